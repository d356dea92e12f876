"""Scatter contiguous staging chunks into non-contiguous KV page slots (paper §3.3, FC-CIO).

``scatter_chunks(staging, src_offsets, layout, page_ids, layer_ids, impl)`` copies chunk ``i``
(``layout.geometry.chunk_bytes`` bytes at ``staging[src_offsets[i]:]``) into page
``page_ids[i]``, layer ``layer_ids[i]`` of ``layout`` (see :mod:`flatcake.common.layout`).

Implementations:

* ``reference`` — unfold-gather into ``[n, chunk_bytes]`` rows + indexed copy; byte-wise and
  slow; the yardstick every other path must match bit for bit.
* ``torch`` — always available: one strided copy per (run of consecutive staging chunks,
  plane), in the widest word the offsets allow, without an intermediate buffer; on CPU through
  numpy views of the same memory (see :func:`_torch_scatter`); the CPU path.
* ``triton`` — one kernel launch per group of planes with equal strides. Every destination
  plane view of a :class:`~flatcake.common.layout.KvPageLayout` is ``[num_pages, page_size, row_bytes]``
  with unit stride in the row, so a chunk's plane is ``page_size`` rows of ``row_bytes`` at
  ``base(layer, plane) + page * page_stride + token * token_stride``. The host computes one
  destination word offset per (chunk, plane) from the views' base pointers and strides (so MHA
  and MLA, ``layer_first``/``page_first``/``page_first_direct`` and per-layer device tensors
  from :meth:`KvPageLayout.from_device_kv` all go through the same kernel); the kernel copies
  ``BLOCK`` words per program, in the widest word (8/4/2/1 bytes) that every offset, stride
  and row length allows. Runs on CUDA tensors, or on CPU under ``TRITON_INTERPRET=1``
  (correctness only: the interpreter is ~1000× slower than ``index_copy_``).
* ``auto`` — ``triton`` for CUDA staging, ``torch`` on CPU.
"""

from __future__ import annotations

import math
import os
from typing import Optional

import numpy as np
import torch

_WORDS = ((8, torch.int64), (4, torch.int32), (2, torch.int16), (1, torch.uint8))

try:  # Triton is optional: CPU-only installs may lack it
    import triton
    import triton.language as tl

    HAVE_TRITON = True  #: triton imports (a CPU run still needs TRITON_INTERPRET=1)
except Exception:  # noqa: BLE001
    HAVE_TRITON = False


if HAVE_TRITON:

    @triton.jit
    def _scatter_rows_kernel(
        src_ptr,  # word pointer: staging buffer
        dst_ptr,  # word pointer: base of the destination (all offsets are relative to it)
        src_off_ptr,  # int64 [n]: word offset of each (chunk, plane) in staging
        dst_off_ptr,  # int64 [n]: word offset of each (chunk, plane) page slot from dst_ptr
        plane_words,  # words per (chunk, plane) = page_size * row_words
        row_words,  # words per token row
        tok_stride,  # words between consecutive token rows of a page slot
        BLOCK: tl.constexpr,
    ):
        i = tl.program_id(0)
        b = tl.program_id(1)
        s0 = tl.load(src_off_ptr + i)
        d0 = tl.load(dst_off_ptr + i)
        e = b * BLOCK + tl.arange(0, BLOCK)
        mask = e < plane_words
        tok = e // row_words
        col = e - tok * row_words
        v = tl.load(src_ptr + s0 + e, mask=mask)
        tl.store(dst_ptr + d0 + tok * tok_stride + col, v, mask=mask)


def triton_available(device: torch.device) -> bool:
    """Whether the Triton kernel can run for tensors on ``device``: CUDA, or CPU with
    ``TRITON_INTERPRET=1`` set before Triton was imported."""
    if not HAVE_TRITON:
        return False
    if device.type == "cuda":
        return True
    return os.environ.get("TRITON_INTERPRET", "") == "1"


