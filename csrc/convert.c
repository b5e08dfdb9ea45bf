/* Python objects -> native words (convert.h). */
#include "convert.h"

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
    /* 0 or 1 digit; an int always has room for one digit, so it is read
     * before the test and selected after (no branch on the value) */
    Py_ssize_t size = Py_SIZE(it);
    digit d = ((PyLongObject *)it)->ob_digit[0];
    if ((size_t)size > 1) return 0;
    *v = size ? d : 0;
    return 1;
#endif
}

/* An exact int in [0, 2**30) (3.11: one digit) or a compact non-negative one
 * (3.12+): the common token id, read with no call and one type test. */
static inline int fast_token(PyObject *it, u64 *v) {
    if (!Py_IS_TYPE(it, &PyLong_Type)) return 0;
    return small_int(it, v);
}

/* One token id by the API (strict: refuse negatives and ids >= 2**64; else wrap
 * them modulo 2**64): the rare item, out of the loops below. */
static int conv_item(PyObject *it, int strict, u64 *out) {
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

u64 *tokens_from(PyObject *obj, Py_ssize_t *n_out, int strict) {
    if (PyBytes_Check(obj) || PyByteArray_Check(obj) || PyUnicode_Check(obj)) {
        PyErr_SetString(PyExc_TypeError, "token_ids must be a sequence of ints, not bytes or str");
        return NULL;
    }
    if (!PyList_Check(obj) && !PyTuple_Check(obj) && PyObject_CheckBuffer(obj)) {
        Py_buffer view;
        if (PyObject_GetBuffer(obj, &view, PyBUF_FORMAT | PyBUF_ND) == 0) {
            const char *f = view.format ? view.format : "B";
            if (*f == '<' || *f == '=' || *f == '@') f++;
            char fc = f[0];
            int ok = f[0] && !f[1] && view.ndim == 1 && strchr("bBhHiIlLqQnN", fc) && PyBuffer_IsContiguous(&view, 'C');
            if (ok) {
                Py_ssize_t n = view.shape ? view.shape[0] : view.len / view.itemsize;
                u64 *out = tsr_malloc((size_t)(n ? n : 1) * sizeof(u64));
                if (!out) {
                    PyBuffer_Release(&view);
                    PyErr_NoMemory();
                    return NULL;
                }
                int isz = (int)view.itemsize;
                int sgn = strchr("bhilqn", fc) != NULL;
                const char *p = view.buf;
                int bad = 0;
                if (isz == 8 && !sgn) {
                    memcpy(out, p, (size_t)n * 8);
                } else {
                    for (Py_ssize_t i = 0; i < n; i++) {
                        int64_t v;
                        u64 uv;
                        switch (isz) {
                        case 1: v = sgn ? (int64_t)((const int8_t *)p)[i] : (int64_t)((const u8 *)p)[i]; break;
                        case 2: v = sgn ? (int64_t)((const int16_t *)p)[i] : (int64_t)((const uint16_t *)p)[i]; break;
                        case 4: v = sgn ? (int64_t)((const int32_t *)p)[i] : (int64_t)((const u32 *)p)[i]; break;
                        default:
                            memcpy(&uv, p + i * 8, 8);
                            v = (int64_t)uv;
                        }
                        if (sgn && v < 0) {
                            if (strict) {
                                bad = 1;
                                break;
                            }
                        }
                        out[i] = (u64)v;
                    }
                }
                PyBuffer_Release(&view);
                if (bad) {
                    tsr_free(out);
                    PyErr_SetString(PyExc_OverflowError, "token ids must be non-negative");
                    return NULL;
                }
                *n_out = n;
                return out;
            }
            int is_float = strchr("efdg", fc) != NULL || fc == '?';
            PyBuffer_Release(&view);
            if (is_float) {
                PyErr_Format(PyExc_TypeError, "token_ids must be integers, got buffer format %s", view.format ? view.format : "?");
                return NULL;
            }
        } else {
            PyErr_Clear();
        }
    }
    PyObject *seq = PySequence_Fast(obj, "token_ids must be a sequence of ints");
    if (!seq) return NULL;
    Py_ssize_t n = PySequence_Fast_GET_SIZE(seq);
    PyObject **items = PySequence_Fast_ITEMS(seq);
    u64 *out = tsr_malloc((size_t)(n ? n : 1) * sizeof(u64));
    if (!out) {
        Py_DECREF(seq);
        PyErr_NoMemory();
        return NULL;
    }
    /* as toks_convert: the item TOK_AHEAD ahead prefetched, one type test per item */
    Py_ssize_t i = 0;
    for (; i < n - TOK_AHEAD; i++) {
        __builtin_prefetch(items[i + TOK_AHEAD]);
        if (!fast_token(items[i], &out[i]) && conv_item(items[i], strict, &out[i]) < 0) goto fail;
    }
    for (; i < n; i++)
        if (!fast_token(items[i], &out[i]) && conv_item(items[i], strict, &out[i]) < 0) goto fail;
    Py_DECREF(seq);
    *n_out = n;
    return out;
fail:
    tsr_free(out);
    Py_DECREF(seq);
    return NULL;
}

/* The rare item: an int subclass (bool, IntEnum), a big int, or not an int. */
static int token_slow(Toks *t, PyObject *it, u64 *out) {
    if (!PyLong_Check(it)) {
        t->slow = 1;
        return 0;
    }
    if (conv_item(it, 1, out) < 0) {
        t->err = 1;
        return 0;
    }
    return 1;
}

int toks_convert(Toks *t, Py_ssize_t upto) {
    if (t->err || t->slow) return 0;
    Py_ssize_t want = upto < t->nconv + 256 ? t->nconv + 256 : upto;
    if (want > t->ntok) want = t->ntok;
    PyObject **items = PySequence_Fast_ITEMS(t->seq);
    u64 *buf = t->buf;
    Py_ssize_t i = t->nconv;
    /* int objects live all over the heap: each item's object is prefetched
     * TOK_AHEAD items ahead (into the next chunk too), no bound test per item */
    Py_ssize_t ahead_end = t->ntok - TOK_AHEAD < want ? t->ntok - TOK_AHEAD : want;
    for (; i < ahead_end; i++) {
        __builtin_prefetch(items[i + TOK_AHEAD]);
        if (!fast_token(items[i], &buf[i]) && !token_slow(t, items[i], &buf[i])) return 0;
    }
    for (; i < want; i++)
        if (!fast_token(items[i], &buf[i]) && !token_slow(t, items[i], &buf[i])) return 0;
    t->nconv = want;
    return 1;
}

int toks_open(PyObject *obj, Toks *t) {
    memset(t, 0, sizeof(*t));
    if (PyList_CheckExact(obj) || PyTuple_CheckExact(obj)) {
        t->ntok = PySequence_Fast_GET_SIZE(obj);
        t->buf = tsr_malloc((size_t)(t->ntok ? t->ntok : 1) * sizeof(u64));
        if (!t->buf) {
            PyErr_NoMemory();
            return -1;
        }
        Py_INCREF(obj);
        t->seq = obj;
        return 0;
    }
    t->buf = tokens_from(obj, &t->ntok, 1);
    if (!t->buf) return -1;
    t->nconv = t->ntok;
    return 0;
}

void toks_close(Toks *t) {
    tsr_free(t->buf);
    Py_CLEAR(t->seq);
}

static inline int long_sign(PyObject *o) {
#if PY_VERSION_HEX >= 0x030E0000
    int sign = 0;
    PyLong_GetSign(o, &sign);
    return sign;
#else
    return _PyLong_Sign(o);
#endif
}

/* An exact int in [-2**63, 2**64) read from its digits, without the generic
 * conversion calls (block hashes are 64-bit: 3 digits, never "compact").
 * 0: not handled here (other versions, subclasses, out of range): use the API. */
static inline int fast_ext_int(PyObject *o, u64 *key, u8 *kind) {
#if PyLong_SHIFT == 30 && PY_VERSION_HEX < 0x030E0000
    if (!PyLong_CheckExact(o)) return 0;
#if PY_VERSION_HEX < 0x030C0000
    Py_ssize_t size = Py_SIZE(o);
    const digit *d = ((PyLongObject *)o)->ob_digit;
    int neg = size < 0;
    Py_ssize_t nd = neg ? -size : size;
#else
    uintptr_t tag = ((PyLongObject *)o)->long_value.lv_tag;
    const digit *d = ((PyLongObject *)o)->long_value.ob_digit;
    int neg = (tag & 3) == 2;
    Py_ssize_t nd = (Py_ssize_t)(tag >> 3);
#endif
    u64 mag;
    switch (nd) {
    case 0: mag = 0; break;
    case 1: mag = d[0]; break;
    case 2: mag = (u64)d[0] | ((u64)d[1] << 30); break;
    case 3:
        if (d[2] >= 16) return 0;
        mag = (u64)d[0] | ((u64)d[1] << 30) | ((u64)d[2] << 60);
        break;
    default: return 0;
    }
    if (!neg) {
        *key = mag;
        *kind = 0;
        return 1;
    }
    if (mag > ((u64)1 << 63)) return 0;
    *key = (u64)0 - mag; /* two's complement, as PyLong_AsLongLong gives it */
    *kind = M_SIGNED;
    return 1;
#else
    (void)o; (void)key; (void)kind;
    return 0;
#endif
}

int ext_key(PyObject *o, u64 *key, u8 *kind) {
    if (fast_ext_int(o, key, kind)) return 0;
    if (PyLong_Check(o)) {
        if (long_sign(o) >= 0) { /* the common case: one conversion */
            u64 v = PyLong_AsUnsignedLongLong(o);
            if (v == (u64)-1 && PyErr_Occurred()) {
                PyErr_SetString(PyExc_ValueError, "block hash out of the 64-bit range");
                return -1;
            }
            *key = v;
            *kind = 0;
            return 0;
        }
        int overflow = 0;
        long long sv = PyLong_AsLongLongAndOverflow(o, &overflow);
        if (overflow == 0) {
            if (sv == -1 && PyErr_Occurred()) return -1;
            *key = (u64)sv;
            *kind = sv < 0 ? M_SIGNED : 0;
            return 0;
        }
        if (overflow > 0) {
            u64 v = PyLong_AsUnsignedLongLong(o);
            if (v == (u64)-1 && PyErr_Occurred()) {
                PyErr_SetString(PyExc_ValueError, "block hash out of the 64-bit range");
                return -1;
            }
            *key = v;
            *kind = 0;
            return 0;
        }
        PyErr_SetString(PyExc_ValueError, "block hash out of the 64-bit range");
        return -1;
    }
    if (PyBytes_Check(o)) {
        *key = XXH3_64bits_withSeed(PyBytes_AS_STRING(o), (size_t)PyBytes_GET_SIZE(o), 0x7473726f75746572ULL);
        *kind = M_BYTES;
        return 0;
    }
    PyErr_Format(PyExc_TypeError, "block hash must be int or bytes, got %.80s", Py_TYPE(o)->tp_name);
    return -1;
}
