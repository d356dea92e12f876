"""SGLang 0.5.23's hybrid device pools on CPU for the linker tests: ``SWAKVPool`` (FULL + SWA),
``HybridLinearKVPool`` + ``HybridReqToTokenPool`` (FULL + MAMBA), both (FULL + SWA + MAMBA), the
allocators SGLang pairs with them, and a ``FlatCakeLinker`` over them built by SGLang's
``linker_factory``."""

from __future__ import annotations

from types import SimpleNamespace

import torch
from linker_kit import PAGE
from sglang.srt.configs.mamba_utils import Mamba2CacheParams, Mamba2StateShape
from sglang.srt.mem_cache.allocator.paged import PagedTokenToKVPoolAllocator
from sglang.srt.mem_cache.allocator.swa import SWATokenToKVPoolAllocator
from sglang.srt.mem_cache.cache_init_params import CacheInitParams
from sglang.srt.mem_cache.memory_pool import HybridLinearKVPool, HybridReqToTokenPool
from sglang.srt.mem_cache.swa_memory_pool import SWAKVPool
from sglang.srt.mem_cache.unified_cache.component_type import ComponentType
from sglang.srt.mem_cache.unified_cache.linker_factory import create_unified_cache_linker

FULL, SWA, MAMBA = ComponentType.FULL, ComponentType.SWA, ComponentType.MAMBA
SLOTS = 64 * PAGE
SWA_SLOTS = 32 * PAGE
LAYERS = {  # model layer ids per kind (4 layers)
    "swa": {"swa": [0, 2], "full": [1, 3]},
    "mamba": {"mamba": [0, 2], "full": [1, 3]},
    "swa_mamba": {"swa": [0, 3], "full": [1], "mamba": [2]},
}
COMPONENTS = {"swa": {FULL, SWA}, "mamba": {FULL, MAMBA}, "swa_mamba": {FULL, SWA, MAMBA}}


def mamba_r2t(mamba_ids):
    """SGLang's ``HybridReqToTokenPool`` with a Mamba2 state (conv + temporal) for ``mamba_ids``."""
    shape = Mamba2StateShape.create(tp_world_size=1, intermediate_size=32, n_groups=1, num_heads=2, head_dim=16,
                                    state_size=8, conv_kernel=4)
    params = Mamba2CacheParams(shape=shape, layers=mamba_ids)
    return HybridReqToTokenPool(size=8, mamba_size=8, mamba_spec_state_size=8, max_context_len=256, device="cpu",
                                enable_memory_saver=False, cache_params=params, mamba_layer_ids=mamba_ids,
                                enable_mamba_extra_buffer=False)


class Model:
    """The device pools SGLang builds for a hybrid model, on CPU, and the linker over them."""

    def __init__(self, kind: str, ssd_dir: str, page: int = PAGE):
        ids = LAYERS[kind]
        self.kind = kind
        self.r2t = mamba_r2t(ids["mamba"]) if "mamba" in ids else None
        if "swa" in ids:
            self.kv = SWAKVPool(size=SLOTS, size_swa=SWA_SLOTS, page_size=page, dtype=torch.bfloat16, head_num=2,
                                head_dim=16, swa_attention_layer_ids=ids["swa"],
                                full_attention_layer_ids=ids["full"], device="cpu")
            self.alloc = SWATokenToKVPoolAllocator(SLOTS, SWA_SLOTS, page, torch.bfloat16, "cpu", self.kv,
                                                   need_sort=False)
            self.full, self.full_alloc = self.kv.full_kv_pool, self.alloc.full_attn_allocator
            self.swa, self.swa_alloc = self.kv.swa_kv_pool, self.alloc.swa_attn_allocator
        else:
            self.kv = HybridLinearKVPool(size=SLOTS, dtype=torch.bfloat16, page_size=page, head_num=2, head_dim=16,
                                         full_attention_layer_ids=ids["full"], device="cpu",
                                         mamba_pool=self.r2t.mamba_pool)
            self.alloc = PagedTokenToKVPoolAllocator(SLOTS, page, torch.bfloat16, "cpu", self.kv, need_sort=False)
            self.full, self.full_alloc, self.swa = self.kv.full_kv_pool, self.alloc, None
        self.params = CacheInitParams(disable=False, req_to_token_pool=self.r2t, token_to_kv_pool_allocator=self.alloc,
                                      page_size=page)
        self.ssd_dir = ssd_dir

    def linker(self, components=None, scatter: str = "torch"):
        ex = {"ssd.path": self.ssd_dir, "ssd.file_bytes": 8 << 20, "ssd.max_files": 4, "dram.capacity_bytes": 0,
              "cio.scatter": scatter}
        config = {"linker": "FlatCakeLinker", "linker_module_path": "flatcake.linker", "linker_extra_config": ex}
        return create_unified_cache_linker(SimpleNamespace(model_path="hybrid-test"), self.params, backend="dynamic",
                                           config=config, components=set(components or COMPONENTS[self.kind]))

    # ---------------------------------------------------------------- device state
    @property
    def mamba_states(self) -> list:
        if self.r2t is None:
            return []
        cache = self.r2t.mamba_pool.mamba_cache
        return [cache.temporal, *cache.conv]

    def fill_kv(self, pool, slots, seed):
        g = torch.Generator().manual_seed(seed)
        for buf in (*pool.k_buffer, *pool.v_buffer):
            buf[slots] = torch.randn(buf[slots].shape, generator=g).to(buf.dtype)

    def fill_mamba(self, slot, seed):
        g = torch.Generator().manual_seed(seed)
        for s in self.mamba_states:
            s[:, slot] = torch.randn(s[:, slot].shape, generator=g).to(s.dtype)

    @staticmethod
    def kv_rows(pool, slots):
        """Per layer of ``pool``: (K rows, V rows) at ``slots``."""
        return [(pool.k_buffer[l][slots].clone(), pool.v_buffer[l][slots].clone()) for l in range(len(pool.k_buffer))]

    def mamba_rows(self, slot):
        """Per Mamba layer: every state tensor's row ``slot``."""
        return [[s[l, slot].clone() for s in self.mamba_states] for l in range(self.mamba_states[0].shape[0])]


def same(a, b) -> list[bool]:
    """Per layer: every tensor bit-equal."""
    return [all(torch.equal(x, y) for x, y in zip(la, lb)) for la, lb in zip(a, b)]
