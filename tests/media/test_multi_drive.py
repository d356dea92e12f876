"""Several NVMe drives without RAID: ``ssd.path`` as a list (``docs/design.md``, "Several drives").

Files go round-robin over the drives, one scope's rounds land on different drives, a restore
reads the drives concurrently, capacity and health are per drive, a failed drive takes only the
pages stored on it, and a warm restart finds the files on every drive — never wrong bytes when
the drive list changed."""

import errno
import os
import shutil
import threading

import pytest
import flatcake_testkit as testkit
from flatcake_testkit import page_matches, put_pages

from flatcake.store import native_write
from flatcake.media import pool_dir


def make_store(ssd_dir, **kw):
    """``testkit.make_store`` with synchronous SSD writes (``ssd.write_backlog_bytes: 0``): these tests
    inject drive faults and restarts right after a put and expect its rounds on disk and journaled
    when it returns."""
    return testkit.make_store(ssd_dir, **{"ssd.write_backlog_bytes": 0, **kw})


BASE = {"ssd.file_bytes": 1 << 20, "ssd.max_files": 4}


@pytest.fixture
def drives(tmp_path):
    """Three drive directories (only their paths: the pool creates them)."""
    return [str(tmp_path / f"nvme{i}" / "fc") for i in range(3)]


def open_store(paths, **kw):
    return make_store(paths[0], **{**BASE, "ssd.path": list(paths), **kw})


def put_session(store, pool, lay, name, rounds, per_round=2, first_page=0):
    """One session of ``rounds`` backups of ``per_round`` pages, each chained to the last:
    returns its keys in order."""
    keys, page = [], first_page
    for r in range(rounds):
        ks = [f"{name}{r}.{i}" for i in range(per_round)]
        assert put_pages(store, pool, lay, ks, range(page, page + per_round), keys or None) == [True] * per_round
        keys += ks
        page += per_round
    return keys


def served(store, pool, lay, keys, first_page=40):
    """Per key: read back alone into a fresh page and bit-exact (False: a miss)."""
    out = []
    for i, k in enumerate(keys):
        p = first_page + i
        out.append(store.get([k], lay, [p]) == [True] and page_matches(pool, p * pool.page_size, k))
    return out


def drive_dir_of(store, key):
    return os.path.dirname(store.ssd.path_of(store.page_info(key).file_index))


def pool_files(d):
    return sorted(n for n in os.listdir(d) if n.endswith(".pool")) if os.path.isdir(d) else []


def test_pool_files_go_round_robin_over_the_drives_and_the_journal_on_the_first(drives):
    store, _, _ = open_store(drives, **{"ssd.max_files": 6})
    pre = store.ssd.prefix
    assert [store.ssd.path_of(i) for i in range(6)] == [os.path.join(drives[i % 3], f"{pre}-{i:05d}.pool")
                                                         for i in range(6)]
    assert [list(store.ssd.drive_files(d)) for d in range(3)] == [[0, 3], [1, 4], [2, 5]]
    # start-up made every drive's directory and its first file (a bad drive fails at start-up)
    assert [pool_files(d) for d in drives] == [[f"{pre}-{i:05d}.pool"] for i in range(3)]
    assert store.ssd.journal_path == os.path.join(drives[0], pre + ".journal")
    assert [os.path.exists(os.path.join(d, pre + ".journal")) for d in drives] == [True, False, False]
    assert [os.path.exists(os.path.join(d, pre + ".lock")) for d in drives] == [True, True, True]
    st = store.snapshot_stats()["media"]["ssd"]
    assert [(d["drive"], d["path"], d["files"], d["configured_capacity_bytes"]) for d in st["drives"]] == \
        [(i, drives[i], 2, 2 << 20) for i in range(3)]
    store.close()


def test_a_drive_that_cannot_be_created_fails_start_up_naming_it(drives, tmp_path):
    blocker = tmp_path / "file"
    blocker.write_bytes(b"x")
    bad = str(blocker / "fc")  # under a regular file: cannot be created
    with pytest.raises(Exception) as ei:
        open_store([drives[0], bad])
    assert repr(bad) in str(ei.value)


