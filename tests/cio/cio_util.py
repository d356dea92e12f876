"""Helpers shared by the FC-CIO tests: pools, layer-major extents on disk, reference fills."""

from __future__ import annotations

import os
from typing import Optional

import numpy as np
import torch
import xxhash

from flatcake.adapter.host_pool import MHAHostPoolDouble, MLAHostPoolDouble
from flatcake.cio import ChunkBatch
from flatcake.common.layout import KvPageLayout

LAYERS = 3
PAGE = 4  # tokens per page


def make_pool(kind: str = "mha", layout: str = "page_first", pages: int = 16, layers: int = LAYERS,
              dtype=torch.bfloat16):
    """Host-pool double, bf16, 4 tokens a page: MHA 4 heads × 8 dim (64 B rows, 512 B chunks),
    MLA dim 24 (48 B rows, 192 B chunks)."""
    if kind == "mha":
        pool = MHAHostPoolDouble(pages * PAGE, PAGE, layers, 4, 8, dtype=dtype, layout=layout)
    else:
        pool = MLAHostPoolDouble(pages * PAGE, PAGE, layers, 24, dtype=dtype, layout=layout)
    return pool, KvPageLayout.from_host_pool(pool)


def kv_bytes(pool) -> torch.Tensor:
    """The pool's buffer as bytes (a copy)."""
    return pool.kv_buffer.view(torch.uint8).clone()


def write_extent(path: str, n_pages: int, layers: int, chunk_bytes: int, *, seed: int = 0,
                 base: int = 0, tail: int = 0) -> np.ndarray:
    """Write a layer-major extent: chunk(page p, layer l) at ``base + (l*n_pages + p)*chunk_bytes``.

    Returns the whole file's bytes (``base`` leading bytes of noise, ``tail`` trailing)."""
    rng = np.random.default_rng(seed)
    data = rng.integers(0, 256, base + n_pages * layers * chunk_bytes + tail, dtype=np.uint8)
    with open(path, "wb") as f:
        f.write(data.tobytes())
    return data


def chunk_batch(rows) -> ChunkBatch:
    """A :class:`ChunkBatch` from literal rows ``(file, offset, nbytes, page, layer, tag,
    checksum or None)`` (tests spell descriptors out one by one)."""
    rows = list(rows)
    if not rows:
        z = np.zeros(0, np.int64)
        return ChunkBatch(z, z, z, z, z, 0)
    f, o, nb, p, l, t, ck = zip(*rows)
    nbytes = int(nb[0]) if len(set(nb)) == 1 else list(nb)
    return ChunkBatch(f, o, p, l, t, nbytes, checksum=np.array([0 if c is None else c for c in ck], dtype=np.uint64),
                      has_checksum=[c is not None for c in ck])


def rows(batch: ChunkBatch) -> list[tuple]:
    """The batch's descriptors as rows ``(file, offset, nbytes, page, layer, tag, checksum or None)``."""
    return [(int(batch.file_index[i]), int(batch.offset[i]), batch.size_of(i), int(batch.page[i]),
             int(batch.layer[i]), int(batch.tag[i]), int(batch.checksum[i]) if batch.has_checksum[i] else None)
            for i in range(len(batch))]


def subset(batch: ChunkBatch, keep) -> ChunkBatch:
    """The chunks of ``batch`` where the bool mask (or index array) ``keep`` selects, in order."""
    return chunk_batch([r for r, k in zip(rows(batch), _mask(batch, keep)) if k])


def concat(*batches: ChunkBatch) -> ChunkBatch:
    """The chunks of every batch, in order."""
    return chunk_batch([r for b in batches for r in rows(b)])


def _mask(batch, keep):
    keep = np.asarray(keep)
    if keep.dtype == bool:
        return keep
    m = np.zeros(len(batch), dtype=bool)
    m[keep] = True
    return m


def extent_chunks(data: np.ndarray, file_index: int, n_pages: int, layers: int, chunk_bytes: int, *,
                  base: int = 0, pages: Optional[list[int]] = None, checksums: bool = True) -> ChunkBatch:
    """Descriptors for the extent written by :func:`write_extent`, layer-major; tag = position of
    the page."""
    dst = pages if pages is not None else list(range(n_pages))
    out = []
    for layer in range(layers):
        for i in range(n_pages):
            off = base + (layer * n_pages + i) * chunk_bytes
            ck = xxhash.xxh3_64_intdigest(data[off : off + chunk_bytes].tobytes()) if checksums else None
            out.append((file_index, off, chunk_bytes, dst[i], layer, i, ck))
    return chunk_batch(out)


def reference(kind: str, layout: str, pages: int, data: np.ndarray, chunks: ChunkBatch, skip_tags=()) -> torch.Tensor:
    """Expected pool bytes after delivering ``chunks`` (except ``skip_tags``) from ``data``
    (one file's bytes, or a ``{file_index: bytes}`` dict)."""
    pool, lay = make_pool(kind, layout, pages)
    for f, off, nb, page, layer, tag, _ in rows(chunks):
        if tag in skip_tags:
            continue
        d = data[f] if isinstance(data, dict) else data
        src = torch.from_numpy(d[off : off + nb].copy()).view(1, -1)
        lay.scatter_chunks(src, torch.tensor([page]), layer)
    return kv_bytes(pool)


def path_fn(directory: str):
    """``path_of`` for a directory of files named ``f<index>``."""
    return lambda i: os.path.join(directory, f"f{i}")
