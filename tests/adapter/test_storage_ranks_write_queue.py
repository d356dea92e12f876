"""MLA with TP > 1 and FlatCake's default SSD write queue: the writer rank's pages are hits on
every rank as soon as its backup returns.

SGLang 0.5.23 backs MLA KV up on the writer rank only and takes the MIN hit count over the ranks;
a follower rank sees the writer's rounds once they are on disk and journaled
(:mod:`flatcake.gva.mirror`). With the write queue a round still queued was a hit on the writer
(served from its in-process buffer) and a miss on the followers, so right after a backup the
ranks disagreed (writer: the whole prefix, follower: 0) and the server saw 0. The writer role
therefore writes its rounds in the put (no queue), as it keeps no DRAM pages; single ranks keep
the queue. The real-server check is ``tests/e2e/test_server_models.py`` (TP 2, CPU engine)."""

from __future__ import annotations

import logging
import threading

import pytest

from flatcake_testkit import page_matches, slots_of, write_pages


def test_the_default_config_has_the_write_queue_on(make_backend):
    be, _ = make_backend()
    assert be.cfg.ssd.write_backlog_bytes > 0 and be.store.queue is not None


@pytest.mark.parametrize("reads_running", [False, True])
def test_mla_tp2_ranks_agree_on_the_whole_prefix_right_after_the_writer_backup_returns(make_backend, caplog,
                                                                                        reads_running):
    """``reads_running``: the writer restores its first pages over and over (as the FC-MAS lanes
    would) while the second backup runs and the ranks are asked."""
    with caplog.at_level(logging.INFO, logger="flatcake.store.page_store"):
        w, wpool = make_backend(mla=True, tp_rank=0, tp_size=2)
    f, fpool = make_backend(mla=True, tp_rank=1, tp_size=2)
    assert (w.store.role, f.store.role) == ("writer", "follower")
    assert w.cfg.ssd.write_backlog_bytes > 0  # the default: queue configured ...
    assert w.store.queue is None and f.store.queue is None  # ... but not on a rank that shares its pages
    assert "SSD write queue off" in caplog.text

    keys = [f"mla{i}" for i in range(6)]
    assert write_pages(w, wpool, keys[:4], range(4)) == [True] * 4
    # no wait, no flush: what SGLang's next hit query on each rank would see
    assert (w.batch_exists(keys[:4]), f.batch_exists(keys[:4])) == (4, 4)
    stop, reads = threading.Event(), []

    def restore_loop():
        while not stop.is_set():
            reads.append(w.batch_get_v1(keys[:4], slots_of(wpool, range(30, 34))))

    reader = threading.Thread(target=restore_loop) if reads_running else None
    if reader is not None:
        reader.start()
        while not reads:  # a restore has run; more are running
            stop.wait(0.001)
    try:
        assert write_pages(w, wpool, keys[4:], range(4, 6), prefix=keys[:4]) == [True] * 2
        assert (w.batch_exists(keys), f.batch_exists(keys)) == (6, 6)
    finally:
        stop.set()
        if reader is not None:
            reader.join()
    assert all(r == [True] * 4 for r in reads)
    assert w.flush_writes(1.0)  # nothing was left behind in a queue
    assert w.store.snapshot_stats()["write_backlog_pages"] == 0

    assert f.batch_get_v1(keys, slots_of(fpool, range(10, 16))) == [True] * 6
    assert all(page_matches(fpool, (10 + i) * fpool.page_size, k) for i, k in enumerate(keys))
    assert w.batch_get_v1(keys, slots_of(wpool, range(20, 26))) == [True] * 6
    assert all(page_matches(wpool, (20 + i) * wpool.page_size, k) for i, k in enumerate(keys))


def test_ranks_that_do_not_share_pages_keep_the_write_queue(make_backend):
    """MLA on one rank, and MHA over TP ranks (each rank its own pool): ``single`` role, queue on."""
    mla1, _ = make_backend(mla=True, tp_rank=0, tp_size=1)
    mha0, _ = make_backend(tp_rank=0, tp_size=2, model="mha-model")
    mha1, _ = make_backend(tp_rank=1, tp_size=2, model="mha-model")
    for be in (mla1, mha0, mha1):
        assert be.store.role == "single" and be.store.queue is not None
