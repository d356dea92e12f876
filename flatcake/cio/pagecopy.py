"""Vectorized page copies and chunk checksums for the write and DRAM paths (paper §3.3).

The write path gathers a round's pages layer by layer into a layer-major buffer, and the DRAM
read path scatters slot rows back into the host pool. Both used to copy page by page (one
``Tensor.copy_`` per (page, plane, layer): 4,096 Python-level calls for a round of 128 pages
of 16 layers), which at 1-token pages cost more CPU than the I/O and held the GIL for most of
it. Here every copy is **one numpy operation per (layer, plane)**: token rows move as opaque
``row_bytes``-byte items (numpy ``void`` dtype, one ``memcpy`` per row whatever the alignment,
as :func:`flatcake.kernels.scatter._numpy_copy` does for restores), and numpy releases the GIL
for the whole copy. CUDA layouts use one ``index_select`` / ``index_copy_`` per (layer, plane).

Checksums stay one xxh3-64 per (page, layer) chunk: that is the on-disk format
(``docs/durability.md``) and what lets a restore verify any subset of a round's pages without
reading the rest. :func:`chunk_checksums` / :func:`checksums_at` compute all of a buffer's in
one call that releases the GIL (:mod:`flatcake.cio.xxh3_bulk`).
"""

from __future__ import annotations

from typing import Sequence

import numpy as np
import torch

from flatcake.cio.xxh3_bulk import xxh3_at


def _ids(page_ids, num_pages: int) -> np.ndarray:
    """int64 numpy ``[n]`` page ids from a tensor, array or sequence; IndexError for an id
    outside ``[0, num_pages)`` (numpy would wrap a negative one)."""
    if isinstance(page_ids, torch.Tensor):
        ids = page_ids.detach().to("cpu", torch.int64).numpy().reshape(-1)
    else:
        ids = np.asarray(page_ids, dtype=np.int64).reshape(-1)
    if ids.shape[0] and (int(ids.min()) < 0 or int(ids.max()) >= num_pages):
        bad = int(ids[np.argmax((ids < 0) | (ids >= num_pages))])
        raise IndexError(f"page {bad} outside the layout ({num_pages} pages)")
    return ids


def _rows(a: np.ndarray, n: int, page_size: int, rb: int) -> np.ndarray:
    """``a`` (uint8, ``[n, page_size * rb]`` or ``[n, page_size, rb]`` with unit stride along
    each token row) as a ``[n, page_size]`` array of ``rb``-byte ``void`` items (a view)."""
    s0 = a.strides[0]
    s1 = a.strides[1] if a.ndim == 3 else rb
    v = np.lib.stride_tricks.as_strided(a, (n, page_size, rb), (s0, s1, 1))
    return v.view(np.dtype((np.void, rb)))[..., 0]


def _consecutive(ids: np.ndarray) -> bool:
    """True when ``ids`` are ``p0, p0+1, ...`` (a slice copy instead of fancy indexing)."""
    n = ids.shape[0]
    return n > 0 and int(ids[-1]) - int(ids[0]) == n - 1 and bool((np.diff(ids) == 1).all())


def gather_pages(layout, page_ids, layer: int, out: torch.Tensor) -> None:
    """Copy the ``layer`` chunks of pages ``page_ids`` of ``layout`` into ``out``.

    Args:
        layout: a :class:`~flatcake.common.layout.KvPageLayout` (host pool, flat pages or device KV).
        page_ids: int64 ``[n]`` page indices in ``layout`` (tensor, array or list).
        layer: layer index.
        out: uint8 ``[n, chunk_bytes]`` on ``layout.device``, each row contiguous (rows may be
            strided, e.g. ``tmp[:, layer]`` of a ``[n, layers, chunk_bytes]`` buffer).

    One numpy copy per plane on CPU (GIL released), one ``index_select`` per plane on CUDA.
    Bit-exact with :meth:`KvPageLayout.gather_chunks`.

    Raises:
        IndexError: a page id outside the layout (a caller bug).
    """
    g = layout.geometry
    ids = _ids(page_ids, layout.num_pages)
    n = ids.shape[0]
    if n == 0:
        return
    P = g.page_size
    on_cpu = out.device.type == "cpu"
    on = out.numpy() if on_cpu else None
    for t, off, rb in zip(layout.layer_planes(layer), g.plane_offsets(), g.plane_row_bytes):
        if not on_cpu:
            idx = torch.from_numpy(ids).to(t.device)
            out[:, off: off + P * rb].view(n, P, rb).copy_(t.index_select(0, idx))
            continue
        src = _rows(t.numpy(), t.shape[0], P, rb)
        dst = _rows(on[:, off: off + P * rb], n, P, rb)
        if _consecutive(ids):
            dst[...] = src[int(ids[0]): int(ids[0]) + n]
        else:
            dst[...] = src[ids]


