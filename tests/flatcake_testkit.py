"""Helpers shared by the tests: SGLang storage configs, host-pool doubles, deterministic page bytes."""

from __future__ import annotations

import os

import torch
import xxhash

from flatcake.adapter.host_pool import MHAHostPoolDouble, MLAHostPoolDouble

FLATCAKE_EXTRA = {
    "backend_name": "flatcake",
    "module_path": "flatcake",
    "class_name": "FlatCakeStorage",
    "interface_v1": 1,
}


def storage_config(extra: dict, *, mla: bool = False, layout: str = "page_first", model: str = "test-model", tp_rank: int = 0, tp_size: int = 1):
    from sglang.srt.mem_cache.hicache_storage import HiCacheStorageConfig

    return HiCacheStorageConfig(
        tp_rank=tp_rank, tp_size=tp_size, pp_rank=0, pp_size=1, attn_cp_rank=0, attn_cp_size=1,
        is_mla_model=mla, enable_storage_metrics=False, is_page_first_layout=layout == "page_first",
        model_name=model, extra_config={**FLATCAKE_EXTRA, **extra},
    )


def make_pool(*, mla=False, layout="page_first", dtype=torch.bfloat16, pages=64, page_size=4, layers=3):
    if mla:
        return MLAHostPoolDouble(size=pages * page_size, page_size=page_size, layer_num=layers, kv_cache_dim=24, dtype=dtype, layout=layout)
    return MHAHostPoolDouble(size=pages * page_size, page_size=page_size, layer_num=layers, head_num=2, head_dim=16, dtype=dtype, layout=layout)


def page_pattern(key: str, numel: int, dtype: torch.dtype) -> torch.Tensor:
    """Deterministic bytes for a page: a function of its key only."""
    seed = xxhash.xxh64_intdigest(key.encode()) & ((1 << 62) - 1)
    g = torch.Generator().manual_seed(seed)
    nbytes = numel * torch.empty((), dtype=dtype).element_size()
    return torch.randint(0, 256, (nbytes,), dtype=torch.uint8, generator=g).view(dtype)


def fill_page(pool, slot: int, key: str) -> None:
    """Write ``page_pattern(key)`` into the host page starting at token slot ``slot``."""
    flat = pool.get_data_page(slot, flat=True)
    pool.set_from_flat_data_page(slot, page_pattern(key, flat.numel(), pool.dtype))


def page_matches(pool, slot: int, key: str) -> bool:
    flat = pool.get_data_page(slot, flat=True)
    return torch.equal(flat.view(torch.uint8), page_pattern(key, flat.numel(), pool.dtype).view(torch.uint8))


def slots_of(pool, pages):
    """int64 host_indices (token slots) for host pages ``pages``."""
    ps = pool.page_size
    return torch.cat([torch.arange(p * ps, (p + 1) * ps) for p in pages]).to(torch.int64)
