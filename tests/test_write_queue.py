"""Reads first, writes in the gaps (Tutti, design notes §3; docs/design.md "Write queue"): SSD
rounds wait in the write queue while restores are in flight, are served from their in-memory
copy meanwhile, and are published (journal, SSD index) only once written. No timing: reads are
held with the queue's own read marks or an event inside the restore."""

import errno
import os
import threading
import time

import numpy as np
import pytest
import torch
from flatcake_testkit import fill_page, make_store, page_matches, put_pages

from flatcake.store import native_write
from flatcake.store.deferred_round import PreparedRound, write_prepared
from flatcake.gva import journal as jmod
from flatcake.gva.address import MEDIUM_SSD
from flatcake.store.stats import StoreStats, write_rates
from flatcake.store.write_queue import MEDIUM_QUEUED, WriteQueue

#: writes wait for reads for as long as a test holds one (the bound on deferral is tested on its own)
HOLD = {"ssd.write_defer_max_s": 3600.0, "ssd.write_urgent_fraction": 1.0}
BACKLOG = {"ssd.write_backlog_bytes": 64 << 20, **HOLD}


def until_writer_held(q) -> None:
    """Wait (no time limit asserted) until the writer thread waits for the reads in flight."""
    for _ in range(30000):
        if q.writer_held:
            return
        time.sleep(0.001)
    raise AssertionError("the writer never waited for the reads in flight")


def rounds_in_journal(store) -> list:
    return [e for e in jmod.read_journal(store.ssd.journal_path) if e.kind == jmod.ROUND]


def keys_of(name: str, n: int = 2) -> list[str]:
    return [f"{name}{i}" for i in range(n)]


def test_the_queue_is_on_by_default_with_a_1_gib_bound_capped_by_a_quarter_of_the_pool(ssd_dir):
    store, pool, lay = make_store(ssd_dir, **HOLD)  # a 32 MiB pool: its queue may pin 8 MiB of it
    assert store.queue is not None and store.queue.backlog_limit == 8 << 20 and store.queue.budget.limit == 1 << 30
    assert store.snapshot_stats()["write_backlog_limit_bytes"] == 8 << 20
    assert store.snapshot_stats()["write_backlog_rank_limit_bytes"] == 1 << 30
    big, _, _ = make_store(ssd_dir + "-big", **{**HOLD, "ssd.file_bytes": 2 << 30, "ssd.max_files": 8,
                                                  "ssd.preallocate": False})
    assert big.queue.backlog_limit == 1 << 30  # a 16 GiB pool: the configured 1 GiB
    big.close()
    store.queue.reads_begin()
    assert put_pages(store, pool, lay, keys_of("d"), [0, 1]) == [True, True]
    assert store.medium_of("d0") == "queued" and not store.flush_writes(0)
    store.queue.reads_end()
    assert store.flush_writes(30) and store.medium_of("d0") == "ssd" and len(rounds_in_journal(store)) == 1
    store.close()


# ---------------------------------------------------------------- held while reading, drained after
def test_a_round_put_while_a_read_is_in_flight_waits_and_is_written_after_it(ssd_dir):
    store, pool, lay = make_store(ssd_dir, **BACKLOG)
    q = store.queue
    q.reads_begin()  # a restore read is in flight
    keys = keys_of("a", 3)
    assert put_pages(store, pool, lay, keys, [0, 1, 2]) == [True] * 3
    snap = store.snapshot_stats()
    assert snap["ssd_write_bytes"] == 0 and snap["queued_rounds"] == 1
    assert snap["write_backlog_pages"] == 3 and snap["write_backlog_bytes"] == q.snapshot()["write_backlog_bytes"] > 0
    assert rounds_in_journal(store) == [] and store.index.get("a0") is None  # not published on SSD yet
    assert [store.medium_of(k) for k in keys] == ["queued"] * 3
    q.reads_end()
    assert q.flush(30)
    snap = store.snapshot_stats()
    assert snap["write_backlog_pages"] == 0 and snap["write_backlog_bytes"] == 0 and snap["ssd_write_bytes"] > 0
    assert [store.medium_of(k) for k in keys] == ["ssd"] * 3
    (entry,) = rounds_in_journal(store)
    assert entry.scope_id == store.page_info("a0").scope_id
    assert store.get(keys, lay, [10, 11, 12]) == [True] * 3
    assert all(page_matches(pool, (10 + i) * pool.page_size, k) for i, k in enumerate(keys))
    assert store.snapshot_stats()["hit_pages_ssd"] == 3
    store.close()


