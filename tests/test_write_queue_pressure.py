"""The write queue under pressure (issue 24 items 1 and 3).

Item 1: with restores that never stop, the bounded deferral (``ssd.write_defer_max_s``) keeps
backups reaching the disk: every put succeeds, every round is written and journaled, in order,
and no round waits longer than the bound. The queue's clock is a fake one the test moves, so the
deferral each round gets is exact (no timed assertion); the write rate it leaves is measured by
``scripts/bench_write_floor.py`` (``docs/durability.md``, "Write rate floor").

Item 3: queued rounds pin their scope; a round that finds the pool full may evict a scope pinned
only by rounds waiting in the queue (they leave it unwritten), so a small pool fails no more puts
with the queue on than with it off, and never serves a wrong byte.
"""

import os
import sys
import threading
import time

import torch
from flatcake_testkit import make_store, page_matches, put_pages

import flatcake.store.write_queue as wq
from flatcake.gva import journal as jmod
from flatcake.media import extent as fmt

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "adapter"))
from held_writer import HeldWriter  # noqa: E402


def wait_for(cond, what: str) -> None:
    """Wait (no time limit asserted) for ``cond()``."""
    for _ in range(120000):
        if cond():
            return
        time.sleep(0.001)
    raise AssertionError(f"never: {what}")


def journal_rounds(store) -> list:
    return [e for e in jmod.read_journal(store.ssd.journal_path) if e.kind == jmod.ROUND]


class FakeClock:
    """``time.monotonic`` of the write queue, moved by the test only."""

    def __init__(self):
        self.now = 1000.0

    def monotonic(self) -> float:
        return self.now


