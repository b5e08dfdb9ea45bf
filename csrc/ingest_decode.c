/*
 * Raw KV event batches straight into the core: no Python object per block (issue 17).
 *
 * Why: decoding a batch with the typed decoder (events/codec.py) builds a
 * Python int per block hash and per token id, which KvIndex.apply then reads
 * back; at 100k blocks/s that is ~1.6M objects a second, made and freed under
 * the GIL the HTTP loop needs. Here the msgpack payload is read in place, into
 * u64 arrays, and applied to the tables with the GIL released.
 *
 * Exactness by construction: this is a *subset* decoder. It accepts only what
 * it can prove the typed decoder + KvIndex.apply would do identically: the
 * three events in either wire form (tagged maps, tagged arrays, mixed), int or
 * bin block ids, medium nil or a spelling of the tier table Python hands in
 * (set_media), the plain namespace (no lora_id/lora_name/cache_salt/extra
 * keys/multimodal infos), every BlockStored on the worker's current block
 * grid. Anything else -- malformed bytes included -- answers "not mine"
 * (None) *before any change*, and the caller takes the typed path, which
 * decides (and counts) exactly as before. tests/property/test_raw_ingest.py
 * checks both against each other with hypothesis on every wire form.
 *
 * It drives the core's own block semantics (index.h: hold_block, drop_block,
 * clear_blocks, the undo log) under the core's lock, one event per lock
 * hold, like the per-event methods; core_type.c exposes it as
 * Core.apply_raw, native.c the module functions scan_batch and set_media.
 */
#include "ingest_decode.h"

#include <math.h>

/* ------------------------------------------------------------ msgpack reader */

enum { MT_NIL, MT_BOOL, MT_INT, MT_FLOAT, MT_STR, MT_BIN, MT_ARR, MT_MAP, MT_EXT };

typedef struct {
    const u8 *p, *end;
} Rd;

typedef struct {
    int t;
    u64 u;          /* MT_INT: the value (two's complement when neg); MT_BOOL: 0/1 */
    int neg;        /* MT_INT: the value is negative */
    double f;       /* MT_FLOAT */
    const u8 *s;    /* MT_STR / MT_BIN: the bytes */
    size_t len;     /* MT_STR / MT_BIN: bytes; MT_ARR / MT_MAP: elements */
} MVal;

static inline u64 rd_be(const u8 *p, int n) {
    u64 v = 0;
    for (int i = 0; i < n; i++) v = (v << 8) | p[i];
    return v;
}

