/* The one-call restore's plan: fc_restore_plan (flatcake/cio/native_plan_c.py documents it,
 * paper §3.3). The same plan as the Python pipeline's plan_reads (uniform chunk size),
 * batch_reads, StagingBatch.build and split_pieces, in one C call that keeps the GIL.
 *
 * 1. Sort the chunks by (file, offset, tag, position) (np.lexsort is stable: the same order).
 * 2. A chunk joins the read before it when it is in the same file and the hole before it is
 *    <= 0 or < gap bytes or its aligned start falls before the previous chunk's aligned end,
 *    and the aligned read stays <= max_io bytes (ends are monotonic: uniform size).
 * 3. Order the reads by (smallest layer, file, offset, plan position) and pack them greedily
 *    into batches of <= capacity bytes (buffer b % 2 for batch b).
 * 4. Cut each read into max(1, min(workers, nbytes / min_piece)) pieces of
 *    align_up(ceil(nbytes / n), 4096) bytes; a chunk wholly in one piece is owned by it.
 *
 * Return: 0, -1 out of memory, -2 a chunk with a negative offset or a non-positive size (or a
 * non-positive align, workers or min_piece), -3 a read longer than capacity. out[0..4]: pieces,
 * batches, merged reads, bytes read, chunks owned by a piece. Array sizes (the caller's): n
 * chunks; pieces at most n * max(1, workers) (pfile, poff, plen, paddr, pbatch; own_lo one
 * more); batches at most n (rest_lo, rest_hi, bbase, left); chunks n (cb0, ck0, ck1, cidx,
 * cstatus). */
#include <pthread.h>
#include <stdlib.h>

#include "fc_common.h"
#include "fc_api.h"
#include "fc_plan.h"

typedef struct { const int64_t *f, *o, *t; } keys_t;
static keys_t g_k;  /* qsort has no context argument in C99; guarded by g_plan_mu */
static pthread_mutex_t g_plan_mu = PTHREAD_MUTEX_INITIALIZER;

static int cmp3(int64_t a1, int64_t b1, int64_t a2, int64_t b2, int64_t a3, int64_t b3) {
    if (a1 != b1) return a1 < b1 ? -1 : 1;
    if (a2 != b2) return a2 < b2 ? -1 : 1;
    if (a3 != b3) return a3 < b3 ? -1 : 1;
    return 0;
}

static int by_chunk(const void *pa, const void *pb) {
    int64_t a = *(const int64_t *)pa, b = *(const int64_t *)pb;
    int c = cmp3(g_k.f[a], g_k.f[b], g_k.o[a], g_k.o[b], g_k.t[a], g_k.t[b]);
    return c ? c : (a < b ? -1 : a > b);
}

void fc_sort_chunks(int64_t *ord, int64_t n, const int64_t *file, const int64_t *off, const int64_t *tag) {
    if (n < 2) return;
    pthread_mutex_lock(&g_plan_mu);
    g_k.f = file; g_k.o = off; g_k.t = tag;
    qsort(ord, (size_t)n, sizeof(int64_t), by_chunk);
    pthread_mutex_unlock(&g_plan_mu);
}

typedef struct { int64_t minl, file, a0, nb, lo, hi, pos; } read_t;

static int by_read(const void *pa, const void *pb) {
    const read_t *a = (const read_t *)pa, *b = (const read_t *)pb;
    int c = cmp3(a->minl, b->minl, a->file, b->file, a->a0, b->a0);
    return c ? c : (a->pos < b->pos ? -1 : a->pos > b->pos);
}

