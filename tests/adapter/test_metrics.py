"""Metrics: SGLang's per-call storage metrics (``get_stats``) and FlatCake's own ``flatcake_*``
Prometheus metrics, against the real HiCacheStorage factory on host-pool doubles."""

from __future__ import annotations

import errno
import os
import sys
import types
from dataclasses import dataclass, field

import pytest
import flatcake_testkit as testkit
from flatcake_testkit import make_pool, slots_of, two_requests_share

from flatcake import metrics
from flatcake.adapter import storage


def write_pages(be, pool, keys, pages, prefix=()):
    """``testkit.write_pages``, then wait for the SSD write queue (``PageStore.flush_writes``): these
    tests inspect or damage the pool files, or count SSD pages, right after a write."""
    out = testkit.write_pages(be, pool, keys, pages, prefix)
    assert be.store.flush_writes(30)
    return out


GIB = 1 << 30


@dataclass
class _StorageMetrics:  # SGLang 0.5.23's dataclass; its module needs torchvision to import here
    prefetch_pgs: list = field(default_factory=list)
    backup_pgs: list = field(default_factory=list)
    prefetch_bandwidth: list = field(default_factory=list)
    backup_bandwidth: list = field(default_factory=list)


@pytest.fixture
def metered(make_backend, monkeypatch):
    """``metered(**make_backend kwargs)`` -> (backend, pool) with storage metrics on (as
    ``--enable-metrics`` sets them), a private Prometheus registry, and a clock that advances
    0.5 s per reading (so every store call lasts exactly 0.5 s)."""
    prom = pytest.importorskip("prometheus_client")
    mod = types.ModuleType("sglang.srt.observability.metrics_collector")
    mod.StorageMetrics = _StorageMetrics
    monkeypatch.setitem(sys.modules, "sglang.srt.observability.metrics_collector", mod)
    ticks = iter(range(10**6))
    monkeypatch.setattr(storage, "clock", lambda: 0.5 * next(ticks))

    def _make(**kw):
        be, pool = make_backend(**kw)
        be.storage_config.enable_storage_metrics = True
        be.prometheus_registry = prom.CollectorRegistry()
        return be, pool

    return _make


def _labels(be, **extra):
    return {"pool": be.store.ssd.prefix, "tp_rank": "0", "pp_rank": "0", "dp_rank": "0", **extra}


def _sample(be, name, **extra):
    return be.prometheus_registry.get_sample_value(name, _labels(be, **extra))


def test_backup_pgs_count_only_pages_this_call_wrote(metered):
    be, pool = metered()
    page_bytes = be.layout.geometry.page_bytes
    keys = [f"b{i}" for i in range(8)]
    assert write_pages(be, pool, keys[:4], range(4)) == [True] * 4
    be.get_stats()  # drain
    assert write_pages(be, pool, keys, range(8)) == [True] * 8  # the first 4 were already stored
    m = be.get_stats()
    assert m.backup_pgs == [4]
    # 4 pages in 0.5 s, in SGLang's "GB/s" (2**30 bytes, as its Mooncake backend divides)
    assert m.backup_bandwidth == [pytest.approx(4 * page_bytes / 0.5 / GIB)]
    assert write_pages(be, pool, keys, range(8)) == [True] * 8  # all held: nothing written
    assert be.get_stats().backup_pgs == []


def test_a_failed_put_contributes_nothing(metered, monkeypatch):
    be, pool = metered(extra={"ssd.write_backlog_bytes": 0})  # synchronous: the write fault fails the put itself
    real = os.pwritev

    def refuse(fd, bufs, off):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(os, "pwritev", refuse)
    assert write_pages(be, pool, ["f0", "f1"], [0, 1]) == [False, False]
    m = be.get_stats()
    assert (m.backup_pgs, m.backup_bandwidth) == ([], [])
    assert _sample(be, "flatcake_put_failures_total") == be.flatcake_stats()["put_failures"] >= 1
    monkeypatch.setattr(os, "pwritev", real)
    assert write_pages(be, pool, ["f0", "f1", "f2"], [0, 1, 2]) == [True] * 3
    assert be.get_stats().backup_pgs == [3]


