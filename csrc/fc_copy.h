/* Copying rows into the host pool: the one-call restore (restore.c) and the bench's page-wise
 * reader (pagewise_read.c) copy the same way, so the bench's baseline is as good as ours. */
#ifndef FC_COPY_H
#define FC_COPY_H

#include <stdint.h>
#include <string.h>
#if defined(__x86_64__)
#include <emmintrin.h>
#endif

/* Copy n bytes from s to d. With nt set, on x86-64, where d is 16-byte aligned and n a multiple
   of 64: SSE2 streaming (non-temporal) stores, which skip reading each destination cache line
   before writing it (the pool is next read by DMA, not by this core); the caller fences
   (fc_copy_fence) before it reports the bytes. Otherwise memcpy. s may be unaligned. */
static inline void fc_copy_rows(int64_t nt, uint8_t *d, const uint8_t *s, size_t n) {
#if defined(__x86_64__)
    if (nt && !((uintptr_t)d & 15) && !(n & 63)) {
        for (size_t i = 0; i < n; i += 64) {
            __m128i a = _mm_loadu_si128((const __m128i *)(s + i)), b = _mm_loadu_si128((const __m128i *)(s + i + 16));
            __m128i c = _mm_loadu_si128((const __m128i *)(s + i + 32)), e = _mm_loadu_si128((const __m128i *)(s + i + 48));
            _mm_stream_si128((__m128i *)(d + i), a); _mm_stream_si128((__m128i *)(d + i + 16), b);
            _mm_stream_si128((__m128i *)(d + i + 32), c); _mm_stream_si128((__m128i *)(d + i + 48), e);
        }
        return;
    }
#endif
    if (n) memcpy(d, s, n);
}

/* Streaming stores visible to other threads (and DMA) from here on; a no-op without nt. */
static inline void fc_copy_fence(int64_t nt) {
#if defined(__x86_64__)
    if (nt) _mm_sfence();
#else
    (void)nt;
#endif
}

#endif
