"""v2 extra pools across MLA TP ranks: replicated pools follow the writer's pool, Mamba is
written by every rank into its own."""

from __future__ import annotations

import os
import sys

import torch
from sglang.srt.mem_cache.hicache_storage import PoolName

sys.path.insert(0, os.path.dirname(__file__))
from v2_kit import KINDS, matches, put, transfer, zero  # noqa: E402


def test_mla_follower_reads_the_writers_extra_pool_and_mamba_is_per_rank(make_backend):
    ranks = []
    for tp in (0, 1):
        be, _ = make_backend(mla=True, tp_rank=tp, tp_size=2)
        idx, mamba = KINDS["indexer"][1](), KINDS["mamba"][1]()
        be.register_mem_host_pool_v2(idx, PoolName.INDEXER)
        be.register_mem_host_pool_v2(mamba, PoolName.MAMBA)
        be.on_host_pools_registered()
        ranks.append((be, idx, mamba))
    (w, widx, wm), (f, fidx, fm) = ranks
    assert w.extra_pool("indexer").store.role == "writer" and f.extra_pool("indexer").store.role == "follower"
    assert w.extra_pool("mamba").store.role == "single" == f.extra_pool("mamba").store.role
    keys = [f"r{i}" for i in range(3)]
    assert put(w, PoolName.INDEXER, widx, keys, range(3)) == [True] * 3
    assert put(f, PoolName.INDEXER, fidx, keys, range(3)) == [True] * 3  # follower: the writer stores it
    assert w.extra_pool("indexer").store.flush_writes(30)  # the follower mirrors the writer's journal
    zero(fidx)
    assert f.batch_get_v2([transfer(PoolName.INDEXER, fidx, keys, range(5, 8))]) == {PoolName.INDEXER: [True] * 3}
    assert all(matches(fidx, 5 + i, k) for i, k in enumerate(keys))  # the writer's bytes
    # Mamba state is TP-sharded: each rank stores and reads its own
    assert put(w, PoolName.MAMBA, wm, ["w-state"], [0]) == [True]
    assert put(f, PoolName.MAMBA, fm, ["f-state"], [0]) == [True]
    assert f.extra_pool("mamba").store.exists("f-state") and not f.extra_pool("mamba").store.exists("w-state")
    assert w.extra_pool("mamba").store.ssd.prefix != f.extra_pool("mamba").store.ssd.prefix
    wm.temporal_buffer.zero_()
    assert w.batch_get_v2([transfer(PoolName.MAMBA, wm, ["w-state"], [3])]) == {PoolName.MAMBA: [True]}
    assert matches(wm, 3, "w-state") and not torch.equal(wm.temporal_buffer[3], torch.zeros_like(wm.temporal_buffer[3]))
