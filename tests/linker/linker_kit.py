"""Build a :class:`flatcake.FlatCakeLinker` as SGLang's ``linker_factory`` does, over real SGLang
device pools on CPU, and build its transfers as ``UnifiedCacheLinkerWrapper`` and the FULL tree
component do (``unified_cache_linker.py``, ``components/full.py``)."""

from __future__ import annotations

from types import SimpleNamespace

import torch
from sglang.srt.mem_cache.allocator.paged import PagedTokenToKVPoolAllocator
from sglang.srt.mem_cache.cache_init_params import CacheInitParams
from sglang.srt.mem_cache.hicache_storage import PoolName, PoolTransfer
from sglang.srt.mem_cache.memory_pool import MHATokenToKVPool, MLATokenToKVPool
from sglang.srt.mem_cache.unified_cache.component_type import ComponentType
from sglang.srt.mem_cache.unified_cache.linker_factory import create_unified_cache_linker
from sglang.srt.mem_cache.utils import get_storage_hash_str

PAGE = 4
LAYERS = 3
SLOTS = 64 * PAGE


def device_pool(kind: str, dtype=torch.bfloat16):
    """A real SGLang device KV pool on CPU: ``mha`` (2 heads x 16) or ``mla`` (16 + 8 latent)."""
    if kind == "mha":
        return MHATokenToKVPool(size=SLOTS, page_size=PAGE, dtype=dtype, head_num=2, head_dim=16, layer_num=LAYERS,
                                device="cpu", enable_memory_saver=False)
    return MLATokenToKVPool(size=SLOTS, page_size=PAGE, dtype=dtype, kv_lora_rank=16, qk_rope_head_dim=8,
                            layer_num=LAYERS, device="cpu", enable_memory_saver=False)


def make_linker(ssd_dir: str, kind: str = "mha", extra: dict | None = None, model: str = "test-model"):
    """``(linker, kvcache, allocator)`` built through SGLang's ``create_unified_cache_linker('dynamic', ...)``."""
    kvcache = device_pool(kind)
    alloc = PagedTokenToKVPoolAllocator(SLOTS, PAGE, kvcache.dtype, "cpu", kvcache, need_sort=False)
    params = CacheInitParams(disable=False, req_to_token_pool=None, token_to_kv_pool_allocator=alloc, page_size=PAGE)
    ex = {"ssd.path": ssd_dir, "ssd.file_bytes": 8 << 20, "ssd.max_files": 4, "dram.capacity_bytes": 0}
    ex.update(extra or {})
    config = {"linker": "FlatCakeLinker", "linker_module_path": "flatcake.linker", "linker_extra_config": ex}
    linker = create_unified_cache_linker(SimpleNamespace(model_path=model), params, backend="dynamic",
                                         config=config, components={ComponentType.FULL})
    return linker, kvcache, alloc


def layer_buffers(kvcache) -> list[list[torch.Tensor]]:
    """Per layer, the device buffers of that layer (MHA: K, V; MLA: the latent)."""
    if hasattr(kvcache, "k_buffer"):
        return [[kvcache.k_buffer[l], kvcache.v_buffer[l]] for l in range(LAYERS)]
    return [[kvcache.kv_buffer[l]] for l in range(LAYERS)]


def page_hashes(tokens: list[int], prior: str | None = None) -> list[str]:
    """SGLang's page keys for ``tokens`` (whole pages), chained from ``prior``."""
    return get_storage_hash_str(tokens, prior, page_size=PAGE)


def fill(kvcache, slots: torch.Tensor, seed: int) -> None:
    """Write a distinct pattern into every layer of ``slots`` (a pattern of ``seed``)."""
    g = torch.Generator().manual_seed(seed)
    for bufs in layer_buffers(kvcache):
        for b in bufs:
            b[slots] = torch.randn(b[slots].shape, generator=g).to(b.dtype)


def snapshot(kvcache, slots: torch.Tensor) -> list[list[torch.Tensor]]:
    """Copies of every layer's rows at ``slots``."""
    return [[b[slots].clone() for b in bufs] for bufs in layer_buffers(kvcache)]


def lookup_transfer(keys) -> list[PoolTransfer]:
    """``FullComponent.build_external_linker_transfer(LOOKUP, None, keys)``."""
    return [PoolTransfer(name=PoolName.KV, keys=list(keys))]


def load_transfer(alloc, keys) -> list[PoolTransfer]:
    """``FullComponent.build_external_linker_transfer(LOAD, None, keys)``: fresh page-aligned slots."""
    slots = alloc.alloc(len(keys) * PAGE)
    assert slots is not None
    return [PoolTransfer(name=PoolName.KV, device_indices=slots.to(torch.int64), keys=list(keys))]


def offload_transfer(slots: torch.Tensor, keys) -> list[PoolTransfer]:
    """``FullComponent.build_external_linker_transfer(OFFLOAD, node, None)`` for a node holding
    ``slots`` and ``keys`` (``node.hash_value``)."""
    return [PoolTransfer(name=PoolName.KV, device_indices=slots.to(torch.int64), keys=list(keys))]


def drain_offloads(linker, n: int, timeout_s: float = 30.0) -> list[bool]:
    """Wait for the ``n`` offloads queued so far (``flush_writes``: pages on their medium) and
    pop their results."""
    assert linker.flush_writes(timeout_s)
    assert linker.num_completed_offloads() == n
    return [linker.pop_completed_offload() for _ in range(n)]
