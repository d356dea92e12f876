/* fc_xxh3_at / fc_xxh3_copy (csrc/xxh3.c): the hash of each chunk, with any hash function by
 * address; empty, zero-length and one-byte chunks, misaligned starts, mismatches left alone. */
#include "fc_test.h"
#include "fc_api.h"


int main(void) {
    void *h = (void *)(intptr_t)fnv;
    int64_t nb = 70001;
    uint8_t *base = malloc((size_t)nb);
    fill(base, nb, 3);
    uint64_t out[8];
    fc_xxh3_at(h, base, NULL, 0, 16, out);  /* no chunks: nothing read */
    int64_t one[] = {nb - 1};
    fc_xxh3_at(h, base, one, 1, 1, out);  /* one byte, the buffer's last */
    CHECK(out[0] == fnv(base + nb - 1, 1));
    int64_t starts[] = {0, 1, 3, 4097, nb - 32771};  /* misaligned, the last ending at the buffer's end */
    for (int64_t len = 0; len <= 32771; len = len ? len * 2 + 1 : 1) {
        fc_xxh3_at(h, base, starts, 5, len, out);
        for (int i = 0; i < 5; i++) CHECK(out[i] == fnv(base + starts[i], (size_t)len));
    }
    /* copy: chunks 0 and 2 match, 1 does not (its destination stays as it was) */
    int64_t len = 4099, cs[] = {5, 9000, 60000}, at[] = {1, 4100, 8201};
    uint64_t want[3] = {fnv(base + 5, 4099), 12345, fnv(base + 60000, 4099)};
    uint8_t *dst = calloc(1, 12300);
    int8_t state[3] = {0, 0, 0};
    fc_xxh3_copy(h, base, cs, 3, len, want, dst, at, state);
    CHECK_EQ(state[0], 1); CHECK_EQ(state[1], -1); CHECK_EQ(state[2], 1);
    CHECK(memcmp(dst + 1, base + 5, 4099) == 0 && memcmp(dst + 8201, base + 60000, 4099) == 0);
    int zero = 1;
    for (int64_t i = 4100; i < 4100 + 4099; i++) zero &= dst[i] == 0;
    CHECK(zero && dst[0] == 0);
    fc_xxh3_copy(h, base, cs, 0, len, want, dst, at, state);  /* none */
    free(dst);
    free(base);
    return fc_done("test_xxh3");
}
