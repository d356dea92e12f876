/* What the C loops' test programs share (csrc/tests/test_*.c, run by tests/native/ under
 * -fsanitize=address,undefined): a check that names the failing line, a reference hash with a
 * one-shot and a streaming form (the loops take python-xxhash's functions by address; any
 * hash with the same one-shot / streaming agreement tests them), a byte pattern and a
 * temporary file. */
#ifndef FC_TEST_H
#define FC_TEST_H

#define _GNU_SOURCE
#include <errno.h>
#include <fcntl.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

static int fc_failures = 0;

#define CHECK(cond)                                                                     \
    do {                                                                                \
        if (!(cond)) {                                                                  \
            fprintf(stderr, "%s:%d: check failed: %s\n", __FILE__, __LINE__, #cond);    \
            fc_failures++;                                                              \
        }                                                                               \
    } while (0)

#define CHECK_EQ(a, b)                                                                              \
    do {                                                                                            \
        long long fc_a = (long long)(a), fc_b = (long long)(b);                                     \
        if (fc_a != fc_b) {                                                                         \
            fprintf(stderr, "%s:%d: %s == %lld, want %s == %lld\n", __FILE__, __LINE__, #a, fc_a, #b, fc_b); \
            fc_failures++;                                                                          \
        }                                                                                           \
    } while (0)

/* the program's exit status: 0 when every check passed */
static inline int fc_done(const char *name) {
    if (fc_failures) fprintf(stderr, "%s: %d check(s) failed\n", name, fc_failures);
    else printf("%s: ok\n", name);
    return fc_failures ? 1 : 0;
}

/* FNV-1a 64 over n bytes (the stand-in for XXH3_64bits) */
static inline uint64_t fnv_update(uint64_t h, const void *p, size_t n) {
    const uint8_t *b = (const uint8_t *)p;
    for (size_t i = 0; i < n; i++) { h ^= b[i]; h *= 0x100000001b3ULL; }
    return h;
}
static inline uint64_t fnv(const void *p, size_t n) { return fnv_update(0xcbf29ce484222325ULL, p, n); }

/* the streaming form, as XXH3_createState / _freeState / _64bits_reset / _update / _digest */
typedef struct { uint64_t h; } fnv_state;
static inline void *fnv_create(void) { return calloc(1, sizeof(fnv_state)); }
static inline int fnv_free(void *s) { free(s); return 0; }
static inline int fnv_reset(void *s) { ((fnv_state *)s)->h = 0xcbf29ce484222325ULL; return 0; }
static inline int fnv_stream(void *s, const void *p, size_t n) { ((fnv_state *)s)->h = fnv_update(((fnv_state *)s)->h, p, n); return 0; }
static inline uint64_t fnv_digest(const void *s) { return ((const fnv_state *)s)->h; }

/* byte i of pattern `seed` */
static inline uint8_t pat(int64_t seed, int64_t i) { return (uint8_t)((i * 131 + seed * 7 + (i >> 8) * 17) & 0xff); }
static inline void fill(uint8_t *p, int64_t n, int64_t seed) { for (int64_t i = 0; i < n; i++) p[i] = pat(seed, i); }

/* a new empty file in $TMPDIR (or /tmp), already unlinked: gone when closed */
static inline int temp_file(void) {
    const char *d = getenv("TMPDIR");
    char path[4096];
    snprintf(path, sizeof path, "%s/fc-ctest-XXXXXX", d && *d ? d : "/tmp");
    int fd = mkstemp(path);
    if (fd < 0) { perror("mkstemp"); exit(2); }
    unlink(path);
    return fd;
}

/* write n bytes of p at off (whole) */
static inline void put(int fd, const uint8_t *p, int64_t n, int64_t off) {
    int64_t done = 0;
    while (done < n) {
        ssize_t r = pwrite(fd, p + done, (size_t)(n - done), (off_t)(off + done));
        if (r <= 0) { perror("pwrite"); exit(2); }
        done += r;
    }
}

#endif
