"""The restart promise under faults (paper §3.1 index, §3.3 self-describing rounds): a published
SSD round is always in the pool journal, the eviction order survives a restart, a damaged pool
file is recreated as a new inode, and what a crash or a bad disk leaves behind is cleaned up."""

import errno
import fcntl
import os
import threading

import pytest
import flatcake_testkit as testkit
from flatcake_testkit import page_matches, put_pages

from flatcake.gva import journal as jmod
from flatcake.gva.address import MEDIUM_SSD
from flatcake.media import pool_faults


def make_store(ssd_dir, **kw):
    """``testkit.make_store`` with synchronous SSD writes (``ssd.write_backlog_bytes: 0``): these tests
    are about the synchronous write contract (a put's True means on disk and journaled; a write
    fault fails the put)."""
    return testkit.make_store(ssd_dir, **{"ssd.write_backlog_bytes": 0, **kw})


def served(store, pool, lay, keys, first_page=40) -> list[bool]:
    got = store.get(keys, lay, list(range(first_page, first_page + len(keys))))
    return [ok and page_matches(pool, (first_page + i) * pool.page_size, k) for i, (ok, k) in enumerate(zip(got, keys))]


def first_keys_oldest_first(store) -> list[str]:
    with store.scopes.lock:
        return [sc.keys[0] for sc in store.index.oldest_scopes_locked(MEDIUM_SSD)]


def test_a_truncated_pool_file_is_recreated_as_a_new_inode(ssd_dir):
    store, pool, lay = make_store(ssd_dir, **{"ssd.max_files": 1, "ssd.file_bytes": 1 << 20})
    put_pages(store, pool, lay, ["a0", "a1"], [0, 1])
    path = store.ssd.path_of(0)
    reader_fd = os.open(path, os.O_RDONLY)  # a reader's cached descriptor of the file
    os.truncate(path, 0)  # a tmp cleaner, behind the backend
    assert put_pages(store, pool, lay, ["b0"], [2]) == [False]  # this put finds out
    assert put_pages(store, pool, lay, ["b0"], [2]) == [True]
    try:
        st, old = os.stat(path), os.fstat(reader_fd)
        assert st.st_ino != old.st_ino and st.st_size == 1 << 20
        assert (old.st_size, os.pread(reader_fd, 4096, 0)) == (0, b"")  # never the truncated inode regrown
    finally:
        os.close(reader_fd)
    assert store.leading_run(["a0"]) == 0
    assert served(store, pool, lay, ["b0"]) == [True]
    store.close()


def test_a_failed_journal_append_fails_the_put_and_publishes_nothing(ssd_dir, monkeypatch):
    store, pool, lay = make_store(ssd_dir)
    put_pages(store, pool, lay, ["p0", "p1"], [0, 1])
    real = store.scopes.journal.append
    calls = []

    def append(e):
        calls.append(e)
        if len(calls) == 1:
            raise OSError(errno.ENOSPC, "No space left on device")
        return real(e)

    monkeypatch.setattr(store.scopes.journal, "append", append)
    used = store.ssd.used_bytes
    assert put_pages(store, pool, lay, ["q0"], [2]) == [False]
    assert store.leading_run(["q0"]) == 0 and store.ssd.used_bytes == used  # nothing published, space back
    assert put_pages(store, pool, lay, ["r0"], [3]) == [True]  # the journal is rewritten, then appended to
    assert store.snapshot_stats()["errors"].get("journal append/ENOSPC") == 1
    store.close()
    store, pool, lay = make_store(ssd_dir)
    assert served(store, pool, lay, ["p0", "p1", "r0"]) == [True] * 3
    assert store.leading_run(["q0"]) == 0
    store.close()


