/*
 * Python objects -> native words: token ids (lists, tuples, buffers; a query's
 * list converted lazily as far as the walk gets) and external block ids
 * (64-bit ints, negative ints, bytes). What a walk runs per token is inline.
 */
#ifndef TSR_CONVERT_H
#define TSR_CONVERT_H

#include "common.h"

/* Token ids -> a u64 array. strict: reject negatives / too large (queries);
 * otherwise wrap them modulo 2**64 (events: ingestion must not half-apply).
 * Returns a malloc'd array (or NULL with an exception set). */
u64 *tokens_from(PyObject *obj, Py_ssize_t *n_out, int strict);

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

/* Open a query's tokens (-1 with an exception set); toks_close frees them. */
int toks_open(PyObject *obj, Toks *t);
void toks_close(Toks *t);

/* Convert the list's items up to `upto` (a chunk of 256 at least): 1, or 0
 * to stop the walk (an item that is not an int sets t->slow; a bad int sets
 * t->err with an exception). Under the index lock no Python code may run (an
 * __index__ could wait for the GIL held by a writer waiting for this lock):
 * exact ints are read here, int subclasses by the API, anything else is
 * left for a full conversion outside the lock. */
int toks_convert(Toks *t, Py_ssize_t upto);

/* Tokens [0, upto) are converted (the walk asks before it hashes a block). */
static inline int toks_need(Toks *t, Py_ssize_t upto) {
    if (upto <= t->nconv) return 1;
    return toks_convert(t, upto);
}

/* External id (u64 int, negative int, or bytes) -> table key + kind flag (M_SIGNED, M_BYTES). */
int ext_key(PyObject *o, u64 *key, u8 *kind);

#endif
