/* I/O faults injected where FlatCake's shipped read and write paths run: an LD_PRELOAD
 * interposer of libc's positioned I/O calls (tests and scripts/soak.py only; never loaded by
 * the package itself). Built by flatcake/testing/fault_preload.py.
 *
 * Why these symbols. FlatCake's default paths are C loops compiled at run time
 * (flatcake/native/loops.py) and called through ctypes, so patching os.preadv/os.pwritev in
 * Python never reaches them:
 *   - the one-call restore (flatcake/cio/native_restore_c.py) calls pread,
 *   - the zero-copy restore (flatcake/cio/native_zero_copy_c.py) calls preadv,
 *   - the write queue's piece writer (flatcake/store/native_write.py) calls pwrite;
 *   those loops are built without _FILE_OFFSET_BITS (LP64: off_t is 64-bit), so they bind the
 *   plain names. CPython binds the large-file names (it is built with _FILE_OFFSET_BITS=64 and
 *   has preadv2): os.pread -> pread64, os.preadv -> preadv64v2, os.pwrite -> pwrite64,
 *   os.pwritev -> pwritev64v2, os.posix_fallocate -> posix_fallocate64 (`nm -D libpython3.so`).
 *   In glibc each plain name and its 64 / v2 twin are aliases of one function, but a caller binds
 *   one name, so every spelling is interposed: pread pread64 preadv preadv64 preadv2 preadv64v2,
 *   pwrite pwrite64 pwritev pwritev64 pwritev2 pwritev64v2, posix_fallocate posix_fallocate64.
 *   (glibc's own internal calls do not go through these symbols and are never touched.)
 *
 * Lifecycle: the constructor reads the configuration from the environment, resolves the real
 * functions (dlsym RTLD_NEXT) and removes LD_PRELOAD from the environment, so processes this one
 * starts are not interposed. Faults are injected only while
 * armed, only on descriptors whose path (/proc/self/fd) starts with FC_FAULT_PATH and ends with
 * FC_FAULT_SUFFIX; each injected fault is counted by (symbol, kind, calling object) — the calling
 * object (dladdr of the return address) shows what saw it (FlatCake's extension _native.*.so, whose
 * pread only the restore and pwrite only the piece writer call; libpython...).
 *
 * Environment (read once, at load):
 *   FC_FAULT_ARMED=1      inject from the start (default: armed later with fc_fault_arm)
 *   FC_FAULT_RATE=p       probability per call of a random fault (default 0)
 *   FC_FAULT_SEED=n       seed of the draws (default 0; draws are a counter hashed, thread-safe)
 *   FC_FAULT_KINDS=...    comma list of random kinds, each with probability p per call:
 *                         eio (reads fail with EIO), short (reads longer than 4 KiB return
 *                         4 KiB), enospc (writes and fallocate fail with ENOSPC);
 *                         default "eio,short"
 *   FC_FAULT_PATH=prefix  only files whose path starts so (default: every file)
 *   FC_FAULT_SUFFIX=s     only files whose path ends so (default: every file)
 * Control (ctypes, the symbols below): arm/disarm, rate and kinds, an ENOSPC window for writes
 * and fallocate, one file that refuses writes with EROFS, and the report of injected faults.
 */
#define _GNU_SOURCE
#include <dlfcn.h>
#include <errno.h>
#include <fcntl.h>
#include <pthread.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/types.h>
#include <sys/uio.h>
#include <time.h>
#include <unistd.h>

enum { K_EIO, K_SHORT, K_ENOSPC, K_EROFS, N_KINDS };
static const char *const KIND_NAMES[N_KINDS] = {"eio", "short", "enospc", "erofs"};
#define SHORT_BYTES 4096

/* ---------------------------------------------------------------- configuration and state */
static volatile int g_armed;
static volatile double g_rate;
static volatile unsigned g_kinds = (1u << K_EIO) | (1u << K_SHORT);
static uint64_t g_seed;
static uint64_t g_draws;                  /* atomic */
static volatile int64_t g_enospc_until_ns; /* CLOCK_MONOTONIC */
static char g_prefix[4096], g_suffix[256];
static pthread_mutex_t g_mu = PTHREAD_MUTEX_INITIALIZER; /* g_refuse and the fault table */
static char g_refuse[4096];
static volatile int g_refusing;

typedef struct { char symbol[24]; int kind; char caller[96]; int64_t count; } fault_row;
#define MAX_ROWS 128
static fault_row g_rows[MAX_ROWS];
static int g_nrows;