def test_fewer_files_than_drives_uses_the_first_drives_and_warns(drives, caplog):
    store, pool, lay = open_store(drives, **{"ssd.max_files": 2})  # e.g. a hybrid model's small extra pool
    assert [d.path for d in store.ssd.drives] == drives[:2] and not os.path.exists(drives[2])
    assert any("ssd.max_files=2 is below the 3 drives" in r.getMessage() for r in caplog.records)
    keys = put_session(store, pool, lay, "s", rounds=2)
    assert [drive_dir_of(store, k) for k in keys[::2]] == drives[:2] and served(store, pool, lay, keys) == [True] * 4
    store.close()


def test_one_sessions_rounds_land_on_the_drives_in_turn_and_read_back_bit_exact(drives):
    store, pool, lay = open_store(drives, **{"ssd.max_files": 6})
    keys = put_session(store, pool, lay, "s", rounds=6)
    scope = store.index.get(keys[0]).scope
    ds = [store.ssd.drive_of(x.file_index) for x in scope.extents]
    assert len(ds) == 6 and all(ds[i + 1] == (ds[i] + 1) % 3 for i in range(5))  # one extent per round
    assert [drive_dir_of(store, k) for k in keys[::2]] == [drives[d] for d in ds]
    assert store.leading_run(keys) == 12
    assert store.get(keys, lay, range(20, 32)) == [True] * 12
    assert all(page_matches(pool, (20 + i) * pool.page_size, k) for i, k in enumerate(keys))
    # a second session starts on the next drive, so new sessions spread over the drives too
    other = put_session(store, pool, lay, "t", rounds=1, first_page=12)
    assert store.ssd.drive_of(store.page_info(other[0]).file_index) == (ds[0] + 1) % 3
    st = store.snapshot_stats()["media"]["ssd"]["drives"]
    assert sum(d["used_bytes"] for d in st) == store.ssd.used_bytes > 0
    assert all(d["used_bytes"] > 0 and d["state"] == "healthy" for d in st)
    store.close()


def test_a_restore_reads_the_drives_concurrently(drives, monkeypatch):
    """The restore engine's reader threads take merged reads of different files at the same
    time: the first read of each drive waits at a barrier for the other drive's, which only a
    concurrent read can pass (a serial restore would break the barrier and miss)."""
    store, pool, lay = open_store(drives[:2], **{"cio.io_workers": 4})
    keys = put_session(store, pool, lay, "s", rounds=4, per_round=4)
    barrier = threading.Barrier(2, timeout=20)
    seen: dict = {}
    lock = threading.Lock()
    real = os.preadv

    def preadv(fd, bufs, off, *a):
        d = os.path.dirname(os.readlink(f"/proc/self/fd/{fd}"))
        with lock:
            first = d not in seen
            seen.setdefault(d, []).append(threading.current_thread().name)
        if first and d in drives:
            barrier.wait()
        return real(fd, bufs, off, *a)

    monkeypatch.setattr(os, "preadv", preadv)
    from flatcake.cio import native_restore  # the Python pipeline: its reads go through os.preadv

    monkeypatch.setitem(native_restore.LOOP.state, "fn", None)
    assert store.get(keys, lay, range(30, 46)) == [True] * 16
    monkeypatch.setattr(os, "preadv", real)
    assert not barrier.broken and sorted(seen) == sorted(drives[:2])
    assert seen[drives[0]][0] != seen[drives[1]][0]  # two reader threads, one per drive, at once
    assert all(page_matches(pool, (30 + i) * pool.page_size, k) for i, k in enumerate(keys))
    assert store.snapshot_stats()["merged_reads"] >= 2
    store.close()


