/*
 * The open-addressing hash tables of the index (linear probing, backward-shift
 * deletion, no tombstones, load <= 3/4, capacities powers of two):
 *
 *   Tab    key -> nval value words, as parallel arrays (keys, vals, meta):
 *          a worker's ext and aux tables (17 bytes a slot with nval 1).
 *   GTab   content id -> worker bitmask of W words, as one array of entries
 *          {content, mask[W]}: a lookup touches one cache line.
 *
 * What a lookup, an insert or a deletion runs per block is inline here (the
 * index's hot loops); growing, freeing and the big allocations are in table.c.
 */
#ifndef TSR_TABLE_H
#define TSR_TABLE_H

#include "common.h"

/* Zeroed memory; tables of 2 MiB and more as huge-page mappings (table.c). */
void *big_zalloc(size_t bytes);
void big_free(void *p, size_t bytes);

/* ------------------------------------------------------------------ Tab */

typedef struct {
    u64 *keys;
    u64 *vals; /* cap * nval */
    u8 *meta;  /* 0 = empty */
    size_t cap, len, nval;
    int shift;
} Tab;

void tab_free(Tab *t);
/* Rebuild with capacity `cap` and `nval` value words (new words zeroed); -1: no memory. */
int tab_rehash(Tab *t, size_t cap, size_t nval);

static inline size_t tab_home(const Tab *t, u64 k) {
    return (size_t)((k * 0x9E3779B97F4A7C15ULL) >> t->shift);
}

static inline Py_ssize_t tab_find(const Tab *t, u64 k) {
    if (!t->len) return -1;
    size_t m = t->cap - 1, i = tab_home(t, k);
    for (;;) {
        if (!t->meta[i]) return -1;
        if (t->keys[i] == k) return (Py_ssize_t)i;
        i = (i + 1) & m;
    }
}

/* The slot of key k whose meta bits `mask` equal `tag` (keys that need more
 * than the key to tell them apart, e.g. an id's kind), or -1. */
static inline Py_ssize_t tab_find_tagged(const Tab *t, u64 k, u8 mask, u8 tag) {
    if (!t->len) return -1;
    size_t m = t->cap - 1, i = tab_home(t, k);
    for (;;) {
        u8 mt = t->meta[i];
        if (!mt) return -1;
        if (t->keys[i] == k && (mt & mask) == tag) return (Py_ssize_t)i;
        i = (i + 1) & m;
    }
}

/* slot for a key known to be absent (no growth) */
static inline size_t tab_slot_for(const Tab *t, u64 k) {
    size_t m = t->cap - 1, i = tab_home(t, k);
    while (t->meta[i]) i = (i + 1) & m;
    return i;
}

/* Insert an absent key; returns its slot or -1 on memory exhaustion. Never
 * allocates while (len + 1) / cap <= 3/4 (what tab_reserve ensures). */
static inline Py_ssize_t tab_insert(Tab *t, u64 k, u8 meta) {
    if ((t->len + 1) * 4 > t->cap * 3) {
        if (tab_rehash(t, t->cap ? t->cap * 2 : 8, t->nval) < 0) return -1;
    }
    size_t i = tab_slot_for(t, k);
    t->keys[i] = k;
    t->meta[i] = meta | M_USED;
    memset(t->vals + i * t->nval, 0, t->nval * sizeof(u64));
    t->len++;
    return (Py_ssize_t)i;
}

/* Make room for `extra` more keys without a rehash (so slots stay put while prefetched). */
static inline int tab_reserve(Tab *t, size_t extra) {
    size_t cap = t->cap ? t->cap : 8;
    while ((t->len + extra) * 4 > cap * 3) cap *= 2;
    if (cap == t->cap) return 0;
    return tab_rehash(t, cap, t->nval);
}

static inline void tab_prefetch(const Tab *t, u64 k) {
    if (!t->cap) return;
    size_t i = tab_home(t, k);
    __builtin_prefetch(&t->meta[i]);
    __builtin_prefetch(&t->keys[i]);
    __builtin_prefetch(&t->vals[i * t->nval]);
}

/* Erase slot i. The table keeps its memory (the caller frees an empty one
 * when nothing may need the room back: see index.c). */
static inline void tab_erase_at(Tab *t, size_t i) {
    size_t m = t->cap - 1, j = i;
    for (;;) {
        j = (j + 1) & m;
        if (!t->meta[j]) break;
        size_t h = tab_home(t, t->keys[j]);
        if (((j - h) & m) >= ((j - i) & m)) {
            t->keys[i] = t->keys[j];
            t->meta[i] = t->meta[j];
            memcpy(t->vals + i * t->nval, t->vals + j * t->nval, t->nval * sizeof(u64));
            i = j;
        }
    }
    t->meta[i] = 0;
    t->len--;
}

static inline size_t tab_bytes(const Tab *t) { return t->cap * (sizeof(u64) * (1 + t->nval) + 1); }

/* ------------------------------------------------------------------ GTab */

/* content id -> worker mask, entries of 1 + W words {content, mask[W]} in one
 * array. A slot is empty when its mask is all zero (a held content always has
 * a bit set), so a lookup touches a single cache line. */
typedef struct {
    u64 *e;
    size_t cap, len, W;
    int shift;
} GTab;

void g_free(GTab *t);
/* Rebuild with capacity `cap` and W mask words (new words zeroed); -1: no memory. */
int g_rehash(GTab *t, size_t cap, size_t W);

static inline size_t g_home(const GTab *t, u64 k) { return (size_t)((k * 0x9E3779B97F4A7C15ULL) >> t->shift); }

static inline int g_empty(const u64 *p, size_t W) {
    if (W == 1) return !p[1];
    for (size_t k = 1; k <= W; k++)
        if (p[k]) return 0;
    return 1;
}

static inline Py_ssize_t g_find(const GTab *t, u64 k) {
    if (!t->len) return -1;
    size_t m = t->cap - 1, i = g_home(t, k), st = 1 + t->W;
    for (;;) {
        const u64 *p = t->e + i * st;
        if (g_empty(p, t->W)) return -1;
        if (p[0] == k) return (Py_ssize_t)i;
        i = (i + 1) & m;
    }
}

static inline void g_prefetch(const GTab *t, u64 k) {
    if (t->cap) __builtin_prefetch(t->e + g_home(t, k) * (1 + t->W));
}

static inline int g_reserve(GTab *t, size_t extra) {
    size_t cap = t->cap ? t->cap : 8;
    while ((t->len + extra) * 4 > cap * 3) cap *= 2;
    return cap == t->cap ? 0 : g_rehash(t, cap, t->W);
}

static inline void g_erase_at(GTab *t, size_t i) {
    size_t m = t->cap - 1, j = i, st = 1 + t->W;
    for (;;) {
        j = (j + 1) & m;
        u64 *pj = t->e + j * st;
        if (g_empty(pj, t->W)) break;
        size_t h = g_home(t, pj[0]);
        if (((j - h) & m) >= ((j - i) & m)) {
            memcpy(t->e + i * st, pj, st * sizeof(u64));
            i = j;
        }
    }
    memset(t->e + i * st, 0, st * sizeof(u64));
    t->len--;
}

#endif