def test_the_read_path_marks_its_restore_in_flight_and_the_write_waits_for_it(ssd_dir):
    store, pool, lay = make_store(ssd_dir, **BACKLOG)
    old = keys_of("old")
    put_pages(store, pool, lay, old, [0, 1])
    assert store.queue.flush(30)
    inside, go = threading.Event(), threading.Event()
    real = store.cio.restore

    def held_restore(batch, layout):
        inside.set()
        go.wait(30)
        return real(batch, layout)

    store.cio.restore = held_restore
    res = {}
    t = threading.Thread(target=lambda: res.update(ok=store.get(old, lay, [20, 21])))
    t.start()
    assert inside.wait(30)
    written = store.snapshot_stats()["ssd_write_bytes"]
    new = keys_of("new")
    assert put_pages(store, pool, lay, new, [2, 3]) == [True, True]
    assert store.queue.reads_in_flight == 1
    assert store.snapshot_stats()["ssd_write_bytes"] == written  # held behind the read
    assert store.medium_of("new0") == "queued"
    until_writer_held(store.queue)
    go.set()
    t.join(30)
    assert res["ok"] == [True, True] and page_matches(pool, 20 * pool.page_size, "old0")
    assert store.queue.flush(30)
    assert store.snapshot_stats()["ssd_write_bytes"] > written and store.medium_of("new1") == "ssd"
    assert store.snapshot_stats()["write_deferred_s"] > 0
    store.close()


# ---------------------------------------------------------------- a queued page is a hit, from memory
def test_a_queued_page_is_a_hit_and_reads_bit_exact_from_its_in_memory_copy(ssd_dir):
    store, pool, lay = make_store(ssd_dir, **BACKLOG)
    store.queue.reads_begin()
    first = keys_of("p", 2)
    put_pages(store, pool, lay, first, [0, 1])
    store.queue.reads_end()
    assert store.queue.flush(30)  # on SSD
    store.queue.reads_begin()
    second = ["p2", "p3"]
    assert put_pages(store, pool, lay, second, [2, 3], prefix=first) == [True, True]
    for p, k in ((2, "x2"), (3, "x3")):  # the host pool reuses its pages after the put
        fill_page(pool, p * pool.page_size, k)
    keys = first + second
    assert store.leading_run(keys) == 4 and all(store.exists(k) for k in second)
    assert store.page_info("p2").scope_id == store.page_info("p0").scope_id  # same session scope
    summary = store.medium_summary(keys)
    assert (summary.dram_pages, summary.ssd_pages, summary.media) == (2, 2, ("ssd", "ssd", "queued", "queued"))
    entries = store.queue.pin_leading_run(keys, store.index)
    assert [e.gva >> 60 for e in entries] == [MEDIUM_SSD, MEDIUM_SSD, MEDIUM_QUEUED, MEDIUM_QUEUED]
    store.scopes.unpin(entries)
    store.queue.release(entries)
    assert store.get(keys, lay, [30, 31, 32, 33]) == [True] * 4  # SSD pages restored, queued ones copied
    for i, k in enumerate(keys):
        assert page_matches(pool, (30 + i) * pool.page_size, k)
    snap = store.snapshot_stats()
    assert (snap["queued_hit_pages"], snap["hit_pages_ssd"]) == (2, 2)
    store.queue.reads_end()
    assert store.queue.flush(30)
    assert store.get(keys, lay, [40, 41, 42, 43]) == [True] * 4
    for i, k in enumerate(keys):
        assert page_matches(pool, (40 + i) * pool.page_size, k)
    store.close()


def test_queued_pages_are_read_from_memory_while_the_writer_is_held(ssd_dir):
    store, pool, lay = make_store(ssd_dir, **BACKLOG)
    store.queue.reads_begin()  # held for the whole test: nothing reaches the disk
    keys = keys_of("m", 3)
    put_pages(store, pool, lay, keys, [0, 1, 2])
    for p in range(3):
        fill_page(pool, p * pool.page_size, f"junk{p}")
    assert store.get(keys, lay, [5, 6, 7]) == [True] * 3
    assert all(page_matches(pool, (5 + i) * pool.page_size, k) for i, k in enumerate(keys))
    snap = store.snapshot_stats()
    assert (snap["queued_hit_pages"], snap["hit_pages_ssd"], snap["ssd_write_bytes"], snap["ssd_read_bytes"]) == (3, 0, 0, 0)
    store.queue.reads_end()
    store.close()