# ================================================================ item 1: deferral is bounded
def test_restores_that_never_stop_leave_every_backup_written_within_the_deferral_bound(ssd_dir, monkeypatch):
    # (DRAM with room: the sessions are agent sessions on SSD, not overflow)
    store, pool, lay = make_store(ssd_dir, **{"placement.l_agent_tokens": 8, "dram.capacity_bytes": 64 << 10})
    q = store.queue
    assert (q.defer_max_s, q.urgent_fraction) == (1.0, 0.5)  # ssd.write_defer_max_s, ssd.write_urgent_fraction
    stored = [f"old{i}" for i in range(8)]
    assert put_pages(store, pool, lay, stored, list(range(40, 48))) == [True] * 8
    assert store.flush_writes(30) and store.medium_of("old7") == "ssd"
    written0, pages0, rounds0 = (store.snapshot_stats()["ssd_write_bytes"], store.snapshot_stats()["pages_written_ssd"],
                                 len(journal_rounds(store)))

    clock = FakeClock()
    monkeypatch.setattr(wq, "time", clock)
    stop, reads, bad = threading.Event(), [0], []

    def restores():  # back to back for the whole test; one more always queued in the FC-MAS SSD lane
        store.reads_pending(+1)
        try:
            while not stop.is_set():
                ok = store.get(stored, lay, list(range(48, 56)))
                if ok != [True] * 8 or not all(page_matches(pool, (48 + i) * pool.page_size, k) for i, k in enumerate(stored)):
                    bad.append(ok)
                reads[0] += 1
        finally:
            store.reads_pending(-1)

    reader = threading.Thread(target=restores)
    reader.start()
    wait_for(lambda: reads[0] > 0 and q.reads_in_flight >= 1, "restores in flight")

    rounds = [[f"s{r}-{i}" for i in range(2)] for r in range(6)]  # one agent session, 6 rounds of 2 pages
    chain: list = []
    puts = []

    def put(r: int) -> None:
        puts.append(put_pages(store, pool, lay, rounds[r], [2 * r, 2 * r + 1], prefix=list(chain) or None))
        chain.extend(rounds[r])

    def on_ssd(r: int) -> bool:
        return store.medium_of(rounds[r][-1]) == "ssd"

    try:
        put(0)  # t = 0: held behind the restores until its deadline
        wait_for(lambda: q.writer_held, "the writer waits for the restores")
        assert store.medium_of("s0-0") == "queued" and len(journal_rounds(store)) == rounds0
        clock.now += 1.0  # its deadline: written beside the restores
        wait_for(lambda: on_ssd(0), "round 0 written at its deadline")
        put(1)  # t = 1.0
        clock.now += 0.5
        put(2)  # t = 1.5
        clock.now += 0.5  # t = 2.0: round 1's deadline, not round 2's
        wait_for(lambda: on_ssd(1) and q.writer_held, "round 1 written, then the writer waits again")
        assert store.medium_of("s2-0") == "queued" and q.reads_in_flight >= 1
        clock.now += 0.5  # t = 2.5: round 2's deadline
        wait_for(lambda: on_ssd(2), "round 2 written at its deadline")
        for r in (3, 4, 5):  # t = 2.5, three rounds at once
            put(r)
        wait_for(lambda: q.writer_held, "held behind the restores")
        assert [store.medium_of(rounds[r][0]) for r in (3, 4, 5)] == ["queued"] * 3
        clock.now += 1.0  # all three past their deadline: written back to back
        wait_for(lambda: all(on_ssd(r) for r in (3, 4, 5)), "rounds 3-5 written")
        assert q.reads_in_flight >= 1  # the restores never stopped
    finally:
        stop.set()
        reader.join(60)
    assert not reader.is_alive() and bad == [] and reads[0] > 0

    assert puts == [[True, True]] * 6  # 6 of 6 backups succeeded
    snap = store.snapshot_stats()
    mine = [e for e in journal_rounds(store)[rounds0:]]
    assert [e.seq for e in mine] == [0, 1, 2, 3, 4, 5]  # every round journaled, oldest first, one scope
    assert len({e.scope_id for e in mine}) == 1 and store.page_info("s5-1").reuse == "agent_session"
    g = store.geometry
    expected = sum(fmt.round_layout(ks, g.layers, g.chunk_bytes).total_bytes for ks in rounds)
    assert [e.record_offset + e.record_bytes for e in mine] == \
        [fmt.round_layout(ks, g.layers, g.chunk_bytes).total_bytes for ks in rounds]
    extents = len({(e.file_index, e.extent_offset) for e in mine})  # each opened with a header block
    assert snap["ssd_write_bytes"] - written0 == expected + extents * fmt.BLOCK
    assert snap["pages_written_ssd"] - pages0 == 12
    # the bound acted: every round was written while restores were in flight, none waited more
    # than ssd.write_defer_max_s (the queue's clock does not move during a write)
    assert snap["write_urgent_rounds"] == 6
    assert snap["write_deferral_rounds"] == 7  # the preload's round (no restore then, real clock) and these 6
    pre, *mine_s = list(q.deferral_s)
    assert mine_s == [1.0] * 6
    assert (snap["write_deferral_p50_s"], snap["write_deferral_p99_s"], snap["write_deferral_max_s"]) == \
        (1.0, max(1.0, pre), max(1.0, pre))
    assert store.get(chain, lay, list(range(20, 32))) == [True] * 12
    assert all(page_matches(pool, (20 + i) * pool.page_size, k) for i, k in enumerate(chain))
    monkeypatch.undo()
    store.close()


# ================================================================ item 3: reclaim sees queued rounds
#: a pool of 4 files of 64 KiB; the write queue may hold a quarter of it (64 KiB)
SMALL_POOL = {"ssd.file_bytes": 64 << 10, "ssd.max_files": 4, "ssd.high_watermark": 1.0, "ssd.low_watermark": 0.9,
              "ssd.write_backlog_wait_s": 0.0}