/* One header (a whole scalar, str or bin; only the count of an array or map). 0 ok, -1 bad. */
static int rd_head(Rd *r, MVal *v) {
    if (r->p >= r->end) return -1;
    u8 b = *r->p++;
    size_t left = (size_t)(r->end - r->p);
    size_t n;
#define NEED(k) do { if (left < (size_t)(k)) return -1; } while (0)
    if (b <= 0x7f) { v->t = MT_INT; v->u = b; v->neg = 0; return 0; }
    if (b >= 0xe0) { v->t = MT_INT; v->u = (u64)(int64_t)(int8_t)b; v->neg = 1; return 0; }
    if ((b & 0xf0) == 0x80) { v->t = MT_MAP; v->len = b & 0x0f; goto count; }
    if ((b & 0xf0) == 0x90) { v->t = MT_ARR; v->len = b & 0x0f; goto count; }
    if ((b & 0xe0) == 0xa0) { v->t = MT_STR; n = b & 0x1f; goto data; }
    switch (b) {
    case 0xc0: v->t = MT_NIL; return 0;
    case 0xc2: case 0xc3: v->t = MT_BOOL; v->u = b == 0xc3; return 0;
    case 0xc4: NEED(1); n = r->p[0]; r->p += 1; left -= 1; v->t = MT_BIN; goto data;
    case 0xc5: NEED(2); n = (size_t)rd_be(r->p, 2); r->p += 2; left -= 2; v->t = MT_BIN; goto data;
    case 0xc6: NEED(4); n = (size_t)rd_be(r->p, 4); r->p += 4; left -= 4; v->t = MT_BIN; goto data;
    case 0xd9: NEED(1); n = r->p[0]; r->p += 1; left -= 1; v->t = MT_STR; goto data;
    case 0xda: NEED(2); n = (size_t)rd_be(r->p, 2); r->p += 2; left -= 2; v->t = MT_STR; goto data;
    case 0xdb: NEED(4); n = (size_t)rd_be(r->p, 4); r->p += 4; left -= 4; v->t = MT_STR; goto data;
    case 0xca: {
        NEED(4);
        u32 x = (u32)rd_be(r->p, 4);
        float f;
        memcpy(&f, &x, 4);
        r->p += 4;
        v->t = MT_FLOAT;
        v->f = f;
        return 0;
    }
    case 0xcb: {
        NEED(8);
        u64 x = rd_be(r->p, 8);
        double d;
        memcpy(&d, &x, 8);
        r->p += 8;
        v->t = MT_FLOAT;
        v->f = d;
        return 0;
    }
    case 0xcc: NEED(1); v->t = MT_INT; v->u = r->p[0]; v->neg = 0; r->p += 1; return 0;
    case 0xcd: NEED(2); v->t = MT_INT; v->u = rd_be(r->p, 2); v->neg = 0; r->p += 2; return 0;
    case 0xce: NEED(4); v->t = MT_INT; v->u = rd_be(r->p, 4); v->neg = 0; r->p += 4; return 0;
    case 0xcf: NEED(8); v->t = MT_INT; v->u = rd_be(r->p, 8); v->neg = 0; r->p += 8; return 0;
    case 0xd0: NEED(1); v->t = MT_INT; v->u = (u64)(int64_t)(int8_t)r->p[0]; r->p += 1; goto sign;
    case 0xd1: NEED(2); v->t = MT_INT; v->u = (u64)(int64_t)(int16_t)rd_be(r->p, 2); r->p += 2; goto sign;
    case 0xd2: NEED(4); v->t = MT_INT; v->u = (u64)(int64_t)(int32_t)rd_be(r->p, 4); r->p += 4; goto sign;
    case 0xd3: NEED(8); v->t = MT_INT; v->u = rd_be(r->p, 8); r->p += 8; goto sign;
    case 0xdc: NEED(2); v->t = MT_ARR; v->len = (size_t)rd_be(r->p, 2); r->p += 2; left -= 2; goto count;
    case 0xdd: NEED(4); v->t = MT_ARR; v->len = (size_t)rd_be(r->p, 4); r->p += 4; left -= 4; goto count;
    case 0xde: NEED(2); v->t = MT_MAP; v->len = (size_t)rd_be(r->p, 2); r->p += 2; left -= 2; goto count;
    case 0xdf: NEED(4); v->t = MT_MAP; v->len = (size_t)rd_be(r->p, 4); r->p += 4; left -= 4; goto count;
    case 0xd4: n = 1; goto ext;
    case 0xd5: n = 2; goto ext;
    case 0xd6: n = 4; goto ext;
    case 0xd7: n = 8; goto ext;
    case 0xd8: n = 16; goto ext;
    case 0xc7: NEED(1); n = r->p[0]; r->p += 1; left -= 1; goto ext;
    case 0xc8: NEED(2); n = (size_t)rd_be(r->p, 2); r->p += 2; left -= 2; goto ext;
    case 0xc9: NEED(4); n = (size_t)rd_be(r->p, 4); r->p += 4; left -= 4; goto ext;
    default: return -1; /* 0xc1: never used */
    }
sign:
    v->neg = (int64_t)v->u < 0;
    return 0;
data:
    NEED(n);
    v->s = r->p;
    v->len = n;
    r->p += n;
    return 0;
ext:
    NEED(n + 1);
    v->t = MT_EXT;
    r->p += n + 1;
    return 0;
count:
    /* every element takes at least a byte (a map entry two): a count beyond the
     * bytes left is malformed, and this bounds every loop over it */
    if (v->len > left || (v->t == MT_MAP && v->len > left / 2)) return -1;
    return 0;
#undef NEED
}

/* Skip one whole value. */
static int rd_skip(Rd *r, int depth) {
    MVal v;
    if (depth > 32 || rd_head(r, &v) < 0) return -1;
    if (v.t == MT_ARR || v.t == MT_MAP) {
        size_t n = v.t == MT_MAP ? 2 * v.len : v.len;
        for (size_t i = 0; i < n; i++)
            if (rd_skip(r, depth + 1) < 0) return -1;
    }
    return 0;
}

static inline int str_is(const MVal *v, const char *lit) {
    size_t n = strlen(lit);
    return v->t == MT_STR && v->len == n && memcmp(v->s, lit, n) == 0;
}

/* ------------------------------------------------------------ the tier names */

/* Python's spelling table (router/tiers.py), handed in once by set_media. */
#define MEDIA_MAX 64
#define MEDIUM_NAME_MAX 31
static char media_name[MEDIA_MAX][MEDIUM_NAME_MAX + 1];
static u8 media_code[MEDIA_MAX];
static int n_media;

