"""The ``tiered`` baseline's I/O (issue 23, item 2): a get's SSD pages are read with
``io_depth`` reads in flight at once, the demoter writes a batch of evicted pages with
``io_depth`` writes in flight, and neither changes what is served, counted or stored: the
counters and the bucket files are the same at depth 1 and at depth 32, and every page read back
is the page written. Bad ``replay.tiered_extra`` values are refused, naming the key."""

import os
import threading
import time

import pytest

from flatcake.replay import tiered as tiered_mod
from flatcake.replay.tiered import DEFAULT_IO_DEPTH, TieredSystem, check_extra
from replay_fixtures import TIERED_PAGE_BYTES as PAGE_BYTES, tiered_read, tiered_systems, tiered_write
from replay_fixtures import tiny_profile  # noqa: F401  (pytest fixture)



@pytest.fixture
def tiered(tmp_path, tiny_profile):
    with tiered_systems(tmp_path, tiny_profile, dram_pages=2, ssd_pages=256, bucket_pages=64) as make:
        yield make


write, read = tiered_write, tiered_read


class Gate:
    """Stands in for ``os.preadv``/``os.pwrite``: each call waits at the gate open when it
    arrives (at most 30 s), then does the real I/O. ``inside`` counts the calls waiting or doing
    I/O now, ``most`` the most at once."""

    def __init__(self, real):
        self.real = real
        self.lock = threading.Lock()
        self.inside = self.most = self.calls = 0
        self.gate = threading.Event()

    def __call__(self, *args):
        with self.lock:
            self.inside += 1
            self.calls += 1
            self.most = max(self.most, self.inside)
            gate = self.gate
        try:
            gate.wait(30)
            return self.real(*args)
        finally:
            with self.lock:
                self.inside -= 1

    def wait_inside(self, n, timeout=10.0):
        end = time.monotonic() + timeout
        while time.monotonic() < end:
            with self.lock:
                if self.inside >= n:
                    return self.inside
            time.sleep(0.002)
        return self.inside

    def open_and_close_behind(self):
        """Let the calls waiting now through; later calls wait at a new gate."""
        with self.lock:
            old, self.gate = self.gate, threading.Event()
        old.set()

    def open_for_good(self):
        with self.lock:
            self.gate.set()


@pytest.mark.parametrize("depth", [8, DEFAULT_IO_DEPTH])
def test_a_big_get_has_io_depth_reads_in_flight_at_once(tiered, monkeypatch, depth):
    t, pool = tiered(dram_pages=2, io_depth=depth)
    keys = [f"a{i}" for i in range(depth + 12)]
    write(t, pool, keys)
    assert t.drain()
    on_ssd = keys[:-2]
    assert t.medium_summary(on_ssd).ssd_pages == len(on_ssd)
    gate = Gate(os.preadv)
    monkeypatch.setattr(tiered_mod.os, "preadv", gate)
    out = {}
    reader = threading.Thread(target=lambda: out.update(r=read(t, pool, on_ssd)))
    reader.start()
    assert gate.wait_inside(depth) == depth  # the whole pool is reading at once ...
    time.sleep(0.1)
    assert gate.inside == depth  # ... and no more than the pool
    gate.open_for_good()
    reader.join(30)
    got, ok = out["r"]
    assert got == (len(on_ssd), 0, len(on_ssd)) and all(ok)
    c = t.counters()
    assert c["ssd_read_qd_max"] == depth and gate.most == depth and gate.calls == len(on_ssd)
    assert c["ssd_read_ops"] == len(on_ssd) and c["ssd_read_bytes"] == len(on_ssd) * PAGE_BYTES


def test_the_demoter_writes_a_batch_with_io_depth_writes_in_flight(tiered, monkeypatch):
    depth = 8
    t, pool = tiered(dram_pages=2, io_depth=depth)
    gate = Gate(os.pwrite)
    monkeypatch.setattr(tiered_mod.os, "pwrite", gate)
    keys = [f"w{i}" for i in range(2 + 3 * depth)]
    write(t, pool, keys)  # 3 * depth evicted; the demoter's first batch waits at the gate
    assert 1 <= gate.wait_inside(1) <= depth  # (however much was queued when it started)
    time.sleep(0.1)
    gate.open_and_close_behind()  # the rest is queued now: the next batch is a full one
    assert gate.wait_inside(depth) == depth
    time.sleep(0.1)
    assert gate.inside == depth
    gate.open_for_good()
    assert t.drain()
    c = t.counters()
    assert c["ssd_write_qd_max"] == depth and gate.most == depth
    assert c["ssd_write_ops"] == 3 * depth and c["ssd_write_bytes"] == 3 * depth * PAGE_BYTES
    got, ok = read(t, pool, keys[: 3 * depth])  # every demoted page reads back bit for bit
    assert got == (3 * depth, 0, 3 * depth) and all(ok)


def workload(t, pool):
    """Writes, demotion, reclaim, promotion (with LRU thrash), a revoked read: what a get
    returns at each step, and the final counters (without the in-flight maxima)."""
    results = []
    for s in range(5):  # 5 sessions x 24 pages: 118 demoted into 16-page buckets; FIFO reclaim
        write(t, pool, [f"s{s}-{i}" for i in range(24)], first_page=24 * s)
        assert t.drain()
    for keys in ([f"s4-{i}" for i in range(24)],  # SSD, then the 2 in DRAM; promotions thrash
                 [f"s4-{i}" for i in range(24)],  # again: each promotion evicts a page still needed
                 [f"s3-{i}" for i in range(20)],
                 [f"s0-{i}" for i in range(24)],  # reclaimed: a miss
                 [f"s2-{i}" for i in range(24)]):  # 24 SSD pages > the 23-page staging budget: revoked
        got, ok = read(t, pool, keys)
        assert all(ok[: got[0]])
        results.append(got)
        assert t.drain()
    c = t.counters()
    del c["ssd_read_qd_max"], c["ssd_write_qd_max"]
    files = {p.name: p.read_bytes() for p in sorted(t.root.glob("*.bucket"))}
    return results, c, files


