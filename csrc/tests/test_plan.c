/* fc_restore_plan (csrc/plan.c): the plan's invariants on unsorted chunks in several files with
 * holes, repeats and far offsets: every chunk planned once, each owned chunk wholly inside its
 * piece at the right file bytes, straddling chunks over consecutive pieces, pieces aligned,
 * batches within the staging capacity; and its refusals (-2, -3). */
#include "fc_test.h"
#include "fc_api.h"


typedef struct {
    int64_t *pfile, *poff, *plen, *paddr, *pbatch, *own_lo, *rest_lo, *rest_hi, *cb0, *bbase, *ck0, *ck1, *cidx,
        *left, out[8];
    uint8_t *cstatus;
} plan_t;

static void alloc_plan(plan_t *p, int64_t n, int64_t workers) {
    int64_t mp = (n ? n : 1) * workers, nn = n ? n : 1;
    int64_t **piece[] = {&p->pfile, &p->poff, &p->plen, &p->paddr, &p->pbatch};
    for (int i = 0; i < 5; i++) *piece[i] = malloc(sizeof(int64_t) * (size_t)mp);
    p->own_lo = malloc(sizeof(int64_t) * (size_t)(mp + 1));
    int64_t **chunk[] = {&p->rest_lo, &p->rest_hi, &p->cb0, &p->bbase, &p->ck0, &p->ck1, &p->cidx, &p->left};
    for (int i = 0; i < 8; i++) *chunk[i] = malloc(sizeof(int64_t) * (size_t)nn);
    p->cstatus = malloc((size_t)nn);
}

static void free_plan(plan_t *p) {
    int64_t *all[] = {p->pfile, p->poff, p->plen, p->paddr, p->pbatch, p->own_lo, p->rest_lo, p->rest_hi, p->cb0,
                      p->bbase, p->ck0, p->ck1, p->cidx, p->left};
    for (int i = 0; i < 14; i++) free(all[i]);
    free(p->cstatus);
}

static int64_t plan(plan_t *p, int64_t n, const int64_t *file, const int64_t *off, const int64_t *tag,
                    const int64_t *layer, int64_t cb, int64_t gap, int64_t max_io, int64_t align, int64_t capacity,
                    int64_t workers, int64_t min_piece) {
    return fc_restore_plan(n, file, off, tag, layer, cb, gap, max_io, align, capacity, workers, min_piece,
                           1 << 20, 1 << 30, p->pfile, p->poff, p->plen, p->paddr, p->pbatch, p->own_lo, p->rest_lo,
                           p->rest_hi, p->cb0, p->bbase, p->ck0, p->ck1, p->cidx, p->left, p->cstatus, p->out);
}

/* chunk c (plan position) lies at bytes [a, a + cb) of the staging buffers: check they are the
   chunk's file bytes, read by pieces ck0[c] .. ck1[c] */
static void check_chunk(plan_t *p, int64_t c, const int64_t *file, const int64_t *off, int64_t cb) {
    int64_t i = p->cidx[c], k0 = p->ck0[c], k1 = p->ck1[c], b = p->pbatch[k0];
    int64_t a = p->bbase[b] + p->cb0[c];
    CHECK(p->pbatch[k1] == b);
    CHECK(a >= p->paddr[k0] && a < p->paddr[k0] + p->plen[k0]);
    CHECK(a + cb <= p->paddr[k1] + p->plen[k1] && a + cb > p->paddr[k1]);
    for (int64_t k = k0; k < k1; k++) CHECK(p->paddr[k] + p->plen[k] == p->paddr[k + 1] && p->poff[k] + p->plen[k] == p->poff[k + 1]);
    CHECK_EQ(p->pfile[k0], file[i]);
    CHECK_EQ(p->poff[k0] + (a - p->paddr[k0]), off[i]);
}

