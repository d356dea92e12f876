"""The ``tiered`` baseline (flatcake.replay.tiered): writes enter DRAM, LRU eviction demotes to
SSD buckets in eviction order, buckets are reclaimed FIFO, SSD hits are staged within a budget
(revoked beyond it) and promoted back into DRAM. Every page read back is the page written."""

import os

import pytest

from replay_fixtures import TIERED_PAGE_BYTES as PAGE_BYTES, tiered_read, tiered_systems, tiered_write
from replay_fixtures import tiny_profile  # noqa: F401  (pytest fixture)



@pytest.fixture
def tiered(tmp_path, tiny_profile):
    with tiered_systems(tmp_path, tiny_profile, dram_pages=4, ssd_pages=64, bucket_pages=8) as make:
        yield make


write, read = tiered_write, tiered_read


def test_evicted_pages_are_demoted_in_eviction_order_and_read_back_bit_exact(tiered):
    t, pool = tiered(dram_pages=6)
    keys = [f"a{i}" for i in range(10)]
    write(t, pool, keys)
    assert t.drain()
    media = t.medium_summary(keys).media
    assert media == ("ssd",) * 4 + ("dram",) * 6  # the 4 least recently written went to SSD
    c = t.counters()
    assert c["ssd_write_ops"] == 4 and c["ssd_write_bytes"] == 4 * PAGE_BYTES
    assert t.exists(keys, []) == 10
    got, ok = read(t, pool, keys[4:] + keys[:4])  # DRAM pages first: promotions evict behind them
    assert got == (10, 6, 4) and all(ok)
    assert t.counters()["ssd_read_ops"] == 4 and t.counters()["hit_pages_ssd"] == 4
    assert t.drain() and t.medium_summary(keys[:4]).media == ("dram",) * 4  # promoted


def test_promotions_into_a_small_dram_thrash_it(tiered):
    """Read in prefix order, each promotion evicts a page the same read still needs: LRU
    thrash, every page served from SSD (what eviction-order placement does to one session)."""
    t, pool = tiered(dram_pages=4)
    keys = [f"a{i}" for i in range(10)]
    write(t, pool, keys)
    assert t.drain()
    got, ok = read(t, pool, keys)
    assert got[0] == 10 and got[2] >= 6 and all(ok)


def test_an_ssd_hit_is_promoted_back_into_dram(tiered):
    t, pool = tiered(dram_pages=4)
    write(t, pool, [f"a{i}" for i in range(8)])
    assert t.drain()
    assert t.medium_summary(["a0"]).media == ("ssd",)
    got, ok = read(t, pool, ["a0"])
    assert got == (1, 0, 1) and ok == [True]
    assert t.medium_summary(["a0"]).media == ("dram",)  # promoted; the disk replica stays
    got, ok = read(t, pool, ["a0"])
    assert got == (1, 1, 0) and ok == [True]


def test_buckets_are_reclaimed_fifo_across_sessions(tiered):
    t, pool = tiered(dram_pages=2, ssd_pages=32)  # 4 buckets of 8 pages
    for s in range(6):  # 6 sessions x 8 pages: 46 demoted, more than the 32 the SSD holds
        write(t, pool, [f"s{s}-{i}" for i in range(8)], first_page=8 * s)
        assert t.drain()
    assert t.exists([f"s0-{i}" for i in range(8)], []) == 0  # the oldest bucket went whole
    assert t.exists([f"s5-{i}" for i in range(8)], []) == 8
    on_ssd = sum(t.medium_summary([f"s{s}-{i}" for i in range(8)]).ssd_pages for s in range(6))
    assert on_ssd <= 32 and len(list(t.root.glob("*.bucket"))) <= 4
    got, ok = read(t, pool, [f"s4-{i}" for i in range(8)])
    assert got[0] == 8 and all(ok)


def test_a_read_beyond_the_staging_budget_is_revoked_from_its_first_ssd_page(tiered):
    t, pool = tiered(dram_pages=4, staging_bytes=3 * PAGE_BYTES)
    keys = [f"a{i}" for i in range(8)]
    write(t, pool, keys)
    assert t.drain()  # a0..a3 on SSD, a4..a7 in DRAM
    got, _ = read(t, pool, keys[4:] + keys[:4])  # DRAM pages first, then 4 SSD pages > 3 staged
    assert got == (4, 4, 0)
    assert t.counters()["staging_revoked_pages"] == 4 and t.counters()["ssd_read_ops"] == 0
    got, ok = read(t, pool, keys[:3])  # 3 SSD pages fit the budget
    assert got == (3, 0, 3) and all(ok)


def bucket_fds(root):
    """Targets of this process's open descriptors on ``root``'s bucket files (Linux /proc)."""
    out = []
    for fd in os.listdir("/proc/self/fd"):
        try:
            target = os.readlink(f"/proc/self/fd/{fd}")
        except OSError:
            continue
        if target.startswith(str(root)):
            out.append(target)
    return sorted(out)


def test_bucket_files_stay_open_only_while_filled_or_read_and_close_with_their_bucket(tiered):
    t, pool = tiered(dram_pages=2, ssd_pages=32)  # 4 buckets of 8 pages
    for s in range(6):  # 46 pages demoted: 5 full buckets, the 6th holds 6
        write(t, pool, [f"s{s}-{i}" for i in range(8)], first_page=8 * s)
        assert t.drain()
    assert bucket_fds(t.root) == [str(t.root / "00000005.bucket")]  # the bucket being filled
    s4 = [f"s4-{i}" for i in range(8)]  # pages 32..39 of the demotion order: bucket 4
    got, ok = read(t, pool, s4)
    assert got == (8, 0, 8) and all(ok) and t.drain()  # promotions demote s5-6, s5-7: bucket 5 is full
    assert bucket_fds(t.root) == [str(t.root / "00000004.bucket")]  # one read descriptor, kept
    got, ok = read(t, pool, s4)  # again from SSD (each promotion evicts the next page), same descriptor
    assert got == (8, 0, 8) and all(ok) and t.counters()["ssd_read_ops"] == 16
    assert bucket_fds(t.root) == [str(t.root / "00000004.bucket")]
    for s in range(6, 9):  # 3 more buckets: 2, 3 and 4 are reclaimed
        write(t, pool, [f"s{s}-{i}" for i in range(8)], first_page=8 * (s - 6))
        assert t.drain()
    assert t.exists(s4, []) == 0 and str(t.root / "00000004.bucket") not in bucket_fds(t.root)
    assert all("(deleted)" not in f for f in bucket_fds(t.root)) and len(bucket_fds(t.root)) <= 1
    t.close()
    assert bucket_fds(t.root) == []
