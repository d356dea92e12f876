/* The zero-copy FC-CIO restore: fc_zc_run (flatcake/cio/native_zero_copy_c.py documents it,
 * paper §3.3). Plans and runs a whole restore in one GIL-free call:
 *
 * 1. Sort the chunks by (file, offset, tag, position) (fc_sort_chunks). Every chunk offset must
 *    be a multiple of align and no two chunks may overlap, else it returns -4 before any byte
 *    is read (the caller takes the staging path).
 * 2. A chunk joins the read before it when it is in the same file, the hole before it is 0 or
 *    < gap bytes, and the read stays <= max_io bytes.
 * 3. Each read is cut into max(1, min(workers, nbytes / min_piece)) pieces of whole chunks.
 * 4. nthreads threads take pieces in order; a piece is one or more preadv calls (at most 1,024
 *    iovecs each) whose iovecs are the chunks' planes in the page slots, in file order, every
 *    bridged hole going to the thread's scratch buffer. Then, holding one of cpu_threads CPU
 *    slots, each chunk wholly read is hashed in place with XXH3's streaming API over its planes
 *    (python-xxhash's functions, by address; one plane: XXH3_64bits).
 *
 * Chunk status out (cstatus[i] for chunk i): 0 delivered, 1 not fully read, 2 checksum
 * mismatch. Piece errors out: 0, an errno, or -1 for end of file. Return: 0, -1 out of memory,
 * -2 a negative offset or non-positive size (or a non-positive align or min_piece), -4 not
 * eligible. out: pieces, merged reads, bytes read, threads switched to SCHED_IDLE. */
#define _GNU_SOURCE
#include <errno.h>
#include <pthread.h>
#include <sched.h>
#include <stdlib.h>
#include <sys/uio.h>
#include <unistd.h>

#include "fc_common.h"
#include "fc_api.h"
#include "fc_plan.h"

typedef struct { void *(*create)(void); int (*release)(void *); int (*reset)(void *);
                 int (*update)(void *, const void *, size_t); uint64_t (*digest)(const void *);
                 uint64_t (*one)(const void *, size_t); } zh_t;

typedef struct {
    zh_t h; int64_t direct, align, scratch_bytes;
    int64_t np; const int64_t *pfd, *poff, *plen, *plo; int64_t *pgot, *perr;  /* plo: [np+1] into ord */
    const int64_t *ord, *off, *page, *layer; const uint64_t *want; const uint8_t *has; int64_t verify;
    int64_t cb, J, P, maxc; const int64_t *plane_off, *plane_rb, *tb, *ts0;
    uint8_t *cstatus;
    int64_t next; pthread_mutex_t mu;
    int64_t cpu_free; pthread_mutex_t cmu; pthread_cond_t ccv;
    int64_t idle, idled;
} zjob_t;

static uint8_t *zdst(zjob_t *j, int64_t i, int64_t q) {
    int64_t t = j->layer[i] * j->J + q;
    return (uint8_t *)(intptr_t)(j->tb[t] + j->page[i] * j->ts0[t]);
}

static int64_t zread(zjob_t *j, int64_t k, struct iovec *iov, uint8_t *scratch) {
    int64_t n = 0, at = j->poff[k];
    for (int64_t s = j->plo[k]; s < j->plo[k + 1]; s++) {
        int64_t i = j->ord[s];
        if (j->off[i] > at) { iov[n].iov_base = scratch; iov[n++].iov_len = (size_t)(j->off[i] - at); }
        for (int64_t q = 0; q < j->J; q++) {
            iov[n].iov_base = zdst(j, i, q);
            iov[n++].iov_len = (size_t)(j->plane_rb[q] * j->P);
        }
        at = j->off[i] + j->cb;
    }
    int64_t got = 0, err = 0, v = 0;
    while (v < n) {
        ssize_t r = preadv((int)j->pfd[k], iov + v, (int)(n - v < 1024 ? n - v : 1024), (off_t)(j->poff[k] + got));
        if (r < 0) { if (errno == EINTR) continue; err = errno; break; }
        if (r == 0) break;
        got += r;
        if (got < j->plen[k] && (r % j->align) && j->direct) break;  /* unaligned short count: EOF */
        for (size_t left = (size_t)r; left && v < n;) {  /* skip what was filled */
            if (left >= iov[v].iov_len) { left -= iov[v].iov_len; v++; continue; }
            iov[v].iov_base = (uint8_t *)iov[v].iov_base + left; iov[v].iov_len -= left; left = 0;
        }
    }
    if (!err && got < j->plen[k]) err = -1;
    j->pgot[k] = got; j->perr[k] = err;
    return got;
}

