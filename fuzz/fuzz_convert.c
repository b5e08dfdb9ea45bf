/*
 * Fuzz target: Python objects -> native words (csrc/convert.c): tokens_from
 * (strict and wrapping), a query's lazy conversion (toks_open, toks_convert
 * in fuzzed chunk sizes) and ext_key, on lists, tuples, buffers of every
 * integer format and wrong types that fuzz_targets.convert_case builds from
 * the input. The expected answers are fuzz_targets.check_*.
 */
#include "embed.h"

#include "convert.h"

static PyObject *words(const u64 *v, Py_ssize_t n) {
    return PyBytes_FromStringAndSize((const char *)v, n * (Py_ssize_t)sizeof(u64));
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
    long live = fz_live();
    PyObject *f = PyObject_GetAttrString(fz_py, "convert_case");
    PyObject *obj = f ? PyObject_CallFunction(f, "y#", (const char *)data, (Py_ssize_t)size) : NULL;
    Py_XDECREF(f);
    if (!obj) fz_fail("convert_case");
    for (int strict = 0; strict < 2; strict++) {
        Py_ssize_t n = 0;
        u64 *v = tokens_from(obj, &n, strict);
        PyObject *got = v ? words(v, n) : Py_NewRef(Py_None);
        PyObject *err = v ? Py_NewRef(Py_None) : fz_take_error();
        tsr_free(v);
        fz_check("check_tokens", Py_BuildValue("(OOOO)", obj, strict ? Py_True : Py_False, got, err));
        Py_DECREF(got);
        Py_DECREF(err);
    }
    Toks t;
    PyObject *got = Py_None, *err = Py_None;
    Py_INCREF(got);
    Py_INCREF(err);
    if (toks_open(obj, &t) < 0) {
        Py_SETREF(err, fz_take_error());
    } else {
        /* the walk asks for block after block: chunks of a fuzzed size */
        Py_ssize_t step = 1 + (size ? data[size - 1] : 0) * 7;
        while (t.nconv < t.ntok && toks_need(&t, t.nconv + step)) {
        }
        if (t.err)
            Py_SETREF(err, fz_take_error());
        else if (!t.slow)
            Py_SETREF(got, words(t.buf, t.ntok));
        fz_check("check_lazy", Py_BuildValue("(OOOO)", obj, got, t.slow ? Py_True : Py_False, err));
        toks_close(&t);
        Py_SETREF(err, Py_NewRef(Py_None));
    }
    if (err != Py_None) fz_check("check_lazy", Py_BuildValue("(OOOO)", obj, Py_None, Py_False, err));
    Py_DECREF(got);
    Py_DECREF(err);
    if (PyList_Check(obj)) {
        for (Py_ssize_t i = 0; i < PyList_GET_SIZE(obj); i++) {
            PyObject *item = PyList_GET_ITEM(obj, i);
            u64 key = 0;
            u8 kind = 0;
            if (ext_key(item, &key, &kind) < 0) {
                PyObject *e = fz_take_error();
                fz_check("check_ext", Py_BuildValue("(OOOO)", item, Py_None, Py_None, e));
                Py_DECREF(e);
            } else {
                fz_check("check_ext", Py_BuildValue("(OKiO)", item, (unsigned long long)key, (int)kind, Py_None));
            }
        }
    }
    if (PyErr_Occurred()) fz_fail("an exception left set");
    Py_DECREF(obj);
    fz_no_leak(live);
    return 0;
}
