/*
 * tokenspeed_router._native: the compiled core of the content hash and the KV index.
 *
 * Why C against the CPython API (as msgspec does) and not Cython or Rust: it
 * needs nothing but the machine's C compiler and Python's own headers, so the
 * normal `pip install` / `make` builds it from source with no extra build
 * dependency (Cython would add one, Rust a toolchain) and nothing downloaded.
 * xxHash is vendored as its single header (csrc/xxhash, BSD-2-Clause).
 *
 * Files (one extension module; setup.py compiles every .c file of csrc):
 *   native.c     this overview, the module's method table and init
 *   common.h     integer types, tier and entry flags, the chained hash
 *   table.[ch]   the open-addressing hash tables (Tab, GTab) and big allocations
 *   index.[ch]   the index core: workers, block semantics, undo log, match walk
 *   convert.[ch] Python objects -> native words (token ids, external block ids)
 *   core_type.[ch] the Python type Core that drives the index core
 *   hashing.c    hash_blocks, chain_hash
 *   msgpack.c    msgpack_tokens: a request's raw token_ids array -> native u64s
 *   zmq_drain.c  zmq_link, zmq_drain, zmq_send_all: every message waiting on a ZeroMQ socket
 *                read in one call, a list of messages sent in one (through pyzmq's libzmq)
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
 * Threading contract (see docs/kv-index.md):
 *   - One writer thread at a time calls the mutating methods (register,
 *     unregister, set_block_size, store, store_hashed, remove, clear, begin,
 *     commit, rollback, apply_raw, apply_raw_many). Any number of threads may call the readers (match,
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
#include "common.h"
#include "core_type.h"
#include "module.h"
#include "ingest_decode.h"

/* ---- allocation fault injection (common.h: tsr_malloc and the others) */

/* Allocations still to go before the one that fails; 0: disarmed (the normal state). */
long tsr_alloc_countdown;
#ifdef TSR_FUZZ
long tsr_live_allocs; /* blocks the extension holds (fuzz build only, common.h) */
#endif

/* Count one allocation while armed: 1 when it is the one to fail (then disarmed). */
int tsr_alloc_fault(void) {
    long n = __atomic_load_n(&tsr_alloc_countdown, __ATOMIC_RELAXED);
    while (n > 0)
        if (__atomic_compare_exchange_n(&tsr_alloc_countdown, &n, n - 1, 0, __ATOMIC_RELAXED, __ATOMIC_RELAXED))
            return n == 1;
    return 0;
}

/* _fail_alloc_after(n) -> int: the n-th allocation of the extension from now
 * on fails (once; n = 0 disarms). Answers how many were still to go under the
 * previous setting: 0 when that failure happened (or nothing was armed). For
 * the tests of tests/unit/test_native_alloc_faults.py only. */
static PyObject *mod_fail_alloc_after(PyObject *m, PyObject *arg) {
    long n = PyLong_AsLong(arg);
    if (n == -1 && PyErr_Occurred()) return NULL;
    if (n < 0) {
        PyErr_SetString(PyExc_ValueError, "_fail_alloc_after takes n >= 0");
        return NULL;
    }
    return PyLong_FromLong(__atomic_exchange_n(&tsr_alloc_countdown, n, __ATOMIC_RELAXED));
}

static PyMethodDef mod_methods[] = {
    {"hash_blocks", mod_hash_blocks, METH_VARARGS, "chained content hashes of the full blocks"},
    {"chain_hash", mod_chain_hash, METH_VARARGS, "XXH3_64(data, seed)"},
    {"msgpack_tokens", mod_msgpack_tokens, METH_O, "a msgpack array of token ids in [0, 2**63) -> native u64 bytes"},
    {"scan_batch", mod_scan_batch, METH_O, "scan_batch(payload) -> ts when apply_raw can take it, else None"},
    {"set_media", mod_set_media, METH_O, "set_media([(name, code), ...]): the tier spellings of the raw decoder"},
    {"zmq_link", mod_zmq_link, METH_O, "zmq_link(path) -> bool: use the libzmq pyzmq loaded from path"},
    {"zmq_drain", mod_zmq_drain, METH_VARARGS, "zmq_drain(socket_address, max) -> every waiting message's frames"},
    {"zmq_send_all", mod_zmq_send_all, METH_VARARGS, "zmq_send_all(socket_address, messages) -> messages sent"},
    {"_fail_alloc_after", mod_fail_alloc_after, METH_O, "tests only: make the n-th allocation from now fail (0: off)"},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef moddef = {
    PyModuleDef_HEAD_INIT, "tokenspeed_router._native",
    "Compiled content hash and KV index core (C, CPython API, vendored xxHash).", -1, mod_methods,
};

/* Every step is checked: a half-initialised module must not import. */
PyMODINIT_FUNC PyInit__native(void) {
    PyObject *m = PyModule_Create(&moddef);
    if (!m) return NULL;
    /* the tier bits, for a test that they are router/tiers.py's */
    if (core_type_add(m) < 0 || PyModule_AddIntConstant(m, "XXH_VERSION", XXH_VERSION_NUMBER) < 0 ||
        PyModule_AddIntConstant(m, "GPU", GPU) < 0 || PyModule_AddIntConstant(m, "CPU", CPU) < 0 ||
        PyModule_AddIntConstant(m, "STORAGE", STORAGE) < 0) {
        Py_DECREF(m);
        return NULL;
    }
    return m;
}
