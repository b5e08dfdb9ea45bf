/* The index core (index.h): block semantics, undo log, match walk. */
#include "index.h"

static void log_push(Core *c, u8 op, int slot, u64 key, u64 val, u8 meta) {
    if (!c->logging) return;
    if (c->nlog == c->caplog) {
        size_t cap = c->caplog ? c->caplog * 2 : 256;
        Undo *n = realloc(c->log, cap * sizeof(Undo));
        if (!n) {
            c->oom = 1;
            return;
        }
        c->log = n;
        c->caplog = cap;
    }
    Undo *u = &c->log[c->nlog++];
    u->op = op;
    u->slot = slot;
    u->key = key;
    u->val = val;
    u->meta = meta;
}

/* ---- holders */

/* Set slot s's bit on content (one probe); 1 if it was not set. */
static int hold_add(Core *c, int s, u64 content) {
    GTab *t = &c->glob;
    if (g_reserve(t, 1) < 0) {
        c->oom = 1;
        return 0;
    }
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

static void hold_set(Core *c, int s, u64 content) { hold_add(c, s, content); }

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
    if (i < 0) {
        c->oom = 1;
        return -1;
    }
    w->ext.vals[i] = content;
    if (!(meta & M_UNM)) w->n_matchable++;
    log_push(c, U_EXT_INS, s, key, 0, 0);
    return 0;
}

static void ext_del_at(Core *c, int s, size_t i) {
    Worker *w = &c->w[s];
    u8 meta = w->ext.meta[i];
    log_push(c, U_EXT_DEL, s, w->ext.keys[i], w->ext.vals[i], meta);
    if (!(meta & M_UNM)) w->n_matchable--;
    tab_erase_at(&w->ext, i);
}

/* ---- aux entries: content key -> refs, tiers (default: 1, GPU) */

/* refs == 0 deletes; a matchable content with refs 1 on GPU alone needs no entry */
static void aux_put(Core *c, int s, u64 ckey, u32 refs, u8 tiers, int unm) {
    Worker *w = &c->w[s];
    Py_ssize_t i = tab_find(&w->aux, ckey);
    if (i >= 0) {
        log_push(c, U_AUX, s, ckey, w->aux.vals[i], w->aux.meta[i]);
        if ((w->aux.vals[i] & 0xff) != GPU) w->n_aux_tier--;
    } else {
        log_push(c, U_AUX, s, ckey, 0, 0);
    }
    int keep = refs > 0 && (unm || refs > 1 || tiers != GPU);
    if (!keep) {
        if (i >= 0) tab_erase_at(&w->aux, (size_t)i);
        return;
    }
    if (i < 0) {
        i = tab_insert(&w->aux, ckey, unm ? M_UNM : 0);
        if (i < 0) {
            c->oom = 1;
            return;
        }
    }
    w->aux.vals[i] = ((u64)refs << 8) | tiers;
    if (tiers != GPU) w->n_aux_tier++;
}

static inline int aux_has(const Worker *w, u64 ckey) { return tab_find(&w->aux, ckey) >= 0; }

/* ---- block semantics */

/* Record that slot s holds content as external key on tier `code`: 1 new, 0 duplicate. */
int hold_block(Core *c, int s, u64 key, u8 kind, u64 content, int unm, u8 code) {
    Worker *w = &c->w[s];
    Tab *t = &w->ext;
    u32 refs;
    u8 cur;
    if (t->cap && (t->len + 1) * 4 <= t->cap * 3) {
        /* one probe: either the key's slot or the empty slot it goes to */
        size_t m = t->cap - 1, j = tab_home(t, key);
        while (t->meta[j] && t->keys[j] != key) j = (j + 1) & m;
        if (!t->meta[j]) {
            t->keys[j] = key;
            t->meta[j] = kind | (unm ? M_UNM : 0) | M_USED;
            t->vals[j] = content;
            t->len++;
            if (!unm) w->n_matchable++;
            log_push(c, U_EXT_INS, s, key, 0, 0);
            goto fresh_ext;
        }
    }
    Py_ssize_t i = tab_find(&w->ext, key);
    if (i >= 0) {
        int punm = (w->ext.meta[i] & M_UNM) != 0;
        u64 ck = ckey_of(w->ext.vals[i], punm);
        aux_get(w, ck, &refs, &cur);
        if ((cur | code) != cur) aux_put(c, s, ck, refs, cur | code, punm);
        return 0;
    }
    if (ext_put(c, s, key, content, kind | (unm ? M_UNM : 0)) < 0) return 0;
fresh_ext:;
    u64 ck = ckey_of(content, unm);
    int fresh;
    if (!unm) {
        fresh = hold_add(c, s, content);
    } else {
        fresh = !aux_has(w, ck);
    }
    if (fresh) {
        if (unm || code != GPU) aux_put(c, s, ck, 1, code, unm);
    } else {
        aux_get(w, ck, &refs, &cur);
        aux_put(c, s, ck, refs + 1, cur | code, unm);
    }
    return 1;
}