/* ---------------------------------------------------------------- the real functions */
static ssize_t (*r_pread)(int, void *, size_t, off_t);
static ssize_t (*r_pread64)(int, void *, size_t, off64_t);
static ssize_t (*r_preadv)(int, const struct iovec *, int, off_t);
static ssize_t (*r_preadv64)(int, const struct iovec *, int, off64_t);
static ssize_t (*r_preadv2)(int, const struct iovec *, int, off_t, int);
static ssize_t (*r_preadv64v2)(int, const struct iovec *, int, off64_t, int);
static ssize_t (*r_pwrite)(int, const void *, size_t, off_t);
static ssize_t (*r_pwrite64)(int, const void *, size_t, off64_t);
static ssize_t (*r_pwritev)(int, const struct iovec *, int, off_t);
static ssize_t (*r_pwritev64)(int, const struct iovec *, int, off64_t);
static ssize_t (*r_pwritev2)(int, const struct iovec *, int, off_t, int);
static ssize_t (*r_pwritev64v2)(int, const struct iovec *, int, off64_t, int);
static int (*r_posix_fallocate)(int, off_t, off_t);
static int (*r_posix_fallocate64)(int, off64_t, off64_t);

#define RESOLVE(name) (r_##name = dlsym(RTLD_NEXT, #name))

static void set_kinds(const char *s) {
    unsigned k = 0;
    for (int i = 0; i < N_KINDS; i++) {
        const char *p = s;
        size_t n = strlen(KIND_NAMES[i]);
        while ((p = strstr(p, KIND_NAMES[i])) != NULL) {
            if ((p == s || p[-1] == ',') && (p[n] == ',' || p[n] == 0)) { k |= 1u << i; break; }
            p += n;
        }
    }
    g_kinds = k;
}

__attribute__((constructor)) static void fc_fault_init(void) {
    RESOLVE(pread); RESOLVE(pread64); RESOLVE(preadv); RESOLVE(preadv64); RESOLVE(preadv2); RESOLVE(preadv64v2);
    RESOLVE(pwrite); RESOLVE(pwrite64); RESOLVE(pwritev); RESOLVE(pwritev64); RESOLVE(pwritev2);
    RESOLVE(pwritev64v2); RESOLVE(posix_fallocate); RESOLVE(posix_fallocate64);
    const char *v;
    if ((v = getenv("FC_FAULT_RATE")) != NULL) g_rate = strtod(v, NULL);
    if ((v = getenv("FC_FAULT_SEED")) != NULL) g_seed = strtoull(v, NULL, 10);
    if ((v = getenv("FC_FAULT_KINDS")) != NULL) set_kinds(v);
    if ((v = getenv("FC_FAULT_PATH")) != NULL) snprintf(g_prefix, sizeof g_prefix, "%s", v);
    if ((v = getenv("FC_FAULT_SUFFIX")) != NULL) snprintf(g_suffix, sizeof g_suffix, "%s", v);
    if ((v = getenv("FC_FAULT_ARMED")) != NULL) g_armed = strcmp(v, "1") == 0;
    unsetenv("LD_PRELOAD"); /* children (the compiler) run without it */
}

/* ---------------------------------------------------------------- decisions */
static double draw(void) {
    uint64_t x = g_seed + 0x9E3779B97F4A7C15ull * (__atomic_fetch_add(&g_draws, 1, __ATOMIC_RELAXED) + 1);
    x = (x ^ (x >> 30)) * 0xBF58476D1CE4E5B9ull; /* splitmix64 */
    x = (x ^ (x >> 27)) * 0x94D049BB133111EBull;
    x ^= x >> 31;
    return (double)(x >> 11) * (1.0 / 9007199254740992.0);
}

static int64_t now_ns(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (int64_t)ts.tv_sec * 1000000000 + ts.tv_nsec;
}

/* the file behind fd, into buf; 0 when it has none */
static int path_of(int fd, char *buf, size_t n) {
    char link[64];
    snprintf(link, sizeof link, "/proc/self/fd/%d", fd);
    ssize_t r = readlink(link, buf, n - 1);
    if (r <= 0) return 0;
    buf[r] = 0;
    return 1;
}

static int targeted(const char *path) {
    size_t lp = strlen(g_prefix), ls = strlen(g_suffix), n = strlen(path);
    return strncmp(path, g_prefix, lp) == 0 && n >= ls && strcmp(path + n - ls, g_suffix) == 0;
}

