"""Reads first, writes in the gaps, for restores that are *queued* (docs/design.md "Write queue"):
a prefetch waiting in the FC-MAS SSD lane counts as a pending read (``PageStore.reads_pending``
through the lanes' ``pending_reads`` hook), so the write queue holds its writes from the moment
the restore is queued; ``PageStore.flush_writes`` waits for the queue. No timing: restores are
held on events."""

import threading

from flatcake_testkit import make_store, page_matches, put_pages

from flatcake.gva import journal as jmod
from flatcake.mas.lanes import FifoLanes, LaneOp, MediumAwareLanes

MiB = 1 << 20


def ssd_op(rid, run, ssd_bytes=4 * MiB):
    return LaneOp(rid, 0.0, 0, 4, ssd_bytes, run)


def dram_op(rid, run):
    return LaneOp(rid, 0.0, 4, 0, 0, run)


def test_the_lanes_count_each_ssd_prefetch_from_submit_to_the_end_of_its_reads():
    marks, seen = [], {}
    count = lambda: sum(marks)  # noqa: E731
    lanes = MediumAwareLanes(ssd_workers=1, pending_reads=marks.append)
    first_in, release = threading.Event(), threading.Event()

    def first():
        seen["first_running"] = count()
        first_in.set()
        release.wait(30)

    a = ssd_op("a", first)
    lanes.submit(a)
    assert first_in.wait(30)
    b = ssd_op("b", lambda: seen.setdefault("second_running", count()))  # waits: one SSD slot
    d = dram_op("d", lambda: seen.setdefault("dram_running", count()))
    lanes.submit(b)
    lanes.submit(d)
    assert d.wait(30)
    assert count() == 2 and not b.wait(0)  # a reading, b queued: both pending; the DRAM op never counted
    release.set()
    assert a.wait(30) and b.wait(30)
    lanes.close()
    assert seen == {"first_running": 1, "dram_running": 2, "second_running": 1}
    assert marks == [+1, +1, -1, -1] and count() == 0


def test_fifo_lanes_count_queued_ssd_prefetches_and_a_raising_one_still_ends_its_mark():
    marks = []
    lanes = FifoLanes(pending_reads=marks.append)

    def boom():
        raise OSError(5, "EIO")

    ops = [ssd_op("x", boom), dram_op("y", lambda: None), ssd_op("z", lambda: None)]
    for o in ops:
        lanes.submit(o)
    assert all(o.wait(30) for o in ops)
    lanes.close()
    assert sorted(marks) == [-1, -1, +1, +1] and sum(marks) == 0
    assert lanes.errors.count == 1


def test_a_queued_restore_holds_the_write_queue_and_a_lane_read_gets_the_queued_pages(ssd_dir):
    store, pool, lay = make_store(ssd_dir, **{"ssd.write_backlog_bytes": 64 << 20})
    old, new = ["old0", "old1"], ["new0", "new1"]
    assert put_pages(store, pool, lay, old, [0, 1]) == [True, True]
    assert store.flush_writes(30)
    assert [store.medium_of(k) for k in old] == ["ssd", "ssd"]
    written = store.snapshot_stats()["ssd_write_bytes"]
    lanes = MediumAwareLanes(ssd_workers=1, pending_reads=store.reads_pending)
    running, release, got = threading.Event(), threading.Event(), {}

    def blocker():  # a lane op that has not reached the store's read path yet
        running.set()
        release.wait(30)

    lanes.submit(ssd_op("busy", blocker))
    assert running.wait(30)
    queued = ssd_op("restore", lambda: got.update(old=store.get(old, lay, [20, 21]), new=store.get(new, lay, [22, 23])))
    lanes.submit(queued)
    assert store.snapshot_stats()["reads_in_flight"] == 2  # one started op, one queued: no store read yet
    assert put_pages(store, pool, lay, new, [2, 3]) == [True, True]
    snap = store.snapshot_stats()
    assert snap["ssd_write_bytes"] == written and snap["write_backlog_pages"] == 2  # held: reads pending
    assert [store.medium_of(k) for k in new] == ["queued", "queued"]
    assert not store.flush_writes(0)
    release.set()
    assert queued.wait(30)
    lanes.close()
    assert got == {"old": [True, True], "new": [True, True]}
    assert all(page_matches(pool, s * pool.page_size, k) for s, k in zip([20, 21, 22, 23], old + new))
    assert store.flush_writes(30)
    snap = store.snapshot_stats()
    assert snap["reads_in_flight"] == 0 and snap["write_backlog_pages"] == 0 and snap["ssd_write_bytes"] > written
    assert [store.medium_of(k) for k in new] == ["ssd", "ssd"]
    rounds = [e for e in jmod.read_journal(store.ssd.journal_path) if e.kind == jmod.ROUND]
    assert len(rounds) == 2
    store.close()


def test_without_a_queue_the_hooks_are_no_ops(ssd_dir):
    store, pool, lay = make_store(ssd_dir, **{"ssd.write_backlog_bytes": 0})  # synchronous writes
    assert store.queue is None
    store.reads_pending(+1)
    assert put_pages(store, pool, lay, ["s0"], [0]) == [True]
    assert store.medium_of("s0") == "ssd" and store.flush_writes(0)  # written by the put itself
    store.reads_pending(-1)
    assert store.snapshot_stats()["reads_in_flight"] == 0
    store.close()