/* Remove tier `code` of external key: 1 gone, 0 still held (or mismatch: *mismatch=1), -1 unknown. */
int drop_block(Core *c, int s, u64 key, u8 code, int unspecified, int *mismatch) {
    Worker *w = &c->w[s];
    Py_ssize_t i = tab_find(&w->ext, key);
    if (i < 0) return -1;
    u64 content = w->ext.vals[i];
    int unm = (w->ext.meta[i] & M_UNM) != 0;
    u64 ck = ckey_of(content, unm);
    u32 refs;
    u8 cur;
    aux_get(w, ck, &refs, &cur);
    if (refs > 1) {
        ext_del_at(c, s, (size_t)i);
        aux_put(c, s, ck, refs - 1, cur, unm);
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
        aux_put(c, s, ck, 1, left, unm);
        return 0;
    }
    ext_del_at(c, s, (size_t)i);
    aux_put(c, s, ck, 0, 0, unm);
    if (!unm) hold_clr(c, s, content);
    return 1;
}

size_t clear_blocks(Core *c, int s, u8 code) {
    Worker *w = &c->w[s];
    size_t gone = 0;
    if (code == ALL_TIERS && !c->logging) {
        for (size_t i = 0; i < w->ext.cap; i++)
            if (w->ext.meta[i] && !(w->ext.meta[i] & M_UNM)) hold_clr(c, s, w->ext.vals[i]);
        gone = w->ext.len;
        tab_free(&w->ext);
        tab_free(&w->aux);
        w->n_matchable = 0;
        w->n_aux_tier = 0;
        return gone;
    }
    size_t n = w->ext.len;
    if (!n) return 0;
    u64 *keys = malloc(n * sizeof(u64));
    if (!keys) {
        c->oom = 1;
        return 0;
    }
    size_t k = 0;
    for (size_t i = 0; i < w->ext.cap; i++)
        if (w->ext.meta[i]) keys[k++] = w->ext.keys[i];
    for (size_t j = 0; j < k; j++) {
        Py_ssize_t i = tab_find(&w->ext, keys[j]);
        if (i < 0) continue;
        int unm = (w->ext.meta[i] & M_UNM) != 0;
        u64 ck = ckey_of(w->ext.vals[i], unm);
        u32 refs;
        u8 cur;
        aux_get(w, ck, &refs, &cur);
        if (!(cur & code)) continue;
        u8 left = cur & (u8)~code;
        if (left) {
            aux_put(c, s, ck, refs, left, unm);
        } else {
            int mm = 0;
            int r = drop_block(c, s, keys[j], code, 0, &mm);
            if (r > 0) gone += (size_t)r;
        }
    }
    free(keys);
    return gone;
}