static int py_space(u8 ch) { return ch == ' ' || (ch >= 0x09 && ch <= 0x0d) || (ch >= 0x1c && ch <= 0x1f); }

/* medium string -> tier code as medium_code() gives it; 0 when not provably the same
 * (non-ASCII, unknown: Python counts unknown spellings, so those take its path). */
static u8 medium_of(const MVal *v) {
    const u8 *s = v->s, *e = v->s + v->len;
    for (const u8 *q = s; q < e; q++)
        if (*q >= 0x80) return 0;
    while (s < e && py_space(*s)) s++;
    while (e > s && py_space(e[-1])) e--;
    size_t n = (size_t)(e - s);
    if (n == 0 || n > MEDIUM_NAME_MAX) return 0;
    char low[MEDIUM_NAME_MAX + 1];
    for (size_t i = 0; i < n; i++) low[i] = (char)((s[i] >= 'A' && s[i] <= 'Z') ? s[i] + 32 : s[i]);
    low[n] = 0;
    for (int i = 0; i < n_media; i++)
        if (strcmp(media_name[i], low) == 0) return media_code[i];
    return 0;
}

/* set_media(pairs): [(lowercase name, tier code), ...]. The pairs are parsed
 * into a local table and copied over the live one only when every pair parsed:
 * a refused call leaves the previous table whole (the raw decoder keeps
 * reading it), never half overwritten. */
PyObject *mod_set_media(PyObject *m, PyObject *pairs) {
    PyObject *seq = PySequence_Fast(pairs, "set_media takes a sequence of (name, code) pairs");
    if (!seq) return NULL;
    Py_ssize_t n = PySequence_Fast_GET_SIZE(seq);
    if (n > MEDIA_MAX) {
        Py_DECREF(seq);
        PyErr_SetString(PyExc_ValueError, "too many medium names");
        return NULL;
    }
    char names[MEDIA_MAX][MEDIUM_NAME_MAX + 1];
    u8 codes[MEDIA_MAX];
    int k = 0;
    for (Py_ssize_t i = 0; i < n; i++) {
        const char *name;
        int code;
        if (!PyArg_ParseTuple(PySequence_Fast_GET_ITEM(seq, i), "si", &name, &code)) {
            Py_DECREF(seq);
            return NULL;
        }
        if (strlen(name) > MEDIUM_NAME_MAX || code < 1 || code > ALL_TIERS) continue;
        strcpy(names[k], name);
        codes[k] = (u8)code;
        k++;
    }
    Py_DECREF(seq);
    memcpy(media_name, names, sizeof(names[0]) * (size_t)k);
    memcpy(media_code, codes, (size_t)k);
    n_media = k;
    Py_RETURN_NONE;
}

/* ------------------------------------------------------------ the decoded plan */

enum { RE_STORE = 1, RE_REMOVE = 2, RE_CLEAR = 3 };
/* RAW_OK, RAW_NOT_MINE, RAW_NOMEM: ingest_decode.h */

typedef struct {
    u8 kind, tier, unspecified, has_parent, pkind;
    u64 pkey;
    Py_ssize_t h0, nh; /* block ids: plan keys[h0 .. h0 + nh) */
    Py_ssize_t t0, nt; /* tokens: plan toks[t0 .. t0 + nt) */
    long bs;
} REv;

typedef struct {
    double ts;
    REv *ev;
    Py_ssize_t nev, capev;
    u64 *keys;
    u8 *kinds;
    size_t *boff; /* bin ids: offset of the bytes in the payload (0 for ints); size_t: payloads may pass 4 GiB */
    size_t *blen;
    Py_ssize_t nkeys, capkeys;
    u64 *toks;
    Py_ssize_t ntoks, captoks;
    int has_bytes, has_store, has_clear_all;
    Py_ssize_t blocks;
} Plan;

static void plan_free(Plan *pl) {
    tsr_free(pl->ev);
    tsr_free(pl->keys);
    tsr_free(pl->kinds);
    tsr_free(pl->boff);
    tsr_free(pl->blen);
    tsr_free(pl->toks);
    memset(pl, 0, sizeof(*pl));
}

/* Room for `need` items; the array exists after any successful call, even for
 * need 0 (an empty id or token list still points into it: NULL + 0 is UB). */
static int grow(void **p, Py_ssize_t *cap, Py_ssize_t need, size_t item) {
    if (need <= *cap && *p) return 0;
    Py_ssize_t c = *cap ? *cap : 64;
    while (c < need) c *= 2;
    void *q = tsr_realloc(*p, (size_t)c * item);
    if (!q) return -1;
    *p = q;
    *cap = c;
    return 0;
}