# ---------------------------------------------------------------- backlog at its bound
def test_a_full_backlog_places_on_dram_then_drops_one_shot_rounds_whole_then_fails_or_waits(ssd_dir):
    store, pool, lay = make_store(ssd_dir, **{**HOLD, "ssd.write_backlog_bytes": 4096, "ssd.write_backlog_wait_s": 0.0,
                                              "dram.capacity_bytes": 2 * 1536, "dram.high_watermark": 1.0,
                                              "placement.l_agent_tokens": 64})
    q = store.queue
    q.urgent_bytes = q.urgent_fraction = float("inf")  # one round over the bound would make writes urgent at once
    q.reads_begin()
    assert put_pages(store, pool, lay, keys_of("a"), [0, 1]) == [True, True]  # queued (takes the queue)
    assert store.medium_of("a0") == "queued"
    assert put_pages(store, pool, lay, keys_of("b"), [2, 3]) == [True, True]  # backlog full: DRAM has room
    assert store.medium_of("b0") == "dram"
    assert put_pages(store, pool, lay, keys_of("c"), [4, 5]) == [False, False]  # one-shot, DRAM full: dropped
    assert store.leading_run(keys_of("c")) == 0 and store.page_info("c0") is None
    prefix = [f"ctx{i}" for i in range(20)]  # 80 tokens of context: an agent-session round
    assert put_pages(store, pool, lay, keys_of("d"), [6, 7], prefix=prefix) == [False, False]  # no wait: fails
    snap = store.snapshot_stats()
    assert (snap["write_backlog_dram_rounds"], snap["write_backlog_dropped_rounds"], snap["write_backlog_dropped_pages"],
            snap["write_backlog_full_failures"]) == (1, 1, 2, 1)
    store.backup.backlog_wait_s = 60.0  # now an agent round waits for room
    res = {}
    t = threading.Thread(target=lambda: res.update(ok=put_pages(store, pool, lay, keys_of("e"), [8, 9], prefix=prefix)))
    t.start()
    t.join(0.2)
    assert t.is_alive()  # cannot finish: the backlog is full while the read is in flight
    q.reads_end()
    t.join(30)
    assert res["ok"] == [True, True]
    assert q.flush(30)
    assert store.get(keys_of("a") + ["zz"], lay, [20, 21, 22]) == [True, True, False]
    assert store.get(keys_of("b"), lay, [23, 24]) == [True, True] and store.get(keys_of("e"), lay, [25, 26]) == [True, True]
    for slot, k in zip((20, 21, 23, 24, 25, 26), ("a0", "a1", "b0", "b1", "e0", "e1")):
        assert page_matches(pool, slot * pool.page_size, k)
    assert store.medium_of("e0") == "ssd" and store.page_info("e0").reuse == "overflow"  # DRAM full: the overflow row
    store.close()


# ---------------------------------------------------------------- a deferred write that fails
def test_a_deferred_write_fault_is_a_later_miss_counted_once_and_nothing_else_is_lost(ssd_dir, caplog):
    store, pool, lay = make_store(ssd_dir, **BACKLOG)
    keep = keys_of("k")
    put_pages(store, pool, lay, keep, [0, 1])
    assert store.queue.flush(30)
    real = store.ssd.write

    def failing_write(file_index, offset, buf, generation=None, pwrite=None):
        raise OSError(errno.ENOSPC, "no space left (injected)")

    store.queue.reads_begin()
    lost = keys_of("f", 3)
    assert put_pages(store, pool, lay, lost, [2, 3, 4]) == [True] * 3  # accepted into the queue
    assert store.leading_run(lost) == 3
    store.ssd.write = failing_write
    store.queue.reads_end()
    assert store.queue.flush(30)
    store.ssd.write = real
    assert store.leading_run(lost) == 0 and store.get(lost, lay, [10, 11, 12]) == [False] * 3
    snap = store.snapshot_stats()
    assert (snap["deferred_write_failures"], snap["deferred_write_failed_pages"], snap["put_failures"]) == (1, 3, 1)
    assert snap["errors"].get("deferred write/ENOSPC") == 1
    assert [e.scope_id for e in rounds_in_journal(store)] == [store.page_info("k0").scope_id]  # only the kept round
    assert store.get(keep, lay, [13, 14]) == [True, True] and page_matches(pool, 14 * pool.page_size, "k1")
    assert put_pages(store, pool, lay, lost, [2, 3, 4]) == [True] * 3  # stored again later
    assert store.queue.flush(30) and store.get(lost, lay, [10, 11, 12]) == [True] * 3
    store.close()


