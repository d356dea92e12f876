/* The one-call FC-CIO restore: fc_restore_run (flatcake/cio/native_restore_c.py documents it,
 * paper §3.3).
 *
 * One call reads every I/O piece of a restore (pread from nthreads POSIX threads into the two
 * staging buffers of a window), verifies each chunk's xxh3-64 (python-xxhash's XXH3_64bits,
 * passed in by address) and copies its planes into the page slots, all without the GIL. A
 * thread that read a piece verifies and scatters the chunks lying wholly in it; the thread that
 * finishes a batch's last piece handles the chunks straddling two of its pieces. The pieces of
 * batch b start only after batch b - 2 (same buffer) is wholly scattered. At most cpu_threads
 * threads verify and copy at once. With idle set the call's threads are all new ones, each
 * switched to SCHED_IDLE before it works; the call returns how many did switch. With nt set
 * (x86-64) the copies into the page slots are streaming stores where they can be (fc_copy.h).
 *
 * Chunk status out: 0 delivered, 1 not fully read (short read, EOF, I/O error), 2 checksum
 * mismatch. Piece errors out: 0, an errno, or -1 for end of file. */
#define _GNU_SOURCE
#include <errno.h>
#include <pthread.h>
#include <sched.h>
#include <unistd.h>

#include "fc_common.h"
#include "fc_api.h"
#include "fc_copy.h"

typedef struct {
    fc_xxh3_fn h; int64_t direct;
    int64_t np; const int64_t *pfd, *poff, *plen, *paddr, *pbatch; int64_t *pgot, *perr;
    int64_t nb; const int64_t *own_lo;  /* [np+1]: owned chunks of piece k */
    const int64_t *rest_lo, *rest_hi;   /* [nb]: straddling chunks of batch b (after its owned) */
    const int64_t *cb0, *bbase, *ck0, *ck1, *cidx;  /* chunk c: bytes at bbase[batch] + cb0[c]; */
    const int64_t *page, *layer; const uint64_t *want; const uint8_t *has; int64_t verify;  /* [cidx[c]] */
    int64_t cb, J, P; const int64_t *plane_off, *plane_rb, *tb, *ts0, *ts1;  /* [layer * J + plane] */
    uint8_t *cstatus;
    int64_t next; int64_t *left; uint8_t *done;
    pthread_mutex_t mu; pthread_cond_t cv;
    int64_t cpu_free; pthread_mutex_t cmu; pthread_cond_t ccv;  /* threads copying/hashing at once */
    int64_t idle, idled;  /* SCHED_IDLE wanted; threads that switched (under mu) */
    int64_t nt;  /* streaming stores into the host pool (fc_copy_rows) */
} job_t;

static void cpu_take(job_t *j) {
    pthread_mutex_lock(&j->cmu);
    while (j->cpu_free <= 0) pthread_cond_wait(&j->ccv, &j->cmu);
    j->cpu_free--;
    pthread_mutex_unlock(&j->cmu);
}

static void cpu_give(job_t *j) {
    pthread_mutex_lock(&j->cmu);
    j->cpu_free++;
    pthread_cond_signal(&j->ccv);
    pthread_mutex_unlock(&j->cmu);
}

static void read_piece(job_t *j, int64_t k) {
    uint8_t *buf = (uint8_t *)(intptr_t)j->paddr[k];
    int64_t want = j->plen[k], got = 0, err = 0;
    while (got < want) {
        ssize_t r = pread((int)j->pfd[k], buf + got, (size_t)(want - got), (off_t)(j->poff[k] + got));
        if (r < 0) { if (errno == EINTR) continue; err = errno; break; }
        if (r == 0) break;
        got += r;
        if (got < want && (r % 4096) && j->direct) break;  /* unaligned short count: EOF */
    }
    if (!err && got < want) err = -1;
    j->pgot[k] = got; j->perr[k] = err;
}

static void deliver(job_t *j, int64_t c, int64_t src_addr) {
    const uint8_t *src = (const uint8_t *)(intptr_t)src_addr;
    int64_t i = j->cidx[c];
    if (j->verify && j->has[i] && j->h(src, (size_t)j->cb) != j->want[i]) { j->cstatus[c] = 2; return; }
    for (int64_t q = 0; q < j->J; q++) {
        const uint8_t *s = src + j->plane_off[q];
        int64_t t = j->layer[i] * j->J + q;
        uint8_t *d = (uint8_t *)(intptr_t)(j->tb[t] + j->page[i] * j->ts0[t]);
        int64_t rb = j->plane_rb[q], rs = j->ts1[t];
        if (rs == rb) { fc_copy_rows(j->nt, d, s, (size_t)(rb * j->P)); continue; }
        for (int64_t r = 0; r < j->P; r++) fc_copy_rows(j->nt, d + r * rs, s + r * rb, (size_t)rb);
    }
    fc_copy_fence(j->nt);  /* streaming stores visible before the chunk counts as delivered */
    j->cstatus[c] = 0;
}

