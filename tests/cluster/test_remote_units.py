"""Data-plane pieces that need no namespace: the owner's piece planner, checksums and their check,
the data-plane descriptor, a remote page's chunk ranges, the DRAM region's address accessors."""

from __future__ import annotations

import numpy as np
import pytest

from flatcake.cluster.records import RemotePage
from flatcake.cluster.remote_dram import chunk_ranges
from flatcake.cluster.remote_ssd import plan_pieces
from flatcake.cluster.transfer import DataPlaneDescriptor, descriptor_key, page_checksums, verify_landed
from flatcake.config import DramConfig
from flatcake.gva.address import MEDIUM_DRAM, MEDIUM_SSD, encode_gva
from flatcake.media.dram import DramRegion

FILE = 1 << 20


def _apply(pieces, disk: bytes, slot_bytes: int) -> dict:
    """Replay a plan against an in-memory 'disk' (files back to back): range j -> its bytes."""
    out = {}
    for p in pieces:
        slot = bytearray(slot_bytes)
        for fi, fo, n, so in p.runs:
            assert fo % 4096 == n % 4096 == so % 4096 == 0
            slot[so: so + n] = disk[fi * FILE + fo: fi * FILE + fo + n]
        assert p.used <= slot_bytes
        for j, so in p.chunks:
            out[j] = (so, bytes(slot))
    return out


def test_plan_sorts_merges_aligns_and_packs_ranges_so_each_lands_whole():
    rng = np.random.default_rng(3)
    disk = rng.integers(0, 256, 2 * FILE, dtype=np.uint8).tobytes()
    # unordered, unaligned, overlapping, on two files
    ranges = [(FILE + 8192, 3000), (100, 5000), (5100, 4096), (0, 100), (FILE + 3 * 4096, 4096), (50000, 20000)]
    pieces = plan_pieces(ranges, FILE, 32768)
    got = _apply(pieces, disk, 32768)
    assert sorted(got) == list(range(len(ranges)))
    for j, (off, n) in enumerate(ranges):
        so, slot = got[j]
        assert slot[so: so + n] == disk[off: off + n]
    # (0,100) (100,5000) (5100,4096) share one aligned run [0, 12288); 50000+20000 -> [49152, 73728)
    # does not fit beside it in 32 KiB and opens piece 2, where file 1's two adjacent ranges
    # (one run [8192, 16384)) fill it to exactly 32 KiB
    assert [[(fi, fo, n) for fi, fo, n, _ in p.runs] for p in pieces] == \
        [[(0, 0, 12288)], [(0, 49152, 24576), (1, 8192, 8192)]]


def test_plan_refuses_a_range_over_a_file_end_or_larger_than_a_slot():
    with pytest.raises(ValueError, match="crosses the end"):
        plan_pieces([(FILE - 10, 20)], FILE, 65536)
    with pytest.raises(ValueError, match="more than one"):
        plan_pieces([(0, 65537)], FILE, 65536)
    assert plan_pieces([], FILE, 65536) == []
    # a range in the second file: its run is in file 1, at its 4 KiB-aligned in-file offset
    (piece,) = plan_pieces([(FILE + 5000, 100)], FILE, 65536)
    assert piece.runs == [(1, 4096, 4096, 0)] and piece.chunks == [(0, 904)] and piece.used == 4096


def test_checksums_of_page_major_pages_and_their_check():
    rng = np.random.default_rng(5)
    pages = rng.integers(0, 256, (3, 4 * 512), dtype=np.uint8)
    sums = page_checksums(pages, 4, 512)
    assert sums.shape == (3, 4) and sums.dtype == np.uint64
    landed = pages.reshape(-1).copy()
    landed[512 * 4 + 7] ^= 1  # one byte of page 1, layer 0
    ok = verify_landed(landed, [sums[0], sums[1], None], 4, 512)
    assert ok.tolist() == [True, False, False]  # page 2: no checksum -> never served


def test_descriptor_round_trip_and_key():
    d = DataPlaneDescriptor(7, "10.78.0.10:15000", 140000000000, 1 << 30, "tcp://10.78.0.10:5601")
    assert DataPlaneDescriptor.decode(d.encode()) == d
    assert descriptor_key("/flatcake", 7) == "/flatcake/dataplane/0007"
    with pytest.raises(ValueError):
        DataPlaneDescriptor.decode(b"{}")


def test_chunk_ranges_of_a_dram_page_and_a_layer_major_ssd_page():
    dram = RemotePage(1, encode_gva(MEDIUM_DRAM, 1, 3 * 2048), 0, 512, None, "k")
    assert chunk_ranges(dram, 4, 512) == [(6144, 2048)]
    ssd = RemotePage(1, encode_gva(MEDIUM_SSD, 1, 8192 + 512), 0, 10 * 512, None, "k")
    assert chunk_ranges(ssd, 3, 512) == [(8704, 512), (8704 + 5120, 512), (8704 + 10240, 512)]