def refuse_writes_under(monkeypatch, directory):
    """EIO for every write into a file under ``directory`` (a failing drive)."""
    real_pwritev, real_pwrite = os.pwritev, os.pwrite

    def refuse(real):
        def call(fd, *a):
            if os.readlink(f"/proc/self/fd/{fd}").startswith(directory + os.sep):
                raise OSError(errno.EIO, "Input/output error")
            return real(fd, *a)
        return call

    monkeypatch.setattr(os, "pwritev", refuse(real_pwritev))
    monkeypatch.setattr(os, "pwrite", refuse(real_pwrite))
    return lambda: (monkeypatch.setattr(os, "pwritev", real_pwritev), monkeypatch.setattr(os, "pwrite", real_pwrite))


def test_a_drive_that_refuses_writes_takes_only_its_pages_and_the_other_keeps_serving(drives, monkeypatch):
    store, pool, lay = open_store(drives[:2])
    keys = put_session(store, pool, lay, "s", rounds=4)
    good, bad, bad_d = drives[0], drives[1], 1  # not the first drive: it holds the journal
    assert [drive_dir_of(store, k) for k in keys[::2]] == [good, bad, good, bad]
    restore = refuse_writes_under(monkeypatch, bad)
    results = [put_pages(store, pool, lay, [f"u{i}"], [10 + i]) for i in range(2)]  # new scopes: one per drive
    assert sorted(results) == [[False], [True]]  # the one placed on the bad drive failed, nothing raised
    st = store.snapshot_stats()["media"]["ssd"]
    assert st["state"] == "degraded" and st["files_out_of_service"] == list(store.ssd.drive_files(bad_d))
    assert [d["state"] for d in st["drives"]] == ["disabled" if i == bad_d else "healthy" for i in range(2)]
    assert st["drives"][bad_d]["capacity_bytes"] == 0 and st["capacity_bytes"] == 2 << 20
    lost = [k for k in keys if store.page_info(k) is None]
    assert lost == keys[2:4] + keys[6:8]  # rounds 1 and 3 were on the bad drive
    assert store.leading_run(keys) == 2  # the prefix up to the first lost page
    kept = keys[0:2] + keys[4:6]
    assert served(store, pool, lay, kept) == [True] * 4 and all(drive_dir_of(store, k) == good for k in kept)
    more = put_session(store, pool, lay, "w", rounds=3, first_page=20)  # writes go on, on the good drive
    assert {drive_dir_of(store, k) for k in more} == {good} and served(store, pool, lay, more) == [True] * 6
    # the lost pages are written again by the next backup of the session: the whole prefix hits
    assert put_pages(store, pool, lay, keys, range(0, 8)) == [True] * 8
    assert store.leading_run(keys) == 8 and served(store, pool, lay, keys) == [True] * 8
    restore()
    store.close()


def test_a_drive_whose_directory_is_gone_goes_out_of_service_and_is_not_recreated(drives):
    store, pool, lay = open_store(drives[:2])
    keys = put_session(store, pool, lay, "s", rounds=2)
    d0, d1 = (drive_dir_of(store, k) for k in (keys[0], keys[2]))
    assert (d0, d1) == (drives[0], drives[1])
    shutil.rmtree(d1)
    outcomes = [put_pages(store, pool, lay, [f"u{i}"], [10 + i]) for i in range(3)]
    assert outcomes == [[False], [True], [True]]  # the put placed on d1 found it gone; then d0 only
    assert not os.path.exists(d1)  # never recreated (its mount point may be on another filesystem)
    st = store.snapshot_stats()["media"]["ssd"]
    assert [d["state"] for d in st["drives"]] == ["healthy", "disabled"]
    assert store.page_info(keys[2]) is None and served(store, pool, lay, keys[:2]) == [True, True]
    assert {drive_dir_of(store, k) for k in ("u1", "u2")} == {d0}
    store.close()


