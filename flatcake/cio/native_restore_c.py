"""The one-call FC-CIO restore, ``fc_restore_run`` in ``csrc/restore.c`` (:mod:`flatcake.cio.native_restore`,
paper §3.3): its meaning and its ctypes signature.

One call reads every I/O piece of a restore (``pread`` from ``nthreads`` POSIX threads into
the two staging buffers of a window), verifies each chunk's xxh3-64 (python-xxhash's own
``XXH3_64bits``, passed in by address) and copies its planes into the page slots, all without
the GIL. A thread that read a piece verifies and scatters the chunks lying wholly in it; the
thread that finishes a batch's last piece handles the chunks straddling two of its pieces. The
pieces of batch ``b`` start only after batch ``b - 2`` (same buffer) is wholly scattered. At
most ``cpu_threads`` threads verify and copy at once (the others keep reading), so a core stays
free for the process's Python threads. With ``idle`` set, the call's threads are all new ones,
each switched to Linux's ``SCHED_IDLE`` class before it works (the calling thread only waits, so
its own class is never touched): any other thread that wakes (SGLang's scheduler loop) takes
their core at once instead of waiting out a time slice. The call returns how many threads did
switch (0 when ``idle`` is off, or where the kernel refused). With ``nt`` set (x86-64), the
copies into the page slots are SSE2 streaming stores where the row is 16-byte aligned and a
multiple of 64 bytes: no read of each destination cache line first, ~25 % less CPU per GB in
the token-strided ``page_first`` copy (docs/performance.md, "Streaming stores"; ``fc_copy_rows`` in
``csrc/fc_copy.h``, which the bench's page-wise reader shares).

Chunk status out: 0 delivered, 1 not fully read (short read, EOF, I/O error), 2 checksum
mismatch. Piece errors out: 0, an errno, or -1 for end of file.
"""

import ctypes

_I64, _P = ctypes.c_int64, ctypes.c_void_p

#: the C file (in the extension :mod:`flatcake._native`, :mod:`flatcake.native.loops`)
C_FILE = "csrc/restore.c"
#: ``fc_restore_run``'s argument types (the xxh3 function's address first)
ARGTYPES = [_P, _I64, _I64, _I64, _I64] + [_P] * 7 + [_I64] + [_P] * 12 + [_I64] * 4 + [_P] * 8 + [_I64] * 2