static int keys_reserve(Plan *pl, Py_ssize_t need) {
    if (need <= pl->capkeys && pl->keys) return 0;
    Py_ssize_t cap = pl->capkeys;
    if (grow((void **)&pl->keys, &cap, need, sizeof(u64)) < 0) return -1;
    Py_ssize_t c2 = pl->capkeys;
    if (grow((void **)&pl->kinds, &c2, need, 1) < 0) return -1;
    c2 = pl->capkeys;
    if (grow((void **)&pl->boff, &c2, need, sizeof(size_t)) < 0) return -1;
    c2 = pl->capkeys;
    if (grow((void **)&pl->blen, &c2, need, sizeof(size_t)) < 0) return -1;
    pl->capkeys = cap;
    return 0;
}

/* One external block id (int or bin) -> key + kind, as ext_key() makes it. */
static int id_of(const MVal *v, const u8 *base, u64 *key, u8 *kind, size_t *off, size_t *len) {
    if (v->t == MT_INT) {
        *key = v->u;
        *kind = v->neg ? M_SIGNED : 0;
        *off = *len = 0;
        return 0;
    }
    if (v->t == MT_BIN) {
        *key = XXH3_64bits_withSeed(v->s, v->len, 0x7473726f75746572ULL);
        *kind = M_BYTES;
        *off = (size_t)(v->s - base);
        *len = v->len;
        return 0;
    }
    return -1;
}

#define MAX_RAW_EVENTS 1000000
#define MAX_RAW_BLOCKS 1000000

/* block_hashes: an array of ids -> the plan's key arrays. */
static int read_ids(Rd *r, const u8 *base, Plan *pl, REv *e) {
    MVal a;
    if (rd_head(r, &a) < 0 || a.t != MT_ARR || a.len > MAX_RAW_BLOCKS) return RAW_NOT_MINE;
    if (keys_reserve(pl, pl->nkeys + (Py_ssize_t)a.len) < 0) return RAW_NOMEM;
    e->h0 = pl->nkeys;
    e->nh = (Py_ssize_t)a.len;
    for (size_t i = 0; i < a.len; i++) {
        MVal v;
        Py_ssize_t k = pl->nkeys++;
        if (rd_head(r, &v) < 0 || id_of(&v, base, &pl->keys[k], &pl->kinds[k], &pl->boff[k], &pl->blen[k]) < 0)
            return RAW_NOT_MINE;
        if (v.t == MT_BIN) pl->has_bytes = 1;
    }
    pl->blocks += e->nh;
    return RAW_OK;
}

static int read_tokens(Rd *r, Plan *pl, REv *e) {
    MVal a;
    if (rd_head(r, &a) < 0 || a.t != MT_ARR) return RAW_NOT_MINE;
    if (grow((void **)&pl->toks, &pl->captoks, pl->ntoks + (Py_ssize_t)a.len, sizeof(u64)) < 0) return RAW_NOMEM;
    e->t0 = pl->ntoks;
    e->nt = (Py_ssize_t)a.len;
    u64 *out = pl->toks + pl->ntoks;
    const u8 *p = r->p, *end = r->end;
    for (size_t i = 0; i < a.len; i++) {
        /* the common token ids inline: fixint, uint8/16/32 */
        if (p < end && *p <= 0x7f) {
            out[i] = *p++;
            continue;
        }
        if (end - p >= 3 && *p == 0xcd) {
            out[i] = ((u64)p[1] << 8) | p[2];
            p += 3;
            continue;
        }
        if (end - p >= 5 && *p == 0xce) {
            out[i] = rd_be(p + 1, 4);
            p += 5;
            continue;
        }
        r->p = p;
        MVal v;
        if (rd_head(r, &v) < 0 || v.t != MT_INT) return RAW_NOT_MINE;
        out[i] = v.u; /* negatives wrap modulo 2**64, as KvIndex.apply reads them */
        p = r->p;
    }
    r->p = p;
    pl->ntoks += (Py_ssize_t)a.len;
    return RAW_OK;
}

/* medium: nil, or a known spelling (0 = not provable here) */
static int read_medium(Rd *r, REv *e) {
    MVal v;
    if (rd_head(r, &v) < 0) return RAW_NOT_MINE;
    if (v.t == MT_NIL) {
        e->tier = GPU;
        e->unspecified = 1;
        return RAW_OK;
    }
    if (v.t != MT_STR) return RAW_NOT_MINE;
    u8 code = medium_of(&v);
    if (!code) return RAW_NOT_MINE;
    e->tier = code;
    e->unspecified = 0;
    return RAW_OK;
}

