"""SSD medium: extent allocator, O_DIRECT probe, and the self-describing on-disk format."""

import os

import numpy as np
import pytest
import xxhash
from flatcake_testkit import make_store, put_pages

from flatcake.common.align import align_up
from flatcake.config import SsdConfig
from flatcake.media import extent as fmt
from flatcake.media.directio import probe_direct_io
from flatcake.media.errors import SsdStartupError
from flatcake.media.ssd import Extent, SsdFilePool


def test_allocator_packs_best_fit_grows_in_place_and_coalesces(tmp_path):
    pool = SsdFilePool(SsdConfig(path=str(tmp_path), file_bytes=4 << 20, max_files=1), "ns")
    a = pool.allocate_locked(100_000)
    assert (a.file_index, a.offset, a.nbytes) == (0, 0, align_up(100_000))  # packed from the start
    b = pool.try_extend_locked(a, 8192)  # the range after it is free: grows in place
    assert b == Extent(0, 0, a.nbytes + 8192)
    c = pool.allocate_locked(4096)
    assert c.offset == b.end  # the next extent packs right after
    assert pool.try_extend_locked(b, 4096) is None  # no longer free after b
    d = pool.allocate_locked(8192)
    pool.free_locked(c)  # a 4 KiB hole between b and d
    e = pool.allocate_locked(4096)
    assert e.offset == c.offset  # best fit: the hole, not the large tail
    assert pool.used_bytes == b.nbytes + d.nbytes + e.nbytes
    for x in (b, d, e):
        pool.free_locked(x)
    assert pool.used_bytes == 0
    assert pool.free_ranges(0) == [(0, 4 << 20)]  # fully coalesced
    assert pool.allocate_locked(8 << 20) is None  # larger than a file
    pool.close()


def test_small_extents_fill_the_pool_before_allocation_fails(tmp_path):
    pool = SsdFilePool(SsdConfig(path=str(tmp_path), file_bytes=1 << 20, max_files=2), "ns")
    n = 0
    while pool.allocate_locked(12 << 10) is not None:
        n += 1
    assert n == 2 * ((1 << 20) // (12 << 10)) and pool.used_fraction() > 0.98
    pool.close()


def test_direct_io_probe_on_ext4_and_tmpfs(tmp_path):
    assert probe_direct_io(str(tmp_path)) is True  # the work filesystem (ext4) accepts O_DIRECT
    assert probe_direct_io(str(tmp_path / "missing")) is False


def test_refused_o_direct_falls_back_to_buffered_with_one_log_line(tmp_path, monkeypatch, caplog):
    import flatcake.media.ssd as ssd

    monkeypatch.setattr(ssd, "probe_direct_io", lambda d: False)
    pool = SsdFilePool(SsdConfig(path=str(tmp_path)), "ns")
    assert pool.direct_io is False
    assert sum("refuses O_DIRECT" in r.message for r in caplog.records) == 1
    pool.close()
    with pytest.raises(SsdStartupError, match="ssd.direct_io"):
        SsdFilePool(SsdConfig(path=str(tmp_path), direct_io="on"), "ns")


def test_files_are_preallocated_single_extents(tmp_path):
    pool = SsdFilePool(SsdConfig(path=str(tmp_path), file_bytes=2 << 20, max_files=2), "ns")
    st = os.stat(pool.path_of(0))
    assert st.st_size == 2 << 20 and st.st_blocks * 512 >= 2 << 20  # fallocated, not sparse


def test_header_and_record_round_trip():
    h = fmt.pack_extent_header("ns|x", 3, 42, 1, 1 << 20)
    assert len(h) == fmt.BLOCK
    eh = fmt.unpack_extent_header(h)
    assert (eh.node, eh.scope_id, eh.extent_seq, eh.reserved_bytes, eh.namespace) == (3, 42, 1, 1 << 20, "ns|x")
    bad = bytearray(h)
    bad[20] ^= 1
    assert fmt.unpack_extent_header(bytes(bad)) is None
    keys = ["a" * 64, "b" * 64, "c"]
    sums = np.arange(6, dtype=np.uint64).reshape(2, 3)
    rec = fmt.pack_record("ns", keys, 2, 512, sums, scope_id=7, seq=3, nonce=0xABC)
    r = fmt.unpack_record(rec + b"\0" * 100)
    assert r.keys == tuple(keys) and r.layers == 2 and r.chunk_bytes == 512
    assert (r.scope_id, r.seq, r.nonce) == (7, 3, 0xABC)
    assert r.ns_digest == fmt.namespace_digest("ns") and np.array_equal(r.checksums, sums)
    assert fmt.unpack_record(rec[:-1] + bytes([rec[-1] ^ 1])) is None  # torn
    lay = fmt.round_layout(keys, 2, 512)
    hdr = fmt.unpack_round_header(fmt.pack_round_header(lay, 3, 7, 0xABC))
    assert (hdr.layout, hdr.seq, hdr.scope_id, hdr.nonce) == (lay, 3, 7, 0xABC) and r.matches(hdr)
    other = fmt.unpack_round_header(fmt.pack_round_header(lay, 3, 7, 0xABD))  # same place, another round
    assert not r.matches(other)


def test_on_disk_extent_is_self_describing(ssd_dir):
    """Walk a pool file with only the format module: extent header -> rounds -> records; every
    chunk's bytes match its recorded checksum and its layer-major position."""
    store, pool, lay = make_store(ssd_dir)
    r1, r2 = ["k0", "k1", "k2"], ["k3", "k4"]
    assert put_pages(store, pool, lay, r1, range(3), []) == [True] * 3
    assert put_pages(store, pool, lay, r2, range(3, 5), r1) == [True] * 2
    assert store.flush_writes(30)  # on SSD: the write queue drained
    scope = store.index.get("k0").scope
    assert store.index.get("k4").scope is scope and len(scope.extents) == 1
    ext = scope.extents[0]
    data = open(store.ssd.path_of(ext.file_index), "rb").read()[ext.offset : ext.end]
    eh = fmt.unpack_extent_header(data[: fmt.BLOCK])
    assert eh.namespace == store.namespace and eh.scope_id == scope.scope_id
    g = store.geometry
    off, found = fmt.BLOCK, []
    while off < len(data):
        parsed = fmt.unpack_round_header(data[off : off + fmt.BLOCK])
        if parsed is None:
            break
        lay, seq, sid = parsed.layout, parsed.seq, parsed.scope_id
        rec = fmt.unpack_record(data[off + lay.record_offset : off + lay.total_bytes])
        assert rec is not None and sid == scope.scope_id and rec.ns_digest == fmt.namespace_digest(store.namespace)
        assert rec.matches(parsed)
        for p, k in enumerate(rec.keys):
            for layer in range(rec.layers):
                o = off + lay.chunk_offset(p, layer)
                assert xxhash.xxh3_64_intdigest(data[o : o + rec.chunk_bytes]) == int(rec.checksums[layer, p])
        found.append((seq, rec.keys))
        off += lay.total_bytes
    assert found == [(0, tuple(r1)), (1, tuple(r2))]
    # layer-major: layer 1 of round 0 starts right after layer 0 of all its 3 pages
    e0, e1 = store.index.get("k0"), store.index.get("k1")
    assert e1.gva - e0.gva == g.chunk_bytes and e0.layer_stride == 3 * g.chunk_bytes
    store.close()
