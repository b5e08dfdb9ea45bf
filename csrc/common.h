/*
 * Shared by every file of tokenspeed_router._native: the integer types, the
 * tier and entry flags, the thresholds for releasing the GIL, and the content
 * hash. See native.c for what the extension holds and its threading contract.
 */
#ifndef TSR_COMMON_H
#define TSR_COMMON_H

#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#define XXH_INLINE_ALL
#define XXH_STATIC_LINKING_ONLY
#include "xxhash.h"

typedef uint64_t u64;
typedef uint32_t u32;
typedef uint8_t u8;

/* tier codes (bits), as router/tiers.py defines them */
#define GPU 1
#define CPU 2
#define STORAGE 4
#define ALL_TIERS 7

/* ext/aux meta flags */
#define M_USED 1
#define M_UNM 2     /* content is unmatchable (partial tail, foreign grid, child of one) */
#define M_SIGNED 4  /* external id was a negative int (key = id mod 2**64) */
#define M_BYTES 8   /* external id was bytes (key = XXH3 of them; originals kept in a dict) */

#define RELEASE_GIL_TOKENS 4096 /* queries at least this long hash and walk without the GIL */
#define RELEASE_GIL_BLOCKS 64   /* events with at least this many blocks apply without it */
#ifndef TOK_AHEAD
#define TOK_AHEAD 96 /* list items whose int objects are prefetched ahead of the one read */
#endif

/* The chained content hash of one block: XXH3-64 of its token ids (native
 * u64s) seeded with the parent's hash (hashing.py is the Python twin). */
static inline u64 chain(const u64 *words, size_t n, u64 seed) {
    return XXH3_64bits_withSeed(words, n * sizeof(u64), seed);
}

#endif
