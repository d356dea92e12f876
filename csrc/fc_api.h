/* The entry points of FlatCake's C loops, one declaration each (the definitions are in the
 * csrc/*.c files named beside them; Python binds them by name through ctypes, flatcake/native/loops.py,
 * and the C tests of csrc/tests/ call them). Every source includes this file, so a definition that
 * drifts from its declaration does not compile. */
#ifndef FC_API_H
#define FC_API_H

#include "fc_common.h"

/* fcds.c */
FC_API void fc_fcds_at(const uint8_t *base, const int64_t *starts, int64_t n, int64_t len, uint64_t *out);
/* gather.c */
FC_API void fc_gather_hash(void *xh, void *fh, uint8_t *out, int64_t n, int64_t L, int64_t J, int64_t P, const int64_t *pages, const int64_t *base, const int64_t *s0, const int64_t *s1, const int64_t *plane_off, const int64_t *plane_rb, int64_t cb, uint64_t *sums, uint64_t *dev);
/* pagewise_read.c */
FC_API int64_t fc_pagewise_read(int64_t n, const int64_t *fd, const int64_t *off, const int64_t *len, const int64_t *dst, int64_t *got, int64_t *err, int64_t nthreads);
/* pagewise_read.c */
FC_API int64_t fc_pagewise_read_copy(int64_t n, const int64_t *fd, const int64_t *off, const int64_t *len, int64_t *got, int64_t *err, int64_t nthreads, int64_t bounce, int64_t bounce_stride, const int64_t *seg_start, const int64_t *seg_src, const int64_t *seg_dst, const int64_t *seg_rows, const int64_t *seg_row_bytes, const int64_t *seg_dst_stride, int64_t nt);
/* plan.c */
FC_API int64_t fc_restore_plan(int64_t n, const int64_t *file, const int64_t *off, const int64_t *tag, const int64_t *layer, int64_t cb, int64_t gap, int64_t max_io, int64_t align, int64_t capacity, int64_t workers, int64_t min_piece, int64_t buf0, int64_t buf1, int64_t *pfile, int64_t *poff, int64_t *plen, int64_t *paddr, int64_t *pbatch, int64_t *own_lo, int64_t *rest_lo, int64_t *rest_hi, int64_t *cb0, int64_t *bbase, int64_t *ck0, int64_t *ck1, int64_t *cidx, int64_t *left, uint8_t *cstatus, int64_t *out);
/* restore.c */
FC_API int64_t fc_restore_run(void *h, int64_t direct, int64_t nthreads, int64_t cpu_threads, int64_t np, const int64_t *pfd, const int64_t *poff, const int64_t *plen, const int64_t *paddr, const int64_t *pbatch, int64_t *pgot, int64_t *perr, int64_t nb, const int64_t *own_lo, const int64_t *rest_lo, const int64_t *rest_hi, const int64_t *cb0, const int64_t *bbase, const int64_t *ck0, const int64_t *ck1, const int64_t *cidx, const int64_t *page, const int64_t *layer, const uint64_t *want, const uint8_t *has, int64_t verify, int64_t cb, int64_t J, int64_t P, const int64_t *plane_off, const int64_t *plane_rb, const int64_t *tb, const int64_t *ts0, const int64_t *ts1, uint8_t *cstatus, int64_t *left, uint8_t *done, int64_t idle, int64_t nt);
/* write.c */
FC_API int64_t fc_write_pieces(int64_t fd, int64_t addr, int64_t off, int64_t n, const int64_t *ends, int64_t nends, const volatile int64_t *readers);
/* xxh3.c */
FC_API void fc_xxh3_at(void *fn, const uint8_t *base, const int64_t *starts, int64_t n, int64_t len, uint64_t *out);
/* xxh3.c */
FC_API void fc_xxh3_copy(void *fn, const uint8_t *base, const int64_t *starts, int64_t n, int64_t len, const uint64_t *want, uint8_t *dst, const int64_t *dst_at, int8_t *state);
/* zero_copy.c */
FC_API int64_t fc_zc_run(const int64_t *hfn, int64_t direct, int64_t nthreads, int64_t cpu_threads, int64_t idle, int64_t n, const int64_t *file, const int64_t *off, const int64_t *tag, const int64_t *page, const int64_t *layer, const uint64_t *want, const uint8_t *has, int64_t verify, const int64_t *fdmap, int64_t nfd, int64_t cb, int64_t gap, int64_t max_io, int64_t align, int64_t workers, int64_t min_piece, int64_t J, int64_t P, const int64_t *plane_off, const int64_t *plane_rb, const int64_t *tb, const int64_t *ts0, int64_t *ord, int64_t *pfd, int64_t *pfile, int64_t *poff, int64_t *plen, int64_t *plo, int64_t *pgot, int64_t *perr, uint8_t *cstatus, int64_t *out);

#endif
