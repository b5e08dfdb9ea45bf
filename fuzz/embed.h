/*
 * What every fuzz target shares: CPython embedded, with the extension's own
 * C files of csrc/ (compiled into the target, instrumented) registered as the builtin
 * module tokenspeed_router._native before anything imports the package, and
 * fuzz/fuzz_targets.py imported for the checks written in Python.
 *
 * Why embed Python rather than link the decoders alone: convert.c works on
 * Python objects by design, and raw_apply drives the real Core (a Python
 * type: its lock, its worker dict, the bytes-id dicts). Factoring the pure-C
 * parts out would fuzz a rearranged copy of ingest_decode.c, which issue 27
 * may restructure anyway; this fuzzes the very files setup.py compiles.
 *
 * Python objects are allocated with malloc (PYMEM_ALLOCATOR_MALLOC), so
 * AddressSanitizer also sees a reference the extension drops too early.
 * libFuzzer calls LLVMFuzzerInitialize; fuzz/driver.c (the build without
 * libFuzzer) does the same.
 */
#ifndef TSR_FUZZ_EMBED_H
#define TSR_FUZZ_EMBED_H

#include "common.h"

#include <stdio.h>

#ifndef TSR_FUZZ
#error "fuzz/run.py builds the targets with -DTSR_FUZZ"
#endif

PyMODINIT_FUNC PyInit__native(void);

/* fuzz/driver.c's hook: write the input being run before dying (libFuzzer
 * keeps it itself; this weak NULL is what a libFuzzer build links). */
__attribute__((weak)) void (*fz_on_finding)(void) = NULL;

static PyObject *fz_py; /* the module fuzz_targets */

/* A finding: show the Python error, keep the input, abort. */
static void fz_fail(const char *what) {
    if (PyErr_Occurred()) PyErr_Print();
    fprintf(stderr, "==fuzz== finding: %s\n", what);
    fflush(stderr);
    if (fz_on_finding) fz_on_finding();
    abort();
}

int LLVMFuzzerInitialize(int *argc, char ***argv) {
    (void)argc;
    (void)argv;
    if (PyImport_AppendInittab("tokenspeed_router._native", PyInit__native) < 0) fz_fail("inittab");
    PyPreConfig pre;
    PyPreConfig_InitPythonConfig(&pre);
    pre.allocator = PYMEM_ALLOCATOR_MALLOC;
    PyStatus st = Py_PreInitialize(&pre);
    if (PyStatus_Exception(st)) Py_ExitStatusException(st);
    PyConfig cfg;
    PyConfig_InitPythonConfig(&cfg);
    cfg.install_signal_handlers = 0; /* the fuzzer's own */
    cfg.parse_argv = 0;
    cfg.write_bytecode = 0;
    st = Py_InitializeFromConfig(&cfg);
    PyConfig_Clear(&cfg);
    if (PyStatus_Exception(st)) Py_ExitStatusException(st);
    fz_py = PyImport_ImportModule("fuzz_targets");
    if (!fz_py) fz_fail("cannot import fuzz_targets (run through fuzz/run.py, which sets PYTHONPATH)");
    return 0;
}

/* The extension's live allocations must come back to what they were before an
 * input (csrc/common.h counts them in the fuzz build, -DTSR_FUZZ). */
static inline long fz_live(void) { return __atomic_load_n(&tsr_live_allocs, __ATOMIC_RELAXED); }

static inline void fz_no_leak(long before) {
    if (fz_live() != before) {
        fprintf(stderr, "==fuzz== the extension holds %ld blocks more than before the input\n", fz_live() - before);
        fz_fail("leak");
    }
}

/* The pending exception as an object (new reference), or Py_None; clears it. */
static inline PyObject *fz_take_error(void) {
    PyObject *t, *v, *tb;
    PyErr_Fetch(&t, &v, &tb);
    if (!t) return Py_NewRef(Py_None);
    PyErr_NormalizeException(&t, &v, &tb);
    Py_XDECREF(t);
    Py_XDECREF(tb);
    return v ? v : Py_NewRef(Py_None);
}

/* Call fuzz_targets.<name>(args...) (args: new references, stolen); abort on an exception. */
static inline void fz_check(const char *name, PyObject *args) {
    if (!args) fz_fail("building the check's arguments");
    PyObject *f = PyObject_GetAttrString(fz_py, name);
    PyObject *r = f ? PyObject_CallObject(f, args) : NULL;
    Py_XDECREF(f);
    Py_DECREF(args);
    if (!r) fz_fail(name);
    Py_DECREF(r);
}

#endif
