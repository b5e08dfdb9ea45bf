/*
 * zmq_drain: read every message waiting on a ZeroMQ socket in one call.
 *
 * Why: pyzmq costs about 15-25 us of Python per three-frame message on this
 * project's machines (a recv per frame, a getsockopt(RCVMORE) that builds an
 * Enum per frame, and a raised zmq.Again to end each drain), more than
 * applying the batch the message carries (issue 33's profile,
 * docs/service.md). Here one C call reads up to max_messages messages with
 * ZMQ_DONTWAIT and hands back their frames as bytes: no exception, no Enum,
 * one Python call per drain.
 *
 * Which libzmq: the very library pyzmq loaded, found by the caller
 * (events/zmq_native.py reads /proc/self/maps) and opened here with
 * RTLD_NOLOAD, so it is never a second copy: the socket pointer
 * (pyzmq's Socket.underlying) belongs to it. Only the libzmq C API's stable
 * message functions are used (zmq.h, libzmq >= 4.0; zmq_msg_t is 64 opaque
 * bytes since 4.0). If anything is missing, zmq_link returns False and the
 * caller keeps pyzmq's path.
 *
 * Threading: the caller owns the socket (ZeroMQ sockets are not thread
 * safe); the GIL is held throughout (a non-blocking read of a waiting message
 * is a copy; handing the GIL over would cost more).
 */
#define _GNU_SOURCE
#include "common.h"

#include <dlfcn.h>
#include <errno.h>

#include "module.h"

typedef struct {
    unsigned char _[64];
} __attribute__((aligned(8))) zmsg; /* zmq_msg_t */

#define ZDONTWAIT 1
/* frames kept per message at most: more cannot be a valid batch; the rest is read and dropped */
#define MAX_FRAMES 16

static int (*p_init)(zmsg *);
static int (*p_recv)(zmsg *, void *, int);
static void *(*p_data)(zmsg *);
static size_t (*p_size)(const zmsg *);
static int (*p_more)(const zmsg *);
static int (*p_close)(zmsg *);
static int (*p_errno)(void);
static int (*p_send)(void *, const void *, size_t, int);

/* zmq_link(path) -> bool: resolve the message functions of the libzmq already loaded from path. */
PyObject *mod_zmq_link(PyObject *m, PyObject *arg) {
    const char *path = PyUnicode_AsUTF8(arg);
    if (!path) return NULL;
    void *h = dlopen(path, RTLD_NOW | RTLD_NOLOAD);
    if (!h) Py_RETURN_FALSE;
    p_init = (int (*)(zmsg *))dlsym(h, "zmq_msg_init");
    p_recv = (int (*)(zmsg *, void *, int))dlsym(h, "zmq_msg_recv");
    p_data = (void *(*)(zmsg *))dlsym(h, "zmq_msg_data");
    p_size = (size_t(*)(const zmsg *))dlsym(h, "zmq_msg_size");
    p_more = (int (*)(const zmsg *))dlsym(h, "zmq_msg_more");
    p_close = (int (*)(zmsg *))dlsym(h, "zmq_msg_close");
    p_errno = (int (*)(void))dlsym(h, "zmq_errno");
    p_send = (int (*)(void *, const void *, size_t, int))dlsym(h, "zmq_send");
    /* the handle stays open: the functions are used for the life of the process */
    if (!p_init || !p_recv || !p_data || !p_size || !p_more || !p_close || !p_errno || !p_send) {
        p_recv = NULL;
        Py_RETURN_FALSE;
    }
    Py_RETURN_TRUE;
}

/* One frame into a new bytes object (NULL: out of memory, error set). */
static PyObject *frame_bytes(zmsg *msg) {
    return PyBytes_FromStringAndSize((const char *)p_data(msg), (Py_ssize_t)p_size(msg));
}

/* zmq_drain(socket_address, max_messages) -> [[frame, ...], ...]: every whole message waiting
 * (at most max_messages), each as its list of frames; [] when none. A libzmq error other than
 * EAGAIN (a closed socket, a terminated context) raises OSError when nothing was read yet. */
