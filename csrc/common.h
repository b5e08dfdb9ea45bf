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

/* Every allocation of the extension goes through tsr_malloc / tsr_calloc /
 * tsr_realloc (and big_zalloc, table.c), so that a test can make the k-th one
 * fail (_native._fail_alloc_after, native.c) and check that each call then
 * raises MemoryError with the index unchanged. Inert unless armed: one
 * relaxed load and a branch never taken. Python objects the extension builds
 * are allocated by CPython and not counted. */
extern long tsr_alloc_countdown;
int tsr_alloc_fault(void);
static inline int tsr_alloc_refused(void) {
    return __builtin_expect(__atomic_load_n(&tsr_alloc_countdown, __ATOMIC_RELAXED) != 0, 0) && tsr_alloc_fault();
}
/* The fuzz build (-DTSR_FUZZ, fuzz/run.py) also counts the live blocks, so a
 * harness can check that an input left none behind (cheaper and more exact
 * than LeakSanitizer beside an embedded interpreter). The normal build: nothing. */
#ifdef TSR_FUZZ
extern long tsr_live_allocs;
#define TSR_COUNT(d) ((void)__atomic_add_fetch(&tsr_live_allocs, (d), __ATOMIC_RELAXED))
#else
#define TSR_COUNT(d) ((void)0)
#endif
static inline void *tsr_counted(void *p) {
    if (p) TSR_COUNT(1);
    return p;
}
static inline void *tsr_malloc(size_t n) { return tsr_alloc_refused() ? NULL : tsr_counted(malloc(n)); }
static inline void *tsr_calloc(size_t n, size_t k) { return tsr_alloc_refused() ? NULL : tsr_counted(calloc(n, k)); }
static inline void *tsr_realloc(void *p, size_t n) {
    if (tsr_alloc_refused()) return NULL;
    void *q = realloc(p, n);
    if (q && !p) TSR_COUNT(1);
    return q;
}
static inline void tsr_free(void *p) {
    if (p) TSR_COUNT(-1);
    free(p);
}

/* The chained content hash of one block: XXH3-64 of its token ids (native
 * u64s) seeded with the parent's hash (hashing.py is the Python twin). */
static inline u64 chain(const u64 *words, size_t n, u64 seed) {
    return XXH3_64bits_withSeed(words, n * sizeof(u64), seed);
}

#endif