# ---------------------------------------------------------------- reclaim, clear, close
def test_a_scope_with_a_queued_round_is_not_reclaimed_and_clear_discards_the_round(ssd_dir):
    store, pool, lay = make_store(ssd_dir, **BACKLOG)
    store.queue.reads_begin()
    keys = keys_of("r", 3)
    put_pages(store, pool, lay, keys, [0, 1, 2])
    with store.scopes.lock:
        assert store.scopes.reclaim_one_locked(MEDIUM_SSD) is False  # pinned by its queued round
    assert store.leading_run(keys) == 3
    used = store.ssd.used_bytes
    assert used > 0
    store.clear()
    assert store.leading_run(keys) == 0 and store.get(keys, lay, [5, 6, 7]) == [False] * 3
    assert store.snapshot_stats()["write_backlog_pages"] == 0  # taken out of the queue, never written
    store.queue.reads_end()
    assert store.queue.flush(30)
    snap = store.snapshot_stats()
    assert (snap["ssd_write_bytes"], snap["write_backlog_discarded_rounds"], store.ssd.used_bytes) == (0, 1, 0)
    assert rounds_in_journal(store) == [] and len(store.index) == 0
    store.close()


def test_close_drains_the_queue_so_a_warm_restart_serves_it(ssd_dir):
    store, pool, lay = make_store(ssd_dir, **BACKLOG)
    store.queue.reads_begin()  # a read mark left behind does not hold the drain at close
    keys = keys_of("w", 3)
    put_pages(store, pool, lay, keys, [0, 1, 2])
    store.close()
    store2, _, _ = make_store(ssd_dir, **BACKLOG)
    assert store2.rebuilt.pages == 3 and store2.leading_run(keys) == 3
    assert store2.get(keys, lay, [10, 11, 12]) == [True] * 3
    assert all(page_matches(pool, (10 + i) * pool.page_size, k) for i, k in enumerate(keys))
    store2.close()


def test_close_drops_what_it_cannot_drain_and_a_restart_does_not_find_it(ssd_dir, monkeypatch):
    import flatcake.store.backup as backup_mod

    store, pool, lay = make_store(ssd_dir, **BACKLOG)
    keep = keys_of("k")
    put_pages(store, pool, lay, keep, [0, 1])
    assert store.queue.flush(30)
    started, release = threading.Event(), threading.Event()

    def stuck_write(*a, **kw):  # the first queued round's write never completes
        started.set()
        release.wait(30)
        raise OSError(errno.ECANCELED, "cancelled (injected)")

    monkeypatch.setattr(backup_mod, "write_prepared", stuck_write)
    put_pages(store, pool, lay, keys_of("s"), [2, 3])
    assert started.wait(30)
    put_pages(store, pool, lay, keys_of("t"), [4, 5])  # waits behind the stuck one
    store.close(timeout_s=0.1)
    release.set()
    snap = store.stats.snapshot()
    assert snap["write_backlog_discarded_rounds"] == 1
    monkeypatch.undo()
    store2, _, _ = make_store(ssd_dir, **BACKLOG)
    assert store2.leading_run(keep) == 2 and store2.leading_run(keys_of("s")) == 0 and store2.leading_run(keys_of("t")) == 0
    assert [e.scope_id for e in rounds_in_journal(store2)] == [store2.page_info("k0").scope_id]
    store2.close()


# ---------------------------------------------------------------- the pieces on their own
def test_write_rates_are_bytes_per_hour_and_drive_writes_per_day():
    assert write_rates(3600, 3600.0, 86400) == {"ssd_write_bytes_per_hour": 3600.0, "ssd_dwpd": 1.0}
    assert write_rates(10, 0.0, 100) == {"ssd_write_bytes_per_hour": 0.0, "ssd_dwpd": 0.0}
    assert write_rates(100, 1.0, 0)["ssd_dwpd"] == 0.0


def test_store_stats_report_dwpd_for_the_configured_capacity(ssd_dir):
    store, pool, lay = make_store(ssd_dir, **BACKLOG)
    put_pages(store, pool, lay, keys_of("s"), [0, 1])
    assert store.queue.flush(30)
    snap = store.snapshot_stats()
    cap = 4 * (8 << 20)
    assert snap["ssd_write_bytes"] > 0 and snap["ssd_write_bytes_per_hour"] > 0
    assert snap["ssd_dwpd"] == pytest.approx(snap["ssd_write_bytes_per_hour"] * 24 / cap)
    assert snap["write_backlog_limit_bytes"] == 8 << 20  # a quarter of the 32 MiB pool (64 MiB configured)
    assert snap["write_backlog_rank_limit_bytes"] == 64 << 20
    store.close()


