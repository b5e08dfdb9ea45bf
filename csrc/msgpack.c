/* The msgpack token reader: a request's raw token_ids array -> native u64s. */
#include "module.h"

/* msgpack_tokens(raw) -> bytes: a msgpack array of token ids (the raw
 * ``token_ids`` field of a ZMQ API request) as native u64s, for the index to
 * read in place. Building 1k Python ints only to read them back costs more
 * than the whole routing decision; this reads the wire bytes once. Accepts
 * exactly what the typed decoder accepts (ints in [0, 2**63)); anything else is
 * a ValueError worded like msgspec's, with the JSON path. */
static PyObject *tokens_type_error(const char *got, Py_ssize_t i) {
    if (i < 0) PyErr_Format(PyExc_ValueError, "Expected `array`, got `%s` - at `$.token_ids`", got);
    else PyErr_Format(PyExc_ValueError, "Expected `int`, got `%s` - at `$.token_ids[%zd]`", got, i);
    return NULL;
}

static const char *msgpack_kind(u8 b) {
    if (b <= 0x7f || b >= 0xe0 || (b >= 0xcc && b <= 0xd3)) return "int";
    if ((b & 0xe0) == 0xa0 || (b >= 0xd9 && b <= 0xdb)) return "str";
    if ((b & 0xf0) == 0x90 || b == 0xdc || b == 0xdd) return "array";
    if ((b & 0xf0) == 0x80 || b == 0xde || b == 0xdf) return "object";
    if (b == 0xc0) return "None";
    if (b == 0xc2 || b == 0xc3) return "bool";
    if (b == 0xca || b == 0xcb) return "float";
    if (b >= 0xc4 && b <= 0xc6) return "bytes";
    return "ext";
}

static inline u64 be_load(const u8 *p, int n) {
    u64 v = 0;
    for (int k = 0; k < n; k++) v = (v << 8) | p[k];
    return v;
}

PyObject *mod_msgpack_tokens(PyObject *m, PyObject *arg) {
    Py_buffer b;
    if (PyObject_GetBuffer(arg, &b, PyBUF_SIMPLE) < 0) return NULL;
    const u8 *p = b.buf, *end = p + b.len;
    PyObject *out = NULL;
    Py_ssize_t n;
    if (p >= end) {
        PyErr_SetString(PyExc_ValueError, "Input data was truncated");
        goto done;
    }
    if ((*p & 0xf0) == 0x90) {
        n = *p & 0x0f;
        p += 1;
    } else if (*p == 0xdc && end - p >= 3) {
        n = (Py_ssize_t)be_load(p + 1, 2);
        p += 3;
    } else if (*p == 0xdd && end - p >= 5) {
        n = (Py_ssize_t)be_load(p + 1, 4);
        p += 5;
    } else {
        tokens_type_error(msgpack_kind(*p), -1);
        goto done;
    }
    if (n > end - p) { /* every item takes at least one byte */
        PyErr_SetString(PyExc_ValueError, "Input data was truncated");
        goto done;
    }
    out = PyBytes_FromStringAndSize(NULL, n * 8);
    if (!out) goto done;
    u64 *dst = (u64 *)PyBytes_AS_STRING(out);
    for (Py_ssize_t i = 0; i < n; i++) {
        /* the count only bounds the items by one byte each: wider items can
         * end the input early (found by fuzz/fuzz_msgpack.c: this read past it) */
        if (p == end) {
            PyErr_SetString(PyExc_ValueError, "Input data was truncated");
            Py_CLEAR(out);
            goto done;
        }
        u8 t = *p;
        u64 v;
        int len;
        if (t <= 0x7f) {
            dst[i] = t;
            p++;
            continue;
        }
        if ((u8)(t - 0xcc) < 4 && end - p >= 9) {
            /* uint 8/16/32/64: one unaligned big-endian load and a shift, no
             * branch on the width (vocabulary ids mix uint16 and uint32). */
            int sz = 1 << (t - 0xcc);
            u64 x;
            memcpy(&x, p + 1, 8);
            v = __builtin_bswap64(x) >> (64 - 8 * sz);
            p += 1 + sz;
            if (v > (u64)INT64_MAX) {
                PyErr_Format(PyExc_ValueError, "Expected `int` <= 9223372036854775807 - at `$.token_ids[%zd]`", i);
                Py_CLEAR(out);
                goto done;
            }
            dst[i] = v;
            continue;
        }
        switch (t) {
        case 0xcc: len = 1; break;
        case 0xcd: len = 2; break;
        case 0xce: len = 4; break;
        case 0xcf: len = 8; break;
        case 0xd0: len = -1; break;
        case 0xd1: len = -2; break;
        case 0xd2: len = -4; break;
        case 0xd3: len = -8; break;
        default:
            if (t >= 0xe0) { /* negative fixint */
                PyErr_Format(PyExc_ValueError, "Expected `int` >= 0 - at `$.token_ids[%zd]`", i);
            } else {
                tokens_type_error(msgpack_kind(t), i);
            }
            Py_CLEAR(out);
            goto done;
        }
        int sz = len < 0 ? -len : len;
        if (end - p < 1 + sz) {
            PyErr_SetString(PyExc_ValueError, "Input data was truncated");
            Py_CLEAR(out);
            goto done;
        }
        switch (sz) { /* big-endian payloads */
        case 1: v = p[1]; break;
        case 2: { uint16_t x; memcpy(&x, p + 1, 2); v = __builtin_bswap16(x); break; }
        case 4: { u32 x; memcpy(&x, p + 1, 4); v = __builtin_bswap32(x); break; }
        default: { u64 x; memcpy(&x, p + 1, 8); v = __builtin_bswap64(x); }
        }
        p += 1 + sz;
        if (len < 0 && sz < 8 && (v >> (8 * sz - 1))) v |= ~(u64)0 << (8 * sz); /* sign-extend */
        if (len < 0 && (int64_t)v < 0) {
            PyErr_Format(PyExc_ValueError, "Expected `int` >= 0 - at `$.token_ids[%zd]`", i);
            Py_CLEAR(out);
            goto done;
        }
        if (v > (u64)INT64_MAX) {
            PyErr_Format(PyExc_ValueError, "Expected `int` <= 9223372036854775807 - at `$.token_ids[%zd]`", i);
            Py_CLEAR(out);
            goto done;
        }
        dst[i] = v;
    }
    if (p != end) {
        PyErr_SetString(PyExc_ValueError, "trailing bytes after the token_ids array");
        Py_CLEAR(out);
    }
done:
    PyBuffer_Release(&b);
    return out;
}
