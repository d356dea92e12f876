/* fc_fcds_at (csrc/fcds.c): the device checksum against its definition, computed byte by byte
 * here; every length 0..70 (the zero-padded last word), misaligned starts, a 32 KiB + 3 chunk.
 * Built twice by tests/native/: under the sanitizers (the plain loop) and at -O3 without them
 * (the variant chosen at load: AVX2 / AVX-512 where the machine has them). */
#include "fc_test.h"
#include "fc_api.h"


static uint64_t ref(const uint8_t *p, int64_t len) {
    uint32_t a = 0, b = 0;
    for (int64_t i = 0; i * 4 < len; i++) {
        uint32_t w = 0;
        for (int k = 0; k < 4; k++) if (4 * i + k < len) w |= (uint32_t)p[4 * i + k] << (8 * k);
        uint32_t ui = (uint32_t)i;
        a += w * (2u * ui + 1u);
        uint32_t x = w ^ (ui * 0x9E3779B9u);
        x *= 0x85EBCA6Bu; x ^= x >> 15; x *= 0xC2B2AE35u;
        b += x;
    }
    return ((uint64_t)b << 32) | a;
}

int main(void) {
    int64_t nb = 3 * 32771 + 64;
    uint8_t *base = malloc((size_t)nb);
    fill(base, nb, 5);
    uint64_t out[4];
    fc_fcds_at(base, NULL, 0, 8, out);  /* no chunks */
    for (int64_t len = 0; len <= 70; len++) {
        int64_t starts[4] = {0, 1, 2, 3};
        fc_fcds_at(base, starts, 4, len, out);
        for (int i = 0; i < 4; i++) CHECK(out[i] == ref(base + starts[i], len));
    }
    CHECK(ref(base, 0) == 0);
    int64_t big[3] = {0, 32771 + 1, nb - 32771};  /* the last ends at the buffer's end */
    fc_fcds_at(base, big, 3, 32771, out);
    for (int i = 0; i < 3; i++) CHECK(out[i] == ref(base + big[i], 32771));
    int64_t last[1] = {nb - 1};  /* one byte: the buffer's last */
    fc_fcds_at(base, last, 1, 1, out);
    CHECK(out[0] == ref(base + nb - 1, 1) && out[0] == (((uint64_t)(0xC2B2AE35u * ((0x85EBCA6Bu * base[nb - 1]) ^ ((0x85EBCA6Bu * base[nb - 1]) >> 15)))) << 32 | base[nb - 1]));
    free(base);
    return fc_done("test_fcds");
}
