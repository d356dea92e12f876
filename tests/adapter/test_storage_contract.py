"""FlatCakeStorage against SGLang 0.5.23's real HiCacheStorage contract, on host-pool doubles."""

from __future__ import annotations

import os
import threading

import pytest
import torch
import flatcake_testkit as testkit
from flatcake_testkit import (fill_page, page_matches, slots_of, slow_read_in_background, storage_config,
                              two_requests_share)
from sglang.srt.mem_cache.hicache_storage import HiCacheStorage, HiCacheStorageExtraInfo

from flatcake.adapter.storage import FlatCakeStorage
from flatcake.config import ConfigError
from flatcake.common.layout import SUPPORTED_LAYOUTS, UnsupportedLayoutError
from flatcake.media.errors import SsdStartupError


def write_pages(be, pool, keys, pages, prefix=()):
    """``testkit.write_pages``, then wait for the SSD write queue (``PageStore.flush_writes``): these
    tests inspect or damage the pool files, or count SSD pages, right after a write."""
    out = testkit.write_pages(be, pool, keys, pages, prefix)
    assert be.store.flush_writes(30)
    return out


LAYOUTS = list(SUPPORTED_LAYOUTS)


def test_factory_builds_flatcake_subclass(make_backend):
    be, _ = make_backend()
    assert isinstance(be, FlatCakeStorage) and isinstance(be, HiCacheStorage)
    import flatcake

    assert flatcake.FlatCakeStorage is FlatCakeStorage


@pytest.mark.parametrize("mla", [False, True], ids=["mha", "mla"])
@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("dram", [0, 1 << 20], ids=["ssd", "dram"])
def test_zero_copy_round_trip_is_bit_exact(make_backend, mla, layout, dram):
    be, pool = make_backend(mla=mla, layout=layout, extra={"dram.capacity_bytes": dram, "placement.shared_refcount": 2})
    keys = [f"{layout}-{mla}-{i}" for i in range(10)]
    if dram:  # two hit queries before the write make it a shared prompt -> DRAM
        two_requests_share(be.batch_exists, keys)
    assert write_pages(be, pool, keys, range(10)) == [True] * 10
    assert be.batch_exists(keys) == 10
    assert {be.store.medium_of(k) for k in keys} == ({"dram"} if dram else {"ssd"})
    pool.kv_buffer.zero_()
    dst = list(range(20, 30))
    assert be.batch_get_v1(keys, slots_of(pool, dst)) == [True] * 10
    assert all(page_matches(pool, p * pool.page_size, k) for p, k in zip(dst, keys))
    st = be.flatcake_stats()
    assert st["hit_pages_dram" if dram else "hit_pages_ssd"] == 10


@pytest.mark.parametrize("mla", [False, True], ids=["mha", "mla"])
@pytest.mark.parametrize("layout", LAYOUTS)
def test_generic_path_round_trip_is_bit_exact(make_backend, mla, layout):
    """batch_set(keys, [get_data_page]) then batch_get into dummy flat pages, as _generic_page_get does."""
    be, pool = make_backend(mla=mla, layout=layout)
    keys = [f"g{i}" for i in range(5)]
    for i, k in enumerate(keys):
        fill_page(pool, i * pool.page_size, k)
    assert be.batch_set(keys, [pool.get_data_page(i * pool.page_size) for i in range(5)]) is True
    got = be.batch_get(keys, [pool.get_dummy_flat_data_page() for _ in keys])
    for i, (k, t) in enumerate(zip(keys, got)):
        pool.set_from_flat_data_page((10 + i) * pool.page_size, t)
        assert page_matches(pool, (10 + i) * pool.page_size, k)
    # zero-copy read of pages written through the generic path gives the same bytes
    pool.kv_buffer.zero_()
    assert be.batch_get_v1(keys, slots_of(pool, range(30, 35))) == [True] * 5
    assert all(page_matches(pool, (30 + i) * pool.page_size, k) for i, k in enumerate(keys))
    assert be.get("missing", pool.get_dummy_flat_data_page()) is None
    assert be.exists("g0") and not be.exists("missing")


