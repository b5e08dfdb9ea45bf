/*
 * The Python type tokenspeed_router._native.Core: argument parsing, the
 * locking and GIL discipline of every method (see native.c), and building the
 * results. The semantics live in index.c; this file only drives them.
 */
#include "core_type.h"
#include "index.h"
#include "ingest_decode.h"

static PyObject *str_gpu, *str_cpu, *str_storage; /* interned tier names of match_detail */

static PyObject *ext_obj(Worker *w, u64 key, u8 meta) {
    if (meta & M_BYTES) {
        PyObject *k = PyLong_FromUnsignedLongLong(key);
        if (!k) return NULL;
        PyObject *b = w->bytes_ids ? PyDict_GetItemWithError(w->bytes_ids, k) : NULL;
        Py_DECREF(k);
        if (!b) {
            if (!PyErr_Occurred()) PyErr_SetString(PyExc_RuntimeError, "bytes block id lost");
            return NULL;
        }
        Py_INCREF(b);
        return b;
    }
    if (meta & M_SIGNED) return PyLong_FromLongLong((long long)key);
    return PyLong_FromUnsignedLongLong(key);
}

/* Convert a list of external ids; records bytes originals in the worker's dict. */
static int ext_keys_from(Core *c, int s, PyObject *ids, u64 **keys_out, u8 **kinds_out, Py_ssize_t *n_out) {
    PyObject *seq = PySequence_Fast(ids, "block_hashes must be a sequence");
    if (!seq) return -1;
    Py_ssize_t n = PySequence_Fast_GET_SIZE(seq);
    PyObject **items = PySequence_Fast_ITEMS(seq);
    u64 *keys = tsr_malloc((size_t)(n ? n : 1) * sizeof(u64));
    u8 *kinds = tsr_malloc((size_t)(n ? n : 1));
    if (!keys || !kinds) {
        tsr_free(keys);
        tsr_free(kinds);
        Py_DECREF(seq);
        PyErr_NoMemory();
        return -1;
    }
    for (Py_ssize_t i = 0; i < n; i++) {
        if (ext_key(items[i], &keys[i], &kinds[i]) < 0) goto fail;
        if (kinds[i] & M_BYTES && s >= 0) {
            Worker *w = &c->w[s];
            if (!w->bytes_ids && !(w->bytes_ids = PyDict_New())) goto fail;
            PyObject *k = PyLong_FromUnsignedLongLong(keys[i]);
            if (!k) goto fail;
            int r = PyDict_SetItem(w->bytes_ids, k, items[i]);
            Py_DECREF(k);
            if (r < 0) goto fail;
        }
    }
    Py_DECREF(seq);
    *keys_out = keys;
    *kinds_out = kinds;
    *n_out = n;
    return 0;
fail:
    tsr_free(keys);
    tsr_free(kinds);
    Py_DECREF(seq);
    return -1;
}

static int slot_lookup(Core *c, PyObject *name) {
    PyObject *v = PyDict_GetItemWithError(c->slot_of, name);
    if (!v) {
        if (!PyErr_Occurred()) PyErr_SetObject(PyExc_KeyError, name);
        return -1;
    }
    return (int)PyLong_AsLong(v);
}

static PyObject *Core_new(PyTypeObject *type, PyObject *args, PyObject *kw) {
    Core *c = (Core *)type->tp_alloc(type, 0);
    if (!c) return NULL;
    pthread_rwlockattr_t attr;
    pthread_rwlockattr_init(&attr);
#ifdef __GLIBC__
    /* a steady stream of long (GIL-free) queries must not starve the writer */
    pthread_rwlockattr_setkind_np(&attr, PTHREAD_RWLOCK_PREFER_WRITER_NONRECURSIVE_NP);
#endif
    pthread_rwlock_init(&c->lock, &attr);
    pthread_rwlockattr_destroy(&attr);
    c->slot_of = PyDict_New();
    c->glob.W = 1;
    if (!c->slot_of) {
        Py_DECREF(c);
        return NULL;
    }
    return (PyObject *)c;
}

static void worker_free(Worker *w) {
    tab_free(&w->ext);
    tab_free(&w->aux);
    Py_CLEAR(w->name);
    Py_CLEAR(w->bytes_ids);
}

static void Core_dealloc(Core *c) {
    for (int s = 0; s < c->nslots; s++) worker_free(&c->w[s]);
    tsr_free(c->w);
    tsr_free(c->order);
    g_free(&c->glob);
    tsr_free(c->log);
    Py_XDECREF(c->slot_of);
    pthread_rwlock_destroy(&c->lock);
    Py_TYPE(c)->tp_free((PyObject *)c);
}

/* register(name): a new worker, last in order, in the lowest free slot (slots
 * of removed workers are reused, so churn does not grow the tables). Any
 * number of workers: the holder masks widen by one word per 64 slots. */
