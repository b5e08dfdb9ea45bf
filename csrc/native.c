/*
 * tokenspeed_router._native: the compiled core of the content hash and the KV index.
 *
 * Why C against the CPython API (as msgspec does) and not Cython or Rust: it
 * needs nothing but the machine's C compiler and Python's own headers, so the
 * normal `pip install` / `make` builds it from source with no extra build
 * dependency (Cython would add one, Rust a toolchain) and nothing downloaded.
 * xxHash is vendored as its single header (csrc/xxhash, BSD-2-Clause).
 *
 * What it holds (the semantics are those of tokenspeed_router/router/index_reference.py,
 * the readable pure-Python model; router/index.py drives both the same way):
 *
 *   global table   content id -> bitmask of the workers holding it (W u64 words)
 *   per worker     ext: external id key -> content id + flags (unmatchable, id kind)
 *                  aux: content key -> (refs, tier code), only for the exceptions:
 *                       unmatchable contents, aliases (refs > 1), tiers other than GPU
 *
 * All three are open-addressing tables (linear probing, backward-shift
 * deletion, no tombstones) of parallel arrays: 17 bytes a slot, load <= 3/4.
 *
 * Threading contract (see docs/index.md):
 *   - One writer thread at a time calls the mutating methods (register,
 *     unregister, set_block_size, store, store_hashed, remove, clear, begin,
 *     commit, rollback). Any number of threads may call the readers (match,
 *     match_detail, info, items, workers) concurrently with it.
 *   - A pthread rwlock guards the tables. Every operation holds it only for
 *     its own work (one event, one query): a query never waits behind a whole
 *     batch. Long operations (big events, long queries, snapshots, clears)
 *     release the GIL first and take the lock without it; short ones keep the
 *     GIL (releasing it would cost more than the work and hand the GIL to
 *     another thread for a whole switch interval).
 *   - Deadlock rule: never acquire the GIL while holding the lock. Python
 *     objects are read and built only with the GIL held and outside any
 *     GIL-free section.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <pthread.h>
#include <sys/mman.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#define XXH_INLINE_ALL
#define XXH_STATIC_LINKING_ONLY
#include "xxhash.h"

typedef uint64_t u64;
typedef uint32_t u32;
typedef uint8_t u8;

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

static inline u64 chain(const u64 *words, size_t n, u64 seed) {
    return XXH3_64bits_withSeed(words, n * sizeof(u64), seed);
}

/* ------------------------------------------------------------------ memory */

/* Tables of 2 MiB and more are mapped with transparent huge pages requested:
 * a lookup is a random access, and with 4 KiB pages most of them would also
 * miss the TLB (which also makes prefetches useless). Zeroed like calloc. */
#define HUGE_MIN ((size_t)2 << 20)

