/*
 * The fuzz targets without libFuzzer: a main that replays a corpus, then runs
 * random mutations of it (bit flips, interesting bytes, msgpack heads,
 * inserts, deletes, splices) until -runs or -max_total_time is reached.
 *
 * Why it exists: libFuzzer comes with clang, and a machine that has only gcc
 * (the C compiler the extension itself needs) must still run the CI smoke run
 * under AddressSanitizer and UBSan. It is not coverage-guided: the long
 * campaigns use libFuzzer (fuzz/run.py picks it when clang has it).
 *
 * A finding (a sanitizer report, or a failed check: fz_fail) writes the input
 * to crash-<n> in the working directory (or -artifact_prefix=) first, as
 * libFuzzer does. Options are libFuzzer's spelling, so fuzz/run.py passes the
 * same ones to both.
 */
#define _POSIX_C_SOURCE 200809L
#include <dirent.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <time.h>

#if defined(__SANITIZE_ADDRESS__)
#define FZ_ASAN 1
#elif defined(__has_feature)
#if __has_feature(address_sanitizer)
#define FZ_ASAN 1
#endif
#endif
#ifdef FZ_ASAN
#include <sanitizer/common_interface_defs.h>
#endif

int LLVMFuzzerInitialize(int *argc, char ***argv);
int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size);
extern void (*fz_on_finding)(void);

typedef struct {
    uint8_t *d;
    size_t n;
} Buf;

static Buf *corpus;
static size_t ncorpus, capcorpus;
static const uint8_t *cur;
static size_t curlen;
static const char *prefix = "";
static uint64_t rng = 0x9E3779B97F4A7C15ULL;

static uint64_t next(void) { /* xorshift64* */
    rng ^= rng >> 12;
    rng ^= rng << 25;
    rng ^= rng >> 27;
    return rng * 0x2545F4914F6CDD1DULL;
}

static void keep_input(void) {
    static int done;
    if (done) return;
    done = 1;
    char path[4096];
    snprintf(path, sizeof(path), "%scrash-%llx", prefix, (unsigned long long)(next() & 0xffffffff));
    FILE *f = fopen(path, "wb");
    if (f) {
        if (curlen) fwrite(cur, 1, curlen, f);
        fclose(f);
        fprintf(stderr, "==driver== input written to %s (%zu bytes)\n", path, curlen);
    }
}

static void add(const uint8_t *d, size_t n) {
    if (ncorpus == capcorpus) {
        capcorpus = capcorpus ? 2 * capcorpus : 256;
        corpus = realloc(corpus, capcorpus * sizeof(Buf));
        if (!corpus) abort();
    }
    uint8_t *c = malloc(n ? n : 1);
    if (!c) abort();
    if (n) memcpy(c, d, n);
    corpus[ncorpus].d = c;
    corpus[ncorpus].n = n;
    ncorpus++;
}

static void load(const char *path) {
    struct stat st;
    if (stat(path, &st) < 0) return;
    if (S_ISDIR(st.st_mode)) {
        DIR *dir = opendir(path);
        if (!dir) return;
        struct dirent *e;
        while ((e = readdir(dir))) {
            if (e->d_name[0] == '.') continue;
            char sub[4096];
            snprintf(sub, sizeof(sub), "%s/%s", path, e->d_name);
            load(sub);
        }
        closedir(dir);
        return;
    }
    FILE *f = fopen(path, "rb");
    if (!f) return;
    size_t n = (size_t)st.st_size;
    uint8_t *d = malloc(n ? n : 1);
    if (!d || fread(d, 1, n, f) != n) abort();
    fclose(f);
    add(d, n);
    free(d);
}

static void run(const uint8_t *d, size_t n) {
    cur = d;
    curlen = n;
    LLVMFuzzerTestOneInput(d, n);
}

#define MAXLEN 65536
static const uint8_t interesting[] = {0x00, 0x01, 0x7f, 0x80, 0xff, 0xc0, 0xc1, 0xc2, 0xc4, 0xc5, 0xc6, 0xca, 0xcb,
                                      0xcc, 0xcd, 0xce, 0xcf, 0xd0, 0xd3, 0xd9, 0xdc, 0xdd, 0xde, 0xdf, 0x90, 0x9f,
                                      0x80, 0x8f, 0xa0, 0xbf, 0xe0, 0xc7, 0xd4, 0xd8};