def test_without_a_backlog_rounds_are_written_by_the_put_itself(ssd_dir):
    store, pool, lay = make_store(ssd_dir, **{"ssd.write_backlog_bytes": 0})  # the opt-out: no queue
    assert store.queue is None
    put_pages(store, pool, lay, keys_of("y"), [0, 1])
    assert store.medium_of("y0") == "ssd" and len(rounds_in_journal(store)) == 1
    snap = store.snapshot_stats()
    assert (snap["write_backlog_bytes"], snap["queued_rounds"]) == (0, 0)
    store.close()


class _Job:
    def __init__(self, keys, nbytes=4096):
        self.plc = type("P", (), {"keys": keys, "scope": type("S", (), {"doomed": False, "retired": False})()})()
        self.prepared = type("R", (), {"layout": type("L", (), {"total_bytes": nbytes})()})()
        self.parent = None
        self.enqueued_s = 0.0
        self.readers, self.done = 0, False

    keys = property(lambda self: self.plc.keys)
    nbytes = 4096
    alive = property(lambda self: True)


def test_the_writer_starts_nothing_while_a_read_is_in_flight_and_close_drops_what_is_stuck():
    done, dropped, gate = [], [], threading.Event()

    def complete(job):
        done.append(job.keys[0])
        if job.keys[0] == "j1":
            gate.wait(30)

    q = WriteQueue(1 << 20, complete, lambda j: dropped.append(j.keys[0]), StoreStats(), lambda *a: None,
                   defer_max_s=3600.0, urgent_fraction=1.0)
    q.reads_begin()
    for name in ("j1", "j2"):
        assert q.submit(_Job([name]))
    assert q.contains("j1") and done == []
    q.reads_end()
    while not done:  # j1 starts once the read ended, then sticks
        q.pause_for_reads()
    assert q.close(timeout_s=0.05) == 1
    gate.set()
    assert done == ["j1"] and dropped == ["j2"] and not q.contains("j2")
    assert q.submit(_Job(["j3"])) is False


def test_a_deferred_round_is_written_in_chunks_with_a_pause_for_reads_between_them():
    calls = []

    class FakeSsd:
        file_bytes = 1 << 30

        def write(self, file_index, offset, buf, generation=None):
            calls.append(("write", offset, len(buf)))

    lay = type("L", (), {"n_pages": 2, "record_offset": 5 * 4096, "total_bytes": 6 * 4096})()
    scope = object()
    plc = type("P", (), {"layout": lay, "new_extent": None, "extent_file": 0, "round_offset": 8192, "generation": 0,
                         "scope": scope})()
    from flatcake.media.directio import AlignedBuffer

    prep = PreparedRound(plc, AlignedBuffer(lay.total_bytes), np.zeros((1, 2), dtype=np.uint64), 4096)
    entries = write_prepared(prep, FakeSsd(), 0, StoreStats(), 2 * 4096, between=lambda: calls.append(("pause",)))
    assert calls == [("write", 8192, 8192), ("pause",), ("write", 16384, 8192), ("pause",), ("write", 24576, 4096),
                     ("pause",), ("write", 8192 + 5 * 4096, 4096)]
    assert [e.gva & ((1 << 48) - 1) for e in entries] == [8192 + 4096, 8192 + 4096 + 4096]


def test_the_backlog_and_dwpd_are_exported_as_flatcake_metrics(ssd_dir):
    prom = pytest.importorskip("prometheus_client")
    from flatcake.metrics import FlatCakeMetrics

    store, pool, lay = make_store(ssd_dir, **BACKLOG)
    reg = prom.CollectorRegistry()
    m = FlatCakeMetrics({"pool": "p"}, reg)
    labels = {"pool": "p", "tp_rank": "", "pp_rank": "", "dp_rank": ""}
    store.queue.reads_begin()
    put_pages(store, pool, lay, keys_of("g", 3), [0, 1, 2])
    snap = store.snapshot_stats()
    m.update(snap)
    until_writer_held(store.queue)
    assert reg.get_sample_value("flatcake_write_backlog_pages", labels) == 3
    assert reg.get_sample_value("flatcake_write_backlog_bytes", labels) == snap["write_backlog_bytes"] > 0
    store.queue.reads_end()
    assert store.queue.flush(30)
    snap = store.snapshot_stats()
    m.update(snap)
    assert reg.get_sample_value("flatcake_write_backlog_pages", labels) == 0
    assert reg.get_sample_value("flatcake_ssd_dwpd", labels) == snap["ssd_dwpd"] > 0
    assert reg.get_sample_value("flatcake_write_deferred_seconds_total", labels) == snap["write_deferred_s"] > 0
    store.close()


