"""The direct linker's load path, measured: time to the first usable layer vs the whole restore.

Shared by ``scripts/gpu_check.py`` (section 8, ``linker``: CUDA tensors standing in for SGLang's
device pools) and ``scripts/bench_linker.py`` (the CPU bench, per page size).

What runs is what :class:`flatcake.FlatCakeLinker` runs for a load batch (``flatcake/linker/
linker.py`` ``_read_batch``): the device pool mapped by :func:`flatcake.linker.device_kv.device_kv_of`
(SGLang's ``MHATokenToKVPool`` / ``MLATokenToKVPool`` are duck-typed there: ``k_buffer`` /
``v_buffer`` lists, or ``kv_buffer`` + ``kv_cache_dim``), then :meth:`flatcake.store.page_store.PageStore.
get_layer_wise` over :func:`flatcake.linker.layer_loads.layer_groups` (one FC-CIO read per layer:
sorted, merged reads into the staging window, verify, scatter into the device slots), the callback
marking each layer usable. The SGLang wrapper around it (lookup, the layer counter) needs SGLang,
which a GPU image may lack; this needs only FlatCake and torch.

Lifecycle of one measurement::

    stand-in pool (random pages) -> PageStore.put(keys, pages) (SSD, synchronous writes)
      -> page cache dropped -> destination pages zeroed
      -> get_layer_wise(keys, dst pages): t_layer0 (layer 0 scattered and synchronized), t_total
      -> every layer of every page compared bit for bit -> store closed, files removed
"""

from __future__ import annotations

import os
import shutil
import time
from dataclasses import asdict, dataclass
from types import SimpleNamespace

import torch

from flatcake.config import config_from_extra
from flatcake.media.directio import drop_page_cache
from flatcake.store.page_store import PageStore


# the linker's own functions; ``flatcake.linker`` imports SGLang only for the class itself (lazily),
# so these import where SGLang does not (a GPU image without it)
from flatcake.linker.device_kv import device_kv_of  # noqa: E402
from flatcake.linker.layer_loads import layer_groups  # noqa: E402

LINKER_IMPORT = "flatcake.linker"


@dataclass(frozen=True)
class LinkerRestore:
    """One measured linker load.

    Attributes:
        kind: ``mha`` (K and V buffers per layer) or ``mla`` (one latent buffer per layer).
        device: where the stand-in device pool lives (``cuda`` / ``cpu``).
        pages, page_size, layers: the restore's shape (pages of ``page_size`` tokens).
        bytes: bytes restored (pages × page bytes).
        stored_pages: pages :meth:`PageStore.put` stored (== ``pages``).
        landed_pages: pages ``get_layer_wise`` delivered intact (== ``pages``).
        bit_exact: every layer of every destination page equals its source page.
        t_layer0_s: seconds from the start of the load to layer 0 usable (read, scattered, synced).
        t_total_s: seconds for the whole restore (every layer usable).
        layer0_fraction: ``t_layer0_s / t_total_s`` (1 / layers when reads are the cost).
        gb_per_s: ``bytes / t_total_s / 1e9``.
    """

    kind: str
    device: str
    pages: int
    page_size: int
    layers: int
    bytes: int
    stored_pages: int
    landed_pages: int
    bit_exact: bool
    t_layer0_s: float
    t_total_s: float
    layer0_fraction: float
    gb_per_s: float

    def as_dict(self) -> dict:
        return asdict(self)


def stand_in_pool(kind: str, layers: int, slots: int, heads: int, head_dim: int, device: str,
                  dtype: torch.dtype = torch.bfloat16):
    """Tensors standing in for SGLang's device pool: ``mha``: ``k_buffer`` / ``v_buffer``, one
    ``[slots, heads, head_dim]`` tensor per layer; ``mla``: ``kv_buffer``, one ``[slots, 1,
    head_dim]`` latent per layer (``kv_cache_dim = head_dim``)."""
    def t():
        return torch.zeros(slots, heads if kind == "mha" else 1, head_dim, dtype=dtype, device=device)

    if kind == "mha":
        return SimpleNamespace(k_buffer=[t() for _ in range(layers)], v_buffer=[t() for _ in range(layers)],
                               dtype=dtype, k_scale_buffer=None, native_k_scale_buffer=None)
    return SimpleNamespace(kv_buffer=[t() for _ in range(layers)], kv_cache_dim=head_dim, dtype=dtype)


