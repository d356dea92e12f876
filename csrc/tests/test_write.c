/* fc_write_pieces (csrc/write.c): every byte lands where asked, in pieces, pausing only when a
 * restore waits; empty, one byte, odd sizes, a misaligned buffer, a far offset, a bad fd. */
#include "fc_test.h"
#include "fc_api.h"


static void expect_file(int fd, const uint8_t *want, int64_t n, int64_t off) {
    uint8_t *got = malloc((size_t)n + 1);
    CHECK_EQ(pread(fd, got, (size_t)n, (off_t)off), n);
    CHECK(memcmp(got, want, (size_t)n) == 0);
    free(got);
}

int main(void) {
    int64_t readers = 0, none = 0;
    uint8_t *buf = malloc(20000);
    fill(buf, 20000, 1);
    int fd = temp_file();

    CHECK_EQ(fc_write_pieces(fd, (int64_t)(intptr_t)buf, 0, 0, NULL, 0, &readers), 0);  /* empty */
    CHECK_EQ(fc_write_pieces(fd, (int64_t)(intptr_t)buf, 7, 1, NULL, 0, &readers), 1);  /* one byte */
    expect_file(fd, buf, 1, 7);

    /* odd size from a misaligned address, pieces ending at odd offsets; no reader: one call */
    int64_t ends[] = {1000 + 4097, 1000 + 8191, 1000 + 12289};
    CHECK_EQ(fc_write_pieces(fd, (int64_t)(intptr_t)(buf + 1), 1000, 16385, ends, 3, &readers), 16385);
    expect_file(fd, buf + 1, 16385, 1000);

    /* a restore waits: the call stops after the first piece, the rest follows in the next call */
    fill(buf, 20000, 2);
    readers = 1;
    CHECK_EQ(fc_write_pieces(fd, (int64_t)(intptr_t)(buf + 3), 1000, 16385, ends, 3, &readers), 4097);
    CHECK_EQ(fc_write_pieces(fd, (int64_t)(intptr_t)(buf + 3 + 4097), 1000 + 4097, 16385 - 4097, ends, 3, &readers),
             8191 - 4097);
    readers = 0;
    CHECK_EQ(fc_write_pieces(fd, (int64_t)(intptr_t)(buf + 3 + 8191), 1000 + 8191, 16385 - 8191, ends, 3, &readers),
             16385 - 8191);
    expect_file(fd, buf + 3, 16385, 1000);

    /* ends outside the write, or before it: one piece */
    int64_t far_ends[] = {10, 1 << 30};
    CHECK_EQ(fc_write_pieces(fd, (int64_t)(intptr_t)buf, 500, 333, far_ends, 2, &none), 333);
    expect_file(fd, buf, 333, 500);

    /* a far file offset (a pool file holds up to ssd.file_bytes; sparse here) */
    int64_t far = (1LL << 34) + 4093;
    if (fc_write_pieces(fd, (int64_t)(intptr_t)buf, far, 4099, NULL, 0, &none) == 4099) expect_file(fd, buf, 4099, far);
    else fprintf(stderr, "note: this file system refused a write at 16 GiB (skipped)\n");

    /* a bad descriptor: -EBADF, nothing written */
    CHECK_EQ(fc_write_pieces(-1, (int64_t)(intptr_t)buf, 0, 10, NULL, 0, &none), -EBADF);
    close(fd);
    free(buf);
    return fc_done("test_write");
}
