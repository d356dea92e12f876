"""The read path on its own (paper §3.1 routing by GVA medium, §3.3 FC-CIO restore): pinned
entries in, pages out, bit for bit, or a miss from the first page that failed."""

import numpy as np
import torch
from flatcake_testkit import make_store, page_matches, put_pages, two_requests_share

from flatcake.gva.address import OFFSET_MASK
from flatcake.media import extent as fmt


def pinned(store, keys):
    entries = store.scopes.pin_leading_run(keys)
    assert len(entries) == len(keys)
    return entries


def test_ssd_pages_are_restored_bit_exact_into_other_slots(ssd_dir):
    store, pool, lay = make_store(ssd_dir, layout="page_first_direct")
    keys = [f"s{i}" for i in range(5)]
    assert put_pages(store, pool, lay, keys, range(5)) == [True] * 5
    assert store.flush_writes(30)  # on SSD: the write queue drained
    entries = pinned(store, keys)
    try:
        assert store.reader.read(keys, entries, lay, [20, 21, 22, 23, 24]) == 5
    finally:
        store.scopes.unpin(entries)
    assert all(page_matches(pool, (20 + i) * pool.page_size, k) for i, k in enumerate(keys))
    st = store.stats.snapshot()
    assert (st["hit_pages_ssd"], st["hit_pages_dram"], st["merged_reads"]) == (5, 0, 1)
    assert st["logical_read_bytes_ssd"] == 5 * store.geometry.page_bytes
    store.close()


def test_the_chunk_batch_is_layer_major_with_each_pages_checksums(ssd_dir):
    store, pool, lay = make_store(ssd_dir)
    keys = ["c0", "c1"]
    put_pages(store, pool, lay, keys, [0, 1])
    assert store.flush_writes(30)  # on SSD: the write queue drained
    entries = pinned(store, keys)
    b = store.reader.chunk_batch(entries, [0, 1], [7, 9])
    store.scopes.unpin(entries)
    g = store.geometry
    off0 = (entries[0].gva & OFFSET_MASK) % store.ssd.file_bytes
    assert b.layer.tolist() == [0, 0, 1, 1, 2, 2] and b.page.tolist() == [7, 9] * 3 and b.tag.tolist() == [0, 1] * 3
    assert b.offset.tolist() == [off0 + l * 2 * g.chunk_bytes + p * g.chunk_bytes for l in range(3) for p in range(2)]
    assert b.checksum.tolist() == [int(entries[p].checksums[l]) for l in range(3) for p in range(2)]
    assert b.has_checksum.all() and b.nbytes == g.chunk_bytes
    store.close()


def test_dram_and_ssd_pages_in_one_call_each_come_from_their_medium(ssd_dir):
    store, pool, lay = make_store(ssd_dir, **{"dram.capacity_bytes": 1 << 20})
    shared = ["d0", "d1"]
    two_requests_share(store.leading_run, shared)
    put_pages(store, pool, lay, shared, [0, 1])
    put_pages(store, pool, lay, ["s2", "s3"], [2, 3], prefix=None)
    assert store.flush_writes(30)  # on SSD: the write queue drained
    assert [store.medium_of(k) for k in ("d0", "s2")] == ["dram", "ssd"]
    keys = ["s2", "d0", "s3", "d1"]
    entries = pinned(store, keys)
    try:
        assert store.reader.read(keys, entries, lay, [30, 31, 32, 33]) == 4
    finally:
        store.scopes.unpin(entries)
    assert all(page_matches(pool, (30 + i) * pool.page_size, k) for i, k in enumerate(keys))
    st = store.stats.snapshot()
    assert (st["hit_pages_dram"], st["hit_pages_ssd"]) == (2, 2)
    store.close()


def test_a_corrupted_chunk_stops_the_read_there_and_later_pages_are_not_delivered(ssd_dir):
    store, pool, lay = make_store(ssd_dir, **{"dram.capacity_bytes": 1 << 20})
    keys = ["k0", "k1", "k2"]
    put_pages(store, pool, lay, keys, [0, 1, 2])
    assert store.flush_writes(30)  # on SSD: the write queue drained
    e1 = store.index.get("k1")
    path = store.ssd.path_of((e1.gva & OFFSET_MASK) // store.ssd.file_bytes)
    with open(path, "r+b") as f:  # flip one byte of page k1, layer 2
        f.seek((e1.gva & OFFSET_MASK) % store.ssd.file_bytes + 2 * e1.layer_stride + 5)
        b = f.read(1)
        f.seek(-1, 1)
        f.write(bytes([b[0] ^ 0xFF]))
    pool.kv_buffer.view(torch.uint8).fill_(0x5A)
    entries = pinned(store, keys)
    try:
        assert store.reader.read(keys, entries, lay, [10, 11, 12]) == 1
    finally:
        store.scopes.unpin(entries)
    assert page_matches(pool, 10 * pool.page_size, "k0")
    assert not page_matches(pool, 11 * pool.page_size, "k1")  # never other bytes: k1 is a miss
    assert store.errors.count == 1
    store.close()


def test_round_header_offsets_line_up_with_entries(ssd_dir):
    store, pool, lay = make_store(ssd_dir)
    put_pages(store, pool, lay, ["h0", "h1"], [0, 1])
    assert store.flush_writes(30)  # on SSD: the write queue drained
    e = store.index.get("h0")
    scope = e.scope
    first_round = scope.extents[0].offset + fmt.BLOCK
    assert (e.gva & OFFSET_MASK) % store.ssd.file_bytes == first_round + fmt.BLOCK
    # record v3: one xxh3-64 per layer, then one device checksum (FCDS) per layer
    assert np.asarray(e.checksums).shape == (2 * store.geometry.layers,)
    store.close()