static PyObject *Core_register(Core *c, PyObject *name) {
    if (!PyUnicode_Check(name)) {
        PyErr_SetString(PyExc_TypeError, "worker name must be str");
        return NULL;
    }
    int known = PyDict_Contains(c->slot_of, name);
    if (known < 0) return NULL;
    if (known) Py_RETURN_NONE;
    int s = 0;
    while (s < c->nslots && c->w[s].used) s++;
    /* the name first: if the tables cannot grow, it is taken out again */
    PyObject *v = PyLong_FromLong(s);
    if (!v) return NULL;
    int r = PyDict_SetItem(c->slot_of, name, v);
    Py_DECREF(v);
    if (r < 0) return NULL;
    int err = 0;
    wlock(c);
    if (s == c->capslots) {
        int cap = c->capslots ? 2 * c->capslots : 8;
        Worker *nw = tsr_realloc(c->w, (size_t)cap * sizeof(Worker));
        if (nw) c->w = nw;
        int *no = nw ? tsr_realloc(c->order, (size_t)cap * sizeof(int)) : NULL;
        if (no) c->order = no;
        if (no) c->capslots = cap;
        else err = 1;
    }
    if (!err && (size_t)s >= 64 * W_OF(c) && g_rehash(&c->glob, c->glob.cap, W_OF(c) + 1) < 0) err = 1;
    if (!err) {
        if (s == c->nslots) {
            memset(&c->w[s], 0, sizeof(Worker));
            c->w[s].ext.nval = 1;
            c->w[s].aux.nval = 1;
            c->nslots++;
        }
        Worker *w = &c->w[s];
        w->used = 1;
        Py_INCREF(name);
        w->name = name;
        w->block_size = 0;
        c->order[c->norder++] = s;
        c->version++;
    }
    unlock(c);
    if (err) {
        if (PyDict_DelItem(c->slot_of, name) < 0) PyErr_Clear();
        return PyErr_NoMemory();
    }
    Py_RETURN_NONE;
}

static PyObject *Core_unregister(Core *c, PyObject *name) {
    int s = slot_lookup(c, name);
    if (s < 0) return NULL;
    Py_BEGIN_ALLOW_THREADS
    wlock(c);
    int was = c->logging;
    c->logging = 0;
    clear_blocks(c, s, ALL_TIERS);
    c->logging = was;
    int k = 0;
    for (int i = 0; i < c->norder; i++)
        if (c->order[i] != s) c->order[k++] = c->order[i];
    c->norder = k;
    c->w[s].used = 0;
    c->version++;
    unlock(c);
    Py_END_ALLOW_THREADS
    worker_free(&c->w[s]);
    c->w[s].ext.nval = 1;
    c->w[s].aux.nval = 1;
    if (PyDict_DelItem(c->slot_of, name) < 0) return NULL;
    Py_RETURN_NONE;
}

static PyObject *Core_workers(Core *c, PyObject *unused) {
    PyObject *out = PyList_New(c->norder);
    if (!out) return NULL;
    for (int i = 0; i < c->norder; i++) {
        PyObject *n = c->w[c->order[i]].name;
        Py_INCREF(n);
        PyList_SET_ITEM(out, i, n);
    }
    return out;
}

static PyObject *Core_set_block_size(Core *c, PyObject *args) {
    PyObject *name, *bs;
    if (!PyArg_ParseTuple(args, "OO", &name, &bs)) return NULL;
    int s = slot_lookup(c, name);
    if (s < 0) return NULL;
    long v = bs == Py_None ? 0 : PyLong_AsLong(bs);
    if (v == -1 && PyErr_Occurred()) return NULL;
    wlock(c);
    c->w[s].block_size = v;
    unlock(c);
    Py_RETURN_NONE;
}

/* What store and store_hashed answer: (new, duplicate) blocks, None when the
 * parent is unknown (nothing changed), or MemoryError (nothing changed: the
 * call runs as its own batch when none is open, and inside one the caller
 * rolls the batch back). */
static PyObject *stored_answer(int err, int unknown, long added, long dup) {
    if (err) return PyErr_NoMemory();
    if (unknown) Py_RETURN_NONE;
    return Py_BuildValue("ll", added, dup);
}

/* store(name, ext_ids, parent, root, tokens, block_size, nfull, tier, unmatchable)
 *   -> (new, duplicate) or None when the parent is unknown (nothing changed). */
