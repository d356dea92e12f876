"""Gather a round and hash it in one GIL-free call (the write queue's prepare step; issue 11,
docs/performance.md "Every page size, the GIL, and writes").

:func:`~flatcake.store.deferred_round.prepare_round` used to take four GIL-free steps per round
(one numpy copy per plane, the xxh3 loop, the device-checksum loop), and next to a thread
burning Python CPU each return can wait a whole switch interval (5 ms) for the GIL. Here one
:mod:`ctypes` call copies every (layer, page) chunk of a CPU host layout into the round's
layer-major buffer and computes both checksums of each chunk right after copying it (while its
bytes are in cache), calling python-xxhash's own ``XXH3_64bits`` and the compiled device
checksum loop of :mod:`flatcake.kernels.fcds_native` by address, so the bits are those of
:func:`~flatcake.cio.pagecopy.chunk_checksums` and
:func:`~flatcake.kernels.fcds_native.fcds_host_chunks`. The C is ``csrc/gather.c``, built into
FlatCake's extension at install (:mod:`flatcake.native.loops`). Where either loop is not in use,
or the layout's token rows are not contiguous bytes, :func:`gather_and_hash` returns ``None``
and the caller takes the numpy path.
"""

from __future__ import annotations

import ctypes
from typing import Optional

import numpy as np

from flatcake.cio.native_restore import dst_table
from flatcake.cio.xxh3_bulk import xxh3_address
from flatcake.kernels import fcds_native
from flatcake.native.loops import NativeLoop, entry


def _build():
    """The bound ``fc_gather_hash`` (with the xxh3 and device-checksum loops' addresses), or
    ``(None, why)``."""
    fc = fcds_native.LOOP.wait_built()
    if fc is None:
        return None, "needs the device checksum's C loop (fcds), which is not in use"
    xaddr, why = xxh3_address()
    if xaddr is None:
        return None, why
    fn, why = entry("fc_gather_hash", [ctypes.c_void_p] * 3 + [ctypes.c_int64] * 4 + [ctypes.c_void_p] * 6 +
                    [ctypes.c_int64] + [ctypes.c_void_p] * 2, None)
    if fn is None:
        return None, why
    faddr = ctypes.cast(fc, ctypes.c_void_p).value
    return (lambda *a: fn(xaddr, faddr, *a)), ""


#: the C gather (``FLATCAKE_NATIVE_GATHER=0`` turns it off)
LOOP = NativeLoop(_build, "FLATCAKE_NATIVE_GATHER", "FlatCake round gather: numpy copies, then the hash loops",
                  name="gather")


def gather_and_hash(layout, page_ids, out: np.ndarray) -> Optional[tuple[np.ndarray, np.ndarray]]:
    """Copy every layer of pages ``page_ids`` of ``layout`` into ``out`` and hash each chunk.

    Args:
        layout: a CPU :class:`~flatcake.common.layout.KvPageLayout` (a host pool).
        page_ids: int64 ``[n]`` source pages, each in ``[0, layout.num_pages)``.
        out: contiguous uint8 ``[layers * n * chunk_bytes]``: chunk (layer ``l``, page ``i``)
            lands at ``(l * n + i) * chunk_bytes``, as a round's layer-major data.

    Returns:
        ``(sums, devsums)``: uint64 ``[layers, n]`` xxh3-64 and device checksums, or ``None``
        (nothing copied) when the C loop is not available or the layout is not one it copies.

    Raises:
        IndexError: a page id outside the layout (checked before any byte moves).
        ValueError: ``out`` of the wrong size or not contiguous.
    """
    fn = LOOP.fn()
    table = dst_table(layout) if fn is not None else None
    if table is None:
        return None
    g = layout.geometry
    ids = np.ascontiguousarray(page_ids, dtype=np.int64).reshape(-1)
    n, L, cb = ids.shape[0], g.layers, g.chunk_bytes
    if n and (int(ids.min()) < 0 or int(ids.max()) >= layout.num_pages):
        raise IndexError(f"page {int(ids[np.argmax((ids < 0) | (ids >= layout.num_pages))])} outside the layout "
                         f"({layout.num_pages} pages)")
    if out.dtype != np.uint8 or not out.flags.c_contiguous or out.size != L * n * cb:
        raise ValueError(f"out must be contiguous uint8 of {L * n * cb} bytes")
    base, s0, s1 = (np.ascontiguousarray(t) for t in table)
    off = np.array(g.plane_offsets(), dtype=np.int64)
    rb = np.array(g.plane_row_bytes, dtype=np.int64)
    sums = np.empty((L, n), dtype=np.uint64)
    dev = np.empty((L, n), dtype=np.uint64)
    if n:
        fn(out.ctypes.data, n, L, base.shape[1], g.page_size, ids.ctypes.data, base.ctypes.data, s0.ctypes.data,
           s1.ctypes.data, off.ctypes.data, rb.ctypes.data, cb, sums.ctypes.data, dev.ctypes.data)
    return sums, dev


__all__ = ["LOOP", "gather_and_hash"]
