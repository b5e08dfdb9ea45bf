/* The index core (index.h): block semantics, undo log, match walk. */
#include "index.h"

/* ---- undo log */

/* Room for k more log entries (nothing to do outside a batch). */
static inline int log_reserve(Core *c, size_t k) {
    if (!c->logging || c->nlog + k <= c->caplog) return 0;
    size_t cap = c->caplog ? c->caplog : 256;
    while (c->nlog + k > cap) cap *= 2;
    Undo *n = tsr_realloc(c->log, cap * sizeof(Undo));
    if (!n) return E_NOMEM;
    c->log = n;
    c->caplog = cap;
    return 0;
}

/* Record one change; the caller reserved the room (log_reserve). */
static inline void log_push(Core *c, u8 op, int slot, u64 key, u64 val, u8 meta) {
    if (!c->logging) return;
    Undo *u = &c->log[c->nlog++];
    u->op = op;
    u->slot = slot;
    u->key = key;
    u->val = val;
    u->meta = meta;
}

/* An emptied table gives its memory back, except while a batch may undo into
 * it: a rollback must find every entry's room where it was (no allocation). */
static inline void tab_release_if_empty(const Core *c, Tab *t) {
    if (!t->len && t->cap && !c->logging && !c->undoing) tab_free(t);
}

/* ---- holders */

/* Set slot s's bit on content; 1 if it was not set, 0 if it was, E_NOMEM. */
static inline int hold_add(Core *c, int s, u64 content) {
    GTab *t = &c->glob;
    if (g_reserve(t, 1) < 0) return E_NOMEM;
    size_t W = t->W, st = 1 + W, m = t->cap - 1, i = g_home(t, content);
    u64 *p;
    for (;;) {
        p = t->e + i * st;
        if (g_empty(p, W)) {
            p[0] = content;
            t->len++;
            break;
        }
        if (p[0] == content) break;
        i = (i + 1) & m;
    }
    u64 bit = (u64)1 << (s & 63);
    if (p[1 + (s >> 6)] & bit) return 0;
    p[1 + (s >> 6)] |= bit;
    log_push(c, U_HOLD_SET, s, content, 0, 0);
    return 1;
}

static void hold_clr(Core *c, int s, u64 content) {
    GTab *t = &c->glob;
    Py_ssize_t i = g_find(t, content);
    if (i < 0) return;
    u64 *p = t->e + (size_t)i * (1 + t->W);
    u64 bit = (u64)1 << (s & 63);
    if (!(p[1 + (s >> 6)] & bit)) return;
    p[1 + (s >> 6)] &= ~bit;
    log_push(c, U_HOLD_CLR, s, content, 0, 0);
    if (g_empty(p, t->W)) g_erase_at(t, (size_t)i);
}

/* ---- ext entries */

static int ext_put(Core *c, int s, u64 key, u64 content, u8 meta) {
    Worker *w = &c->w[s];
    Py_ssize_t i = tab_insert(&w->ext, key, meta);
    if (i < 0) return E_NOMEM;
    w->ext.vals[i] = content;
    if (!(meta & M_UNM)) w->n_matchable++;
    log_push(c, U_EXT_INS, s, key, 0, meta & M_KIND);
    return 0;
}

static void ext_del_at(Core *c, int s, size_t i) {
    Worker *w = &c->w[s];
    u8 meta = w->ext.meta[i];
    log_push(c, U_EXT_DEL, s, w->ext.keys[i], w->ext.vals[i], meta);
    if (!(meta & M_UNM)) w->n_matchable--;
    tab_erase_at(&w->ext, i);
    tab_release_if_empty(c, &w->ext);
}

/* ---- aux entries */

/* Set (content, unm)'s refs and tiers; refs == 0 deletes, and a matchable
 * content with refs 1 on GPU alone needs no entry. E_NOMEM only when an entry
 * is new and the table is full (callers reserve one slot first). */