static int read_nil(Rd *r) {
    MVal v;
    return rd_head(r, &v) == 0 && v.t == MT_NIL ? RAW_OK : RAW_NOT_MINE;
}

static int read_parent(Rd *r, const u8 *base, Plan *pl, REv *e) {
    MVal v;
    if (rd_head(r, &v) < 0) return RAW_NOT_MINE;
    if (v.t == MT_NIL) {
        e->has_parent = 0;
        return RAW_OK;
    }
    size_t off, len;
    if (id_of(&v, base, &e->pkey, &e->pkind, &off, &len) < 0) return RAW_NOT_MINE;
    e->has_parent = 1;
    (void)pl;
    return RAW_OK;
}

static int read_block_size(Rd *r, REv *e) {
    MVal v;
    if (rd_head(r, &v) < 0 || v.t != MT_INT || v.neg || v.u == 0 || v.u > (1u << 30)) return RAW_NOT_MINE;
    e->bs = (long)v.u;
    return RAW_OK;
}

/* The checks validate_event and KvIndex._validate make (anything they refuse is not mine). */
static int check_store(const REv *e) {
    if (e->nh == 0 || e->nt == 0) return RAW_NOT_MINE; /* prehashed stores take the typed path */
    if (!((e->nh - 1) * e->bs < e->nt && e->nt <= e->nh * e->bs)) return RAW_NOT_MINE;
    return RAW_OK;
}

/* Field slots of BlockStored, in array order. */
enum { F_HASHES, F_PARENT, F_TOKENS, F_BS, F_LORA_ID, F_MEDIUM, F_LORA_NAME, F_EXTRA, F_MM, F_SALT, F_N };
static const char *const stored_fields[F_N] = {
    "block_hashes", "parent_block_hash", "token_ids", "block_size", "lora_id",
    "medium", "lora_name", "extra_keys", "block_mm_infos", "cache_salt",
};

static int read_stored_field(Rd *r, const u8 *base, Plan *pl, REv *e, int f) {
    switch (f) {
    case F_HASHES: return read_ids(r, base, pl, e);
    case F_PARENT: return read_parent(r, base, pl, e);
    case F_TOKENS: return read_tokens(r, pl, e);
    case F_BS: return read_block_size(r, e);
    case F_MEDIUM: return read_medium(r, e);
    default: return read_nil(r); /* namespaces, extra keys, mm infos: only the plain case is mine */
    }
}

static int new_event(Plan *pl, REv **out) {
    if (pl->nev >= MAX_RAW_EVENTS) return RAW_NOT_MINE;
    if (grow((void **)&pl->ev, &pl->capev, pl->nev + 1, sizeof(REv)) < 0) return RAW_NOMEM;
    REv *e = &pl->ev[pl->nev++];
    memset(e, 0, sizeof(*e));
    e->tier = GPU;
    e->unspecified = 1;
    *out = e;
    return RAW_OK;
}

/* One event, map form: {"type": TAG, ...} with the tag first. */
static int read_map_event(Rd *r, const u8 *base, Plan *pl, size_t nkeys) {
    MVal k, tag;
    if (nkeys == 0 || rd_head(r, &k) < 0 || !str_is(&k, "type") || rd_head(r, &tag) < 0 || tag.t != MT_STR)
        return RAW_NOT_MINE;
    REv *e;
    int rc = new_event(pl, &e);
    if (rc) return rc;
    unsigned seen = 0;
    if (str_is(&tag, "BlockStored")) {
        e->kind = RE_STORE;
        for (size_t i = 1; i < nkeys; i++) {
            if (rd_head(r, &k) < 0 || k.t != MT_STR) return RAW_NOT_MINE;
            int f = -1;
            for (int j = 0; j < F_N; j++)
                if (str_is(&k, stored_fields[j])) f = j;
            if (f < 0) {
                if (str_is(&k, "type")) return RAW_NOT_MINE;
                if (rd_skip(r, 0) < 0) return RAW_NOT_MINE; /* unknown keys are ignored */
                continue;
            }
            if (seen & (1u << f)) return RAW_NOT_MINE;
            seen |= 1u << f;
            if ((rc = read_stored_field(r, base, pl, e, f))) return rc;
        }
        unsigned required = (1u << F_HASHES) | (1u << F_PARENT) | (1u << F_TOKENS) | (1u << F_BS);
        if ((seen & required) != required) return RAW_NOT_MINE;
        return check_store(e);
    }
    int removed = str_is(&tag, "BlockRemoved");
    if (!removed && !str_is(&tag, "AllBlocksCleared")) return RAW_NOT_MINE; /* unknown tags: counted there */
    e->kind = removed ? RE_REMOVE : RE_CLEAR;
    for (size_t i = 1; i < nkeys; i++) {
        if (rd_head(r, &k) < 0 || k.t != MT_STR) return RAW_NOT_MINE;
        int f = removed && str_is(&k, "block_hashes") ? 0 : str_is(&k, "medium") ? 1 : -1;
        if (f < 0) {
            if (str_is(&k, "type") || rd_skip(r, 0) < 0) return RAW_NOT_MINE;
            continue;
        }
        if (seen & (1u << f)) return RAW_NOT_MINE;
        seen |= 1u << f;
        if ((rc = f == 0 ? read_ids(r, base, pl, e) : read_medium(r, e))) return rc;
    }
    if (removed && !(seen & 1)) return RAW_NOT_MINE;
    return RAW_OK;
}

