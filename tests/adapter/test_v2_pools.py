"""SGLang's v2 pool interface (hybrid models) on FlatCakeStorage: round trips per pool kind,
hit policies, success lists, dynamic sidecars, refusals and scope retirement."""

from __future__ import annotations

import os
import sys
import threading

import pytest
import torch
import flatcake_testkit as testkit
from flatcake_testkit import slots_of
from sglang.srt.mem_cache.hicache_storage import HiCacheStorageExtraInfo, PoolHitPolicy, PoolName, PoolTransfer

from flatcake.adapter.host_pool import DsaIndexerHostPoolDouble, MXFP8HostPoolDouble
from flatcake.common.layout import UnsupportedLayoutError

sys.path.insert(0, os.path.dirname(__file__))
from v2_kit import KINDS, PAGE, PAGES, fill, flat_bytes, matches, put, transfer, zero  # noqa: E402
from held_writer import HeldWriter  # noqa: E402


def write_pages(be, pool, keys, pages, prefix=()):
    """``testkit.write_pages``, then wait for the SSD write queue (``PageStore.flush_writes``): these
    tests inspect or damage the pool files, or count SSD pages, right after a write."""
    out = testkit.write_pages(be, pool, keys, pages, prefix)
    assert be.store.flush_writes(30)
    return out


TRAILING = PoolHitPolicy.TRAILING_PAGES


def attach(make_backend, pools: dict):
    """A backend with the KV double registered, then ``pools`` (name -> host pool) through v2
    and the end-of-burst call, as HybridCacheController.attach_storage_backend does."""
    be, kv = make_backend()
    for name, pool in pools.items():
        be.register_mem_host_pool_v2(pool, name)
    be.on_host_pools_registered()
    return be, kv


@pytest.mark.parametrize("kind", list(KINDS))
def test_round_trip_is_bit_exact_for_each_pool_kind(make_backend, kind):
    name, make = KINDS[kind]
    pool = make()
    be, _ = attach(make_backend, {name: pool})
    p = be.extra_pool(name)
    assert p.layout.geometry.page_bytes == flat_bytes(pool, 0).numel()  # one stored page = SGLang's flat page
    keys = [f"{kind}-{i}" for i in range(5)]
    assert put(be, name, pool, keys, range(5)) == [True] * 5
    assert all(p.store.exists(k) for k in keys) and not be.store.exists(keys[0])  # the pool's store, not KV's
    zero(pool)
    got = be.batch_get_v2([transfer(name, pool, keys, range(10, 15))])
    assert got == {name: [True] * 5}
    assert all(matches(pool, 10 + i, k) for i, k in enumerate(keys))
    assert not matches(pool, 0, keys[0])  # the source pages were zeroed: the bytes came from the store


def test_pools_of_one_model_never_alias(make_backend):
    swa = KINDS["swa-page_first"][1]()
    idx = KINDS["indexer"][1]()
    be, _ = attach(make_backend, {PoolName.SWA: swa, PoolName.INDEXER: idx})
    assert put(be, PoolName.SWA, swa, ["k0"], [0]) == [True]
    assert be.extra_pool("swa").store.exists("k0") and not be.extra_pool("indexer").store.exists("k0")
    assert be.batch_get_v2([transfer(PoolName.INDEXER, idx, ["k0"], [1])]) == {PoolName.INDEXER: [False]}
    assert be.extra_pool("swa").store.ssd.prefix != be.extra_pool("indexer").store.ssd.prefix != be.store.ssd.prefix


def _kv(be, kv, keys):
    assert write_pages(be, kv, keys, range(len(keys))) == [True] * len(keys)


def test_trailing_pages_hit_is_the_prefix_whose_window_exists(make_backend):
    """SWA + KV, the SWA pool holding only the trailing 2 pages of a 6-page prefix."""
    swa = KINDS["swa-page_first"][1]()
    be, kv = attach(make_backend, {PoolName.SWA: swa})
    keys = [f"t{i}" for i in range(8)]
    _kv(be, kv, keys)
    assert put(be, PoolName.SWA, swa, keys[4:6], [4, 5], prefix=keys[:4]) == [True, True]
    t = PoolTransfer(name=PoolName.SWA, keys=keys[-2:], hit_policy=TRAILING)
    r = be.batch_exists_v2(keys, [t])
    assert r.kv_hit_pages == 6
    assert r.restorable_prefix_pages == [6]
    assert r.extra_pool_hit_pages == {PoolName.KV: 8, PoolName.SWA: 6}
    # a one-page window (Mamba-like) at the same store: prefixes 5 and 6 are restorable
    t1 = PoolTransfer(name=PoolName.SWA, keys=keys[-1:], hit_policy=TRAILING)
    r1 = be.batch_exists_v2(keys, [t1])
    assert (r1.kv_hit_pages, r1.restorable_prefix_pages) == (6, [5, 6])