def test_prefetch_pgs_are_the_pages_read(metered):
    be, pool = metered()
    page_bytes = be.layout.geometry.page_bytes
    keys = [f"p{i}" for i in range(8)]
    write_pages(be, pool, keys[:6], range(6))
    be.get_stats()
    assert be.batch_get_v1(keys, slots_of(pool, range(20, 28))) == [True] * 6 + [False] * 2
    assert be.batch_get_v1(["absent"], slots_of(pool, [30])) == [False]  # nothing read: no entry
    got = be.batch_get(keys[:3], [pool.get_dummy_flat_data_page() for _ in range(3)])  # generic path
    assert all(t is not None for t in got)
    m = be.get_stats()
    assert m.prefetch_pgs == [6, 3]
    assert m.prefetch_bandwidth == [pytest.approx(6 * page_bytes / 0.5 / GIB), pytest.approx(3 * page_bytes / 0.5 / GIB)]


def test_generic_batch_set_counts_only_new_pages(metered):
    be, pool = metered()
    write_pages(be, pool, ["g0"], [0])
    be.get_stats()
    write_pages(be, pool, ["g1"], [1])  # fills page 1 with g1's bytes
    be.get_stats()
    pages = [pool.get_data_page(i * pool.page_size) for i in range(3)]
    assert be.batch_set(["g0", "g1", "g2"], pages) is True
    assert be.get_stats().backup_pgs == [1]


def test_flatcake_metrics_equal_the_store_counters(metered):
    be, pool = metered(extra={"dram.capacity_bytes": 1 << 20, "placement.shared_refcount": 2})
    shared, own = [f"s{i}" for i in range(4)], [f"o{i}" for i in range(3)]
    two_requests_share(be.batch_exists, shared)  # a shared prompt: placed in DRAM
    write_pages(be, pool, shared, range(4))
    write_pages(be, pool, own, range(4, 7))
    assert {be.store.medium_of(k) for k in shared} == {"dram"} and {be.store.medium_of(k) for k in own} == {"ssd"}
    assert be.batch_get_v1(shared, slots_of(pool, range(10, 14))) == [True] * 4
    assert be.batch_get_v1(own, slots_of(pool, range(20, 23))) == [True] * 3
    be.get_stats()
    st = be.flatcake_stats()
    assert (st["hit_pages_dram"], st["hit_pages_ssd"]) == (4, 3)
    assert _sample(be, "flatcake_hit_pages_total", medium="dram") == 4
    assert _sample(be, "flatcake_hit_pages_total", medium="ssd") == 3
    assert _sample(be, "flatcake_pages_written_total", medium="dram") == st["pages_written_dram"] == 4
    assert _sample(be, "flatcake_pages_written_total", medium="ssd") == st["pages_written_ssd"] == 3
    assert _sample(be, "flatcake_restores_total") == st["ssd_restores"] == 1  # one read call needed the SSD
    assert _sample(be, "flatcake_merged_reads_total") == st["merged_reads"] >= 1
    assert _sample(be, "flatcake_ssd_read_bytes_total") == st["ssd_read_bytes"] > 0
    for medium in ("dram", "ssd"):
        m = st["media"][medium]
        assert _sample(be, "flatcake_used_bytes", medium=medium) == m["used_bytes"] > 0
        assert _sample(be, "flatcake_capacity_bytes", medium=medium) == m["capacity_bytes"] > 0
        assert _sample(be, "flatcake_medium_state", medium=medium, state="healthy") == 1
        assert _sample(be, "flatcake_medium_state", medium=medium, state="degraded") == 0
    assert _sample(be, "flatcake_pages_indexed") == st["pages_indexed"] == 7
    assert _sample(be, "flatcake_quarantined_scopes_total") == 0


def test_reclaim_and_refresh_cadence(metered):
    be, pool = metered()
    write_pages(be, pool, ["r0", "r1"], [0, 1])
    be.get_stats()
    be.clear()  # every scope reclaimed
    be.get_stats()  # within REFRESH_S of the last refresh (the test clock moved 0.5 s): not yet
    assert _sample(be, "flatcake_reclaimed_scopes_total", medium="ssd") == 0
    be.refresh_metrics(force=True)
    assert _sample(be, "flatcake_reclaimed_scopes_total", medium="ssd") == be.flatcake_stats()["reclaimed_scopes_ssd"] >= 1
    assert _sample(be, "flatcake_pages_indexed") == 0