def test_leading_run_with_holes(make_backend):
    be, pool = make_backend()
    keys = [f"h{i}" for i in range(8)]
    assert write_pages(be, pool, keys[2:], range(2, 8)) == [True] * 6
    assert be.batch_exists(keys) == 0  # pages 0..1 absent
    assert be.batch_get_v1(keys, slots_of(pool, range(8))) == [False] * 8
    # out of order: 0, then 3 (hole at 1..2 filled later)
    be2, pool2 = make_backend(model="other")
    write_pages(be2, pool2, [keys[0]], [0])
    write_pages(be2, pool2, [keys[3]], [3])
    assert be2.batch_exists(keys) == 1
    write_pages(be2, pool2, [keys[1]], [1])
    assert be2.batch_exists(keys) == 2
    write_pages(be2, pool2, [keys[2]], [2])
    assert be2.batch_exists(keys) == 4
    assert be2.batch_get_v1(keys[:6], slots_of(pool2, range(10, 16))) == [True] * 4 + [False] * 2


def test_rewrite_is_idempotent(make_backend):
    be, pool = make_backend()
    keys = ["r0", "r1"]
    write_pages(be, pool, keys, [0, 1])
    written = be.flatcake_stats()["pages_written_ssd"]
    assert write_pages(be, pool, keys, [0, 1]) == [True, True]
    assert be.flatcake_stats()["pages_written_ssd"] == written


@pytest.mark.parametrize("other", [{"dtype": torch.float8_e4m3fn}, {"layout": "layer_first"}, {"model": "other-model"}, {"tp_rank": 1, "tp_size": 2}])
def test_namespace_separation_is_a_miss_never_bytes(make_backend, other):
    be, pool = make_backend()
    keys = [f"n{i}" for i in range(4)]
    write_pages(be, pool, keys, range(4))
    kw = dict(other)
    be2, pool2 = make_backend(**kw)
    assert be2.namespace != be.namespace
    assert be2.batch_exists(keys) == 0
    assert be2.batch_get_v1(keys, slots_of(pool2, range(4))) == [False] * 4
    assert int(pool2.kv_buffer.view(torch.uint8).count_nonzero()) == 0


def test_mla_non_writer_rank_writes_nothing(make_backend):
    be, pool = make_backend(mla=True, tp_rank=1, tp_size=2)
    assert be.storage_config.is_storage_writer is False
    assert write_pages(be, pool, ["m0", "m1"], [0, 1]) == [True, True]
    assert be.batch_exists(["m0", "m1"]) == 0
    assert be.flatcake_stats()["pages_written_ssd"] == 0


def test_truncated_file_is_a_miss_for_that_page_and_later(make_backend):
    be, pool = make_backend(extra={"cio.verify_checksums": True})
    keys = [f"t{i}" for i in range(6)]
    write_pages(be, pool, keys[:3], range(3))
    write_pages(be, pool, keys[3:], range(3, 6), prefix=keys[:3])
    # the file loses everything from page 4's last-layer chunk on (layer-major: pages 4 and 5
    # of the second round lose their last layer; page 3's chunks all lie before that offset)
    e = be.store.index.get(keys[4])
    off = (e.gva & ((1 << 48) - 1)) + (be.store.geometry.layers - 1) * e.layer_stride
    f, o = divmod(off, be.cfg.ssd.file_bytes)
    with open(be.store.ssd.path_of(f), "r+b") as fh:
        fh.truncate(o)
    assert be.batch_exists(keys) == 6  # the index still says so
    pool.kv_buffer.zero_()
    got = be.batch_get_v1(keys, slots_of(pool, range(10, 16)))
    assert got == [True] * 4 + [False] * 2
    assert all(page_matches(pool, (10 + i) * pool.page_size, keys[i]) for i in range(4))
    assert be.flatcake_stats()["get_failures"] == 1