def test_all_pages_hole_in_the_middle_shrinks_the_hit(make_backend):
    idx = KINDS["indexer"][1]()
    be, kv = attach(make_backend, {PoolName.INDEXER: idx})
    keys = [f"a{i}" for i in range(8)]
    _kv(be, kv, keys)
    assert put(be, PoolName.INDEXER, idx, keys[:3], range(3)) == [True] * 3
    assert put(be, PoolName.INDEXER, idx, keys[4:], range(4, 8), prefix=keys[:4]) == [True] * 4
    r = be.batch_exists_v2(keys, [PoolTransfer(name=PoolName.INDEXER, keys=keys)])
    assert (r.kv_hit_pages, r.restorable_prefix_pages) == (3, [1, 2, 3])
    assert r.extra_pool_hit_pages == {PoolName.KV: 8, PoolName.INDEXER: 3}


def test_kv_hit_pages_is_the_minimum_across_pools(make_backend):
    idx = KINDS["indexer"][1]()
    mamba = KINDS["mamba"][1]()
    be, kv = attach(make_backend, {PoolName.INDEXER: idx, PoolName.MAMBA: mamba})
    keys = [f"m{i}" for i in range(8)]
    _kv(be, kv, keys[:5])  # KV: 5 pages
    assert put(be, PoolName.INDEXER, idx, keys, range(8)) == [True] * 8  # indexer: all 8
    assert put(be, PoolName.MAMBA, mamba, keys[3:4], [0], prefix=keys[:3]) == [True]  # state at page 4
    ts = [PoolTransfer(name=PoolName.INDEXER, keys=keys), PoolTransfer(name=PoolName.MAMBA, keys=keys[-1:],
                                                                        hit_policy=TRAILING)]
    r = be.batch_exists_v2(keys, ts)
    assert r.kv_hit_pages == 4 and r.restorable_prefix_pages == [4]
    assert r.extra_pool_hit_pages == {PoolName.KV: 5, PoolName.INDEXER: 5, PoolName.MAMBA: 4}
    # an unregistered pool holds nothing: no hit at all
    r0 = be.batch_exists_v2(keys, ts + [PoolTransfer(name=PoolName.DRAFT, keys=keys)])
    assert (r0.kv_hit_pages, r0.restorable_prefix_pages) == (0, [])


def test_success_lists_have_one_entry_per_key(make_backend):
    idx = KINDS["indexer"][1]()
    be, kv = attach(make_backend, {PoolName.INDEXER: idx})
    keys = [f"s{i}" for i in range(6)]
    assert put(be, PoolName.INDEXER, idx, keys[:2], range(2)) == [True, True]
    got = be.batch_get_v2([transfer(PoolName.INDEXER, idx, keys, range(10, 16)),
                           transfer(PoolName.DRAFT, idx, keys[:3], range(20, 23))])
    assert got == {PoolName.INDEXER: [True, True, False, False, False, False], PoolName.DRAFT: [False] * 3}
    bad = PoolTransfer(name=PoolName.INDEXER, host_indices=torch.arange(5), keys=keys[:2])  # not 2 whole pages
    assert be.batch_get_v2([bad]) == {PoolName.INDEXER: [False, False]}
    assert be.batch_set_v2([bad]) == {PoolName.INDEXER: [False, False]}
    # the kv pool in a v2 call is the v1 store
    _kv(be, kv, keys[:3])
    assert be.batch_get_v2([transfer(PoolName.KV, kv, keys[:4], range(30, 34))]) == {
        PoolName.KV: [True, True, True, False]}