def test_counters_stay_monotonic_when_the_store_is_reopened(metered):
    be, pool = metered()
    write_pages(be, pool, ["m0", "m1"], [0, 1])
    be.batch_get_v1(["m0", "m1"], slots_of(pool, [5, 6]))
    be.get_stats()
    assert _sample(be, "flatcake_hit_pages_total", medium="ssd") == 2
    be.register_mem_pool_host(pool)  # a new store: its counters restart at 0
    be.batch_get_v1(["m0"], slots_of(pool, [7]))  # rebuilt from the pool's journal
    be.refresh_metrics(force=True)
    assert be.flatcake_stats()["hit_pages_ssd"] == 1
    assert _sample(be, "flatcake_hit_pages_total", medium="ssd") == 3


def test_a_re_registered_store_in_another_pool_is_labelled_with_that_pool(metered):
    """The ``pool`` label follows the open store: a host pool with another page size opens
    another pool (another namespace), and its metrics carry that pool's prefix."""
    be, pool = metered()
    write_pages(be, pool, ["p0"], [0])
    be.refresh_metrics(force=True)
    first = be.store.ssd.prefix
    assert _sample(be, "flatcake_pages_written_total", medium="ssd") == 1
    other = make_pool(page_size=pool.page_size * 2)
    be.register_mem_pool_host(other)
    assert be.store.ssd.prefix != first
    write_pages(be, other, ["q0", "q1"], [0, 1])
    be.refresh_metrics(force=True)
    assert _sample(be, "flatcake_pages_written_total", medium="ssd") == 2  # under the new pool label
    assert be.prometheus_registry.get_sample_value(
        "flatcake_pages_written_total", {**_labels(be, medium="ssd"), "pool": first}) == 1

def test_metrics_off_exports_nothing(make_backend):
    prom = pytest.importorskip("prometheus_client")
    be, pool = make_backend()
    be.prometheus_registry = prom.CollectorRegistry()
    write_pages(be, pool, ["x0"], [0])
    assert be.get_stats() is None
    be.refresh_metrics(force=True)
    assert not [m for m in be.prometheus_registry.collect() if m.name.startswith("flatcake_")]


def test_without_prometheus_client_start_up_and_get_stats_still_work(metered, monkeypatch):
    be, pool = metered()
    monkeypatch.setitem(sys.modules, "prometheus_client", None)  # import fails
    assert metrics.make_exporter({"pool": "p"}) is None
    write_pages(be, pool, ["n0"], [0])
    assert be.get_stats().backup_pgs == [1]
    assert not list(be.prometheus_registry.collect())


def test_metrics_reach_another_process_through_prometheus_multiprocess_files(tmp_path):
    """SGLang's /metrics (``--enable-metrics``) is served by its HTTP process from the files the
    scheduler process writes into PROMETHEUS_MULTIPROC_DIR: values FlatCake sets in one process
    are read in another, as SGLang's MultiProcessCollector reads them."""
    import subprocess

    prom = pytest.importorskip("prometheus_client")
    from prometheus_client import multiprocess

    code = ("from flatcake.metrics import make_exporter\n"
            "e = make_exporter({'pool': 'fc-test', 'tp_rank': 1})\n"
            "e.update({'hit_pages_ssd': 5, 'pages_indexed': 3, 'media': {'ssd': {'state': 'degraded',"
            " 'used_bytes': 10, 'capacity_bytes': 20, 'files_out_of_service': [2]}}})\n"
            "e.update({'hit_pages_ssd': 7})\n")
    env = {**os.environ, "PROMETHEUS_MULTIPROC_DIR": str(tmp_path)}
    subprocess.run([sys.executable, "-c", code], env=env, check=True, timeout=120)
    reg = prom.CollectorRegistry()
    multiprocess.MultiProcessCollector(reg, path=str(tmp_path))
    lab = {"pool": "fc-test", "tp_rank": "1", "pp_rank": "", "dp_rank": ""}
    assert reg.get_sample_value("flatcake_hit_pages_total", {**lab, "medium": "ssd"}) == 7
    assert reg.get_sample_value("flatcake_pages_indexed", lab) == 3
    assert reg.get_sample_value("flatcake_medium_state", {**lab, "medium": "ssd", "state": "degraded"}) == 1
    assert reg.get_sample_value("flatcake_ssd_files_out_of_service", lab) == 1