static int aux_put(Core *c, int s, u64 content, u32 refs, u8 tiers, int unm) {
    Worker *w = &c->w[s];
    Py_ssize_t i = aux_find(w, content, unm);
    int keep = refs > 0 && (unm || refs > 1 || tiers != GPU);
    if (i < 0 && keep && (w->aux.len + 1) * 4 > w->aux.cap * 3 && tab_reserve(&w->aux, 1) < 0) return E_NOMEM;
    if (i >= 0) {
        log_push(c, U_AUX, s, content, w->aux.vals[i], w->aux.meta[i]);
        if ((w->aux.vals[i] & 0xff) != GPU) w->n_aux_tier--;
    } else {
        log_push(c, U_AUX, s, content, 0, unm ? M_UNM : 0); /* meta without M_USED: absent before */
    }
    if (!keep) {
        if (i >= 0) {
            tab_erase_at(&w->aux, (size_t)i);
            tab_release_if_empty(c, &w->aux);
        }
        return 0;
    }
    if (i < 0) i = tab_insert(&w->aux, content, unm ? M_UNM : 0); /* room reserved above */
    w->aux.vals[i] = ((u64)refs << 8) | tiers;
    if (tiers != GPU) w->n_aux_tier++;
    return 0;
}

/* ---- block semantics */
int hold_chain(Core *c, int s, const u64 *keys, const u8 *kinds, u64 *toks, Py_ssize_t n,
               Py_ssize_t ntok, long bs, Py_ssize_t nfull, u64 h, int unm, u8 tier,
               long *added, long *dup) {
    Worker *w = &c->w[s];
    /* room for the whole event first (slots stay put while prefetched; the log
     * takes at most three entries a block) */
    if (tab_reserve(&w->ext, (size_t)n) < 0 || g_reserve(&c->glob, (size_t)n) < 0 ||
        tab_reserve(&w->aux, (size_t)(unm || tier != GPU ? n : n - nfull)) < 0 || log_reserve(c, 3 * (size_t)n) < 0)
        return E_NOMEM;
    enum { D = 12 };
    for (Py_ssize_t i = 0; i < n + D; i++) {
        if (i < n) {
            if (i < nfull)
                h = chain(toks + i * bs, (size_t)bs, h);
            else
                h = chain(toks + nfull * bs, (size_t)(ntok - nfull * bs), h);
            toks[i] = h; /* block i's tokens are consumed: the buffer holds its hash now */
            tab_prefetch(&w->ext, keys[i]);
            g_prefetch(&c->glob, h);
        }
        Py_ssize_t k = i - D;
        if (k < 0) continue;
        int r = hold_block(c, s, keys[k], kinds[k], toks[k], unm || k >= nfull, tier);
        if (r < 0) return r;
        *added += r;
        *dup += 1 - r;
    }
    return 0;
}


int hold_block(Core *c, int s, u64 key, u8 kind, u64 content, int unm, u8 code) {
    Worker *w = &c->w[s];
    /* Room first (three log entries at most, one slot in each table): past
     * this point nothing can fail, so the block is recorded whole or not at all. */
    if (tab_reserve(&w->ext, 1) < 0 || tab_reserve(&w->aux, 1) < 0 || (!unm && g_reserve(&c->glob, 1) < 0) ||
        log_reserve(c, 3) < 0)
        return E_NOMEM;
    Tab *t = &w->ext;
    u32 refs;
    u8 cur;
    /* one probe: either the id's slot or the empty slot it goes to */
    size_t m = t->cap - 1, j = tab_home(t, key);
    while (t->meta[j] && (t->keys[j] != key || (t->meta[j] & M_KIND) != kind)) j = (j + 1) & m;
    if (t->meta[j]) { /* a known id: at most one more tier */
        int punm = (t->meta[j] & M_UNM) != 0;
        u64 pc = t->vals[j];
        aux_get(w, pc, punm, &refs, &cur);
        if ((cur | code) != cur) aux_put(c, s, pc, refs, cur | code, punm);
        return 0;
    }
    t->keys[j] = key;
    t->meta[j] = kind | (unm ? M_UNM : 0) | M_USED;
    t->vals[j] = content;
    t->len++;
    if (!unm) w->n_matchable++;
    log_push(c, U_EXT_INS, s, key, 0, kind);
    int fresh = unm ? aux_find(w, content, 1) < 0 : hold_add(c, s, content);
    if (fresh) {
        if (unm || code != GPU) aux_put(c, s, content, 1, code, unm);
    } else { /* an alias: another external id for content the worker holds */
        aux_get(w, content, unm, &refs, &cur);
        aux_put(c, s, content, refs + 1, cur | code, unm);
    }
    return 1;
}