def test_drop_keys_drops_a_scope_whose_pages_are_all_still_queued(ssd_dir):
    store, pool, lay = make_store(ssd_dir, **BACKLOG)
    store.queue.reads_begin()
    keys = keys_of("v", 2)
    put_pages(store, pool, lay, keys, [0, 1])
    assert store.drop_keys(["v1"]) == 1
    assert store.leading_run(keys) == 0 and store.snapshot_stats()["write_backlog_discarded_rounds"] == 1
    store.queue.reads_end()
    assert store.queue.flush(30)
    assert rounds_in_journal(store) == [] and store.ssd.used_bytes == 0 and store.snapshot_stats()["ssd_write_bytes"] == 0
    store.close()


def test_a_session_queued_round_by_round_stays_one_scope_and_a_repeated_put_writes_once(ssd_dir):
    store, pool, lay = make_store(ssd_dir, **BACKLOG)
    store.queue.reads_begin()
    first, second = ["s0", "s1"], ["s2", "s3"]
    put_pages(store, pool, lay, first, [0, 1])
    put_pages(store, pool, lay, second, [2, 3], prefix=first)  # joins the queued round's scope
    assert put_pages(store, pool, lay, first, [0, 1]) == [True, True]  # already held: not queued again
    assert store.snapshot_stats()["queued_rounds"] == 2
    sid = store.page_info("s0").scope_id
    assert store.page_info("s3").scope_id == sid
    store.queue.reads_end()
    assert store.queue.flush(30)
    assert [(e.scope_id, e.seq) for e in rounds_in_journal(store)] == [(sid, 0), (sid, 1)]
    a, b = store.page_info("s1"), store.page_info("s2")
    assert b.gva - a.gva > 0 and b.file_index == a.file_index  # back to back at the scope's tail
    assert store.snapshot_stats()["pages_written_ssd"] == 4
    store.close()


def test_a_written_rounds_buffer_is_reused_only_after_its_last_reader_is_done(ssd_dir):
    store, pool, lay = make_store(ssd_dir, **BACKLOG)
    q = store.queue
    q.reads_begin()
    put_pages(store, pool, lay, keys_of("u"), [0, 1])
    entries = q.pin_leading_run(keys_of("u"), store.index)  # a read copying from the buffer
    job = entries[0].job
    buf = job.prepared.buf
    q.reads_end()
    assert q.flush(30) and store.medium_of("u0") == "ssd"  # written and published meanwhile
    assert job.done and job.readers == 2
    other = q.take_buffer()
    assert other is not buf  # still in use by the read
    rows = job.chunks(1, [0, 1])  # the read goes on from the round's buffer, bit-exact
    store.get(keys_of("u"), lay, [10, 11])  # (the same pages from SSD, for comparison)
    ref = torch.empty_like(rows)
    lay.gather_chunks(torch.tensor([10, 11]), 1, ref)
    assert torch.equal(rows, ref)
    store.scopes.unpin(entries)
    q.release(entries)
    assert q.take_buffer() is buf  # given back once the last reader ended
    store.close()


def test_through_sglangs_factory_a_queued_page_is_a_hit_and_close_drains_it(make_backend):
    from flatcake_testkit import slots_of, write_pages

    be, pool = make_backend(extra={"ssd.write_backlog_bytes": 64 << 20})
    q = be.store.queue
    q.reads_begin()  # a restore in flight: the backup is queued, not written
    keys = keys_of("sg", 3)
    assert write_pages(be, pool, keys, [0, 1, 2]) == [True] * 3
    assert be.batch_exists(keys) == 3 and be.store.medium_of("sg0") == "queued"
    assert be.batch_get_v1(keys, slots_of(pool, [10, 11, 12])) == [True] * 3
    assert all(page_matches(pool, (10 + i) * pool.page_size, k) for i, k in enumerate(keys))
    st = be.flatcake_stats()
    assert (st["write_backlog_pages"], st["queued_hit_pages"], st["ssd_write_bytes"]) == (3, 3, 0)
    assert "write queue <= 8388608 bytes" in be.store.describe()  # a quarter of the 32 MiB pool
    q.reads_end()
    assert q.flush(30) and be.store.medium_of("sg2") == "ssd"
    assert len(rounds_in_journal(be.store)) == 1



# ---------------------------------------------------------------- deferral is bounded (issue 24 item 1)
def wait_for(cond, what: str) -> None:
    """Wait (no time limit asserted) for ``cond()``."""
    for _ in range(60000):
        if cond():
            return
        time.sleep(0.001)
    raise AssertionError(f"never: {what}")