static void *big_zalloc(size_t bytes) {
    if (bytes < HUGE_MIN) return calloc(1, bytes ? bytes : 1);
    void *p = mmap(NULL, bytes, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    if (p == MAP_FAILED) return NULL;
#ifdef MADV_HUGEPAGE
    madvise(p, bytes, MADV_HUGEPAGE);
#endif
    return p;
}

static void big_free(void *p, size_t bytes) {
    if (!p) return;
    if (bytes < HUGE_MIN)
        free(p);
    else
        munmap(p, bytes);
}

/* ------------------------------------------------------------------ table */

typedef struct {
    u64 *keys;
    u64 *vals; /* cap * nval */
    u8 *meta;  /* 0 = empty */
    size_t cap, len, nval;
    int shift;
} Tab;

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

static void tab_free(Tab *t) {
    big_free(t->keys, t->cap * sizeof(u64));
    big_free(t->vals, t->cap * t->nval * sizeof(u64));
    big_free(t->meta, t->cap);
    size_t nval = t->nval;
    memset(t, 0, sizeof(*t));
    t->nval = nval;
}

static int tab_alloc(Tab *t, size_t cap) {
    int lg = 0;
    while (((size_t)1 << lg) < cap) lg++;
    cap = (size_t)1 << lg;
    t->keys = big_zalloc(cap * sizeof(u64));
    t->vals = big_zalloc(cap * t->nval * sizeof(u64));
    t->meta = big_zalloc(cap);
    if (!t->keys || !t->vals || !t->meta) {
        big_free(t->keys, cap * sizeof(u64));
        big_free(t->vals, cap * t->nval * sizeof(u64));
        big_free(t->meta, cap);
        t->keys = NULL;
        t->vals = NULL;
        t->meta = NULL;
        return -1;
    }
    t->cap = cap;
    t->len = 0;
    t->shift = 64 - lg;
    return 0;
}

/* slot for a key known to be absent (no growth) */
static inline size_t tab_slot_for(const Tab *t, u64 k) {
    size_t m = t->cap - 1, i = tab_home(t, k);
    while (t->meta[i]) i = (i + 1) & m;
    return i;
}

/* Rebuild with capacity `cap` and `nval` value words (new words zeroed). */
static int tab_rehash(Tab *t, size_t cap, size_t nval) {
    Tab n;
    memset(&n, 0, sizeof(n));
    n.nval = nval;
    if (tab_alloc(&n, cap < 8 ? 8 : cap) < 0) return -1;
    size_t copy = nval < t->nval ? nval : t->nval;
    for (size_t i = 0; i < t->cap; i++) {
        if (!t->meta[i]) continue;
        size_t j = tab_slot_for(&n, t->keys[i]);
        n.keys[j] = t->keys[i];
        n.meta[j] = t->meta[i];
        memcpy(n.vals + j * nval, t->vals + i * t->nval, copy * sizeof(u64));
        n.len++;
    }
    big_free(t->keys, t->cap * sizeof(u64));
    big_free(t->vals, t->cap * t->nval * sizeof(u64));
    big_free(t->meta, t->cap);
    *t = n;
    return 0;
}

/* Insert an absent key; returns its slot or -1 on memory exhaustion. */
static Py_ssize_t tab_insert(Tab *t, u64 k, u8 meta) {
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
static int tab_reserve(Tab *t, size_t extra) {
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

static void tab_erase_at(Tab *t, size_t i) {
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
    if (!t->len) tab_free(t);
}

static size_t tab_bytes(const Tab *t) { return t->cap * (sizeof(u64) * (1 + t->nval) + 1); }

/* ------------------------------------------------------------------ global table */

/* content id -> worker mask, entries of 1 + W words {content, mask[W]} in one
 * array. A slot is empty when its mask is all zero (a held content always has
 * a bit set), so a lookup touches a single cache line. Linear probing,
 * backward-shift deletion, load <= 3/4. */
typedef struct {
    u64 *e;
    size_t cap, len, W;
    int shift;
} GTab;

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

static void g_free(GTab *t) {
    big_free(t->e, t->cap * (1 + t->W) * sizeof(u64));
    t->e = NULL;
    t->cap = t->len = 0;
}

static int g_rehash(GTab *t, size_t cap, size_t W) {
    int lg = 3;
    while (((size_t)1 << lg) < cap) lg++;
    cap = (size_t)1 << lg;
    size_t st = 1 + W, ost = 1 + t->W;
    u64 *e = big_zalloc(cap * st * sizeof(u64));
    if (!e) return -1;
    size_t m = cap - 1, copy = W < t->W ? W : t->W;
    for (size_t i = 0; i < t->cap; i++) {
        const u64 *p = t->e + i * ost;
        if (g_empty(p, t->W)) continue;
        size_t j = (size_t)((p[0] * 0x9E3779B97F4A7C15ULL) >> (64 - lg));
        while (!g_empty(e + j * st, W)) j = (j + 1) & m;
        e[j * st] = p[0];
        memcpy(e + j * st + 1, p + 1, copy * sizeof(u64));
    }
    big_free(t->e, t->cap * ost * sizeof(u64));
    t->e = e;
    t->cap = cap;
    t->W = W;
    t->shift = 64 - lg;
    return 0;
}

static int g_reserve(GTab *t, size_t extra) {
    size_t cap = t->cap ? t->cap : 8;
    while ((t->len + extra) * 4 > cap * 3) cap *= 2;
    return cap == t->cap ? 0 : g_rehash(t, cap, t->W);
}

static void g_erase_at(GTab *t, size_t i) {
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

/* ------------------------------------------------------------------ core */

typedef struct {
    int used;
    PyObject *name;      /* str */
    long block_size;     /* 0: none yet */
    Tab ext;             /* nval 1: content */
    Tab aux;             /* nval 1: refs << 8 | tiers */
    size_t n_matchable;  /* ext entries with a matchable content */
    size_t n_aux_tier;   /* aux entries whose tiers are not GPU alone */
    PyObject *bytes_ids; /* key -> original bytes id (pruned lazily) */
} Worker;

enum { U_EXT_INS, U_EXT_DEL, U_AUX, U_HOLD_SET, U_HOLD_CLR };

typedef struct {
    u8 op, meta;
    int slot;
    u64 key, val;
} Undo;

typedef struct {
    PyObject_HEAD
    pthread_rwlock_t lock;
    Worker *w;
    int nslots;
    int *order; /* registration order of used slots */
    int norder;
    PyObject *slot_of; /* name -> int slot */
    GTab glob;
    u64 version;
    Undo *log;
    size_t nlog, caplog;
    int logging;
    int oom;
} Core;

#define W_OF(c) ((c)->glob.W)

static inline void wlock(Core *c) { pthread_rwlock_wrlock(&c->lock); }
static inline void rlock(Core *c) { pthread_rwlock_rdlock(&c->lock); }
static inline void unlock(Core *c) { pthread_rwlock_unlock(&c->lock); }

static void log_push(Core *c, u8 op, int slot, u64 key, u64 val, u8 meta) {
    if (!c->logging) return;
    if (c->nlog == c->caplog) {
        size_t cap = c->caplog ? c->caplog * 2 : 256;
        Undo *n = realloc(c->log, cap * sizeof(Undo));
        if (!n) {
            c->oom = 1;
            return;
        }
        c->log = n;
        c->caplog = cap;
    }
    Undo *u = &c->log[c->nlog++];
    u->op = op;
    u->slot = slot;
    u->key = key;
    u->val = val;
    u->meta = meta;
}

/* ---- holders */

/* Set slot s's bit on content (one probe); 1 if it was not set. */
static int hold_add(Core *c, int s, u64 content) {
    GTab *t = &c->glob;
    if (g_reserve(t, 1) < 0) {
        c->oom = 1;
        return 0;
    }
    size_t W = t->W, st = 1 + W, m = t->cap - 1, i = g_home(t, content);
    u64 *p;
    for (;;) {
        p = t->e + i * st;
        if (g_empty(p, W)) {
            p[0] = content;
            t->len++;
            break;
        }
        if (p[0] == content) break;
        i = (i + 1) & m;
    }
    u64 bit = (u64)1 << (s & 63);
    if (p[1 + (s >> 6)] & bit) return 0;
    p[1 + (s >> 6)] |= bit;
    log_push(c, U_HOLD_SET, s, content, 0, 0);
    return 1;
}

static void hold_set(Core *c, int s, u64 content) { hold_add(c, s, content); }

static void hold_clr(Core *c, int s, u64 content) {
    GTab *t = &c->glob;
    Py_ssize_t i = g_find(t, content);
    if (i < 0) return;
    u64 *p = t->e + (size_t)i * (1 + t->W);
    u64 bit = (u64)1 << (s & 63);
    if (!(p[1 + (s >> 6)] & bit)) return;
    p[1 + (s >> 6)] &= ~bit;
    log_push(c, U_HOLD_CLR, s, content, 0, 0);
    if (g_empty(p, t->W)) g_erase_at(t, (size_t)i);
}

/* ---- ext entries */

static int ext_put(Core *c, int s, u64 key, u64 content, u8 meta) {
    Worker *w = &c->w[s];
    Py_ssize_t i = tab_insert(&w->ext, key, meta);
    if (i < 0) {
        c->oom = 1;
        return -1;
    }
    w->ext.vals[i] = content;
    if (!(meta & M_UNM)) w->n_matchable++;
    log_push(c, U_EXT_INS, s, key, 0, 0);
    return 0;
}

static void ext_del_at(Core *c, int s, size_t i) {
    Worker *w = &c->w[s];
    u8 meta = w->ext.meta[i];
    log_push(c, U_EXT_DEL, s, w->ext.keys[i], w->ext.vals[i], meta);
    if (!(meta & M_UNM)) w->n_matchable--;
    tab_erase_at(&w->ext, i);
}

/* ---- aux entries: content key -> refs, tiers (default: 1, GPU) */

static inline u64 ckey_of(u64 content, int unm) { return unm ? ~content : content; }

static inline void aux_get(const Worker *w, u64 ckey, u32 *refs, u8 *tiers) {
    Py_ssize_t i = tab_find(&w->aux, ckey);
    if (i < 0) {
        *refs = 1;
        *tiers = GPU;
    } else {
        *refs = (u32)(w->aux.vals[i] >> 8);
        *tiers = (u8)(w->aux.vals[i] & 0xff);
    }
}

/* refs == 0 deletes; a matchable content with refs 1 on GPU alone needs no entry */
static void aux_put(Core *c, int s, u64 ckey, u32 refs, u8 tiers, int unm) {
    Worker *w = &c->w[s];
    Py_ssize_t i = tab_find(&w->aux, ckey);
    if (i >= 0) {
        log_push(c, U_AUX, s, ckey, w->aux.vals[i], w->aux.meta[i]);
        if ((w->aux.vals[i] & 0xff) != GPU) w->n_aux_tier--;
    } else {
        log_push(c, U_AUX, s, ckey, 0, 0);
    }
    int keep = refs > 0 && (unm || refs > 1 || tiers != GPU);
    if (!keep) {
        if (i >= 0) tab_erase_at(&w->aux, (size_t)i);
        return;
    }
    if (i < 0) {
        i = tab_insert(&w->aux, ckey, unm ? M_UNM : 0);
        if (i < 0) {
            c->oom = 1;
            return;
        }
    }
    w->aux.vals[i] = ((u64)refs << 8) | tiers;
    if (tiers != GPU) w->n_aux_tier++;
}

static inline int aux_has(const Worker *w, u64 ckey) { return tab_find(&w->aux, ckey) >= 0; }

/* ---- block semantics */

/* Record that slot s holds content as external key on tier `code`: 1 new, 0 duplicate. */
static int hold_block(Core *c, int s, u64 key, u8 kind, u64 content, int unm, u8 code) {
    Worker *w = &c->w[s];
    Tab *t = &w->ext;
    u32 refs;
    u8 cur;
    if (t->cap && (t->len + 1) * 4 <= t->cap * 3) {
        /* one probe: either the key's slot or the empty slot it goes to */
        size_t m = t->cap - 1, j = tab_home(t, key);
        while (t->meta[j] && t->keys[j] != key) j = (j + 1) & m;
        if (!t->meta[j]) {
            t->keys[j] = key;
            t->meta[j] = kind | (unm ? M_UNM : 0) | M_USED;
            t->vals[j] = content;
            t->len++;
            if (!unm) w->n_matchable++;
            log_push(c, U_EXT_INS, s, key, 0, 0);
            goto fresh_ext;
        }
    }
    Py_ssize_t i = tab_find(&w->ext, key);
    if (i >= 0) {
        int punm = (w->ext.meta[i] & M_UNM) != 0;
        u64 ck = ckey_of(w->ext.vals[i], punm);
        aux_get(w, ck, &refs, &cur);
        if ((cur | code) != cur) aux_put(c, s, ck, refs, cur | code, punm);
        return 0;
    }
    if (ext_put(c, s, key, content, kind | (unm ? M_UNM : 0)) < 0) return 0;
fresh_ext:;
    u64 ck = ckey_of(content, unm);
    int fresh;
    if (!unm) {
        fresh = hold_add(c, s, content);
    } else {
        fresh = !aux_has(w, ck);
    }
    if (fresh) {
        if (unm || code != GPU) aux_put(c, s, ck, 1, code, unm);
    } else {
        aux_get(w, ck, &refs, &cur);
        aux_put(c, s, ck, refs + 1, cur | code, unm);
    }
    return 1;
}

/* Remove tier `code` of external key: 1 gone, 0 still held (or mismatch: *mismatch=1), -1 unknown. */
static int drop_block(Core *c, int s, u64 key, u8 code, int unspecified, int *mismatch) {
    Worker *w = &c->w[s];
    Py_ssize_t i = tab_find(&w->ext, key);
    if (i < 0) return -1;
    u64 content = w->ext.vals[i];
    int unm = (w->ext.meta[i] & M_UNM) != 0;
    u64 ck = ckey_of(content, unm);
    u32 refs;
    u8 cur;
    aux_get(w, ck, &refs, &cur);
    if (refs > 1) {
        ext_del_at(c, s, (size_t)i);
        aux_put(c, s, ck, refs - 1, cur, unm);
        return 1;
    }
    u8 rm = code;
    if (unspecified && !(cur & GPU)) rm = ALL_TIERS;
    u8 left = cur & (u8)~rm;
    if (left == cur) {
        *mismatch = 1;
        return 0;
    }
    if (left) {
        aux_put(c, s, ck, 1, left, unm);
        return 0;
    }
    ext_del_at(c, s, (size_t)i);
    aux_put(c, s, ck, 0, 0, unm);
    if (!unm) hold_clr(c, s, content);
    return 1;
}

static size_t clear_blocks(Core *c, int s, u8 code) {
    Worker *w = &c->w[s];
    size_t gone = 0;
    if (code == ALL_TIERS && !c->logging) {
        for (size_t i = 0; i < w->ext.cap; i++)
            if (w->ext.meta[i] && !(w->ext.meta[i] & M_UNM)) hold_clr(c, s, w->ext.vals[i]);
        gone = w->ext.len;
        tab_free(&w->ext);
        tab_free(&w->aux);
        w->n_matchable = 0;
        w->n_aux_tier = 0;
        return gone;
    }
    size_t n = w->ext.len;
    if (!n) return 0;
    u64 *keys = malloc(n * sizeof(u64));
    if (!keys) {
        c->oom = 1;
        return 0;
    }
    size_t k = 0;
    for (size_t i = 0; i < w->ext.cap; i++)
        if (w->ext.meta[i]) keys[k++] = w->ext.keys[i];
    for (size_t j = 0; j < k; j++) {
        Py_ssize_t i = tab_find(&w->ext, keys[j]);
        if (i < 0) continue;
        int unm = (w->ext.meta[i] & M_UNM) != 0;
        u64 ck = ckey_of(w->ext.vals[i], unm);
        u32 refs;
        u8 cur;
        aux_get(w, ck, &refs, &cur);
        if (!(cur & code)) continue;
        u8 left = cur & (u8)~code;
        if (left) {
            aux_put(c, s, ck, refs, left, unm);
        } else {
            int mm = 0;
            int r = drop_block(c, s, keys[j], code, 0, &mm);
            if (r > 0) gone += (size_t)r;
        }
    }
    free(keys);
    return gone;
}

static void undo_all(Core *c) {
    int was = c->logging;
    c->logging = 0;
    while (c->nlog) {
        Undo *u = &c->log[--c->nlog];
        Worker *w = &c->w[u->slot];
        Py_ssize_t i;
        switch (u->op) {
        case U_EXT_INS:
            i = tab_find(&w->ext, u->key);
            if (i >= 0) ext_del_at(c, u->slot, (size_t)i);
            break;
        case U_EXT_DEL:
            ext_put(c, u->slot, u->key, u->val, u->meta & (u8)~M_USED);
            break;
        case U_AUX:
            i = tab_find(&w->aux, u->key);
            if (i >= 0) {
                if ((w->aux.vals[i] & 0xff) != GPU) w->n_aux_tier--;
                tab_erase_at(&w->aux, (size_t)i);
            }
            if (u->meta) {
                i = tab_insert(&w->aux, u->key, u->meta & (u8)~M_USED);
                if (i < 0) {
                    c->oom = 1;
                    break;
                }
                w->aux.vals[i] = u->val;
                if ((u->val & 0xff) != GPU) w->n_aux_tier++;
            }
            break;
        case U_HOLD_SET:
            hold_clr(c, u->slot, u->key);
            break;
        case U_HOLD_CLR:
            hold_set(c, u->slot, u->key);
            break;
        }
    }
    c->logging = was;
}

/* ------------------------------------------------------------------ conversions */

/* A non-negative int that fits one machine word, read without the generic
 * conversion (the common token id; ~3x faster on a 32k-token list). */
static inline int small_int(PyObject *it, u64 *v) {
#if PY_VERSION_HEX >= 0x030C0000
    if (PyUnstable_Long_IsCompact((PyLongObject *)it)) {
        Py_ssize_t x = PyUnstable_Long_CompactValue((PyLongObject *)it);
        if (x >= 0) {
            *v = (u64)x;
            return 1;
        }
    }
    return 0;
#else
    Py_ssize_t size = Py_SIZE(it);
    if (size == 0) {
        *v = 0;
        return 1;
    }
    if (size == 1) {
        *v = ((PyLongObject *)it)->ob_digit[0];
        return 1;
    }
    return 0;
#endif
}

/* Token ids -> a u64 array. strict: reject negatives / too large (queries);
 * otherwise wrap them modulo 2**64 (events: ingestion must not half-apply).
 * Returns a malloc'd array (or NULL with an exception set). */
static u64 *tokens_from(PyObject *obj, Py_ssize_t *n_out, int strict) {
    if (PyBytes_Check(obj) || PyByteArray_Check(obj) || PyUnicode_Check(obj)) {
        PyErr_SetString(PyExc_TypeError, "token_ids must be a sequence of ints, not bytes or str");
        return NULL;
    }
    if (!PyList_Check(obj) && !PyTuple_Check(obj) && PyObject_CheckBuffer(obj)) {
        Py_buffer view;
        if (PyObject_GetBuffer(obj, &view, PyBUF_FORMAT | PyBUF_ND) == 0) {
            const char *f = view.format ? view.format : "B";
            if (*f == '<' || *f == '=' || *f == '@') f++;
            char fc = f[0];
            int ok = f[0] && !f[1] && view.ndim == 1 && strchr("bBhHiIlLqQnN", fc) && PyBuffer_IsContiguous(&view, 'C');
            if (ok) {
                Py_ssize_t n = view.shape ? view.shape[0] : view.len / view.itemsize;
                u64 *out = malloc((size_t)(n ? n : 1) * sizeof(u64));
                if (!out) {
                    PyBuffer_Release(&view);
                    PyErr_NoMemory();
                    return NULL;
                }
                int isz = (int)view.itemsize;
                int sgn = strchr("bhilqn", fc) != NULL;
                const char *p = view.buf;
                int bad = 0;
                if (isz == 8 && !sgn) {
                    memcpy(out, p, (size_t)n * 8);
                } else {
                    for (Py_ssize_t i = 0; i < n; i++) {
                        int64_t v;
                        u64 uv;
                        switch (isz) {
                        case 1: v = sgn ? (int64_t)((const int8_t *)p)[i] : (int64_t)((const u8 *)p)[i]; break;
                        case 2: v = sgn ? (int64_t)((const int16_t *)p)[i] : (int64_t)((const uint16_t *)p)[i]; break;
                        case 4: v = sgn ? (int64_t)((const int32_t *)p)[i] : (int64_t)((const u32 *)p)[i]; break;
                        default:
                            memcpy(&uv, p + i * 8, 8);
                            v = (int64_t)uv;
                        }
                        if (sgn && v < 0) {
                            if (strict) {
                                bad = 1;
                                break;
                            }
                        }
                        out[i] = (u64)v;
                    }
                }
                PyBuffer_Release(&view);
                if (bad) {
                    free(out);
                    PyErr_SetString(PyExc_OverflowError, "token ids must be non-negative");
                    return NULL;
                }
                *n_out = n;
                return out;
            }
            int is_float = strchr("efdg", fc) != NULL || fc == '?';
            PyBuffer_Release(&view);
            if (is_float) {
                PyErr_Format(PyExc_TypeError, "token_ids must be integers, got buffer format %s", view.format ? view.format : "?");
                return NULL;
            }
        } else {
            PyErr_Clear();
        }
    }
    PyObject *seq = PySequence_Fast(obj, "token_ids must be a sequence of ints");
    if (!seq) return NULL;
    Py_ssize_t n = PySequence_Fast_GET_SIZE(seq);
    PyObject **items = PySequence_Fast_ITEMS(seq);
    u64 *out = malloc((size_t)(n ? n : 1) * sizeof(u64));
    if (!out) {
        Py_DECREF(seq);
        PyErr_NoMemory();
        return NULL;
    }
    for (Py_ssize_t i = 0; i < n; i++) {
        PyObject *it = items[i];
        u64 v;
        if (i + TOK_AHEAD < n) __builtin_prefetch(items[i + TOK_AHEAD]);
        if (PyLong_CheckExact(it) && small_int(it, &v)) {
            out[i] = v;
            continue;
        }
        if (PyLong_Check(it)) {
            v = strict ? PyLong_AsUnsignedLongLong(it) : PyLong_AsUnsignedLongLongMask(it);
        } else {
            PyObject *ix = PyNumber_Index(it);
            if (!ix) goto fail;
            v = strict ? PyLong_AsUnsignedLongLong(ix) : PyLong_AsUnsignedLongLongMask(ix);
            Py_DECREF(ix);
        }
        if (v == (u64)-1 && PyErr_Occurred()) goto fail;
        out[i] = v;
    }
    Py_DECREF(seq);
    *n_out = n;
    return out;
fail:
    free(out);
    Py_DECREF(seq);
    return NULL;
}

/* One token id (strict: refuse negatives and ids >= 2**64). */
static inline int conv_item(PyObject *it, int strict, u64 *out) {
    u64 v;
    if (PyLong_CheckExact(it) && small_int(it, &v)) {
        *out = v;
        return 0;
    }
    if (PyLong_Check(it)) {
        v = strict ? PyLong_AsUnsignedLongLong(it) : PyLong_AsUnsignedLongLongMask(it);
    } else {
        PyObject *ix = PyNumber_Index(it);
        if (!ix) return -1;
        v = strict ? PyLong_AsUnsignedLongLong(ix) : PyLong_AsUnsignedLongLongMask(ix);
        Py_DECREF(ix);
    }
    if (v == (u64)-1 && PyErr_Occurred()) return -1;
    *out = v;
    return 0;
}

/* A query's tokens: a buffer converted at once, or a list/tuple converted
 * lazily (with the GIL held) as far as the walk gets: a prompt that stops
 * matching after 32 blocks costs 32 blocks of conversion, not 32k tokens. */
typedef struct {
    u64 *buf;
    Py_ssize_t ntok, nconv;
    PyObject *seq;     /* list/tuple being converted lazily, or NULL */
    int err;           /* a conversion failed: exception set */
    int slow;          /* an item is not an int: convert it all first, outside the lock */
} Toks;

static int toks_open(PyObject *obj, Toks *t) {
    memset(t, 0, sizeof(*t));
    if (PyList_CheckExact(obj) || PyTuple_CheckExact(obj)) {
        t->ntok = PySequence_Fast_GET_SIZE(obj);
        t->buf = malloc((size_t)(t->ntok ? t->ntok : 1) * sizeof(u64));
        if (!t->buf) {
            PyErr_NoMemory();
            return -1;
        }
        Py_INCREF(obj);
        t->seq = obj;
        return 0;
    }
    t->buf = tokens_from(obj, &t->ntok, 1);
    if (!t->buf) return -1;
    t->nconv = t->ntok;
    return 0;
}

static void toks_close(Toks *t) {
    free(t->buf);
    Py_CLEAR(t->seq);
}

static inline int toks_need(Toks *t, Py_ssize_t upto) {
    if (upto <= t->nconv) return 1;
    if (t->err) return 0;
    Py_ssize_t want = upto < t->nconv + 256 ? t->nconv + 256 : upto;
    if (want > t->ntok) want = t->ntok;
    PyObject **items = PySequence_Fast_ITEMS(t->seq);
    for (Py_ssize_t i = t->nconv; i < want; i++) {
        if (i + TOK_AHEAD < want) __builtin_prefetch(items[i + TOK_AHEAD]); /* int objects live all over the heap */
        /* Under the index lock no Python code may run (an __index__ could wait
         * for the GIL held by a writer waiting for this lock): ints only here. */
        if (!PyLong_Check(items[i])) {
            t->slow = 1;
            return 0;
        }
        if (conv_item(items[i], 1, &t->buf[i]) < 0) {
            t->err = 1;
            return 0;
        }
    }
    t->nconv = want;
    return 1;
}

static inline int long_sign(PyObject *o) {
#if PY_VERSION_HEX >= 0x030E0000
    int sign = 0;
    PyLong_GetSign(o, &sign);
    return sign;
#else
    return _PyLong_Sign(o);
#endif
}

/* An exact int in [-2**63, 2**64) read from its digits, without the generic
 * conversion calls (block hashes are 64-bit: 3 digits, never "compact").
 * 0: not handled here (other versions, subclasses, out of range): use the API. */
static inline int fast_ext_int(PyObject *o, u64 *key, u8 *kind) {
#if PyLong_SHIFT == 30 && PY_VERSION_HEX < 0x030E0000
    if (!PyLong_CheckExact(o)) return 0;
#if PY_VERSION_HEX < 0x030C0000
    Py_ssize_t size = Py_SIZE(o);
    const digit *d = ((PyLongObject *)o)->ob_digit;
    int neg = size < 0;
    Py_ssize_t nd = neg ? -size : size;
#else
    uintptr_t tag = ((PyLongObject *)o)->long_value.lv_tag;
    const digit *d = ((PyLongObject *)o)->long_value.ob_digit;
    int neg = (tag & 3) == 2;
    Py_ssize_t nd = (Py_ssize_t)(tag >> 3);
#endif
    u64 mag;
    switch (nd) {
    case 0: mag = 0; break;
    case 1: mag = d[0]; break;
    case 2: mag = (u64)d[0] | ((u64)d[1] << 30); break;
    case 3:
        if (d[2] >= 16) return 0;
        mag = (u64)d[0] | ((u64)d[1] << 30) | ((u64)d[2] << 60);
        break;
    default: return 0;
    }
    if (!neg) {
        *key = mag;
        *kind = 0;
        return 1;
    }
    if (mag > ((u64)1 << 63)) return 0;
    *key = (u64)0 - mag; /* two's complement, as PyLong_AsLongLong gives it */
    *kind = M_SIGNED;
    return 1;
#else
    (void)o; (void)key; (void)kind;
    return 0;
#endif
}

/* External id (u64 int, negative int, or bytes) -> table key + kind flag. */
static int ext_key(PyObject *o, u64 *key, u8 *kind) {
    if (fast_ext_int(o, key, kind)) return 0;
    if (PyLong_Check(o)) {
        if (long_sign(o) >= 0) { /* the common case: one conversion */
            u64 v = PyLong_AsUnsignedLongLong(o);
            if (v == (u64)-1 && PyErr_Occurred()) {
                PyErr_SetString(PyExc_ValueError, "block hash out of the 64-bit range");
                return -1;
            }
            *key = v;
            *kind = 0;
            return 0;
        }
        int overflow = 0;
        long long sv = PyLong_AsLongLongAndOverflow(o, &overflow);
        if (overflow == 0) {
            if (sv == -1 && PyErr_Occurred()) return -1;
            *key = (u64)sv;
            *kind = sv < 0 ? M_SIGNED : 0;
            return 0;
        }
        if (overflow > 0) {
            u64 v = PyLong_AsUnsignedLongLong(o);
            if (v == (u64)-1 && PyErr_Occurred()) {
                PyErr_SetString(PyExc_ValueError, "block hash out of the 64-bit range");
                return -1;
            }
            *key = v;
            *kind = 0;
            return 0;
        }
        PyErr_SetString(PyExc_ValueError, "block hash out of the 64-bit range");
        return -1;
    }
    if (PyBytes_Check(o)) {
        *key = XXH3_64bits_withSeed(PyBytes_AS_STRING(o), (size_t)PyBytes_GET_SIZE(o), 0x7473726f75746572ULL);
        *kind = M_BYTES;
        return 0;
    }
    PyErr_Format(PyExc_TypeError, "block hash must be int or bytes, got %.80s", Py_TYPE(o)->tp_name);
    return -1;
}

static PyObject *ext_obj(Worker *w, u64 key, u8 meta) {
    if (meta & M_BYTES) {
        PyObject *k = PyLong_FromUnsignedLongLong(key);
        if (!k) return NULL;
        PyObject *b = w->bytes_ids ? PyDict_GetItemWithError(w->bytes_ids, k) : NULL;
        Py_DECREF(k);
        if (!b) {
            if (!PyErr_Occurred()) PyErr_SetString(PyExc_RuntimeError, "bytes block id lost");
            return NULL;
        }
        Py_INCREF(b);
        return b;
    }
    if (meta & M_SIGNED) return PyLong_FromLongLong((long long)key);
    return PyLong_FromUnsignedLongLong(key);
}

/* Convert a list of external ids; records bytes originals in the worker's dict. */
static int ext_keys_from(Core *c, int s, PyObject *ids, u64 **keys_out, u8 **kinds_out, Py_ssize_t *n_out) {
    PyObject *seq = PySequence_Fast(ids, "block_hashes must be a sequence");
    if (!seq) return -1;
    Py_ssize_t n = PySequence_Fast_GET_SIZE(seq);
    PyObject **items = PySequence_Fast_ITEMS(seq);
    u64 *keys = malloc((size_t)(n ? n : 1) * sizeof(u64));
    u8 *kinds = malloc((size_t)(n ? n : 1));
    if (!keys || !kinds) {
        free(keys);
        free(kinds);
        Py_DECREF(seq);
        PyErr_NoMemory();
        return -1;
    }
    for (Py_ssize_t i = 0; i < n; i++) {
        if (ext_key(items[i], &keys[i], &kinds[i]) < 0) goto fail;
        if (kinds[i] & M_BYTES && s >= 0) {
            Worker *w = &c->w[s];
            if (!w->bytes_ids && !(w->bytes_ids = PyDict_New())) goto fail;
            PyObject *k = PyLong_FromUnsignedLongLong(keys[i]);
            if (!k) goto fail;
            int r = PyDict_SetItem(w->bytes_ids, k, items[i]);
            Py_DECREF(k);
            if (r < 0) goto fail;
        }
    }
    Py_DECREF(seq);
    *keys_out = keys;
    *kinds_out = kinds;
    *n_out = n;
    return 0;
fail:
    free(keys);
    free(kinds);
    Py_DECREF(seq);
    return -1;
}

/* ------------------------------------------------------------------ Core type */

static int slot_lookup(Core *c, PyObject *name) {
    PyObject *v = PyDict_GetItemWithError(c->slot_of, name);
    if (!v) {
        if (!PyErr_Occurred()) PyErr_SetObject(PyExc_KeyError, name);
        return -1;
    }
    return (int)PyLong_AsLong(v);
}

static PyObject *Core_new(PyTypeObject *type, PyObject *args, PyObject *kw) {
    Core *c = (Core *)type->tp_alloc(type, 0);
    if (!c) return NULL;
    pthread_rwlockattr_t attr;
    pthread_rwlockattr_init(&attr);
#ifdef __GLIBC__
    /* a steady stream of long (GIL-free) queries must not starve the writer */
    pthread_rwlockattr_setkind_np(&attr, PTHREAD_RWLOCK_PREFER_WRITER_NONRECURSIVE_NP);
#endif
    pthread_rwlock_init(&c->lock, &attr);
    pthread_rwlockattr_destroy(&attr);
    c->slot_of = PyDict_New();
    c->glob.W = 1;
    if (!c->slot_of) {
        Py_DECREF(c);
        return NULL;
    }
    return (PyObject *)c;
}

static void worker_free(Worker *w) {
    tab_free(&w->ext);
    tab_free(&w->aux);
    Py_CLEAR(w->name);
    Py_CLEAR(w->bytes_ids);
}

static void Core_dealloc(Core *c) {
    for (int s = 0; s < c->nslots; s++) worker_free(&c->w[s]);
    free(c->w);
    free(c->order);
    g_free(&c->glob);
    free(c->log);
    Py_XDECREF(c->slot_of);
    pthread_rwlock_destroy(&c->lock);
    Py_TYPE(c)->tp_free((PyObject *)c);
}

static PyObject *Core_register(Core *c, PyObject *name) {
    if (!PyUnicode_Check(name)) {
        PyErr_SetString(PyExc_TypeError, "worker name must be str");
        return NULL;
    }
    if (PyDict_Contains(c->slot_of, name)) Py_RETURN_NONE;
    int s = 0;
    while (s < c->nslots && c->w[s].used) s++;
    wlock(c);
    if (s == c->nslots) {
        Worker *nw = realloc(c->w, (size_t)(s + 1) * sizeof(Worker));
        int *no = realloc(c->order, (size_t)(s + 1) * sizeof(int));
        if (nw) c->w = nw;
        if (no) c->order = no;
        if (!nw || !no) {
            unlock(c);
            return PyErr_NoMemory();
        }
        memset(&c->w[s], 0, sizeof(Worker));
        c->w[s].ext.nval = 1;
        c->w[s].aux.nval = 1;
        c->nslots++;
    }
    if ((size_t)s >= 64 * W_OF(c)) {
        if (g_rehash(&c->glob, c->glob.cap, W_OF(c) + 1) < 0) {
            unlock(c);
            return PyErr_NoMemory();
        }
    }
    Worker *w = &c->w[s];
    w->used = 1;
    Py_INCREF(name);
    w->name = name;
    w->block_size = 0;
    c->order[c->norder++] = s;
    c->version++;
    unlock(c);
    PyObject *v = PyLong_FromLong(s);
    if (!v || PyDict_SetItem(c->slot_of, name, v) < 0) {
        Py_XDECREF(v);
        return NULL;
    }
    Py_DECREF(v);
    Py_RETURN_NONE;
}

static PyObject *Core_unregister(Core *c, PyObject *name) {
    int s = slot_lookup(c, name);
    if (s < 0) return NULL;
    Py_BEGIN_ALLOW_THREADS
    wlock(c);
    int was = c->logging;
    c->logging = 0;
    clear_blocks(c, s, ALL_TIERS);
    c->logging = was;
    int k = 0;
    for (int i = 0; i < c->norder; i++)
        if (c->order[i] != s) c->order[k++] = c->order[i];
    c->norder = k;
    c->w[s].used = 0;
    c->version++;
    unlock(c);
    Py_END_ALLOW_THREADS
    worker_free(&c->w[s]);
    c->w[s].ext.nval = 1;
    c->w[s].aux.nval = 1;
    if (PyDict_DelItem(c->slot_of, name) < 0) return NULL;
    Py_RETURN_NONE;
}

static PyObject *Core_workers(Core *c, PyObject *unused) {
    PyObject *out = PyList_New(c->norder);
    if (!out) return NULL;
    for (int i = 0; i < c->norder; i++) {
        PyObject *n = c->w[c->order[i]].name;
        Py_INCREF(n);
        PyList_SET_ITEM(out, i, n);
    }
    return out;
}

static PyObject *Core_set_block_size(Core *c, PyObject *args) {
    PyObject *name, *bs;
    if (!PyArg_ParseTuple(args, "OO", &name, &bs)) return NULL;
    int s = slot_lookup(c, name);
    if (s < 0) return NULL;
    long v = bs == Py_None ? 0 : PyLong_AsLong(bs);
    if (v == -1 && PyErr_Occurred()) return NULL;
    wlock(c);
    c->w[s].block_size = v;
    unlock(c);
    Py_RETURN_NONE;
}

/* store(name, ext_ids, parent, root, tokens, block_size, nfull, tier, unmatchable)
 *   -> (new, duplicate) or None when the parent is unknown (nothing changed). */
static PyObject *Core_store(Core *c, PyObject *args) {
    PyObject *name, *ids, *parent, *tokens;
    unsigned long long root;
    long bs;
    Py_ssize_t nfull;
    int tier, unm;
    if (!PyArg_ParseTuple(args, "OOOKOlnip", &name, &ids, &parent, &root, &tokens, &bs, &nfull, &tier, &unm))
        return NULL;
    int s = slot_lookup(c, name);
    if (s < 0) return NULL;
    u64 pkey = 0;
    u8 pkind = 0;
    if (parent != Py_None && ext_key(parent, &pkey, &pkind) < 0) return NULL;
    Py_ssize_t ntok;
    u64 *toks = tokens_from(tokens, &ntok, 0);
    if (!toks) return NULL;
    u64 *keys;
    u8 *kinds;
    Py_ssize_t n;
    if (ext_keys_from(c, s, ids, &keys, &kinds, &n) < 0) {
        free(toks);
        return NULL;
    }
    if (bs <= 0 || nfull < 0 || nfull > n || nfull * bs > ntok || n - nfull > 1) {
        free(toks);
        free(keys);
        free(kinds);
        PyErr_SetString(PyExc_ValueError, "inconsistent store arguments");
        return NULL;
    }
    long added = 0, dup = 0;
    int unknown = 0;
    PyThreadState *ts = NULL;
    if (n >= RELEASE_GIL_BLOCKS) ts = PyEval_SaveThread();
    wlock(c);
    u64 h = root;
    if (parent != Py_None) {
        Worker *w = &c->w[s];
        Py_ssize_t i = tab_find(&w->ext, pkey);
        if (i < 0) {
            unknown = 1;
        } else {
            h = w->ext.vals[i];
            if (w->ext.meta[i] & M_UNM) unm = 1;
        }
    }
    if (!unknown) {
        /* Hash every block first, prefetching the table slots each will touch,
         * then insert: the inserts' cache misses overlap instead of queueing. */
        Worker *w = &c->w[s];
        if (tab_reserve(&w->ext, (size_t)n) < 0 || g_reserve(&c->glob, (size_t)n) < 0) c->oom = 1;
        enum { D = 12 };
        for (Py_ssize_t i = 0; i < n + D && !c->oom; i++) {
            if (i < n) {
                if (i < nfull)
                    h = chain(toks + i * bs, (size_t)bs, h);
                else
                    h = chain(toks + nfull * bs, (size_t)(ntok - nfull * bs), h);
                toks[i] = h; /* block i's tokens are consumed: reuse the buffer for its hash */
                tab_prefetch(&w->ext, keys[i]);
                g_prefetch(&c->glob, h);
            }
            Py_ssize_t k = i - D;
            if (k < 0) continue;
            int r = hold_block(c, s, keys[k], kinds[k], toks[k], unm || k >= nfull, (u8)tier);
            added += r;
            dup += 1 - r;
        }
    }
    unlock(c);
    if (ts) PyEval_RestoreThread(ts);
    free(toks);
    free(keys);
    free(kinds);
    if (c->oom) {
        c->oom = 0;
        return PyErr_NoMemory();
    }
    if (unknown) Py_RETURN_NONE;
    return Py_BuildValue("ll", added, dup);
}

/* store_hashed(name, ext_ids, parent, contents, unmatchable_flags (bytes or None), tier)
 *   -> (new, duplicate) or None when the parent is unknown. */
static PyObject *Core_store_hashed(Core *c, PyObject *args) {
    PyObject *name, *ids, *parent, *contents, *flags;
    int tier;
    if (!PyArg_ParseTuple(args, "OOOOOi", &name, &ids, &parent, &contents, &flags, &tier)) return NULL;
    int s = slot_lookup(c, name);
    if (s < 0) return NULL;
    u64 pkey = 0;
    u8 pkind = 0;
    if (parent != Py_None && ext_key(parent, &pkey, &pkind) < 0) return NULL;
    Py_ssize_t nc;
    u64 *cs = tokens_from(contents, &nc, 1);
    if (!cs) return NULL;
    u64 *keys;
    u8 *kinds;
    Py_ssize_t n;
    if (ext_keys_from(c, s, ids, &keys, &kinds, &n) < 0) {
        free(cs);
        return NULL;
    }
    const char *fl = NULL;
    if (flags != Py_None) {
        if (!PyBytes_Check(flags) || PyBytes_GET_SIZE(flags) != n) {
            PyErr_SetString(PyExc_ValueError, "unmatchable flags must be bytes of one flag per block");
            goto bad;
        }
        fl = PyBytes_AS_STRING(flags);
    }
    if (nc != n) {
        PyErr_SetString(PyExc_ValueError, "one content id per block hash");
        goto bad;
    }
    long added = 0, dup = 0;
    int unknown = 0, punm = 0;
    PyThreadState *ts = NULL;
    if (n >= RELEASE_GIL_BLOCKS) ts = PyEval_SaveThread();
    wlock(c);
    if (parent != Py_None) {
        Worker *w = &c->w[s];
        Py_ssize_t i = tab_find(&w->ext, pkey);
        if (i < 0)
            unknown = 1;
        else
            punm = (w->ext.meta[i] & M_UNM) != 0;
    }
    if (!unknown) {
        for (Py_ssize_t i = 0; i < n; i++) {
            int r = hold_block(c, s, keys[i], kinds[i], cs[i], punm || (fl && fl[i]), (u8)tier);
            added += r;
            dup += 1 - r;
        }
    }
    unlock(c);
    if (ts) PyEval_RestoreThread(ts);
    free(cs);
    free(keys);
    free(kinds);
    if (c->oom) {
        c->oom = 0;
        return PyErr_NoMemory();
    }
    if (unknown) Py_RETURN_NONE;
    return Py_BuildValue("ll", added, dup);
bad:
    free(cs);
    free(keys);
    free(kinds);
    return NULL;
}

/* Drop originals of bytes ids no longer stored, once they are most of the dict
 * (amortised O(1) per removal; never inside a batch that may roll back). */
static int prune_bytes(Core *c, int s) {
    Worker *w = &c->w[s];
    if (!w->bytes_ids || c->logging) return 0;
    Py_ssize_t have = PyDict_GET_SIZE(w->bytes_ids);
    if ((size_t)have < 2 * w->ext.len + 1024) return 0;
    PyObject *keep = PyDict_New();
    if (!keep) return -1;
    for (size_t i = 0; i < w->ext.cap; i++) {
        if (!(w->ext.meta[i] & M_BYTES)) continue;
        PyObject *k = PyLong_FromUnsignedLongLong(w->ext.keys[i]);
        PyObject *v = k ? PyDict_GetItemWithError(w->bytes_ids, k) : NULL;
        if (!v || PyDict_SetItem(keep, k, v) < 0) {
            Py_XDECREF(k);
            Py_DECREF(keep);
            return PyErr_Occurred() ? -1 : 0;
        }
        Py_DECREF(k);
    }
    Py_SETREF(w->bytes_ids, keep);
    return 0;
}

/* remove(name, ext_ids, tier, unspecified) -> (removed, unknown, tier_mismatches) */
static PyObject *Core_remove(Core *c, PyObject *args) {
    PyObject *name, *ids;
    int tier, unspecified;
    if (!PyArg_ParseTuple(args, "OOip", &name, &ids, &tier, &unspecified)) return NULL;
    int s = slot_lookup(c, name);
    if (s < 0) return NULL;
    PyObject *seq = PySequence_Fast(ids, "block_hashes must be a sequence");
    if (!seq) return NULL;
    Py_ssize_t n = PySequence_Fast_GET_SIZE(seq);
    PyObject **items = PySequence_Fast_ITEMS(seq);
    u64 *keys = malloc((size_t)(n ? n : 1) * sizeof(u64));
    u8 *valid = malloc((size_t)(n ? n : 1));
    if (!keys || !valid) {
        free(keys);
        free(valid);
        Py_DECREF(seq);
        return PyErr_NoMemory();
    }
    for (Py_ssize_t i = 0; i < n; i++) {
        u8 kind;
        valid[i] = ext_key(items[i], &keys[i], &kind) == 0;
        if (!valid[i]) { /* an id of no known shape is simply unknown */
            PyErr_Clear();
            keys[i] = 0;
        }
    }
    Py_DECREF(seq);
    long removed = 0, unknown = 0, mismatch = 0;
    PyThreadState *ts = NULL;
    if (n >= RELEASE_GIL_BLOCKS) ts = PyEval_SaveThread();
    wlock(c);
    {
        /* A software pipeline: the external id of block i+16 and the holder
         * slot of block i+8 are prefetched while block i is dropped, so a
         * dozen cache misses are in flight instead of one. */
        Worker *w = &c->w[s];
        enum { D1 = 16, D2 = 8 };
        for (Py_ssize_t i = 0; i < n + D1; i++) {
            if (i < n) tab_prefetch(&w->ext, keys[i]);
            Py_ssize_t j = i - D2;
            if (j >= 0 && j < n) {
                Py_ssize_t x = tab_find(&w->ext, keys[j]);
                if (x >= 0) g_prefetch(&c->glob, w->ext.vals[x]);
            }
            Py_ssize_t k = i - D1;
            if (k < 0) continue;
            int mm = 0;
            int r = valid[k] ? drop_block(c, s, keys[k], (u8)tier, unspecified, &mm) : -1;
            if (r < 0)
                unknown++;
            else
                removed += r;
            mismatch += mm;
        }
    }
    unlock(c);
    if (ts) PyEval_RestoreThread(ts);
    free(keys);
    free(valid);
    if (c->oom) {
        c->oom = 0;
        return PyErr_NoMemory();
    }
    if (prune_bytes(c, s) < 0) return NULL;
    return Py_BuildValue("lll", removed, unknown, mismatch);
}

/* clear(name, tier) -> blocks gone */
static PyObject *Core_clear(Core *c, PyObject *args) {
    PyObject *name;
    int tier;
    if (!PyArg_ParseTuple(args, "Oi", &name, &tier)) return NULL;
    int s = slot_lookup(c, name);
    if (s < 0) return NULL;
    size_t gone;
    Py_BEGIN_ALLOW_THREADS
    wlock(c);
    gone = clear_blocks(c, s, (u8)tier);
    unlock(c);
    Py_END_ALLOW_THREADS
    if (c->w[s].ext.len == 0 && !c->logging) Py_CLEAR(c->w[s].bytes_ids);
    if (c->oom) {
        c->oom = 0;
        return PyErr_NoMemory();
    }
    return PyLong_FromSize_t(gone);
}

static PyObject *Core_begin(Core *c, PyObject *unused) {
    wlock(c);
    c->nlog = 0;
    c->logging = 1;
    unlock(c);
    Py_RETURN_NONE;
}

static PyObject *Core_commit(Core *c, PyObject *unused) {
    wlock(c);
    c->nlog = 0;
    c->logging = 0;
    unlock(c);
    Py_RETURN_NONE;
}

static PyObject *Core_rollback(Core *c, PyObject *unused) {
    Py_BEGIN_ALLOW_THREADS
    wlock(c);
    undo_all(c);
    c->logging = 0;
    unlock(c);
    Py_END_ALLOW_THREADS
    if (c->oom) {
        c->oom = 0;
        return PyErr_NoMemory();
    }
    Py_RETURN_NONE;
}

/* ---- matching */

typedef struct {
    int nslots;
    long *scores;     /* per slot */
    long *tiers;      /* per slot: 3 counts (detail only) */
    u64 version;
} MatchOut;

/* Walk every block-size group; lock held by the caller. */
#define MATCH_AHEAD 16 /* blocks hashed (and their slots prefetched) ahead of the lookup */

/* Walk every block-size group; lock held by the caller. */
static void walk(Core *c, Toks *t, u64 root, int detail, MatchOut *out) {
    size_t W = W_OF(c);
    u64 group[8], alive[8], m[8]; /* up to 512 worker slots */
    if (W > 8) W = 8;
    long done_sizes[64];
    int ndone = 0;
    Py_ssize_t ntok = t->ntok;
    u64 *hashes = NULL;
    for (int oi = 0; oi < c->norder; oi++) {
        long bs = c->w[c->order[oi]].block_size;
        if (bs <= 0) continue;
        int seen = 0;
        for (int k = 0; k < ndone; k++) seen |= done_sizes[k] == bs;
        if (seen || ndone == 64) continue;
        done_sizes[ndone++] = bs;
        memset(group, 0, sizeof(group));
        for (int oj = 0; oj < c->norder; oj++) {
            int s = c->order[oj];
            if (c->w[s].block_size == bs && (size_t)(s >> 6) < W) group[s >> 6] |= (u64)1 << (s & 63);
        }
        Py_ssize_t nfull = ntok / bs;
        if (!nfull || !c->glob.len) continue;
        free(hashes);
        hashes = malloc((size_t)nfull * sizeof(u64));
        if (!hashes) {
            c->oom = 1;
            return;
        }
        memcpy(alive, group, sizeof(alive));
        u64 hc = root;
        Py_ssize_t nh = 0, depth = 0;
        int any = 1;
        for (; depth < nfull && any; depth++) {
            while (nh < nfull && nh <= depth + MATCH_AHEAD) {
                if (!toks_need(t, (nh + 1) * bs)) break;
                hc = chain(t->buf + nh * bs, (size_t)bs, hc);
                hashes[nh++] = hc;
                g_prefetch(&c->glob, hc);
            }
            if (depth >= nh) break; /* a bad token: the caller raises */
            Py_ssize_t i = g_find(&c->glob, hashes[depth]);
            if (i < 0)
                memset(m, 0, sizeof(m));
            else
                for (size_t k = 0; k < W; k++) m[k] = c->glob.e[(size_t)i * (1 + W_OF(c)) + 1 + k];
            any = 0;
            for (size_t k = 0; k < W; k++) {
                u64 dead = alive[k] & ~m[k];
                while (dead) {
                    int b = __builtin_ctzll(dead);
                    out->scores[k * 64 + b] = depth;
                    dead &= dead - 1;
                }
                alive[k] &= m[k];
                any |= alive[k] != 0;
            }
        }
        for (size_t k = 0; k < W; k++) {
            u64 a = alive[k];
            while (a) {
                int b = __builtin_ctzll(a);
                out->scores[k * 64 + b] = depth;
                a &= a - 1;
            }
        }
        if (detail) {
            for (int oj = 0; oj < c->norder; oj++) {
                int s = c->order[oj];
                Worker *w = &c->w[s];
                if (w->block_size != bs) continue;
                long sc = out->scores[s];
                long *tc = out->tiers + 3 * s;
                if (!w->n_aux_tier) {
                    tc[0] = sc;
                    continue;
                }
                for (long j = 0; j < sc; j++) {
                    u32 refs;
                    u8 tiers;
                    aux_get(w, hashes[j], &refs, &tiers);
                    tc[(tiers & GPU) ? 0 : (tiers & CPU) ? 1 : 2]++;
                }
            }
        }
    }
    free(hashes);
}

static PyObject *str_gpu, *str_cpu, *str_storage;

static PyObject *do_match(Core *c, PyObject *args, int detail) {
    PyObject *tokens;
    unsigned long long root;
    if (!PyArg_ParseTuple(args, "OK", &tokens, &root)) return NULL;
    Toks toks;
    if (toks_open(tokens, &toks) < 0) return NULL;
    Py_ssize_t ntok = toks.ntok;
    MatchOut out;
    PyObject *result = NULL;
    for (;;) {
        int ns = c->nslots;
        out.nslots = ns;
        out.scores = calloc((size_t)(ns ? ns : 1), sizeof(long));
        out.tiers = calloc((size_t)(ns ? ns : 1) * 3, sizeof(long));
        if (!out.scores || !out.tiers) {
            free(out.scores);
            free(out.tiers);
            toks_close(&toks);
            return PyErr_NoMemory();
        }
        u64 version;
        if (ntok >= RELEASE_GIL_TOKENS && !toks.seq) {
            /* a buffer needs no Python object: hash and walk without the GIL */
            Py_BEGIN_ALLOW_THREADS
            rlock(c);
            version = c->version;
            if (c->nslots == ns) walk(c, &toks, root, detail, &out);
            unlock(c);
            Py_END_ALLOW_THREADS
        } else {
            rlock(c);
            version = c->version;
            walk(c, &toks, root, detail, &out);
            unlock(c);
        }
        if (toks.err || toks.slow) {
            free(out.scores);
            free(out.tiers);
            if (toks.err) {
                toks_close(&toks);
                return NULL;
            }
            /* items that are not ints (numpy scalars, ...): convert all now, then walk again */
            PyObject *seq = toks.seq;
            Py_INCREF(seq);
            toks_close(&toks);
            memset(&toks, 0, sizeof(toks));
            toks.buf = tokens_from(seq, &toks.ntok, 1);
            Py_DECREF(seq);
            if (!toks.buf) return NULL;
            toks.nconv = toks.ntok;
            continue;
        }
        if (version == c->version && ns == c->nslots) break;
        free(out.scores); /* the set of workers changed meanwhile: answer again */
        free(out.tiers);
    }
    toks_close(&toks);
    if (c->oom) {
        c->oom = 0;
        free(out.scores);
        free(out.tiers);
        return PyErr_NoMemory();
    }
    PyObject *scores = PyDict_New(), *tiers = NULL, *sizes = NULL;
    if (!scores) goto done;
    if (detail && (!(tiers = PyDict_New()) || !(sizes = PyDict_New()))) goto done;
    for (int oi = 0; oi < c->norder; oi++) {
        int s = c->order[oi];
        Worker *w = &c->w[s];
        PyObject *v = PyLong_FromLong(out.scores[s]);
        if (!v || PyDict_SetItem(scores, w->name, v) < 0) {
            Py_XDECREF(v);
            goto done;
        }
        Py_DECREF(v);
        if (!detail) continue;
        long *t = out.tiers + 3 * s;
        PyObject *td = Py_BuildValue("{OlOlOl}", str_gpu, t[0], str_cpu, t[1], str_storage, t[2]);
        if (!td || PyDict_SetItem(tiers, w->name, td) < 0) {
            Py_XDECREF(td);
            goto done;
        }
        Py_DECREF(td);
        if (w->block_size > 0) {
            PyObject *b = PyLong_FromLong(w->block_size);
            if (!b || PyDict_SetItem(sizes, w->name, b) < 0) {
                Py_XDECREF(b);
                goto done;
            }
            Py_DECREF(b);
        }
    }
    if (detail)
        result = PyTuple_Pack(3, scores, tiers, sizes);
    else {
        Py_INCREF(scores);
        result = scores;
    }
done:
    Py_XDECREF(scores);
    Py_XDECREF(tiers);
    Py_XDECREF(sizes);
    free(out.scores);
    free(out.tiers);
    return result;
}

static PyObject *Core_match(Core *c, PyObject *args) { return do_match(c, args, 0); }
static PyObject *Core_match_detail(Core *c, PyObject *args) { return do_match(c, args, 1); }

/* info(name) -> (block_size|None, blocks, gpu, cpu, storage, unmatchable, aliased, matchable) */
static PyObject *Core_info(Core *c, PyObject *name) {
    int s = slot_lookup(c, name);
    if (s < 0) return NULL;
    rlock(c);
    Worker *w = &c->w[s];
    long cpu = 0, sto = 0, notgpu = 0, unmc = 0, alias = 0;
    for (size_t i = 0; i < w->aux.cap; i++) {
        if (!w->aux.meta[i]) continue;
        long refs = (long)(w->aux.vals[i] >> 8);
        u8 t = (u8)(w->aux.vals[i] & 0xff);
        if (!(t & GPU)) notgpu += refs;
        if (t & CPU) cpu += refs;
        if (t & STORAGE) sto += refs;
        if (w->aux.meta[i] & M_UNM) unmc += refs;
        alias += refs - 1;
    }
    long n = (long)w->ext.len, bs = w->block_size, nm = (long)w->n_matchable;
    unlock(c);
    PyObject *b = bs > 0 ? PyLong_FromLong(bs) : Py_NewRef(Py_None);
    if (!b) return NULL;
    return Py_BuildValue("Nlllllll", b, n, n - notgpu, cpu, sto, unmc, alias, nm);
}

static PyObject *Core_num_distinct(Core *c, PyObject *unused) { return PyLong_FromSize_t(c->glob.len); }

static PyObject *Core_memory_bytes(Core *c, PyObject *unused) {
    rlock(c);
    size_t b = c->glob.cap * (1 + c->glob.W) * sizeof(u64) + (size_t)c->nslots * sizeof(Worker);
    for (int s = 0; s < c->nslots; s++) b += tab_bytes(&c->w[s].ext) + tab_bytes(&c->w[s].aux);
    unlock(c);
    return PyLong_FromSize_t(b);
}

/* items(name) -> (ext_ids, contents, unmatchable_indices, tier_indices, tier_codes) */
static PyObject *Core_items(Core *c, PyObject *name) {
    int s = slot_lookup(c, name);
    if (s < 0) return NULL;
    Worker *w = &c->w[s];
    size_t n = 0;
    u64 *keys = NULL, *vals = NULL;
    u8 *meta = NULL, *tiers = NULL;
    int oom = 0;
    Py_BEGIN_ALLOW_THREADS
    rlock(c);
    n = w->ext.len;
    keys = malloc((n ? n : 1) * sizeof(u64));
    vals = malloc((n ? n : 1) * sizeof(u64));
    meta = malloc(n ? n : 1);
    tiers = malloc(n ? n : 1);
    if (!keys || !vals || !meta || !tiers) {
        oom = 1;
    } else {
        size_t k = 0;
        for (size_t i = 0; i < w->ext.cap; i++) {
            if (!w->ext.meta[i]) continue;
            keys[k] = w->ext.keys[i];
            vals[k] = w->ext.vals[i];
            meta[k] = w->ext.meta[i];
            u32 refs;
            aux_get(w, ckey_of(vals[k], (meta[k] & M_UNM) != 0), &refs, &tiers[k]);
            k++;
        }
    }
    unlock(c);
    Py_END_ALLOW_THREADS
    PyObject *ext = NULL, *cont = NULL, *unmi = NULL, *ti = NULL, *tc = NULL, *res = NULL;
    if (oom) {
        PyErr_NoMemory();
        goto done;
    }
    if (!(ext = PyList_New((Py_ssize_t)n)) || !(cont = PyList_New((Py_ssize_t)n)) || !(unmi = PyList_New(0)) ||
        !(ti = PyList_New(0)) || !(tc = PyList_New(0)))
        goto done;
    for (size_t i = 0; i < n; i++) {
        PyObject *e = ext_obj(w, keys[i], meta[i]);
        if (!e) goto done;
        PyList_SET_ITEM(ext, (Py_ssize_t)i, e);
        PyObject *v = PyLong_FromUnsignedLongLong(vals[i]);
        if (!v) goto done;
        PyList_SET_ITEM(cont, (Py_ssize_t)i, v);
        if (meta[i] & M_UNM) {
            PyObject *ix = PyLong_FromSize_t(i);
            if (!ix || PyList_Append(unmi, ix) < 0) {
                Py_XDECREF(ix);
                goto done;
            }
            Py_DECREF(ix);
        }
        if (tiers[i] != GPU) {
            PyObject *ix = PyLong_FromSize_t(i), *code = PyLong_FromLong(tiers[i]);
            int bad = !ix || !code || PyList_Append(ti, ix) < 0 || PyList_Append(tc, code) < 0;
            Py_XDECREF(ix);
            Py_XDECREF(code);
            if (bad) goto done;
        }
    }
    res = PyTuple_Pack(5, ext, cont, unmi, ti, tc);
done:
    Py_XDECREF(ext);
    Py_XDECREF(cont);
    Py_XDECREF(unmi);
    Py_XDECREF(ti);
    Py_XDECREF(tc);
    free(keys);
    free(vals);
    free(meta);
    free(tiers);
    return res;
}

/* raw event batches without Python objects per block (issue 17): its own file */
#include "ingest_decode.c"

static PyMethodDef Core_methods[] = {
    {"apply_raw", (PyCFunction)Core_apply_raw, METH_VARARGS, "apply_raw(name, payload, bs, root, salvage)"},
    {"register", (PyCFunction)Core_register, METH_O, "register(name): a new worker, last in order"},
    {"unregister", (PyCFunction)Core_unregister, METH_O, "unregister(name): drop its blocks and forget it"},
    {"workers", (PyCFunction)Core_workers, METH_NOARGS, "registered workers in order"},
    {"set_block_size", (PyCFunction)Core_set_block_size, METH_VARARGS, "set_block_size(name, bs|None)"},
    {"store", (PyCFunction)Core_store, METH_VARARGS, "hash and store one event's blocks"},
    {"store_hashed", (PyCFunction)Core_store_hashed, METH_VARARGS, "store blocks whose content ids are given"},
    {"remove", (PyCFunction)Core_remove, METH_VARARGS, "remove(name, ids, tier, unspecified)"},
    {"clear", (PyCFunction)Core_clear, METH_VARARGS, "clear(name, tier) -> blocks gone"},
    {"begin", (PyCFunction)Core_begin, METH_NOARGS, "start recording an undo log"},
    {"commit", (PyCFunction)Core_commit, METH_NOARGS, "forget the undo log"},
    {"rollback", (PyCFunction)Core_rollback, METH_NOARGS, "undo everything since begin()"},
    {"match", (PyCFunction)Core_match, METH_VARARGS, "match(tokens, root) -> {worker: blocks}"},
    {"match_detail", (PyCFunction)Core_match_detail, METH_VARARGS, "-> (scores, tiers, block sizes)"},
    {"info", (PyCFunction)Core_info, METH_O, "per-worker counts"},
    {"num_distinct", (PyCFunction)Core_num_distinct, METH_NOARGS, "distinct matchable contents"},
    {"memory_bytes", (PyCFunction)Core_memory_bytes, METH_NOARGS, "bytes held by the tables"},
    {"items", (PyCFunction)Core_items, METH_O, "a worker's entries for snapshots"},
    {NULL, NULL, 0, NULL},
};

static PyObject *Core_get_version(Core *c, void *closure) { return PyLong_FromUnsignedLongLong(c->version); }

static PyGetSetDef Core_getset[] = {
    {"version", (getter)Core_get_version, NULL, "changes when the set of workers changes", NULL},
    {NULL, NULL, NULL, NULL, NULL},
};

static PyTypeObject CoreType = {
    PyVarObject_HEAD_INIT(NULL, 0).tp_name = "tokenspeed_router._native.Core",
    .tp_basicsize = sizeof(Core),
    .tp_flags = Py_TPFLAGS_DEFAULT,
    .tp_doc = "Compiled KV index core (see router/index.py for the semantics layer).",
    .tp_new = Core_new,
    .tp_dealloc = (destructor)Core_dealloc,
    .tp_methods = Core_methods,
    .tp_getset = Core_getset,
};

/* ------------------------------------------------------------------ hashing */

/* hash_blocks(tokens, block_size, seed) -> list of the chained hashes of every full block */
static PyObject *mod_hash_blocks(PyObject *m, PyObject *args) {
    PyObject *tokens;
    long bs;
    unsigned long long seed;
    if (!PyArg_ParseTuple(args, "OlK", &tokens, &bs, &seed)) return NULL;
    if (bs <= 0) {
        PyErr_SetString(PyExc_ValueError, "block_size must be positive");
        return NULL;
    }
    Py_ssize_t ntok;
    u64 *toks = tokens_from(tokens, &ntok, 1);
    if (!toks) return NULL;
    Py_ssize_t n = ntok / bs;
    u64 *hs = malloc((size_t)(n ? n : 1) * sizeof(u64));
    if (!hs) {
        free(toks);
        return PyErr_NoMemory();
    }
    u64 h = seed;
    if (ntok >= RELEASE_GIL_TOKENS) {
        Py_BEGIN_ALLOW_THREADS
        for (Py_ssize_t i = 0; i < n; i++) hs[i] = h = chain(toks + i * bs, (size_t)bs, h);
        Py_END_ALLOW_THREADS
    } else {
        for (Py_ssize_t i = 0; i < n; i++) hs[i] = h = chain(toks + i * bs, (size_t)bs, h);
    }
    free(toks);
    PyObject *out = PyList_New(n);
    if (out) {
        for (Py_ssize_t i = 0; i < n; i++) {
            PyObject *v = PyLong_FromUnsignedLongLong(hs[i]);
            if (!v) {
                Py_CLEAR(out);
                break;
            }
            PyList_SET_ITEM(out, i, v);
        }
    }
    free(hs);
    return out;
}

/* chain_hash(data: bytes-like, seed) -> XXH3_64(data, seed) */
static PyObject *mod_chain_hash(PyObject *m, PyObject *args) {
    Py_buffer b;
    unsigned long long seed = 0;
    if (!PyArg_ParseTuple(args, "y*|K", &b, &seed)) return NULL;
    u64 h = XXH3_64bits_withSeed(b.buf, (size_t)b.len, seed);
    PyBuffer_Release(&b);
    return PyLong_FromUnsignedLongLong(h);
}

/* msgpack_tokens(raw) -> bytes: a msgpack array of token ids (the raw
 * ``token_ids`` field of a ZMQ API request) as native u64s, for the index to
 * read in place. Building 1k Python ints only to read them back costs more
 * than the whole routing decision; this reads the wire bytes once. Accepts
 * exactly what the typed decoder accepts (ints in [0, 2**63)); anything else is
 * a ValueError worded like msgspec's, with the JSON path. */
static PyObject *tokens_type_error(const char *got, Py_ssize_t i) {
    if (i < 0) PyErr_Format(PyExc_ValueError, "Expected `array`, got `%s` - at `$.token_ids`", got);
    else PyErr_Format(PyExc_ValueError, "Expected `int`, got `%s` - at `$.token_ids[%zd]`", got, i);
    return NULL;
}

static const char *msgpack_kind(u8 b) {
    if (b <= 0x7f || b >= 0xe0 || (b >= 0xcc && b <= 0xd3)) return "int";
    if ((b & 0xe0) == 0xa0 || (b >= 0xd9 && b <= 0xdb)) return "str";
    if ((b & 0xf0) == 0x90 || b == 0xdc || b == 0xdd) return "array";
    if ((b & 0xf0) == 0x80 || b == 0xde || b == 0xdf) return "object";
    if (b == 0xc0) return "None";
    if (b == 0xc2 || b == 0xc3) return "bool";
    if (b == 0xca || b == 0xcb) return "float";
    if (b >= 0xc4 && b <= 0xc6) return "bytes";
    return "ext";
}

static inline u64 be_load(const u8 *p, int n) {
    u64 v = 0;
    for (int k = 0; k < n; k++) v = (v << 8) | p[k];
    return v;
}

static PyObject *mod_msgpack_tokens(PyObject *m, PyObject *arg) {
    Py_buffer b;
    if (PyObject_GetBuffer(arg, &b, PyBUF_SIMPLE) < 0) return NULL;
    const u8 *p = b.buf, *end = p + b.len;
    PyObject *out = NULL;
    Py_ssize_t n;
    if (p >= end) {
        PyErr_SetString(PyExc_ValueError, "Input data was truncated");
        goto done;
    }
    if ((*p & 0xf0) == 0x90) {
        n = *p & 0x0f;
        p += 1;
    } else if (*p == 0xdc && end - p >= 3) {
        n = (Py_ssize_t)be_load(p + 1, 2);
        p += 3;
    } else if (*p == 0xdd && end - p >= 5) {
        n = (Py_ssize_t)be_load(p + 1, 4);
        p += 5;
    } else {
        tokens_type_error(msgpack_kind(*p), -1);
        goto done;
    }
    if (n > end - p) { /* every item takes at least one byte */
        PyErr_SetString(PyExc_ValueError, "Input data was truncated");
        goto done;
    }
    out = PyBytes_FromStringAndSize(NULL, n * 8);
    if (!out) goto done;
    u64 *dst = (u64 *)PyBytes_AS_STRING(out);
    for (Py_ssize_t i = 0; i < n; i++) {
        u8 t = *p;
        u64 v;
        int len;
        if (t <= 0x7f) {
            dst[i] = t;
            p++;
            continue;
        }
        if ((u8)(t - 0xcc) < 4 && end - p >= 9) {
            /* uint 8/16/32/64: one unaligned big-endian load and a shift, no
             * branch on the width (vocabulary ids mix uint16 and uint32). */
            int sz = 1 << (t - 0xcc);
            u64 x;
            memcpy(&x, p + 1, 8);
            v = __builtin_bswap64(x) >> (64 - 8 * sz);
            p += 1 + sz;
            if (v > (u64)INT64_MAX) {
                PyErr_Format(PyExc_ValueError, "Expected `int` <= 9223372036854775807 - at `$.token_ids[%zd]`", i);
                Py_CLEAR(out);
                goto done;
            }
            dst[i] = v;
            continue;
        }
        switch (t) {
        case 0xcc: len = 1; break;
        case 0xcd: len = 2; break;
        case 0xce: len = 4; break;
        case 0xcf: len = 8; break;
        case 0xd0: len = -1; break;
        case 0xd1: len = -2; break;
        case 0xd2: len = -4; break;
        case 0xd3: len = -8; break;
        default:
            if (t >= 0xe0) { /* negative fixint */
                PyErr_Format(PyExc_ValueError, "Expected `int` >= 0 - at `$.token_ids[%zd]`", i);
            } else {
                tokens_type_error(msgpack_kind(t), i);
            }
            Py_CLEAR(out);
            goto done;
        }
        int sz = len < 0 ? -len : len;
        if (end - p < 1 + sz) {
            PyErr_SetString(PyExc_ValueError, "Input data was truncated");
            Py_CLEAR(out);
            goto done;
        }
        switch (sz) { /* big-endian payloads */
        case 1: v = p[1]; break;
        case 2: { uint16_t x; memcpy(&x, p + 1, 2); v = __builtin_bswap16(x); break; }
        case 4: { u32 x; memcpy(&x, p + 1, 4); v = __builtin_bswap32(x); break; }
        default: { u64 x; memcpy(&x, p + 1, 8); v = __builtin_bswap64(x); }
        }
        p += 1 + sz;
        if (len < 0 && sz < 8 && (v >> (8 * sz - 1))) v |= ~(u64)0 << (8 * sz); /* sign-extend */
        if (len < 0 && (int64_t)v < 0) {
            PyErr_Format(PyExc_ValueError, "Expected `int` >= 0 - at `$.token_ids[%zd]`", i);
            Py_CLEAR(out);
            goto done;
        }
        if (v > (u64)INT64_MAX) {
            PyErr_Format(PyExc_ValueError, "Expected `int` <= 9223372036854775807 - at `$.token_ids[%zd]`", i);
            Py_CLEAR(out);
            goto done;
        }
        dst[i] = v;
    }
    if (p != end) {
        PyErr_SetString(PyExc_ValueError, "trailing bytes after the token_ids array");
        Py_CLEAR(out);
    }
done:
    PyBuffer_Release(&b);
    return out;
}

static PyMethodDef mod_methods[] = {
    {"hash_blocks", mod_hash_blocks, METH_VARARGS, "chained content hashes of the full blocks"},
    {"chain_hash", mod_chain_hash, METH_VARARGS, "XXH3_64(data, seed)"},
    {"msgpack_tokens", mod_msgpack_tokens, METH_O, "a msgpack array of token ids in [0, 2**63) -> native u64 bytes"},
    {"scan_batch", mod_scan_batch, METH_O, "scan_batch(payload) -> ts when apply_raw can take it, else None"},
    {"set_media", mod_set_media, METH_O, "set_media([(name, code), ...]): the tier spellings"},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef moddef = {
    PyModuleDef_HEAD_INIT, "tokenspeed_router._native",
    "Compiled content hash and KV index core (C, CPython API, vendored xxHash).", -1, mod_methods,
};

PyMODINIT_FUNC PyInit__native(void) {
    if (PyType_Ready(&CoreType) < 0) return NULL;
    PyObject *m = PyModule_Create(&moddef);
    if (!m) return NULL;
    str_gpu = PyUnicode_InternFromString("gpu");
    str_cpu = PyUnicode_InternFromString("cpu");
    str_storage = PyUnicode_InternFromString("storage");
    Py_INCREF(&CoreType);
    if (PyModule_AddObject(m, "Core", (PyObject *)&CoreType) < 0) return NULL;
    PyModule_AddIntConstant(m, "XXH_VERSION", XXH_VERSION_NUMBER);
    return m;
}