/* One event, array form: [TAG, fields in order...] (no trailing extras). */
static int read_array_event(Rd *r, const u8 *base, Plan *pl, size_t n) {
    MVal tag;
    if (n == 0 || rd_head(r, &tag) < 0 || tag.t != MT_STR) return RAW_NOT_MINE;
    REv *e;
    int rc = new_event(pl, &e);
    if (rc) return rc;
    size_t nf = n - 1;
    if (str_is(&tag, "BlockStored")) {
        e->kind = RE_STORE;
        if (nf < 4 || nf > F_N) return RAW_NOT_MINE;
        for (size_t f = 0; f < nf; f++)
            if ((rc = read_stored_field(r, base, pl, e, (int)f))) return rc;
        return check_store(e);
    }
    if (str_is(&tag, "BlockRemoved")) {
        e->kind = RE_REMOVE;
        if (nf < 1 || nf > 2) return RAW_NOT_MINE;
        if ((rc = read_ids(r, base, pl, e))) return rc;
        return nf == 2 ? read_medium(r, e) : RAW_OK;
    }
    if (str_is(&tag, "AllBlocksCleared")) {
        e->kind = RE_CLEAR;
        if (nf > 1) return RAW_NOT_MINE;
        return nf == 1 ? read_medium(r, e) : RAW_OK;
    }
    return RAW_NOT_MINE;
}

/* The whole payload: [ts, [event...], dp_rank?] and nothing after it. No Python objects. */
static int plan_read(const u8 *buf, size_t len, Plan *pl) {
    Rd r = {buf, buf + len};
    MVal v;
    if (rd_head(&r, &v) < 0 || v.t != MT_ARR || v.len < 2 || v.len > 3) return RAW_NOT_MINE;
    size_t top = v.len;
    MVal ts;
    if (rd_head(&r, &ts) < 0) return RAW_NOT_MINE;
    if (ts.t == MT_FLOAT)
        pl->ts = ts.f;
    else if (ts.t == MT_INT)
        pl->ts = ts.neg ? (double)(int64_t)ts.u : (double)ts.u;
    else
        return RAW_NOT_MINE;
    if (!isfinite(pl->ts)) return RAW_NOT_MINE;
    MVal evs;
    if (rd_head(&r, &evs) < 0 || evs.t != MT_ARR || evs.len > MAX_RAW_EVENTS) return RAW_NOT_MINE;
    for (size_t i = 0; i < evs.len; i++) {
        MVal h;
        if (rd_head(&r, &h) < 0) return RAW_NOT_MINE;
        int rc;
        if (h.t == MT_MAP)
            rc = read_map_event(&r, buf, pl, h.len);
        else if (h.t == MT_ARR)
            rc = read_array_event(&r, buf, pl, h.len);
        else
            rc = RAW_NOT_MINE;
        if (rc) return rc;
        REv *e = &pl->ev[pl->nev - 1];
        if (e->kind == RE_STORE) pl->has_store = 1;
        if (e->kind == RE_CLEAR && e->unspecified) pl->has_clear_all = 1;
    }
    if (top == 3) {
        MVal dp;
        if (rd_head(&r, &dp) < 0 || (dp.t != MT_NIL && dp.t != MT_INT)) return RAW_NOT_MINE;
    }
    return r.p == r.end ? RAW_OK : RAW_NOT_MINE;
}

/* ------------------------------------------------------------ applying a plan */

/* One BlockStored on the worker's grid (hold_chain, as Core_store): 1 unknown parent,
 * E_NOMEM, else 0. Lock held. */