def test_dynamic_sidecar_registered_after_the_burst(make_backend):
    be, kv = attach(make_backend, {})
    name, make = KINDS["draft-mla"]
    draft = make()
    keys = [f"d{i}" for i in range(4)]
    assert be.batch_set_v2([transfer(name, draft, keys, range(4))]) == {name: [False] * 4}  # not yet registered
    be.register_mem_host_pool_v2(draft, name)  # EAGLE3 sidecar, no on_host_pools_registered
    assert put(be, name, draft, keys, range(4)) == [True] * 4
    zero(draft)
    assert be.batch_get_v2([transfer(name, draft, keys, range(8, 12))]) == {name: [True] * 4}
    assert all(matches(draft, 8 + i, k) for i, k in enumerate(keys))


def test_scale_tensor_pools_are_refused_naming_the_pool(make_backend):
    be, _ = attach(make_backend, {})
    mx = MXFP8HostPoolDouble(PAGES * PAGE, PAGE, 3, 2, 16)
    with pytest.raises(UnsupportedLayoutError, match=r"'draft'.*MXFP8HostPoolDouble.*k_scale_host"):
        be.register_mem_host_pool_v2(mx, PoolName.DRAFT)
    assert be.extra_pool(PoolName.DRAFT) is None
    # as the KV anchor it is refused too (its kv_buffer alone would be served with wrong scales)
    with pytest.raises(UnsupportedLayoutError, match="k_scale_host"):
        make_backend(pool=MXFP8HostPoolDouble(PAGES * PAGE, PAGE, 3, 2, 16))


def test_unmappable_pool_is_refused_naming_the_pool(make_backend):
    """No zero-copy meta (as SGLang's DSA indexer in layer_first) and pages that are copies,
    not views into the pool's buffers: nothing FlatCake could address."""
    be, _ = attach(make_backend, {})
    lf = DsaIndexerHostPoolDouble(PAGES * PAGE, PAGE, 3, layout="layer_first")
    view = lf.get_data_page
    lf.get_data_page = lambda index, flat=True: view(index, flat).clone()
    with pytest.raises(UnsupportedLayoutError, match=r"'indexer'.*Unsupported layout: layer_first.*not a view"):
        be.register_mem_host_pool_v2(lf, PoolName.INDEXER)
    assert be.extra_pool(PoolName.INDEXER) is None


def test_layer_first_indexer_is_mapped_from_its_page_view(make_backend):
    """SGLang's DSA indexer in layer_first has no zero-copy meta: its page view gives one row
    per layer (a layer-major page, as KV's)."""
    be, _ = attach(make_backend, {PoolName.INDEXER: KINDS["indexer-layer_first"][1]()})
    g = be.extra_pool(PoolName.INDEXER).layout.geometry
    assert (g.layers, g.page_bytes) == (3, 3 * 132)


def test_a_freed_kv_scope_takes_its_extra_pages_with_it(make_backend):
    swa = KINDS["swa-page_first"][1]()
    be, kv = attach(make_backend, {PoolName.SWA: swa})
    a = [f"sa{i}" for i in range(4)]
    b = [f"sb{i}" for i in range(4)]
    for keys in (a, b):
        _kv(be, kv, keys)
        assert put(be, PoolName.SWA, swa, keys[2:], [2, 3], prefix=keys[:2]) == [True, True]
    sw = be.extra_pool(PoolName.SWA).store
    # rounds on disk first: a scope whose round the write queue is still writing is pinned, so a
    # drop only dooms it and its retire listeners run when the writer lets go
    assert be.store.flush_writes(30) and sw.flush_writes(30)
    assert be.store.drop_keys([a[0]]) == 1  # session a's KV scope freed
    assert not any(be.store.exists(k) for k in a) and not any(sw.exists(k) for k in a)
    assert all(sw.exists(k) for k in b[2:]) and all(be.store.exists(k) for k in b)
    assert sw.flush_writes(30)  # pages_indexed counts pages on SSD, not those in the write queue
    st = be.extra_pool_stats()["swa"]
    assert st["reclaimed_scopes_ssd"] == 1 and st["pages_indexed"] == 2


