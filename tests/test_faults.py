"""Inputs and faults that used to go wrong (issue: trustworthy under faults and restarts), each
as a test of the whole kind: a page read back is the page written or a miss, nothing raises,
resources stay bounded, and the store keeps serving."""

import errno
import logging
import os
import threading

import pytest
import torch
import flatcake_testkit as testkit
from flatcake_testkit import page_matches, put_pages, two_requests_share

from flatcake.gva.address import OFFSET_MASK


def make_store(ssd_dir, **kw):
    """``testkit.make_store`` with synchronous SSD writes (``ssd.write_backlog_bytes: 0``): these tests
    are about the synchronous write contract (a put's True means on disk and journaled; a write
    fault fails the put)."""
    return testkit.make_store(ssd_dir, **{"ssd.write_backlog_bytes": 0, **kw})


DRAM = {"dram.capacity_bytes": 64 * 1536}  # 64 page slots of the test geometry


def fd_path(fd: int) -> str:
    try:
        return os.readlink(f"/proc/self/fd/{fd}")
    except OSError:
        return ""


def open_fds() -> int:
    return len(os.listdir("/proc/self/fd"))


# ---------------------------------------------------------------- 1. DRAM slots: one owner, identity checked
def test_a_dram_write_that_fails_part_way_leaves_no_slot_with_two_owners(ssd_dir, monkeypatch):
    store, pool, lay = make_store(ssd_dir, **DRAM)
    import flatcake.store.write_path as write_path_mod

    real = write_path_mod.gather_pages
    calls = {"n": 0}

    def flaky_gather(layout, page_ids, layer, out):
        calls["n"] += 1
        if calls["n"] == 2:  # the first DRAM round dies in its second layer
            raise RuntimeError("gather failed")
        return real(layout, page_ids, layer, out)

    monkeypatch.setattr(write_path_mod, "gather_pages", flaky_gather)
    a = [f"a{i}" for i in range(4)]
    two_requests_share(store.leading_run, a)
    assert put_pages(store, pool, lay, a, range(4)) == [False] * 4
    sessions = [[f"s{s}-{i}" for i in range(4)] for s in range(8)]
    for s, keys in enumerate(sessions):  # more DRAM sessions reuse the free slots
        two_requests_share(store.leading_run, keys)
        assert put_pages(store, pool, lay, keys, range(4 + 4 * s, 8 + 4 * s)) == [True] * 4
    owners = [slot for sc in store.index.scopes.values() for slot in sc.slots]
    assert len(owners) == len(set(owners)) == 32 and store.dram.free_slots == 32
    store.clear()
    assert store.dram.free_slots == 64  # every slot freed once
    store.close()


def test_a_dram_slot_holding_another_page_is_a_miss_never_its_bytes(ssd_dir):
    store, pool, lay = make_store(ssd_dir, **DRAM)
    keys = ["x0", "x1"]
    two_requests_share(store.leading_run, keys)
    put_pages(store, pool, lay, keys, [0, 1])
    slot = lambda k: (store.index.get(k).gva & OFFSET_MASK) // store.geometry.page_bytes  # noqa: E731
    store.dram.slots[slot("x1")] = store.dram.slots[slot("x0")]  # a slot handed to two pages ...
    store.dram.set_identity([slot("x1")], ["x0"])  # ... whose last writer was x0
    assert store.get(keys, lay, [10, 11]) == [True, False]
    assert page_matches(pool, 10 * pool.page_size, "x0")
    assert store.snapshot_stats()["checksum_failures"] == 1
    store.close()


