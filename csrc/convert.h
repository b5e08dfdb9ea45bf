/*
 * Python objects -> native words: token ids (lists, tuples, buffers; a query's
 * list converted lazily as far as the walk gets) and external block ids
 * (64-bit ints, negative ints, bytes). What a walk runs per token is inline.
 */
#ifndef TSR_CONVERT_H
#define TSR_CONVERT_H

#include "common.h"

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
u64 *tokens_from(PyObject *obj, Py_ssize_t *n_out, int strict);

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

/* Open a query's tokens (-1 with an exception set); toks_close frees them. */
int toks_open(PyObject *obj, Toks *t);
void toks_close(Toks *t);

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

/* External id (u64 int, negative int, or bytes) -> table key + kind flag (M_SIGNED, M_BYTES). */
int ext_key(PyObject *o, u64 *key, u8 *kind);

#endif
