/* The module-level functions of _native, one file each, as native.c lists them. */
#ifndef TSR_MODULE_H
#define TSR_MODULE_H

#include "common.h"

/* hashing.c */
PyObject *mod_hash_blocks(PyObject *m, PyObject *args);
PyObject *mod_chain_hash(PyObject *m, PyObject *args);

/* msgpack.c */
PyObject *mod_msgpack_tokens(PyObject *m, PyObject *arg);

/* zmq_drain.c */
PyObject *mod_zmq_link(PyObject *m, PyObject *arg);
PyObject *mod_zmq_drain(PyObject *m, PyObject *args);
PyObject *mod_zmq_send_all(PyObject *m, PyObject *args);

#endif