int drop_block(Core *c, int s, u64 key, u8 kind, u8 code, int unspecified, int *mismatch) {
    Worker *w = &c->w[s];
    Py_ssize_t i = ext_find(w, key, kind);
    if (i < 0) return -1;
    if (log_reserve(c, 3) < 0) return E_NOMEM; /* drops never grow a table: the log is all */
    u64 content = w->ext.vals[i];
    int unm = (w->ext.meta[i] & M_UNM) != 0;
    u32 refs;
    u8 cur;
    aux_get(w, content, unm, &refs, &cur);
    if (refs > 1) {
        ext_del_at(c, s, (size_t)i);
        aux_put(c, s, content, refs - 1, cur, unm);
        return 1;
    }
    u8 rm = code;
    if (unspecified && !(cur & GPU)) rm = ALL_TIERS;
    u8 left = cur & (u8)~rm;
    if (left == cur) {
        *mismatch = 1;
        return 0;
    }
    if (left) {
        aux_put(c, s, content, 1, left, unm);
        return 0;
    }
    ext_del_at(c, s, (size_t)i);
    aux_put(c, s, content, 0, 0, unm);
    if (!unm) hold_clr(c, s, content);
    return 1;
}

Py_ssize_t clear_blocks(Core *c, int s, u8 code) {
    Worker *w = &c->w[s];
    Py_ssize_t gone = 0;
    if (code == ALL_TIERS && !c->logging) {
        for (size_t i = 0; i < w->ext.cap; i++)
            if (w->ext.meta[i] && !(w->ext.meta[i] & M_UNM)) hold_clr(c, s, w->ext.vals[i]);
        gone = (Py_ssize_t)w->ext.len;
        tab_free(&w->ext);
        tab_free(&w->aux);
        w->n_matchable = 0;
        w->n_aux_tier = 0;
        return gone;
    }
    size_t n = w->ext.len;
    if (!n) return 0;
    u64 *keys = tsr_malloc(n * sizeof(u64));
    u8 *kinds = tsr_malloc(n);
    if (!keys || !kinds) {
        tsr_free(keys);
        tsr_free(kinds);
        return E_NOMEM;
    }
    size_t k = 0;
    for (size_t i = 0; i < w->ext.cap; i++)
        if (w->ext.meta[i]) {
            keys[k] = w->ext.keys[i];
            kinds[k++] = w->ext.meta[i] & M_KIND;
        }
    for (size_t j = 0; j < k; j++) {
        Py_ssize_t i = ext_find(w, keys[j], kinds[j]);
        if (i < 0) continue;
        int unm = (w->ext.meta[i] & M_UNM) != 0;
        u64 content = w->ext.vals[i];
        u32 refs;
        u8 cur;
        aux_get(w, content, unm, &refs, &cur);
        if (!(cur & code)) continue;
        u8 left = cur & (u8)~code;
        int r;
        if (left) {
            r = log_reserve(c, 1);
            if (r == 0) aux_put(c, s, content, refs, left, unm); /* an existing entry: no insert */
        } else {
            int mm = 0;
            r = drop_block(c, s, keys[j], kinds[j], code, 0, &mm);
            if (r > 0) gone += r;
        }
        if (r == E_NOMEM) {
            gone = E_NOMEM;
            break;
        }
    }
    tsr_free(keys);
    tsr_free(kinds);
    return gone;
}

/* Give back the memory of the tables the batch emptied (they were kept for a
 * rollback), then forget the log. */