void undo_all(Core *c) {
    int was = c->logging;
    c->logging = 0;
    while (c->nlog) {
        Undo *u = &c->log[--c->nlog];
        Worker *w = &c->w[u->slot];
        Py_ssize_t i;
        switch (u->op) {
        case U_EXT_INS:
            i = tab_find(&w->ext, u->key);
            if (i >= 0) ext_del_at(c, u->slot, (size_t)i);
            break;
        case U_EXT_DEL:
            ext_put(c, u->slot, u->key, u->val, u->meta & (u8)~M_USED);
            break;
        case U_AUX:
            i = tab_find(&w->aux, u->key);
            if (i >= 0) {
                if ((w->aux.vals[i] & 0xff) != GPU) w->n_aux_tier--;
                tab_erase_at(&w->aux, (size_t)i);
            }
            if (u->meta) {
                i = tab_insert(&w->aux, u->key, u->meta & (u8)~M_USED);
                if (i < 0) {
                    c->oom = 1;
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
            hold_set(c, u->slot, u->key);
            break;
        }
    }
    c->logging = was;
}

/* ------------------------------------------------------------------ matching */

#define MATCH_AHEAD 16 /* blocks hashed (and their slots prefetched) ahead of the lookup */

/* Walk every block-size group; lock held by the caller. */
void walk(Core *c, Toks *t, u64 root, int detail, MatchOut *out) {
    size_t W = W_OF(c);
    u64 group[8], alive[8], m[8]; /* up to 512 worker slots */
    if (W > 8) W = 8;
    long done_sizes[64];
    int ndone = 0;
    Py_ssize_t ntok = t->ntok;
    u64 *hashes = NULL;
    for (int oi = 0; oi < c->norder; oi++) {
        long bs = c->w[c->order[oi]].block_size;
        if (bs <= 0) continue;
        int seen = 0;
        for (int k = 0; k < ndone; k++) seen |= done_sizes[k] == bs;
        if (seen || ndone == 64) continue;
        done_sizes[ndone++] = bs;
        memset(group, 0, sizeof(group));
        for (int oj = 0; oj < c->norder; oj++) {
            int s = c->order[oj];
            if (c->w[s].block_size == bs && (size_t)(s >> 6) < W) group[s >> 6] |= (u64)1 << (s & 63);
        }
        Py_ssize_t nfull = ntok / bs;
        if (!nfull || !c->glob.len) continue;
        free(hashes);
        hashes = malloc((size_t)nfull * sizeof(u64));
        if (!hashes) {
            c->oom = 1;
            return;
        }
        memcpy(alive, group, sizeof(alive));
        u64 hc = root;
        Py_ssize_t nh = 0, depth = 0;
        int any = 1;
        for (; depth < nfull && any; depth++) {
            while (nh < nfull && nh <= depth + MATCH_AHEAD) {
                if (!toks_need(t, (nh + 1) * bs)) break;
                hc = chain(t->buf + nh * bs, (size_t)bs, hc);
                hashes[nh++] = hc;
                g_prefetch(&c->glob, hc);
            }
            if (depth >= nh) break; /* a bad token: the caller raises */
            Py_ssize_t i = g_find(&c->glob, hashes[depth]);
            if (i < 0)
                memset(m, 0, sizeof(m));
            else
                for (size_t k = 0; k < W; k++) m[k] = c->glob.e[(size_t)i * (1 + W_OF(c)) + 1 + k];
            any = 0;
            for (size_t k = 0; k < W; k++) {
                u64 dead = alive[k] & ~m[k];
                while (dead) {
                    int b = __builtin_ctzll(dead);
                    out->scores[k * 64 + b] = depth;
                    dead &= dead - 1;
                }
                alive[k] &= m[k];
                any |= alive[k] != 0;
            }
        }
        for (size_t k = 0; k < W; k++) {
            u64 a = alive[k];
            while (a) {
                int b = __builtin_ctzll(a);
                out->scores[k * 64 + b] = depth;
                a &= a - 1;
            }
        }
        if (detail) {
            for (int oj = 0; oj < c->norder; oj++) {
                int s = c->order[oj];
                Worker *w = &c->w[s];
                if (w->block_size != bs) continue;
                long sc = out->scores[s];
                long *tc = out->tiers + 3 * s;
                if (!w->n_aux_tier) {
                    tc[0] = sc;
                    continue;
                }
                for (long j = 0; j < sc; j++) {
                    u32 refs;
                    u8 tiers;
                    aux_get(w, hashes[j], &refs, &tiers);
                    tc[(tiers & GPU) ? 0 : (tiers & CPU) ? 1 : 2]++;
                }
            }
        }
    }
    free(hashes);
}