static PyObject *Core_store(Core *c, PyObject *args) {
    PyObject *name, *ids, *parent, *tokens;
    unsigned long long root;
    long bs;
    Py_ssize_t nfull;
    int tier, unm;
    if (!PyArg_ParseTuple(args, "OOOKOlnip", &name, &ids, &parent, &root, &tokens, &bs, &nfull, &tier, &unm))
        return NULL;
    int s = slot_lookup(c, name);
    if (s < 0) return NULL;
    u64 pkey = 0;
    u8 pkind = 0;
    if (parent != Py_None && ext_key(parent, &pkey, &pkind) < 0) return NULL;
    Py_ssize_t ntok;
    u64 *toks = tokens_from(tokens, &ntok, 0);
    if (!toks) return NULL;
    u64 *keys;
    u8 *kinds;
    Py_ssize_t n;
    if (ext_keys_from(c, s, ids, &keys, &kinds, &n) < 0) {
        tsr_free(toks);
        return NULL;
    }
    if (bs <= 0 || nfull < 0 || nfull > n || nfull * bs > ntok || n - nfull > 1) {
        tsr_free(toks);
        tsr_free(keys);
        tsr_free(kinds);
        PyErr_SetString(PyExc_ValueError, "inconsistent store arguments");
        return NULL;
    }
    long added = 0, dup = 0;
    int unknown = 0, err = 0;
    PyThreadState *ts = NULL;
    if (n >= RELEASE_GIL_BLOCKS) ts = PyEval_SaveThread();
    wlock(c);
    u64 h = root;
    if (parent != Py_None) {
        Worker *w = &c->w[s];
        Py_ssize_t i = ext_find(w, pkey, pkind);
        if (i < 0) {
            unknown = 1;
        } else {
            h = w->ext.vals[i];
            if (w->ext.meta[i] & M_UNM) unm = 1;
        }
    }
    if (!unknown) {
        int own = txn_open(c);
        err = hold_chain(c, s, keys, kinds, toks, n, ntok, bs, nfull, h, unm, (u8)tier, &added, &dup);
        txn_close(c, own, err);
    }
    unlock(c);
    if (ts) PyEval_RestoreThread(ts);
    tsr_free(toks);
    tsr_free(keys);
    tsr_free(kinds);
    return stored_answer(err, unknown, added, dup);
}

/* store_hashed(name, ext_ids, parent, contents, unmatchable_flags (bytes or None), tier)
 *   -> (new, duplicate) or None when the parent is unknown. */
static PyObject *Core_store_hashed(Core *c, PyObject *args) {
    PyObject *name, *ids, *parent, *contents, *flags;
    int tier;
    if (!PyArg_ParseTuple(args, "OOOOOi", &name, &ids, &parent, &contents, &flags, &tier)) return NULL;
    int s = slot_lookup(c, name);
    if (s < 0) return NULL;
    u64 pkey = 0;
    u8 pkind = 0;
    if (parent != Py_None && ext_key(parent, &pkey, &pkind) < 0) return NULL;
    Py_ssize_t nc;
    u64 *cs = tokens_from(contents, &nc, 1);
    if (!cs) return NULL;
    u64 *keys;
    u8 *kinds;
    Py_ssize_t n;
    if (ext_keys_from(c, s, ids, &keys, &kinds, &n) < 0) {
        tsr_free(cs);
        return NULL;
    }
    const char *fl = NULL;
    if (flags != Py_None) {
        if (!PyBytes_Check(flags) || PyBytes_GET_SIZE(flags) != n) {
            PyErr_SetString(PyExc_ValueError, "unmatchable flags must be bytes of one flag per block");
            goto bad;
        }
        fl = PyBytes_AS_STRING(flags);
    }
    if (nc != n) {
        PyErr_SetString(PyExc_ValueError, "one content id per block hash");
        goto bad;
    }
    long added = 0, dup = 0;
    int unknown = 0, punm = 0, err = 0;
    Py_ssize_t nflagged = 0;
    for (Py_ssize_t i = 0; fl && i < n; i++) nflagged += fl[i] != 0;
    PyThreadState *ts = NULL;
    if (n >= RELEASE_GIL_BLOCKS) ts = PyEval_SaveThread();
    wlock(c);
    if (parent != Py_None) {
        Worker *w = &c->w[s];
        Py_ssize_t i = ext_find(w, pkey, pkind);
        if (i < 0)
            unknown = 1;
        else
            punm = (w->ext.meta[i] & M_UNM) != 0;
    }
    if (!unknown) {
        Worker *w = &c->w[s];
        int own = txn_open(c);
        /* room for the whole event first */
        if (tab_reserve(&w->ext, (size_t)n) < 0 || g_reserve(&c->glob, (size_t)n) < 0 ||
            tab_reserve(&w->aux, (size_t)(punm || tier != GPU ? n : nflagged)) < 0)
            err = E_NOMEM;
        for (Py_ssize_t i = 0; i < n && !err; i++) {
            int r = hold_block(c, s, keys[i], kinds[i], cs[i], punm || (fl && fl[i]), (u8)tier);
            if (r < 0) {
                err = r;
                break;
            }
            added += r;
            dup += 1 - r;
        }
        txn_close(c, own, err);
    }
    unlock(c);
    if (ts) PyEval_RestoreThread(ts);
    tsr_free(cs);
    tsr_free(keys);
    tsr_free(kinds);
    return stored_answer(err, unknown, added, dup);
bad:
    tsr_free(cs);
    tsr_free(keys);
    tsr_free(kinds);
    return NULL;
}