def test_put_counted_counts_new_pages_only(ssd_dir):
    from flatcake_testkit import fill_page, make_store

    store, pool, lay = make_store(ssd_dir)
    for i, k in enumerate(["c0", "c1", "c2", "c3"]):
        fill_page(pool, i * pool.page_size, k)
    assert store.put_counted(["c0", "c1"], lay, [0, 1]) == ([True, True], 2)
    assert store.put_counted(["c0", "c1", "c2", "c3", "c3"], lay, [0, 1, 2, 3, 3]) == ([True] * 5, 2)  # c3 twice: once
    assert store.put_counted(["c0"], lay, [0]) == ([True], 0)
    store.close()
    assert store.put_counted(["c9"], lay, [0]) == ([False], 0)


def test_restores_count_read_calls_not_merged_reads(metered):
    """``flatcake_restores_total`` counts FC-CIO restores (one per read call that needs the SSD);
    the ranges the restores plan are ``flatcake_merged_reads_total``: two pages written by two
    puts lie in two rounds, apart on the SSD, so one restore of both plans two merged reads when
    no hole is bridged."""
    be, pool = metered(extra={"cio.gap_bytes": 0})
    write_pages(be, pool, ["x0"], [0])
    write_pages(be, pool, ["y0"], [1])
    assert be.batch_get_v1(["x0", "y0"], slots_of(pool, [10, 11])) == [True, True]
    be.refresh_metrics(force=True)
    st = be.flatcake_stats()
    assert _sample(be, "flatcake_restores_total") == st["ssd_restores"] == 1
    assert _sample(be, "flatcake_merged_reads_total") == st["merged_reads"] == 2


def _calls(be, method):
    return be.flatcake_stats()["sglang_calls"][method]


def test_sglang_calls_are_counted_per_method_with_their_pages(metered):
    """Every method SGLang calls is counted: calls, pages asked and the answer (the leading run
    present, pages delivered, pages reported stored); the generic one-page ``get``/``set`` count
    as themselves only, not also as ``batch_get``/``batch_set``."""
    be, pool = metered()
    keys = [f"c{i}" for i in range(5)]
    assert write_pages(be, pool, keys[:3], range(3)) == [True] * 3
    assert write_pages(be, pool, keys[:4], range(4)) == [True] * 4  # 3 already held: still "stored"
    assert be.batch_exists(keys) == 4
    assert be.batch_exists(["absent"] + keys) == 0
    assert be.batch_get_v1(keys, slots_of(pool, range(10, 15))) == [True] * 4 + [False]
    got = be.batch_get(keys[:2] + ["absent"], [pool.get_dummy_flat_data_page() for _ in range(3)])
    assert [g is not None for g in got] == [True, True, False]
    assert be.batch_set(["g0", "g1"], [pool.get_data_page(i * pool.page_size) for i in range(2)]) is True
    assert be.exists("c0") and not be.exists("absent")
    assert be.get("c1", pool.get_dummy_flat_data_page()) is not None and be.get("absent") is None
    assert be.set("s0", pool.get_data_page(0)) is True
    calls = be.flatcake_stats()["sglang_calls"]
    assert calls["batch_set_v1"] == {"calls": 2, "asked": 7, "stored": 7}
    assert calls["batch_exists"] == {"calls": 2, "asked": 11, "present": 4}
    assert calls["batch_get_v1"] == {"calls": 1, "asked": 5, "delivered": 4}
    assert calls["batch_get"] == {"calls": 1, "asked": 3, "delivered": 2}
    assert calls["batch_set"] == {"calls": 1, "asked": 2, "stored": 2}
    assert calls["exists"] == {"calls": 2, "asked": 2, "present": 1}
    assert calls["get"] == {"calls": 2, "asked": 2, "delivered": 1}
    assert calls["set"] == {"calls": 1, "asked": 1, "stored": 1}
    be.refresh_metrics(force=True)
    for method, c in calls.items():
        assert _sample(be, "flatcake_sglang_calls_total", method=method) == c["calls"]
        for what, pages in c.items():
            if what != "calls":
                assert _sample(be, "flatcake_sglang_call_pages_total", method=method, what=what) == pages


def test_a_failed_put_is_counted_as_asked_not_stored(metered, monkeypatch):
    be, pool = metered(extra={"ssd.write_backlog_bytes": 0})

    def refuse(fd, bufs, off):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(os, "pwritev", refuse)
    assert write_pages(be, pool, ["f0", "f1"], [0, 1]) == [False, False]
    assert _calls(be, "batch_set_v1") == {"calls": 1, "asked": 2, "stored": 0}


