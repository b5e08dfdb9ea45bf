/*
 * The index core: per-worker tables, the global content -> workers table, the
 * block semantics of store / remove / clear (hold_block, drop_block,
 * clear_blocks), the undo log of a batch, and the match walk. Plain C over the
 * tables of table.h; the Python type that drives it is core_type.c.
 *
 * Semantics: those of tokenspeed_router/router/index_reference.py (the
 * readable pure-Python model); router/index.py drives both the same way.
 */
#ifndef TSR_INDEX_H
#define TSR_INDEX_H

#include "common.h"

#include <pthread.h>

#include "convert.h"
#include "table.h"

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

/* Record that slot s holds content as external key on tier `code`: 1 new, 0 duplicate. */
int hold_block(Core *c, int s, u64 key, u8 kind, u64 content, int unm, u8 code);
/* Remove tier `code` of external key: 1 gone, 0 still held (or mismatch: *mismatch=1), -1 unknown. */
int drop_block(Core *c, int s, u64 key, u8 code, int unspecified, int *mismatch);
/* Drop tier `code` of every block of slot s; returns the blocks gone. */
size_t clear_blocks(Core *c, int s, u8 code);
/* Undo everything the log recorded since begin(), newest first. */
void undo_all(Core *c);

/* ---- matching */

typedef struct {
    int nslots;
    long *scores;     /* per slot */
    long *tiers;      /* per slot: 3 counts (detail only) */
    u64 version;
} MatchOut;

/* Walk every block-size group; lock held by the caller. */
void walk(Core *c, Toks *t, u64 root, int detail, MatchOut *out);

#endif