def _plane_stack(layout, plane: int, l0: int, l1: int):
    """uint8 numpy ``[num_pages, l1 - l0, page_size, row_bytes]`` view of plane ``plane`` over
    layers ``l0..l1-1`` of a CPU layout, or ``None`` when those layers' views are not equally
    spaced slices of one buffer (then the caller copies layer by layer)."""
    ts = [layout.layer_planes(layer)[plane] for layer in range(l0, l1)]
    a = ts[0]
    step = ts[1].data_ptr() - a.data_ptr() if len(ts) > 1 else 0
    for k, t in enumerate(ts):
        if t.data_ptr() != a.data_ptr() + k * step or t.stride() != a.stride() or t.shape != a.shape:
            return None
    base = a.numpy()
    return np.lib.stride_tricks.as_strided(base, (base.shape[0], l1 - l0, base.shape[1], base.shape[2]),
                                           (base.strides[0], step, base.strides[1], base.strides[2]))


def gather_layers(layout, page_ids, l0: int, l1: int, out: torch.Tensor) -> None:
    """Copy layers ``l0..l1-1`` of pages ``page_ids`` into ``out`` (uint8 ``[l1 - l0, n,
    chunk_bytes]``, layer-major, each row contiguous): one numpy copy per plane for all the
    layers where the layout's layers are equally spaced in one buffer (every SGLang host
    layout), so a round takes a few GIL-free steps instead of one per (layer, plane); else, and
    on CUDA, :func:`gather_pages` per layer. Bit-exact with :func:`gather_pages`.

    Raises:
        IndexError: a page id outside the layout (a caller bug).
    """
    g = layout.geometry
    ids = _ids(page_ids, layout.num_pages)
    n = ids.shape[0]
    if n == 0 or l1 <= l0:
        return
    stacks = [_plane_stack(layout, j, l0, l1) for j in range(len(g.plane_row_bytes))] \
        if out.device.type == "cpu" else [None]
    if any(st is None for st in stacks):
        for k, layer in enumerate(range(l0, l1)):
            gather_pages(layout, ids, layer, out[k])
        return
    on, P, lr = out.numpy(), g.page_size, l1 - l0
    for st, off, rb in zip(stacks, g.plane_offsets(), g.plane_row_bytes):
        item = np.dtype((np.void, rb))
        src = st.view(item)[..., 0]  # [pages, lr, P]
        d = on[:, :, off: off + P * rb]
        dst = np.lib.stride_tricks.as_strided(d, (lr, n, P, rb), (d.strides[0], d.strides[1], rb, 1))
        dst = dst.view(item)[..., 0].transpose(1, 0, 2)  # [n, lr, P]
        if _consecutive(ids):
            dst[...] = src[int(ids[0]): int(ids[0]) + n]
        else:
            dst[...] = src[ids]


def scatter_pages(layout, src: torch.Tensor, page_ids, layer: int) -> None:
    """Inverse of :func:`gather_pages`: chunk rows ``src`` (uint8 ``[n, chunk_bytes]``, each row
    contiguous, on ``layout.device``) into the ``layer`` slots of pages ``page_ids``.

    Raises:
        IndexError: a page id outside the layout (a caller bug).
    """
    g = layout.geometry
    ids = _ids(page_ids, layout.num_pages)
    n = ids.shape[0]
    if n == 0:
        return
    P = g.page_size
    on_cpu = src.device.type == "cpu"
    sn = src.numpy() if on_cpu else None
    for t, off, rb in zip(layout.layer_planes(layer), g.plane_offsets(), g.plane_row_bytes):
        if not on_cpu:
            rows = src[:, off: off + P * rb].reshape(n, P, rb)
            t.index_copy_(0, torch.from_numpy(ids).to(t.device), rows)
            continue
        dst = _rows(t.numpy(), t.shape[0], P, rb)
        s = _rows(sn[:, off: off + P * rb], n, P, rb)
        if _consecutive(ids):
            dst[int(ids[0]): int(ids[0]) + n] = s
        else:
            dst[ids] = s


def chunk_checksums(data: np.ndarray, chunk_bytes: int) -> np.ndarray:
    """xxh3-64 (``xxhash.xxh3_64_intdigest``, seed 0) of every ``chunk_bytes`` chunk of ``data``,
    in one GIL-free call where the native loop is available (:mod:`flatcake.cio.xxh3_bulk`).

    Args:
        data: contiguous uint8 ``[m * chunk_bytes]`` (e.g. a round's layer-major data).
        chunk_bytes: bytes per chunk (> 0).

    Returns:
        uint64 ``[m]``, chunk ``i`` = ``data[i*chunk_bytes:(i+1)*chunk_bytes]``.
    """
    m = data.shape[0] // chunk_bytes
    return xxh3_at(data, np.arange(m, dtype=np.int64) * chunk_bytes, chunk_bytes)


def checksums_at(host: np.ndarray, starts: Sequence[int], chunk_bytes: int) -> np.ndarray:
    """uint64 ``[len(starts)]`` xxh3-64 of the ``chunk_bytes`` bytes at each offset of ``host``
    (uint8, contiguous; offsets in bytes); see :func:`chunk_checksums`."""
    return xxh3_at(host, starts, chunk_bytes)


__all__ = ["checksums_at", "chunk_checksums", "gather_layers", "gather_pages", "scatter_pages"]
