/* The device checksum (flatcake/kernels/device_checksum.py) of many chunks in one GIL-free call,
 * on the host: fc_fcds_at (flatcake/kernels/fcds_native.py; the write side hashes every round).
 *
 * For chunk c of len bytes at base + starts[c], as 32-bit little-endian words w_i (the last one
 * zero-padded), i = 0 .. ceil(len / 4) - 1, all arithmetic mod 2^32:
 *     a = sum w_i * (2i + 1)
 *     x_i = w_i ^ (i * 0x9E3779B9); x_i *= 0x85EBCA6B; x_i ^= x_i >> 15; x_i *= 0xC2B2AE35
 *     b = sum x_i
 *     out[c] = (b << 32) | a
 * One pass over the bytes. On x86-64 with GCC the loop is also compiled for x86-64-v3 (AVX2)
 * and x86-64-v4 (AVX-512) and the variant is chosen when the extension loads (function
 * multiversioning, an ifunc): a wheel built on one machine runs on any x86-64 and still gets
 * the vector loop (the development machine: 3.2 GB/s SSE2, 14.9 v3, 20.6 v4, 22 -march=native;
 * the run-time compile used -march=native). Not under AddressSanitizer (csrc/tests). */
#include <string.h>

#include "fc_common.h"
#include "fc_api.h"

#if defined(__x86_64__) && !defined(__clang__) && __GNUC__ >= 11 && !defined(__SANITIZE_ADDRESS__)
#define FC_CLONES __attribute__((target_clones("arch=x86-64-v4", "arch=x86-64-v3", "default")))
#elif defined(__x86_64__) && !defined(__clang__) && __GNUC__ >= 6 && !defined(__SANITIZE_ADDRESS__)
#define FC_CLONES __attribute__((target_clones("avx2", "default")))
#else
#define FC_CLONES
#endif

static inline uint32_t mix(uint32_t w, uint32_t i) {
    uint32_t x = w ^ (i * 0x9E3779B9u);
    x *= 0x85EBCA6Bu; x ^= x >> 15; x *= 0xC2B2AE35u;
    return x;
}

FC_API FC_CLONES void fc_fcds_at(const uint8_t *base, const int64_t *starts, int64_t n, int64_t len,
                                 uint64_t *out) {
    int64_t W = (len + 3) / 4, full = len / 4;
    for (int64_t c = 0; c < n; c++) {
        const uint8_t *p = base + starts[c];
        uint32_t a = 0, b = 0;
        for (int64_t i = 0; i < full; i++) {  /* whole words: a vectorizable loop */
            uint32_t w, ui = (uint32_t)i;
            memcpy(&w, p + 4 * i, 4);
            a += w * (2u * ui + 1u);
            b += mix(w, ui);
        }
        if (full < W) {  /* the zero-padded last word */
            uint32_t w = 0, ui = (uint32_t)full;
            for (int64_t k = 0; 4 * full + k < len; k++) w |= (uint32_t)p[4 * full + k] << (8 * k);
            a += w * (2u * ui + 1u);
            b += mix(w, ui);
        }
        out[c] = ((uint64_t)b << 32) | a;
    }
}
