"""TP ranks and processes sharing FlatCake pools: the MLA writer/follower ranks (the scope
journal, :mod:`flatcake.gva.mirror`) and one writer per pool (SGLang 0.5.23 storage contract)."""

from __future__ import annotations

import pytest
from flatcake_testkit import page_matches, slots_of, write_pages

from flatcake.gva import mirror as mirror_mod
from flatcake.media.errors import SsdStartupError


@pytest.fixture
def make_backend(make_backend):
    """conftest's ``make_backend`` with synchronous SSD writes (``ssd.write_backlog_bytes: 0``):
    these tests check what a follower rank mirrors right after the writer's put returned (its
    rounds on disk and journaled then)."""
    def make(*, extra=None, **kw):
        return make_backend(extra={"ssd.write_backlog_bytes": 0, **(extra or {})}, **kw)
    return make


def test_mla_tp2_follower_rank_sees_the_writer_rank_pages(make_backend):
    """SGLang takes the MIN hit count over TP ranks; for MLA only rank 0 writes, so rank 1
    must see rank 0's pages (it tails rank 0's scope journal and reads its pool files)."""
    w, wpool = make_backend(mla=True, tp_rank=0, tp_size=2, extra={"dram.capacity_bytes": 1 << 20, "cio.verify_checksums": False})
    f, fpool = make_backend(mla=True, tp_rank=1, tp_size=2)
    assert (w.store.role, f.store.role) == ("writer", "follower")
    assert w.store.dram.n_slots == 0  # DRAM pages would be invisible to rank 1
    keys = [f"mla{i}" for i in range(6)]
    assert write_pages(w, wpool, keys[:3], range(3)) == [True] * 3
    assert write_pages(w, wpool, keys[3:], range(3, 6), prefix=keys[:3]) == [True] * 3
    assert write_pages(f, fpool, keys, range(6)) == [True] * 6  # non-writer: SGLang skips it; no bytes written
    assert min(w.batch_exists(keys), f.batch_exists(keys)) == 6
    assert f.batch_get_v1(keys, slots_of(fpool, range(10, 16))) == [True] * 6
    assert all(page_matches(fpool, (10 + i) * fpool.page_size, k) for i, k in enumerate(keys))
    assert f.store.cfg.cio.verify_checksums is True  # followers always verify
    w.clear()  # the writer frees the scope: the follower stops advertising it
    assert f.batch_exists(keys) == 0


def test_second_writer_on_the_same_pool_fails_at_startup(make_backend):
    """One writer per pool: with a fixed ``ssd.pool_id`` there is no other slot to take (without
    it a second process takes the next free slot: tests/adapter/test_identity.py)."""
    make_backend(extra={"ssd.pool_id": "srv"})
    with pytest.raises(SsdStartupError, match="ssd.pool_id 'srv': .*in use by another FlatCake process"):
        make_backend(extra={"ssd.pool_id": "srv"})


def test_follower_starts_over_when_the_writer_restarts(make_backend):
    w1, wpool = make_backend(mla=True, tp_rank=0, tp_size=2)
    f, fpool = make_backend(mla=True, tp_rank=1, tp_size=2)
    a = [f"A{i}" for i in range(4)]
    write_pages(w1, wpool, a, range(4))
    assert f.batch_exists(a) == 4
    w1.close()
    w2, wpool2 = make_backend(mla=True, tp_rank=0, tp_size=2)  # a restarted writer: a new journal
    b = [f"B{i}" for i in range(4)]
    b2 = [f"B2{i}" for i in range(4)]
    write_pages(w2, wpool2, b, range(4))
    write_pages(w2, wpool2, b2, range(4, 8))
    # the restarted writer rebuilt A from its pool; the follower replays the new journal
    assert (f.batch_exists(a), f.batch_exists(b), f.batch_exists(b2)) == (4, 4, 4)
    assert f.batch_get_v1(b + b2, slots_of(fpool, range(10, 18))) == [True] * 8
    assert all(page_matches(fpool, (10 + i) * fpool.page_size, k) for i, k in enumerate(b + b2))
    f.close()
    assert f.batch_set_v1(b, slots_of(fpool, range(4))) == [False] * 4  # closed: no success reported


