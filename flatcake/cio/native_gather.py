"""Gather a round and hash it in one GIL-free call (the write queue's prepare step; issue 11,
docs/performance.md "Every page size, the GIL, and writes").

:func:`~flatcake.deferred_round.prepare_round` used to take four GIL-free steps per round
(one numpy copy per plane, the xxh3 loop, the device-checksum loop), and next to a thread
burning Python CPU each return can wait a whole switch interval (5 ms) for the GIL. Here one
:mod:`ctypes` call copies every (layer, page) chunk of a CPU host layout into the round's
layer-major buffer and computes both checksums of each chunk right after copying it (while its
bytes are in cache), calling python-xxhash's own ``XXH3_64bits`` and the compiled device
checksum loop of :mod:`flatcake.kernels.fcds_native` by address, so the bits are those of
:func:`~flatcake.cio.pagecopy.chunk_checksums` and
:func:`~flatcake.kernels.fcds_native.fcds_host_chunks`. Where either loop is not compiled, or the
layout's token rows are not contiguous bytes, :func:`gather_and_hash` returns ``None`` and the
caller takes the numpy path.
"""

from __future__ import annotations

import ctypes
from typing import Optional

import numpy as np

from flatcake.cio.native_restore import dst_table
from flatcake.cio.xxh3_bulk import xxh3_address
from flatcake.kernels import fcds_native
from flatcake.native_loop import NativeLoop, compile_shim

_SHIM = r"""
#include <stdint.h>
#include <string.h>
typedef uint64_t (*xxh3_fn)(const void *, size_t);
typedef void (*fcds_fn)(const uint8_t *, const int64_t *, int64_t, int64_t, uint64_t *);
void fc_gather_hash(void *xh, void *fh, uint8_t *out, int64_t n, int64_t L, int64_t J, int64_t P,
                    const int64_t *pages, const int64_t *base, const int64_t *s0, const int64_t *s1,
                    const int64_t *plane_off, const int64_t *plane_rb, int64_t cb, uint64_t *sums, uint64_t *dev) {
    xxh3_fn h = (xxh3_fn)xh; fcds_fn f = (fcds_fn)fh; const int64_t zero = 0;
    for (int64_t l = 0; l < L; l++) {
        for (int64_t i = 0; i < n; i++) {
            uint8_t *d = out + (l * n + i) * cb;
            for (int64_t q = 0; q < J; q++) {
                int64_t t = l * J + q, rb = plane_rb[q];
                const uint8_t *s = (const uint8_t *)(intptr_t)(base[t] + pages[i] * s0[t]);
                uint8_t *dq = d + plane_off[q];
                if (s1[t] == rb) { memcpy(dq, s, (size_t)(rb * P)); continue; }
                for (int64_t r = 0; r < P; r++) memcpy(dq + r * rb, s + r * s1[t], (size_t)rb);
            }
            sums[l * n + i] = h(d, (size_t)cb);
            f(d, &zero, 1, cb, &dev[l * n + i]);
        }
    }
}
"""


def _build():
    """The bound ``fc_gather_hash`` (with the xxh3 and device-checksum loops' addresses), or
    ``(None, why)``."""
    fc = fcds_native.LOOP.wait_built()
    if fc is None:
        return None, "needs the device checksum's C loop (fcds), which is not in use"
    xaddr, why = xxh3_address()
    if xaddr is None:
        return None, why
    lib, why = compile_shim(_SHIM, "gather")
    if lib is None:
        return None, why
    fn = lib.fc_gather_hash
    fn.argtypes = [ctypes.c_void_p] * 3 + [ctypes.c_int64] * 4 + [ctypes.c_void_p] * 6 + [ctypes.c_int64] + \
        [ctypes.c_void_p] * 2
    fn.restype = None
    faddr = ctypes.cast(fc, ctypes.c_void_p).value
    return (lambda *a: (fc, fn(xaddr, faddr, *a))), why  # the closure keeps both libraries loaded


#: the C gather (``FLATCAKE_NATIVE_GATHER=0`` turns it off)
LOOP = NativeLoop(_build, "FLATCAKE_NATIVE_GATHER", "FlatCake round gather: numpy copies, then the hash loops",
                  name="gather")


def gather_and_hash(layout, page_ids, out: np.ndarray) -> Optional[tuple[np.ndarray, np.ndarray]]:
    """Copy every layer of pages ``page_ids`` of ``layout`` into ``out`` and hash each chunk.

    Args:
        layout: a CPU :class:`~flatcake.layout.KvPageLayout` (a host pool).
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
