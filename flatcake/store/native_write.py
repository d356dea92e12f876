"""A deferred round's pieces written in one GIL-free call (the write queue's writer thread;
issue 11, docs/performance.md "The busy-thread ratio is GIL hand-offs").

:func:`~flatcake.store.deferred_round.write_prepared` writes a round in pieces of
``WRITE_CHUNK_BYTES`` (8 MiB) so that a restore waits behind at most one piece (paper §3.3,
reads first). In Python each piece is an ``fstat`` and a ``pwritev`` in
:meth:`~flatcake.media.ssd.SsdFilePool.write`, and next to a thread burning Python CPU
(SGLang's scheduler loop) each return can wait a whole switch interval (5 ms) for the GIL:
~340 such steps per GB. Here :func:`piece_writer` gives ``SsdFilePool.write`` (one call per
round: its checks and one ``fstat``) a ``pwrite`` that writes the pieces in one :mod:`ctypes`
call, in order, the record last; between two pieces it reads the write queue's count of
restores in flight (:attr:`~flatcake.store.write_queue.WriteQueue.readers_now`) and, when one is,
returns so the caller pauses (``between``) and calls again for the rest. Same bytes, same
order, same pause points as the Python loop. The C is ``csrc/write.c``, built into the
extension at install (:mod:`flatcake.native.loops`); ``FLATCAKE_NATIVE_WRITE=0`` or an
extension not built keeps the Python loop (as do tests that inject faults at ``os.pwritev``).
"""

from __future__ import annotations

import ctypes
import os
from typing import Callable, Optional, Sequence

import numpy as np

from flatcake.native.loops import NativeLoop, entry


def _build():
    """The bound ``fc_write_pieces`` (``csrc/write.c``), or ``(None, why)``."""
    return entry("fc_write_pieces", [ctypes.c_int64] * 4 + [ctypes.c_void_p, ctypes.c_int64, ctypes.c_void_p],
                 ctypes.c_int64)


#: the C piece loop (``FLATCAKE_NATIVE_WRITE=0`` turns it off)
LOOP = NativeLoop(_build, "FLATCAKE_NATIVE_WRITE", "write queue: a pwritev per piece from Python", name="write")


def warm_up() -> None:
    """Bind the C piece loop, and every other C loop, from the extension (called when a store
    opens its write queue, so its state is logged then; :func:`flatcake.native.loops.warm_up_all`)."""
    LOOP.warm_up()


def piece_writer(ends: Sequence[int], readers: Optional[np.ndarray],
                 between: Optional[Callable[[], None]]) -> Optional[Callable]:
    """A ``pwrite(fd, mv, offset) -> bytes written`` for :meth:`SsdFilePool.write` that writes
    ``mv`` in pieces in one GIL-free call, or ``None`` (the C loop is off: the caller's Python
    loop, one ``pwritev`` per piece).

    Args:
        ends: file offsets (bytes, ascending) where pieces end; the last piece ends at the end of
            the buffer.
        readers: int64 ``[1]`` restores in flight, updated by the write queue; ``None``: never
            pause.
        between: called when the loop stopped for a restore, before the caller writes the rest
            (``WriteQueue.pause_for_reads``).

    The returned function raises ``OSError`` (the errno of the failed ``pwrite``) and returns 0
    when nothing could be written (the caller's ``ShortWrite``).
    """
    fn = LOOP.fn()
    if fn is None:
        return None
    e = np.ascontiguousarray(ends, dtype=np.int64)
    r = readers if readers is not None else np.zeros(1, dtype=np.int64)

    def pwrite(fd: int, mv, offset: int) -> int:
        a = np.frombuffer(mv, dtype=np.uint8)
        got = fn(fd, a.ctypes.data, offset, a.shape[0], e.ctypes.data, e.shape[0], r.ctypes.data)
        if got < 0:
            raise OSError(-got, os.strerror(-got))
        if 0 < got < a.shape[0] and between is not None:
            between()
        return got

    return pwrite


__all__ = ["LOOP", "piece_writer", "warm_up"]
