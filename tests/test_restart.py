"""Warm restart (paper §3.1 index, §3.3 self-describing rounds): a store that opens a pool it
wrote before serves every committed SSD page again, bit for bit, and nothing else. Every test
runs with the default write queue and without it (``ssd.write_backlog_bytes: 0``)."""

import os

import pytest
import flatcake_testkit as testkit
from flatcake_testkit import page_matches, put_pages, two_requests_share

from flatcake.gva import journal as jmod
from flatcake.gva.address import OFFSET_MASK
from flatcake.media import extent as fmt


WRITE_MODES = {"queue": {},  # the default: a put returns once its round is queued; close() drains the queue
               "sync": {"ssd.write_backlog_bytes": 0}}  # the put writes its round itself


@pytest.fixture(params=list(WRITE_MODES))
def make_store(request):
    """``testkit.make_store`` in each write mode (docs/durability.md, "Write ordering"). A clean
    close writes what the queue holds, so a restart serves every page whose put returned True in
    both; a test that inspects what is on disk (index entries, rounds, the journal) before the
    close first waits for the queue (:func:`on_disk`)."""
    mode = WRITE_MODES[request.param]
    return lambda ssd_dir, **kw: testkit.make_store(ssd_dir, **{**mode, **kw})


def on_disk(store) -> None:
    """Wait until every queued round is written and journaled (at once without a queue)."""
    assert store.flush_writes(60)


def sessions(n_sessions, pages):
    return [[f"s{s}-p{i}" for i in range(pages)] for s in range(n_sessions)]


def fill(store, pool, lay, sess):
    for s, keys in enumerate(sess):
        half = len(keys) // 2  # two rounds per session: the second chained on the first
        assert put_pages(store, pool, lay, keys[:half], range(half)) == [True] * half
        assert put_pages(store, pool, lay, keys[half:], range(half, len(keys)), keys[:half]) == [True] * (len(keys) - half)


def served(store, pool, lay, keys, first_page=40) -> list[bool]:
    got = store.get(keys, lay, list(range(first_page, first_page + len(keys))))
    return [ok and page_matches(pool, (first_page + i) * pool.page_size, k) for i, (ok, k) in enumerate(zip(got, keys))]


def test_restart_serves_every_committed_ssd_page_and_no_dram_page(make_store, ssd_dir):
    store, pool, lay = make_store(ssd_dir, **{"dram.capacity_bytes": 1 << 20})
    sess = sessions(5, 6)
    fill(store, pool, lay, sess)
    shared = ["sys0", "sys1"]
    two_requests_share(store.leading_run, shared)
    put_pages(store, pool, lay, shared, [20, 21])
    assert store.medium_of("sys0") == "dram"
    store.close()
    pool.kv_buffer.zero_()
    store, pool2, lay2 = make_store(ssd_dir, **{"dram.capacity_bytes": 1 << 20})
    st = store.snapshot_stats()
    assert (st["pages_rebuilt"], st["scopes"]) == (30, 5)
    for keys in sess:
        assert store.leading_run(keys) == 6
        assert served(store, pool2, lay2, keys) == [True] * 6
    assert store.leading_run(shared) == 0  # DRAM pages do not outlive the process
    assert all(store.page_info(k).medium == "ssd" for k in sess[0])
    store.close()


