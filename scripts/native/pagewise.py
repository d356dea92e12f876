"""The page-wise baselines' reader (``csrc/pagewise_read.c``, in FlatCake's extension), for scripts/bench_restore.py.

A page-wise store restores a prefix with one read per page (or per (page, layer) chunk) slot.
Issue 23 (item 7) asks that the bench's page-wise baselines be the best such reader anyone
could write: many reads in flight from native threads, not a Python loop per page. So:

    reader = PagewiseReader(threads)      # binds the C reader from FlatCake's extension
    got = reader.read(fd, off, length, dst)               # job i: straight into address dst[i]
    got = reader.read_copy(fd, off, length, bounce, Segments(...))
                                          # job i: into the thread's bounce slot, then its
                                          # segments copied out (K/V regions, token rows)

``reader.kind`` says what runs: ``"c-pthreads"`` (the C source, built into FlatCake's extension
at install with the loops and bound by :func:`flatcake.native.loops.entry`; ``threads`` POSIX
threads, each with one blocking ``pread`` in flight: queue depth = ``threads``) or
``"python-threads"`` (the extension not built: a Python thread pool of the same size doing the
same jobs, ``reader.why`` says why). Copies use the restore's own row copy (``fc_copy_rows``,
``csrc/fc_copy.h``): streaming stores where FlatCake's restore uses them
(``FLATCAKE_STREAMING_STORES``, the same knob).
"""

from __future__ import annotations

import ctypes
import os
import threading
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Optional

import numpy as np

from flatcake.cio.native_restore import STREAMING_STORES
from flatcake.native.loops import entry

_I64, _P = ctypes.c_int64, ctypes.c_void_p


@dataclass(frozen=True)
class Segments:
    """Where each job's bytes go (copy mode). Segment ``s`` copies ``rows[s]`` rows of
    ``row_bytes[s]`` bytes, back to back in its job's bytes from offset ``src[s]``, to the
    address ``dst[s]`` with rows ``dst_stride[s]`` bytes apart; job ``i`` owns segments
    ``start[i] .. start[i + 1] - 1``. All int64 numpy arrays (``start`` has one entry per job
    plus one)."""

    start: np.ndarray
    src: np.ndarray
    dst: np.ndarray
    rows: np.ndarray
    row_bytes: np.ndarray
    dst_stride: np.ndarray


def _i64(x) -> np.ndarray:
    return np.ascontiguousarray(x, dtype=np.int64).reshape(-1)


class _Lib:
    """The two bound entry points (``fc_pagewise_read``, ``fc_pagewise_read_copy``)."""

    def __init__(self, read, read_copy):
        self.fc_pagewise_read, self.fc_pagewise_read_copy = read, read_copy


def _build():
    """``(lib, "")`` with both entry points bound, or ``(None, why)``."""
    read, why = entry("fc_pagewise_read", [_I64] + [_P] * 6 + [_I64], _I64)
    read_copy, why2 = entry("fc_pagewise_read_copy", [_I64] + [_P] * 5 + [_I64] * 3 + [_P] * 6 + [_I64], _I64)
    if read is None or read_copy is None:
        return None, why or why2
    return _Lib(read, read_copy), ""


