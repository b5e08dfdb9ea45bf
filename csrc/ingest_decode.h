/* Raw KV event batches into the core without Python objects per block (ingest_decode.c). */
#ifndef TSR_INGEST_DECODE_H
#define TSR_INGEST_DECODE_H

#include "common.h"

#include "index.h"

typedef struct {
    long stored, dup, removed, unknown, cleared, mismatch;
    long rejected;          /* salvage: events refused (unknown parent) */
    Py_ssize_t last_clear;  /* salvage: index of the last whole-cache clear applied, -1 none */
    Py_ssize_t last_reject; /* salvage: index of the last refused event, -1 none */
    int unknown_parent;     /* atomic mode: the batch was refused and rolled back */
    int err;                /* E_NOMEM: out of memory (atomic mode: rolled back) */
} RawOut;

/* What one raw_run did: rc (RAW_OK, RAW_NOT_MINE: not the fast case and nothing changed,
 * RAW_NOMEM), the batch's timestamp, events, flags (1: stores, 2: a clear of every tier),
 * the counts and the worker's blocks after it. */
typedef struct {
    int rc;
    double ts;
    Py_ssize_t nev;
    int flags;
    RawOut o;
    Py_ssize_t blocks;
} RawRes;

/* Raw batches (one, or a run in Core.apply_raw_many) of at least this many bytes in all are
 * applied without the GIL; less keeps it. Handing the GIL over costs the applying thread up to
 * a switch interval (0.5 ms in serve) to get it back when a query thread takes it: more than
 * applying a few 3 KB batches, and paid per batch when a worker's batches each end a run
 * (a resyncing worker's refused batches and their salvage). */
#define RAW_RELEASE_BYTES 16384

#define RAW_OK 0
#define RAW_NOT_MINE 1
#define RAW_NOMEM 2

/* Read and apply one batch without Python objects; *ts: the caller's saved thread state while
 * the GIL is released, or NULL while it is held (taken back only for bytes ids). */
void raw_run(Core *c, int s, const void *data, Py_ssize_t len, long bs, u64 root, int salvage, RawRes *r,
             PyThreadState **ts);
/* raw_run's answer to Python (GIL held): None, the result tuple, or NULL with MemoryError. */
PyObject *raw_result(const RawRes *r);

/* Apply the msgpack batch data[0..len) to slot s (Core.apply_raw; see ingest_decode.c):
 * None when it is not provably the fast case (nothing changed), else the result
 * tuple; NULL with an exception (out of memory). Takes and releases the GIL itself. */
PyObject *raw_apply(Core *c, int s, const void *data, Py_ssize_t len, long bs, u64 root, int salvage);

/* module functions: scan_batch(payload) -> ts | None; set_media([(name, code), ...]) */
PyObject *mod_scan_batch(PyObject *m, PyObject *arg);
PyObject *mod_set_media(PyObject *m, PyObject *pairs);

#endif
