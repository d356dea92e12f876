"""FlatCake's device checksum ("FCDS"): a per-chunk 64-bit checksum a GPU computes at memory
speed, so a restore into HBM verifies chunks where they landed (paper §3.3 integrity).

xxh3-64 (the record's host checksum) is impractical on a GPU; this one is two 32-bit lanes over
the chunk's little-endian 32-bit words ``w_0 .. w_{W-1}`` (``W = ceil(chunk_bytes / 4)``, the
last word zero-padded), all arithmetic modulo 2**32::

    A = Σ_i  w_i * (2i + 1)                               position-weighted sum (odd weights)
    B = Σ_i  f(w_i XOR (i * 0x9E3779B9))                  f(x): x *= 0x85EBCA6B; x ^= x >> 15;
                                                                x *= 0xC2B2AE35
    fcds(chunk) = (B << 32) | A                           uint64

What it detects: any change of a single 32-bit word (the odd weight makes lane A change, always);
words moved or swapped inside a chunk (position-weighted in both lanes); a torn chunk (part old
bytes, part new), a stale chunk left by an earlier round at the same offset, another tenant's or
another page's chunk — i.e. *different* bytes in general — except with a chance of about 2**-64
for unrelated contents (both lanes must collide; lane B is non-linear, so the structured error
patterns that cancel in lane A — e.g. two flips of bit 31 — do not cancel there). What it does
not: it is not cryptographic (a deliberate forgery is easy), the two lanes are not proven
independent, so for structured corruption count on about 2**-32, not 2**-64; a chunk whose bytes
are identical to the expected ones (e.g. two all-zero pages swapped) passes, as it should. The
record holding the expected values is itself sealed with xxh3-64, and the round's identity
(scope, sequence number, nonce) is checked before any chunk is served.

Implementations, bit-identical (tests/kernels/test_device_checksum.py):

* :func:`fcds_numpy` — uint32 numpy ufuncs over a whole buffer of chunks (GIL released inside
  each ufunc); the write side, from the host bytes of a round.
* :func:`fcds_torch` — int64 torch ops with 32-bit masks; any device; the reference and the
  fallback where Triton is missing.
* :func:`fcds_triton` — one Triton program per chunk, ``BLOCK`` words per step, two uint32
  accumulators; CUDA tensors, or CPU under ``TRITON_INTERPRET=1`` (correctness only).
* :func:`fcds_at` — dispatch: Triton where it can run, else torch.
"""

from __future__ import annotations

import os
from typing import Optional

import numpy as np
import torch

K_POS = 0x9E3779B9  #: position key of lane B (golden-ratio constant)
K_M1 = 0x85EBCA6B  #: first multiplier of lane B's mixer (murmur3 fmix32)
K_M2 = 0xC2B2AE35  #: second multiplier of lane B's mixer
_M32 = 0xFFFFFFFF

try:  # Triton is optional: CPU-only installs may lack it
    import triton
    import triton.language as tl

    HAVE_TRITON = True
except Exception:  # noqa: BLE001
    HAVE_TRITON = False


if HAVE_TRITON:

    @triton.jit
    def _fcds_kernel(src_ptr, start_ptr, out_ptr, n_words, chunk_bytes, BLOCK: tl.constexpr,
                     WORDS: tl.constexpr):
        """Program ``c``: the checksum of the chunk at ``start_ptr[c]`` (a word offset when
        ``WORDS``, an int32 pointer; else a byte offset into a uint8 pointer)."""
        c = tl.program_id(0)
        s0 = tl.load(start_ptr + c)
        acc_a = tl.zeros([BLOCK], dtype=tl.uint32)
        acc_b = tl.zeros([BLOCK], dtype=tl.uint32)
        for w0 in range(0, n_words, BLOCK):
            e = w0 + tl.arange(0, BLOCK)
            mask = e < n_words
            if WORDS:
                w = tl.load(src_ptr + s0 + e, mask=mask, other=0).to(tl.uint32, bitcast=True)
            else:
                b = 4 * e
                w = tl.zeros([BLOCK], dtype=tl.uint32)
                for k in tl.static_range(4):
                    v = tl.load(src_ptr + s0 + b + k, mask=mask & (b + k < chunk_bytes), other=0)
                    w = w | (v.to(tl.uint32) << (8 * k))
            i = e.to(tl.uint32)
            acc_a += tl.where(mask, w * (2 * i + 1), 0)
            x = w ^ (i * K_POS)
            x = x * K_M1
            x = x ^ (x >> 15)
            x = x * K_M2
            acc_b += tl.where(mask, x, 0)
        a = tl.sum(acc_a, axis=0).to(tl.uint64)
        bb = tl.sum(acc_b, axis=0).to(tl.uint64)
        tl.store(out_ptr + c, ((bb << 32) | a).to(tl.int64, bitcast=True))