static void count(const char *symbol, int kind, void *ret) {
    Dl_info info;
    const char *caller = "?";
    if (ret && dladdr(ret, &info) && info.dli_fname && info.dli_fname[0]) {
        const char *slash = strrchr(info.dli_fname, '/');
        caller = slash ? slash + 1 : info.dli_fname;
    }
    pthread_mutex_lock(&g_mu);
    int i = 0;
    for (; i < g_nrows; i++)
        if (g_rows[i].kind == kind && !strcmp(g_rows[i].symbol, symbol) && !strcmp(g_rows[i].caller, caller)) break;
    if (i == g_nrows && g_nrows < MAX_ROWS) {
        snprintf(g_rows[i].symbol, sizeof g_rows[i].symbol, "%s", symbol);
        snprintf(g_rows[i].caller, sizeof g_rows[i].caller, "%s", caller);
        g_rows[i].kind = kind;
        g_nrows++;
    }
    if (i < g_nrows) g_rows[i].count++;
    pthread_mutex_unlock(&g_mu);
}

/* A read: -1 (no fault), K_EIO or K_SHORT (the latter only when want > SHORT_BYTES). */
static int read_fault(int fd, size_t want) {
    if (!g_armed) return -1;
    double u = draw(), p = g_rate, lo = 0;  /* each kind on has its own band of width p */
    int k = -1;
    if (g_kinds & (1u << K_EIO)) {
        if (u < p) k = K_EIO;
        lo = p;
    }
    if (k < 0 && (g_kinds & (1u << K_SHORT)) && u >= lo && u < lo + p && want > SHORT_BYTES) k = K_SHORT;
    char path[4096];
    if (k >= 0 && !(path_of(fd, path, sizeof path) && targeted(path))) k = -1;
    return k;
}

/* A write or fallocate: -1 (no fault), K_EROFS (the refused file), K_ENOSPC (a window or a draw). */
static int write_fault(int fd) {
    if (!g_armed) return -1;
    int window = g_enospc_until_ns > now_ns();
    int drawn = (g_kinds & (1u << K_ENOSPC)) && g_rate > 0 && draw() < g_rate;
    if (!g_refusing && !window && !drawn) return -1;
    char path[4096];
    if (!path_of(fd, path, sizeof path) || !targeted(path)) return -1;
    if (g_refusing) {
        pthread_mutex_lock(&g_mu);
        int refused = g_refusing && strcmp(path, g_refuse) == 0;
        pthread_mutex_unlock(&g_mu);
        if (refused) return K_EROFS;
    }
    return (window || drawn) ? K_ENOSPC : -1;
}

static size_t iov_bytes(const struct iovec *iov, int cnt) {
    size_t n = 0;
    for (int i = 0; i < cnt; i++) n += iov[i].iov_len;
    return n;
}

/* the first SHORT_BYTES of iov (at most HEAD_IOVS entries of it), into out; returns the count */
#define HEAD_IOVS 64
static int iov_head(const struct iovec *iov, int cnt, struct iovec *out) {
    size_t left = SHORT_BYTES;
    int n = 0;
    for (int i = 0; i < cnt && left && n < HEAD_IOVS; i++, n++) {
        out[n] = iov[i];
        if (out[n].iov_len > left) out[n].iov_len = left;
        left -= out[n].iov_len;
    }
    return n;
}