def test_a_torn_journal_append_is_repaired_before_the_next_entry(ssd_dir, monkeypatch):
    store, pool, lay = make_store(ssd_dir)
    put_pages(store, pool, lay, ["p0"], [0])
    journal = store.ssd.journal_path
    real = os.write
    torn = []

    def write(fd, data):
        if not torn and os.readlink(f"/proc/self/fd/{fd}") == journal:
            torn.append(fd)
            return real(fd, data[:20])  # a short write: 20 of 64 bytes
        return real(fd, data)

    monkeypatch.setattr(os, "write", write)
    assert put_pages(store, pool, lay, ["q0"], [1]) == [False]
    assert put_pages(store, pool, lay, ["r0", "r1"], [2, 3]) == [True, True]
    monkeypatch.setattr(os, "write", real)
    assert os.path.getsize(store.ssd.journal_path) % jmod.ENTRY_BYTES == 0
    store.close()
    store, pool, lay = make_store(ssd_dir)
    assert served(store, pool, lay, ["p0", "r0", "r1"]) == [True] * 3
    store.close()


@pytest.mark.parametrize("compact", [False, True])
def test_the_eviction_order_survives_a_restart(ssd_dir, compact):
    store, pool, lay = make_store(ssd_dir)
    for s in "ABC":
        put_pages(store, pool, lay, [f"{s}0"], [0])
    put_pages(store, pool, lay, ["A1"], [1], ["A0"])  # A is written again: now the most recent
    assert first_keys_oldest_first(store) == ["B0", "C0", "A0"]
    if compact:
        with store.scopes.lock:
            store.scopes.journal.rewrite(store.scopes.journal_entries_locked())
    store.close()
    store, pool, lay = make_store(ssd_dir)
    assert first_keys_oldest_first(store) == ["B0", "C0", "A0"]
    store.close()


def test_reclaim_never_frees_the_scope_a_put_just_wrote(ssd_dir):
    cfg = {"ssd.max_files": 1, "ssd.file_bytes": 256 << 10, "ssd.high_watermark": 0.5, "ssd.low_watermark": 0.1}
    store, pool, lay = make_store(ssd_dir, page_size=16, **cfg)
    put_pages(store, pool, lay, ["old"], [0])
    keys = [f"big{i}" for i in range(30)]  # alone above the high watermark
    assert put_pages(store, pool, lay, keys, range(1, 31)) == [True] * 30
    assert store.ssd.used_fraction() > 0.5
    assert store.leading_run(["old"]) == 0  # the older scope went ...
    assert served(store, pool, lay, keys[:8], first_page=40) == [True] * 8  # ... not the one just written
    store.close()


def test_scopes_of_a_file_out_of_service_come_back_at_restart_and_the_file_returns(ssd_dir, monkeypatch):
    cfg = {"ssd.file_bytes": 256 << 10, "ssd.max_files": 3}
    store, pool, lay = make_store(ssd_dir, **cfg)
    put_pages(store, pool, lay, ["old0", "old1"], [0, 1])
    bad = store.ssd.path_of(0)
    real_pwritev, real_pwrite = os.pwritev, os.pwrite

    def refuse(real):
        def call(fd, *a):
            if os.readlink(f"/proc/self/fd/{fd}") == bad:
                raise OSError(errno.EIO, "Input/output error")
            return real(fd, *a)
        return call

    monkeypatch.setattr(os, "pwritev", refuse(real_pwritev))
    monkeypatch.setattr(os, "pwrite", refuse(real_pwrite))
    assert put_pages(store, pool, lay, ["new0"], [2]) == [False]
    assert store.snapshot_stats()["media"]["ssd"]["files_out_of_service"] == [0]
    monkeypatch.setattr(pool_faults, "OUT_OF_SERVICE_RETRY_S", 0.0)
    assert put_pages(store, pool, lay, ["new1"], [3]) == [True]  # the probe still fails: stays out
    assert store.snapshot_stats()["media"]["ssd"]["files_out_of_service"] == [0]
    assert store.leading_run(["old0"]) == 0
    store.close()
    monkeypatch.setattr(os, "pwritev", real_pwritev)
    monkeypatch.setattr(os, "pwrite", real_pwrite)
    store, pool, lay = make_store(ssd_dir, **cfg)  # the disk is fine again: nothing was RETIREd
    assert served(store, pool, lay, ["old0", "old1", "new1"]) == [True] * 3
    store.close()