PyObject *mod_zmq_drain(PyObject *m, PyObject *args) {
    unsigned long long addr;
    Py_ssize_t max_messages;
    if (!PyArg_ParseTuple(args, "Kn", &addr, &max_messages)) return NULL;
    if (!p_recv) {
        PyErr_SetString(PyExc_RuntimeError, "zmq_drain: zmq_link found no libzmq");
        return NULL;
    }
    void *sock = (void *)(uintptr_t)addr;
    PyObject *out = PyList_New(0);
    if (!out) return NULL;
    zmsg msg;
    for (Py_ssize_t n = 0; n < max_messages; n++) {
        p_init(&msg);
        if (p_recv(&msg, sock, ZDONTWAIT) < 0) {
            int err = p_errno();
            p_close(&msg);
            if (err != EAGAIN && PyList_GET_SIZE(out) == 0) {
                Py_DECREF(out);
                errno = err;
                return PyErr_SetFromErrno(PyExc_OSError);
            }
            break;
        }
        PyObject *frames = PyList_New(0);
        int more;
        for (;;) {
            more = p_more(&msg);
            if (frames && PyList_GET_SIZE(frames) < MAX_FRAMES) {
                PyObject *b = frame_bytes(&msg);
                if (!b || PyList_Append(frames, b) < 0) Py_CLEAR(frames);
                Py_XDECREF(b);
            }
            p_close(&msg);
            if (!more) break;
            p_init(&msg);
            if (p_recv(&msg, sock, ZDONTWAIT) < 0) { /* cannot happen: the parts arrive together */
                p_close(&msg);
                break;
            }
        }
        if (!frames || PyList_Append(out, frames) < 0) {
            Py_XDECREF(frames);
            Py_DECREF(out);
            if (!PyErr_Occurred()) PyErr_NoMemory();
            return NULL;
        }
        Py_DECREF(frames);
    }
    return out;
}

/* zmq_send_all(socket_address, messages) -> messages sent: each message (a list of bytes
 * frames) with ZMQ_DONTWAIT, in order; stops at the first frame libzmq refuses (EAGAIN: the
 * peer is not reading; what a ROUTER socket says only with ZMQ_ROUTER_MANDATORY). The replies
 * of a burst in one call: pyzmq's send type-checks and builds Enum flags per frame. */
#define ZSNDMORE 2
PyObject *mod_zmq_send_all(PyObject *m, PyObject *args) {
    unsigned long long addr;
    PyObject *messages;
    if (!PyArg_ParseTuple(args, "KO!", &addr, &PyList_Type, &messages)) return NULL;
    if (!p_send) {
        PyErr_SetString(PyExc_RuntimeError, "zmq_send_all: zmq_link found no libzmq");
        return NULL;
    }
    void *sock = (void *)(uintptr_t)addr;
    Py_ssize_t n = PyList_GET_SIZE(messages), sent = 0;
    for (; sent < n; sent++) {
        PyObject *frames = PyList_GET_ITEM(messages, sent);
        if (!PyList_Check(frames) || PyList_GET_SIZE(frames) == 0) {
            PyErr_SetString(PyExc_TypeError, "zmq_send_all: each message is a non-empty list of bytes");
            return NULL;
        }
        Py_ssize_t k = PyList_GET_SIZE(frames);
        for (Py_ssize_t i = 0; i < k; i++) {
            PyObject *f = PyList_GET_ITEM(frames, i);
            if (!PyBytes_Check(f)) {
                PyErr_SetString(PyExc_TypeError, "zmq_send_all: frames are bytes");
                return NULL;
            }
            if (p_send(sock, PyBytes_AS_STRING(f), (size_t)PyBytes_GET_SIZE(f), ZDONTWAIT | (i + 1 < k ? ZSNDMORE : 0)) < 0)
                return PyLong_FromSsize_t(sent);
        }
    }
    return PyLong_FromSsize_t(sent);
}