/* Drop originals of bytes ids no longer stored, once they are most of the dict
 * (amortised O(1) per removal; never inside a batch that may roll back).
 * Housekeeping, not the call's work: when it cannot build the smaller dict
 * (out of memory) the old one stays and the next removal tries again, so the
 * call that did its work still answers. */
static void prune_bytes(Core *c, int s) {
    Worker *w = &c->w[s];
    if (!w->bytes_ids || c->logging) return;
    Py_ssize_t have = PyDict_GET_SIZE(w->bytes_ids);
    if ((size_t)have < 2 * w->ext.len + 1024) return;
    PyObject *keep = PyDict_New();
    if (!keep) {
        PyErr_Clear();
        return;
    }
    for (size_t i = 0; i < w->ext.cap; i++) {
        if (!(w->ext.meta[i] & M_BYTES)) continue;
        PyObject *k = PyLong_FromUnsignedLongLong(w->ext.keys[i]);
        PyObject *v = k ? PyDict_GetItemWithError(w->bytes_ids, k) : NULL;
        if (!v || PyDict_SetItem(keep, k, v) < 0) {
            Py_XDECREF(k);
            Py_DECREF(keep);
            PyErr_Clear();
            return;
        }
        Py_DECREF(k);
    }
    Py_SETREF(w->bytes_ids, keep);
}

/* remove(name, ext_ids, tier, unspecified) -> (removed, unknown, tier_mismatches) */
static PyObject *Core_remove(Core *c, PyObject *args) {
    PyObject *name, *ids;
    int tier, unspecified;
    if (!PyArg_ParseTuple(args, "OOip", &name, &ids, &tier, &unspecified)) return NULL;
    int s = slot_lookup(c, name);
    if (s < 0) return NULL;
    PyObject *seq = PySequence_Fast(ids, "block_hashes must be a sequence");
    if (!seq) return NULL;
    Py_ssize_t n = PySequence_Fast_GET_SIZE(seq);
    PyObject **items = PySequence_Fast_ITEMS(seq);
    u64 *keys = tsr_malloc((size_t)(n ? n : 1) * sizeof(u64));
    u8 *kinds = tsr_malloc((size_t)(n ? n : 1));
    u8 *valid = tsr_malloc((size_t)(n ? n : 1));
    if (!keys || !kinds || !valid) {
        tsr_free(keys);
        tsr_free(kinds);
        tsr_free(valid);
        Py_DECREF(seq);
        return PyErr_NoMemory();
    }
    for (Py_ssize_t i = 0; i < n; i++) {
        valid[i] = ext_key(items[i], &keys[i], &kinds[i]) == 0;
        if (!valid[i]) { /* an id of no known shape is simply unknown */
            PyErr_Clear();
            keys[i] = 0;
            kinds[i] = 0;
        }
    }
    Py_DECREF(seq);
    long removed = 0, unknown = 0, mismatch = 0;
    int err = 0;
    PyThreadState *ts = NULL;
    if (n >= RELEASE_GIL_BLOCKS) ts = PyEval_SaveThread();
    wlock(c);
    {
        /* A software pipeline: the external id of block i+16 and the holder
         * slot of block i+8 are prefetched while block i is dropped, so a
         * dozen cache misses are in flight instead of one. */
        Worker *w = &c->w[s];
        enum { D1 = 16, D2 = 8 };
        for (Py_ssize_t i = 0; i < n + D1; i++) {
            if (i < n) tab_prefetch(&w->ext, keys[i]);
            Py_ssize_t j = i - D2;
            if (j >= 0 && j < n) {
                Py_ssize_t x = ext_find(w, keys[j], kinds[j]);
                if (x >= 0) g_prefetch(&c->glob, w->ext.vals[x]);
            }
            Py_ssize_t k = i - D1;
            if (k < 0) continue;
            int mm = 0;
            int r = valid[k] ? drop_block(c, s, keys[k], kinds[k], (u8)tier, unspecified, &mm) : -1;
            if (r == E_NOMEM) {
                err = r;
                break;
            }
            if (r < 0)
                unknown++;
            else
                removed += r;
            mismatch += mm;
        }
    }
    unlock(c);
    if (ts) PyEval_RestoreThread(ts);
    tsr_free(keys);
    tsr_free(kinds);
    tsr_free(valid);
    if (err) return PyErr_NoMemory();
    prune_bytes(c, s);
    return Py_BuildValue("lll", removed, unknown, mismatch);
}