static void batch_end(Core *c, size_t nlog) {
    c->logging = 0;
    for (size_t k = 0; k < nlog; k++) {
        Worker *w = &c->w[c->log[k].slot];
        tab_release_if_empty(c, &w->ext);
        tab_release_if_empty(c, &w->aux);
    }
    c->nlog = 0;
}

void commit_batch(Core *c) { batch_end(c, c->nlog); }

/* A log this long (entries) is given back when a call's own batch ends: one
 * huge event (a snapshot restore's store) must not keep its log forever. */
#define TXN_LOG_KEEP 4096

int txn_open(Core *c) {
    if (c->logging) return 0;
    c->nlog = 0;
    c->logging = 1;
    return 1;
}

int txn_close(Core *c, int own, int failed) {
    if (!own) return 0;
    int err = 0;
    if (failed)
        err = undo_all(c);
    else
        commit_batch(c);
    if (c->caplog > TXN_LOG_KEEP) {
        tsr_free(c->log);
        c->log = NULL;
        c->caplog = 0;
    }
    return err;
}

int undo_all(Core *c) {
    int err = 0;
    size_t n0 = c->nlog;
    c->logging = 0;
    c->undoing = 1;
    for (size_t k = n0; k-- > 0;) {
        Undo *u = &c->log[k];
        Worker *w = &c->w[u->slot];
        Py_ssize_t i;
        switch (u->op) {
        case U_EXT_INS:
            i = ext_find(w, u->key, u->meta & M_KIND);
            if (i >= 0) ext_del_at(c, u->slot, (size_t)i);
            break;
        case U_EXT_DEL:
            if (ext_put(c, u->slot, u->key, u->val, u->meta & (u8)~M_USED) < 0) err = E_NOMEM;
            break;
        case U_AUX:
            i = aux_find(w, u->key, (u->meta & M_UNM) != 0);
            if (i >= 0) {
                if ((w->aux.vals[i] & 0xff) != GPU) w->n_aux_tier--;
                tab_erase_at(&w->aux, (size_t)i);
            }
            if (u->meta & M_USED) { /* the entry existed: put it back */
                i = tab_insert(&w->aux, u->key, u->meta & (u8)~M_USED);
                if (i < 0) {
                    err = E_NOMEM;
                    break;
                }
                w->aux.vals[i] = u->val;
                if ((u->val & 0xff) != GPU) w->n_aux_tier++;
            }
            break;
        case U_HOLD_SET:
            hold_clr(c, u->slot, u->key);
            break;
        case U_HOLD_CLR:
            if (hold_add(c, u->slot, u->key) < 0) err = E_NOMEM;
            break;
        }
    }
    c->undoing = 0;
    batch_end(c, n0);
    return err;
}

/* ------------------------------------------------------------------ matching */

#define MATCH_AHEAD 16 /* blocks hashed (and their slots prefetched) ahead of the lookup */

/* Scratch of one walk: on the stack for small fleets, else one allocation. */
enum { SMALL_WORKERS = 64, SMALL_WORDS = 8 };

/* Walk one block-size group: score its workers (alive = the group's mask,
 * act = the words of it with a bit set) and fill hashes[0..depth). */
static Py_ssize_t walk_group(const Core *c, Toks *t, u64 root, long bs, u64 *alive, int *act, int nact,
                             u64 *hashes, MatchOut *out) {
    const GTab *g = &c->glob;
    size_t st = 1 + g->W;
    Py_ssize_t nfull = t->ntok / bs, nh = 0, depth = 0;
    u64 hc = root;
    for (; depth < nfull && nact; depth++) {
        while (nh < nfull && nh <= depth + MATCH_AHEAD) {
            if (!toks_need(t, (nh + 1) * bs)) break;
            hc = chain(t->buf + nh * bs, (size_t)bs, hc);
            hashes[nh++] = hc;
            g_prefetch(g, hc);
        }
        if (depth >= nh) break; /* a bad token: the caller raises */
        Py_ssize_t i = g_find(g, hashes[depth]);
        const u64 *mk = i < 0 ? NULL : g->e + (size_t)i * st + 1;
        int keep = 0;
        for (int a = 0; a < nact; a++) {
            int k = act[a];
            u64 held = mk ? mk[k] : 0, dead = alive[k] & ~held;
            while (dead) {
                out->scores[k * 64 + __builtin_ctzll(dead)] = depth;
                dead &= dead - 1;
            }
            alive[k] &= held;
            if (alive[k]) act[keep++] = k;
        }
        nact = keep;
    }
    for (int a = 0; a < nact; a++) {
        u64 rest = alive[act[a]];
        while (rest) {
            out->scores[act[a] * 64 + __builtin_ctzll(rest)] = depth;
            rest &= rest - 1;
        }
    }
    return depth;
}

