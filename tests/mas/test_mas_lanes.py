"""FC-MAS lanes (paper §3.2) with real threads: DRAM-only prefetches never wait behind an SSD
restore, a big restore is never starved, a finished restore is announced by its arrival order,
and SGLang's FIFO (the ablation) does the opposite. Operations block on events, not sleeps, so
every order asserted is forced, not timed."""

from __future__ import annotations

import threading
import time

import pytest

from flatcake.mas.lanes import FifoLanes, LaneOp, MediumAwareLanes, make_lanes

MiB = 1 << 20


def op(rid, arrival, ssd_bytes=0, run=None, log=None):
    def work():
        if run is not None:
            run()
        if log is not None:
            log.append(("run", rid))

    return LaneOp(rid, arrival, 0 if ssd_bytes else 4, 4 if ssd_bytes else 0, ssd_bytes, work,
                  on_done=(lambda o: log.append(("done", o.request_id))) if log is not None else None)


def test_a_burst_of_dram_hits_is_served_while_one_huge_restore_runs():
    lanes = MediumAwareLanes(ssd_workers=1)
    release, log = threading.Event(), []
    t0 = time.monotonic()
    big = op("huge", t0, 4096 * MiB, run=lambda: release.wait(60), log=log)
    lanes.submit(big)
    small = [op(f"d{i}", t0 + 0.001 * (i + 1), log=log) for i in range(20)]
    for o in small:
        lanes.submit(o)
    assert all(o.wait(60) for o in small)  # all done while the restore is still blocked
    assert not big.wait(0) and [e for e in log if e[0] == "done"] == [("done", f"d{i}") for i in range(20)]
    assert {o.lane for o in small} == {"dram"} and big.lane == "ssd"
    release.set()
    assert big.wait(60)
    lanes.close()
    # every DRAM hit passed the one restore submitted before it; the restore passed nothing
    assert lanes.stats() == {"lanes": "mas", "dram": 20, "ssd": 1, "fifo": 0, "overtakes": 20, "overtaken": 20}


def test_fifo_ablation_makes_the_dram_hits_wait_for_the_restore():
    lanes = FifoLanes()
    started, release, log = threading.Event(), threading.Event(), []
    t0 = time.monotonic()
    big = op("huge", t0, 4096 * MiB, run=lambda: (started.set(), release.wait(60)), log=log)
    lanes.submit(big)
    small = [op(f"d{i}", t0 + 0.001, log=log) for i in range(3)]
    for o in small:
        lanes.submit(o)
    assert started.wait(60)
    assert not any(o.wait(0) for o in small) and log == []  # stuck behind the restore, as in SGLang
    release.set()
    assert all(o.wait(60) for o in small)
    # the DRAM hits ran only after the restore ended: nothing passed it
    assert log == [("run", "huge"), ("done", "huge")] + [(e, f"d{i}") for i in range(3) for e in ("run", "done")]
    lanes.close()
    assert lanes.stats() == {"lanes": "fcfs", "dram": 0, "ssd": 0, "fifo": 4, "overtakes": 0, "overtaken": 0}


def test_a_huge_restore_keeps_being_served_while_dram_hits_keep_arriving():
    """The DRAM lane has its own thread: a stream of DRAM-only prefetches never takes the SSD
    restore's slot. The restore reads 20 chunks and each waits for the next DRAM hit to be
    served first, so both lanes must make progress in turn, whatever the machine's load: the
    restore runs while the stream goes on, and every hit is served while the restore is in
    flight."""
    lanes = MediumAwareLanes(ssd_workers=1)
    hit_served, chunk_read = threading.Semaphore(0), threading.Semaphore(0)
    chunks, events = [], []

    def restore():
        for k in range(20):
            assert hit_served.acquire(timeout=60), "no DRAM hit was served while the restore ran"
            chunks.append(k)
            events.append(("chunk", k))
            chunk_read.release()

    t0 = time.monotonic()
    big = op("huge", t0, 4096 * MiB, run=restore)
    lanes.submit(big)
    stream = []
    for k in range(20):  # a DRAM hit, then a chunk of the restore, and so on
        o = op(f"d{k}", time.monotonic())
        lanes.submit(o)
        assert o.wait(60), "a DRAM hit waited behind the restore"
        events.append(("hit", k))
        stream.append(o)
        hit_served.release()
        assert chunk_read.acquire(timeout=60), "the restore was starved"
    assert big.wait(60) and chunks == list(range(20))
    assert events == [(e, k) for k in range(20) for e in ("hit", "chunk")]
    assert all(big.started_s <= o.finished_s <= big.finished_s for o in stream[1:])  # d0 may come first
    assert {o.lane for o in stream} == {"dram"} and big.lane == "ssd"
    lanes.close()