def test_counts_pages_and_bucket_bytes_do_not_depend_on_io_depth(tiered):
    runs = [workload(*tiered(dram_pages=2, ssd_pages=96, bucket_pages=16, staging_bytes=23 * PAGE_BYTES, io_depth=d))
            for d in (1, DEFAULT_IO_DEPTH)]
    (r1, c1, f1), (r32, c32, f32) = runs
    assert r1 == r32 and c1 == c32
    assert f1 == f32 and len(f1) == 6  # the same bucket files, byte for byte (96 pages / 16)
    assert r1[0] == (24, 2, 22)  # s4-22, s4-23 were in DRAM (evicted by the first promotions: still in memory)
    assert r1[1] == (24, 0, 24)  # the second read of s4 thrashes: each promotion evicts a page it still needs
    assert r1[2] == (20, 0, 20) and r1[3] == (0, 0, 0)  # s0's buckets were reclaimed
    assert r1[4] == (0, 0, 0) and c1["staging_revoked_pages"] == 24  # s2 revoked from its first page
    assert c1["ssd_read_bytes"] == c1["ssd_read_ops"] * PAGE_BYTES == c1["logical_read_bytes_ssd"]
    assert c1["hit_pages_ssd"] == c1["ssd_read_ops"] == sum(r[2] for r in r1)


def test_a_bucket_reclaimed_while_read_is_still_delivered_then_closed(tiered, monkeypatch):
    t, pool = tiered(dram_pages=2, ssd_pages=64, bucket_pages=16, io_depth=4)
    old = [f"o{i}" for i in range(18)]
    write(t, pool, old)
    assert t.drain()  # o0..o15 fill bucket 0
    gate = Gate(os.preadv)
    monkeypatch.setattr(tiered_mod.os, "preadv", gate)
    out = {}
    reader = threading.Thread(target=lambda: out.update(r=read(t, pool, old[:8])))
    reader.start()
    assert gate.wait_inside(4) == 4
    write(t, pool, [f"n{i}" for i in range(64)], first_page=32)  # 4 more buckets: bucket 0 reclaimed
    assert t.drain() and t.exists(old[:1], []) == 0
    assert not (t.root / "00000000.bucket").exists()
    gate.open_for_good()
    reader.join(30)
    got, ok = out["r"]
    assert got == (8, 0, 8) and all(ok)  # read from the unlinked file, as Mooncake's read guard allows
    assert not any("00000000.bucket" in f for f in open_files())  # its last reader closed the descriptor


def open_files():
    """Targets of this process's open descriptors (Linux /proc; a deleted file's ends in "(deleted)")."""
    out = []
    for fd in os.listdir("/proc/self/fd"):
        try:
            out.append(os.readlink(f"/proc/self/fd/{fd}"))
        except OSError:
            pass
    return out


def test_close_stops_every_io_thread(tiered):
    t, pool = tiered(io_depth=4)
    write(t, pool, [f"a{i}" for i in range(8)])
    assert t.drain()
    threads = [th for th in threading.enumerate() if th.name.startswith("tiered-")]
    assert len(threads) == 9  # 4 readers, 4 writers, the demoter
    t.close()
    assert not any(th.is_alive() for th in threads)
    assert not any(str(t.root) in f for f in open_files())


@pytest.mark.parametrize("extra,key", [({"io_depth": 0}, "io_depth"), ({"io_depth": 1.5}, "io_depth"),
                                       ({"io_depth": "32"}, "io_depth"), ({"io_depth": True}, "io_depth"),
                                       ({"io_depth": 257}, "io_depth"), ({"bucket_bytes": -1}, "bucket_bytes"),
                                       ({"staging_bytes": float("nan")}, "staging_bytes"),
                                       ({"staging_bytes": 0}, "staging_bytes"), ({"queue_depth": 32}, "unknown")])
def test_bad_tiered_extra_is_refused_naming_the_key(tmp_path, tiny_profile, extra, key):
    with pytest.raises(ValueError, match="replay.tiered_extra") as e:
        check_extra(extra)
    assert key in str(e.value)
    with pytest.raises(ValueError, match=key):
        TieredSystem(tiny_profile, tiny_profile.make_host_pool(8), tmp_path / "t", 1 << 20, 1 << 24, extra)
    assert not (tmp_path / "t").exists()  # refused before anything was made


def test_tiered_extra_defaults_and_whole_floats():
    assert check_extra(None) == {"bucket_bytes": 256 << 20, "staging_bytes": 1 << 30, "io_depth": 32}
    assert check_extra({"io_depth": 4.0, "bucket_bytes": 2.56e8})["io_depth"] == 4


def test_scale_divides_tiered_byte_sizes_but_not_its_io_depth():
    from pathlib import Path

    from flatcake.config import load_config
    from flatcake.replay.cli import REPLAY_DEFAULTS, apply_scale, resolve_model

    root = Path(__file__).resolve().parents[2]
    cfg = load_config(None, {})
    settings = dict(REPLAY_DEFAULTS, tiered_extra={"io_depth": 32, "bucket_bytes": 64 << 20})
    _, out, _ = apply_scale(cfg, settings, resolve_model(cfg, root / "configs"), 4)
    assert out["tiered_extra"]["io_depth"] == 32 and out["tiered_extra"]["bucket_bytes"] == 16 << 20
