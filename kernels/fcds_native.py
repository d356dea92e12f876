"""The device checksum (:mod:`flatcake.kernels.device_checksum`) of many chunks in one C call
that does not hold the GIL: the write side, which hashes every round's host bytes.

numpy's ufuncs release the GIL but make ~8 passes over the data (0.26-0.34 GB/s on the
development machine for 2 KiB-512 KiB chunks, against 10-13 GB/s for the native xxh3 loop;
docs/performance.md), too slow for a write path that must keep up with the disk. The same
arithmetic in a 20-line C loop (``csrc/fcds.c``, built into FlatCake's extension at install,
with AVX2 / AVX-512 variants chosen at load on x86-64, and bound through :mod:`ctypes`;
:mod:`flatcake.native.loops`) makes one pass. Where the extension was not built it falls back
to :func:`~flatcake.kernels.device_checksum.fcds_numpy` (same bits; logged once at WARNING and
reported as the ``fcds`` loop's state).
"""

from __future__ import annotations

import ctypes

import numpy as np

from flatcake.kernels.device_checksum import fcds_numpy
from flatcake.native.loops import NativeLoop, chunk_starts, entry


def _build():
    """The bound C loop ``fc_fcds_at``, or ``(None, why)``."""
    return entry("fc_fcds_at", [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int64, ctypes.c_int64, ctypes.c_void_p],
                 None)


#: the C loop (``FLATCAKE_NATIVE_FCDS=0`` turns it off)
LOOP = NativeLoop(_build, "FLATCAKE_NATIVE_FCDS", "FlatCake device checksums on the write side: numpy", name="fcds")


def native() -> bool:
    """Whether the C loop is in use (bound on the first call; thread-safe;
    ``FLATCAKE_NATIVE_FCDS=0`` disables it)."""
    return LOOP.fn() is not None


def warm_up() -> None:
    """Bind the C loop, and every other C loop, from the extension
    (:func:`flatcake.native.loops.warm_up_all`)."""
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