def test_warm_restart_finds_the_rounds_on_every_drive(drives):
    store, pool, lay = open_store(drives[:2])
    a = put_session(store, pool, lay, "a", rounds=3)
    b = put_session(store, pool, lay, "b", rounds=2, first_page=10)
    assert {drive_dir_of(store, k) for k in a} == set(drives[:2])
    store.close()
    store, pool, lay = open_store(drives[:2])
    assert store.snapshot_stats()["pages_rebuilt"] == 10
    assert store.leading_run(a) == 6 and store.leading_run(b) == 4
    assert served(store, pool, lay, a + b) == [True] * 10
    more = put_session(store, pool, lay, "a3", rounds=1, first_page=20)  # and it writes on
    assert served(store, pool, lay, more) == [True, True]
    store.close()


def test_a_removed_drive_loses_only_its_pages_at_restart(drives):
    store, pool, lay = open_store(drives[:2])
    keys = put_session(store, pool, lay, "s", rounds=4)
    first = [drive_dir_of(store, k) == drives[0] for k in keys]
    store.close()
    store, pool, lay = open_store(drives[:1])  # drive 1 left out: its files are not found
    got = served(store, pool, lay, keys)
    assert got == first and any(got) and not all(got)  # exactly the pages of drive 0, bit-exact
    store.close()


def test_an_added_drive_keeps_the_files_that_stay_where_they_were(drives):
    store, pool, lay = open_store(drives[:2])
    keys = put_session(store, pool, lay, "s", rounds=4)
    files = {store.page_info(k).file_index for k in keys}
    assert files == {0, 1}  # files 0 and 1 stay on drives 0 and 1 with a third drive
    store.close()
    store, pool, lay = open_store(drives, **{"ssd.max_files": 6})
    assert served(store, pool, lay, keys) == [True] * 8
    store.close()


def test_a_reordered_drive_list_never_serves_wrong_bytes(drives):
    store, pool, lay = open_store(drives[:2])
    keys = put_session(store, pool, lay, "s", rounds=4)
    pre = store.ssd.prefix
    store.close()
    store, pool, lay = open_store([drives[1], drives[0]])  # every file would be on the other drive
    assert served(store, pool, lay, keys) == [False] * 8 and store.snapshot_stats()["pages_rebuilt"] == 0
    # the misplaced files were removed (each drive holds only its own, new, files) and the old
    # journal off the new first drive too
    assert pool_files(drives[1]) == [f"{pre}-00000.pool"] and pool_files(drives[0]) == [f"{pre}-00001.pool"]
    assert not os.path.exists(os.path.join(drives[0], pre + ".journal"))
    again = put_session(store, pool, lay, "s", rounds=2, first_page=10)
    assert served(store, pool, lay, again) == [True] * 4
    store.close()


def test_stale_pools_are_counted_per_drive(drives):
    """The capacity rule holds on each drive against that drive's share (its files)."""
    store, pool, lay = open_store(drives[:2], **{"ssd.max_files": 2})
    put_session(store, pool, lay, "s", rounds=2)
    store.close()
    other, _, _ = open_store([drives[1], drives[0]], mla=True, **{"ssd.max_files": 2})  # another namespace:
    assert other.ssd.prefix != store.ssd.prefix  # the first pool is stale on both drives
    assert sorted(other.ssd.removed_stale_pools) == [store.ssd.prefix] * 2
    assert pool_dir.scan(drives[0]).keys() == pool_dir.scan(drives[1]).keys() == {other.ssd.prefix}
    other.close()


