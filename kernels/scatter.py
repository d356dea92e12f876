"""Scatter contiguous staging chunks into non-contiguous KV page slots (paper §3.3, FC-CIO).

``scatter_chunks(staging, src_offsets, layout, page_ids, layer_ids)`` copies chunk ``i``
(``layout.geometry.chunk_bytes`` bytes at ``staging[src_offsets[i]:]``) into page
``page_ids[i]``, layer ``layer_ids[i]`` of ``layout`` (see :mod:`flatcake.layout`).

Implementations: ``torch`` (unfold-gather + indexed copy; always available, the reference)
and ``triton`` (added by FC-CIO; runs on CUDA, or on CPU under ``TRITON_INTERPRET=1``).
"""

from __future__ import annotations

import math

import torch


def _torch_scatter(staging, src_offsets, layout, page_ids, layer_ids) -> None:
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


def scatter_chunks(staging, src_offsets, layout, page_ids, layer_ids, impl: str = "torch") -> None:
    """Scatter staged chunks into their page slots.

    Args:
        staging: uint8 1-D tensor holding the chunks (host or device).
        src_offsets: int64 ``[n]`` byte offsets of each chunk in ``staging``.
        layout: :class:`flatcake.layout.KvPageLayout` of the destination buffer.
        page_ids: int64 ``[n]`` destination page index per chunk.
        layer_ids: int64 ``[n]`` destination layer per chunk.
        impl: ``"torch"`` (reference) or ``"triton"``.

    Raises:
        ValueError: unknown ``impl``.
    """
    if impl == "torch":
        return _torch_scatter(staging, src_offsets, layout, page_ids, layer_ids)
    raise ValueError(f"unknown scatter impl {impl!r}")