static size_t mutate(uint8_t *d, size_t n) {
    int k = 1 + (int)(next() % 6);
    for (int r = 0; r < k; r++) {
        size_t at = n ? next() % n : 0;
        switch (next() % 8) {
        case 0:
            if (n) d[at] ^= (uint8_t)(1u << (next() % 8));
            break;
        case 1:
            if (n) d[at] = (uint8_t)next();
            break;
        case 2:
            if (n) d[at] = interesting[next() % sizeof(interesting)];
            break;
        case 3: { /* insert a few bytes */
            size_t m = 1 + next() % 8;
            if (n + m > MAXLEN) break;
            memmove(d + at + m, d + at, n - at);
            for (size_t i = 0; i < m; i++) d[at + i] = next() & 1 ? (uint8_t)next() : interesting[next() % sizeof(interesting)];
            n += m;
            break;
        }
        case 4: { /* delete a range */
            if (!n) break;
            size_t m = 1 + next() % (n - at < 16 ? n - at : 16);
            memmove(d + at, d + at + m, n - at - m);
            n -= m;
            break;
        }
        case 5: { /* overwrite with a slice of another input */
            const Buf *o = &corpus[next() % ncorpus];
            if (!o->n || !n) break;
            size_t from = next() % o->n, m = 1 + next() % 32;
            if (m > o->n - from) m = o->n - from;
            if (m > n - at) m = n - at;
            memcpy(d + at, o->d + from, m);
            break;
        }
        case 6: /* truncate */
            n = at;
            break;
        default: /* a big-endian length field gets an extreme value */
            if (n >= 4 && at <= n - 4) {
                uint32_t v = next() & 1 ? 0xffffffffu : (uint32_t)(next() % 70000);
                d[at] = (uint8_t)(v >> 24);
                d[at + 1] = (uint8_t)(v >> 16);
                d[at + 2] = (uint8_t)(v >> 8);
                d[at + 3] = (uint8_t)v;
            }
        }
    }
    return n;
}

int main(int argc, char **argv) {
    long long runs = -1;
    double max_time = 0;
    for (int i = 1; i < argc; i++) {
        if (!strncmp(argv[i], "-runs=", 6)) runs = atoll(argv[i] + 6);
        else if (!strncmp(argv[i], "-max_total_time=", 16)) max_time = atof(argv[i] + 16);
        else if (!strncmp(argv[i], "-seed=", 6)) rng = (uint64_t)atoll(argv[i] + 6) * 2654435761u + 1;
        else if (!strncmp(argv[i], "-artifact_prefix=", 17)) prefix = argv[i] + 17;
        else if (argv[i][0] == '-') continue; /* other libFuzzer options: not ours */
        else load(argv[i]);
    }
    fz_on_finding = keep_input;
#ifdef FZ_ASAN
    __sanitizer_set_death_callback(keep_input);
#endif
    LLVMFuzzerInitialize(&argc, &argv);
    if (!ncorpus) add((const uint8_t *)"", 0);
    struct timespec t0, t1;
    clock_gettime(CLOCK_MONOTONIC, &t0);
    long long execs = 0;
    for (size_t i = 0; i < ncorpus; i++, execs++) run(corpus[i].d, corpus[i].n);
    fprintf(stderr, "==driver== replayed %zu inputs\n", ncorpus);
    uint8_t *buf = malloc(MAXLEN + 64);
    if (!buf) abort();
    double el = 0;
    while ((runs < 0 || execs < runs) && (max_time <= 0 || el < max_time)) {
        const Buf *s = &corpus[next() % ncorpus];
        size_t n = s->n > MAXLEN ? MAXLEN : s->n;
        memcpy(buf, s->d, n);
        n = mutate(buf, n);
        run(buf, n);
        execs++;
        if ((execs & 63) == 0) {
            clock_gettime(CLOCK_MONOTONIC, &t1);
            el = (double)(t1.tv_sec - t0.tv_sec) + (double)(t1.tv_nsec - t0.tv_nsec) / 1e9;
        }
        if (runs < 0 && max_time <= 0) break;
    }
    clock_gettime(CLOCK_MONOTONIC, &t1);
    el = (double)(t1.tv_sec - t0.tv_sec) + (double)(t1.tv_nsec - t0.tv_nsec) / 1e9;
    fprintf(stderr, "==driver== Done %lld runs in %.1f s (corpus %zu, no coverage guidance)\n", execs, el, ncorpus);
    free(buf);
    return 0;
}
