"""The one-call restores' per-call arguments (issue 11): the destination arguments built once per
layout (native_restore.dest_args), the page count of a restore (distinct_pages), the plan's array
addresses taken by arithmetic, the zero-copy eligibility cached per (layout, alignment), and the
argument check's unsigned range test."""

import weakref
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from cio_util import chunk_batch, make_pool, path_fn
from flatcake.cio import RestoreEngine, native_restore
from flatcake.cio.native_restore import dest_args, distinct_pages, dst_table
from flatcake.cio.native_zero_copy import ZeroCopy
from flatcake.cio.plan import ChunkBatch
from flatcake.config import CioConfig

needs_c = pytest.mark.skipif(native_restore.LOOP.fn() is None, reason="extension not built: the Python pipeline runs")


@pytest.mark.parametrize("kind", ["mha", "mla"])
@pytest.mark.parametrize("layout", ["layer_first", "page_first", "page_first_direct"])
def test_dest_args_hold_the_layouts_geometry_and_table_once_per_layout(kind, layout):
    _, lay = make_pool(kind, layout, pages=8)
    d = dest_args(lay)
    assert dest_args(lay) is d  # built once per layout object
    g = lay.geometry
    assert d.plane_off.tolist() == list(g.plane_offsets())
    assert d.plane_rb.tolist() == list(g.plane_row_bytes) == ([64, 64] if kind == "mha" else [48])
    assert (d.planes, d.page_size) == (len(g.plane_row_bytes), 4)
    for got, want in zip(d.table, dst_table(lay)):
        assert np.array_equal(got, want) and got.shape == (3, d.planes)
    assert d.addrs == tuple(x.ctypes.data for x in (d.plane_off, d.plane_rb) + d.table)
    assert d.table[0][1, 0] == lay.layer_planes(1)[0].data_ptr()  # a plane's base address
    with pytest.raises(ValueError):
        d.plane_off[0] = 1  # shared by every restore into this layout: read-only


def test_dest_args_is_none_where_a_planes_rows_are_not_contiguous():
    class Strided:  # rows of 64 bytes, every other byte: the Python pipeline copies
        geometry = SimpleNamespace(layers=1, plane_row_bytes=(64,), page_size=4)

        def layer_planes(self, layer):
            return [torch.zeros(2, 4, 128, dtype=torch.uint8)[:, :, ::2]]

    lay = Strided()
    assert dst_table(lay) is None and dest_args(lay) is None and dest_args(lay) is None


def test_distinct_pages_counts_every_page_once():
    layer_major = np.tile(np.array([7, 3, 7, 11, 0], dtype=np.int64), 4)  # 4 layers of 5 chunks
    assert distinct_pages(layer_major, 4) == 4
    assert distinct_pages(layer_major, 2) == 4 and distinct_pages(layer_major, 1) == 4
    not_repeated = np.array([1, 2, 3, 1, 2, 9], dtype=np.int64)  # halves differ: every entry counted
    assert distinct_pages(not_repeated, 2) == 4 and distinct_pages(not_repeated, 3) == 4
    assert distinct_pages(np.array([5, 5, 6], dtype=np.int64), 2) == 2  # 3 chunks, 2 layers: not a tile
    assert distinct_pages(np.zeros(0, dtype=np.int64), 3) == 0
    one_layer_missing = np.concatenate([np.arange(128), np.arange(128), np.arange(127)]).astype(np.int64)
    assert distinct_pages(one_layer_missing, 3) == 128


@needs_c
def test_plan_arrays_addresses_are_the_arrays_addresses():
    eng = SimpleNamespace(cfg=SimpleNamespace(gap_bytes=0, io_workers=3), max_io_bytes=1 << 20,
                          staging_bytes=1 << 20, chunk_bytes=4096)
    nr = native_restore.NativeRestore(eng, posix=None)
    n = 40
    chunks = ChunkBatch(file_index=np.arange(n) % 2, offset=(np.arange(n) // 2) * 4096, page=np.arange(n) % 10,
                        layer=np.arange(n) // 10, tag=np.arange(n), nbytes=4096)
    r = nr.plan_arrays(chunks, [1 << 30, 1 << 31])
    assert r is not None and r["nb"] == 1 and r["reads"] == 2 and r["bytes_read"] == n * 4096
    for k, a in r["addr"].items():
        if k != "out":
            assert a == r[k].ctypes.data, k
    npc = len(r["pfile"])  # each file's one read in pieces of >= engines.MIN_PIECE_BYTES
    assert sorted(set(r["pfile"].tolist())) == [0, 1] and int(r["plen"].sum()) == n * 4096
    assert r["pgot"].tolist() == r["perr"].tolist() == [0] * npc and len(r["own_lo"]) == npc + 1
    assert r["done"].tolist() == [0] and len(r["cidx"]) == n and sorted(r["cidx"].tolist()) == list(range(n))


def test_zero_copy_eligibility_is_checked_once_per_layout_and_alignment():
    zc = ZeroCopy(SimpleNamespace())
    calls = []

    def check(ok):
        return lambda: calls.append(ok) or ok

    class Layout:
        pass

    a, b = Layout(), Layout()
    assert zc.eligible_cached(a, 4096, check(True)) is True
    assert zc.eligible_cached(a, 4096, check(False)) is True  # cached: not asked again
    assert zc.eligible_cached(a, 512, check(False)) is False  # another alignment: asked
    assert zc.eligible_cached(b, 4096, check(False)) is False  # another layout: asked
    assert zc.eligible_cached(b, 4096, check(True)) is False
    assert calls == [True, False, False]
    ref = weakref.ref(a)
    del a
    assert ref() is None  # the cache does not keep a layout alive


@pytest.mark.parametrize("page,layer", [(-1, 0), (0, -1), (16, 0), (0, 3), (-(1 << 62), 0)])
def test_a_page_or_layer_outside_the_layout_is_refused(ext4_dir, page, layer):
    _, lay = make_pool("mha", "layer_first", pages=16)
    cb = lay.geometry.chunk_bytes
    with RestoreEngine(CioConfig(io_workers=1), path_fn(ext4_dir), direct_io=False, chunk_bytes=cb) as eng:
        with pytest.raises(ValueError, match="outside layout"):
            eng.restore(chunk_batch([(0, 0, cb, 15, 2, 0, None), (0, cb, cb, page, layer, 7, None)]), lay)


def test_zero_copy_is_off_unless_flatcake_zero_copy_is_1(monkeypatch):
    from flatcake.cio import native_zero_copy
    from flatcake.native.loops import NativeLoop

    assert native_zero_copy.LOOP.env == "FLATCAKE_ZERO_COPY" and native_zero_copy.LOOP.default_on is False
    monkeypatch.delenv("FC_TEST_LOOP", raising=False)
    off = NativeLoop(lambda: ((lambda: 41), ""), "FC_TEST_LOOP", "fallback", default_on=False)
    assert off.fn() is None  # unset: the fallback
    monkeypatch.setenv("FC_TEST_LOOP", "1")
    on = NativeLoop(lambda: ((lambda: 41), ""), "FC_TEST_LOOP", "fallback", default_on=False)
    assert on.fn()() == 41
    monkeypatch.setenv("FC_TEST_LOOP", "0")
    default_on = NativeLoop(lambda: ((lambda: 42), ""), "FC_TEST_LOOP", "fallback")
    assert default_on.fn() is None  # a default-on loop turned off by "0", as before