int walk(const Core *c, Toks *t, u64 root, int detail, MatchOut *out) {
    int norder = c->norder;
    size_t W = W_OF(c);
    if (!norder || !c->glob.len) return 0;
    /* The distinct block sizes, in registration order, and each worker's group. */
    long sizes_s[SMALL_WORKERS];
    int gi_s[SMALL_WORKERS], act_s[SMALL_WORDS];
    u64 alive_s[SMALL_WORDS];
    long *sizes = sizes_s;
    int *gi = gi_s, *act = act_s;
    u64 *alive = alive_s, *hashes = NULL;
    int err = 0;
    if (norder > SMALL_WORKERS || W > SMALL_WORDS) {
        sizes = tsr_malloc((size_t)norder * sizeof(long));
        gi = tsr_malloc((size_t)norder * sizeof(int));
        act = tsr_malloc(W * sizeof(int));
        alive = tsr_malloc(W * sizeof(u64));
        if (!sizes || !gi || !act || !alive) {
            err = E_NOMEM;
            goto done;
        }
    }
    int ngroups = 0;
    long minbs = 0;
    for (int oi = 0, last = -1; oi < norder; oi++) {
        long bs = c->w[c->order[oi]].block_size;
        gi[oi] = -1;
        if (bs <= 0) continue;
        if (last < 0 || sizes[last] != bs) { /* neighbours mostly share a size */
            last = -1;
            for (int k = 0; k < ngroups && last < 0; k++)
                if (sizes[k] == bs) last = k;
            if (last < 0) {
                last = ngroups;
                sizes[ngroups++] = bs;
                if (!minbs || bs < minbs) minbs = bs;
            }
        }
        gi[oi] = last;
    }
    if (!ngroups || t->ntok < minbs) goto done;
    hashes = tsr_malloc((size_t)(t->ntok / minbs) * sizeof(u64));
    if (!hashes) {
        err = E_NOMEM;
        goto done;
    }
    for (int g = 0; g < ngroups; g++) {
        long bs = sizes[g];
        if (t->ntok / bs == 0) continue;
        memset(alive, 0, W * sizeof(u64));
        for (int oi = 0; oi < norder; oi++) {
            if (gi[oi] != g) continue;
            int s = c->order[oi];
            alive[s >> 6] |= (u64)1 << (s & 63);
        }
        int nact = 0;
        for (size_t k = 0; k < W; k++)
            if (alive[k]) act[nact++] = (int)k;
        walk_group(c, t, root, bs, alive, act, nact, hashes, out);
        if (!detail) continue;
        for (int oi = 0; oi < norder; oi++) {
            if (gi[oi] != g) continue;
            int s = c->order[oi];
            const Worker *w = &c->w[s];
            long sc = out->scores[s];
            long *tc = out->tiers + 3 * s;
            if (!w->n_aux_tier) {
                tc[0] = sc;
                continue;
            }
            for (long j = 0; j < sc; j++) {
                u32 refs;
                u8 tiers;
                aux_get(w, hashes[j], 0, &refs, &tiers);
                tc[(tiers & GPU) ? 0 : (tiers & CPU) ? 1 : 2]++;
            }
        }
    }
done:
    tsr_free(hashes);
    if (sizes != sizes_s) {
        tsr_free(sizes);
        tsr_free(gi);
        tsr_free(act);
        tsr_free(alive);
    }
    return err;
}
