"""The device checksum (:mod:`flatcake.kernels.device_checksum`) of many chunks in one C call
that does not hold the GIL: the write side, which hashes every round's host bytes.

numpy's ufuncs release the GIL but make ~8 passes over the data (0.26-0.34 GB/s on the
development machine for 2 KiB-512 KiB chunks, against 10-13 GB/s for the native xxh3 loop;
docs/performance.md), too slow for a write path that must keep up with the disk. The same
arithmetic in a 20-line C loop, compiled once per process with the system C compiler into a
temporary directory and loaded through :mod:`ctypes` (files removed right after; the pattern
of :mod:`flatcake.cio.xxh3_bulk`), makes one pass. Where no compiler is available it falls back
to :func:`~flatcake.kernels.device_checksum.fcds_numpy` (same bits; logged once at WARNING and
reported as the ``fcds`` loop's state, :mod:`flatcake.native_loop`).
"""

from __future__ import annotations

import ctypes

import numpy as np

from flatcake.kernels.device_checksum import fcds_numpy
from flatcake.native_loop import NativeLoop, chunk_starts, compile_shim

_SHIM = r"""
#include <stdint.h>
#include <string.h>
void fc_fcds_at(const uint8_t *base, const int64_t *starts, int64_t n, int64_t len, uint64_t *out) {
    int64_t W = (len + 3) / 4, full = len / 4;
    for (int64_t c = 0; c < n; c++) {
        const uint8_t *p = base + starts[c];
        uint32_t a = 0, b = 0;
        for (int64_t i = 0; i < full; i++) {  /* whole words: a vectorizable loop */
            uint32_t w, ui = (uint32_t)i;
            memcpy(&w, p + 4 * i, 4);
            a += w * (2u * ui + 1u);
            uint32_t x = w ^ (ui * 0x9E3779B9u);
            x *= 0x85EBCA6Bu; x ^= x >> 15; x *= 0xC2B2AE35u;
            b += x;
        }
        if (full < W) {  /* the zero-padded last word */
            uint32_t w = 0, ui = (uint32_t)full;
            for (int64_t k = 0; 4 * full + k < len; k++) w |= (uint32_t)p[4 * full + k] << (8 * k);
            a += w * (2u * ui + 1u);
            uint32_t x = w ^ (ui * 0x9E3779B9u);
            x *= 0x85EBCA6Bu; x ^= x >> 15; x *= 0xC2B2AE35u;
            b += x;
        }
        out[c] = ((uint64_t)b << 32) | a;
    }
}
"""


def _build():
    """The bound C loop ``fc_fcds_at``, or ``(None, why)``."""
    lib, why = compile_shim(_SHIM, "fcds", (["-O3", "-march=native"], ["-O3"]))  # native: AVX2, ~3x here
    if lib is None:
        return None, why
    fn = lib.fc_fcds_at
    fn.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int64, ctypes.c_int64, ctypes.c_void_p]
    fn.restype = None
    return fn, why


#: the C loop (``FLATCAKE_NATIVE_FCDS=0`` turns it off)
LOOP = NativeLoop(_build, "FLATCAKE_NATIVE_FCDS", "FlatCake device checksums on the write side: numpy", name="fcds")


def native() -> bool:
    """Whether the C loop is in use (compiled on the first call; thread-safe;
    ``FLATCAKE_NATIVE_FCDS=0`` disables it)."""
    return LOOP.fn() is not None


def warm_up() -> None:
    """Compile the C loop, and every other C loop, in the background, so the first round does
    not wait (:func:`flatcake.native_loop.warm_up_all`)."""
    LOOP.warm_up()


def fcds_host_at(host: np.ndarray, starts, chunk_bytes: int) -> np.ndarray:
    """Device checksums of the ``chunk_bytes`` bytes at each byte offset ``starts`` of ``host``
    (contiguous uint8), computed on the host: uint64 ``[len(starts)]``, bit-identical to
    :func:`~flatcake.kernels.device_checksum.fcds_triton`.

    Raises:
        ValueError: an offset outside ``host`` (checked before any byte is read).
    """
    st = chunk_starts(host, starts, chunk_bytes)
    n = st.shape[0]
    out = np.empty(n, dtype=np.uint64)
    if n == 0:
        return out
    fn = LOOP.fn()
    if fn is not None and host.flags.c_contiguous:
        fn(host.ctypes.data, st.ctypes.data, n, chunk_bytes, out.ctypes.data)
        return out
    return fcds_numpy(host, st, chunk_bytes)


def fcds_host_chunks(data: np.ndarray, chunk_bytes: int) -> np.ndarray:
    """Device checksums of every ``chunk_bytes`` chunk of ``data`` (uint8 ``[m * chunk_bytes]``,
    a round's layer-major data): uint64 ``[m]`` — what the write path stores in the record."""
    m = data.shape[0] // chunk_bytes
    return fcds_host_at(data, np.arange(m, dtype=np.int64) * chunk_bytes, chunk_bytes)


__all__ = ["fcds_host_at", "fcds_host_chunks", "native", "warm_up"]