class PagewiseReader:
    """Reads jobs ``(fd, offset, length)`` on ``threads`` threads (see the module docstring).

    Args:
        threads: threads, each with one read in flight (the queue depth).
        native: ``False`` forces the Python thread pool (tests; an install without the
            extension gets it anyway).

    Attributes:
        kind: ``"c-pthreads"`` or ``"python-threads"``.
        why: why the Python pool runs (empty with the C reader).
    """

    def __init__(self, threads: int, native: bool = True):
        if threads < 1:
            raise ValueError(f"threads must be >= 1, got {threads}")
        self.threads = threads
        self._lib, self.why = _build() if native else (None, "native=False")
        self.kind = "c-pthreads" if self._lib is not None else "python-threads"
        self._pool: Optional[ThreadPoolExecutor] = None
        self._slots = threading.local()
        self._next_slot = 0
        self._slot_lock = threading.Lock()

    def read(self, fd, off, length, dst) -> np.ndarray:
        """Read job ``i`` (``length[i]`` bytes at ``off[i]`` of ``fd[i]``) into address ``dst[i]``.

        Returns:
            int64 bytes read per job (``length[i]`` unless the file ended or a read failed).

        Raises:
            OSError: a read failed (the first failing job's errno).
        """
        fd, off, length, dst = (_i64(x) for x in (fd, off, length, dst))
        got, err = np.zeros(len(fd), dtype=np.int64), np.zeros(len(fd), dtype=np.int64)
        if self._lib is not None:
            self._lib.fc_pagewise_read(len(fd), *(x.ctypes.data for x in (fd, off, length, dst, got, err)),
                                       self.threads)
        else:
            self._python(fd, off, length, got, err, lambda i, _slot: int(dst[i]), None, 0)
        _raise_first(err)
        return got

    def read_copy(self, fd, off, length, bounce: int, bounce_stride: int, seg: Segments) -> np.ndarray:
        """Read job ``i`` into the reading thread's slot of ``bounce`` (``threads`` slots of
        ``bounce_stride`` bytes, each at least the longest job; 4 KiB-aligned for O_DIRECT) and
        copy its segments out of it once all its bytes are read.

        Returns / Raises: as :meth:`read`.
        """
        fd, off, length = (_i64(x) for x in (fd, off, length))
        n = len(fd)
        if n and int(length.max()) > bounce_stride:
            raise ValueError(f"a job of {int(length.max())} bytes does not fit a {bounce_stride}-byte bounce slot")
        arrs = [_i64(x) for x in (seg.start, seg.src, seg.dst, seg.rows, seg.row_bytes, seg.dst_stride)]
        if len(arrs[0]) != n + 1:
            raise ValueError(f"segments start has {len(arrs[0])} entries for {n} jobs")
        got, err = np.zeros(n, dtype=np.int64), np.zeros(n, dtype=np.int64)
        if self._lib is not None:
            self._lib.fc_pagewise_read_copy(n, *(x.ctypes.data for x in (fd, off, length, got, err)), self.threads,
                                            int(bounce), int(bounce_stride), *(x.ctypes.data for x in arrs),
                                            int(STREAMING_STORES))
        else:
            self._python(fd, off, length, got, err, lambda _i, slot: int(bounce) + slot * int(bounce_stride),
                         arrs, 1)
        _raise_first(err)
        return got

    # ---------------------------------------------------------------- the Python fallback
    def _slot(self) -> int:
        s = getattr(self._slots, "slot", None)
        if s is None:
            with self._slot_lock:
                s = self._slots.slot = self._next_slot
                self._next_slot += 1
        return s

    def _python(self, fd, off, length, got, err, where, segs, copy: int) -> None:
        """The same jobs on a Python thread pool of ``threads`` threads (one ``preadv`` per job)."""
        if self._pool is None:
            self._pool = ThreadPoolExecutor(self.threads, thread_name_prefix="pagewise")

        def one(i: int) -> None:
            addr = where(i, self._slot())
            want, done = int(length[i]), 0
            view = memoryview((ctypes.c_char * max(1, want)).from_address(addr)).cast("B")[:want]
            try:
                while done < want:
                    k = os.preadv(int(fd[i]), [view[done:]], int(off[i]) + done)
                    if k == 0:
                        break
                    done += k
            except OSError as e:
                if not (e.errno == 22 and done and done % 512):  # O_DIRECT short count at end of file
                    err[i] = e.errno or -1
            got[i] = done
            if copy and not err[i] and done == want:
                start, src, dst, rows, rb, ds = segs
                for s in range(int(start[i]), int(start[i + 1])):
                    for r in range(int(rows[s])):
                        ctypes.memmove(int(dst[s]) + r * int(ds[s]), addr + int(src[s]) + r * int(rb[s]), int(rb[s]))

        list(self._pool.map(one, range(len(fd))))

    def close(self) -> None:
        """Stop the Python pool's threads (nothing to do for the C reader)."""
        if self._pool is not None:
            self._pool.shutdown()
            self._pool = None
            self._slots, self._next_slot = threading.local(), 0


def _raise_first(err: np.ndarray) -> None:
    bad = np.flatnonzero(err)
    if len(bad):
        e = int(err[bad[0]])
        raise OSError(e, f"page-wise read of job {int(bad[0])} failed: {os.strerror(e) if e > 0 else 'error'}")