def test_with_reads_that_never_stop_backups_keep_reaching_the_disk_after_the_deadline(ssd_dir):
    store, pool, lay = make_store(ssd_dir, **{"ssd.write_backlog_bytes": 64 << 20, "ssd.write_defer_max_s": 0.05,
                                              "ssd.write_urgent_fraction": 1.0})
    q = store.queue
    q.reads_begin()  # a restore is always in flight from now on
    keys = [keys_of(f"r{i}-") for i in range(12)]
    for i, ks in enumerate(keys):
        assert put_pages(store, pool, lay, ks, [2 * (i % 8), 2 * (i % 8) + 1]) == [True, True]
    wait_for(lambda: store.snapshot_stats()["write_backlog_pages"] == 0, "the backlog drained beside the reads")
    snap = store.snapshot_stats()
    assert all(store.medium_of(k) == "ssd" for ks in keys for k in ks)
    assert len(rounds_in_journal(store)) == 12 and snap["pages_written_ssd"] == 24
    assert snap["write_urgent_rounds"] == 12 and snap["write_deferral_rounds"] == 12
    # each round waited for the reads, but not longer than its deadline plus the rounds before it
    assert snap["write_deferral_p50_s"] >= 0.05 and snap["write_deferral_max_s"] >= snap["write_deferral_p99_s"] >= 0.05
    q.reads_end()
    assert store.get(keys[0], lay, [30, 31]) == [True, True] and page_matches(pool, 30 * pool.page_size, keys[0][0])
    store.close()


def test_a_backlog_past_the_urgent_fraction_is_written_beside_reads_down_to_the_fraction(ssd_dir):
    store, pool, lay = make_store(ssd_dir, **{"ssd.write_backlog_bytes": 64 << 20, **HOLD})
    q = store.queue
    q.reads_begin()
    assert put_pages(store, pool, lay, keys_of("x"), [0, 1]) == [True, True]
    round_bytes = store.snapshot_stats()["write_backlog_bytes"]
    q.reads_end()
    store.close()
    store, pool, lay = make_store(ssd_dir + "2", **{"ssd.write_backlog_bytes": 8 * round_bytes, "ssd.write_defer_max_s": 3600.0,
                                              "ssd.write_urgent_fraction": 0.5})
    q = store.queue
    q.reads_begin()  # reads never stop
    for i in range(4):  # 4 rounds = half the backlog: not urgent, all held
        assert put_pages(store, pool, lay, keys_of(f"h{i}-"), [2 * i, 2 * i + 1]) == [True, True]
    until_writer_held(q)
    assert store.snapshot_stats()["write_backlog_bytes"] == 4 * round_bytes and len(rounds_in_journal(store)) == 0
    assert put_pages(store, pool, lay, keys_of("h4-"), [8, 9]) == [True, True]  # past half: urgent
    wait_for(lambda: q.writer_held and store.snapshot_stats()["write_backlog_bytes"] <= 4 * round_bytes,
             "written down to the fraction, then held again")
    snap = store.snapshot_stats()
    assert snap["write_backlog_bytes"] == 4 * round_bytes and len(rounds_in_journal(store)) == 1
    assert snap["write_urgent_rounds"] == 1 and store.medium_of("h0-0") == "ssd" and store.medium_of("h1-0") == "queued"
    q.reads_end()
    assert store.flush_writes(30) and len(rounds_in_journal(store)) == 5
    store.close()


# ---------------------------------------------------------------- one bound per rank (issue 24 item 3)
def test_the_pools_of_a_rank_share_one_backlog_bound(ssd_dir):
    from flatcake.store.write_queue import BacklogBudget

    a, pool, lay = make_store(ssd_dir, **BACKLOG)
    a.queue.reads_begin()
    assert put_pages(a, pool, lay, keys_of("probe"), [0, 1]) == [True, True]
    round_bytes = a.snapshot_stats()["write_backlog_bytes"]
    a.queue.reads_end()
    a.close()
    budget = BacklogBudget(2 * round_bytes)  # the rank's bound: two rounds, for every pool together
    cfg = {**BACKLOG, "ssd.write_backlog_wait_s": 0.0}
    stores = [make_store(f"{ssd_dir}-{n}", **cfg) for n in ("kv", "indexer", "draft")]
    from flatcake.store.page_store import PageStore

    stores = [(PageStore(s.cfg, s.geometry, s.namespace, backlog_budget=budget), p, l) for (s, p, l) in
              [(st.close() or st, p, l) for st, p, l in stores]]
    for s, _, _ in stores:
        s.queue.reads_begin()  # restores in flight everywhere: nothing drains
    (kv, kp, kl), (ix, ip, il), (dr, dp, dl) = stores
    assert put_pages(kv, kp, kl, keys_of("k"), [0, 1]) == [True, True]
    assert put_pages(ix, ip, il, keys_of("i"), [0, 1]) == [True, True]
    assert budget.used == 2 * round_bytes and not dr.queue.has_room(round_bytes)  # the third pool finds it full
    assert put_pages(dr, dp, dl, keys_of("d"), [0, 1]) == [False, False]  # one-shot, DRAM off: not stored
    assert [s.snapshot_stats()["write_backlog_bytes"] for s, _, _ in stores] == [round_bytes, round_bytes, 0]
    assert dr.snapshot_stats()["write_backlog_rank_bytes"] == 2 * round_bytes
    for s, _, _ in stores:
        s.queue.reads_end()
    assert kv.flush_writes(30) and ix.flush_writes(30) and budget.used == 0 and dr.queue.has_room(round_bytes)
    assert put_pages(dr, dp, dl, keys_of("d"), [0, 1]) == [True, True]
    for s, _, _ in stores:
        s.close()


