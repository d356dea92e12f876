"""Helpers of the v2 (hybrid model) tests: extra host pools of each kind and byte checks."""

from __future__ import annotations

import torch
from flatcake_testkit import page_pattern, slots_of
from sglang.srt.mem_cache.hicache_storage import HiCacheStorageExtraInfo, PoolHitPolicy, PoolName, PoolTransfer

from flatcake.adapter.host_pool import (DsaIndexerHostPoolDouble, MambaHostPoolDouble, MHAHostPoolDouble,
                                        MLAHostPoolDouble)

PAGES = 64  # pages of each extra pool (and of the KV double of ``make_backend``)
PAGE = 4  # tokens per KV page (``make_backend``'s double)


def dsv4_pool(layout: str):
    """SGLang's own ``DeepSeekV4PagedHostPool`` (built on CPU): 3 layers of 96-byte page rows."""
    from flatcake.replay.sglang_cpu import ensure_importable

    ensure_importable()
    from sglang.srt.mem_cache.memory_pool_host import DeepSeekV4PagedHostPool

    bufs = [torch.zeros(8, 96, dtype=torch.uint8) for _ in range(3)]
    return DeepSeekV4PagedHostPool("c4", bufs, item_bytes=96, num_host_pages=PAGES, slot_page_size=PAGE,
                                   layout=layout, device="cpu", pin_memory=False)


#: pool kind -> (SGLang pool name, factory)
KINDS = {
    "swa-page_first": (PoolName.SWA, lambda: MHAHostPoolDouble(PAGES * PAGE, PAGE, 3, 2, 16, layout="page_first")),
    "swa-layer_first": (PoolName.SWA, lambda: MHAHostPoolDouble(PAGES * PAGE, PAGE, 3, 2, 16, layout="layer_first")),
    "swa-page_first_direct": (PoolName.SWA, lambda: MHAHostPoolDouble(PAGES * PAGE, PAGE, 3, 2, 16,
                                                                      layout="page_first_direct")),
    "mamba": (PoolName.MAMBA, lambda: MambaHostPoolDouble(PAGES, 3)),
    "indexer": (PoolName.INDEXER, lambda: DsaIndexerHostPoolDouble(PAGES * PAGE, PAGE, 3)),
    "indexer-layer_first": (PoolName.INDEXER, lambda: DsaIndexerHostPoolDouble(PAGES * PAGE, PAGE, 3,
                                                                               layout="layer_first")),
    "dsv4-c4-layer_first": (PoolName.DEEPSEEK_V4_C4, lambda: dsv4_pool("layer_first")),
    "dsv4-c4-page_first": (PoolName.DEEPSEEK_V4_C4, lambda: dsv4_pool("page_first")),
    "draft-mla": (PoolName.DRAFT, lambda: MLAHostPoolDouble(PAGES * PAGE, PAGE, 1, 24, layout="page_first")),
}


def flat_bytes(pool, slot: int) -> torch.Tensor:
    """SGLang's flat data page at ``slot`` as bytes (the pool's own view of one page)."""
    d = pool.get_data_page(slot, flat=True)
    return d.contiguous().view(torch.uint8).reshape(-1)


def fill(pool, page: int, key: str) -> None:
    """Write ``key``'s pattern into host page ``page`` through the pool's own flat-page API."""
    slot = page * pool.page_size
    d = pool.get_data_page(slot, flat=True)
    n = d.numel() * d.element_size()
    pool.set_from_flat_data_page(slot, page_pattern(key, n, torch.uint8).view(d.dtype))


def matches(pool, page: int, key: str) -> bool:
    """True when host page ``page`` holds ``key``'s pattern bit for bit."""
    b = flat_bytes(pool, page * pool.page_size)
    return torch.equal(b, page_pattern(key, b.numel(), torch.uint8))


def transfer(name, pool, keys, pages, policy=PoolHitPolicy.ALL_PAGES) -> PoolTransfer:
    """A storage-path ``PoolTransfer``: ``keys`` at host pages ``pages`` of ``pool``."""
    return PoolTransfer(name=name, host_indices=slots_of(pool, pages), keys=list(keys), hit_policy=policy)


def put(be, name, pool, keys, pages, prefix=()):
    """Fill and back up ``keys`` at ``pages`` through ``batch_set_v2``; returns its result list."""
    for k, p in zip(keys, pages):
        fill(pool, p, k)
    out = be.batch_set_v2([transfer(name, pool, keys, pages)], HiCacheStorageExtraInfo(prefix_keys=list(prefix)))
    return out[name]


def zero(pool) -> None:
    """Zero every page buffer of ``pool``."""
    from flatcake.common.layout import pool_buffers

    for b in pool_buffers(pool):
        b.zero_()
