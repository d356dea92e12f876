/* Many xxh3-64 chunk checksums in one GIL-free call (flatcake/cio/xxh3_bulk.py, paper §3.3
 * integrity). fn is python-xxhash's exported XXH3_64bits (by address), so the sums are its bits.
 *
 * fc_xxh3_at:   out[i] = XXH3_64bits(base + starts[i], len) for i < n
 * fc_xxh3_copy: hash each chunk and, where it equals want[i], copy it to dst + dst_at[i] while
 *               it is still in cache (state[i] = 1); else state[i] = -1 and dst is untouched. */
#include <string.h>

#include "fc_common.h"
#include "fc_api.h"

FC_API void fc_xxh3_at(void *fn, const uint8_t *base, const int64_t *starts, int64_t n, int64_t len, uint64_t *out) {
    fc_xxh3_fn f = (fc_xxh3_fn)fn;
    for (int64_t i = 0; i < n; i++) out[i] = f(base + starts[i], (size_t)len);
}

FC_API void fc_xxh3_copy(void *fn, const uint8_t *base, const int64_t *starts, int64_t n, int64_t len,
                         const uint64_t *want, uint8_t *dst, const int64_t *dst_at, int8_t *state) {
    fc_xxh3_fn f = (fc_xxh3_fn)fn;
    for (int64_t i = 0; i < n; i++) {
        const uint8_t *s = base + starts[i];
        if (f(s, (size_t)len) != want[i]) { state[i] = -1; continue; }
        if (len) memcpy(dst + dst_at[i], s, (size_t)len);
        state[i] = 1;
    }
}