static int plan_store(Core *c, int s, Plan *pl, const REv *e, u64 root, long *added, long *dup) {
    Worker *w = &c->w[s];
    u64 *toks = pl->toks + e->t0;
    const u64 *keys = pl->keys + e->h0;
    const u8 *kinds = pl->kinds + e->h0;
    Py_ssize_t n = e->nh, ntok = e->nt;
    long bs = e->bs;
    Py_ssize_t nfull = ntok / bs < n ? ntok / bs : n;
    int unm = 0;
    u64 h = root;
    if (e->has_parent) {
        Py_ssize_t i = ext_find(w, e->pkey, e->pkind);
        if (i < 0) return 1;
        h = w->ext.vals[i];
        if (w->ext.meta[i] & M_UNM) unm = 1;
    }
    return hold_chain(c, s, keys, kinds, toks, n, ntok, bs, nfull, h, unm, e->tier, added, dup);
}

/* Apply every event of the plan, each under its own lock hold. GIL not needed.
 * salvage=0: all or nothing (undo log, as KvIndex.apply);
 * salvage=1: event by event, refused stores skipped and counted (IndexIngestor._salvage).
 * Out of memory undoes the whole batch in both modes (the call raises MemoryError
 * with the index unchanged); so does an unknown parent when salvage=0. */
static void plan_apply(Core *c, int s, Plan *pl, u64 root, int salvage, RawOut *o) {
    o->last_clear = o->last_reject = -1;
    /* a lone remove or clear cannot fail halfway (and a lone clear of every
     * tier takes the fast path only outside a batch): no log for those */
    int own = 0;
    if (pl->nev > 1 || (pl->nev == 1 && pl->ev[0].kind == RE_STORE)) {
        wlock(c);
        own = txn_open(c);
        unlock(c);
    }
    for (Py_ssize_t i = 0; i < pl->nev && !o->err; i++) {
        const REv *e = &pl->ev[i];
        wlock(c);
        if (e->kind == RE_STORE) {
            long a = 0, d = 0;
            int r = plan_store(c, s, pl, e, root, &a, &d);
            if (r < 0) {
                o->err = r;
            } else if (r > 0) {
                unlock(c);
                if (!salvage) {
                    o->unknown_parent = 1;
                    break;
                }
                o->rejected++;
                o->last_reject = i;
                continue;
            }
            o->stored += a;
            o->dup += d;
        } else if (e->kind == RE_REMOVE) {
            Worker *w = &c->w[s];
            const u64 *keys = pl->keys + e->h0;
            const u8 *kinds = pl->kinds + e->h0;
            Py_ssize_t n = e->nh;
            enum { D1 = 16, D2 = 8 };
            for (Py_ssize_t j = 0; j < n + D1 && !o->err; j++) {
                if (j < n) tab_prefetch(&w->ext, keys[j]);
                Py_ssize_t q = j - D2;
                if (q >= 0 && q < n) {
                    Py_ssize_t x = ext_find(w, keys[q], kinds[q]);
                    if (x >= 0) g_prefetch(&c->glob, w->ext.vals[x]);
                }
                Py_ssize_t k = j - D1;
                if (k < 0) continue;
                int mm = 0;
                int r = drop_block(c, s, keys[k], kinds[k], e->tier, e->unspecified, &mm);
                if (r == E_NOMEM)
                    o->err = r;
                else if (r < 0)
                    o->unknown++;
                else
                    o->removed += r;
                o->mismatch += mm;
            }
        } else {
            Py_ssize_t gone = clear_blocks(c, s, e->unspecified ? ALL_TIERS : e->tier);
            if (gone < 0) {
                o->err = (int)gone;
            } else {
                o->removed += (long)gone;
                o->cleared++;
                if (e->unspecified) o->last_clear = i;
            }
        }
        unlock(c);
    }
    wlock(c);
    if (txn_close(c, own, o->unknown_parent || o->err) < 0) o->err = E_NOMEM;
    unlock(c);
}

/* Remember the original bytes of bin ids (Worker.bytes_ids), as ext_keys_from does. GIL held. */
static int plan_bytes(Core *c, int s, Plan *pl, const u8 *base) {
    Worker *w = &c->w[s];
    for (Py_ssize_t i = 0; i < pl->nev; i++) {
        const REv *e = &pl->ev[i];
        if (e->kind != RE_STORE) continue;
        for (Py_ssize_t j = e->h0; j < e->h0 + e->nh; j++) {
            if (!(pl->kinds[j] & M_BYTES)) continue;
            if (!w->bytes_ids && !(w->bytes_ids = PyDict_New())) return -1;
            PyObject *k = PyLong_FromUnsignedLongLong(pl->keys[j]);
            PyObject *b = k ? PyBytes_FromStringAndSize((const char *)base + pl->boff[j], (Py_ssize_t)pl->blen[j]) : NULL;
            int r = b ? PyDict_SetItem(w->bytes_ids, k, b) : -1;
            Py_XDECREF(k);
            Py_XDECREF(b);
            if (r < 0) return -1;
        }
    }
    return 0;
}