def test_start_up_line_and_metrics_report_each_drive(drives, make_backend, caplog):
    import logging

    import prometheus_client as prom

    from flatcake.metrics import FlatCakeMetrics

    caplog.set_level(logging.INFO, logger="flatcake")
    be, pool = make_backend(extra={"ssd.path": drives[:2], "ssd.file_bytes": 8 << 20, "ssd.max_files": 4})
    line = next(r.getMessage() for r in caplog.records if "per-rank capacity" in r.getMessage())
    assert (f"pool {be.store.ssd.prefix} in 2 drives {drives[0]} (2 files, healthy), {drives[1]} (2 files, healthy), "
            f"journal on {drives[0]}") in line
    assert "SSD 33554432 bytes (32.0 MiB) = 4 x 8388608-byte files" in line
    reg = prom.CollectorRegistry()
    m = FlatCakeMetrics({"pool": "p"}, reg)
    with be.store.scopes.lock:
        be.store.scopes.take_file_out_of_service_locked(1)  # drive 1 fails
    m.update(be.store.snapshot_stats())

    def sample(name, d, **kw):
        return reg.get_sample_value("flatcake_" + name, {"pool": "p", "tp_rank": "", "pp_rank": "", "dp_rank": "",
                                                         "drive": str(d), "path": drives[d], **kw})

    assert [sample("ssd_drive_capacity_bytes", d) for d in range(2)] == [16 << 20, 0]
    assert [sample("ssd_drive_state", d, state="healthy") for d in range(2)] == [1, 0]
    assert [sample("ssd_drive_state", d, state="disabled") for d in range(2)] == [0, 1]
    assert sample("ssd_drive_used_bytes", 0) == 0


def test_a_failed_drive_stays_out_while_it_refuses_and_comes_back_empty_when_it_takes_writes(drives, monkeypatch):
    from flatcake.media import pool_faults

    store, pool, lay = open_store(drives[:2], **{"ssd.max_files": 6})
    keys = put_session(store, pool, lay, "s", rounds=2)
    restore = refuse_writes_under(monkeypatch, drives[1])
    assert [put_pages(store, pool, lay, [f"u{i}"], [10 + i]) for i in range(2)] == [[False], [True]]
    assert store.snapshot_stats()["media"]["ssd"]["files_out_of_service"] == [1, 3, 5]
    monkeypatch.setattr(pool_faults, "OUT_OF_SERVICE_RETRY_S", 0.0)
    assert put_pages(store, pool, lay, ["v0"], [12]) == [True]  # the probe of file 1 still fails:
    st = store.snapshot_stats()["media"]["ssd"]  # files 3 and 5 (never created) stay out with it
    assert st["files_out_of_service"] == [1, 3, 5] and st["drives"][1]["state"] == "disabled"
    restore()
    gen = store.ssd.generation_of(1)
    more = put_session(store, pool, lay, "w", rounds=2, first_page=20)  # drive 1 takes writes again
    st = store.snapshot_stats()["media"]["ssd"]
    assert st["files_out_of_service"] == [] and [d["state"] for d in st["drives"]] == ["healthy", "healthy"]
    assert store.ssd.generation_of(1) == gen + 1  # back empty, under a new generation
    assert {drive_dir_of(store, k) for k in more} == set(drives[:2]) and served(store, pool, lay, more) == [True] * 4
    assert store.page_info(keys[2]) is None and served(store, pool, lay, keys[:2]) == [True, True]
    store.close()


def test_a_live_pool_is_locked_on_every_drive(drives):
    """Another process with the same pool identity but the drives in another order fails on the
    lock before touching any file; another pool on one of the drives sees this one live there."""
    store, pool, lay = open_store(drives[:2], **{"ssd.max_files": 2})
    keys = put_session(store, pool, lay, "s", rounds=2)
    before = [pool_files(d) for d in drives[:2]]
    with pytest.raises(pool_dir.PoolInUse):
        open_store([drives[1], drives[0]], **{"ssd.max_files": 2})
    assert [pool_files(d) for d in drives[:2]] == before  # nothing deleted as misplaced
    other, _, _ = make_store(drives[1], mla=True, **{**BASE, "ssd.max_files": 1})  # drive 1 alone, full
    assert other.ssd.removed_stale_pools == [] and pool_files(drives[1]) == sorted(
        before[1] + [f"{other.ssd.prefix}-00000.pool"])
    assert served(store, pool, lay, keys) == [True] * 4
    other.close()
    store.close()


