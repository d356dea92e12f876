/* Shared by FlatCake's C loops (the extension flatcake._native, built by setup.py).
 *
 * FC_API marks the entry points Python binds through ctypes (flatcake/native/loops.py loads the
 * extension's file with ctypes.CDLL); everything else is compiled with -fvisibility=hidden. */
#ifndef FC_COMMON_H
#define FC_COMMON_H

#include <stddef.h>
#include <stdint.h>

#define FC_API __attribute__((visibility("default")))

/* python-xxhash's XXH3_64bits (seed 0), passed in by address so the loops give its bits */
typedef uint64_t (*fc_xxh3_fn)(const void *, size_t);

/* x rounded up to a multiple of a (a > 0, x >= 0) */
static inline int64_t fc_align_up(int64_t x, int64_t a) { return (x + a - 1) / a * a; }

#endif
