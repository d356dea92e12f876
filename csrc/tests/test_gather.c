/* fc_gather_hash (csrc/gather.c): a round gathered from a host layout, layer-major, with each
 * chunk's hash and device checksum; token-strided planes (page_first) and contiguous ones,
 * odd row sizes, one-token pages, no pages. Checked against a gather done here byte by byte. */
#include "fc_test.h"
#include "fc_api.h"


/* one case: L layers, 2 planes of rb0 / rb1 bytes per token, P tokens per page, npages pages in
   the pool; strided: token rows of all pages interleaved (row stride npages * rb), else each
   page's plane contiguous */
static void one(int64_t L, int64_t rb0, int64_t rb1, int64_t P, int64_t npages, int strided,
                const int64_t *pages, int64_t n) {
    int64_t J = 2, rb[2] = {rb0, rb1}, plane_off[2] = {0, rb0 * P}, cb = (rb0 + rb1) * P;
    int64_t base[64] = {0}, s0[64] = {0}, s1[64] = {0};
    uint8_t *pool[64];
    for (int64_t l = 0; l < L; l++)
        for (int64_t q = 0; q < J; q++) {
            int64_t t = l * J + q, bytes = npages * P * rb[q];
            pool[t] = malloc((size_t)bytes + 1);
            fill(pool[t] + 1, bytes, t + 1);  /* +1: a misaligned base */
            base[t] = (int64_t)(intptr_t)(pool[t] + 1);
            s0[t] = strided ? rb[q] : P * rb[q];
            s1[t] = strided ? npages * rb[q] : rb[q];
        }
    uint8_t *out = malloc((size_t)(L * n * cb) + 1), *want = malloc((size_t)(L * n * cb) + 1);
    uint64_t sums[256], dev[256];
    fc_gather_hash((void *)(intptr_t)fnv, (void *)(intptr_t)fc_fcds_at, out, n, L, J, P, pages, base, s0, s1,
                   plane_off, rb, cb, sums, dev);
    for (int64_t l = 0; l < L; l++)
        for (int64_t i = 0; i < n; i++) {
            uint8_t *c = want + (l * n + i) * cb;
            for (int64_t q = 0; q < J; q++)
                for (int64_t r = 0; r < P; r++)
                    for (int64_t b = 0; b < rb[q]; b++)
                        c[plane_off[q] + r * rb[q] + b] =
                            ((uint8_t *)(intptr_t)base[l * J + q])[pages[i] * s0[l * J + q] + r * s1[l * J + q] + b];
            CHECK(sums[l * n + i] == fnv(c, (size_t)cb));
            uint64_t d;
            int64_t zero = 0;
            fc_fcds_at(c, &zero, 1, cb, &d);
            CHECK(dev[l * n + i] == d);
        }
    CHECK(n == 0 || memcmp(out, want, (size_t)(L * n * cb)) == 0);
    for (int64_t t = 0; t < L * J; t++) free(pool[t]);
    free(out); free(want);
}

int main(void) {
    int64_t pages[] = {3, 0, 7, 7, 1};
    one(2, 64, 64, 16, 8, 1, pages, 5);  /* page_first: token-strided rows */
    one(2, 64, 64, 16, 8, 0, pages, 5);  /* layer_first: contiguous planes */
    one(3, 3, 5, 1, 8, 1, pages, 5);     /* odd row bytes, one-token pages */
    one(1, 7, 1, 3, 8, 0, pages + 4, 1); /* one page */
    one(2, 8, 8, 4, 8, 1, pages, 0);     /* no pages: nothing written */
    return fc_done("test_gather");
}
