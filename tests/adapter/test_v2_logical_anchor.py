"""DeepSeek-V4's HiCache: a KV anchor without bytes (SGLang's LogicalHostPool) and the data
in v2 pools (SGLang's own DeepSeekV4PagedHostPool, built on CPU)."""

from __future__ import annotations

import math
import os
import sys
import threading

import torch
from flatcake_testkit import slots_of
from flatcake.adapter import v2
from sglang.srt.mem_cache.hicache_storage import HiCacheStorageExtraInfo, PoolHitPolicy, PoolName, PoolTransfer

sys.path.insert(0, os.path.dirname(__file__))
from v2_kit import PAGE, PAGES, dsv4_pool, matches, put, transfer, zero  # noqa: E402
from held_writer import HeldWriter  # noqa: E402

C4, SWA = PoolName.DEEPSEEK_V4_C4, PoolName.SWA


def logical_backend(make_backend):
    from sglang.srt.mem_cache.memory_pool_host import LogicalHostPool  # importable after dsv4_pool()

    c4, swa = dsv4_pool("page_first"), dsv4_pool("layer_first")
    anchor = LogicalHostPool(PAGES * PAGE, PAGE, layout="page_first")
    be, _ = make_backend(pool=anchor)
    assert be.logical_anchor and be.store is None
    be.register_mem_host_pool_v2(anchor, PoolName.KV)
    be.register_mem_host_pool_v2(c4, C4)
    be.register_mem_host_pool_v2(swa, SWA)
    assert be.extra_pool(C4).store is None  # opened once the pool set is known
    be.on_host_pools_registered()
    return be, anchor, c4, swa


def test_logical_anchor_moves_no_kv_bytes_and_pools_carry_the_pages(make_backend):
    dsv4_pool("page_first")  # makes SGLang's host-pool modules importable
    be, anchor, c4, swa = logical_backend(make_backend)
    keys = [f"v4-{i}" for i in range(6)]
    slots = slots_of(anchor, range(6))
    assert be.batch_set_v1(keys, slots) == [True] * 6 and be.batch_get_v1(keys, slots) == [True] * 6
    assert be.batch_exists(keys) == 0
    assert be.batch_exists_v2(keys, []).kv_hit_pages == 0  # nothing vouches for any page
    assert put(be, C4, c4, keys, range(6)) == [True] * 6  # KV-derived: the anchor's page indices
    assert put(be, SWA, swa, keys[3:4], [0], prefix=keys[:3]) == [True]  # trailing state of page 4
    ts = [PoolTransfer(name=C4, keys=keys), PoolTransfer(name=SWA, keys=keys[-1:], hit_policy=PoolHitPolicy.TRAILING_PAGES)]
    r = be.batch_exists_v2(keys, ts, HiCacheStorageExtraInfo(prefix_keys=[]))
    assert (r.kv_hit_pages, r.restorable_prefix_pages) == (4, [4])
    assert r.extra_pool_hit_pages == {PoolName.KV: 6, C4: 6, SWA: 4}
    zero(c4)
    assert be.batch_get_v2([transfer(C4, c4, keys, range(10, 16))]) == {C4: [True] * 6}
    assert all(matches(c4, 10 + i, k) for i, k in enumerate(keys))