static void zcheck(zjob_t *j, int64_t k, int64_t got, void *st) {
    for (int64_t s = j->plo[k]; s < j->plo[k + 1]; s++) {
        int64_t i = j->ord[s];
        if (j->off[i] + j->cb - j->poff[k] > got) { j->cstatus[i] = 1; continue; }
        if (j->verify && j->has[i]) {
            uint64_t h;
            if (j->J == 1) h = j->h.one(zdst(j, i, 0), (size_t)j->cb);
            else {
                j->h.reset(st);
                for (int64_t q = 0; q < j->J; q++) j->h.update(st, zdst(j, i, q), (size_t)(j->plane_rb[q] * j->P));
                h = j->h.digest(st);
            }
            if (h != j->want[i]) { j->cstatus[i] = 2; continue; }
        }
        j->cstatus[i] = 0;
    }
}

static void *zworker(void *arg) {
    zjob_t *j = (zjob_t *)arg;
    if (j->idle) {  /* a new thread of this call only (the caller only waits) */
        struct sched_param sp = {0};
        if (sched_setscheduler(0, SCHED_IDLE, &sp) == 0) {
            pthread_mutex_lock(&j->mu); j->idled++; pthread_mutex_unlock(&j->mu);
        }
    }
    struct iovec *iov = malloc(sizeof(struct iovec) * (size_t)(j->maxc * (j->J + 1)));
    void *scratch = 0, *st = j->h.create();
    if (j->scratch_bytes && posix_memalign(&scratch, (size_t)j->align, (size_t)j->scratch_bytes)) scratch = 0;
    int ok = iov && st && (scratch || !j->scratch_bytes);
    for (;;) {
        pthread_mutex_lock(&j->mu);
        int64_t k = j->next < j->np ? j->next++ : -1;
        pthread_mutex_unlock(&j->mu);
        if (k < 0) break;
        if (!ok || j->pfd[k] < 0) { j->pgot[k] = 0; j->perr[k] = ok ? EBADF : ENOMEM; zcheck(j, k, 0, st); continue; }
        int64_t got = zread(j, k, iov, scratch);
        pthread_mutex_lock(&j->cmu);
        while (j->cpu_free <= 0) pthread_cond_wait(&j->ccv, &j->cmu);
        j->cpu_free--;
        pthread_mutex_unlock(&j->cmu);
        zcheck(j, k, got, st);
        pthread_mutex_lock(&j->cmu);
        j->cpu_free++;
        pthread_cond_signal(&j->ccv);
        pthread_mutex_unlock(&j->cmu);
    }
    free(iov); free(scratch);
    if (st) j->h.release(st);
    return 0;
}

/* steps 2-3 of the header; returns the number of pieces, or -4 */
static int64_t zplan(int64_t n, const int64_t *file, const int64_t *off, const int64_t *fdmap, int64_t nfd,
                     int64_t cb, int64_t gap, int64_t max_io, int64_t align, int64_t workers, int64_t min_piece,
                     int64_t *ord, int64_t *pfd, int64_t *pfile, int64_t *poff, int64_t *plen, int64_t *plo,
                     int64_t *maxc, int64_t *maxgap, int64_t *out) {
    int64_t np = 0, nr = 0, bytes = 0;
    for (int64_t s = 0; s < n;) {
        int64_t e = s + 1, i0 = ord[s];
        if (off[i0] % align) return -4;
        for (; e < n; e++) {
            int64_t i = ord[e], p = ord[e - 1], g = off[i] - (off[p] + cb);
            if (off[i] % align) return -4;
            if (file[i] != file[i0]) break;
            if (g < 0) return -4;  /* overlapping or repeated chunk: one slot per file byte */
            if ((g != 0 && g >= gap) || off[i] + cb - off[i0] > max_io) break;
            if (g > *maxgap) *maxgap = g;
        }
        int64_t nb = off[ord[e - 1]] + cb - off[i0], m = nb / min_piece, c = e - s;
        if (m > workers) m = workers;
        if (m < 1) m = 1;
        int64_t per = (c + m - 1) / m;
        if (per > *maxc) *maxc = per;
        for (int64_t a = s; a < e; a += per, np++) {
            int64_t b = a + per < e ? a + per : e, f = file[ord[a]];
            pfile[np] = f; pfd[np] = f >= 0 && f < nfd ? fdmap[f] : -1;
            poff[np] = off[ord[a]]; plen[np] = off[ord[b - 1]] + cb - poff[np]; plo[np] = a;
        }
        nr++; bytes += nb; s = e;
    }
    plo[np] = n; out[0] = np; out[1] = nr; out[2] = bytes;
    return np;
}

