/* fc_restore_run (csrc/restore.c) end to end with the plan (csrc/plan.c): chunks read from two
 * files through the staging buffers into a host layout's page slots, hashes checked; token-
 * strided and contiguous destinations, streaming stores on and off, a misaligned destination,
 * one thread and many, SCHED_IDLE threads; a wrong checksum (status 2, slots untouched), a
 * chunk past the end of its file and a bad descriptor (status 1, the piece's error). */
#include <sched.h>

#include "fc_test.h"
#include "fc_api.h"


enum { N = 40, L = 2, J = 2, P = 16, PAGES = 24, RB0 = 64, RB1 = 128, CB = (RB0 + RB1) * P };

/* chunk i's bytes (plane 0 rows, then plane 1 rows) */
static void chunk_bytes(int64_t i, uint8_t *c) { fill(c, CB, 100 + i); }

static void run_case(int strided, int64_t nt, int64_t nthreads, int64_t idle, int64_t misalign, int64_t capacity) {
    int fds[2] = {temp_file(), temp_file()};
    int64_t file[N], off[N], tag[N], layer[N], page[N];
    uint64_t want[N];
    uint8_t has[N], bytes[CB];
    for (int64_t i = 0; i < N; i++) {
        int64_t j = (i * 7) % N;  /* unsorted */
        file[i] = j % 2; off[i] = (j / 2) * CB + (j / 2 > 10 ? 8192 : 0) + (j % 2) * 512; tag[i] = i;
        layer[i] = i % L; page[i] = (i / L) + 1;  /* distinct (layer, page) per chunk; page 0 unused */
        chunk_bytes(i, bytes);
        put(fds[file[i]], bytes, CB, off[i]);
        want[i] = fnv(bytes, CB); has[i] = 1;
    }
    int64_t bad_sum = 5, past_eof = 11;
    want[bad_sum] ^= 1;  /* its checksum does not match */
    off[past_eof] = 1LL << 32;  /* nothing written there: past the end of its file */
    /* destination: per (layer, plane) a pool of PAGES+1 pages */
    int64_t rb[J] = {RB0, RB1}, plane_off[J] = {0, RB0 * P}, tb[L * J], ts0[L * J], ts1[L * J];
    uint8_t *pool[L * J];
    for (int64_t t = 0; t < L * J; t++) {
        int64_t q = t % J, nbytes = (PAGES + 1) * P * rb[q];
        pool[t] = aligned_alloc(64, (size_t)(nbytes + 64));
        memset(pool[t], 0xEE, (size_t)(nbytes + 64));
        tb[t] = (int64_t)(intptr_t)(pool[t] + misalign);
        ts0[t] = strided ? rb[q] : P * rb[q];
        ts1[t] = strided ? (PAGES + 1) * rb[q] : rb[q];
    }
    /* plan */
    int64_t workers = 4, mp = N * workers;
    int64_t *w = calloc((size_t)(mp * 8 + 1 + N * 8 + 8), sizeof(int64_t));
    int64_t *pfile = w, *poff = pfile + mp, *plen = poff + mp, *paddr = plen + mp, *pbatch = paddr + mp,
            *pgot = pbatch + mp, *perr = pgot + mp, *own_lo = perr + mp, *rest_lo = own_lo + mp + 1,
            *rest_hi = rest_lo + N, *cb0 = rest_hi + N, *bbase = cb0 + N, *ck0 = bbase + N, *ck1 = ck0 + N,
            *cidx = ck1 + N, *left = cidx + N, *out = left + N;
    uint8_t cstatus[N], done[N];
    uint8_t *bufs = aligned_alloc(4096, (size_t)capacity * 2);
    CHECK_EQ(fc_restore_plan(N, file, off, tag, layer, CB, 4096, 64 * 1024, 4096, capacity, workers, 8192,
                             (int64_t)(intptr_t)bufs, (int64_t)(intptr_t)(bufs + capacity), pfile, poff, plen, paddr,
                             pbatch, own_lo, rest_lo, rest_hi, cb0, bbase, ck0, ck1, cidx, left, cstatus, out), 0);
    int64_t np = out[0], nb = out[1];
    int64_t *pfd = malloc(sizeof(int64_t) * (size_t)np);
    for (int64_t k = 0; k < np; k++) pfd[k] = fds[pfile[k]];
    memset(done, 0, sizeof done);
    int64_t idled = fc_restore_run((void *)(intptr_t)fnv, 0, nthreads, 2, np, pfd, poff, plen, paddr, pbatch, pgot,
                                   perr, nb, own_lo, rest_lo, rest_hi, cb0, bbase, ck0, ck1, cidx, page, layer, want,
                                   has, 1, CB, J, P, plane_off, rb, tb, ts0, ts1, cstatus, left, done, idle, nt);
    CHECK(idled >= 0 && idled <= (idle ? nthreads : 0));
    for (int64_t c = 0; c < N; c++) {
        int64_t i = cidx[c];
        int64_t st = i == bad_sum ? 2 : (i == past_eof ? 1 : 0);
        CHECK_EQ(cstatus[c], st);
        chunk_bytes(i, bytes);
        for (int64_t q = 0; q < J; q++) {
            int64_t t = layer[i] * J + q;
            for (int64_t r = 0; r < P; r++) {
                const uint8_t *d = (const uint8_t *)(intptr_t)(tb[t] + page[i] * ts0[t] + r * ts1[t]);
                if (st == 0) CHECK(memcmp(d, bytes + plane_off[q] + r * rb[q], (size_t)rb[q]) == 0);
                else for (int64_t b = 0; b < rb[q]; b++) CHECK(d[b] == 0xEE);  /* untouched */
            }
        }
    }
    int eof_seen = 0;
    for (int64_t k = 0; k < np; k++) eof_seen |= perr[k] == -1;
    CHECK(eof_seen);
    for (int64_t t = 0; t < L * J; t++) {  /* page 0 was not requested: untouched */
        const uint8_t *d = (const uint8_t *)(intptr_t)tb[t];
        CHECK(d[0] == 0xEE && d[rb[t % J] - 1] == 0xEE);
    }
    /* a descriptor that is not open: every piece fails with EBADF, every chunk status 1 */
    for (int64_t k = 0; k < np; k++) { pfd[k] = -1; pgot[k] = perr[k] = 0; }
    CHECK_EQ(fc_restore_plan(N, file, off, tag, layer, CB, 4096, 64 * 1024, 4096, capacity, workers, 8192,
                             (int64_t)(intptr_t)bufs, (int64_t)(intptr_t)(bufs + capacity), pfile, poff, plen, paddr,
                             pbatch, own_lo, rest_lo, rest_hi, cb0, bbase, ck0, ck1, cidx, left, cstatus, out), 0);
    memset(done, 0, sizeof done);
    fc_restore_run((void *)(intptr_t)fnv, 0, nthreads, 1, np, pfd, poff, plen, paddr, pbatch, pgot, perr, nb, own_lo,
                   rest_lo, rest_hi, cb0, bbase, ck0, ck1, cidx, page, layer, want, has, 1, CB, J, P, plane_off, rb,
                   tb, ts0, ts1, cstatus, left, done, 0, nt);
    for (int64_t k = 0; k < np; k++) CHECK_EQ(perr[k], EBADF);
    for (int64_t c = 0; c < N; c++) CHECK_EQ(cstatus[c], 1);
    for (int64_t t = 0; t < L * J; t++) free(pool[t]);
    free(w); free(pfd); free(bufs);
    close(fds[0]); close(fds[1]);
}

int main(void) {
    run_case(1, 1, 4, 0, 0, 64 * 1024);   /* page_first rows, streaming stores, 4 threads, several batches */
    run_case(1, 0, 1, 0, 0, 64 * 1024);   /* memcpy, the caller's thread alone */
    run_case(0, 1, 8, 1, 0, 1 << 20);     /* contiguous planes, SCHED_IDLE threads, one batch */
    run_case(1, 1, 3, 0, 1, 64 * 1024);   /* a misaligned destination: memcpy despite nt */
    run_case(0, 1, 64, 0, 0, 16 * 4096);  /* more threads than pieces; the smallest capacity that fits */
    return fc_done("test_restore");
}