def test_corrupted_bytes_are_a_miss_not_other_bytes(make_backend):
    be, pool = make_backend()
    keys = ["c0", "c1"]
    write_pages(be, pool, keys, [0, 1])
    e = be.store.index.get("c1")
    f, o = divmod(e.gva & ((1 << 48) - 1), be.cfg.ssd.file_bytes)
    with open(be.store.ssd.path_of(f), "r+b") as fh:
        fh.seek(o + 5)
        fh.write(b"\xff\x00\xff")
    pool.kv_buffer.zero_()
    assert be.batch_get_v1(keys, slots_of(pool, [5, 6])) == [True, False]
    assert page_matches(pool, 5 * pool.page_size, "c0")


def test_unusable_ssd_path_fails_at_startup(tmp_path):
    from sglang.srt.mem_cache.storage.backend_factory import StorageBackendFactory

    blocker = tmp_path / "file"
    blocker.write_text("x")
    cfg = storage_config({"ssd.path": str(blocker / "sub")})
    with pytest.raises(SsdStartupError, match="ssd.path"):
        StorageBackendFactory.create_backend("dynamic", cfg, None)


def test_bad_config_fails_at_startup_naming_the_field(tmp_path):
    with pytest.raises(ConfigError, match="cio.gap_bytes"):
        FlatCakeStorage(storage_config({"ssd.path": str(tmp_path), "cio.gap_bytes": -1}))
    with pytest.raises(ConfigError, match="ssd.bogus"):
        FlatCakeStorage(storage_config({"ssd.path": str(tmp_path), "ssd.bogus": 1}))


def test_unsupported_layout_refused_at_registration(tmp_path):
    be = FlatCakeStorage(storage_config({"ssd.path": str(tmp_path)}))

    class PageHeadPool:
        layout = "page_head"
        page_size = 4
        layer_num = 2
        kv_buffer = torch.zeros(2, 1, 2, 4, 2, 8)

    with pytest.raises(UnsupportedLayoutError, match="page_head"):
        be.register_mem_pool_host(PageHeadPool())


def test_calls_before_registration_are_misses(tmp_path):
    be = FlatCakeStorage(storage_config({"ssd.path": str(tmp_path)}))
    assert be.batch_exists(["a"]) == 0
    assert be.batch_get_v1(["a"], torch.arange(4)) == [False]
    assert be.batch_set_v1(["a"], torch.arange(4)) == [False]


def test_exists_turns_true_no_later_than_the_write_returns(make_backend):
    be, pool = make_backend(extra={"ssd.write_backlog_bytes": 0})  # synchronous: published after the put's own write
    key = "race"
    fill_page(pool, 0, key)
    seen_before_return = []
    done = threading.Event()
    real_write = be.store.ssd.write

    def slow_write(*a, **kw):
        # while the bytes are being written the key must not be visible yet
        seen_before_return.append(be.exists(key))
        real_write(*a, **kw)
        seen_before_return.append(be.exists(key))

    be.store.ssd.write = slow_write
    polls = []

    def poll():
        while not done.is_set():
            polls.append(be.exists(key))

    t = threading.Thread(target=poll)
    t.start()
    assert be.batch_set_v1([key], slots_of(pool, [0])) == [True]
    after = be.exists(key)
    done.set()
    t.join()
    assert seen_before_return and not any(seen_before_return)  # published only after the write
    assert after is True
    pool.kv_buffer.zero_()
    assert be.batch_get_v1([key], slots_of(pool, [3])) == [True]
    assert page_matches(pool, 3 * pool.page_size, key)


