"""Helpers shared by the FC-CIO tests: pools, layer-major extents on disk, reference fills."""

from __future__ import annotations

import os
from typing import Optional

import numpy as np
import torch
import xxhash

from flatcake.adapter.host_pool import MHAHostPoolDouble, MLAHostPoolDouble
from flatcake.cio import ChunkRead
from flatcake.layout import KvPageLayout

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


def extent_chunks(data: np.ndarray, file_index: int, n_pages: int, layers: int, chunk_bytes: int, *,
                  base: int = 0, pages: Optional[list[int]] = None, checksums: bool = True) -> list[ChunkRead]:
    """Descriptors for the extent written by :func:`write_extent`; tag = position of the page."""
    dst = pages if pages is not None else list(range(n_pages))
    out = []
    for layer in range(layers):
        for i in range(n_pages):
            off = base + (layer * n_pages + i) * chunk_bytes
            ck = xxhash.xxh3_64_intdigest(data[off : off + chunk_bytes].tobytes()) if checksums else None
            out.append(ChunkRead(file_index, off, chunk_bytes, dst[i], layer, i, ck))
    return out


def reference(kind: str, layout: str, pages: int, data: np.ndarray, chunks, skip_tags=()) -> torch.Tensor:
    """Expected pool bytes after delivering ``chunks`` (except ``skip_tags``) from ``data``
    (one file's bytes, or a ``{file_index: bytes}`` dict)."""
    pool, lay = make_pool(kind, layout, pages)
    for c in chunks:
        if c.tag in skip_tags:
            continue
        d = data[c.file_index] if isinstance(data, dict) else data
        src = torch.from_numpy(d[c.offset : c.offset + c.nbytes].copy()).view(1, -1)
        lay.scatter_chunks(src, torch.tensor([c.page]), c.layer)
    return kv_bytes(pool)


def path_fn(directory: str):
    """``path_of`` for a directory of files named ``f<index>``."""
    return lambda i: os.path.join(directory, f"f{i}")
