"""Many xxh3-64 chunk checksums in one call that does not hold the GIL (paper §3.3 integrity).

FlatCake's on-disk format keeps one xxh3-64 per (page, layer) chunk (``docs/durability.md``):
a round of 128 pages of 16 layers has 2,048 of them. Hashing them from Python is one
``xxhash.xxh3_64_intdigest`` call per chunk, and the loop holds the GIL between calls; measured
on the development machine, a 1 ms ticker thread overshot by 15-17 ms at p99 while 64 MiB of
32 KiB or 2 KiB chunks were hashed that way, against ~6 ms while the same bytes were hashed in
one call (the 2-core machine's scheduling floor at the time; docs/performance.md).

Here the loop runs in C (``csrc/xxh3.c``, built into FlatCake's extension at install and bound
through :mod:`ctypes`, :mod:`flatcake.native.loops`): it calls ``XXH3_64bits`` from the
*installed* python-xxhash extension (the same library, so the same bits as
``xxh3_64_intdigest(seed=0)``), for every chunk, in one ctypes call that releases the GIL.
Where the extension was not built, or the xxhash extension does not export ``XXH3_64bits``,
it falls back to the Python loop (same results; logged once at WARNING and reported as the
``xxh3`` loop's state).
"""

from __future__ import annotations

import ctypes
import functools

import numpy as np
import xxhash

from flatcake.native.loops import NativeLoop, chunk_starts, entry


def xxh3_address():
    """``(address, "")`` of python-xxhash's exported ``XXH3_64bits`` (the function the C loops
    call, so their hashes are python-xxhash's bits), or ``(None, why)``."""
    try:
        import xxhash._xxhash as ext

        return ctypes.cast(ctypes.CDLL(ext.__file__).XXH3_64bits, ctypes.c_void_p).value, ""
    except (ImportError, OSError, AttributeError) as e:
        return None, f"xxhash extension does not export XXH3_64bits ({e})"


def _build():
    """The bound C loop (``fc_xxh3_at`` with the address of python-xxhash's ``XXH3_64bits``;
    ``.copy``: ``fc_xxh3_copy``), or ``(None, why)``."""
    addr, why = xxh3_address()
    if addr is None:
        return None, why
    at = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int64, ctypes.c_int64, ctypes.c_void_p]
    fn, why = entry("fc_xxh3_at", at, None)
    cp, why2 = entry("fc_xxh3_copy", at[:5] + [ctypes.c_void_p] * 4, None)
    if fn is None or cp is None:
        return None, why or why2
    bound = functools.partial(fn, addr)
    bound.copy = functools.partial(cp, addr)
    return bound, ""


#: the C loop (``FLATCAKE_NATIVE_XXH3=0`` turns it off)
LOOP = NativeLoop(_build, "FLATCAKE_NATIVE_XXH3", "FlatCake checksums: per-chunk Python loop", name="xxh3")


def native() -> bool:
    """Whether the GIL-free C loop is in use (bound on the first call; thread-safe)."""
    return LOOP.fn() is not None


def warm_up() -> None:
    """Bind the native loop, and every other C loop, from the extension (called at start-up, so
    each loop's state is logged then; :func:`flatcake.native.loops.warm_up_all`)."""
    LOOP.warm_up()


def xxh3_at(host: np.ndarray, starts, chunk_bytes: int) -> np.ndarray:
    """xxh3-64 (seed 0, ``xxhash.xxh3_64_intdigest``) of the ``chunk_bytes`` bytes at each
    offset of ``host``.

    Args:
        host: contiguous uint8 numpy array (e.g. a staging buffer or a round's write buffer).
        starts: byte offsets (int64 array or sequence) with ``start + chunk_bytes <= host.size``.
        chunk_bytes: bytes per chunk (> 0).

    Returns:
        uint64 ``[len(starts)]``.

    Raises:
        ValueError: ``host`` not 1-D uint8, ``chunk_bytes`` not positive, or an offset outside
        ``host`` (checked before any byte is read).
    """
    st = chunk_starts(host, starts, chunk_bytes)
    n = st.shape[0]
    out = np.empty(n, dtype=np.uint64)
    fn = LOOP.fn() if n else None
    if fn is not None and host.flags.c_contiguous:
        fn(host.ctypes.data, st.ctypes.data, n, chunk_bytes, out.ctypes.data)
        return out
    mv = memoryview(host)
    h = xxhash.xxh3_64_intdigest
    for i, s in enumerate(st.tolist()):
        out[i] = h(mv[s: s + chunk_bytes])
    return out


def xxh3_copy(host: np.ndarray, starts, chunk_bytes: int, want: np.ndarray, dst: np.ndarray, dst_at) -> np.ndarray:
    """Check chunks of ``host`` against expected xxh3-64s and copy each matching one into ``dst``.

    Each chunk is hashed and, where it matches, copied right away while it is still in cache
    (one GIL-free C call for all of them; with no C loop, :func:`xxh3_at` and then one numpy
    copy per matching chunk — same result). Used by remote reads, which verify every chunk they
    pull against its record's checksum (paper §3.1; docs/cluster.md).

    Args:
        host: contiguous uint8 ``[nbytes]``; starts: int64 ``[k]`` chunk offsets in ``host``.
        chunk_bytes: bytes per chunk (> 0).
        want: uint64 ``[k]`` expected xxh3-64 (seed 0) of each chunk.
        dst: contiguous uint8 ``[dst_bytes]``; dst_at: int64 ``[k]`` where each chunk goes.

    Returns:
        int8 ``[k]``: 1 copied, -1 mismatch (``dst`` untouched there).

    Raises:
        ValueError: ``host`` or ``dst`` not 1-D uint8, ``dst`` read-only, ``chunk_bytes`` not
        positive, an offset outside ``host`` or ``dst``, or ``want`` / ``dst_at`` not ``[k]``
        (checked before any byte is read or written).
    """
    st = chunk_starts(host, starts, chunk_bytes)
    at = chunk_starts(dst, dst_at, chunk_bytes)
    if not dst.flags.writeable:
        raise ValueError("xxh3_copy: the destination is read-only")
    want = np.ascontiguousarray(want, dtype=np.uint64).reshape(-1)
    if at.shape != st.shape or want.shape != st.shape:
        raise ValueError(f"{st.shape[0]} chunks but {at.shape[0]} destinations and {want.shape[0]} checksums")
    state = np.empty(st.shape[0], dtype=np.int8)
    fn = LOOP.fn() if st.shape[0] else None
    if fn is not None and host.flags.c_contiguous and dst.flags.c_contiguous:
        fn.copy(host.ctypes.data, st.ctypes.data, st.shape[0], chunk_bytes, want.ctypes.data, dst.ctypes.data,
                at.ctypes.data, state.ctypes.data)
        return state
    ok = xxh3_at(host, st, chunk_bytes) == want
    state[:] = np.where(ok, 1, -1)
    for s, d in zip(st[ok].tolist(), at[ok].tolist()):
        dst[d: d + chunk_bytes] = host[s: s + chunk_bytes]
    return state


__all__ = ["native", "warm_up", "xxh3_at", "xxh3_copy"]