def test_dram_region_exposes_its_address_and_size():
    r = DramRegion(DramConfig(capacity_bytes=10 * 4096, pin="off"), 4096)
    assert r.region_address() == r.slots.data_ptr()
    assert r.region_bytes() == 10 * 4096


class _FakeSession:
    """get/put of an in-memory key space (what PeerDirectory and DescriptorKeeper use)."""

    def __init__(self):
        self.kv, self.gets, self.puts = {}, 0, []

    def get(self, key):
        self.gets += 1
        return self.kv.get(key)

    def put(self, key, value, lease=0):
        self.puts.append((key, lease))
        self.kv[key] = value
        return len(self.puts)


def test_peer_directory_caches_forgets_after_a_failure_and_backs_off_an_absent_node():
    from flatcake.cluster.peers import PeerDirectory

    s, now = _FakeSession(), [100.0]
    d = DataPlaneDescriptor(3, "10.78.0.12:15000", 4096, 1 << 20, "tcp://10.78.0.12:5601")
    peers = PeerDirectory(s, "/fc", retry_s=1.0, clock=lambda: now[0])
    assert peers.get(3) is None and s.gets == 1  # absent
    s.kv[descriptor_key("/fc", 3)] = d.encode()
    assert peers.get(3) is None and s.gets == 1  # not asked again within retry_s
    now[0] += 1.5
    assert peers.get(3) == d and peers.get(3) == d and s.gets == 2  # found, then cached
    moved = DataPlaneDescriptor(3, "10.78.0.12:16000", 8192, 1 << 20, "tcp://10.78.0.12:5601")
    s.kv[descriptor_key("/fc", 3)] = moved.encode()  # the owner restarted elsewhere
    peers.invalidate(3)
    assert peers.get(3) == moved and s.gets == 3


def test_descriptor_keeper_publishes_again_on_a_new_lease():
    from flatcake.cluster.peers import DescriptorKeeper

    s, lease = _FakeSession(), [7]
    d = DataPlaneDescriptor(2, "10.78.0.11:15000", 4096, 1 << 20, "")
    k = DescriptorKeeper(s, "/fc", d, lambda: lease[0], interval_s=3600).start()
    try:
        k.check()  # same lease, key present: nothing
        lease[0] = 9  # the node lost its lease and took a new one
        k.check()
        del s.kv[descriptor_key("/fc", 2)]  # gone (e.g. etcd restored without it)
        k.check()
    finally:
        k.close()
    assert s.puts == [("/fc/dataplane/0002", 7), ("/fc/dataplane/0002", 9), ("/fc/dataplane/0002", 9)]
    assert DataPlaneDescriptor.decode(s.kv["/fc/dataplane/0002"]) == d


def test_remote_reader_routes_by_node_and_medium_and_merges_the_results():
    from flatcake.cluster.peers import PeerDirectory
    from flatcake.cluster.remote import RemoteReader
    from flatcake.cluster.transfer import RemoteReadResult

    class Fake:
        def __init__(self, fill, fail=False):
            self.fill, self.fail, self.calls = fill, fail, []

        def read(self, desc, pages, layers, chunk_bytes, out=None):
            self.calls.append((desc.node if desc else None, [p.gva for p in pages]))
            res = RemoteReadResult.empty(len(pages), layers * chunk_bytes, out)
            if self.fail:
                res.misses["failed"] = len(pages)
            else:
                res.data[:] = self.fill
                res.hit[:] = True
            return res

    s = _FakeSession()
    for n in (1, 2):
        s.kv[descriptor_key("/fc", n)] = DataPlaneDescriptor(n, f"h{n}:1").encode()
    dram, ssd = Fake(0xD), Fake(0x5, fail=True)
    peers = PeerDirectory(s, "/fc")
    r = RemoteReader(peers, dram, ssd)
    pg = [RemotePage(1, encode_gva(MEDIUM_DRAM, 1, 0), 0, 8, None, "k"), None,
          RemotePage(2, encode_gva(MEDIUM_SSD, 2, 4096), 0, 8, None, "k"),
          RemotePage(1, encode_gva(MEDIUM_DRAM, 1, 16), 0, 8, None, "k")]
    res = r.read(pg, 2, 8)
    assert res.hit.tolist() == [True, False, False, True]
    assert res.data[0].tolist() == [0xD] * 16 and res.data[3].tolist() == [0xD] * 16
    assert res.misses["not_in_view"] == 1 and res.misses["failed"] == 1
    assert dram.calls == [(1, [pg[0].gva, pg[3].gva])] and ssd.calls == [(2, [pg[2].gva])]
    gets = s.gets
    again = r.read(pg, 2, 8)  # node 2's transfer failed: suspended, no transfer, no lookup
    assert again.hit.tolist() == [True, False, False, True] and again.misses["suspended"] == 1
    assert ssd.calls == [(2, [pg[2].gva])] and s.gets == gets