def test_rebuilt_pages_are_checked_even_with_verification_off(make_store, ssd_dir):
    store, pool, lay = make_store(ssd_dir, **{"cio.verify_checksums": False})
    keys = ["v0", "v1", "v2"]
    put_pages(store, pool, lay, keys, range(3))
    on_disk(store)
    e = store.index.get("v1")
    path, off = store.ssd.path_of((e.gva & OFFSET_MASK) // store.ssd.file_bytes), (e.gva & OFFSET_MASK) % store.ssd.file_bytes
    store.close()
    with open(path, "r+b") as f:  # bit rot in page v1 while the server was down
        f.seek(off + 7)
        b = f.read(1)
        f.seek(off + 7)
        f.write(bytes([b[0] ^ 0x40]))
    store, pool, lay = make_store(ssd_dir, **{"cio.verify_checksums": False})
    assert store.leading_run(keys) == 3  # the record is intact: advertised ...
    assert served(store, pool, lay, keys) == [True, False, False]  # ... but never other bytes
    assert store.snapshot_stats()["checksum_failures"] == 1
    store.close()


def test_another_namespace_is_never_served_and_its_pool_is_left_alone(make_store, ssd_dir):
    store, pool, lay = make_store(ssd_dir)
    put_pages(store, pool, lay, ["n0", "n1"], [0, 1])
    prefix = store.ssd.prefix
    store.close()
    other, pool2, lay2 = make_store(ssd_dir, mla=True)  # another model: another namespace
    assert other.leading_run(["n0", "n1"]) == 0 and other.snapshot_stats()["pages_rebuilt"] == 0
    other.close()
    assert os.path.exists(os.path.join(ssd_dir, f"{prefix}-00000.pool"))  # kept: within the capacity
    store, pool, lay = make_store(ssd_dir)  # and served again when its namespace returns
    assert served(store, pool, lay, ["n0", "n1"]) == [True, True]
    store.close()


@pytest.mark.parametrize("damage", ["record", "truncate"])
def test_a_torn_last_round_is_a_miss_and_every_earlier_round_is_served(make_store, ssd_dir, damage):
    store, pool, lay = make_store(ssd_dir)
    r1, r2 = ["t0", "t1"], ["t2", "t3"]
    put_pages(store, pool, lay, r1, [0, 1])
    put_pages(store, pool, lay, r2, [2, 3], r1)
    on_disk(store)
    last = store.index.get("t2").scope.rounds[-1]
    hdr = fmt.unpack_round_header(store.ssd.read_at(last.file_index, last.round_offset, fmt.BLOCK))
    path = store.ssd.path_of(last.file_index)
    store.close()
    with open(path, "r+b") as f:
        if damage == "record":  # the second write of the round never finished
            f.seek(last.round_offset + hdr.layout.record_offset)
            f.write(b"\0" * fmt.BLOCK)
        else:
            f.truncate(last.round_offset + fmt.BLOCK)
    store, pool, lay = make_store(ssd_dir)
    assert store.leading_run(r1 + r2) == 2
    assert served(store, pool, lay, r1) == [True, True]
    assert store.rebuilt.rounds_dropped == 1
    store.close()


def test_rebuild_reads_only_the_records(make_store, ssd_dir, monkeypatch):
    store, pool, lay = make_store(ssd_dir)
    fill(store, pool, lay, sessions(4, 8))
    on_disk(store)
    rounds = [e for sc in store.index.scopes.values() for e in sc.rounds]
    store.close()
    reads, listings = [], []
    real_listdir = os.listdir
    from flatcake.gva import rebuild

    real_read_round = rebuild.read_round

    def read_round(ssd, e, digest, geometry, read=None):
        def traced(f, off, n):
            reads.append((f, off, n))
            return (read or ssd.read_at)(f, off, n)
        return real_read_round(ssd, e, digest, geometry, traced)

    monkeypatch.setattr(rebuild, "read_round", read_round)
    monkeypatch.setattr(os, "listdir", lambda d: listings.append(d) or real_listdir(d))
    store, pool, lay = make_store(ssd_dir)
    assert store.rebuilt.rounds == len(rounds) == 8
    records = {(e.file_index, e.round_offset + e.record_offset, e.record_bytes) for e in rounds}
    assert sorted(reads) == sorted(records)  # one read per round, of its record: no header, no data
    assert listings == [ssd_dir]  # one listing of ssd.path (a few files per pool), none per page
    store.close()


def test_a_recovered_session_keeps_growing_after_the_restart(make_store, ssd_dir):
    store, pool, lay = make_store(ssd_dir)
    keys = [f"g{i}" for i in range(6)]
    put_pages(store, pool, lay, keys[:3], range(3))
    on_disk(store)
    sid = store.page_info("g0").scope_id
    store.close()
    store, pool, lay = make_store(ssd_dir)
    put_pages(store, pool, lay, keys[3:], range(3, 6), keys[:3])  # the next turn, chained on the tail
    on_disk(store)
    assert store.page_info("g3").scope_id == sid  # joins the recovered scope
    new = put_pages(store, pool, lay, ["fresh"], [7])
    on_disk(store)
    assert new == [True] and store.page_info("fresh").scope_id > sid  # ids never collide with disk
    store.close()
    store, pool, lay = make_store(ssd_dir)
    assert served(store, pool, lay, keys + ["fresh"]) == [True] * 7
    store.close()


def test_a_journal_entry_for_reused_space_is_dropped(make_store, ssd_dir):
    store, pool, lay = make_store(ssd_dir, **{"ssd.max_files": 1})
    put_pages(store, pool, lay, ["old0", "old1"], [0, 1])
    on_disk(store)  # its ROUND entry in the journal
    journal = store.ssd.journal_path
    store.clear()  # appends RETIRE and frees the space ...
    put_pages(store, pool, lay, ["new0", "new1", "new2"], [2, 3, 4])  # ... which the next scope reuses
    store.close()
    entries = [e for e in jmod.read_journal(journal) if e.kind != jmod.RETIRE]  # as if the RETIRE were lost
    jmod.JournalWriter(journal, entries).close()
    store, pool, lay = make_store(ssd_dir, **{"ssd.max_files": 1})
    assert store.leading_run(["old0"]) == 0  # its round's identity no longer matches the bytes there
    assert served(store, pool, lay, ["new0", "new1", "new2"]) == [True] * 3
    store.close()


def test_the_journal_stays_bounded_by_the_live_rounds(make_store, ssd_dir, monkeypatch):
    monkeypatch.setattr("flatcake.gva.scopes.COMPACT_MIN_ENTRIES", 8)
    store, pool, lay = make_store(ssd_dir, **{"ssd.file_bytes": 256 << 10, "ssd.max_files": 1,
                                              "ssd.high_watermark": 0.5, "ssd.low_watermark": 0.3})
    for s in range(60):  # far more rounds than fit: reclaim retires most of them
        put_pages(store, pool, lay, [f"j{s}"], [s % 32])
    on_disk(store)
    live = store.scopes.live_rounds
    assert live < 20
    assert os.path.getsize(store.ssd.journal_path) <= (2 * live + 8 + 2) * jmod.ENTRY_BYTES
    keys = [k for sc in store.index.scopes.values() for k in sc.keys]
    store.close()
    store, pool, lay = make_store(ssd_dir, **{"ssd.file_bytes": 256 << 10, "ssd.max_files": 1})
    assert store.rebuilt.journal_entries <= 2 * live + 10 and store.rebuilt.pages == len(keys)
    store.close()