FC_API int64_t fc_zc_run(const int64_t *hfn, int64_t direct, int64_t nthreads, int64_t cpu_threads, int64_t idle,
                         int64_t n, const int64_t *file, const int64_t *off, const int64_t *tag, const int64_t *page,
                         const int64_t *layer, const uint64_t *want, const uint8_t *has, int64_t verify,
                         const int64_t *fdmap, int64_t nfd, int64_t cb, int64_t gap, int64_t max_io, int64_t align,
                         int64_t workers, int64_t min_piece, int64_t J, int64_t P, const int64_t *plane_off,
                         const int64_t *plane_rb, const int64_t *tb, const int64_t *ts0,
                         int64_t *ord, int64_t *pfd, int64_t *pfile, int64_t *poff, int64_t *plen, int64_t *plo,
                         int64_t *pgot, int64_t *perr, uint8_t *cstatus, int64_t *out) {
    if (cb <= 0 || align <= 0 || min_piece <= 0) return -2;
    for (int64_t i = 0; i < n; i++) {
        ord[i] = i; cstatus[i] = 1;
        if (off[i] < 0) return -2;
    }
    fc_sort_chunks(ord, n, file, off, tag);
    int64_t maxc = 1, maxgap = 0;
    int64_t np = zplan(n, file, off, fdmap, nfd, cb, gap, max_io, align, workers < 1 ? 1 : workers, min_piece,
                       ord, pfd, pfile, poff, plen, plo, &maxc, &maxgap, out);
    if (np < 0) return np;
    zjob_t j = {{(void *(*)(void))(intptr_t)hfn[0], (int (*)(void *))(intptr_t)hfn[1],
                 (int (*)(void *))(intptr_t)hfn[2], (int (*)(void *, const void *, size_t))(intptr_t)hfn[3],
                 (uint64_t (*)(const void *))(intptr_t)hfn[4], (uint64_t (*)(const void *, size_t))(intptr_t)hfn[5]},
                direct, align, maxgap,
                np, pfd, poff, plen, plo, pgot, perr, ord, off, page, layer, want, has, verify,
                cb, J, P, maxc, plane_off, plane_rb, tb, ts0, cstatus};
    pthread_mutex_init(&j.mu, 0);
    pthread_mutex_init(&j.cmu, 0);
    pthread_cond_init(&j.ccv, 0);
    j.cpu_free = cpu_threads < 1 ? 1 : cpu_threads;
    j.idle = idle;
    pthread_t th[64];
    int64_t m = nthreads < 1 ? 1 : (nthreads > 64 ? 64 : nthreads), started = 0;
    if (m > np) m = np < 1 ? 1 : np;
    for (int64_t t = idle ? 0 : 1; t < m; t++) if (pthread_create(&th[started], 0, zworker, &j) == 0) started++;
    if (!idle || started == 0) { j.idle = 0; zworker(&j); }  /* the caller works in its own class */
    for (int64_t t = 0; t < started; t++) pthread_join(th[t], 0);
    pthread_mutex_destroy(&j.mu);
    pthread_mutex_destroy(&j.cmu);
    pthread_cond_destroy(&j.ccv);
    out[3] = j.idled;
    return 0;
}