def test_a_failed_owner_is_suspended_with_a_doubling_back_off_reset_by_a_success():
    from flatcake.cluster.peers import SUSPEND_MAX_S, SUSPEND_MIN_S, PeerDirectory

    s, now = _FakeSession(), [0.0]
    s.kv[descriptor_key("/fc", 4)] = DataPlaneDescriptor(4, "h4:1").encode()
    peers = PeerDirectory(s, "/fc", clock=lambda: now[0])
    assert peers.get(4) is not None and not peers.suspended(4)
    backoffs = []
    for _ in range(7):
        peers.suspend(4)
        start = now[0]
        while peers.suspended(4):
            now[0] += 0.5
        backoffs.append(now[0] - start)
    assert backoffs == [SUSPEND_MIN_S * 2 ** i if SUSPEND_MIN_S * 2 ** i < SUSPEND_MAX_S else SUSPEND_MAX_S
                        for i in range(7)]
    peers.succeeded(4)
    peers.suspend(4)
    assert peers.suspended(4)
    now[0] += SUSPEND_MIN_S
    assert not peers.suspended(4) and peers.get(4) is not None


def test_data_plane_settings_are_validated_naming_the_field():
    from flatcake.cluster.dataplane import split_advertise
    from flatcake.config import ConfigError, load_config

    cfg = load_config(None, {"cluster.advertise": "10.78.0.10:5601"}).cluster
    assert (cfg.staging_slots, cfg.staging_slot_bytes, cfg.landing_bytes, cfg.remote_timeout_s) == (3, 16 << 20, 64 << 20, 2.0)
    assert split_advertise(cfg.advertise) == ("10.78.0.10", 5601)
    assert split_advertise("[fd00::1]:7000") == ("fd00::1", 7000)
    with pytest.raises(ConfigError, match=r"cluster\.advertise"):
        split_advertise(None)
    for over, field in (({"cluster.staging_slots": 1}, "cluster.staging_slots"),
                        ({"cluster.staging_slot_bytes": 4097}, "cluster.staging_slot_bytes"),
                        ({"cluster.landing_bytes": 4096}, "cluster.landing_bytes"),
                        ({"cluster.remote_timeout_s": 0}, "cluster.remote_timeout_s")):
        with pytest.raises(ConfigError, match=field.replace(".", r"\.")):
            load_config(None, over)


def test_landing_pool_quarantines_failed_buffers_and_bounds_their_number(monkeypatch):
    import flatcake.cluster.transfer as tr

    class Ep:
        def __init__(self):
            self.registered = []

        def register(self, addr, nbytes):
            self.registered.append((addr, nbytes))

    ep, now = Ep(), [0.0]
    pool = tr.LandingPool(ep, 8192, quarantine_s=60.0, max_quarantined=2, clock=lambda: now[0])
    first = pool.get()
    assert first is not None and ep.registered == [(first.addr, 8192)]
    pool.retire()  # a transfer into `first` failed: never reused while quarantined
    second = pool.get()
    assert second is not None and second is not first and pool.quarantined() == 1
    pool.retire()  # two quarantined: no new buffer, reads are misses
    assert pool.get() is None and pool.quarantined() == 2 and len(ep.registered) == 2
    now[0] = 61.0  # the oldest quarantine is over: `first` comes back, nothing new is registered
    assert pool.get() is first and pool.quarantined() == 1 and len(ep.registered) == 2


def test_a_failed_read_from_an_owner_that_restarted_is_read_again_with_its_new_descriptor():
    from flatcake.cluster.peers import PeerDirectory
    from flatcake.cluster.remote import RemoteReader
    from flatcake.cluster.transfer import RemoteReadResult

    class ByEngine:  # only the restarted owner's engine (h5:2) answers
        def __init__(self):
            self.calls = []

        def read(self, desc, pages, layers, chunk_bytes, out=None):
            self.calls.append(desc.te)
            res = RemoteReadResult.empty(len(pages), layers * chunk_bytes, out)
            if desc.te == "h5:2":
                res.data[:] = 0x7
                res.hit[:] = True
            else:
                res.misses["failed"] = len(pages)
            return res

    s = _FakeSession()
    s.kv[descriptor_key("/fc", 5)] = DataPlaneDescriptor(5, "h5:1").encode()
    dram = ByEngine()
    peers = PeerDirectory(s, "/fc")
    r = RemoteReader(peers, dram)
    pg = [RemotePage(5, encode_gva(MEDIUM_DRAM, 5, 0), 0, 8, None, "k")]
    assert peers.get(5).te == "h5:1"  # cached
    s.kv[descriptor_key("/fc", 5)] = DataPlaneDescriptor(5, "h5:2").encode()  # restarted, new engine
    res = r.read(pg, 2, 8)
    assert res.hit.tolist() == [True] and res.data[0].tolist() == [0x7] * 16
    assert dram.calls == ["h5:1", "h5:2"] and not peers.suspended(5) and peers.get(5).te == "h5:2"
    s.kv[descriptor_key("/fc", 5)] = DataPlaneDescriptor(5, "h5:1").encode()  # back to a dead engine
    peers.invalidate(5)
    assert r.read(pg, 2, 8).hit.tolist() == [False]
    assert dram.calls == ["h5:1", "h5:2", "h5:1"] and peers.suspended(5)  # unchanged: back-off