/* Read and apply one batch to slot s (ingest_decode.h: RawRes). *ts is the caller's saved
 * thread state while the GIL is released (NULL: held); it is taken back only for the bytes
 * ids, which need Python objects, and given away again. */
void raw_run(Core *c, int s, const void *data, Py_ssize_t len, long bs, u64 root, int salvage, RawRes *r,
             PyThreadState **ts) {
    Plan pl;
    memset(&pl, 0, sizeof(pl));
    memset(r, 0, sizeof(*r));
    const u8 *base = data;
    int rc = plan_read(base, (size_t)len, &pl);
    if (rc == RAW_OK) {
        for (Py_ssize_t i = 0; i < pl.nev; i++)
            if (pl.ev[i].kind == RE_STORE && pl.ev[i].bs != bs) rc = RAW_NOT_MINE; /* another grid: Python adopts */
    }
    if (rc == RAW_OK && pl.has_bytes) {
        int released = *ts != NULL;
        if (released) PyEval_RestoreThread(*ts);
        *ts = NULL;
        int bad = plan_bytes(c, s, &pl, base) < 0;
        if (bad) {
            PyErr_Clear(); /* reported as out of memory, below */
            rc = RAW_NOMEM;
        }
        if (released) *ts = PyEval_SaveThread();
    }
    if (rc == RAW_OK) plan_apply(c, s, &pl, root, salvage, &r->o);
    r->rc = rc;
    r->ts = pl.ts;
    r->nev = pl.nev;
    r->flags = (pl.has_store ? 1 : 0) | (pl.has_clear_all ? 2 : 0);
    /* the worker's blocks after the batch (what Core.info counts first; the writer reads its own len) */
    r->blocks = (Py_ssize_t)c->w[s].ext.len;
    plan_free(&pl);
}

/* The Python answer of one raw_run: None (not the fast case, nothing changed), the result
 * tuple, or NULL with MemoryError set (nothing of the batch applied). GIL held. */
PyObject *raw_result(const RawRes *r) {
    if (r->rc == RAW_NOMEM || r->o.err) {
        PyErr_SetString(PyExc_MemoryError, "out of memory applying a KV event batch (nothing of it applied)");
        return NULL;
    }
    if (r->rc != RAW_OK) Py_RETURN_NONE;
    const RawOut *o = &r->o;
    return Py_BuildValue("dnlllllliilnnn", r->ts, r->nev, o->stored, o->dup, o->removed, o->unknown, o->cleared,
                         o->mismatch, r->flags, o->unknown_parent, o->rejected, o->last_clear, o->last_reject,
                         r->blocks);
}

PyObject *raw_apply(Core *c, int s, const void *data, Py_ssize_t len, long bs, u64 root, int salvage) {
    RawRes r;
    PyThreadState *ts = len >= RAW_RELEASE_BYTES ? PyEval_SaveThread() : NULL;
    raw_run(c, s, data, len, bs, root, salvage, &r, &ts);
    if (ts) PyEval_RestoreThread(ts);
    return raw_result(&r);
}

#define SCAN_RELEASE_BYTES 65536

/* scan_batch(payload) -> the batch timestamp when apply_raw could take it whole
 * (the structure and the checks of the typed decoder, on the fast subset), else None. */
PyObject *mod_scan_batch(PyObject *m, PyObject *arg) {
    Py_buffer buf;
    if (PyObject_GetBuffer(arg, &buf, PyBUF_SIMPLE) < 0) return NULL;
    Plan pl;
    memset(&pl, 0, sizeof(pl));
    int rc;
    /* A receiving thread scans every frame as it reads it: giving the GIL away for a few
     * microseconds of reading hands it to a query thread that then holds it for up to the
     * switch interval (0.5 ms in serve), per frame. Only a big payload is worth that. */
    if (buf.len >= SCAN_RELEASE_BYTES) {
        Py_BEGIN_ALLOW_THREADS
        rc = plan_read(buf.buf, (size_t)buf.len, &pl);
        Py_END_ALLOW_THREADS
    } else {
        rc = plan_read(buf.buf, (size_t)buf.len, &pl);
    }
    double ts = pl.ts;
    plan_free(&pl);
    PyBuffer_Release(&buf);
    if (rc == RAW_NOMEM) return PyErr_NoMemory();
    if (rc != RAW_OK) Py_RETURN_NONE;
    return PyFloat_FromDouble(ts);
}