def test_a_drive_back_with_new_files_is_never_read_through_old_descriptors(drives, monkeypatch):
    """The readers cache a descriptor per pool file. A drive whose directory went away comes back
    empty, and its files are created again as new inodes at the same offsets: reads of the new
    pages must see the new bytes (no checksum to save us), never the old inode's."""
    from flatcake.media import pool_faults

    store, pool, lay = open_store(drives[:2], **{"cio.verify_checksums": False, "ssd.file_bytes": 64 << 10})
    old = put_session(store, pool, lay, "s", rounds=10)  # 16 KiB per round: drive 1 holds files 1 (full) and 3
    assert sorted({store.page_info(k).file_index for k in old}) == [0, 1, 2, 3]
    for _ in range(store.cfg.cio.io_workers):  # one read each: every reader thread caches file 1
        assert store.get(old[2:3], lay, [20]) == [True]
    old_gva = store.page_info(old[2]).gva  # round 1: file 1, offset 0
    shutil.rmtree(drives[1])
    assert put_pages(store, pool, lay, ["u0"], [10]) == [False]  # placed in file 3: finds the drive gone
    os.makedirs(drives[1])  # the drive is back, empty
    monkeypatch.setattr(pool_faults, "OUT_OF_SERVICE_RETRY_S", 0.0)
    new = put_session(store, pool, lay, "w", rounds=2, first_page=40)
    assert store.page_info(new[2]).gva == old_gva  # file 1 again, same offset, a new inode
    assert served(store, pool, lay, new, first_page=50) == [True] * 4  # the new bytes, bit-exact
    assert served(store, pool, lay, old, first_page=0) == [k in old[0::4] or k in old[1::4] for k in old]
    store.close()


def test_with_the_write_queue_rounds_still_alternate_and_a_deferred_fault_takes_only_its_drive(drives, monkeypatch):
    monkeypatch.setitem(native_write.LOOP.state, "fn", None)  # the fault is injected at os.pwritev
    store, pool, lay = open_store(drives[:2], **{"ssd.write_backlog_bytes": 16 << 20, "ssd.write_defer_max_s": 3600.0,
                                                 "ssd.write_urgent_fraction": 1.0})
    restore = refuse_writes_under(monkeypatch, drives[1])
    store.queue.reads_begin()  # a restore in flight: the writer waits, all four rounds are placed first
    keys = put_session(store, pool, lay, "s", rounds=4)  # queued: the put succeeds before the write
    assert [store.medium_of(k) for k in keys] == ["queued"] * 8
    store.queue.reads_end()
    assert store.queue.flush()
    restore()
    st = store.snapshot_stats()
    assert st["media"]["ssd"]["files_out_of_service"] == [1, 3] and st["deferred_write_failures"] == 2
    # rounds 1 and 3 (drive 1) failed after the fact; rounds 0 and 2 (drive 0) were published
    assert [store.page_info(k) is not None for k in keys] == [True, True, False, False] * 2
    assert served(store, pool, lay, keys) == [True, True, False, False] * 2
    assert {drive_dir_of(store, k) for k in keys[0:2] + keys[4:6]} == {drives[0]}
    store.close()


# --------------------------------------------------------------- a drive not mounted at start-up (issue 24 item 5)
def test_a_drive_missing_at_start_up_of_an_existing_pool_is_out_of_service_and_never_created(drives, caplog, monkeypatch):
    from flatcake.media import drives as drives_mod

    store, pool, lay = open_store(drives[:2])
    keys = put_session(store, pool, lay, "s", rounds=4)
    on_d0 = [drive_dir_of(store, k) == drives[0] for k in keys]
    assert on_d0 == [True, True, False, False, True, True, False, False]
    store.close()
    shutil.rmtree(drives[1])  # the drive did not come back after the reboot
    store, pool, lay = open_store(drives[:2])
    assert not os.path.exists(drives[1])  # not recreated on the file system beneath
    assert store.ssd.missing_at_start == [1]
    assert any(f"ssd.path {drives[1]!r} is missing at start-up" in r.getMessage() for r in caplog.records)
    st = store.snapshot_stats()["media"]["ssd"]
    assert [d["state"] for d in st["drives"]] == ["healthy", "disabled"]
    assert served(store, pool, lay, keys) == on_d0  # drive 0's rounds keep serving, bit-exact
    new = put_session(store, pool, lay, "n", rounds=3, first_page=20)
    assert {drive_dir_of(store, k) for k in new} == {drives[0]} and not os.path.exists(drives[1])
    # the drive is mounted again: it takes new files once it is back
    monkeypatch.setattr(drives_mod, "CREATE_RETRY_CHECK_S", 0.0)
    os.makedirs(drives[1])
    more = put_session(store, pool, lay, "m", rounds=4, first_page=30)
    assert drives[1] in {drive_dir_of(store, k) for k in more}
    assert served(store, pool, lay, more) == [True] * 8
    store.close()


