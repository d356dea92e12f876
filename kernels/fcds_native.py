"""The device checksum (:mod:`flatcake.kernels.device_checksum`) of many chunks in one C call
that does not hold the GIL: the write side, which hashes every round's host bytes.

numpy's ufuncs release the GIL but make ~8 passes over the data (0.26-0.34 GB/s on the
development machine for 2 KiB-512 KiB chunks, against 10-13 GB/s for the native xxh3 loop;
docs/performance.md), too slow for a write path that must keep up with the disk. The same
arithmetic in a 20-line C loop, compiled once per process with the system C compiler into a
temporary directory and loaded through :mod:`ctypes` (files removed right after; the pattern
of :mod:`flatcake.cio.xxh3_bulk`), makes one pass. Where no compiler is available it falls back
to :func:`~flatcake.kernels.device_checksum.fcds_numpy` (same bits; logged once at INFO).
"""

from __future__ import annotations

import ctypes
import logging
import os
import shutil
import subprocess
import tempfile
import threading

import numpy as np

from flatcake.kernels.device_checksum import fcds_numpy

log = logging.getLogger(__name__)

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

_lock = threading.Lock()
_state: dict = {}


def _compile():
    """(library, why not): the shim, or None and the reason."""
    cc = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")
    if not cc:
        return None, "no C compiler (cc) on PATH"
    d = tempfile.mkdtemp(prefix="flatcake-fcds-")
    try:
        src, so = os.path.join(d, "fcds.c"), os.path.join(d, "libfcfcds.so")
        with open(src, "w") as f:
            f.write(_SHIM)
        for flags in (["-O3", "-march=native"], ["-O3"]):  # native: AVX2 lanes, ~3x faster here
            proc = subprocess.run([cc, *flags, "-shared", "-fPIC", "-o", so, src], capture_output=True, text=True,
                                  timeout=60)
            if proc.returncode == 0:
                break
        if proc.returncode != 0:
            return None, f"{cc} failed: {proc.stderr.strip()[:200]}"
        lib = ctypes.CDLL(so)
    except (OSError, subprocess.SubprocessError) as e:
        return None, f"compiling the shim failed ({e})"
    finally:
        shutil.rmtree(d, ignore_errors=True)
    fn = lib.fc_fcds_at
    fn.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int64, ctypes.c_int64, ctypes.c_void_p]
    fn.restype = None
    return lib, ""


def native() -> bool:
    """Whether the C loop is in use (compiled on the first call; thread-safe;
    ``FLATCAKE_NATIVE_FCDS=0`` disables it)."""
    if "lib" not in _state:
        with _lock:
            if "lib" not in _state:
                lib, why = (None, "disabled by FLATCAKE_NATIVE_FCDS=0") \
                    if os.environ.get("FLATCAKE_NATIVE_FCDS", "1") == "0" else _compile()
                if lib is None:
                    log.info("FlatCake device checksums on the write side: numpy (%s)", why)
                _state["lib"] = lib
    return _state["lib"] is not None


def warm_up() -> None:
    """Compile the C loop in a background (non-daemon) thread, so the first round does not wait."""
    if "lib" not in _state:
        threading.Thread(target=native, name="fc-fcds-init", daemon=False).start()


def fcds_host_at(host: np.ndarray, starts, chunk_bytes: int) -> np.ndarray:
    """Device checksums of the ``chunk_bytes`` bytes at each byte offset ``starts`` of ``host``
    (contiguous uint8), computed on the host: uint64 ``[len(starts)]``, bit-identical to
    :func:`~flatcake.kernels.device_checksum.fcds_triton`.

    Raises:
        ValueError: an offset outside ``host`` (checked before any byte is read).
    """
    st = np.ascontiguousarray(starts, dtype=np.int64).reshape(-1)
    n = st.shape[0]
    out = np.empty(n, dtype=np.uint64)
    if n == 0:
        return out
    if int(st.min()) < 0 or int(st.max()) + chunk_bytes > host.shape[0]:
        raise ValueError(f"chunk offsets outside the {host.shape[0]}-byte buffer")
    if native() and host.flags.c_contiguous:
        _state["lib"].fc_fcds_at(host.ctypes.data, st.ctypes.data, n, chunk_bytes, out.ctypes.data)
        return out
    return fcds_numpy(host, st, chunk_bytes)


def fcds_host_chunks(data: np.ndarray, chunk_bytes: int) -> np.ndarray:
    """Device checksums of every ``chunk_bytes`` chunk of ``data`` (uint8 ``[m * chunk_bytes]``,
    a round's layer-major data): uint64 ``[m]`` — what the write path stores in the record."""
    m = data.shape[0] // chunk_bytes
    return fcds_host_at(data, np.arange(m, dtype=np.int64) * chunk_bytes, chunk_bytes)


__all__ = ["fcds_host_at", "fcds_host_chunks", "native", "warm_up"]