def test_a_huge_restore_waits_only_for_the_backlog_of_small_restores_ahead_of_it():
    """HRRN over bytes serves the small restores queued with it first, then the huge one: its
    wait is bounded by that backlog, not by restores that arrive later."""
    lanes = MediumAwareLanes(ssd_workers=1)
    gate, order = threading.Event(), []
    t0 = time.monotonic()
    lanes.submit(op("first", t0, 8 * MiB, run=lambda: gate.wait(60)))
    huge = op("huge", t0, 4096 * MiB, run=lambda: order.append("huge"))
    lanes.submit(huge)
    backlog = [op(f"s{i}", t0, MiB, run=lambda i=i: order.append(f"s{i}")) for i in range(5)]
    for o in backlog:
        lanes.submit(o)
    gate.set()
    assert huge.wait(60)
    late = [op(f"late{i}", time.monotonic(), MiB, run=lambda i=i: order.append(f"late{i}")) for i in range(5)]
    for o in late:
        lanes.submit(o)
    assert all(o.wait(60) for o in backlog + late)
    assert order.index("huge") == 5 and sorted(order[:5]) == [f"s{i}" for i in range(5)]
    lanes.close()


def test_small_restores_go_first_among_those_waiting_equally():
    lanes = MediumAwareLanes(ssd_workers=1)
    started, gate, order = threading.Event(), threading.Event(), []
    t0 = time.monotonic()
    lanes.submit(op("blocker", t0, MiB, run=lambda: (started.set(), gate.wait(60))))
    assert started.wait(60)  # the one restore slot is taken: the next two wait together
    big = op("big", t0, 1024 * MiB, run=lambda: order.append("big"))
    little = op("little", t0, 1 * MiB, run=lambda: order.append("little"))
    lanes.submit(big)
    lanes.submit(little)
    gate.set()
    assert big.wait(60) and little.wait(60)
    assert order == ["little", "big"]
    lanes.close()


def test_a_finished_restore_is_announced_in_arrival_order_and_a_raising_op_still_completes(caplog):
    lanes = MediumAwareLanes(ssd_workers=2)
    done = []
    t0 = time.monotonic()

    def boom():
        raise RuntimeError("read failed")

    a = LaneOp("a", t0, 0, 2, 2 * MiB, boom, on_done=lambda o: done.append(o.request_id))
    lanes.submit(a)
    assert a.wait(60) and done == ["a"] and a.finished_s >= a.started_s
    assert "read failed" in caplog.text
    lanes.close()


def test_make_lanes_names_the_field_on_a_bad_scheduler():
    one, three = make_lanes("fcfs"), make_lanes("fifo-3")
    assert isinstance(one, FifoLanes) and one.name == "fcfs" and one.workers == 1
    assert isinstance(three, FifoLanes) and three.name == "fifo-3" and three.workers == 3
    one.close(), three.close()
    for bad in ("lifo", "fifo-0", "fifo-x"):
        with pytest.raises(ValueError, match="scheduler must be 'fcfs', 'fifo-N' or 'mas'|workers must be >= 1"):
            make_lanes(bad)


def test_a_refused_submit_leaves_nothing_half_queued_and_close_returns():
    lanes = MediumAwareLanes(ssd_workers=1)
    gate, log = threading.Event(), []
    t0 = time.monotonic()
    lanes.submit(op("a", t0, 4 * MiB, run=lambda: gate.wait(60), log=log))
    with pytest.raises(ValueError, match="already scheduled"):
        lanes.submit(op("a", t0, 4 * MiB, log=log))  # same id while the first is in flight
    gate.set()
    closer = threading.Thread(target=lanes.close)
    closer.start()
    closer.join(60)
    assert not closer.is_alive() and log == [("run", "a"), ("done", "a")]


def test_an_announcement_that_raises_never_ends_the_dram_lane(caplog):
    lanes = MediumAwareLanes(ssd_workers=1)
    t0, log = time.monotonic(), []

    def bad_done(o):
        raise RuntimeError("ack queue gone")

    first = LaneOp("x", t0, 4, 0, 0, lambda: None, on_done=bad_done)
    lanes.submit(first)
    assert first.wait(60)
    later = [op(f"d{i}", t0 + i, log=log) for i in range(2)] + [op("s", t0 + 3, 4 * MiB, log=log)]
    for o in later:
        lanes.submit(o)
    assert all(o.wait(60) for o in later)
    assert [e for e in log if e[0] == "done"] == [("done", "d0"), ("done", "d1"), ("done", "s")]
    assert "ack queue gone" in caplog.text
    lanes.close()
