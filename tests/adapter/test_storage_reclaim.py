"""Whole-scope reclaim through the backend: readers never see a scope freed under them; a full
pool of pinned scopes fails the put; a hit query is one dict probe per key."""

import os

import pytest
import flatcake_testkit as testkit
from flatcake_testkit import page_matches, slots_of


def write_pages(be, pool, keys, pages, prefix=()):
    """``testkit.write_pages``, then wait for the SSD write queue (``PageStore.flush_writes``): these
    tests inspect or damage the pool files, or count SSD pages, right after a write."""
    out = testkit.write_pages(be, pool, keys, pages, prefix)
    assert be.store.flush_writes(30)
    return out


PS = 4


def put(be, pool, keys, first_page, prefix=()):
    return write_pages(be, pool, keys, range(first_page, first_page + len(keys)), prefix)


@pytest.fixture
def small_ssd(make_backend, allow_small_files):
    # 1 file of 128 KiB; a one-round scope of 1-3 pages (1.5 KiB each) takes 16-20 KiB
    # (extent header, round header, data, record: 4 KiB blocks), so 6-8 scopes fit
    return make_backend(pages=64, extra={"ssd.file_bytes": 128 << 10, "ssd.max_files": 1, "ssd.high_watermark": 0.7, "ssd.low_watermark": 0.5})


def test_reclaim_frees_oldest_whole_scopes(small_ssd):
    be, pool = small_ssd
    sessions = [[f"s{s}p{i}" for i in range(3)] for s in range(6)]
    for s, keys in enumerate(sessions):
        assert put(be, pool, keys, (s * 3) % 60) == [True] * 3
    st = be.flatcake_stats()
    assert st["reclaimed_scopes_ssd"] >= 2
    # whole scopes: every session is either fully present or fully gone, and the newest stays
    counts = [be.batch_exists(k) for k in sessions]
    assert set(counts) <= {0, 3}
    assert counts[-1] == 3 and counts[0] == 0
    assert be.store.ssd.used_fraction() <= 0.7


def test_reader_holding_scope_blocks_reclaim(small_ssd):
    be, pool = small_ssd
    first = ["h0", "h1"]
    put(be, pool, first, 0)
    scope = be.store.index.get("h0").scope
    assert scope.try_acquire()  # a reader is inside batch_get_v1 for this scope
    for s in range(8):
        put(be, pool, [f"x{s}a", f"x{s}b"], 2 + 2 * s)
    assert not scope.retired
    assert be.batch_exists(first) == 2
    pool.kv_buffer.zero_()
    assert be.batch_get_v1(first, slots_of(pool, [40, 41])) == [True, True]
    assert page_matches(pool, 40 * PS, "h0") and page_matches(pool, 41 * PS, "h1")
    scope.release()  # the reader leaves (and h is now the most recently used scope)
    for s in range(8, 20):
        put(be, pool, [f"x{s}a", f"x{s}b"], 2 + 2 * (s % 8))
    assert scope.retired and be.batch_exists(first) == 0


def test_pool_full_of_pinned_scopes_fails_the_put_and_keeps_old_pages(make_backend, allow_small_files):
    be, pool = make_backend(pages=64, extra={"ssd.file_bytes": 128 << 10, "ssd.max_files": 1,
                                             "ssd.high_watermark": 1.0, "ssd.low_watermark": 0.9})
    pinned = []
    for s in range(8):  # 8 x 16 KiB fill the file
        assert put(be, pool, [f"p{s}"], s) == [True]
        sc = be.store.index.get(f"p{s}").scope
        sc.try_acquire()
        pinned.append(sc)
    assert be.store.ssd.used_bytes == 128 << 10
    assert put(be, pool, ["late"], 10) == [False]
    assert all(be.batch_exists([f"p{s}"]) == 1 for s in range(8))
    for sc in pinned:
        sc.release()
    assert put(be, pool, ["late"], 10) == [True]


def test_million_keys_hit_query_is_o1_and_lists_no_directory(make_backend, monkeypatch):
    be, pool = make_backend()
    put(be, pool, ["real0", "real1"], 0)
    idx = be.store.index
    e = idx.get("real0")
    many = [f"{i:064x}" for i in range(1_000_000)]
    with idx.lock:  # a million published entries (same page bytes; we test the lookup path)
        idx.publish_locked(many, [e] * len(many))
    assert len(idx) == 1_000_002

    def no_listing(*a, **k):
        raise AssertionError("hit query touched the filesystem")

    for name in ("listdir", "scandir", "stat", "open"):
        monkeypatch.setattr(os, name, no_listing)
    keys = many[::1000]
    assert be.batch_exists(keys) == 1000
    assert be.batch_exists(keys + ["absent"] + keys) == 1000

    # per-key work is one dict probe whatever the index size: count probes
    probes = []
    real_get = idx.get
    monkeypatch.setattr(idx, "get", lambda k: probes.append(k) or real_get(k))
    be.batch_exists(keys)
    assert len(probes) == len(keys)