/* clear(name, tier) -> blocks gone */
static PyObject *Core_clear(Core *c, PyObject *args) {
    PyObject *name;
    int tier;
    if (!PyArg_ParseTuple(args, "Oi", &name, &tier)) return NULL;
    int s = slot_lookup(c, name);
    if (s < 0) return NULL;
    Py_ssize_t gone;
    Py_BEGIN_ALLOW_THREADS
    wlock(c);
    gone = clear_blocks(c, s, (u8)tier);
    unlock(c);
    Py_END_ALLOW_THREADS
    if (c->w[s].ext.len == 0 && !c->logging) Py_CLEAR(c->w[s].bytes_ids);
    if (gone < 0) return PyErr_NoMemory();
    return PyLong_FromSsize_t(gone);
}

/* apply_raw(name, payload, block_size, root, salvage) -> None | result (ingest_decode.c) */
static PyObject *Core_apply_raw(Core *c, PyObject *args) {
    PyObject *name;
    Py_buffer buf;
    long bs;
    unsigned long long root;
    int salvage;
    if (!PyArg_ParseTuple(args, "Oy*lKp", &name, &buf, &bs, &root, &salvage)) return NULL;
    int s = slot_lookup(c, name);
    if (s < 0) {
        PyBuffer_Release(&buf);
        return NULL;
    }
    PyObject *out = raw_apply(c, s, buf.buf, buf.len, bs, root, salvage);
    PyBuffer_Release(&buf);
    if (out != NULL && out != Py_None) {
        if (c->w[s].ext.len == 0 && !c->logging)
            Py_CLEAR(c->w[s].bytes_ids);
        else
            prune_bytes(c, s);
    }
    return out;
}

/* apply_raw_many(names, payloads, block_sizes, root) -> [result | None | MemoryError, ...]:
 * apply_raw(name, payload, bs, root, False) for each job in order, the GIL given away once
 * for the whole run (when its payloads reach RAW_RELEASE_BYTES, ingest_decode.h) instead of
 * once per batch. Stops after the first
 * job the raw path does not take (None), refuses whole (unknown parent) or that runs out
 * of memory (the MemoryError instance in its place, nothing of it applied): one entry per
 * job tried, every job before the last entry applied. A bad argument raises before
 * anything is applied. */
static PyObject *Core_apply_raw_many(Core *c, PyObject *args) {
    PyObject *names, *payloads, *sizes;
    unsigned long long root;
    if (!PyArg_ParseTuple(args, "O!O!O!K", &PyList_Type, &names, &PyList_Type, &payloads, &PyList_Type, &sizes,
                          &root))
        return NULL;
    Py_ssize_t n = PyList_GET_SIZE(names);
    if (PyList_GET_SIZE(payloads) != n || PyList_GET_SIZE(sizes) != n) {
        PyErr_SetString(PyExc_ValueError, "apply_raw_many: names, payloads and block_sizes differ in length");
        return NULL;
    }
    Py_buffer *bufs = tsr_calloc((size_t)(n ? n : 1), sizeof(Py_buffer));
    int *slots = tsr_calloc((size_t)(n ? n : 1), sizeof(int));
    long *bss = tsr_calloc((size_t)(n ? n : 1), sizeof(long));
    RawRes *res = tsr_calloc((size_t)(n ? n : 1), sizeof(RawRes));
    PyObject *out = NULL;
    Py_ssize_t got = 0, tried = 0, total = 0;
    if (!bufs || !slots || !bss || !res) {
        PyErr_NoMemory();
        goto done;
    }
    for (; got < n; got++) {
        if ((slots[got] = slot_lookup(c, PyList_GET_ITEM(names, got))) < 0) goto done;
        bss[got] = PyLong_AsLong(PyList_GET_ITEM(sizes, got));
        if (bss[got] == -1 && PyErr_Occurred()) goto done;
        if (PyObject_GetBuffer(PyList_GET_ITEM(payloads, got), &bufs[got], PyBUF_SIMPLE) < 0) goto done;
        total += bufs[got].len;
    }
    PyThreadState *ts = total >= RAW_RELEASE_BYTES ? PyEval_SaveThread() : NULL;
    while (tried < n) {
        RawRes *r = &res[tried];
        raw_run(c, slots[tried], bufs[tried].buf, bufs[tried].len, bss[tried], root, 0, r, &ts);
        tried++;
        if (r->rc != RAW_OK || r->o.err || r->o.unknown_parent) break;
    }
    if (ts) PyEval_RestoreThread(ts);
    if (!(out = PyList_New(tried))) goto done;
    for (Py_ssize_t i = 0; i < tried; i++) {
        PyObject *one = raw_result(&res[i]);
        if (!one) { /* out of memory for that batch: hand the error over in its place */
            PyObject *type, *value, *tb;
            PyErr_Fetch(&type, &value, &tb);
            PyErr_NormalizeException(&type, &value, &tb);
            Py_XDECREF(type);
            Py_XDECREF(tb);
            one = value;
        }
        PyList_SET_ITEM(out, i, one);
    }
    for (Py_ssize_t i = 0; i < tried; i++) { /* as Core_apply_raw does after each batch */
        int s = slots[i];
        if (c->w[s].ext.len == 0 && !c->logging)
            Py_CLEAR(c->w[s].bytes_ids);
        else
            prune_bytes(c, s);
    }
done:
    for (Py_ssize_t i = 0; i < got; i++) PyBuffer_Release(&bufs[i]);
    tsr_free(bufs);
    tsr_free(slots);
    tsr_free(bss);
    tsr_free(res);
    return out;
}

