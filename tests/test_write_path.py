"""The write path on its own (paper §3.1 write-time placement, §3.3 layer-major rounds): the bytes
it puts on each medium and the entries it hands back, for placements made by the scope table."""

import os

import numpy as np
import pytest
import torch
import xxhash
import flatcake_testkit as testkit
from flatcake_testkit import fill_page, two_requests_share

from flatcake.gva.address import MEDIUM_DRAM, MEDIUM_SSD, decode_gva
from flatcake.common.layout import PageGeometry
from flatcake.media import extent as fmt
from flatcake.media.errors import PoolFileGone
from flatcake.store.write_path import MAX_ROUND_PAGES, max_round_pages
from kernels.device_checksum import fcds_chunks


def make_store(ssd_dir, **kw):
    """``testkit.make_store`` with synchronous SSD writes (``ssd.write_backlog_bytes: 0``): these tests
    are about the synchronous write path itself (WritePath slabs and faults), which the write queue
    bypasses."""
    return testkit.make_store(ssd_dir, **{"ssd.write_backlog_bytes": 0, **kw})


def place(store, keys, pages, parent=None):
    with store.scopes.lock:
        return store.scopes.place_locked(keys, pages, parent, len(keys) * store.geometry.page_size)


def chunk(lay, page: int, layer: int) -> bytes:
    """The host pool's bytes of (page, layer), as the write path gathers them."""
    out = torch.empty((1, lay.geometry.chunk_bytes), dtype=torch.uint8)
    lay.gather_chunks(torch.tensor([page]), layer, out)
    return out.numpy().tobytes()


@pytest.mark.parametrize("mla", [False, True], ids=["mha", "mla"])
def test_ssd_round_is_extent_header_then_header_layer_major_data_and_record(ssd_dir, mla):
    store, pool, lay = make_store(ssd_dir, mla=mla, layout="layer_first")
    g = store.geometry
    keys = ["w0", "w1", "w2"]
    for i, k in enumerate(keys):
        fill_page(pool, (5 + i) * pool.page_size, k)
    plc = place(store, keys, [5, 6, 7])
    entries = store.writer.write(plc, lay)
    store.scopes.release(plc)
    ext = plc.new_extent
    raw = open(store.ssd.path_of(ext.file_index), "rb").read()
    eh = fmt.unpack_extent_header(raw[ext.offset: ext.offset + fmt.BLOCK])
    assert (eh.namespace, eh.scope_id, eh.extent_seq) == (store.namespace, plc.scope.scope_id, 0)
    rnd = raw[plc.round_offset: plc.round_offset + plc.layout.total_bytes]
    hdr = fmt.unpack_round_header(rnd[: fmt.BLOCK])
    rl = hdr.layout
    assert (rl.n_pages, rl.layers, rl.chunk_bytes, hdr.seq, hdr.scope_id, hdr.nonce) == (
        3, g.layers, g.chunk_bytes, 0, plc.scope.scope_id, plc.nonce)
    rec = fmt.unpack_record(rnd[rl.record_offset:])
    assert rec.keys == tuple(keys) and rec.matches(hdr)
    for p in range(3):
        for layer in range(g.layers):
            o = rl.chunk_offset(p, layer)
            assert rnd[o: o + g.chunk_bytes] == chunk(lay, 5 + p, layer)  # layer-major, bit for bit
            assert xxhash.xxh3_64_intdigest(rnd[o: o + g.chunk_bytes]) == int(rec.checksums[layer, p])
        e = entries[p]
        f = decode_gva(e.gva)
        assert (f.medium, f.offset) == (MEDIUM_SSD, ext.file_index * store.ssd.file_bytes + plc.round_offset + fmt.BLOCK + p * g.chunk_bytes)
        # the entry carries the page's xxh3 per layer, then its device checksums (record v3)
        assert e.layer_stride == 3 * g.chunk_bytes and np.array_equal(e.checksums, rec.page_checksums(p))
        assert np.array_equal(e.checksums[:g.layers], rec.checksums[:, p])
        assert np.array_equal(e.checksums[g.layers:], [fcds_chunks(np.frombuffer(chunk(lay, 5 + p, l), np.uint8),
                                                                    g.chunk_bytes)[0] for l in range(g.layers)])
    st = store.stats.snapshot()
    # extent header, then header + data, then the record: three ordered writes
    assert (st["ssd_write_ops"], st["ssd_write_bytes"], st["pages_written_ssd"]) == (3, fmt.BLOCK + rl.total_bytes, 3)
    store.close()


def test_dram_round_lands_page_major_in_its_slots(ssd_dir):
    store, pool, lay = make_store(ssd_dir, **{"dram.capacity_bytes": 1 << 20})
    g = store.geometry
    keys = ["d0", "d1"]
    two_requests_share(store.leading_run, keys)  # a shared prompt: DRAM
    for i, k in enumerate(keys):
        fill_page(pool, (3 + i) * pool.page_size, k)
    plc = place(store, keys, [3, 4])
    assert plc.medium == MEDIUM_DRAM
    entries = store.writer.write(plc, lay)
    store.scopes.release(plc)
    for p, (slot, e) in enumerate(zip(plc.slots, entries)):
        assert decode_gva(e.gva).offset == slot * g.page_bytes and e.checksums is None
        row = store.dram.slots[slot].numpy().tobytes()
        assert row == b"".join(chunk(lay, 3 + p, layer) for layer in range(g.layers))
    assert store.stats.snapshot()["dram_write_bytes"] == 2 * g.page_bytes
    store.close()


def test_write_into_a_removed_pool_file_raises_pool_file_gone(ssd_dir):
    store, pool, lay = make_store(ssd_dir)
    plc = place(store, ["g0"], [0])
    os.unlink(store.ssd.path_of(plc.extent_file))
    with pytest.raises(PoolFileGone):
        store.writer.write(plc, lay)
    store.scopes.release(plc)
    store.close()


def test_max_round_pages_fits_a_file_and_lets_rounds_fill_it():
    g = PageGeometry(layers=4, page_size=16, plane_row_bytes=(1024, 1024))  # 128 KiB pages
    assert max_round_pages(1 << 30, g) == MAX_ROUND_PAGES
    n = max_round_pages(4 << 20, g)  # 31 pages of 128 KiB + headers fit a 4 MiB file, but alone
    ext = fmt.round_layout(["k" * 80] * n, 4, g.chunk_bytes).total_bytes + fmt.BLOCK
    assert ext <= 4 << 20 and (4 << 20) // ext * ext >= 0.9 * (4 << 20)
    # 512 KiB pages in 256 MiB files: 128-page rounds fit 3 a file (75%), 127-page rounds 4 (99%)
    big = PageGeometry(layers=16, page_size=16, plane_row_bytes=(1024, 1024))
    assert max_round_pages(256 << 20, big) == 127
    assert max_round_pages(64 << 10, g) == 0  # not even one page