static int64_t valid_end(job_t *j, int64_t k) { return j->paddr[k] + j->pgot[k]; }

static void owned(job_t *j, int64_t k) {
    int64_t base = j->bbase[j->pbatch[k]];
    for (int64_t c = j->own_lo[k]; c < j->own_lo[k + 1]; c++) {
        if (base + j->cb0[c] + j->cb > valid_end(j, k)) { j->cstatus[c] = 1; continue; }
        deliver(j, c, base + j->cb0[c]);
    }
}

static void rest(job_t *j, int64_t b) {
    for (int64_t c = j->rest_lo[b]; c < j->rest_hi[b]; c++) {
        int ok = 1;
        for (int64_t k = j->ck0[c]; k < j->ck1[c]; k++) if (j->pgot[k] < j->plen[k]) ok = 0;
        int64_t src = j->bbase[b] + j->cb0[c];
        if (!ok || src + j->cb > valid_end(j, j->ck1[c])) { j->cstatus[c] = 1; continue; }
        deliver(j, c, src);
    }
}

static void *worker(void *arg) {
    job_t *j = (job_t *)arg;
    pthread_mutex_lock(&j->mu);
    while (j->next < j->np) {
        int64_t k = j->next, b = j->pbatch[k];
        if (b >= 2 && !j->done[b - 2]) { pthread_cond_wait(&j->cv, &j->mu); continue; }
        j->next++;
        pthread_mutex_unlock(&j->mu);
        read_piece(j, k);
        cpu_take(j);
        owned(j, k);
        cpu_give(j);
        pthread_mutex_lock(&j->mu);
        if (--j->left[b] == 0) {
            pthread_mutex_unlock(&j->mu);
            cpu_take(j);
            rest(j, b);
            cpu_give(j);
            pthread_mutex_lock(&j->mu);
            j->done[b] = 1;
            pthread_cond_broadcast(&j->cv);
        }
    }
    pthread_mutex_unlock(&j->mu);
    return 0;
}

static void *spawned(void *arg) {
    job_t *j = (job_t *)arg;
    if (j->idle) {  /* pid 0 = this thread only; it ends with the call */
        struct sched_param sp = {0};
        if (sched_setscheduler(0, SCHED_IDLE, &sp) == 0) {
            pthread_mutex_lock(&j->mu);
            j->idled++;
            pthread_mutex_unlock(&j->mu);
        }
    }
    return worker(arg);
}

FC_API int64_t fc_restore_run(void *h, int64_t direct, int64_t nthreads, int64_t cpu_threads,
                              int64_t np, const int64_t *pfd, const int64_t *poff, const int64_t *plen,
                              const int64_t *paddr, const int64_t *pbatch, int64_t *pgot, int64_t *perr,
                              int64_t nb, const int64_t *own_lo, const int64_t *rest_lo, const int64_t *rest_hi,
                              const int64_t *cb0, const int64_t *bbase, const int64_t *ck0, const int64_t *ck1,
                              const int64_t *cidx, const int64_t *page, const int64_t *layer,
                              const uint64_t *want, const uint8_t *has, int64_t verify,
                              int64_t cb, int64_t J, int64_t P, const int64_t *plane_off, const int64_t *plane_rb,
                              const int64_t *tb, const int64_t *ts0, const int64_t *ts1, uint8_t *cstatus,
                              int64_t *left, uint8_t *done, int64_t idle, int64_t nt) {
    job_t j = {(fc_xxh3_fn)h, direct, np, pfd, poff, plen, paddr, pbatch, pgot, perr, nb, own_lo, rest_lo, rest_hi,
               cb0, bbase, ck0, ck1, cidx, page, layer, want, has, verify, cb, J, P, plane_off, plane_rb,
               tb, ts0, ts1, cstatus, 0, left, done};
    pthread_mutex_init(&j.mu, 0);
    pthread_cond_init(&j.cv, 0);
    j.cpu_free = cpu_threads < 1 ? 1 : cpu_threads;
    pthread_mutex_init(&j.cmu, 0);
    pthread_cond_init(&j.ccv, 0);
    j.idle = idle; j.idled = 0; j.nt = nt;
    pthread_t th[64];
    int64_t n = nthreads < 1 ? 1 : (nthreads > 64 ? 64 : nthreads), started = 0;
    for (int64_t t = idle ? 0 : 1; t < n; t++) if (pthread_create(&th[started], 0, spawned, &j) == 0) started++;
    if (!idle || started == 0) worker(&j);  /* the calling thread works too (in its own class) */
    for (int64_t t = 0; t < started; t++) pthread_join(th[t], 0);
    pthread_mutex_destroy(&j.mu);
    pthread_cond_destroy(&j.cv);
    pthread_mutex_destroy(&j.cmu);
    pthread_cond_destroy(&j.ccv);
    return j.idled;
}