static PyObject *Core_begin(Core *c, PyObject *unused) {
    wlock(c);
    c->nlog = 0;
    c->logging = 1;
    unlock(c);
    Py_RETURN_NONE;
}

static PyObject *Core_commit(Core *c, PyObject *unused) {
    wlock(c);
    commit_batch(c);
    unlock(c);
    Py_RETURN_NONE;
}

static PyObject *Core_rollback(Core *c, PyObject *unused) {
    int err;
    Py_BEGIN_ALLOW_THREADS
    wlock(c);
    err = undo_all(c);
    unlock(c);
    Py_END_ALLOW_THREADS
    if (err) {
        PyErr_SetString(PyExc_MemoryError, "rollback could not restore every block: clear the worker and resync it");
        return NULL;
    }
    Py_RETURN_NONE;
}

/* ---- matching */

static PyObject *do_match(Core *c, PyObject *args, int detail) {
    PyObject *tokens;
    unsigned long long root;
    if (!PyArg_ParseTuple(args, "OK", &tokens, &root)) return NULL;
    Toks toks;
    if (toks_open(tokens, &toks) < 0) return NULL;
    Py_ssize_t ntok = toks.ntok;
    MatchOut out;
    PyObject *result = NULL;
    int werr = 0;
    for (;;) {
        int ns = c->nslots;
        werr = 0;
        out.scores = tsr_calloc((size_t)(ns ? ns : 1), sizeof(long));
        out.tiers = tsr_calloc((size_t)(ns ? ns : 1) * 3, sizeof(long));
        if (!out.scores || !out.tiers) {
            tsr_free(out.scores);
            tsr_free(out.tiers);
            toks_close(&toks);
            return PyErr_NoMemory();
        }
        u64 version;
        if (ntok >= RELEASE_GIL_TOKENS && !toks.seq) {
            /* a buffer needs no Python object: hash and walk without the GIL */
            Py_BEGIN_ALLOW_THREADS
            rlock(c);
            version = c->version;
            if (c->nslots == ns) werr = walk(c, &toks, root, detail, &out);
            unlock(c);
            Py_END_ALLOW_THREADS
        } else {
            rlock(c);
            version = c->version;
            werr = walk(c, &toks, root, detail, &out);
            unlock(c);
        }
        if (toks.err || toks.slow) {
            tsr_free(out.scores);
            tsr_free(out.tiers);
            if (toks.err) {
                toks_close(&toks);
                return NULL;
            }
            /* items that are not ints (numpy scalars, ...): convert all now, then walk again */
            PyObject *seq = toks.seq;
            Py_INCREF(seq);
            toks_close(&toks);
            memset(&toks, 0, sizeof(toks));
            toks.buf = tokens_from(seq, &toks.ntok, 1);
            Py_DECREF(seq);
            if (!toks.buf) return NULL;
            toks.nconv = toks.ntok;
            continue;
        }
        if (version == c->version && ns == c->nslots) break;
        tsr_free(out.scores); /* the set of workers changed meanwhile: answer again */
        tsr_free(out.tiers);
    }
    toks_close(&toks);
    if (werr) {
        tsr_free(out.scores);
        tsr_free(out.tiers);
        return PyErr_NoMemory();
    }
    PyObject *scores = PyDict_New(), *tiers = NULL, *sizes = NULL;
    if (!scores) goto done;
    if (detail && (!(tiers = PyDict_New()) || !(sizes = PyDict_New()))) goto done;
    for (int oi = 0; oi < c->norder; oi++) {
        int s = c->order[oi];
        Worker *w = &c->w[s];
        PyObject *v = PyLong_FromLong(out.scores[s]);
        if (!v || PyDict_SetItem(scores, w->name, v) < 0) {
            Py_XDECREF(v);
            goto done;
        }
        Py_DECREF(v);
        if (!detail) continue;
        long *t = out.tiers + 3 * s;
        PyObject *td = Py_BuildValue("{OlOlOl}", str_gpu, t[0], str_cpu, t[1], str_storage, t[2]);
        if (!td || PyDict_SetItem(tiers, w->name, td) < 0) {
            Py_XDECREF(td);
            goto done;
        }
        Py_DECREF(td);
        if (w->block_size > 0) {
            PyObject *b = PyLong_FromLong(w->block_size);
            if (!b || PyDict_SetItem(sizes, w->name, b) < 0) {
                Py_XDECREF(b);
                goto done;
            }
            Py_DECREF(b);
        }
    }
    if (detail)
        result = PyTuple_Pack(3, scores, tiers, sizes);
    else {
        Py_INCREF(scores);
        result = scores;
    }
done:
    Py_XDECREF(scores);
    Py_XDECREF(tiers);
    Py_XDECREF(sizes);
    tsr_free(out.scores);
    tsr_free(out.tiers);
    return result;
}