LONG = [[f"L{s}-{r}-{i}" for r in range(4) for i in range(2)] for s in range(4)]  # 4 sessions x 4 rounds x 2 pages
TURN2 = [[f"L{s}-t2-{i}" for i in range(2)] for s in range(4)]
NEW = [[f"N{n}-{i}" for i in range(2)] for n in range(2)]


def fill_small_pool(store, pool, lay) -> None:
    """4 long sessions on disk, each in a file of its own, 52 of its 64 KiB."""
    for s in range(4):
        for r in range(4):
            ks = LONG[s][2 * r: 2 * r + 2]
            assert put_pages(store, pool, lay, ks, [2 * r, 2 * r + 1], prefix=LONG[s][: 2 * r] or None) == [True, True]
            assert store.flush_writes(30)
    assert [store.page_info(ks[0]).file_index for ks in LONG] == [0, 1, 2, 3]


def stream(store, pool, lay) -> list:
    """Each session's next turn (a round that fills its file), then two new sessions: more than
    the pool holds. Returns each put's result."""
    out = [put_pages(store, pool, lay, TURN2[s], [10, 11], prefix=LONG[s]) for s in range(4)]
    return out + [put_pages(store, pool, lay, NEW[n], [20 + 2 * n, 21 + 2 * n]) for n in range(2)]


def read_back(store, pool, lay) -> dict:
    """Session -> pages read back (a leading run), each checked bit for bit against its key."""
    hits = {}
    for name, keys in [(f"L{s}", LONG[s] + TURN2[s]) for s in range(4)] + [(f"N{n}", NEW[n]) for n in range(2)]:
        ok = store.get(keys, lay, list(range(30, 30 + len(keys))))
        n = ok.count(True)
        assert ok == [True] * n + [False] * (len(keys) - n)
        assert all(page_matches(pool, (30 + i) * pool.page_size, keys[i]) for i in range(n))  # bit-exact or a miss
        hits[name] = n
    return hits


def test_a_full_small_pool_evicts_a_scope_pinned_only_by_queued_rounds_as_the_queue_off_run_does(ssd_dir):
    off, pool, lay = make_store(ssd_dir + "-off", **SMALL_POOL, **{"ssd.write_backlog_bytes": 0})
    fill_small_pool(off, pool, lay)
    retired_off = []
    off.add_retire_listener(lambda keys: retired_off.append(sorted(keys)))
    res_off = stream(off, pool, lay)
    snap_off = off.snapshot_stats()
    hits_off = read_back(off, pool, lay)
    off.close()

    store, pool, lay = make_store(ssd_dir, **SMALL_POOL)  # the queue on, at its cap: a quarter of the pool
    q = store.queue
    assert q.backlog_limit == 64 << 10
    fill_small_pool(store, pool, lay)
    q.defer_max_s = q.urgent_bytes = q.urgent_fraction = float("inf")  # the writer held by the restore below
    q.reads_begin()
    l0 = store.page_info(LONG[0][0]).scope_id
    retired = []  # (the v2 adapter drops the extra pools' pages of these keys)
    store.add_retire_listener(lambda keys, scope_id: retired.append((scope_id, sorted(keys))), with_scope=True)
    res_on = stream(store, pool, lay)
    snap = store.snapshot_stats()
    # every session's next turn waits in the queue, pinning its whole session (the pool is full):
    # the first new session evicts the least recently used one, queued round and all
    assert [r.count(False) for r in res_on] == [r.count(False) for r in res_off] == [0] * 6
    assert (snap["put_failures"], snap_off["put_failures"]) == (0, 0)
    assert (snap["reclaimed_scopes_ssd"], snap_off["reclaimed_scopes_ssd"]) == (1, 1)
    assert snap["write_backlog_evicted_rounds"] == 1 and snap["errors"] == {} == snap_off["errors"]
    # the listeners hear of the evicted session once, its queued turn included, as with the queue off
    assert retired == [(l0, sorted(LONG[0] + TURN2[0]))] and retired_off == [sorted(LONG[0] + TURN2[0])]
    assert snap["write_backlog_bytes"] == 5 * 12288 and snap["write_backlog_pages"] == 10  # L1-L3 turns, N0, N1
    assert snap["ssd_write_bytes"] == snap_off["ssd_write_bytes"] - 6 * 12288 - 2 * fmt.BLOCK  # nothing of them written
    hits = read_back(store, pool, lay)
    assert hits == hits_off == {"L0": 0, "L1": 10, "L2": 10, "L3": 10, "N0": 2, "N1": 2}
    assert store.medium_of("L1-t2-0") == "queued" and store.medium_of("N1-0") == "queued"
    q.reads_end()
    assert store.flush_writes(30) and store.snapshot_stats()["write_backlog_bytes"] == 0
    assert read_back(store, pool, lay) == hits_off
    # the journal: every round written (L0's first four, then its RETIRE), never L0's evicted turn
    entries = list(jmod.read_journal(store.ssd.journal_path))
    assert len(journal_rounds(store)) == 4 * 4 + 3 + 2
    assert [e.seq for e in entries if e.scope_id == l0 and e.kind == jmod.ROUND] == [0, 1, 2, 3]
    assert [e.kind for e in entries if e.scope_id == l0][-1] == jmod.RETIRE
    store.close()
    again, pool, lay = make_store(ssd_dir, **SMALL_POOL)  # a restart serves the same pages, bit for bit
    assert again.rebuilt.pages == 3 * 10 + 2 * 2
    assert read_back(again, pool, lay) == hits_off
    again.close()