def _buffers(pool) -> list:
    return (list(pool.k_buffer) + list(pool.v_buffer)) if hasattr(pool, "k_buffer") else list(pool.kv_buffer)


def _sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def measure(kind: str, workdir: str, *, device: str, pages: int, page_size: int, layers: int, heads: int,
            head_dim: int, seed: int = 0) -> LinkerRestore:
    """Store ``pages`` random pages from a stand-in pool, then load them layer-wise into other
    pages of it as the linker does; see the module docstring.

    Args:
        kind: ``mha`` or ``mla``.
        workdir: a directory on the SSD under test (a pool directory is made and removed in it).
        device: ``cuda`` or ``cpu``.
        pages, page_size, layers, heads, head_dim: the shape (bf16 elements).

    Raises:
        flatcake.config.ConfigError / SsdStartupError: the pool cannot be made in ``workdir``.
    """
    slots = 2 * pages * page_size
    pool = stand_in_pool(kind, layers, slots, heads, head_dim, device)
    g = torch.Generator(device="cpu").manual_seed(seed)
    for b in _buffers(pool):
        b[: pages * page_size] = torch.randn(b[: pages * page_size].shape, generator=g).to(b.dtype).to(device)
    dev = device_kv_of(pool, page_size)
    geometry = dev.layout.geometry
    pool_dir = os.path.join(workdir, f"linker-{kind}-{page_size}")
    page_bytes = geometry.page_bytes
    file_bytes = max(64 << 20, -(-(pages + 128) * page_bytes // 4096) * 4096)  # the pages + one 128-page round
    cfg = config_from_extra({"ssd.path": pool_dir, "ssd.file_bytes": file_bytes, "ssd.max_files": 2,
                             "dram.capacity_bytes": 0, "ssd.write_backlog_bytes": 0})
    store = PageStore(cfg, geometry, f"linker-check-{kind}-p{page_size}")
    try:
        keys = [f"linker-check-{kind}-{seed}-{i}" for i in range(pages)]
        src = list(range(pages))
        dst = list(range(pages, 2 * pages))
        _sync(device)
        stored = sum(store.put(keys, dev.layout, src))
        store.flush_writes(60.0)
        for name in os.listdir(pool_dir):
            path = os.path.join(pool_dir, name)
            if os.path.isfile(path):
                drop_page_cache(path)
        marks: list[float] = []

        def landed(group, good: int) -> None:
            _sync(device)  # the layer is usable once its scatter finished on the device
            marks.append(time.perf_counter())

        t0 = time.perf_counter()
        good = store.get_layer_wise(keys, dev.layout, dst, layer_groups(layers), landed)
        _sync(device)
        t_total = time.perf_counter() - t0
        t_layer0 = (marks[0] - t0) if marks else float("nan")
        exact = all(torch.equal(b[s * page_size:(s + 1) * page_size], b[d * page_size:(d + 1) * page_size])
                    for b in _buffers(pool) for s, d in zip(src, dst))
    finally:
        store.close()
        shutil.rmtree(pool_dir, ignore_errors=True)
    total_bytes = pages * page_bytes
    return LinkerRestore(kind, device, pages, page_size, layers, total_bytes, stored, good,
                         bool(exact and good == pages and len(marks) == layers), t_layer0, t_total,
                         t_layer0 / t_total if t_total > 0 else float("nan"),
                         total_bytes / t_total / 1e9 if t_total > 0 else 0.0)