def test_a_kv_scope_dropped_while_its_round_is_written_retires_its_extra_pages_when_the_writer_lets_go(
        make_backend, monkeypatch):
    """The deferred case of the test above: session a's next KV round is inside the write queue's
    writer (held there) when its scope is dropped. The scope pinned by that round is only doomed:
    its KV pages stop being served at once, its SWA pages stay until the writer lets go; then the
    scope is freed, its retire listeners run, and the SWA pages go with it."""
    swa = KINDS["swa-page_first"][1]()
    be, kv = attach(make_backend, {PoolName.SWA: swa})
    a, b = [f"da{i}" for i in range(4)], [f"db{i}" for i in range(4)]
    for keys in (a, b):
        _kv(be, kv, keys)  # (on disk)
        assert put(be, PoolName.SWA, swa, keys[2:], [2, 3], prefix=keys[:2]) == [True, True]
    sw = be.extra_pool(PoolName.SWA).store
    assert sw.flush_writes(30)
    retired = threading.Event()
    be.store.add_retire_listener(lambda keys: retired.set())  # after the v2 hook: runs once it ran
    held = HeldWriter(be.store, monkeypatch)
    turn = ["da4", "da5"]  # session a's next turn: joins a's scope, queued, then held in the writer
    assert testkit.write_pages(be, kv, turn, [4, 5], a) == [True, True]
    assert held.entered.wait(60)
    try:
        assert be.store.drop_keys([a[0]]) == 1
        assert not any(be.store.exists(k) for k in a + turn)  # KV: unpublished at once ...
        assert all(sw.exists(k) for k in a[2:])  # ... SWA: kept until the scope is freed
        assert not retired.is_set() and be.store.snapshot_stats()["reclaimed_scopes_ssd"] == 0
        assert be.batch_get_v1(a, slots_of(kv, range(10, 14))) == [False] * 4
    finally:
        held.release()
    assert retired.wait(60)  # the writer let go: the doomed scope was freed
    assert not any(sw.exists(k) for k in a[2:]) and all(sw.exists(k) for k in b[2:])
    assert be.store.flush_writes(30) and not any(be.store.exists(k) for k in turn)  # never published
    assert be.store.snapshot_stats()["reclaimed_scopes_ssd"] == 1
    assert sw.flush_writes(30) and be.extra_pool_stats()["swa"]["reclaimed_scopes_ssd"] == 1
    zero(swa)
    zero(kv)
    # nothing stale served (a read is a leading run: one call per session)
    assert be.batch_get_v2([transfer(PoolName.SWA, swa, a[2:], [20, 21])]) == {PoolName.SWA: [False, False]}
    assert be.batch_get_v2([transfer(PoolName.SWA, swa, b[2:], [22, 23])]) == {PoolName.SWA: [True, True]}
    assert matches(swa, 22, b[2]) and matches(swa, 23, b[3])
    assert be.batch_get_v1(a + turn, slots_of(kv, range(10, 16))) == [False] * 6
    assert be.batch_get_v1(b, slots_of(kv, range(30, 34))) == [True] * 4
    assert all(testkit.page_matches(kv, (30 + i) * kv.page_size, k) for i, k in enumerate(b))


def test_never_raises_into_sglang_threads(make_backend):
    idx = KINDS["indexer"][1]()
    be, _ = attach(make_backend, {PoolName.INDEXER: idx})
    r = be.batch_exists_v2(None, [PoolTransfer(name=PoolName.INDEXER, keys=["x"])])
    assert (r.kv_hit_pages, r.extra_pool_hit_pages) == (0, {})
    assert be.batch_get_v2([None]) == {} and be.batch_set_v2([None]) == {}  # unusable transfers: nothing moved
    be.close()
    assert be.batch_get_v2([transfer(PoolName.INDEXER, idx, ["x"], [0])]) == {PoolName.INDEXER: [False]}
    assert be.batch_set_v2([transfer(PoolName.INDEXER, idx, ["x"], [0])]) == {PoolName.INDEXER: [False]}
    assert be.extra_pool(PoolName.INDEXER).store.closed


def test_a_re_registered_kv_pool_still_retires_extra_pages(make_backend):
    swa = KINDS["swa-page_first"][1]()
    be, kv = attach(make_backend, {PoolName.SWA: swa})
    be.register_mem_pool_host(kv)  # a new KV store over the same pool
    keys = [f"rr{i}" for i in range(3)]
    _kv(be, kv, keys)
    assert put(be, PoolName.SWA, swa, keys[1:], [1, 2], prefix=keys[:1]) == [True, True]
    assert be.store.flush_writes(30)  # (as above: a scope being written is pinned)
    assert be.store.drop_keys([keys[0]]) == 1
    assert not any(be.extra_pool(PoolName.SWA).store.exists(k) for k in keys)