def n_words(chunk_bytes: int) -> int:
    """32-bit words per chunk (the last one zero-padded when ``chunk_bytes % 4``)."""
    return (int(chunk_bytes) + 3) // 4


def _np_words(host: np.ndarray, starts: np.ndarray, chunk_bytes: int) -> np.ndarray:
    """uint32 ``[m, W]`` words of the chunks at ``starts`` (a view when the chunks are back to
    back and 4-byte aligned, else a zero-padded copy)."""
    m, W = starts.shape[0], n_words(chunk_bytes)
    if (chunk_bytes % 4 == 0 and m and int(starts[0]) % 4 == 0 and host.flags.c_contiguous
            and (m == 1 or bool((np.diff(starts) == chunk_bytes).all()))):
        s0 = int(starts[0])
        return host[s0: s0 + m * chunk_bytes].view("<u4").reshape(m, W)
    out = np.zeros((m, W * 4), dtype=np.uint8)
    idx = starts[:, None] + np.arange(chunk_bytes, dtype=np.int64)[None, :]
    out[:, :chunk_bytes] = host[idx]
    return out.view("<u4").reshape(m, W)


_np_keys: dict = {}


def _np_lane_keys(W: int) -> tuple[np.ndarray, np.ndarray]:
    """Per-word constants of width ``W``: lane A's odd weights, lane B's position keys (cached)."""
    got = _np_keys.get(W)
    if got is None:
        i = np.arange(W, dtype=np.uint32)
        got = _np_keys[W] = (2 * i + np.uint32(1), i * np.uint32(K_POS))
        if len(_np_keys) > 16:
            _np_keys.pop(next(iter(_np_keys)))
    return got


def fcds_numpy(host: np.ndarray, starts, chunk_bytes: int) -> np.ndarray:
    """Device checksums of the chunks at byte offsets ``starts`` of ``host``, with numpy.

    Args:
        host: uint8 numpy array (contiguous).
        starts: int64 byte offsets, ``start + chunk_bytes <= host.size``.
        chunk_bytes: bytes per chunk (> 0).

    Returns:
        uint64 ``[len(starts)]``.

    Raises:
        ValueError: an offset outside ``host``.
    """
    st = np.ascontiguousarray(starts, dtype=np.int64).reshape(-1)
    m = st.shape[0]
    if m == 0:
        return np.empty(0, dtype=np.uint64)
    if int(st.min()) < 0 or int(st.max()) + chunk_bytes > host.shape[0]:
        raise ValueError(f"chunk offsets outside the {host.shape[0]}-byte buffer")
    w = _np_words(host, st, chunk_bytes)
    wa, kb = _np_lane_keys(w.shape[1])
    a = np.multiply(w, wa, dtype=np.uint32).sum(axis=1, dtype=np.uint64) & np.uint64(_M32)
    x = np.bitwise_xor(w, kb)
    x *= np.uint32(K_M1)
    x ^= x >> np.uint32(15)
    x *= np.uint32(K_M2)
    b = x.sum(axis=1, dtype=np.uint64) & np.uint64(_M32)
    return (b << np.uint64(32)) | a


def fcds_chunks(data: np.ndarray, chunk_bytes: int) -> np.ndarray:
    """Device checksums of every ``chunk_bytes`` chunk of ``data`` (uint8 ``[m * chunk_bytes]``,
    e.g. a round's layer-major data), uint64 ``[m]`` — the write side."""
    m = data.shape[0] // chunk_bytes
    return fcds_numpy(data, np.arange(m, dtype=np.int64) * chunk_bytes, chunk_bytes)


def _torch_words(buf: torch.Tensor, starts: torch.Tensor, chunk_bytes: int) -> torch.Tensor:
    """int64 ``[m, W]`` words (0 .. 2**32-1) of the chunks at byte offsets ``starts`` of ``buf``."""
    W = n_words(chunk_bytes)
    idx = starts[:, None] + torch.arange(W * 4, device=buf.device, dtype=torch.int64)[None, :]
    valid = idx < (starts[:, None] + chunk_bytes)
    b = torch.where(valid, buf[idx.clamp(max=buf.numel() - 1)].to(torch.int64), 0).view(-1, W, 4)
    return b[..., 0] | (b[..., 1] << 8) | (b[..., 2] << 16) | (b[..., 3] << 24)