def test_three_sglang_threads_concurrently(make_backend):
    """Backup writes, prefetch reads and hit queries at once: every page read equals what was written."""
    be, pool = make_backend(pages=256, extra={"dram.capacity_bytes": 1 << 20})
    sessions = [[f"s{s}-p{i}" for i in range(12)] for s in range(8)]
    errors = []
    write_done = threading.Event()

    def backup():
        for s, keys in enumerate(sessions):
            pages = range(s * 12, s * 12 + 12)
            if write_pages(be, pool, keys[:6], pages[:6]) != [True] * 6:
                errors.append("put")
            if write_pages(be, pool, keys[6:], pages[6:], prefix=keys[:6]) != [True] * 6:
                errors.append("put")
        write_done.set()

    def prefetch():
        reads = 0
        while not write_done.is_set() or reads < 8:
            for s, keys in enumerate(sessions):
                dst = list(range(128 + (s % 8) * 12, 128 + (s % 8) * 12 + 12))
                got = be.batch_get_v1(keys, slots_of(pool, dst))
                n = got.index(False) if False in got else 12
                for i in range(n):
                    if not page_matches(pool, dst[i] * pool.page_size, keys[i]):
                        errors.append(("bytes", keys[i]))
                reads += 1

    def query():
        while not write_done.is_set():
            for keys in sessions:
                be.batch_exists(keys, HiCacheStorageExtraInfo(prefix_keys=[]))

    ts = [threading.Thread(target=f) for f in (backup, prefetch, query)]
    for t in ts:
        t.start()
    for t in ts:
        t.join(timeout=120)
    assert errors == []
    assert all(be.batch_exists(k) == 12 for k in sessions)


def test_get_stats_reports_pages_per_call_and_drains(make_backend, monkeypatch):
    """With --enable-metrics SGLang drains get_stats() each tick. The real StorageMetrics module
    needs prometheus/transformers, so a module with the same dataclass stands in for it."""
    import sys
    import types
    from dataclasses import dataclass, field

    @dataclass
    class StorageMetrics:
        prefetch_pgs: list = field(default_factory=list)
        backup_pgs: list = field(default_factory=list)
        prefetch_bandwidth: list = field(default_factory=list)
        backup_bandwidth: list = field(default_factory=list)

    mod = types.ModuleType("sglang.srt.observability.metrics_collector")
    mod.StorageMetrics = StorageMetrics
    monkeypatch.setitem(sys.modules, "sglang.srt.observability.metrics_collector", mod)
    be, pool = make_backend()
    be.storage_config.enable_storage_metrics = True
    write_pages(be, pool, ["m0", "m1", "m2"], [0, 1, 2])
    be.batch_get_v1(["m0", "m1"], slots_of(pool, [5, 6]))
    m = be.get_stats()
    assert (m.backup_pgs, m.prefetch_pgs) == ([3], [2])
    assert len(m.backup_bandwidth) == 1 and m.backup_bandwidth[0] > 0
    m2 = be.get_stats()
    assert (m2.backup_pgs, m2.prefetch_pgs, m2.prefetch_bandwidth) == ([], [], [])


def test_clear_forgets_every_scope_and_frees_a_pinned_one_when_its_reader_leaves(make_backend):
    be, pool = make_backend()
    write_pages(be, pool, ["a0", "a1"], [0, 1])
    write_pages(be, pool, ["b0"], [2])
    entries = be.store.scopes.pin_leading_run(["b0"])  # a read of b0 is in flight
    be.clear()
    assert be.batch_exists(["a0", "a1"]) == 0 and be.batch_exists(["b0"]) == 0  # nothing served any more
    held = entries[0].scope
    assert held.doomed and not held.retired and be.store.ssd.used_bytes > 0  # ... but its bytes stay for the reader
    be.store.scopes.unpin(entries)  # the reader leaves: the scope is retired and its space freed
    assert held.retired and be.store.ssd.used_bytes == 0 and len(be.store.index) == 0
    assert be.flatcake_stats()["reclaimed_scopes_ssd"] == 2


def test_calls_after_close_are_misses_not_errors(make_backend):
    be, pool = make_backend()
    write_pages(be, pool, ["z0"], [0])
    be.close()
    assert be.batch_exists(["z0"]) == 0
    assert be.batch_get_v1(["z0"], slots_of(pool, [1])) == [False]
    assert be.batch_set_v1(["z1"], slots_of(pool, [1])) == [False]
    be.close()  # idempotent


