/* The page-wise baselines' reader for scripts/bench_restore.py (issue 23, item 7), built into
 * FlatCake's extension with the loops (scripts/native/pagewise.py binds it).
 *
 * A page-wise store (one page, or one (page, layer) chunk, per file slot) restores a prefix with
 * one read per slot. Its best implementation keeps many reads in flight and never returns to
 * the interpreter between them; this is that reader:
 *
 *   fc_pagewise_read       job i: read len[i] bytes at off[i] of fd[i] straight into dst[i]
 *   fc_pagewise_read_copy  job i: read them into the calling thread's bounce slot, then copy the
 *                          job's segments out of it (a page's K and V regions, a chunk's token
 *                          rows) into their destinations
 *
 * Both run the jobs on `nthreads` POSIX threads (the caller's thread is one of them), each taking
 * the next job from a shared counter and issuing a blocking pread for it: `nthreads` reads in
 * flight, the queue depth. Called through ctypes, which releases the GIL for the whole call.
 *
 * Lifecycle of one call: spawn nthreads - 1 threads -> every thread: take job -> pread until
 * len bytes, EOF or an error -> (copy mode) copy its segments -> next job -> join -> return.
 *
 * A segment is a 2-D copy: `rows` rows of `row_bytes`, back to back in the job's bytes from
 * `src` (an offset), `dst_stride` bytes apart from the address `dst`. A job's segments are
 * seg_start[i] .. seg_start[i + 1] - 1 and are copied only when the job read all its bytes.
 * With `nt` set, rows that are 16-byte aligned and a multiple of 64 bytes go through SSE2
 * streaming stores on x86-64: fc_copy_rows, the copy FlatCake's restore uses (fc_copy.h).
 *
 * got[i]: bytes read; err[i]: 0, or the errno that stopped the job. The return value is the
 * number of jobs that did not read len[i] bytes (short at end of file, or an error).
 */
#define _GNU_SOURCE
#include <errno.h>
#include <pthread.h>
#include <string.h>
#include <unistd.h>

#include "fc_common.h"
#include "fc_api.h"
#include "fc_copy.h"

#define MAX_THREADS 1024

typedef struct {
    int64_t n;
    const int64_t *fd, *off, *len, *dst;
    int64_t *got, *err;
    uint8_t *bounce;  /* copy mode: nthreads slots of bounce_stride bytes; NULL: read into dst */
    int64_t bounce_stride;
    const int64_t *seg_start, *seg_src, *seg_dst, *seg_rows, *seg_row_bytes, *seg_dst_stride;
    int64_t nt;
    int64_t next;  /* the next job to take (atomic) */
} pw_t;

typedef struct {
    pw_t *p;
    int64_t slot;
} pw_arg;

/* pread until `want` bytes, end of file or an error; returns the bytes read, *err the errno. */
static int64_t read_full(int fd, uint8_t *buf, int64_t want, int64_t off, int64_t *err) {
    int64_t got = 0;
    *err = 0;
    while (got < want) {
        ssize_t r = pread(fd, buf + got, (size_t)(want - got), (off_t)(off + got));
        if (r < 0) {
            if (errno == EINTR) continue;
            /* O_DIRECT: a short count at end of file leaves an unaligned offset, refused with EINVAL */
            if (errno == EINVAL && got > 0 && (got & 511)) break;
            *err = errno;
            break;
        }
        if (r == 0) break;  /* end of file */
        got += r;
    }
    return got;
}

static void *worker(void *arg) {
    pw_arg *w = (pw_arg *)arg;
    pw_t *p = w->p;
    uint8_t *slot = p->bounce ? p->bounce + w->slot * p->bounce_stride : NULL;
    int64_t copied = 0;
    for (;;) {
        int64_t i = __atomic_fetch_add(&p->next, 1, __ATOMIC_RELAXED);
        if (i >= p->n) break;
        uint8_t *buf = slot ? slot : (uint8_t *)(intptr_t)p->dst[i];
        int64_t e;
        int64_t got = read_full((int)p->fd[i], buf, p->len[i], p->off[i], &e);
        p->got[i] = got;
        p->err[i] = e;
        if (!slot || e || got != p->len[i]) continue;
        for (int64_t s = p->seg_start[i]; s < p->seg_start[i + 1]; s++) {
            const uint8_t *src = slot + p->seg_src[s];
            uint8_t *dst = (uint8_t *)(intptr_t)p->seg_dst[s];
            int64_t rb = p->seg_row_bytes[s], ds = p->seg_dst_stride[s];
            for (int64_t r = 0; r < p->seg_rows[s]; r++) fc_copy_rows(p->nt, dst + r * ds, src + r * rb, (size_t)rb);
        }
        copied = 1;
    }
    if (copied) fc_copy_fence(p->nt);  /* streaming stores visible before the call returns */
    return NULL;
}

static int64_t run(pw_t *p, int64_t nthreads) {
    if (p->n <= 0) return 0;
    if (nthreads > p->n) nthreads = p->n;
    if (nthreads > MAX_THREADS) nthreads = MAX_THREADS;
    if (nthreads < 1) nthreads = 1;
    pthread_t th[MAX_THREADS];
    pw_arg args[MAX_THREADS];
    int64_t started = 0;
    for (int64_t t = 1; t < nthreads; t++) {  /* thread 0 is the caller */
        args[t].p = p;
        args[t].slot = t;
        if (pthread_create(&th[t], NULL, worker, &args[t]) != 0) break;  /* fewer threads, same jobs */
        started = t;
    }
    args[0].p = p;
    args[0].slot = 0;
    worker(&args[0]);
    for (int64_t t = 1; t <= started; t++) pthread_join(th[t], NULL);
    int64_t bad = 0;
    for (int64_t i = 0; i < p->n; i++) bad += (p->err[i] != 0 || p->got[i] != p->len[i]);
    return bad;
}

FC_API int64_t fc_pagewise_read(int64_t n, const int64_t *fd, const int64_t *off, const int64_t *len, const int64_t *dst,
                         int64_t *got, int64_t *err, int64_t nthreads) {
    pw_t p;
    memset(&p, 0, sizeof p);
    p.n = n; p.fd = fd; p.off = off; p.len = len; p.dst = dst; p.got = got; p.err = err;
    return run(&p, nthreads);
}

FC_API int64_t fc_pagewise_read_copy(int64_t n, const int64_t *fd, const int64_t *off, const int64_t *len,
                              int64_t *got, int64_t *err, int64_t nthreads, int64_t bounce, int64_t bounce_stride,
                              const int64_t *seg_start, const int64_t *seg_src, const int64_t *seg_dst,
                              const int64_t *seg_rows, const int64_t *seg_row_bytes, const int64_t *seg_dst_stride,
                              int64_t nt) {
    pw_t p;
    memset(&p, 0, sizeof p);
    p.n = n; p.fd = fd; p.off = off; p.len = len; p.got = got; p.err = err;
    p.bounce = (uint8_t *)(intptr_t)bounce; p.bounce_stride = bounce_stride;
    p.seg_start = seg_start; p.seg_src = seg_src; p.seg_dst = seg_dst;
    p.seg_rows = seg_rows; p.seg_row_bytes = seg_row_bytes; p.seg_dst_stride = seg_dst_stride;
    p.nt = nt;
    return run(&p, nthreads);
}
