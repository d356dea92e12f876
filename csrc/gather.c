/* A round gathered and hashed in one GIL-free call: fc_gather_hash (flatcake/cio/native_gather.py,
 * the write queue's prepare step).
 *
 * Copies every (layer l, page i) chunk of a CPU host layout into `out` at (l * n + i) * cb (a
 * round's layer-major data) and, right after copying it (its bytes still in cache), computes
 * its xxh3-64 (xh: python-xxhash's XXH3_64bits, by address) into sums[l * n + i] and its device
 * checksum (fh: fc_fcds_at, fcds.c, by address) into dev[l * n + i]. Source of plane q of
 * (layer l, page p): base[l*J+q] + p * s0[l*J+q], P token rows s1[l*J+q] bytes apart, each
 * plane_rb[q] bytes, landing at plane_off[q] of the chunk. */
#include <string.h>

#include "fc_common.h"
#include "fc_api.h"

typedef void (*fcds_fn)(const uint8_t *, const int64_t *, int64_t, int64_t, uint64_t *);

FC_API void fc_gather_hash(void *xh, void *fh, uint8_t *out, int64_t n, int64_t L, int64_t J, int64_t P,
                           const int64_t *pages, const int64_t *base, const int64_t *s0, const int64_t *s1,
                           const int64_t *plane_off, const int64_t *plane_rb, int64_t cb, uint64_t *sums,
                           uint64_t *dev) {
    fc_xxh3_fn h = (fc_xxh3_fn)xh;
    fcds_fn f = (fcds_fn)fh;
    const int64_t zero = 0;
    for (int64_t l = 0; l < L; l++) {
        for (int64_t i = 0; i < n; i++) {
            uint8_t *d = out + (l * n + i) * cb;
            for (int64_t q = 0; q < J; q++) {
                int64_t t = l * J + q, rb = plane_rb[q];
                const uint8_t *s = (const uint8_t *)(intptr_t)(base[t] + pages[i] * s0[t]);
                uint8_t *dq = d + plane_off[q];
                if (s1[t] == rb) { memcpy(dq, s, (size_t)(rb * P)); continue; }
                for (int64_t r = 0; r < P; r++) memcpy(dq + r * rb, s + r * s1[t], (size_t)rb);
            }
            sums[l * n + i] = h(d, (size_t)cb);
            f(d, &zero, 1, cb, &dev[l * n + i]);
        }
    }
}
