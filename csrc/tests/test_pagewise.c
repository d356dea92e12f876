/* fc_pagewise_read / fc_pagewise_read_copy (csrc/pagewise_read.c, the bench's page-wise
 * reader): jobs read into their destinations, or into a thread's bounce slot and copied out by
 * segments (the restore's fc_copy_rows, streaming stores on and off, misaligned rows); no jobs,
 * one-byte jobs, a job past the end of its file (short, no copy), a descriptor not open. */
#include "fc_test.h"
#include "fc_api.h"


enum { N = 24, JOB = 4160 };

int main(void) {
    int fd = temp_file();
    int64_t fsize = N * JOB;
    uint8_t *file = malloc((size_t)fsize);
    fill(file, fsize, 9);
    put(fd, file, fsize, 0);
    int64_t fds[N], off[N], len[N], dst[N], got[N], err[N];
    uint8_t *out = calloc(1, (size_t)(N * JOB + 1));
    CHECK_EQ(fc_pagewise_read(0, fds, off, len, dst, got, err, 4), 0);  /* no jobs */
    for (int64_t i = 0; i < N; i++) {
        fds[i] = fd; off[i] = ((i * 5) % N) * JOB; len[i] = i == 0 ? 1 : JOB;  /* job 0: one byte */
        dst[i] = (int64_t)(intptr_t)(out + 1 + i * JOB);  /* misaligned destinations */
    }
    off[7] = fsize - 100;  /* short: the file ends */
    fds[9] = -1;           /* not open */
    CHECK_EQ(fc_pagewise_read(N, fds, off, len, dst, got, err, 5), 2);
    for (int64_t i = 0; i < N; i++) {
        if (i == 7) { CHECK_EQ(got[i], 100); CHECK_EQ(err[i], 0); continue; }
        if (i == 9) { CHECK_EQ(got[i], 0); CHECK_EQ(err[i], EBADF); continue; }
        CHECK_EQ(got[i], len[i]); CHECK_EQ(err[i], 0);
        CHECK(memcmp(out + 1 + i * JOB, file + off[i], (size_t)len[i]) == 0);
    }
    /* copy mode: each job's bytes are two segments of rows (64-byte rows to a 16-byte aligned
       destination: the streaming path; 3-byte rows: memcpy), into strided destinations */
    for (int64_t nt = 0; nt <= 1; nt++) {
        int64_t nthreads = 3, stride = 8192;
        uint8_t *bounce = aligned_alloc(4096, (size_t)(nthreads * stride));
        int64_t rows0 = 64, rb0 = 64, rows1 = 3, rb1 = 3, ds0 = 128, ds1 = 5;
        uint8_t *d0 = aligned_alloc(64, (size_t)(N * rows0 * ds0)), *d1 = calloc(1, (size_t)(N * rows1 * ds1 + 1));
        memset(d0, 0, (size_t)(N * rows0 * ds0));
        int64_t start[N + 1], src[2 * N], sdst[2 * N], rows[2 * N], rb[2 * N], dstr[2 * N];
        for (int64_t i = 0; i < N; i++) {
            fds[i] = fd; off[i] = ((i * 7) % N) * JOB; len[i] = JOB;
            start[i] = 2 * i;
            src[2 * i] = 0; sdst[2 * i] = (int64_t)(intptr_t)(d0 + i * rows0 * ds0); rows[2 * i] = rows0;
            rb[2 * i] = rb0; dstr[2 * i] = ds0;
            src[2 * i + 1] = rows0 * rb0 + 1; sdst[2 * i + 1] = (int64_t)(intptr_t)(d1 + 1 + i * rows1 * ds1);
            rows[2 * i + 1] = rows1; rb[2 * i + 1] = rb1; dstr[2 * i + 1] = ds1;
        }
        start[N] = 2 * N;
        off[3] = fsize - 10;  /* short: its segments are not copied */
        CHECK_EQ(fc_pagewise_read_copy(N, fds, off, len, got, err, nthreads, (int64_t)(intptr_t)bounce, stride, start,
                                       src, sdst, rows, rb, dstr, nt), 1);
        for (int64_t i = 0; i < N; i++) {
            for (int64_t r = 0; r < rows0; r++) {
                const uint8_t *d = d0 + i * rows0 * ds0 + r * ds0;
                if (i == 3) CHECK(d[0] == 0 && d[rb0 - 1] == 0);
                else CHECK(memcmp(d, file + off[i] + r * rb0, (size_t)rb0) == 0);
            }
            for (int64_t r = 0; r < rows1; r++) {
                const uint8_t *d = d1 + 1 + i * rows1 * ds1 + r * ds1;
                if (i == 3) CHECK(d[0] == 0);
                else CHECK(memcmp(d, file + off[i] + rows0 * rb0 + 1 + r * rb1, (size_t)rb1) == 0);
            }
        }
        free(bounce); free(d0); free(d1);
    }
    free(file); free(out);
    close(fd);
    return fc_done("test_pagewise");
}