def test_logical_anchor_splits_capacity_and_retires_pools_together(make_backend):
    dsv4_pool("page_first")
    be, anchor, c4, swa = logical_backend(make_backend)
    pc4, pswa = be.extra_pool(C4), be.extra_pool(SWA)
    # a trailing pool (SWA) needs a window per request, not a page per KV page: its capacity
    # weight is TRAILING_SHARE of its page bytes
    c4_bytes, swa_bytes = pc4.layout.geometry.page_bytes, pswa.layout.geometry.page_bytes
    total = c4_bytes + swa_bytes * v2.TRAILING_SHARE
    cfg = be.cfg
    assert pc4.store.cfg.ssd.max_files == math.ceil(cfg.ssd.max_files * c4_bytes / total)
    assert pswa.store.cfg.ssd.max_files == math.ceil(cfg.ssd.max_files * swa_bytes * v2.TRAILING_SHARE / total)
    assert v2.capacity_weight(SWA, swa_bytes) == swa_bytes * v2.TRAILING_SHARE
    assert v2.capacity_weight(C4, c4_bytes) == c4_bytes
    assert pc4.store.ssd.prefix != pswa.store.ssd.prefix
    a, b = [f"a{i}" for i in range(3)], [f"b{i}" for i in range(3)]
    for keys, base in ((a, 0), (b, 3)):
        assert put(be, C4, c4, keys, range(base, base + 3)) == [True] * 3
        assert put(be, SWA, swa, keys[2:], [base], prefix=keys[:2]) == [True]
    # the rounds on disk first: a scope whose round the write queue is still writing is pinned,
    # so a drop only dooms it and its retire listeners run when the writer lets go
    assert pc4.store.flush_writes(30) and pswa.store.flush_writes(30)
    assert pc4.store.drop_keys([a[0]]) == 1  # the C4 pool frees session a
    assert pswa.store.exists(a[2])  # the others follow at the next v2 call, outside the store locks
    be.batch_exists_v2(a, [])
    assert not pswa.store.exists(a[2]) and pswa.store.exists(b[2]) and all(pc4.store.exists(k) for k in b)


def test_logical_anchor_pool_dropped_while_its_round_is_written_retires_the_others_when_the_writer_lets_go(
        make_backend, monkeypatch):
    """The deferred case of the test above: session a's next C4 round is inside the C4 store's
    writer (held there) when the C4 pool drops the session. Its scope is only doomed; the SWA
    pages stay until the writer lets go and the scope is freed; the next v2 call then retires
    them (outside the store locks)."""
    dsv4_pool("page_first")
    be, anchor, c4, swa = logical_backend(make_backend)
    pc4, pswa = be.extra_pool(C4), be.extra_pool(SWA)
    a, b = [f"da{i}" for i in range(3)], [f"db{i}" for i in range(3)]
    for keys, base in ((a, 0), (b, 3)):
        assert put(be, C4, c4, keys, range(base, base + 3)) == [True] * 3
        assert put(be, SWA, swa, keys[2:], [base], prefix=keys[:2]) == [True]
    assert pc4.store.flush_writes(30) and pswa.store.flush_writes(30)
    retired = threading.Event()
    pc4.store.add_retire_listener(lambda keys: retired.set())  # after the v2 listener: runs once it ran
    held = HeldWriter(pc4.store, monkeypatch)
    assert put(be, C4, c4, ["da3"], [6], prefix=a) == [True]  # a's next page: queued, then held
    assert held.entered.wait(60)
    try:
        assert pc4.store.drop_keys([a[0]]) == 1
        assert not any(pc4.store.exists(k) for k in a + ["da3"])  # C4: unpublished at once
        be.batch_exists_v2(a, [])  # a v2 call: nothing was freed yet, so nothing to retire
        assert pswa.store.exists(a[2]) and not retired.is_set()
    finally:
        held.release()
    assert retired.wait(60)  # the writer let go: the doomed scope was freed
    assert pswa.store.exists(a[2])  # the other pools follow at the next v2 call
    be.batch_exists_v2(a, [])
    assert not pswa.store.exists(a[2]) and pswa.store.exists(b[2]) and all(pc4.store.exists(k) for k in b)
    assert pc4.store.flush_writes(30) and not pc4.store.exists("da3")  # the held round was never published
    zero(c4)
    zero(swa)
    got = be.batch_get_v2([transfer(C4, c4, a, range(10, 13)), transfer(SWA, swa, a[2:], [13])])
    assert got == {C4: [False] * 3, SWA: [False]}  # nothing stale served
    assert be.batch_get_v2([transfer(C4, c4, b, range(20, 23))]) == {C4: [True] * 3}
    assert all(matches(c4, 20 + i, k) for i, k in enumerate(b))