def test_call_counters_go_on_when_the_store_is_reopened(metered):
    """The call counters belong to the adapter, not the store: a re-registered host pool (a
    new store, whose own counters restart at 0) neither resets nor re-exports them."""
    be, pool = metered()
    write_pages(be, pool, ["m0", "m1"], [0, 1])
    be.batch_exists(["m0", "m1"])
    be.refresh_metrics(force=True)
    be.register_mem_pool_host(pool)
    be.batch_exists(["m0"])
    be.refresh_metrics(force=True)
    assert _calls(be, "batch_exists") == {"calls": 2, "asked": 3, "present": 3}
    assert _sample(be, "flatcake_sglang_calls_total", method="batch_exists") == 2
    assert _sample(be, "flatcake_sglang_call_pages_total", method="batch_exists", what="present") == 3
    assert _sample(be, "flatcake_sglang_calls_total", method="batch_set_v1") == 1


def test_the_fc_mas_plugin_lanes_reach_flatcake_stats_and_metrics(metered):
    from flatcake.mas.lanes import LaneOp, MediumAwareLanes

    be, pool = metered()
    lanes = MediumAwareLanes(ssd_workers=1)
    be.prefetch_lanes = lanes  # as flatcake.adapter.plugin.PrefetchLanes attaches them
    ops = [LaneOp("restore", 0.0, 0, 4, 4 << 20, lambda: None), LaneOp("dram", 1.0, 4, 0, 0, lambda: None)]
    for op in ops:
        lanes.submit(op)
    assert all(op.wait(5) for op in ops)
    lanes.close()
    st = be.flatcake_stats()["mas_lanes"]
    assert (st["dram"], st["ssd"]) == (1, 1) and st["overtakes"] == lanes.stats()["overtakes"]
    be.refresh_metrics(force=True)
    assert _sample(be, "flatcake_mas_prefetches_total", lane="dram") == 1
    assert _sample(be, "flatcake_mas_prefetches_total", lane="ssd") == 1
    assert _sample(be, "flatcake_mas_overtakes_total") == st["overtakes"]


def test_a_drain_between_a_call_and_its_count_loses_no_page(metered, monkeypatch):
    """Issue 24 item 9: SGLang's collector drains get_stats() while a backup thread is between
    reading the clock and appending its count; the count lands in the next drain, exactly once."""
    be, pool = metered()
    drained = []
    real = storage._now
    armed = {"on": False}

    def now():  # the drain runs at the instant the call ends (before its count is appended)
        t = real()
        if armed["on"]:
            armed["on"] = False
            drained.append(be.get_stats())
        return t

    monkeypatch.setattr(storage, "_now", now)
    be.get_stats()
    armed["on"] = True
    keys = [f"race{i}" for i in range(5)]
    assert write_pages(be, pool, keys, range(5)) == [True] * 5
    assert len(drained) == 1 and drained[0].backup_pgs == []  # the drain came first
    after = be.get_stats()
    assert after.backup_pgs == [5] and len(after.backup_bandwidth) == 1
    assert be.get_stats().backup_pgs == []  # counted once


def test_evicted_queued_rounds_and_cluster_store_resets_are_counters():
    """The write queue's evictions (issue 24 item 3) and the cluster's store resets (item 7, from
    ``flatcake_stats()["cluster"]``) reach Prometheus as counters that only grow by the deltas."""
    prom = pytest.importorskip("prometheus_client")
    reg = prom.CollectorRegistry()
    ex = metrics.FlatCakeMetrics({"pool": "p", "tp_rank": 0, "pp_rank": 0, "dp_rank": 0}, reg)
    lab = {"pool": "p", "tp_rank": "0", "pp_rank": "0", "dp_rank": "0"}
    ex.update({"write_backlog_evicted_rounds": 3, "cluster": {"store_resets": 1, "leases_lost": 1}})
    ex.update({"write_backlog_evicted_rounds": 5, "cluster": {"store_resets": 2}})
    assert reg.get_sample_value("flatcake_write_backlog_evicted_rounds_total", lab) == 5
    assert reg.get_sample_value("flatcake_cluster_store_resets_total", lab) == 2
    ex.update({"write_backlog_evicted_rounds": 5})  # no cluster: the counter stays where it was
    assert reg.get_sample_value("flatcake_cluster_store_resets_total", lab) == 2
