/* fc_zc_run (csrc/zero_copy.c): chunks read straight into the page slots of a host layout whose
 * planes are contiguous, holes bridged into scratch, each chunk hashed in place with the
 * streaming API over its planes (and the one-shot hash with one plane); unsorted input, two
 * files, one thread and many, SCHED_IDLE threads, a far offset; a wrong checksum (status 2), a
 * chunk past the end of its file and a file not open (status 1); the refusals (-2, -4). */
#include "fc_test.h"
#include "fc_api.h"


enum { N = 30, L = 2, P = 8, PAGES = 20, ALIGN = 512 };

typedef struct {
    int64_t J, rb[2], plane_off[2], cb, tb[L * 2], ts0[L * 2];
    uint8_t *pool[L * 2];
} dest_t;

static void make_dest(dest_t *d, int64_t J) {
    d->J = J; d->rb[0] = 64; d->rb[1] = 128;
    d->cb = 0;
    for (int64_t q = 0; q < J; q++) { d->plane_off[q] = d->cb; d->cb += d->rb[q] * P; }
    for (int64_t t = 0; t < L * J; t++) {
        int64_t q = t % J, nbytes = (PAGES + 1) * P * d->rb[q];
        d->pool[t] = aligned_alloc(ALIGN, (size_t)nbytes);
        memset(d->pool[t], 0xEE, (size_t)nbytes);
        d->tb[t] = (int64_t)(intptr_t)d->pool[t];
        d->ts0[t] = P * d->rb[q];
    }
}

static int64_t hfn[6];

static int64_t zc(dest_t *d, int64_t nthreads, int64_t idle, int64_t n, const int64_t *file, const int64_t *off,
                  const int64_t *page, const int64_t *layer, const uint64_t *want, const uint8_t *has,
                  const int64_t *fdmap, int64_t nfd, int64_t cb, int64_t align, int64_t *w, uint8_t *cstatus) {
    int64_t tag[64];
    for (int64_t i = 0; i < n; i++) tag[i] = 1000 - i;
    return fc_zc_run(hfn, 0, nthreads, 2, idle, n, file, off, tag, page, layer, want, has, 1, fdmap, nfd, cb,
                     4096, 1 << 20, align, 4, 4096, d->J, P, d->plane_off, d->rb, d->tb, d->ts0, w, w + n, w + 2 * n,
                     w + 3 * n, w + 4 * n, w + 7 * n, w + 5 * n, w + 6 * n, cstatus, w + 8 * n + 1);
}

static void run_case(int64_t J, int64_t nthreads, int64_t idle) {
    dest_t d;
    make_dest(&d, J);
    int fds[2] = {temp_file(), temp_file()};
    int64_t fdmap[3] = {fds[0], fds[1], -1};
    int64_t file[N], off[N], page[N], layer[N];
    uint64_t want[N];
    uint8_t has[N], *bytes = malloc((size_t)d.cb);
    for (int64_t i = 0; i < N; i++) {
        int64_t j = (i * 11) % N;  /* unsorted */
        file[i] = j % 2;
        off[i] = (j / 2) * d.cb + (j / 2 > 6 ? 3 * ALIGN : 0) + (file[i] ? (1LL << 36) : 0);  /* bridged holes, far */
        layer[i] = i % L; page[i] = i / L + 1;
        fill(bytes, d.cb, 7 * i + J);
        put(fds[file[i]], bytes, d.cb, off[i]);
        want[i] = fnv(bytes, (size_t)d.cb); has[i] = (uint8_t)(i != 3);  /* chunk 3: no checksum to check */
    }
    int64_t bad_sum = 4, past_eof = 9, not_open = N - 1;
    want[bad_sum] ^= 1;
    off[past_eof] = (1LL << 37) + ALIGN;
    file[not_open] = 2;
    int64_t w[8 * N + 8];
    uint8_t cstatus[N];
    CHECK_EQ(zc(&d, nthreads, idle, N, file, off, page, layer, want, has, fdmap, 3, d.cb, ALIGN, w, cstatus), 0);
    int64_t np = w[8 * N + 1];
    for (int64_t i = 0; i < N; i++) {
        int64_t st = i == bad_sum ? 2 : (i == past_eof || i == not_open ? 1 : 0);
        CHECK_EQ(cstatus[i], st);
        if (st) continue;  /* a failed chunk's slots hold undefined bytes in this mode */
        fill(bytes, d.cb, 7 * i + J);
        for (int64_t q = 0; q < J; q++) {
            const uint8_t *s = (const uint8_t *)(intptr_t)(d.tb[layer[i] * J + q] + page[i] * d.ts0[layer[i] * J + q]);
            CHECK(memcmp(s, bytes + d.plane_off[q], (size_t)(d.rb[q] * P)) == 0);
        }
    }
    int eof = 0, badf = 0;
    for (int64_t k = 0; k < np; k++) { eof |= w[6 * N + k] == -1; badf |= w[6 * N + k] == EBADF; }
    CHECK(eof && badf);
    CHECK(np >= 3 && w[8 * N + 4] >= 0 && w[8 * N + 4] <= (idle ? nthreads : 0));
    for (int64_t t = 0; t < L * J; t++) CHECK(d.pool[t][0] == 0xEE);  /* page 0 not requested: untouched */

    /* refusals, before any byte is read */
    int64_t off2[2] = {0, ALIGN + 1}, file2[2] = {0, 0}, page2[2] = {1, 2}, layer2[2] = {0, 0};
    CHECK_EQ(zc(&d, 2, 0, 2, file2, off2, page2, layer2, want, has, fdmap, 3, d.cb, ALIGN, w, cstatus), -4);  /* unaligned */
    off2[1] = d.cb - ALIGN;
    CHECK_EQ(zc(&d, 2, 0, 2, file2, off2, page2, layer2, want, has, fdmap, 3, d.cb, ALIGN, w, cstatus), -4);  /* overlap */
    off2[1] = -ALIGN;
    CHECK_EQ(zc(&d, 2, 0, 2, file2, off2, page2, layer2, want, has, fdmap, 3, d.cb, ALIGN, w, cstatus), -2);  /* negative */
    off2[1] = d.cb;
    CHECK_EQ(zc(&d, 2, 0, 2, file2, off2, page2, layer2, want, has, fdmap, 3, 0, ALIGN, w, cstatus), -2);     /* size 0 */
    CHECK_EQ(zc(&d, 2, 0, 0, file2, off2, page2, layer2, want, has, fdmap, 3, d.cb, ALIGN, w, cstatus), 0);   /* none */
    CHECK_EQ(w[8 * 0 + 1], 0);
    for (int64_t t = 0; t < L * J; t++) free(d.pool[t]);
    free(bytes);
    close(fds[0]); close(fds[1]);
}

int main(void) {
    hfn[0] = (int64_t)(intptr_t)fnv_create; hfn[1] = (int64_t)(intptr_t)fnv_free;
    hfn[2] = (int64_t)(intptr_t)fnv_reset; hfn[3] = (int64_t)(intptr_t)fnv_stream;
    hfn[4] = (int64_t)(intptr_t)fnv_digest; hfn[5] = (int64_t)(intptr_t)fnv;
    run_case(2, 4, 0);   /* two planes: the streaming hash */
    run_case(1, 1, 0);   /* one plane: the one-shot hash; the caller's thread alone */
    run_case(2, 64, 1);  /* more threads than pieces, SCHED_IDLE */
    return fc_done("test_zero_copy");
}