def test_a_scope_a_reader_or_the_writer_holds_is_not_evicted_the_next_one_is(ssd_dir, monkeypatch):
    store, pool, lay = make_store(ssd_dir, **SMALL_POOL)
    q = store.queue
    fill_small_pool(store, pool, lay)
    q.defer_max_s = q.urgent_bytes = q.urgent_fraction = float("inf")
    held = HeldWriter(store, monkeypatch)  # L0's next turn is being written (and stays so)
    assert put_pages(store, pool, lay, TURN2[0], [10, 11], prefix=LONG[0]) == [True, True]
    assert held.entered.wait(60)
    q.reads_begin()  # L1-L3's next turns wait behind it
    for s in (1, 2, 3):
        assert put_pages(store, pool, lay, TURN2[s], [12 + 2 * s, 13 + 2 * s], prefix=LONG[s]) == [True, True]
    entries = q.pin_leading_run(TURN2[1], store.index)  # a reader copying L1's queued pages
    assert len(entries) == 2
    assert put_pages(store, pool, lay, NEW[0], [20, 21]) == [True, True]  # L0 is written, L1 read: L2 goes
    snap = store.snapshot_stats()
    assert (snap["write_backlog_evicted_rounds"], snap["reclaimed_scopes_ssd"], snap["put_failures"]) == (1, 1, 0)
    assert [store.leading_run(LONG[s] + TURN2[s]) for s in range(4)] == [10, 10, 0, 10]
    rows = entries[0].job.chunks(1, [0, 1])  # the reader copies layer 1 from the queued buffer
    store.scopes.unpin(entries)
    q.release(entries)
    assert store.get(TURN2[1], lay, [42, 43]) == [True, True]
    assert page_matches(pool, 42 * pool.page_size, TURN2[1][0]) and page_matches(pool, 43 * pool.page_size, TURN2[1][1])
    ref = torch.empty_like(rows)
    lay.gather_chunks(torch.tensor([42, 43]), 1, ref)
    assert torch.equal(rows, ref)
    held.release()
    q.reads_end()
    assert store.flush_writes(30)
    assert [store.leading_run(LONG[s] + TURN2[s]) for s in range(4)] == [10, 10, 0, 10]
    assert store.get(NEW[0], lay, [44, 45]) == [True, True] and page_matches(pool, 45 * pool.page_size, "N0-1")
    store.close()
