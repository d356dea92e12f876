"""Vectorized page copies and chunk checksums (flatcake.cio.pagecopy): bit-exact against the
layout's per-page reference copies, at page sizes 1, 16 and 64 tokens, all three host layouts,
MHA and MLA; and SSD/DRAM round trips through the store at those page sizes."""

from __future__ import annotations

import numpy as np
import pytest
import torch
import xxhash

from flatcake.adapter.host_pool import MHAHostPoolDouble, MLAHostPoolDouble
from flatcake.cio.pagecopy import checksums_at, chunk_checksums, gather_pages, scatter_pages
from flatcake.common.layout import SUPPORTED_LAYOUTS, KvPageLayout
from tests.flatcake_testkit import make_store, page_matches, put_pages, two_requests_share

LAYERS = 3
PAGES = 12


def _pool(kind: str, layout: str, page_size: int):
    if kind == "mha":
        pool = MHAHostPoolDouble(PAGES * page_size, page_size, LAYERS, 2, 8, dtype=torch.bfloat16, layout=layout)
    else:
        pool = MLAHostPoolDouble(PAGES * page_size, page_size, LAYERS, 24, dtype=torch.bfloat16, layout=layout)
    flat = pool.kv_buffer.view(torch.uint8).view(-1)
    g = torch.Generator().manual_seed(page_size * 7 + len(layout))
    flat.copy_(torch.randint(0, 256, (flat.numel(),), dtype=torch.uint8, generator=g))
    return pool, KvPageLayout.from_host_pool(pool)


CASES = [(k, lay, p) for k in ("mha", "mla") for lay in SUPPORTED_LAYOUTS for p in (1, 16, 64)]


@pytest.mark.parametrize("kind,layout,page_size", CASES)
def test_gather_pages_matches_reference(kind, layout, page_size):
    pool, lay = _pool(kind, layout, page_size)
    cb = lay.geometry.chunk_bytes
    for ids in ([3, 4, 5, 6], [9, 0, 7, 2, 2]):  # consecutive (slice copy) and arbitrary (fancy index)
        for layer in range(LAYERS):
            want = torch.zeros((len(ids), cb), dtype=torch.uint8)
            lay.gather_chunks(torch.tensor(ids), layer, want)
            got = torch.zeros((len(ids), LAYERS, cb), dtype=torch.uint8)  # strided rows, as the DRAM path
            gather_pages(lay, np.asarray(ids), layer, got[:, layer])
            assert torch.equal(got[:, layer], want)
            assert int(got[:, [x for x in range(LAYERS) if x != layer]].count_nonzero()) == 0


@pytest.mark.parametrize("kind,layout,page_size", CASES)
def test_scatter_pages_round_trip_bit_exact(kind, layout, page_size):
    pool, lay = _pool(kind, layout, page_size)
    before = pool.kv_buffer.view(torch.uint8).clone()
    cb = lay.geometry.chunk_bytes
    rows = torch.zeros((PAGES, LAYERS, cb), dtype=torch.uint8)
    ids = [5, 1, 11, 0, 6, 7, 8, 2, 3, 4, 9, 10]
    for layer in range(LAYERS):
        gather_pages(lay, torch.tensor(ids), layer, rows[:, layer])
    pool.kv_buffer.view(torch.uint8).zero_()
    for layer in range(LAYERS):
        scatter_pages(lay, rows[:, layer], ids, layer)
    assert torch.equal(pool.kv_buffer.view(torch.uint8), before)
    # consecutive ids take the slice path: scatter pages 2..4 only, the rest stay zero
    pool.kv_buffer.view(torch.uint8).zero_()
    for layer in range(LAYERS):
        scatter_pages(lay, rows[[7, 8, 9], layer], [2, 3, 4], layer)
    ref = torch.zeros((PAGES, LAYERS, cb), dtype=torch.uint8)
    for layer in range(LAYERS):
        lay.gather_chunks(torch.arange(PAGES), layer, ref[:, layer])
    assert torch.equal(ref[2:5], rows[[7, 8, 9]])
    assert int(ref[[0, 1] + list(range(5, PAGES))].count_nonzero()) == 0


def test_gather_pages_rejects_page_outside_layout():
    _, lay = _pool("mha", "page_first", 4)
    with pytest.raises(IndexError):
        gather_pages(lay, [PAGES], 0, torch.zeros((1, lay.geometry.chunk_bytes), dtype=torch.uint8))


