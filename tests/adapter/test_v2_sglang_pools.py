"""v2 round trips through SGLang 0.5.23's own host-pool classes, built on the CPU:
``MHATokenToKVPoolHost`` as an SWA / draft pool (three layouts) and ``MambaPoolHost``; a Mamba
pool with slot side states (no zero-copy page meta) is refused naming the pool."""

from __future__ import annotations

import os
import sys

import pytest
import torch
from sglang.srt.mem_cache.hicache_storage import PoolName

from flatcake.common.layout import UnsupportedLayoutError
from flatcake.replay.sglang_cpu import ensure_importable

sys.path.insert(0, os.path.dirname(__file__))
from v2_kit import PAGE, flat_bytes, matches, put, transfer, zero  # noqa: E402

LAYERS, HEADS, DIM, TOKENS = 3, 2, 16, 64


def sglang_mha_pool(layout: str):
    ensure_importable()
    from sglang.srt.mem_cache.device_pool_info import KVBufferLayout, KVBuffers, MHABufferInfo
    from sglang.srt.mem_cache.pool_host.mha import MHATokenToKVPoolHost

    k = tuple(torch.zeros(TOKENS, HEADS, DIM, dtype=torch.bfloat16) for _ in range(LAYERS))
    v = tuple(torch.zeros(TOKENS, HEADS, DIM, dtype=torch.bfloat16) for _ in range(LAYERS))
    ptrs = [torch.tensor([t.data_ptr() for t in x], dtype=torch.uint64) for x in (k, v)]
    info = MHABufferInfo(buffers=KVBuffers(k=k, v=v, k_data_ptrs=ptrs[0], v_data_ptrs=ptrs[1], layout=KVBufferLayout.NHD),
                         page_size=PAGE, head_num=HEADS, head_dim=DIM, v_head_dim=DIM, dtype=torch.bfloat16,
                         device=torch.device("cpu"))
    return MHATokenToKVPoolHost(info, 2.0, 0, PAGE, layout, pin_memory=False, device="cpu",
                                device_capacity_tokens=TOKENS, start_layer=0, end_layer=LAYERS)


def sglang_mamba_pool(side_state: bool = False):
    ensure_importable()
    from sglang.srt.mem_cache.device_pool_info import MambaStateBufferInfo
    from sglang.srt.mem_cache.pool_host.mamba import MambaPoolHost

    extra = (torch.zeros(9, 5),) if side_state else ()
    info = MambaStateBufferInfo(temporal=torch.zeros(LAYERS, 9, 2, 4, 4),
                                conv=(torch.zeros(LAYERS, 9, 6, 3, dtype=torch.bfloat16),), extra_checkpoint_buffers=extra)
    return MambaPoolHost(info, 2.0, 0, device_capacity=8, pin_memory=False, device="cpu", layout="page_first")


def attach(make_backend, name, pool):
    be, kv = make_backend()
    be.register_mem_host_pool_v2(pool, name)
    be.on_host_pools_registered()
    return be


@pytest.mark.parametrize("layout", ["layer_first", "page_first", "page_first_direct"])
def test_sglang_mha_host_pool_as_swa_round_trip(make_backend, layout):
    pool = sglang_mha_pool(layout)
    be = attach(make_backend, PoolName.SWA, pool)
    assert be.extra_pool(PoolName.SWA).layout.geometry.page_bytes == flat_bytes(pool, 0).numel() == 2 * LAYERS * PAGE * HEADS * DIM * 2
    keys = [f"swa-{layout}-{i}" for i in range(4)]
    assert put(be, PoolName.SWA, pool, keys, range(4)) == [True] * 4
    zero(pool)
    assert be.batch_get_v2([transfer(PoolName.SWA, pool, keys, range(20, 24))]) == {PoolName.SWA: [True] * 4}
    assert all(matches(pool, 20 + i, k) for i, k in enumerate(keys))


def test_sglang_mamba_host_pool_round_trip(make_backend):
    pool = sglang_mamba_pool()
    be = attach(make_backend, PoolName.MAMBA, pool)
    g = be.extra_pool(PoolName.MAMBA).layout.geometry
    assert (g.layers, g.page_size, g.plane_row_bytes) == (1, 1, (LAYERS * 32 * 4, LAYERS * 18 * 2))
    keys = ["state-a", "state-b"]
    assert put(be, PoolName.MAMBA, pool, keys, [1, 2]) == [True, True]
    zero(pool)
    assert be.batch_get_v2([transfer(PoolName.MAMBA, pool, keys, [7, 8])]) == {PoolName.MAMBA: [True, True]}
    assert matches(pool, 7, "state-a") and matches(pool, 8, "state-b")


def test_sglang_mamba_pool_with_slot_side_states_is_refused(make_backend):
    be, _ = make_backend()
    with pytest.raises(UnsupportedLayoutError, match=r"'mamba'.*MambaPoolHost.*slot side"):
        be.register_mem_host_pool_v2(sglang_mamba_pool(side_state=True), PoolName.MAMBA)