def test_two_logical_anchor_servers_share_a_directory(make_backend):
    """Two servers (both DP rank 0) on one ssd.path: the second takes the next pool slot, and
    each reads only its own pages."""
    dsv4_pool("page_first")
    (b1, _, c41, _), (b2, _, c42, _) = logical_backend(make_backend), logical_backend(make_backend)
    assert (b1.identity.instance, b2.identity.instance) == ("dp0", "dp0-s1")
    assert b1.extra_pool(C4).store.ssd.prefix != b2.extra_pool(C4).store.ssd.prefix
    assert b2.extra_pool(SWA).store.instance == "dp0-s1"
    assert put(b1, C4, c41, ["only-1"], [0]) == [True]
    assert b1.extra_pool(C4).store.exists("only-1") and not b2.extra_pool(C4).store.exists("only-1")


def test_logical_anchor_medium_summary_counts_the_pools_pages(make_backend):
    """FC-MAS picks the lane from medium_summary: with no KV store the pools' pages count."""
    dsv4_pool("page_first")
    be, anchor, c4, swa = logical_backend(make_backend)
    keys = [f"ms{i}" for i in range(4)]
    assert put(be, C4, c4, keys[:3], range(3)) == [True] * 3
    assert put(be, SWA, swa, keys[2:3], [0], prefix=keys[:2]) == [True]
    assert be.extra_pool(C4).store.flush_writes(30) and be.extra_pool(SWA).store.flush_writes(30)  # on SSD
    m = be.medium_summary(keys)
    pb = be.extra_pool(C4).layout.geometry.page_bytes, be.extra_pool(SWA).layout.geometry.page_bytes
    assert m.media == ("ssd", "ssd", "ssd", None) and (m.dram_pages, m.ssd_pages) == (0, 3)
    assert m.ssd_bytes == 3 * pb[0] + pb[1]


def test_flush_writes_drains_every_pools_write_queue_without_a_kv_store(make_backend):
    """FlatCakeStorage.flush_writes with a logical anchor (no KV store): the pools' queues drain
    (it answered False at once before, leaving their rounds queued for whoever read counters)."""
    dsv4_pool("page_first")
    be, anchor, c4, swa = logical_backend(make_backend)
    stores = [be.extra_pool(C4).store, be.extra_pool(SWA).store]
    keys = [f"fw{i}" for i in range(3)]
    for s in stores:
        s.queue.defer_max_s = s.queue.urgent_bytes = float("inf")  # no bound on the deferral here
        s.queue.reads_begin()  # a restore in flight: the writers hold every round
    assert put(be, C4, c4, keys, range(3)) == [True] * 3
    assert put(be, SWA, swa, keys[2:], [0], prefix=keys[:2]) == [True]
    assert [s.snapshot_stats()["write_backlog_pages"] for s in stores] == [3, 1]
    assert not be.flush_writes(0.2)  # still held: not drained in time
    for s in stores:
        s.queue.reads_end()
    assert be.flush_writes(30)
    st = be.extra_pool_stats()
    assert [(st[n]["write_backlog_pages"], st[n]["pages_indexed"]) for n in ("deepseek_v4_c4", "swa")] == [(0, 3), (0, 1)]


def test_every_pool_of_the_rank_shares_one_write_backlog_bound(make_backend):
    """Issue 24 item 3: the C4 and SWA pools' queues draw on one bound (ssd.write_backlog_bytes
    per rank), not one each."""
    dsv4_pool("page_first")
    be, anchor, c4, swa = logical_backend(make_backend)
    stores = [be.extra_pool(C4).store, be.extra_pool(SWA).store]
    assert be.backlog_budget is not None and be.backlog_budget.limit == be.cfg.ssd.write_backlog_bytes
    assert all(s.queue.budget is be.backlog_budget for s in stores)
    for s in stores:
        s.queue.defer_max_s = s.queue.urgent_bytes = float("inf")
        s.queue.urgent_fraction = 1.0
        s.queue.reads_begin()  # hold every writer
    keys = [f"sb{i}" for i in range(3)]
    assert put(be, C4, c4, keys, range(3)) == [True] * 3
    assert put(be, SWA, swa, keys[2:], [0], prefix=keys[:2]) == [True]
    held = [s.snapshot_stats()["write_backlog_bytes"] for s in stores]
    assert all(held) and be.backlog_budget.used == sum(held)
    assert all(s.snapshot_stats()["write_backlog_rank_bytes"] == sum(held) for s in stores)
    for s in stores:
        s.queue.reads_end()
    assert be.flush_writes(30) and be.backlog_budget.used == 0
