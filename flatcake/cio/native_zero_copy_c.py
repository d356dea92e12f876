"""The zero-copy FC-CIO restore, ``fc_zc_run`` in ``csrc/zero_copy.c``
(:mod:`flatcake.cio.native_zero_copy`, paper §3.3): its meaning and its ctypes signature.

It shares the plan's chunk sort (``fc_sort_chunks``, ``csrc/plan.c``). ``fc_zc_run`` plans and
runs a whole restore in one GIL-free call:

1. Sort the chunks by (file, offset, tag, position). Every chunk offset must be a multiple of
   ``align`` and no two chunks may overlap, else it returns -4 before any byte is read (the
   caller takes the staging path).
2. A chunk joins the read before it when it is in the same file, the hole before it is 0 or
   ``< gap`` bytes, and the read stays ``<= max_io`` bytes.
3. Each read is cut into ``max(1, min(workers, nbytes // min_piece))`` pieces of whole chunks
   (no chunk straddles two pieces; ``ceil(chunks / pieces)`` chunks each).
4. ``nthreads`` threads take pieces in order; a piece is one or more ``preadv`` calls (at most
   1,024 iovecs each) whose iovecs are the chunks' planes in the page slots, in file order,
   with every bridged hole going to the thread's scratch buffer. Then, holding one of
   ``cpu_threads`` CPU slots, each chunk wholly read is hashed in place with XXH3's streaming
   API over its planes (python-xxhash's ``XXH3_64bits_reset/_update/_digest``; one plane:
   ``XXH3_64bits``), the same bits as the one-shot hash of the chunk's bytes in file order.

Chunk status out (``cstatus[i]`` for chunk ``i``): 0 delivered, 1 not fully read (short read,
EOF, I/O error, file not open), 2 checksum mismatch; a failed chunk's slots hold undefined
bytes. Piece errors out: 0, an errno, or -1 for end of file. Return: 0, -1 out of memory, -2 a
negative offset or non-positive size (or a non-positive ``align`` or ``min_piece``), -4 not
eligible (unaligned offset, overlap). ``out``:
pieces, merged reads, bytes read, threads switched to ``SCHED_IDLE``.
"""

import ctypes

_I64, _P = ctypes.c_int64, ctypes.c_void_p

#: the C file (in the extension :mod:`flatcake._native`, :mod:`flatcake.native.loops`)
C_FILE = "csrc/zero_copy.c"
#: ``fc_zc_run``'s argument types (the six hash functions' address array first)
ARGTYPES = [_P] + [_I64] * 5 + [_P] * 7 + [_I64] + [_P] + [_I64] * 9 + [_P] * 4 + [_P] * 10
