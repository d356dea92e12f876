"""What FlatCake owns under ssd.path stays within the configured capacity across restarts
(flatcake.media.pool_dir): stale pools are kept while they fit and removed, oldest first,
when this pool needs the room; a live pool is never touched; files beyond a lowered
ssd.max_files go at start-up."""

import fcntl
import os

from flatcake_testkit import make_store, put_pages

from flatcake.media import pool_dir

KIB = 1 << 10


def pool_bytes(d: str, prefix: str | None = None) -> int:
    """Bytes of pool files (``*.pool``) under ``d`` (of one prefix, or all)."""
    return sum(os.stat(os.path.join(d, n)).st_blocks * 512 for n in os.listdir(d)
               if n.endswith(".pool") and (prefix is None or n.startswith(prefix)))


def fake_pool(d: str, prefix: str, files: int, nbytes: int, mtime: float) -> None:
    for i in range(files):
        p = os.path.join(d, f"{prefix}-{i:05d}.pool")
        with open(p, "wb") as f:
            os.posix_fallocate(f.fileno(), 0, nbytes)
        os.utime(p, (mtime, mtime))
    open(os.path.join(d, prefix + ".journal"), "wb").close()


def test_stale_pools_are_kept_while_they_fit_and_removed_oldest_first(ssd_dir):
    fake_pool(ssd_dir, "fc-00000000000000aa", 1, 128 * KIB, mtime=1000)  # older
    fake_pool(ssd_dir, "fc-00000000000000bb", 1, 128 * KIB, mtime=2000)
    cfg = {"ssd.file_bytes": 256 * KIB, "ssd.max_files": 4}  # capacity 1 MiB
    store, pool, lay = make_store(ssd_dir, **cfg)
    own = lambda: len(pool_dir.scan(ssd_dir)[store.ssd.prefix].pool_indices)  # noqa: E731
    seen = []
    s = 0
    while own() < 4:
        put_pages(store, pool, lay, [f"k{s}-{i}" for i in range(8)], range(8))
        assert pool_bytes(ssd_dir) <= 1024 * KIB  # never above the capacity
        stale = sorted(p for p in pool_dir.scan(ssd_dir) if p != store.ssd.prefix)
        if not seen or seen[-1] != (own(), stale):
            seen.append((own(), stale))
        s += 1
    aa, bb = "fc-00000000000000aa", "fc-00000000000000bb"
    # own files (+ lock and journal) and stale pools: 2 files fit beside both, 3 beside the newer one
    assert seen == [(1, [aa, bb]), (2, [aa, bb]), (3, [bb]), (4, [])]
    assert store.ssd.removed_stale_pools == [aa, bb]  # least recently written first
    store.close()


def test_a_live_pool_is_never_removed(ssd_dir):
    fake_pool(ssd_dir, "fc-00000000000000cc", 2, 256 * KIB, mtime=1000)
    fd = os.open(os.path.join(ssd_dir, "fc-00000000000000cc.lock"), os.O_RDWR | os.O_CREAT)
    fcntl.flock(fd, fcntl.LOCK_EX)  # another FlatCake process is running on it
    try:
        assert pool_dir.is_live(ssd_dir, "fc-00000000000000cc")
        store, pool, lay = make_store(ssd_dir, **{"ssd.file_bytes": 256 * KIB, "ssd.max_files": 2})
        for s in range(30):
            put_pages(store, pool, lay, [f"k{s}-{i}" for i in range(8)], range(8))
        assert pool_bytes(ssd_dir, "fc-00000000000000cc") == 512 * KIB
        assert pool_bytes(ssd_dir, store.ssd.prefix) <= 512 * KIB
        store.close()
    finally:
        os.close(fd)
    assert not pool_dir.is_live(ssd_dir, "fc-00000000000000cc")


def test_files_beyond_a_lowered_max_files_are_removed_at_start_up(ssd_dir):
    cfg = {"ssd.file_bytes": 256 * KIB, "ssd.max_files": 4}
    store, pool, lay = make_store(ssd_dir, **cfg)
    s = 0
    while len(pool_dir.scan(ssd_dir)[store.ssd.prefix].pool_indices) < 4:
        put_pages(store, pool, lay, [f"k{s}-{i}" for i in range(8)], range(8))
        s += 1
    in_files = {f: [k for sc in store.index.scopes.values() for k in sc.keys if store.page_info(k).file_index == f]
                for f in range(4)}
    prefix = store.ssd.prefix
    store.close()
    store, pool, lay = make_store(ssd_dir, **{**cfg, "ssd.max_files": 2})
    assert sorted(pool_dir.scan(ssd_dir)[prefix].pool_indices) == [0, 1]
    assert pool_bytes(ssd_dir) <= 2 * 256 * KIB
    kept = in_files[0] + in_files[1]
    assert kept and all(store.index.contains(k) for k in kept)
    assert not any(store.index.contains(k) for k in in_files[2] + in_files[3])
    store.close()