def test_the_journal_drive_missing_at_start_up_of_an_existing_pool_fails_naming_it(drives):
    store, pool, lay = open_store(drives[:2])
    put_session(store, pool, lay, "s", rounds=2)
    store.close()
    before = sorted(os.listdir(drives[1]))
    shutil.rmtree(drives[0])
    with pytest.raises(Exception) as ei:
        open_store(drives[:2])
    assert f"ssd.path {drives[0]!r}: missing, and it is the first drive" in str(ei.value)
    assert not os.path.exists(drives[0]) and sorted(os.listdir(drives[1])) == before


def test_a_new_pool_creates_its_missing_drive_directories(drives):
    os.makedirs(drives[0])
    store, pool, lay = open_store(drives[:2])  # nothing of this pool anywhere: a new pool
    assert store.ssd.missing_at_start == [] and os.path.isdir(drives[1]) and len(pool_files(drives[1])) == 1
    store.close()


def test_check_pool_dir_creates_nothing_and_names_a_bad_path(tmp_path):
    from flatcake.media.errors import SsdStartupError

    pool_dir.check_pool_dir(str(tmp_path / "a" / "b"))
    assert not (tmp_path / "a").exists()
    (tmp_path / "f").write_bytes(b"x")
    with pytest.raises(SsdStartupError, match=r"ssd.path '.*/f/fc': cannot be created"):
        pool_dir.check_pool_dir(str(tmp_path / "f" / "fc"))
    with pytest.raises(SsdStartupError, match="not a writable directory"):
        pool_dir.check_pool_dir(str(tmp_path / "f"))


# --------------------------------------------------------------- a drive that fails reads (issue 24 item 4)
def corrupt(store, key):
    """Overwrite the first 64 bytes of ``key``'s layer-0 chunk on disk (its checksum then fails)."""
    from flatcake.gva.address import OFFSET_MASK

    info = store.page_info(key)
    off = (info.gva & OFFSET_MASK) % store.ssd.file_bytes
    fd = os.open(store.ssd.path_of(info.file_index), os.O_WRONLY)
    try:
        os.pwrite(fd, b"\xa5" * 64, off)
        os.fsync(fd)
    finally:
        os.close(fd)


def test_a_failed_read_drops_only_its_round_and_the_rounds_after_it(drives):
    store, pool, lay = open_store(drives[:2])
    s = put_session(store, pool, lay, "s", rounds=4)  # rounds on d0, d1, d0, d1
    t = put_session(store, pool, lay, "t", rounds=4, first_page=10)
    corrupt(store, s[3])  # the second page of round 1 (drive 1)
    assert served(store, pool, lay, s) == [True, True, True, False, False, False, False, False]  # one page at a time
    assert [store.page_info(k) is not None for k in s] == [True, True] + [False] * 6  # round 1 on: misses
    assert served(store, pool, lay, t) == [True] * 8  # the other session, on both drives, keeps serving
    assert store.leading_run(s) == 2 and store.leading_run(t) == 8
    st = store.snapshot_stats()
    assert st["quarantined_pages"] == 6 and st["quarantined_scopes"] == 1
    assert [(d["state"], d["read_failures"]) for d in st["media"]["ssd"]["drives"]] == [("healthy", 0), ("healthy", 1)]
    # the next backup of the lost pages stores them again, and that prefix hits once more
    assert put_pages(store, pool, lay, s[2:4], [2, 3], s[:2]) == [True, True]
    assert store.leading_run(s) == 4 and served(store, pool, lay, s[:4]) == [True] * 4
    store.close()