def test_chunk_checksums_are_per_chunk_xxh3():
    data = np.frombuffer(np.random.default_rng(1).bytes(5 * 320), dtype=np.uint8)
    got = chunk_checksums(data, 320)
    want = [xxhash.xxh3_64_intdigest(data[i * 320:(i + 1) * 320].tobytes()) for i in range(5)]
    assert got.dtype == np.uint64 and got.tolist() == want
    assert checksums_at(data, [640, 0], 320).tolist() == [want[2], want[0]]


@pytest.mark.parametrize("mla", [False, True])
@pytest.mark.parametrize("layout", SUPPORTED_LAYOUTS)
@pytest.mark.parametrize("page_size", [1, 16, 64])
@pytest.mark.parametrize("dram", [0, 64 << 20])
def test_store_round_trip_bit_exact(tmp_path, mla, layout, page_size, dram):
    """put then get through the write path (SSD: layer-major round + per-chunk checksums, or
    DRAM slots) and the read path (FC-CIO restore with checksum verification, or DRAM copy)."""
    store, pool, lay = make_store(str(tmp_path / "ssd"), mla=mla, layout=layout, pages=16, page_size=page_size,
                                  **{"dram.capacity_bytes": dram, "cio.verify_checksums": True})
    try:
        keys = [f"k{page_size}-{i}" for i in range(6)]
        src = [9, 2, 3, 4, 12, 0]
        if dram:  # shared by two requests: placed on DRAM (paper Table 2)
            two_requests_share(store.leading_run, keys)
        assert put_pages(store, pool, lay, keys, src) == [True] * 6
        assert store.flush_writes(30)  # on SSD: the write queue drained
        st = store.snapshot_stats()
        assert st["pages_written_dram" if dram else "pages_written_ssd"] == 6
        pool.kv_buffer.view(torch.uint8).zero_()
        dst = [1, 5, 6, 7, 15, 10]
        assert store.get(keys, lay, dst) == [True] * 6
        assert store.snapshot_stats()["hit_pages_dram" if dram else "hit_pages_ssd"] == 6
        for k, p in zip(keys, dst):
            assert page_matches(pool, p * page_size, k)
        for p in set(range(16)) - set(dst):  # pages not read stay untouched (zero)
            assert int(pool.get_data_page(p * page_size, flat=True).view(torch.uint8).count_nonzero()) == 0
    finally:
        store.close()


@pytest.mark.parametrize("kind,layout,page_size", CASES)
def test_gather_layers_matches_per_layer_gathers(kind, layout, page_size):
    from flatcake.cio.pagecopy import _plane_stack, gather_layers

    pool, lay = _pool(kind, layout, page_size)
    cb = lay.geometry.chunk_bytes
    assert _plane_stack(lay, 0, 0, LAYERS) is not None  # every host layout: one copy per plane
    for ids in ([3, 4, 5, 6], [9, 0, 7, 2, 2]):
        for l0, l1 in ((0, LAYERS), (1, 3), (2, 3)):
            want = torch.zeros((l1 - l0, len(ids), cb), dtype=torch.uint8)
            for k, layer in enumerate(range(l0, l1)):
                lay.gather_chunks(torch.tensor(ids), layer, want[k])
            got = torch.zeros((LAYERS, len(ids), cb), dtype=torch.uint8)
            gather_layers(lay, ids, l0, l1, got[l0:l1])
            assert torch.equal(got[l0:l1], want)
            assert int(got[:l0].count_nonzero()) == 0 and int(got[l1:].count_nonzero()) == 0


def test_gather_layers_falls_back_per_layer_for_unevenly_spaced_layers():
    from flatcake.cio.pagecopy import _plane_stack, gather_layers

    ks = [torch.randint(0, 256, (8, 2, 16), dtype=torch.uint8).view(torch.bfloat16) for _ in range(3)]
    vs = [torch.randint(0, 256, (8, 2, 16), dtype=torch.uint8).view(torch.bfloat16) for _ in range(3)]
    lay = KvPageLayout.from_device_kv(ks, vs, page_size=2)  # separate tensors per layer
    assert _plane_stack(lay, 0, 0, 3) is None
    cb = lay.geometry.chunk_bytes
    want = torch.zeros((3, 2, cb), dtype=torch.uint8)
    for layer in range(3):
        lay.gather_chunks(torch.tensor([3, 1]), layer, want[layer])
    got = torch.zeros((3, 2, cb), dtype=torch.uint8)
    gather_layers(lay, [3, 1], 0, 3, got)
    assert torch.equal(got, want)
