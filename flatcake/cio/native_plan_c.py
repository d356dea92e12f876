"""The one-call restore's plan, ``fc_restore_plan`` in ``csrc/plan.c`` (:mod:`flatcake.cio.native_restore`,
paper §3.3): its meaning and its ctypes signature.

The same plan as the Python pipeline's :func:`~flatcake.cio.plan.plan_reads` (uniform chunk
size), :func:`~flatcake.cio.plan.batch_reads`, :meth:`~flatcake.cio.batch.StagingBatch.build`
and :func:`~flatcake.cio.engines.split_pieces`, in one C call that keeps the GIL (~0.1 ms for
2,048 chunks): next to a thread burning Python CPU, the Python plan's sorts, gathers
(``a[order]`` over the 2,048 chunk descriptors) and ``flatnonzero`` gave the GIL up, and each
could wait a whole switch interval to get it back (17 + 12 ms of a busy 128-page call,
docs/performance.md). The arrays it fills are the ones ``fc_restore_run`` reads.

1. Sort the chunks by (file, offset, tag, position) (``np.lexsort`` is stable: the same order).
2. A chunk joins the read before it when it is in the same file and the hole before it is
   ``<= 0`` or ``< gap`` bytes or its aligned start falls before the previous chunk's aligned
   end, and the aligned read stays ``<= max_io`` bytes (ends are monotonic: uniform size).
3. Order the reads by (smallest layer, file, offset, plan position) and pack them greedily into
   batches of ``<= capacity`` bytes (buffer ``b % 2`` for batch ``b``).
4. Cut each read into ``max(1, min(workers, nbytes // min_piece))`` pieces of
   ``align_up(ceil(nbytes / n))`` bytes; a chunk wholly in one piece is owned by it.

Return: 0, -1 out of memory, -2 a chunk with a negative offset or a non-positive size (or a
non-positive ``align``, ``workers`` or ``min_piece``), -3 a read longer than ``capacity`` (the
caller then takes the Python pipeline, which raises).
``out[0..4]``: pieces, batches, merged reads, bytes read, chunks owned by a piece.
"""

import ctypes

_I64, _P = ctypes.c_int64, ctypes.c_void_p

#: the C file (in the extension :mod:`flatcake._native`, :mod:`flatcake.native.loops`)
C_FILE = "csrc/plan.c"
#: ``fc_restore_plan``'s argument types: ``n``, the four chunk columns, seven sizes and the two
#: staging buffers' addresses, then the fifteen arrays it fills and ``out``
ARGTYPES = [_I64] + [_P] * 4 + [_I64] * 9 + [_P] * 16