/* ---------------------------------------------------------------- interposed calls */
#define READ_PLAIN(name, off_type)                                                              \
    ssize_t name(int fd, void *buf, size_t n, off_type off) {                                   \
        int k = read_fault(fd, n);                                                              \
        if (k >= 0) count(#name, k, __builtin_return_address(0));                               \
        if (k == K_EIO) { errno = EIO; return -1; }                                             \
        return r_##name(fd, buf, k == K_SHORT ? SHORT_BYTES : n, off);                          \
    }
READ_PLAIN(pread, off_t)
READ_PLAIN(pread64, off64_t)

#define READ_VEC(name, off_type, FLAGS_PARAM, FLAGS_ARG)                                        \
    ssize_t name(int fd, const struct iovec *iov, int cnt, off_type off FLAGS_PARAM) {          \
        int k = read_fault(fd, iov_bytes(iov, cnt));                                            \
        if (k >= 0) count(#name, k, __builtin_return_address(0));                               \
        if (k == K_EIO) { errno = EIO; return -1; }                                             \
        if (k == K_SHORT) {                                                                     \
            struct iovec head[HEAD_IOVS];                                                       \
            return r_##name(fd, head, iov_head(iov, cnt, head), off FLAGS_ARG);                 \
        }                                                                                       \
        return r_##name(fd, iov, cnt, off FLAGS_ARG);                                           \
    }
#define NOFLAGS
#define COMMA_INT_FLAGS , int flags
#define COMMA_FLAGS , flags
READ_VEC(preadv, off_t, NOFLAGS, NOFLAGS)
READ_VEC(preadv64, off64_t, NOFLAGS, NOFLAGS)
READ_VEC(preadv2, off_t, COMMA_INT_FLAGS, COMMA_FLAGS)
READ_VEC(preadv64v2, off64_t, COMMA_INT_FLAGS, COMMA_FLAGS)

#define WRITE_FAIL(name)                                                                        \
    int k = write_fault(fd);                                                                    \
    if (k >= 0) {                                                                               \
        count(#name, k, __builtin_return_address(0));                                           \
        errno = k == K_EROFS ? EROFS : ENOSPC;                                                  \
        return -1;                                                                              \
    }

ssize_t pwrite(int fd, const void *buf, size_t n, off_t off) { WRITE_FAIL(pwrite) return r_pwrite(fd, buf, n, off); }
ssize_t pwrite64(int fd, const void *buf, size_t n, off64_t off) {
    WRITE_FAIL(pwrite64) return r_pwrite64(fd, buf, n, off);
}
ssize_t pwritev(int fd, const struct iovec *iov, int cnt, off_t off) {
    WRITE_FAIL(pwritev) return r_pwritev(fd, iov, cnt, off);
}
ssize_t pwritev64(int fd, const struct iovec *iov, int cnt, off64_t off) {
    WRITE_FAIL(pwritev64) return r_pwritev64(fd, iov, cnt, off);
}
ssize_t pwritev2(int fd, const struct iovec *iov, int cnt, off_t off, int flags) {
    WRITE_FAIL(pwritev2) return r_pwritev2(fd, iov, cnt, off, flags);
}
ssize_t pwritev64v2(int fd, const struct iovec *iov, int cnt, off64_t off, int flags) {
    WRITE_FAIL(pwritev64v2) return r_pwritev64v2(fd, iov, cnt, off, flags);
}

/* posix_fallocate returns the error number instead of setting errno */
int posix_fallocate(int fd, off_t off, off_t n) {
    int k = write_fault(fd);
    if (k >= 0) { count("posix_fallocate", k, __builtin_return_address(0)); return k == K_EROFS ? EROFS : ENOSPC; }
    return r_posix_fallocate(fd, off, n);
}
int posix_fallocate64(int fd, off64_t off, off64_t n) {
    int k = write_fault(fd);
    if (k >= 0) { count("posix_fallocate64", k, __builtin_return_address(0)); return k == K_EROFS ? EROFS : ENOSPC; }
    return r_posix_fallocate64(fd, off, n);
}

/* ---------------------------------------------------------------- control (ctypes) */
/* Arm (1) or disarm (0); returns the previous state. */
int fc_fault_arm(int on) {
    int was = g_armed;
    g_armed = on != 0;
    return was;
}

/* Random faults: probability per call and the comma list of kinds (NULL: unchanged). */
void fc_fault_set_rate(double rate, const char *kinds) {
    g_rate = rate;
    if (kinds) set_kinds(kinds);
}

/* Writes and fallocates of targeted files fail with ENOSPC for the next ms milliseconds. */
void fc_fault_enospc_for_ms(int64_t ms) { g_enospc_until_ns = now_ns() + ms * 1000000; }

/* Writes to the file at path (as /proc/self/fd shows it) fail with EROFS; NULL or "": none. */
void fc_fault_refuse(const char *path) {
    pthread_mutex_lock(&g_mu);
    snprintf(g_refuse, sizeof g_refuse, "%s", path ? path : "");
    g_refusing = g_refuse[0] != 0;
    pthread_mutex_unlock(&g_mu);
}

/* Injected faults so far, one "symbol kind caller count" line each, into buf (NUL-terminated,
   cut at n bytes); returns the bytes the whole report needs (without the NUL). */
int64_t fc_fault_report(char *buf, int64_t n) {
    int64_t need = 0;
    pthread_mutex_lock(&g_mu);
    for (int i = 0; i < g_nrows; i++) {
        char line[256];
        int len = snprintf(line, sizeof line, "%s %s %s %lld\n", g_rows[i].symbol, KIND_NAMES[g_rows[i].kind],
                           g_rows[i].caller, (long long)g_rows[i].count);
        if (buf && need + len < n) memcpy(buf + need, line, (size_t)len);
        need += len;
    }
    pthread_mutex_unlock(&g_mu);
    if (buf && n > 0) buf[need < n ? need : n - 1] = 0;
    return need;
}