def test_a_follower_that_dropped_a_session_after_a_failed_read_mirrors_its_next_rounds_again(make_backend):
    w, wpool = make_backend(mla=True, tp_rank=0, tp_size=2)
    f, fpool = make_backend(mla=True, tp_rank=1, tp_size=2)
    keys = [f"s{i}" for i in range(4)]
    write_pages(w, wpool, keys[:2], range(2))
    assert f.batch_exists(keys[:2]) == 2
    real = f.store.cio.restore
    f.store.cio.restore = lambda chunks, layout, **kw: real(chunks.__class__(
        chunks.file_index + 7, chunks.offset, chunks.page, chunks.layer, chunks.tag, chunks.nbytes,
        chunks.checksum, chunks.has_checksum), layout, **kw)  # one read of a missing file
    assert f.batch_get_v1(keys[:2], slots_of(fpool, [10, 11])) == [False, False]
    f.store.cio.restore = real
    assert f.batch_exists(keys[:2]) == 0  # the follower dropped what it could not read
    write_pages(w, wpool, keys[2:], range(2, 4), keys[:2])  # the session goes on at the writer
    n = f.batch_exists(keys[2:], None)
    got = f.batch_get_v1(keys[2:], slots_of(fpool, [12, 13]))
    assert got == [True] * n and n == 2  # promised only what it can read, and reads it
    assert all(page_matches(fpool, (12 + i) * fpool.page_size, k) for i, k in enumerate(keys[2:]))


def test_a_follower_that_starts_late_replays_only_the_live_rounds(make_backend, monkeypatch):
    monkeypatch.setattr("flatcake.gva.scopes.COMPACT_MIN_ENTRIES", 16)
    w, wpool = make_backend(mla=True, tp_rank=0, tp_size=2,
                            extra={"ssd.file_bytes": 256 << 10, "ssd.max_files": 1, "ssd.high_watermark": 0.5,
                                   "ssd.low_watermark": 0.3})
    for s in range(80):  # far more rounds than stay live: reclaim retires most of them
        write_pages(w, wpool, [f"h{s}"], [s % 32])
    live = w.store.scopes.live_rounds
    assert live < 20
    f, fpool = make_backend(mla=True, tp_rank=1, tp_size=2)  # starts now
    polled = []
    real_poll = f.store.mirror.journal.poll
    f.store.mirror.journal.poll = lambda: (lambda r: polled.append(len(r[1])) or r)(real_poll())
    keys = [k for sc in w.store.index.scopes.values() for k in sc.keys]
    assert f.batch_exists(keys[-1:]) == 1
    assert polled[0] <= 2 * live + 16 + 2  # the compacted journal, not 80 rounds of history
    got = f.batch_get_v1(keys[-1:], slots_of(fpool, [40]))
    assert got == [True] and page_matches(fpool, 40 * fpool.page_size, keys[-1])


def test_a_follower_keeps_what_it_mirrored_when_the_writer_compacts(make_backend, monkeypatch):
    w, wpool = make_backend(mla=True, tp_rank=0, tp_size=2)
    f, fpool = make_backend(mla=True, tp_rank=1, tp_size=2)
    sess = [[f"c{s}-{i}" for i in range(3)] for s in range(4)]
    for keys in sess:
        write_pages(w, wpool, keys, range(3))
    assert all(f.batch_exists(keys) == 3 for keys in sess)
    reads = []
    real = mirror_mod.read_round
    monkeypatch.setattr(mirror_mod, "read_round", lambda *a, **kw: (reads.append(a[1]), real(*a, **kw))[1])
    w.clear()  # drops every scope ...
    write_pages(w, wpool, sess[0], range(3))  # ... one comes back as a new scope
    w2 = [f"d{i}" for i in range(2)]
    write_pages(w, wpool, w2, range(3, 5))
    with w.store.scopes.lock:  # the writer compacts: the follower sees a new journal inode
        w.store.scopes.journal.rewrite(w.store.scopes.journal_entries_locked())
    assert (f.batch_exists(sess[0]), f.batch_exists(sess[1]), f.batch_exists(w2)) == (3, 0, 2)
    n_after_first_sync = len(reads)
    write_pages(w, wpool, [f"e{i}" for i in range(2)], range(5, 7))
    with w.store.scopes.lock:
        w.store.scopes.journal.rewrite(w.store.scopes.journal_entries_locked())
    assert f.batch_exists(w2) == 2 and f.batch_exists(["e0", "e1"]) == 2
    assert len(reads) == n_after_first_sync + 1  # only the new round's record was read; the rest kept
    assert f.batch_get_v1(sess[0] + w2, slots_of(fpool, range(10, 15))) == [True] * 5
    assert all(page_matches(fpool, (10 + i) * fpool.page_size, k) for i, k in enumerate(sess[0] + w2))
