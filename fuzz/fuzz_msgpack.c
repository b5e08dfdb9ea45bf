/*
 * Fuzz target: the token reader (csrc/msgpack.c, _native.msgpack_tokens)
 * against a reference written here for reading, not speed: an array (fix,
 * 16 or 32) of ints in [0, 2**63) in any msgpack int form, nothing after it.
 * Same verdict and the same values, or it is a finding.
 */
#include "embed.h"

PyObject *mod_msgpack_tokens(PyObject *m, PyObject *arg);

static u64 be(const u8 *p, size_t n) {
    u64 v = 0;
    for (size_t i = 0; i < n; i++) v = (v << 8) | p[i];
    return v;
}

/* 1 and the values when accepted, 0 when refused. Offsets, never pointers past the end. */
static int ref_tokens(const u8 *d, size_t len, u64 **out, size_t *count) {
    size_t i = 0, n;
    if (len == 0) return 0;
    u8 h = d[i++];
    if ((h & 0xf0) == 0x90) {
        n = h & 0x0f;
    } else if (h == 0xdc || h == 0xdd) {
        size_t w = h == 0xdc ? 2 : 4;
        if (len - i < w) return 0;
        n = (size_t)be(d + i, w);
        i += w;
    } else {
        return 0;
    }
    if (n > len - i) return 0;
    u64 *v = malloc((n ? n : 1) * sizeof(u64));
    if (!v) abort();
    for (size_t k = 0; k < n; k++) {
        if (i >= len) goto refuse;
        u8 t = d[i++];
        if (t <= 0x7f) {
            v[k] = t;
            continue;
        }
        size_t w;
        int sgn;
        if (t >= 0xcc && t <= 0xcf) {
            w = (size_t)1 << (t - 0xcc);
            sgn = 0;
        } else if (t >= 0xd0 && t <= 0xd3) {
            w = (size_t)1 << (t - 0xd0);
            sgn = 1;
        } else {
            goto refuse; /* negative fixint, nil, float, str, ...: not a token id */
        }
        if (len - i < w) goto refuse;
        u64 x = be(d + i, w);
        i += w;
        if (sgn && (x >> (8 * w - 1)) & 1) goto refuse; /* negative */
        if (x > (u64)INT64_MAX) goto refuse;
        v[k] = x;
    }
    if (i != len) goto refuse;
    *out = v;
    *count = n;
    return 1;
refuse:
    free(v);
    return 0;
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
    long live = fz_live();
    PyObject *b = PyBytes_FromStringAndSize((const char *)data, (Py_ssize_t)size);
    if (!b) fz_fail("bytes");
    PyObject *got = mod_msgpack_tokens(NULL, b);
    Py_DECREF(b);
    u64 *want = NULL;
    size_t n = 0;
    int ok = ref_tokens(data, size, &want, &n);
    if (!got) {
        if (!PyErr_ExceptionMatches(PyExc_ValueError)) fz_fail("msgpack_tokens raised something else than ValueError");
        PyErr_Clear();
        if (ok) fz_fail("msgpack_tokens refused what the reference accepts");
        fz_no_leak(live);
        return 0;
    }
    if (!ok) fz_fail("msgpack_tokens accepted what the reference refuses");
    if ((size_t)PyBytes_GET_SIZE(got) != n * 8 || memcmp(PyBytes_AS_STRING(got), want, n * 8) != 0)
        fz_fail("msgpack_tokens read other values than the reference");
    Py_DECREF(got);
    free(want);
    fz_no_leak(live);
    return 0;
}