static void check_plan(plan_t *p, int64_t n, const int64_t *file, const int64_t *off, int64_t cb, int64_t align,
                       int64_t capacity) {
    int64_t np = p->out[0], nb = p->out[1], nown = p->out[4], bytes = 0;
    int *seen = calloc((size_t)n + 1, sizeof(int));
    for (int64_t c = 0; c < n; c++) {
        CHECK(p->cidx[c] >= 0 && p->cidx[c] < n);
        if (p->cidx[c] >= 0 && p->cidx[c] < n) seen[p->cidx[c]]++;
        CHECK_EQ(p->cstatus[c], 1);
        if (c < nown) CHECK_EQ(p->ck0[c], p->ck1[c]);
        else CHECK(p->ck0[c] < p->ck1[c]);
        check_chunk(p, c, file, off, cb);
    }
    for (int64_t i = 0; i < n; i++) CHECK_EQ(seen[i], 1);
    free(seen);
    CHECK_EQ(p->own_lo[0], 0);
    CHECK_EQ(p->own_lo[np], nown);
    for (int64_t k = 0; k < np; k++) {
        CHECK(p->own_lo[k] <= p->own_lo[k + 1]);
        for (int64_t c = p->own_lo[k]; c < p->own_lo[k + 1]; c++) CHECK_EQ(p->ck0[c], k);
        CHECK(p->poff[k] % align == 0 && p->plen[k] > 0);
        bytes += p->plen[k];
    }
    CHECK_EQ(bytes, p->out[3]);
    int64_t lo = nown, k = 0;
    for (int64_t b = 0; b < nb; b++) {
        int64_t used = 0, pieces = 0;
        for (; k < np && p->pbatch[k] == b; k++) { used += p->plen[k]; pieces++; }
        CHECK(used <= capacity);
        CHECK_EQ(p->left[b], pieces);
        CHECK_EQ(p->bbase[b], b % 2 ? 1 << 30 : 1 << 20);
        CHECK_EQ(p->rest_lo[b], lo);
        CHECK(p->rest_hi[b] >= lo);
        lo = p->rest_hi[b];
    }
    CHECK_EQ(k, np);
    CHECK_EQ(lo, n);
}

int main(void) {
    plan_t p;
    /* no chunks */
    alloc_plan(&p, 0, 4);
    CHECK_EQ(plan(&p, 0, NULL, NULL, NULL, NULL, 4096, 0, 1 << 20, 4096, 1 << 20, 4, 4096), 0);
    CHECK_EQ(p.out[0], 0); CHECK_EQ(p.out[1], 0); CHECK_EQ(p.own_lo[0], 0);
    free_plan(&p);

    /* one odd-sized chunk at an odd offset */
    {
        int64_t file[] = {0}, off[] = {4097}, tag[] = {9}, layer[] = {0};
        alloc_plan(&p, 1, 4);
        CHECK_EQ(plan(&p, 1, file, off, tag, layer, 1001, 0, 1 << 20, 4096, 1 << 20, 4, 4096), 0);
        CHECK_EQ(p.out[0], 1); CHECK_EQ(p.out[2], 1); CHECK_EQ(p.poff[0], 4096); CHECK_EQ(p.plen[0], 4096);
        check_plan(&p, 1, file, off, 1001, 4096, 1 << 20);
        free_plan(&p);
    }

    /* 64 chunks, unsorted, 3 files, holes (some bridged, some not), a repeat, far offsets */
    {
        enum { N = 64 };
        int64_t file[N], off[N], tag[N], layer[N], cb = 12288;
        for (int64_t i = 0; i < N; i++) {
            int64_t j = (i * 37) % N;  /* a permutation: unsorted input */
            file[i] = j % 3;
            off[i] = (1LL << 40) * (j % 3 == 2) + (j / 3) * cb + ((j / 3) % 5 == 0 ? 3 * 4096 : 0) * (j / 15);
            tag[i] = j; layer[i] = j % 4;
        }
        off[N - 1] = off[N - 2]; file[N - 1] = file[N - 2];  /* a repeated chunk */
        for (int64_t workers = 1; workers <= 8; workers *= 2) {
            alloc_plan(&p, N, workers);
            CHECK_EQ(plan(&p, N, file, off, tag, layer, cb, 8192, 256 * 1024, 4096, 192 * 1024, workers, 16384), 0);
            check_plan(&p, N, file, off, cb, 4096, 192 * 1024);
            CHECK(p.out[1] > 1);  /* several batches: both buffers used */
            free_plan(&p);
        }
    }

    /* refusals */
    {
        int64_t file[] = {0, 0}, off[] = {0, -4096}, tag[] = {0, 1}, layer[] = {0, 0};
        alloc_plan(&p, 2, 2);
        CHECK_EQ(plan(&p, 2, file, off, tag, layer, 4096, 0, 1 << 20, 4096, 1 << 20, 2, 4096), -2);  /* negative offset */
        off[1] = 4096;
        CHECK_EQ(plan(&p, 2, file, off, tag, layer, 0, 0, 1 << 20, 4096, 1 << 20, 2, 4096), -2);     /* chunk size 0 */
        CHECK_EQ(plan(&p, 2, file, off, tag, layer, 4096, 0, 1 << 20, 0, 1 << 20, 2, 4096), -2);     /* align 0 */
        CHECK_EQ(plan(&p, 2, file, off, tag, layer, 4096, 0, 1 << 20, 4096, 1 << 20, 2, 0), -2);     /* min piece 0 */
        CHECK_EQ(plan(&p, 2, file, off, tag, layer, 4096, 0, 1 << 20, 4096, 4096, 2, 4096), -3);     /* a read > capacity */
        free_plan(&p);
    }
    return fc_done("test_plan");
}
