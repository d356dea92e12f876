"""Several live pools in one ssd.path (flatcake.media.pool_dir): the capacity bound is per pool
(per process), a live pool is never removed or counted, stale pools are removed under their own
lock, and the lock file carries the writer's server tag for MLA followers."""

from __future__ import annotations

import fcntl
import os

import pytest
from flatcake_testkit import make_pool, put_pages

from flatcake.config import load_config
from flatcake.common.layout import KvPageLayout
from flatcake.media import pool_dir
from flatcake.store.page_store import PageStore

KIB = 1 << 10


def open_store(ssd_dir: str, instance: str):
    cfg = load_config(None, {"ssd.path": ssd_dir, "ssd.file_bytes": 256 * KIB, "ssd.max_files": 2,
                             "dram.capacity_bytes": 0})
    pool = make_pool()
    lay = KvPageLayout.from_host_pool(pool)
    return PageStore(cfg, lay.geometry, "test|ns", instance=instance), pool, lay


def fake_pool(d: str, prefix: str, nbytes: int, mtime: float) -> None:
    p = os.path.join(d, f"{prefix}-00000.pool")
    with open(p, "wb") as f:
        os.posix_fallocate(f.fileno(), 0, nbytes)
    os.utime(p, (mtime, mtime))
    open(os.path.join(d, prefix + ".lock"), "wb").close()


def pool_file_bytes(d: str, prefix: str) -> int:
    return sum(os.stat(os.path.join(d, n)).st_blocks * 512 for n in os.listdir(d)
               if n.startswith(prefix) and n.endswith(".pool"))


def test_the_pool_prefix_is_the_one_the_ssd_pool_uses(ssd_dir):
    store, _, _ = open_store(ssd_dir, "dp0-s3")
    try:
        assert store.ssd.prefix == pool_dir.pool_prefix("test|ns", "dp0-s3")
        assert store.ssd.prefix != pool_dir.pool_prefix("test|ns", "dp0")
    finally:
        store.close()


def test_two_live_pools_fill_their_own_capacity_and_only_the_stale_one_goes(ssd_dir):
    stale = "fc-00000000000000ee"
    fake_pool(ssd_dir, stale, 256 * KIB, mtime=1000)
    a, apool, alay = open_store(ssd_dir, "dp0")
    b, bpool, blay = open_store(ssd_dir, "dp0-s1")
    try:
        for s in range(30):  # both fill their 2 x 256 KiB and reclaim
            put_pages(a, apool, alay, [f"a{s}-{i}" for i in range(8)], range(8))
            put_pages(b, bpool, blay, [f"b{s}-{i}" for i in range(8)], range(8))
        assert pool_file_bytes(ssd_dir, a.ssd.prefix) == 512 * KIB
        assert pool_file_bytes(ssd_dir, b.ssd.prefix) == 512 * KIB  # per process: 2 x the capacity in the dir
        assert stale not in pool_dir.scan(ssd_dir)
        assert a.ssd.removed_stale_pools + b.ssd.removed_stale_pools == [stale]
        assert b.ssd.prefix not in a.ssd.removed_stale_pools and a.ssd.prefix not in b.ssd.removed_stale_pools
    finally:
        a.close()
        b.close()


def test_a_pool_whose_lock_is_taken_after_the_scan_is_not_removed(ssd_dir):
    prefix = "fc-00000000000000ef"
    fake_pool(ssd_dir, prefix, 128 * KIB, mtime=1000)
    pool = pool_dir.scan(ssd_dir)[prefix]  # seen stale ...
    fd = pool_dir.take_writer_lock(ssd_dir, prefix)  # ... then its process starts
    try:
        assert pool_dir.remove_if_stale(ssd_dir, pool) is None
        assert sorted(os.listdir(ssd_dir)) == [f"{prefix}-00000.pool", f"{prefix}.lock"]
        assert pool_dir.make_room(ssd_dir, "fc-0000000000000001", 0, 0) == []  # live: neither removed nor counted
    finally:
        os.close(fd)
    on_disk = sum(os.stat(p).st_blocks * 512 for p in pool.paths)  # the pool file and the lock (with a pid)
    assert on_disk >= 128 * KIB
    assert pool_dir.remove_if_stale(ssd_dir, pool) == on_disk
    assert os.listdir(ssd_dir) == []


def test_the_lock_file_carries_the_pid_and_the_writers_server_tag(ssd_dir):
    prefix = "fc-00000000000000f0"
    fd = pool_dir.take_writer_lock(ssd_dir, prefix)
    try:
        assert pool_dir.read_lock_tag(ssd_dir, prefix) is None  # pid only
        pool_dir.write_lock_tag(ssd_dir, prefix, "host=h/ppid=7")
        with open(os.path.join(ssd_dir, prefix + ".lock")) as f:
            assert f.read() == f"{os.getpid()} host=h/ppid=7"
        assert pool_dir.read_lock_tag(ssd_dir, prefix) == "host=h/ppid=7"
        with pytest.raises(pool_dir.PoolInUse, match=f"pid {os.getpid()}"):
            pool_dir.take_writer_lock(ssd_dir, prefix, attempts=1)
    finally:
        os.close(fd)
    assert pool_dir.read_lock_tag(ssd_dir, "fc-00000000000000f1") is None  # no lock file


def test_a_lock_file_replaced_while_waiting_is_taken_afresh(ssd_dir, monkeypatch):
    prefix = "fc-00000000000000f2"
    path = os.path.join(ssd_dir, prefix + ".lock")
    real_flock = fcntl.flock
    calls = []

    def flock(fd, op):  # between open and flock, a stale-pool sweep deletes the lock file
        if not calls:
            os.unlink(path)
            open(path, "wb").close()
        calls.append(op)
        return real_flock(fd, op)

    monkeypatch.setattr(pool_dir.fcntl, "flock", flock)
    fd = pool_dir.take_writer_lock(ssd_dir, prefix)
    try:
        assert len(calls) == 2  # the first lock was on an unlinked inode: dropped, retaken
        assert os.fstat(fd).st_ino == os.stat(path).st_ino
        assert pool_dir.is_live(ssd_dir, prefix)
    finally:
        os.close(fd)
