/* The module's content-hash functions (hashing.py calls them). */
#include "convert.h"
#include "module.h"

/* hash_blocks(tokens, block_size, seed) -> list of the chained hashes of every full block */
PyObject *mod_hash_blocks(PyObject *m, PyObject *args) {
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
    u64 *hs = tsr_malloc((size_t)(n ? n : 1) * sizeof(u64));
    if (!hs) {
        tsr_free(toks);
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
    tsr_free(toks);
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
    tsr_free(hs);
    return out;
}

/* chain_hash(data: bytes-like, seed) -> XXH3_64(data, seed) */
PyObject *mod_chain_hash(PyObject *m, PyObject *args) {
    Py_buffer b;
    unsigned long long seed = 0;
    if (!PyArg_ParseTuple(args, "y*|K", &b, &seed)) return NULL;
    u64 h = XXH3_64bits_withSeed(b.buf, (size_t)b.len, seed);
    PyBuffer_Release(&b);
    return PyLong_FromUnsignedLongLong(h);
}
