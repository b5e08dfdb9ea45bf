/* The tables' cold paths: big allocations, growing and freeing (table.h). */
#include "table.h"

#include <sys/mman.h>

/* Tables of 2 MiB and more are mapped with transparent huge pages requested:
 * a lookup is a random access, and with 4 KiB pages most of them would also
 * miss the TLB (which also makes prefetches useless). Zeroed like calloc. */
#define HUGE_MIN ((size_t)2 << 20)

void *big_zalloc(size_t bytes) {
    if (bytes < HUGE_MIN) return tsr_calloc(1, bytes ? bytes : 1);
    if (tsr_alloc_refused()) return NULL;
    void *p = mmap(NULL, bytes, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    if (p == MAP_FAILED) return NULL;
    TSR_COUNT(1);
#ifdef MADV_HUGEPAGE
    madvise(p, bytes, MADV_HUGEPAGE);
#endif
    return p;
}

void big_free(void *p, size_t bytes) {
    if (!p) return;
    if (bytes < HUGE_MIN) {
        tsr_free(p);
    } else {
        TSR_COUNT(-1);
        munmap(p, bytes);
    }
}

/* ------------------------------------------------------------------ Tab */

void tab_free(Tab *t) {
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

int tab_rehash(Tab *t, size_t cap, size_t nval) {
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

/* ------------------------------------------------------------------ GTab */

void g_free(GTab *t) {
    big_free(t->e, t->cap * (1 + t->W) * sizeof(u64));
    t->e = NULL;
    t->cap = t->len = 0;
}

int g_rehash(GTab *t, size_t cap, size_t W) {
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