def test_a_drive_failing_reads_past_the_threshold_goes_out_with_only_its_pages_until_a_probe_succeeds(drives, monkeypatch):
    from flatcake.media import pool_dir as pd
    from flatcake.media import pool_faults

    store, pool, lay = open_store(drives[:2])
    sessions = [put_session(store, pool, lay, f"s{j}", rounds=4, first_page=10 * j) for j in range(4)]
    on_d0 = {k for keys in sessions for k in keys if drive_dir_of(store, k) == drives[0]}
    for j in range(pool_faults.READ_FAILURES_OUT):  # three failed reads of drive 1 within the window
        i = next(i for i, k in enumerate(sessions[j]) if i >= 2 and k not in on_d0)  # a later round on drive 1
        corrupt(store, sessions[j][i])
        assert served(store, pool, lay, sessions[j][:i + 1]) == [True] * i + [False]
    st = store.snapshot_stats()["media"]["ssd"]
    assert [(d["state"], d["read_failures"]) for d in st["drives"]] == [("healthy", 0), ("disabled", 3)]
    last = sessions[3]  # untouched session: its drive-1 pages are gone, its drive-0 pages serve
    assert [store.page_info(k) is not None for k in last] == [k in on_d0 for k in last]
    assert served(store, pool, lay, [k for k in last if k in on_d0]) == [True] * 4
    new = put_session(store, pool, lay, "n", rounds=3, first_page=50)
    assert {drive_dir_of(store, k) for k in new} == {drives[0]}  # new rounds only on the healthy drive
    # the probe fails while the drive still refuses; then it succeeds and the drive serves again
    monkeypatch.setattr(pool_faults, "OUT_OF_SERVICE_RETRY_S", 0.0)
    refuse = {"on": True}
    real = pd.rewrite_first_block

    def probe(path, fb):
        if refuse["on"] and path.startswith(drives[1]):
            raise OSError(errno.EIO, "Input/output error", path)
        return real(path, fb)

    monkeypatch.setattr(pd, "rewrite_first_block", probe)
    put_session(store, pool, lay, "p", rounds=2, first_page=56)  # a put runs the retry
    assert store.snapshot_stats()["media"]["ssd"]["drives"][1]["state"] == "disabled"
    refuse["on"] = False
    more = put_session(store, pool, lay, "q", rounds=4, first_page=0)
    assert store.snapshot_stats()["media"]["ssd"]["drives"][1]["state"] == "healthy"
    assert drives[1] in {drive_dir_of(store, k) for k in more} and served(store, pool, lay, more) == [True] * 8
    store.close()


def test_one_drive_failing_reads_past_the_threshold_takes_its_files_out(ssd_dir):
    from flatcake.media import pool_faults

    store, pool, lay = make_store(ssd_dir, **{"ssd.file_bytes": 1 << 20, "ssd.max_files": 2})
    sessions = [put_session(store, pool, lay, f"s{j}", rounds=2, first_page=10 * j) for j in range(4)]
    for j in range(pool_faults.READ_FAILURES_OUT - 1):
        corrupt(store, sessions[j][2])
        assert served(store, pool, lay, sessions[j][:3]) == [True, True, False]
    assert store.ssd.health() == "healthy" and served(store, pool, lay, sessions[3]) == [True] * 4
    corrupt(store, sessions[2][2])
    assert served(store, pool, lay, sessions[2][:3]) == [True, True, False]
    assert store.ssd.health() == "disabled" and store.page_info(sessions[3][0]) is None  # nothing promised
    store.close()