def fcds_torch(buf: torch.Tensor, starts: torch.Tensor, chunk_bytes: int) -> torch.Tensor:
    """Device checksums with torch ops (int64 with 32-bit masks; any device; the reference and
    the fallback where Triton is missing — groups of chunks of ~4 MiB, so its int64
    temporaries stay bounded).

    Args:
        buf: uint8 ``[nbytes]`` tensor (e.g. a staging buffer).
        starts: int64 ``[m]`` byte offsets on ``buf``'s device.
        chunk_bytes: bytes per chunk (> 0).

    Returns:
        int64 ``[m]`` on ``buf``'s device: the uint64 checksums' bits.
    """
    m = starts.numel()
    if m == 0:
        return torch.empty(0, dtype=torch.int64, device=buf.device)
    st = starts.to(torch.int64)
    group = max(1, (4 << 20) // max(1, chunk_bytes))  # bounds the int64 temporaries (~32x the bytes)
    i = torch.arange(n_words(chunk_bytes), device=buf.device, dtype=torch.int64)
    out = []
    for g0 in range(0, m, group):
        w = _torch_words(buf, st[g0: g0 + group], chunk_bytes)
        a = ((w * (2 * i + 1)) & _M32).sum(dim=1) & _M32
        x = w ^ ((i * K_POS) & _M32)
        x = (x * K_M1) & _M32
        x = x ^ (x >> 15)
        x = (x * K_M2) & _M32
        b = x.sum(dim=1) & _M32
        out.append((b << 32) | a)
    return out[0] if len(out) == 1 else torch.cat(out)


def triton_available(device: torch.device) -> bool:
    """Whether :func:`fcds_triton` can run on ``device``: CUDA with Triton, or CPU with
    ``TRITON_INTERPRET=1`` set before Triton was imported."""
    if not HAVE_TRITON:
        return False
    return device.type == "cuda" or os.environ.get("TRITON_INTERPRET", "") == "1"


def fcds_triton(buf: torch.Tensor, starts: torch.Tensor, chunk_bytes: int, block: int = 1024,
                word_aligned: Optional[bool] = None) -> torch.Tensor:
    """Device checksums with the Triton kernel: one program per chunk.

    Args:
        buf: uint8 ``[nbytes]`` tensor (CUDA, or CPU under ``TRITON_INTERPRET=1``).
        starts: int64 ``[m]`` byte offsets on ``buf``'s device.
        chunk_bytes: bytes per chunk (> 0).
        block: words per step of a program (power of two).
        word_aligned: whether every start is a multiple of 4 (known to the caller from its host
            copy of the offsets; ``None`` checks ``starts``, a device-to-host sync on CUDA).

    Returns:
        int64 ``[m]`` on ``buf``'s device (the uint64 checksums' bits).

    Raises:
        RuntimeError: Triton cannot run on ``buf``'s device.
    """
    if not triton_available(buf.device):
        raise RuntimeError("the device checksum kernel needs CUDA, or TRITON_INTERPRET=1 set before importing triton")
    m = starts.numel()
    out = torch.empty(m, dtype=torch.int64, device=buf.device)
    if m == 0:
        return out
    W = n_words(chunk_bytes)
    blk = min(block, triton.next_power_of_2(W))
    st = starts.to(torch.int64)
    if word_aligned is None:
        word_aligned = bool((st % 4 == 0).all())
    words = chunk_bytes % 4 == 0 and buf.numel() % 4 == 0 and buf.storage_offset() % 4 == 0 and word_aligned
    if words:
        _fcds_kernel[(m,)](buf.view(torch.int32), st // 4, out, W, chunk_bytes, BLOCK=blk, WORDS=True)
    else:
        _fcds_kernel[(m,)](buf, st, out, W, chunk_bytes, BLOCK=blk, WORDS=False)
    return out


def fcds_at(buf: torch.Tensor, starts: torch.Tensor, chunk_bytes: int, impl: Optional[str] = None,
            word_aligned: Optional[bool] = None) -> torch.Tensor:
    """Device checksums of the chunks at ``starts`` of ``buf``, on ``buf``'s device: ``impl``
    ``"triton"`` / ``"torch"``, or ``None`` for Triton where it can run, else torch. Returns int64
    ``[m]`` (uint64 bits); ``word_aligned`` as in :func:`fcds_triton`. Raises RuntimeError for
    ``"triton"`` where it cannot run."""
    use = impl or ("triton" if triton_available(buf.device) else "torch")
    if use == "triton":
        return fcds_triton(buf, starts, chunk_bytes, word_aligned=word_aligned)
    return fcds_torch(buf, starts, chunk_bytes)


def as_int64(sums: np.ndarray) -> np.ndarray:
    """uint64 checksums reinterpreted as int64 (torch has no uint64 arithmetic)."""
    return np.ascontiguousarray(sums, dtype=np.uint64).view(np.int64)


__all__ = ["HAVE_TRITON", "as_int64", "fcds_at", "fcds_chunks", "fcds_numpy", "fcds_torch", "fcds_triton",
           "n_words", "triton_available"]