def _reference_scatter(staging, src_offsets, layout, page_ids, layer_ids) -> None:
    """The reference: gather chunks into ``[n, chunk_bytes]`` rows (a copy), then indexed copy
    per layer through :meth:`KvPageLayout.scatter_chunks`. Byte-wise, simple and slow."""
    cb = layout.geometry.chunk_bytes
    n = int(src_offsets.numel())
    if n == 0:
        return
    g = cb
    for o in src_offsets.tolist():
        g = math.gcd(g, int(o))
    rows = staging[: staging.numel()].unfold(0, cb, g)[src_offsets // g]  # [n, cb] copy
    for layer in torch.unique(layer_ids).tolist():
        sel = (layer_ids == layer).nonzero().flatten()
        layout.scatter_chunks(rows[sel], page_ids[sel], layer)


def _word_plane(view: torch.Tensor, w: int, dt: torch.dtype) -> Optional[torch.Tensor]:
    """``view`` (uint8 ``[pages, P, row]``, unit row stride) reinterpreted as ``w``-byte words,
    or ``None`` when its strides/offset do not allow it."""
    if w == 1:
        return view
    try:
        return view.view(dt)
    except RuntimeError:
        return None


def _torch_scatter(staging, src_offsets, layout, page_ids, layer_ids) -> None:
    """Fast path: one strided copy per (run of consecutive staging chunks, plane), in the widest
    word (8/4/2/1 bytes) the offsets allow; a slice copy when the destination pages are
    consecutive too, else an indexed copy. No intermediate buffer.

    On CPU the copies go through numpy views of the same memory (single-threaded, GIL released):
    torch's two-thread OpenMP copy of these strided rows fell to 0.26 GB/s here whenever another
    process held one of the two cores, against 5.8-12.6 GB/s single-threaded. On CUDA, torch
    copies (strided ``copy_`` / ``index_copy_`` in the widest word the offsets allow)."""
    n = int(src_offsets.numel())
    if n == 0:
        return
    g = layout.geometry
    cb, P = g.chunk_bytes, g.page_size
    offs = src_offsets.cpu().numpy().astype(np.int64, copy=False)
    pages = page_ids.cpu().numpy().astype(np.int64, copy=False)
    layers = layer_ids.cpu().numpy().astype(np.int64, copy=False)
    # group by layer (stable: positions keep their order inside a layer), then cut maximal runs
    # whose staging offsets advance by one chunk; array arithmetic, no per-chunk Python work
    if n > 1 and (layers[1:] < layers[:-1]).any():
        order = np.argsort(layers, kind="stable")
        offs, pages, layers = offs[order], pages[order], layers[order]
    cut = np.flatnonzero((layers[1:] != layers[:-1]) | (offs[1:] != offs[:-1] + cb)) + 1
    starts = np.concatenate(([0], cut)).tolist()
    ends = np.concatenate((cut, [n])).tolist()
    on_cpu = staging.device.type == "cpu"
    sbase = staging.data_ptr()
    snp = staging.numpy() if on_cpu else None
    for a, b in zip(starts, ends):
        k = b - a
        layer = int(layers[a])
        p = pages[a:b]
        p0 = int(p[0])
        consecutive = k == 1 or (int(p[-1]) - p0 == k - 1 and bool((np.diff(p) == 1).all()))
        o0 = int(offs[a])
        for view, rb, po in zip(layout.layer_planes(layer), g.plane_row_bytes, g.plane_offsets()):
            s0 = o0 + po
            if on_cpu:
                _numpy_copy(snp, view.numpy(), s0, k, P, rb, cb, p, consecutive)
                continue
            w, dt = word_width([s0, rb, cb, sbase, view.data_ptr(), view.stride(0), view.stride(1)])
            dst = _word_plane(view, w, dt)
            try:
                sw = staging if w == 1 else staging[: staging.numel() - staging.numel() % w].view(dt)
            except RuntimeError:  # staging storage offset not word aligned
                sw = None
            if dst is None or sw is None:
                w, dst, sw = 1, view, staging
            src = sw.as_strided((k, P, rb // w), (cb // w, rb // w, 1), sw.storage_offset() + s0 // w)
            if consecutive:
                dst[p0 : p0 + k].copy_(src)
            else:
                dst.index_copy_(0, torch.from_numpy(np.ascontiguousarray(p)).to(dst.device), src)


def _numpy_copy(snp, dnp, s0: int, k: int, P: int, rb: int, cb: int, p, consecutive: bool) -> None:
    """Copy ``k`` chunk planes (``P`` rows of ``rb`` bytes, ``cb`` apart from byte ``s0`` of the
    1-D uint8 array ``snp``) into pages ``p`` (int64 ``[k]`` array or list) of the uint8
    ``[pages, P, rb]`` view ``dnp``.

    Rows move as opaque ``rb``-byte items (numpy ``void`` dtype), i.e. one ``memcpy`` per row
    whatever the alignment (6.5-8.3 GB/s on this machine against 4.0-7.2 GB/s for an 8-byte-word
    strided copy, same runs; docs/performance.md)."""
    row = np.dtype((np.void, rb))
    src = np.ndarray(shape=(k, P), dtype=row, buffer=snp, offset=s0, strides=(cb, rb))
    dst = dnp.view(row)[..., 0]  # [pages, P]: the row axis has unit stride and rb bytes
    if consecutive:
        p0 = int(p[0])
        dst[p0 : p0 + k] = src
    else:
        dst[np.asarray(p, dtype=np.int64)] = src


def _word_view(t: torch.Tensor, w: int, dt: torch.dtype, numel_bytes: Optional[int] = None) -> torch.Tensor:
    """A 1-D ``dt`` tensor starting at ``t.data_ptr()`` (``numel_bytes`` long, default ``w``)."""
    n = numel_bytes if numel_bytes is not None else w
    n -= n % w
    return t.as_strided((max(n, w),), (1,)).view(dt)


def _triton_scatter(staging, src_offsets, layout, page_ids, layer_ids, block: int = 4096) -> None:
    """Triton scatter; see the module docstring. Tensors as in :func:`scatter_chunks`."""
    if not triton_available(staging.device):
        raise RuntimeError(
            "Triton scatter needs a CUDA tensor, or TRITON_INTERPRET=1 set before importing triton"
        )
    n = int(src_offsets.numel())
    if n == 0:
        return
    g = layout.geometry
    P = g.page_size
    pages = page_ids.cpu().numpy().astype(np.int64, copy=False)
    layers = layer_ids.cpu().numpy().astype(np.int64, copy=False)
    srcs = src_offsets.cpu().numpy().astype(np.int64, copy=False)
    plane_offs = g.plane_offsets()
    uniq, inv = np.unique(layers, return_inverse=True)
    sel = [np.flatnonzero(inv == u) for u in range(uniq.shape[0])] if uniq.shape[0] > 1 else [None]
    # group (chunk, plane) pairs by (row_bytes, token stride): one launch per group; per group,
    # byte offsets as int64 arrays (a loop over planes x distinct layers, not over chunks)
    groups: dict[tuple[int, int], list] = {}
    for j, (rb, po) in enumerate(zip(g.plane_row_bytes, plane_offs)):
        for u, layer in enumerate(uniq.tolist()):
            view = layout.layer_planes(layer)[j]  # uint8 [num_pages, P, rb]
            if view.stride(2) != 1:
                raise ValueError(f"plane {j} of layer {layer} has a non-unit row stride")
            idx = sel[u]
            s_b = (srcs if idx is None else srcs[idx]) + po
            d_b = (pages if idx is None else pages[idx]) * view.stride(0) + view.data_ptr()
            groups.setdefault((rb, view.stride(1)), []).append((s_b, d_b, view))
    base_src = staging.data_ptr()
    for (rb, tok_stride), items in groups.items():
        dst_base_t = items[0][2]
        dst_base = dst_base_t.data_ptr()
        s_all = np.concatenate([s for s, _, _ in items])
        d_all = np.concatenate([d for _, d, _ in items]) - dst_base
        w, dt = word_width([rb, tok_stride, base_src, dst_base], (s_all, d_all))
        src_w = _word_view(staging, w, dt, staging.numel())
        dst_w = _word_view(dst_base_t, w, dt)
        dev = staging.device
        s_off = torch.from_numpy(s_all // w).to(dev)
        d_off = torch.from_numpy(d_all // w).to(dev)
        plane_words = P * rb // w
        blk = min(block, triton.next_power_of_2(plane_words))
        grid = (int(s_all.shape[0]), triton.cdiv(plane_words, blk))
        _scatter_rows_kernel[grid](src_w, dst_w, s_off, d_off, plane_words, rb // w, tok_stride // w, BLOCK=blk)


def word_width(values, arrays=()) -> tuple[int, torch.dtype]:
    """Widest copy word dividing every byte offset, stride and length given.

    Args:
        values: ints (bytes: offsets, strides, row lengths, data pointers).
        arrays: int64 numpy arrays of byte offsets, every entry of which must be divisible too.

    Returns:
        ``(bytes, dtype)``: ``(8, torch.int64)``, ``(4, torch.int32)``, ``(2, torch.int16)`` or
        ``(1, torch.uint8)``.
    """
    for w, dt in _WORDS:
        if all(v % w == 0 for v in values) and all(not (a % w).any() for a in arrays):
            return w, dt
    return 1, torch.uint8  # pragma: no cover - w=1 always divides


def resolve_impl(impl: str, device: torch.device) -> str:
    """Map ``"auto"`` to ``"triton"`` on CUDA and ``"torch"`` elsewhere; pass others through.

    Raises:
        ValueError: unknown ``impl``.
    """
    if impl == "auto":
        return "triton" if (device.type == "cuda" and HAVE_TRITON) else "torch"
    if impl not in ("torch", "triton", "reference"):
        raise ValueError(f"unknown scatter impl {impl!r}")
    return impl


def scatter_chunks(staging, src_offsets, layout, page_ids, layer_ids, impl: str = "torch") -> None:
    """Scatter staged chunks into their page slots.

    Args:
        staging: uint8 1-D tensor holding the chunks (host or device, same device as ``layout``).
        src_offsets: int64 ``[n]`` byte offsets of each chunk in ``staging`` (CPU tensor).
        layout: :class:`flatcake.common.layout.KvPageLayout` of the destination buffer.
        page_ids: int64 ``[n]`` destination page index per chunk (CPU tensor).
        layer_ids: int64 ``[n]`` destination layer per chunk (CPU tensor).
        impl: ``"torch"`` (strided word copies), ``"triton"``, ``"auto"`` or ``"reference"``
            (gather + indexed copy, byte-wise; the bit-exact yardstick for the other two).

    Raises:
        ValueError: unknown ``impl``.
        RuntimeError: ``impl="triton"`` where Triton cannot run (CPU without ``TRITON_INTERPRET=1``).
    """
    impl = resolve_impl(impl, staging.device)
    if impl == "torch":
        return _torch_scatter(staging, src_offsets, layout, page_ids, layer_ids)
    if impl == "reference":
        return _reference_scatter(staging, src_offsets, layout, page_ids, layer_ids)
    return _triton_scatter(staging, src_offsets, layout, page_ids, layer_ids)
