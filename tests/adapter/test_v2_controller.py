"""The v2 entry points driven by SGLang 0.5.23's real ``HybridCacheController`` code on the CPU:
its backup (``_page_backup_with_stable_layout``: v2 sidecars, then v1 KV), its hit query
(``_storage_hit_query`` -> ``batch_exists_v2``) and its prefetch transfer
(``_page_transfer_with_stable_layout``: v1 KV + KV-derived sidecars, then trailing sidecars).
The controller is built with ``__new__`` and given only what those methods read."""

from __future__ import annotations

import contextlib
import os
import queue
import sys
from types import SimpleNamespace

import pytest
from flatcake_testkit import slots_of
from sglang.srt.mem_cache.hicache_storage import PoolHitPolicy, PoolName, PoolTransfer

from flatcake.replay.sglang_cpu import ensure_importable

sys.path.insert(0, os.path.dirname(__file__))
from v2_kit import KINDS, PAGE, fill, matches  # noqa: E402

N = 6  # pages of the request
SWA, IDX = PoolName.SWA, PoolName.INDEXER


@pytest.fixture(scope="module")
def hcc():
    ensure_importable()
    try:
        from sglang.srt.mem_cache.hybrid_cache import hybrid_cache_controller as m
        from sglang.srt.mem_cache.utils import get_storage_hash_str
    except Exception as e:  # noqa: BLE001
        pytest.skip(f"SGLang's cache controller does not import here ({type(e).__name__}: {e})")
    return m, get_storage_hash_str


class GroupDouble:
    """The host pool group's ``layout_lease()`` and ``entry_map`` (``pool_host/group.py``)."""

    def __init__(self, pools):
        self.entry_map = {n: SimpleNamespace(host_pool=p) for n, p in pools.items()}

    @contextlib.contextmanager
    def layout_lease(self):
        yield


def controller(m, be, kv, pools):
    cc = m.HybridCacheController.__new__(m.HybridCacheController)
    cc.storage_backend, cc.storage_backend_type = be, "dynamic"
    cc.page_size, cc.storage_host_pool = PAGE, kv
    cc.mem_pool_host = GroupDouble(pools)
    cc.page_get_func, cc.page_set_func = cc._page_get_zero_copy, cc._page_set_zero_copy
    cc.storage_config = be.storage_config
    cc.prefetch_sync_queue = queue.Queue()
    cc.prefetch_hits_sync_groups = []
    return cc


def test_backup_hit_query_and_prefetch_through_sglangs_controller(make_backend, hcc):
    m, hash_str = hcc
    be, kv = make_backend()
    swa, idx = KINDS["swa-page_first"][1](), KINDS["indexer"][1]()
    be.register_mem_host_pool_v2(swa, SWA)
    be.register_mem_host_pool_v2(idx, IDX)
    be.on_host_pools_registered()
    cc = controller(m, be, kv, {SWA: swa, IDX: idx})
    tokens = list(range(100, 100 + N * PAGE))
    keys = hash_str(tokens, None, page_size=PAGE)
    for i, k in enumerate(keys):  # KV and indexer page i, SWA window = the last 2 pages
        fill(kv, i, k)
        fill(idx, i, "idx-" + k)
    for j, k in enumerate(keys[-2:]):
        fill(swa, j, "swa-" + k)

    op = m.StorageOperation(slots_of(kv, range(N)), tokens, hash_value=list(keys), prefix_keys=[], pool_transfers=[
        PoolTransfer(name=SWA, host_indices=slots_of(swa, [0, 1]), keys=keys[-2:], hit_policy=PoolHitPolicy.TRAILING_PAGES),
        PoolTransfer(name=IDX, indices_from_pool=PoolName.KV)])
    cc._page_backup_with_stable_layout(op)
    assert op.completed_tokens == N * PAGE
    assert op.pool_storage_result.extra_pool_hit_pages == {SWA: 2, IDX: N}

    handle = m.CacheRequestHandle("r", 0)
    q = m.PrefetchOperation(handle, tokens, prefix_keys=[], pool_transfers=[
        PoolTransfer(name=SWA, host_indices=slots_of(swa, [10, 11]), keys=["?", "?"], hit_policy=PoolHitPolicy.TRAILING_PAGES),
        PoolTransfer(name=IDX, indices_from_pool=PoolName.KV)])
    hit, tokens_hit = cc._storage_hit_query(q)
    assert (hit, tokens_hit) == (keys, N * PAGE)
    assert q.query_pool_hit_pages == {PoolName.KV: N, SWA: N, IDX: N}

    q.hash_value, q.host_indices = hit, slots_of(kv, range(20, 20 + N))
    cc._page_transfer_with_stable_layout(q)
    acks = [cc.prefetch_sync_queue.get_nowait() for _ in range(cc.prefetch_sync_queue.qsize())]
    assert acks[0].completed_tokens == N * PAGE and acks[-1].pool_hits == {SWA: 2}
    assert all(matches(kv, 20 + i, k) for i, k in enumerate(keys))
    assert all(matches(idx, 20 + i, "idx-" + k) for i, k in enumerate(keys))
    assert all(matches(swa, 10 + j, "swa-" + k) for j, k in enumerate(keys[-2:]))
