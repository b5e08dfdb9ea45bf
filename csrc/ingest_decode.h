/* Raw KV event batches into the core without Python objects per block (ingest_decode.c). */
#ifndef TSR_INGEST_DECODE_H
#define TSR_INGEST_DECODE_H

#include "common.h"

#include "index.h"

/* Apply the msgpack batch data[0..len) to slot s (Core.apply_raw; see ingest_decode.c):
 * None when it is not provably the fast case (nothing changed), else the result
 * tuple; NULL with an exception (out of memory). Takes and releases the GIL itself. */
PyObject *raw_apply(Core *c, int s, const void *data, Py_ssize_t len, long bs, u64 root, int salvage);

/* module functions: scan_batch(payload) -> ts | None; set_media([(name, code), ...]) */
PyObject *mod_scan_batch(PyObject *m, PyObject *arg);
PyObject *mod_set_media(PyObject *m, PyObject *pairs);

#endif
