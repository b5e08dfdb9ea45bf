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
    Tab ext;             /* nval 1: content; identity (key, meta & M_KIND) */
    Tab aux;             /* nval 1: refs << 8 | tiers; identity (content, meta & M_UNM) */
    size_t n_matchable;  /* ext entries with a matchable content */
    size_t n_aux_tier;   /* aux entries whose tiers are not GPU alone */
    PyObject *bytes_ids; /* key -> original bytes id (pruned lazily) */
} Worker;

/* What tells external ids of one key apart: -1 (M_SIGNED) and 2**64-1 share
 * the key 0xffffffffffffffff, as may a bytes id's XXH3 (M_BYTES). */
#define M_KIND (M_SIGNED | M_BYTES)

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
    int nslots, capslots;
    int *order; /* registration order of used slots */
    int norder;
    PyObject *slot_of; /* name -> int slot */
    GTab glob;         /* W = ceil(slots / 64) mask words, widened as workers register */
    u64 version;
    Undo *log;
    size_t nlog, caplog;
    int logging;  /* between begin() and commit()/rollback(): every change is logged */
    int undoing;  /* inside undo_all */
} Core;

#define W_OF(c) ((c)->glob.W)

/* Errors are returned, never left in the Core: a reader (under the read lock)
 * must not write shared state, and a writer's failure belongs to its call.
 * E_NOMEM: out of memory, nothing of the failing step changed. */
#define E_NOMEM (-2)

static inline void wlock(Core *c) { pthread_rwlock_wrlock(&c->lock); }
static inline void rlock(Core *c) { pthread_rwlock_rdlock(&c->lock); }
static inline void unlock(Core *c) { pthread_rwlock_unlock(&c->lock); }

/* ---- entries */

static inline Py_ssize_t ext_find(const Worker *w, u64 key, u8 kind) {
    return tab_find_tagged(&w->ext, key, M_KIND, kind);
}

/* aux: (content, unmatchable) -> refs, tiers (default: 1, GPU) */
static inline Py_ssize_t aux_find(const Worker *w, u64 content, int unm) {
    return tab_find_tagged(&w->aux, content, M_UNM, unm ? M_UNM : 0);
}

static inline void aux_get(const Worker *w, u64 content, int unm, u32 *refs, u8 *tiers) {
    Py_ssize_t i = aux_find(w, content, unm);
    if (i < 0) {
        *refs = 1;
        *tiers = GPU;
    } else {
        *refs = (u32)(w->aux.vals[i] >> 8);
        *tiers = (u8)(w->aux.vals[i] & 0xff);
    }
}

/* Every mutation below first makes room for all it will write (table slots,
 * undo-log entries) and returns E_NOMEM before changing anything when it
 * cannot: a block is recorded whole or not at all, and inside a batch every
 * change is logged, so rollback() restores the state of begin() exactly. */

/* Record that slot s holds content as external id (key, kind) on tier `code`:
 * 1 new, 0 duplicate, E_NOMEM. */
int hold_block(Core *c, int s, u64 key, u8 kind, u64 content, int unm, u8 code);
/* Store one event's chain of n blocks for slot s: block i's tokens are
 * toks[i*bs ..] (the last of n may be partial: n - nfull <= 1), chained from h.
 * Reserves room for the whole event first, then hashes every block while
 * prefetching the slots each will touch, so the inserts' cache misses overlap.
 * toks is reused for the hashes. 0, or E_NOMEM (blocks before the failing one
 * stay held, each whole: callers run it inside txn_open/txn_close, which
 * undoes them). One definition for store() and the raw ingest path. */
int hold_chain(Core *c, int s, const u64 *keys, const u8 *kinds, u64 *toks, Py_ssize_t n,
               Py_ssize_t ntok, long bs, Py_ssize_t nfull, u64 h, int unm, u8 tier,
               long *added, long *dup);
/* Remove tier `code` of external id (key, kind): 1 gone, 0 still held (or a
 * mismatch: *mismatch = 1), -1 unknown, E_NOMEM. */
int drop_block(Core *c, int s, u64 key, u8 kind, u8 code, int unspecified, int *mismatch);
/* Drop tier `code` of every block of slot s: the blocks gone, or E_NOMEM. */
Py_ssize_t clear_blocks(Core *c, int s, u8 code);
/* End a batch (begin() set c->logging): keep its changes... */
void commit_batch(Core *c);
/* ...or undo everything the log recorded, newest first. 0, or E_NOMEM if a
 * table could not take back an entry (never expected: no table shrinks while
 * a batch is logged, so every entry fits where it was). */
int undo_all(Core *c);

/* A call that may fail halfway (an event's chain of blocks, a raw batch) runs
 * as its own batch when none is open, so that E_NOMEM undoes what it did and
 * the index is left as it was: txn_open answers 1 when it opened one (the
 * caller passes that to txn_close), 0 inside a batch (begin() .. commit(),
 * whose owner rolls back). txn_close(c, own, failed) commits or undoes it:
 * 0, or E_NOMEM if the undo could not restore everything (never expected). */
int txn_open(Core *c);
int txn_close(Core *c, int own, int failed);

/* ---- matching */

typedef struct {
    long *scores; /* per slot */
    long *tiers;  /* per slot: 3 counts (detail only) */
} MatchOut;

/* Score every worker with a block size against the query (lock held by the
 * caller; scores and tiers zeroed, nslots long): 0, or E_NOMEM (nothing to
 * trust in out). Any number of workers and of distinct block sizes. */
int walk(const Core *c, Toks *t, u64 root, int detail, MatchOut *out);

#endif