# ---------------------------------------------------------------- 3. a disk that fills while files are created
def test_a_full_disk_while_creating_pool_files_is_logged_once_and_retried_when_room_returns(ssd_dir, monkeypatch, caplog):
    fds0 = open_fds()
    store, pool, lay = make_store(ssd_dir, **{"ssd.file_bytes": 256 << 10, "ssd.max_files": 4})
    real_fallocate, real_statvfs = os.posix_fallocate, os.statvfs
    state = {"full": True, "tries": 0}

    def fallocate(fd, off, n):
        if state["full"]:
            state["tries"] += 1
            raise OSError(errno.ENOSPC, "No space left on device")
        return real_fallocate(fd, off, n)

    class Vfs:
        def __init__(self, st):
            self.f_frsize, self.f_bavail = st.f_frsize, (0 if state["full"] else st.f_bavail)

    monkeypatch.setattr(os, "posix_fallocate", fallocate)
    monkeypatch.setattr(os, "statvfs", lambda p: Vfs(real_statvfs(p)))
    with caplog.at_level(logging.WARNING):
        for s in range(80):  # ~20 KiB a session: file 0 fills, then the old sessions are reclaimed
            keys = [f"f{s}-{i}" for i in range(3)]
            put_pages(store, pool, lay, keys, range(3))
            assert open_fds() <= fds0 + 16  # no descriptor leaks per retry
    assert state["tries"] == 1  # the creation was not retried while the disk stayed full
    assert sum("create pool file" in r.getMessage() for r in caplog.records) == 1
    assert store.snapshot_stats()["media"]["ssd"]["state"] == "degraded"
    assert sorted(os.listdir(ssd_dir)).count(f"{store.ssd.prefix}-00001.pool") == 0  # no half-created file
    state["full"] = False
    from flatcake.media import drives

    monkeypatch.setattr(drives, "CREATE_RETRY_CHECK_S", 0.0)  # the next put checks the free space again
    for s in range(80, 100):
        put_pages(store, pool, lay, [f"f{s}-0"], [0])
    assert store.page_info("f99-0").file_index >= 1 and store.ssd.health() == "healthy"  # no restart
    store.close()
    assert open_fds() == fds0


# ---------------------------------------------------------------- 4. admission, and one writer per key
def test_two_threads_putting_the_same_new_keys_write_them_once(ssd_dir, monkeypatch):
    """The first put's write waits until the second put has asked for the same keys (its claim),
    so the two puts overlap on every run, however loaded the machine."""
    store, pool, lay = make_store(ssd_dir)
    keys = [f"d{i}" for i in range(6)]
    for i, k in enumerate(keys):
        put_pages(store, pool, lay, [k], [i])  # fill the pages once ...
    store.clear()
    claims, real_claim, real_write = store.scopes.claims, store.scopes.claims.claim, store.ssd.write
    asked, both_asked, writes = [], threading.Event(), []

    def claim(ks, *a, **kw):
        asked.append(list(ks))
        if len(asked) == 2:
            both_asked.set()
        return real_claim(ks, *a, **kw)

    def write_when_both_asked(*a):
        writes.append(len(asked))
        if len(writes) == 1:
            assert both_asked.wait(60), "the second put never asked for the keys"
        real_write(*a)

    monkeypatch.setattr(claims, "claim", claim)
    monkeypatch.setattr(store.ssd, "write", write_when_both_asked)
    results = []
    ts = [threading.Thread(target=lambda: results.append(store.put(keys, lay, list(range(6))))) for _ in range(2)]
    for t in ts:
        t.start()
    for t in ts:
        t.join(120)
    assert not any(t.is_alive() for t in ts)
    assert results == [[True] * 6, [True] * 6] and asked == [keys, keys]
    assert store.snapshot_stats()["pages_written_ssd"] == 6 + 6  # ... then each key once more, not twice
    assert store.get(keys, lay, list(range(10, 16))) == [True] * 6
    store.close()


# ---------------------------------------------------------------- 6. the pool fills before the first eviction
@pytest.mark.parametrize("pages", [1, 2, 7, 32])
def test_the_pool_is_at_least_85_percent_used_when_the_first_eviction_happens(ssd_dir, pages):
    store, pool, lay = make_store(ssd_dir, pages=64, **{"ssd.file_bytes": 1 << 20, "ssd.max_files": 2})
    peak = 0.0
    s = 0
    while store.snapshot_stats()["reclaimed_scopes_ssd"] == 0:
        peak = max(peak, store.ssd.used_fraction())
        assert put_pages(store, pool, lay, [f"p{s}-{i}" for i in range(pages)], range(pages)) == [True] * pages
        s += 1
    assert peak >= 0.85, (pages, s, peak)
    store.close()


# ---------------------------------------------------------------- 8. a pool file that refuses writes
@pytest.mark.parametrize("code", [errno.EROFS, errno.EIO, errno.EPERM])
def test_a_pool_file_refusing_writes_goes_out_of_service_and_the_others_keep_working(ssd_dir, monkeypatch, code):
    store, pool, lay = make_store(ssd_dir, **{"ssd.file_bytes": 256 << 10, "ssd.max_files": 3})
    put_pages(store, pool, lay, ["old0", "old1"], [0, 1])
    bad = store.ssd.path_of(0)
    real = os.pwritev

    def pwritev(fd, bufs, off):
        if fd_path(fd) == bad:
            raise OSError(code, os.strerror(code))
        return real(fd, bufs, off)

    monkeypatch.setattr(os, "pwritev", pwritev)
    assert put_pages(store, pool, lay, ["new0"], [2]) == [False]  # it lands in file 0 and fails ...
    for i in range(1, 6):  # ... then every later put goes to the other files
        assert put_pages(store, pool, lay, [f"new{i}"], [2 + i]) == [True]
        assert store.page_info(f"new{i}").file_index != 0
    st = store.snapshot_stats()["media"]["ssd"]
    assert (st["state"], st["files_out_of_service"], st["capacity_bytes"]) == ("degraded", [0], 2 * (256 << 10))
    assert store.leading_run(["old0"]) == 0  # its scopes are dropped
    assert store.get(["new1"], lay, [20]) == [True] and page_matches(pool, 20 * pool.page_size, "new1")
    store.close()