def test_a_file_out_of_service_is_probed_and_put_back_in_service_empty(ssd_dir, monkeypatch):
    store, pool, lay = make_store(ssd_dir, **{"ssd.file_bytes": 256 << 10, "ssd.max_files": 2})
    put_pages(store, pool, lay, ["old0"], [0])
    gen = store.ssd.generation_of(0)
    with store.scopes.lock:
        store.scopes.take_file_out_of_service_locked(0)
    assert store.ssd.capacity_bytes == 256 << 10 and store.leading_run(["old0"]) == 0
    monkeypatch.setattr(pool_faults, "OUT_OF_SERVICE_RETRY_S", 0.0)
    assert put_pages(store, pool, lay, ["x0"], [1]) == [True]  # its allocation probes file 0 first
    st = store.snapshot_stats()["media"]["ssd"]
    assert (st["files_out_of_service"], st["capacity_bytes"], st["state"]) == ([], 512 << 10, "healthy")
    assert store.ssd.generation_of(0) == gen + 2  # back empty: x0 took the best fit at its start
    assert store.page_info("x0").file_index == 0 and served(store, pool, lay, ["x0"]) == [True]
    store.close()


def test_a_corrupt_journal_entry_loses_only_its_round(ssd_dir):
    store, pool, lay = make_store(ssd_dir)
    for s in range(3):
        put_pages(store, pool, lay, [f"s{s}"], [s])
    path = store.ssd.journal_path
    store.close()
    with open(path, "r+b") as f:  # a flipped bit in the first entry
        f.seek(9)
        b = f.read(1)
        f.seek(9)
        f.write(bytes([b[0] ^ 1]))
    store, pool, lay = make_store(ssd_dir)
    assert store.leading_run(["s0"]) == 0
    assert served(store, pool, lay, ["s1", "s2"]) == [True, True]
    store.close()


def test_a_compaction_cut_short_leaves_no_file_behind(ssd_dir):
    store, pool, lay = make_store(ssd_dir)
    put_pages(store, pool, lay, ["k0"], [0])
    tmp = f"{store.ssd.journal_path}.4242.tmp"
    store.close()
    with open(tmp, "wb") as f:
        f.write(b"\0" * 128)
    store, pool, lay = make_store(ssd_dir)
    assert not os.path.exists(tmp)
    assert served(store, pool, lay, ["k0"]) == [True]
    store.close()


def test_a_lowered_file_size_shrinks_the_pool_files_and_keeps_the_rounds_that_fit(ssd_dir):
    store, pool, lay = make_store(ssd_dir, **{"ssd.file_bytes": 1 << 20, "ssd.max_files": 1})
    put_pages(store, pool, lay, ["k0", "k1"], [0, 1])
    path = store.ssd.path_of(0)
    store.close()
    store, pool, lay = make_store(ssd_dir, **{"ssd.file_bytes": 512 << 10, "ssd.max_files": 1})
    assert os.path.getsize(path) == 512 << 10
    assert served(store, pool, lay, ["k0", "k1"]) == [True, True]  # written at the start of the file
    assert put_pages(store, pool, lay, ["k2"], [2]) == [True]
    store.close()


def test_a_liveness_probe_holding_the_lock_for_an_instant_does_not_fail_the_start(ssd_dir):
    store, pool, lay = make_store(ssd_dir)
    lock = os.path.join(ssd_dir, store.ssd.prefix + ".lock")
    store.close()
    fd = os.open(lock, os.O_RDONLY)
    fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)  # another server's pool_dir.is_live probe
    t = threading.Timer(0.2, os.close, (fd,))
    t.start()
    store, pool, lay = make_store(ssd_dir)
    t.join()
    assert store.ssd.health() == "healthy"
    store.close()