def test_close_waits_for_a_running_read(make_backend):
    be, pool = make_backend()
    write_pages(be, pool, ["w0", "w1"], [0, 1])
    t, results = slow_read_in_background(be, pool, ["w0", "w1"], [4, 5])
    be.close()
    t.join(10)
    assert results == [[True, True]]
    assert page_matches(pool, 4 * pool.page_size, "w0")


def test_pool_removed_behind_the_backend_stops_hits_and_recovers(make_backend):
    import shutil

    be, pool = make_backend(extra={"ssd.write_backlog_bytes": 0})  # synchronous: the put meeting the fault is False
    keys = [f"rm{i}" for i in range(4)]
    write_pages(be, pool, keys, range(4))
    shutil.rmtree(be.cfg.ssd.path)  # a tmp cleaner removes the pool
    assert be.batch_exists(keys) == 4  # nothing has noticed yet
    assert be.batch_get_v1(keys, slots_of(pool, range(8, 12))) == [False] * 4
    assert be.batch_exists(keys) == 0  # the unreadable scope is no longer advertised
    # new writes detect the removed file, drop what lived there and recreate the pool
    other = [f"new{i}" for i in range(3)]
    assert write_pages(be, pool, other, range(20, 23)) == [False] * 3
    assert write_pages(be, pool, other, range(20, 23)) == [True] * 3
    pool.kv_buffer.zero_()
    assert be.batch_get_v1(other, slots_of(pool, range(30, 33))) == [True] * 3
    assert all(page_matches(pool, (30 + i) * pool.page_size, k) for i, k in enumerate(other))


def test_oversized_round_fails_without_reclaiming_anything(make_backend, allow_small_files):
    be, pool = make_backend(extra={"ssd.file_bytes": 16 << 10, "ssd.max_files": 1, "ssd.high_watermark": 1.0,
                                   "ssd.low_watermark": 0.9})
    write_pages(be, pool, ["keep0", "keep1"], [0, 1])  # 16 KiB: extent and round headers, data, record
    # legal 4054-byte keys: even a one-page round's record (8 KiB) makes its extent 20 KiB > 16 KiB
    keys = [f"{'k' * 4050}{i:04d}" for i in range(8)]
    got = be.batch_set_v1(keys, torch.arange(8 * pool.page_size) % (60 * pool.page_size))
    assert got == [False] * 8
    assert be.batch_exists(["keep0", "keep1"]) == 2  # nothing was reclaimed for a hopeless put
    assert be.flatcake_stats()["reclaimed_scopes_ssd"] == 0


def test_bad_keys_fail_the_put_and_leave_no_pinned_scope(make_backend):
    be, pool = make_backend()
    write_pages(be, pool, ["s1"], [0])
    assert be.batch_set_v1([None], slots_of(pool, [1]), HiCacheStorageExtraInfo(prefix_keys=["s1"])) == [False]
    assert be.batch_set_v1(["ok", "\ud800bad", "after"], slots_of(pool, [1, 2, 3])) == [True, False, False]
    assert be.store.index.get("s1").scope.refcount == 0
    be.clear()
    assert be.batch_exists(["s1"]) == 0 and len(be.store.index) == 0


def test_duplicate_keys_in_one_call_are_stored_once(make_backend):
    be, pool = make_backend()
    fill_page(pool, 0, "x")
    fill_page(pool, 4, "y")
    assert be.batch_set_v1(["x", "x", "y"], slots_of(pool, [0, 0, 1])) == [True, True, True]
    assert be.store.flush_writes(30)  # pages_written_ssd counts pages on disk
    assert be.flatcake_stats()["pages_written_ssd"] == 2


