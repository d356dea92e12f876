"""The PageStore facade: composition, public seams and lifecycle, without SGLang."""

import os
import subprocess
import sys
from pathlib import Path

import pytest
from flatcake_testkit import make_store, page_matches, put_pages, two_requests_share

from flatcake.config import ConfigError

HERE = Path(__file__).resolve().parent


def open_fds() -> int:
    return len(os.listdir("/proc/self/fd"))


def test_put_get_round_trip_and_page_info(ssd_dir):
    store, pool, lay = make_store(ssd_dir)
    keys = ["p0", "p1", "p2"]
    assert put_pages(store, pool, lay, keys, range(3)) == [True] * 3
    assert store.flush_writes(30)  # on SSD: the write queue drained
    assert store.leading_run(keys + ["absent"]) == 3
    assert store.get(keys + ["absent"], lay, [10, 11, 12, 13]) == [True, True, True, False]
    assert all(page_matches(pool, (10 + i) * pool.page_size, k) for i, k in enumerate(keys))
    info = store.page_info("p1")
    # DRAM is off (full): overflow to SSD; the hit query that ran past the tail started turn 2
    assert (info.medium, info.reuse, info.turn) == ("ssd", "overflow", 2) and info.gva >> 60 == 1
    assert store.medium_of("absent") is None and store.page_info("absent") is None
    assert "page 1536 bytes" in store.describe() and "posix engine" in store.describe()
    st = store.snapshot_stats()
    assert (st["pages_indexed"], st["scopes"], st["hit_pages_ssd"], st["pages_written_ssd"]) == (3, 1, 3, 3)
    store.close()
    assert store.get(keys, lay, [0, 1, 2]) == [False] * 3 and store.leading_run(keys) == 0


def test_medium_summary_counts_pages_and_ssd_bytes_for_the_fc_mas_lanes(ssd_dir):
    store, pool, lay = make_store(ssd_dir, **{"dram.capacity_bytes": 1 << 20})
    two_requests_share(store.leading_run, ["sys0", "sys1"])  # a shared prompt: DRAM
    put_pages(store, pool, lay, ["sys0", "sys1"], [0, 1])
    put_pages(store, pool, lay, ["a0", "a1", "a2"], [2, 3, 4])  # overflow of nothing shared: SSD
    assert store.flush_writes(30)  # on SSD: the write queue drained
    assert [store.medium_of(k) for k in ("sys0", "a0")] == ["dram", "ssd"]
    m = store.medium_summary(["sys0", "sys1", "a0", "a1", "a2", "absent"])
    assert (m.dram_pages, m.ssd_pages, m.ssd_bytes, m.needs_ssd) == (2, 3, 3 * 1536, True)
    assert m.media == ("dram", "dram", "ssd", "ssd", "ssd", None)
    assert store.medium_summary(["sys0"]).needs_ssd is False
    store.close()


@pytest.mark.parametrize("bad", [{"cio.staging_bytes": 4096}, {"ssd.file_bytes": 4096}])
def test_failed_startup_releases_every_file_and_the_pool_lock(ssd_dir, bad):
    fds = open_fds()
    with pytest.raises((ValueError, ConfigError)):
        make_store(ssd_dir, **bad)
    assert open_fds() == fds  # nothing leaked ...
    store, pool, lay = make_store(ssd_dir)  # ... and the same pool opens again in this process
    assert put_pages(store, pool, lay, ["ok"], [0]) == [True]
    store.close()
    assert open_fds() == fds


def test_the_core_runs_without_sglang(tmp_path):
    code = (
        "import sys; sys.modules['sglang'] = None\n"  # any sglang import now fails
        f"sys.path.insert(0, {str(HERE)!r})\n"
        "from flatcake_testkit import make_store, page_matches, put_pages\n"
        f"store, pool, lay = make_store({str(tmp_path)!r})\n"
        "assert put_pages(store, pool, lay, ['a', 'b'], [0, 1]) == [True, True]\n"
        "assert store.get(['a', 'b'], lay, [5, 6]) == [True, True]\n"
        "assert page_matches(pool, 5 * pool.page_size, 'a') and page_matches(pool, 6 * pool.page_size, 'b')\n"
        "import flatcake.mas, flatcake.cio, flatcake.gva.mirror\n"
        "store.close(); print('OK')\n"
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0 and proc.stdout.strip().endswith("OK"), proc.stderr[-2000:]


def test_unusable_arguments_are_misses_and_never_leak_the_close_gate(ssd_dir):
    store, pool, lay = make_store(ssd_dir)
    assert store.put(None, lay, []) == [] and store.get(None, lay, []) == []
    assert store.leading_run([["unhashable"]]) == 0 and store.exists(["x"]) is False
    assert store.page_info({}) is None
    assert store.put(["ok"], lay, [0]) == [True]
    t = __import__("time").perf_counter()
    store.close(timeout_s=5)
    assert __import__("time").perf_counter() - t < 2  # nothing was left inside the gate
    store.clear()  # after close: a no-op, no error
    again, _, _ = make_store(ssd_dir)  # the pool lock was released
    again.close()