FC_API int64_t fc_restore_plan(int64_t n, const int64_t *file, const int64_t *off, const int64_t *tag,
                               const int64_t *layer, int64_t cb, int64_t gap, int64_t max_io, int64_t align,
                               int64_t capacity, int64_t workers, int64_t min_piece, int64_t buf0, int64_t buf1,
                               int64_t *pfile, int64_t *poff, int64_t *plen, int64_t *paddr, int64_t *pbatch,
                               int64_t *own_lo, int64_t *rest_lo, int64_t *rest_hi, int64_t *cb0, int64_t *bbase,
                               int64_t *ck0, int64_t *ck1, int64_t *cidx, int64_t *left, uint8_t *cstatus,
                               int64_t *out) {
    if (cb <= 0 || align <= 0 || min_piece <= 0 || workers < 1) return -2;
    for (int64_t i = 0; i < n; i++)
        if (off[i] < 0) return -2;
    if (n == 0) {
        own_lo[0] = 0;
        out[0] = out[1] = out[2] = out[3] = out[4] = 0;
        return 0;
    }
    int64_t *ord = malloc(sizeof(int64_t) * (size_t)n * 5);
    read_t *rd = malloc(sizeof(read_t) * (size_t)n);
    if (!ord || !rd) { free(ord); free(rd); return -1; }
    int64_t *rb = ord + n, *rk0 = ord + 2 * n, *rk1 = ord + 3 * n, *ri = ord + 4 * n;  /* straddling chunks */
    for (int64_t i = 0; i < n; i++) ord[i] = i;
    fc_sort_chunks(ord, n, file, off, tag);
    int64_t nr = 0, bytes = 0;
    for (int64_t s = 0; s < n; s++) {
        int64_t i = ord[s], as = off[i] - off[i] % align, ae = fc_align_up(off[i] + cb, align);
        if (nr) {
            read_t *r = &rd[nr - 1];
            int64_t p = ord[s - 1], g = off[i] - (off[p] + cb);
            if (file[i] == r->file && (g <= 0 || g < gap || as < fc_align_up(off[p] + cb, align)) &&
                ae - r->a0 <= max_io) {
                r->hi = s + 1; r->nb = ae - r->a0;
                if (layer[i] < r->minl) r->minl = layer[i];
                continue;
            }
        }
        rd[nr] = (read_t){layer[i], file[i], as, ae - as, s, s + 1, nr};
        nr++;
    }
    for (int64_t r = 0; r < nr; r++) bytes += rd[r].nb;
    qsort(rd, (size_t)nr, sizeof(read_t), by_read);
    int64_t np = 0, nbt = 0, nown = 0, nrest = 0, used = 0, pos = 0, first_b = 0;
    for (int64_t r = 0; r < nr; r++) {
        read_t *R = &rd[r];
        if (R->nb > capacity) { free(ord); free(rd); return -3; }
        if (r == 0 || used + R->nb > capacity) {  /* a new batch */
            if (r) { rest_hi[nbt - 1] = nrest; left[nbt - 1] = np - first_b; }
            bbase[nbt] = nbt % 2 ? buf1 : buf0; rest_lo[nbt] = nrest; first_b = np; nbt++; used = 0; pos = 0;
        }
        used += R->nb;
        int64_t k = R->nb / min_piece, m = k < workers ? k : workers;
        if (m < 1) m = 1;
        int64_t step = fc_align_up((R->nb + m - 1) / m, 4096), first = np;
        for (int64_t d = 0; d < R->nb; d += step, np++) {
            pfile[np] = R->file; poff[np] = R->a0 + d; plen[np] = R->nb - d < step ? R->nb - d : step;
            paddr[np] = bbase[nbt - 1] + pos + d; pbatch[np] = nbt - 1;
        }
        for (int64_t s = R->lo; s < R->hi; s++) {
            int64_t i = ord[s], o = off[i] - R->a0, a = o / step + first, b = (o + cb - 1) / step + first;
            if (a == b) { cb0[nown] = o + pos; cidx[nown] = i; ck0[nown] = ck1[nown] = a; nown++; }
            else { rb[nrest] = o + pos; rk0[nrest] = a; rk1[nrest] = b; ri[nrest] = i; nrest++; }
        }
        pos += R->nb;
    }
    if (nbt) { rest_hi[nbt - 1] = nrest; left[nbt - 1] = np - first_b; }
    for (int64_t c = 0; c < nrest; c++) {
        cb0[nown + c] = rb[c]; ck0[nown + c] = rk0[c]; ck1[nown + c] = rk1[c]; cidx[nown + c] = ri[c];
    }
    for (int64_t b = 0; b < nbt; b++) { rest_lo[b] += nown; rest_hi[b] += nown; }
    for (int64_t k = 0, c = 0; k <= np; k++) {  /* owned chunks are grouped by piece, in order */
        while (c < nown && ck0[c] < k) c++;
        own_lo[k] = c;
    }
    for (int64_t c = 0; c < n; c++) cstatus[c] = 1;
    out[0] = np; out[1] = nbt; out[2] = nr; out[3] = bytes; out[4] = nown;
    free(ord); free(rd);
    return 0;
}