static PyObject *Core_match(Core *c, PyObject *args) { return do_match(c, args, 0); }
static PyObject *Core_match_detail(Core *c, PyObject *args) { return do_match(c, args, 1); }

/* info(name) -> (block_size|None, blocks, gpu, cpu, storage, unmatchable, aliased, matchable) */
static PyObject *Core_info(Core *c, PyObject *name) {
    int s = slot_lookup(c, name);
    if (s < 0) return NULL;
    rlock(c);
    Worker *w = &c->w[s];
    long cpu = 0, sto = 0, notgpu = 0, unmc = 0, alias = 0;
    for (size_t i = 0; i < w->aux.cap; i++) {
        if (!w->aux.meta[i]) continue;
        long refs = (long)(w->aux.vals[i] >> 8);
        u8 t = (u8)(w->aux.vals[i] & 0xff);
        if (!(t & GPU)) notgpu += refs;
        if (t & CPU) cpu += refs;
        if (t & STORAGE) sto += refs;
        if (w->aux.meta[i] & M_UNM) unmc += refs;
        alias += refs - 1;
    }
    long n = (long)w->ext.len, bs = w->block_size, nm = (long)w->n_matchable;
    unlock(c);
    PyObject *b = bs > 0 ? PyLong_FromLong(bs) : Py_NewRef(Py_None);
    if (!b) return NULL;
    return Py_BuildValue("Nlllllll", b, n, n - notgpu, cpu, sto, unmc, alias, nm);
}

static PyObject *Core_num_distinct(Core *c, PyObject *unused) { return PyLong_FromSize_t(c->glob.len); }

static PyObject *Core_memory_bytes(Core *c, PyObject *unused) {
    rlock(c);
    size_t b = c->glob.cap * (1 + c->glob.W) * sizeof(u64) + (size_t)c->nslots * sizeof(Worker);
    for (int s = 0; s < c->nslots; s++) b += tab_bytes(&c->w[s].ext) + tab_bytes(&c->w[s].aux);
    unlock(c);
    return PyLong_FromSize_t(b);
}

/* items(name) -> (ext_ids, contents, unmatchable_indices, tier_indices, tier_codes) */
static PyObject *Core_items(Core *c, PyObject *name) {
    int s = slot_lookup(c, name);
    if (s < 0) return NULL;
    Worker *w = &c->w[s];
    size_t n = 0;
    u64 *keys = NULL, *vals = NULL;
    u8 *meta = NULL, *tiers = NULL;
    int oom = 0;
    Py_BEGIN_ALLOW_THREADS
    rlock(c);
    n = w->ext.len;
    keys = tsr_malloc((n ? n : 1) * sizeof(u64));
    vals = tsr_malloc((n ? n : 1) * sizeof(u64));
    meta = tsr_malloc(n ? n : 1);
    tiers = tsr_malloc(n ? n : 1);
    if (!keys || !vals || !meta || !tiers) {
        oom = 1;
    } else {
        size_t k = 0;
        for (size_t i = 0; i < w->ext.cap; i++) {
            if (!w->ext.meta[i]) continue;
            keys[k] = w->ext.keys[i];
            vals[k] = w->ext.vals[i];
            meta[k] = w->ext.meta[i];
            u32 refs;
            aux_get(w, vals[k], (meta[k] & M_UNM) != 0, &refs, &tiers[k]);
            k++;
        }
    }
    unlock(c);
    Py_END_ALLOW_THREADS
    PyObject *ext = NULL, *cont = NULL, *unmi = NULL, *ti = NULL, *tc = NULL, *res = NULL;
    if (oom) {
        PyErr_NoMemory();
        goto done;
    }
    if (!(ext = PyList_New((Py_ssize_t)n)) || !(cont = PyList_New((Py_ssize_t)n)) || !(unmi = PyList_New(0)) ||
        !(ti = PyList_New(0)) || !(tc = PyList_New(0)))
        goto done;
    for (size_t i = 0; i < n; i++) {
        PyObject *e = ext_obj(w, keys[i], meta[i]);
        if (!e) goto done;
        PyList_SET_ITEM(ext, (Py_ssize_t)i, e);
        PyObject *v = PyLong_FromUnsignedLongLong(vals[i]);
        if (!v) goto done;
        PyList_SET_ITEM(cont, (Py_ssize_t)i, v);
        if (meta[i] & M_UNM) {
            PyObject *ix = PyLong_FromSize_t(i);
            if (!ix || PyList_Append(unmi, ix) < 0) {
                Py_XDECREF(ix);
                goto done;
            }
            Py_DECREF(ix);
        }
        if (tiers[i] != GPU) {
            PyObject *ix = PyLong_FromSize_t(i), *code = PyLong_FromLong(tiers[i]);
            int bad = !ix || !code || PyList_Append(ti, ix) < 0 || PyList_Append(tc, code) < 0;
            Py_XDECREF(ix);
            Py_XDECREF(code);
            if (bad) goto done;
        }
    }
    res = PyTuple_Pack(5, ext, cont, unmi, ti, tc);
done:
    Py_XDECREF(ext);
    Py_XDECREF(cont);
    Py_XDECREF(unmi);
    Py_XDECREF(ti);
    Py_XDECREF(tc);
    tsr_free(keys);
    tsr_free(vals);
    tsr_free(meta);
    tsr_free(tiers);
    return res;
}