# ---------------------------------------------------------------- 9. re-issued hit queries
def test_a_reissued_hit_query_counts_once(ssd_dir):
    store, pool, lay = make_store(ssd_dir, **DRAM)
    for _ in range(3):  # SGLang re-issues the same request's query
        store.leading_run(["q0", "q1"])
    put_pages(store, pool, lay, ["q0", "q1"], [0, 1])
    assert store.page_info("q0").reuse == "one_shot" and store.medium_of("q0") == "ssd"
    for _ in range(3):  # the next turn of the session, queried three times
        store.leading_run(["q0", "q1", "q2"])
    assert store.page_info("q0").turn == 2
    store.close()


# ---------------------------------------------------------------- faults on the SSD medium
def test_io_faults_are_misses_or_failed_puts_logged_once_and_writes_resume(ssd_dir, monkeypatch, caplog):
    store, pool, lay = make_store(ssd_dir, **{"cio.verify_checksums": False})
    put_pages(store, pool, lay, ["k0", "k1"], [0, 1])
    real_w, real_r = os.pwritev, os.preadv
    mode = {"w": None, "r": None}

    def pwritev(fd, bufs, off):
        if mode["w"] == "enospc":
            raise OSError(errno.ENOSPC, "No space left on device")
        if mode["w"] == "short":
            return real_w(fd, [memoryview(bufs[0])[:4096]], off) if len(bufs[0]) > 4096 else 0
        return real_w(fd, bufs, off)

    def preadv(fd, bufs, off):
        if mode["r"] == "eio":
            raise OSError(errno.EIO, "Input/output error")
        return real_r(fd, bufs, off)

    monkeypatch.setattr(os, "pwritev", pwritev)
    from flatcake.cio import engines

    monkeypatch.setattr(engines.os, "preadv", preadv)
    from flatcake.cio import native_restore  # the Python pipeline: its reads go through os.preadv

    monkeypatch.setitem(native_restore.LOOP.state, "fn", None)
    with caplog.at_level(logging.WARNING):
        for i, w in enumerate(["enospc", "enospc", "short", "short"]):
            mode["w"] = w
            assert put_pages(store, pool, lay, [f"w{i}"], [2]) == [False]
        mode["w"] = None  # the disk has room again: writes resume, no restart
        assert put_pages(store, pool, lay, ["w9"], [2]) == [True]
        mode["r"] = "eio"
        assert store.get(["k0", "k1"], lay, [10, 11]) == [False, False]
        mode["r"] = None
    assert sum("ENOSPC" in r.getMessage() for r in caplog.records) == 1
    assert sum("(EIO)" in r.getMessage() for r in caplog.records) <= 2  # short write + read, once each
    assert store.get(["w9"], lay, [12]) == [True] and page_matches(pool, 12 * pool.page_size, "w9")
    assert store.snapshot_stats()["media"]["ssd"]["state"] == "healthy"  # ENOSPC is not a broken file
    store.close()


def test_a_truncated_extent_is_a_miss_and_the_store_keeps_serving(ssd_dir):
    store, pool, lay = make_store(ssd_dir, **{"ssd.max_files": 2, "ssd.file_bytes": 1 << 20})
    put_pages(store, pool, lay, ["t0", "t1"], [0, 1])
    e = store.index.get("t1")
    os.truncate(store.ssd.path_of(0), (e.gva & OFFSET_MASK) % store.ssd.file_bytes + 100)
    # layer-major round: t0/L0 | t1/L0 | t0/L1 ...: the cut inside t1/L0 loses t0's later layers too
    assert store.get(["t0", "t1"], lay, [10, 11]) == [False, False]
    assert store.leading_run(["t0"]) == 0  # the scope is dropped: no more promises
    pool.kv_buffer.view(torch.uint8).zero_()
    for i in range(3):  # the first write may be the one that finds the file truncated
        put_pages(store, pool, lay, [f"after{i}"], [i])
    assert store.get(["after2"], lay, [20]) == [True] and page_matches(pool, 20 * pool.page_size, "after2")
    store.close()
