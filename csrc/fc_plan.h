/* The chunk sort shared by the restore's plan (plan.c) and the zero-copy restore (zero_copy.c). */
#ifndef FC_PLAN_H
#define FC_PLAN_H

#include <stdint.h>

/* Sort ord[0..n) (chunk positions) by (file, offset, tag, position): the order of numpy's
   stable lexsort over those keys. Thread-safe (qsort has no context argument in C99: the keys
   are a global guarded by a mutex). */
void fc_sort_chunks(int64_t *ord, int64_t n, const int64_t *file, const int64_t *off, const int64_t *tag);

#endif