def test_host_indices_not_on_page_boundaries_are_refused(make_backend):
    be, pool = make_backend()
    fill_page(pool, 0, "a")
    bad = torch.arange(2, 6)  # slots 2..5 straddle pages 0 and 1 (page_size 4)
    assert be.batch_set_v1(["a"], bad) == [False]
    assert be.batch_exists(["a"]) == 0
    write_pages(be, pool, ["a"], [0])
    assert be.batch_get_v1(["a"], bad) == [False]
    assert be.batch_get_v1(["a"], torch.arange(4)) == [True]


def test_restore_of_dram_pages_issues_no_ssd_read(make_backend):
    be, pool = make_backend(extra={"dram.capacity_bytes": 1 << 20})
    keys = ["d0", "d1", "d2"]
    two_requests_share(be.batch_exists, keys)  # a shared prompt: placed on DRAM
    write_pages(be, pool, keys, range(3))
    before = be.flatcake_stats()
    assert be.batch_get_v1(keys, slots_of(pool, range(5, 8))) == [True] * 3
    after = be.flatcake_stats()
    assert after["hit_pages_dram"] - before["hit_pages_dram"] == 3
    assert (after["ssd_read_bytes"], after["ssd_read_ops"]) == (before["ssd_read_bytes"], before["ssd_read_ops"])


def test_missing_page_in_the_middle_reads_nothing_past_the_hole(make_backend):
    be, pool = make_backend()
    keys = [f"m{i}" for i in range(6)]
    write_pages(be, pool, keys[:2], [0, 1])
    write_pages(be, pool, keys[3:], [3, 4, 5])  # m2 never stored
    before = be.flatcake_stats()["ssd_read_bytes"]
    assert be.batch_get_v1(keys, slots_of(pool, range(10, 16))) == [True, True] + [False] * 4
    read = be.flatcake_stats()["ssd_read_bytes"] - before
    g = be.store.geometry
    # pages m0, m1 only: their round's chunks rounded out to 4 KiB blocks (+1 block of skew)
    assert 2 * g.page_bytes <= read <= -(-2 * g.page_bytes // 4096) * 4096 + 4096
    assert be.flatcake_stats()["hit_pages_ssd"] == 2


@pytest.mark.parametrize("fault", ["remove", "truncate"])
def test_replaced_pool_file_never_serves_old_bytes_even_without_checksums(make_backend, fault):
    """Readers cache fds; a pool file removed (or truncated) and recreated behind the backend
    must give misses for the old pages and correct bytes for the new ones."""
    import os

    be, pool = make_backend(extra={"cio.verify_checksums": False, "ssd.file_bytes": 2 << 20, "ssd.max_files": 1,
                                   "ssd.write_backlog_bytes": 0})  # synchronous: the put meeting the fault is False
    old = [[f"o{s}-{i}" for i in range(3)] for s in range(3)]
    for s, keys in enumerate(old):
        write_pages(be, pool, keys, range(s * 3, s * 3 + 3))
        assert be.batch_get_v1(keys, slots_of(pool, range(40, 43))) == [True] * 3  # fds now cached
    path = be.store.ssd.path_of(0)
    if fault == "remove":
        os.unlink(path)
    else:
        os.truncate(path, 0)
    new = [[f"n{s}-{i}" for i in range(3)] for s in range(3)]
    for s, keys in enumerate(new):
        if write_pages(be, pool, keys, range(20 + s * 3, 23 + s * 3)) != [True] * 3:  # the first detects the fault
            assert write_pages(be, pool, keys, range(20 + s * 3, 23 + s * 3)) == [True] * 3
    pool.kv_buffer.zero_()
    for keys in new:
        assert be.batch_get_v1(keys, slots_of(pool, range(40, 43))) == [True] * 3
        assert all(page_matches(pool, (40 + i) * pool.page_size, k) for i, k in enumerate(keys))
    for keys in old:
        got = be.batch_get_v1(keys, slots_of(pool, range(50, 53)))
        n = got.index(False) if False in got else 3
        assert all(page_matches(pool, (50 + i) * pool.page_size, keys[i]) for i in range(n))
        assert n == 0