static PyMethodDef Core_methods[] = {
    {"register", (PyCFunction)Core_register, METH_O, "register(name): a new worker, last in order"},
    {"unregister", (PyCFunction)Core_unregister, METH_O, "unregister(name): drop its blocks and forget it"},
    {"workers", (PyCFunction)Core_workers, METH_NOARGS, "registered workers in order"},
    {"set_block_size", (PyCFunction)Core_set_block_size, METH_VARARGS, "set_block_size(name, bs|None)"},
    {"store", (PyCFunction)Core_store, METH_VARARGS, "hash and store one event's blocks"},
    {"store_hashed", (PyCFunction)Core_store_hashed, METH_VARARGS, "store blocks whose content ids are given"},
    {"remove", (PyCFunction)Core_remove, METH_VARARGS, "remove(name, ids, tier, unspecified)"},
    {"clear", (PyCFunction)Core_clear, METH_VARARGS, "clear(name, tier) -> blocks gone"},
    {"apply_raw", (PyCFunction)Core_apply_raw, METH_VARARGS, "apply_raw(name, payload, bs, root, salvage)"},
    {"apply_raw_many", (PyCFunction)Core_apply_raw_many, METH_VARARGS,
     "apply_raw_many(names, payloads, block_sizes, root): apply_raw of each in order, one GIL hand-over"},
    {"begin", (PyCFunction)Core_begin, METH_NOARGS, "start recording an undo log"},
    {"commit", (PyCFunction)Core_commit, METH_NOARGS, "forget the undo log"},
    {"rollback", (PyCFunction)Core_rollback, METH_NOARGS, "undo everything since begin()"},
    {"match", (PyCFunction)Core_match, METH_VARARGS, "match(tokens, root) -> {worker: blocks}"},
    {"match_detail", (PyCFunction)Core_match_detail, METH_VARARGS, "-> (scores, tiers, block sizes)"},
    {"info", (PyCFunction)Core_info, METH_O, "per-worker counts"},
    {"num_distinct", (PyCFunction)Core_num_distinct, METH_NOARGS, "distinct matchable contents"},
    {"memory_bytes", (PyCFunction)Core_memory_bytes, METH_NOARGS, "bytes held by the tables"},
    {"items", (PyCFunction)Core_items, METH_O, "a worker's entries for snapshots"},
    {NULL, NULL, 0, NULL},
};

static PyObject *Core_get_version(Core *c, void *closure) { return PyLong_FromUnsignedLongLong(c->version); }

static PyGetSetDef Core_getset[] = {
    {"version", (getter)Core_get_version, NULL, "changes when the set of workers changes", NULL},
    {NULL, NULL, NULL, NULL, NULL},
};

static PyTypeObject CoreType = {
    PyVarObject_HEAD_INIT(NULL, 0).tp_name = "tokenspeed_router._native.Core",
    .tp_basicsize = sizeof(Core),
    .tp_flags = Py_TPFLAGS_DEFAULT,
    .tp_doc = "Compiled KV index core (see router/index.py for the semantics layer).",
    .tp_new = Core_new,
    .tp_dealloc = (destructor)Core_dealloc,
    .tp_methods = Core_methods,
    .tp_getset = Core_getset,
};

int core_type_add(PyObject *m) {
    if (PyType_Ready(&CoreType) < 0) return -1;
    if (!(str_gpu = PyUnicode_InternFromString("gpu"))) return -1;
    if (!(str_cpu = PyUnicode_InternFromString("cpu"))) return -1;
    if (!(str_storage = PyUnicode_InternFromString("storage"))) return -1;
    Py_INCREF(&CoreType);
    if (PyModule_AddObject(m, "Core", (PyObject *)&CoreType) < 0) {
        Py_DECREF(&CoreType);
        return -1;
    }
    return 0;
}