# ---------------------------------------------------------------- a deferred round that opens an extent
# the extent header travels in the round's first data write (docs/performance.md, "The busy-thread
# ratio is GIL hand-offs")
@pytest.mark.parametrize("native", [False, True])
def test_a_deferred_round_opening_an_extent_writes_the_extent_header_with_its_first_piece(ssd_dir, monkeypatch,
                                                                                          native):
    # the extent header block sits right before the round header: one write carries both, the
    # record still comes last (Python loop: its own write; C piece loop: its last piece); on
    # disk the header is where a warm restart looks for it
    from flatcake.media import extent as fmt

    if not native:
        monkeypatch.setitem(native_write.LOOP.state, "fn", None)
    elif native_write.LOOP.fn() is None:
        pytest.skip("extension not built")
    store, pool, lay = make_store(ssd_dir, **BACKLOG)
    calls = []
    real = store.ssd.write

    def write(file_index, offset, buf, generation=None, pwrite=None):
        calls.append((file_index, offset, len(buf), bytes(memoryview(buf)[:8])))
        return real(file_index, offset, buf, generation, pwrite)

    store.ssd.write = write
    assert put_pages(store, pool, lay, keys_of("eh", 3), [0, 1, 2]) == [True] * 3
    assert store.flush_writes(30)
    info = store.page_info("eh0")
    f, first = calls[0][0], calls[0][1]
    assert calls[0][3] == fmt.EXTENT_MAGIC and calls[0][2] > fmt.BLOCK  # header + round in one write
    assert all(c[0] == f and c[1] > first for c in calls[1:]) and len(calls) == 1 + (not native)  # the record
    with open(store.ssd.path_of(f), "rb") as fh:
        fh.seek(first)
        hdr = fmt.unpack_extent_header(fh.read(fmt.BLOCK))
    assert hdr is not None and info.file_index == f
    assert store.get(keys_of("eh", 3), lay, [10, 11, 12]) == [True] * 3
    assert all(page_matches(pool, (10 + i) * pool.page_size, k) for i, k in enumerate(keys_of("eh", 3)))
    store.close()
    store2, pool2, lay2 = make_store(ssd_dir, **BACKLOG)  # warm restart finds the extent and its round
    assert store2.get(keys_of("eh", 3), lay2, [0, 1, 2]) == [True] * 3
    assert all(page_matches(pool2, i * pool2.page_size, k) for i, k in enumerate(keys_of("eh", 3)))
    store2.close()


def test_the_c_piece_loop_writes_in_order_and_stops_between_pieces_while_a_restore_reads(tmp_path):
    if native_write.LOOP.fn() is None:
        pytest.skip("extension not built")
    data = np.random.default_rng(5).integers(0, 256, size=5 * 4096 + 100, dtype=np.uint8)
    readers = np.ones(1, dtype=np.int64)  # a restore in flight from the start
    pauses = []

    def between():
        pauses.append(readers[0])
        readers[0] = 0  # the restore ended

    off = 8192
    pw = native_write.piece_writer([off + 4096, off + 3 * 4096], readers, between)
    fd = os.open(tmp_path / "f", os.O_RDWR | os.O_CREAT, 0o600)
    try:
        mv = memoryview(data)
        assert pw(fd, mv, off) == 4096 and pauses == [1]  # the first piece, then the pause
        assert pw(fd, mv[4096:], off + 4096) == data.shape[0] - 4096 and pauses == [1]  # the rest at once
        with open(tmp_path / "f", "rb") as fh:
            fh.seek(off)
            assert fh.read() == data.tobytes()
        with pytest.raises(OSError) as e:
            pw(-1, mv, off)
        assert e.value.errno == 9  # EBADF: the errno of the failed pwrite
    finally:
        os.close(fd)
