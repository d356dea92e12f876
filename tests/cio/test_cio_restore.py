"""FC-CIO restore (paper §3.3): coalesced reads → double-buffered staging window → scatter."""

import errno
import fcntl
import logging
import os
import threading
import time

import numpy as np
import pytest
import torch

from cio_util import (LAYERS, chunk_batch, concat, extent_chunks, kv_bytes, make_pool, path_fn, reference, rows,
                      subset, write_extent)
from flatcake.cio import ChunkBatch, EngineUnavailableError, RestoreEngine, auto_staging_bytes
from flatcake.cio import engines as engines_mod
from flatcake.cio import kvikio_engine as kvikio_mod
from flatcake.cio import native_restore
from flatcake.cio.restore import MIN_AUTO_STAGING_BYTES
from flatcake.config import CioConfig
from flatcake.kernels.scatter import triton_available

N = 16  # pages per extent


@pytest.fixture
def python_pipeline(monkeypatch):
    """Restores take the Python pipeline (per-piece worker threads), whose reads go through
    ``os.preadv``: the seam these tests inject faults at or count calls on. The one-call C
    restore (the default) is covered by tests/cio/test_cio_native_restore.py."""
    monkeypatch.setitem(native_restore.LOOP.state, "fn", None)


def engine(d, cb, direct_io=True, **cfg):
    kw = dict(io_workers=2)
    kw.update(cfg)
    return RestoreEngine(CioConfig(**kw), path_fn(d), direct_io=direct_io, chunk_bytes=cb, max_pages_per_restore=N)


@pytest.mark.parametrize("kind", ["mha", "mla"])
@pytest.mark.parametrize("layout", ["layer_first", "page_first", "page_first_direct"])
def test_restore_is_bit_exact_for_every_host_layout(ext4_dir, kind, layout):
    pool, lay = make_pool(kind, layout, pages=2 * N)
    cb = lay.geometry.chunk_bytes
    data = write_extent(os.path.join(ext4_dir, "f0"), N, LAYERS, cb, seed=1, base=100, tail=50)
    dst = [2 * i + 1 for i in range(N)]  # non-contiguous destination slots
    chunks = extent_chunks(data, 0, N, LAYERS, cb, base=100, pages=dst)
    with engine(ext4_dir, cb, staging_bytes=32768) as eng:
        rep = eng.restore(chunk_batch(rows(chunks)[::-1]), lay)  # any order
    assert rep.failed_tags == frozenset()
    assert torch.equal(kv_bytes(pool), reference(kind, layout, 2 * N, data, chunks))
    extent = N * LAYERS * cb
    assert (rep.pages, rep.chunks, rep.merged_reads, rep.engine) == (N, N * LAYERS, 1, "posix")
    assert rep.bytes_read == -(-(100 + extent) // 4096) * 4096
    assert rep.bytes_over_read == rep.bytes_read - extent


def test_layer_major_extent_restores_with_one_read_per_layer_through_the_pipeline(ext4_dir):
    pool, lay = make_pool("mha", "page_first", pages=N)
    cb = lay.geometry.chunk_bytes  # 512 B: one layer of 16 pages = 8 KiB
    data = write_extent(os.path.join(ext4_dir, "f0"), N, LAYERS, cb, seed=2)
    chunks = extent_chunks(data, 0, N, LAYERS, cb)
    with engine(ext4_dir, cb, max_io_bytes=8192, staging_bytes=8192) as eng:
        rep = eng.restore(chunks, lay)
        assert eng.staging_total_bytes == 2 * 8192
    assert (rep.merged_reads, rep.batches, rep.bytes_read, rep.bytes_over_read) == (LAYERS, LAYERS, 3 * 8192, 0)
    assert rep.failed_tags == frozenset()
    assert torch.equal(kv_bytes(pool), reference("mha", "page_first", N, data, chunks))


def test_missing_file_in_the_middle_fails_exactly_that_page(ext4_dir, caplog):
    pool, lay = make_pool("mha", "layer_first", pages=N)
    cb = lay.geometry.chunk_bytes
    data = write_extent(os.path.join(ext4_dir, "f0"), N, LAYERS, cb, seed=3)
    chunks = extent_chunks(data, 0, N, LAYERS, cb)
    # page 7's three layer chunks point into file 9, which does not exist
    chunks = chunk_batch([(9, r[4] << 20, *r[2:]) if r[5] == 7 else r for r in rows(chunks)])
    with caplog.at_level(logging.WARNING, logger="flatcake.cio"):
        with engine(ext4_dir, cb, staging_bytes=32768) as eng:
            rep = eng.restore(chunks, lay)
            assert eng.errors.count == LAYERS  # three failed reads (1 MiB apart: not bridged) ...
    assert rep.failed_tags == frozenset({7})
    assert sum("ENOENT" in r.getMessage() for r in caplog.records) == 1  # ... logged once
    exp = reference("mha", "layer_first", N, data, chunks, skip_tags={7})
    assert torch.equal(kv_bytes(pool), exp)
    assert rep.merged_reads == 1 + LAYERS  # file 0 coalesced; file 9 one read per layer


def test_eio_on_one_read_fails_only_the_chunks_it_covers(ext4_dir, monkeypatch, python_pipeline):
    pool, lay = make_pool("mla", "page_first", pages=N)
    cb = lay.geometry.chunk_bytes  # 192 B
    data = write_extent(os.path.join(ext4_dir, "f0"), N, LAYERS, cb, seed=4)
    bad = write_extent(os.path.join(ext4_dir, "f1"), 2, 1, cb, seed=5)
    chunks = extent_chunks(data, 0, N, LAYERS, cb)
    # two extra chunks from file 1 into pages 0 and 1 of layer 0, under tags 100/101
    chunks = subset(chunks, ~((chunks.layer == 0) & (chunks.page < 2)))
    chunks = concat(chunks, chunk_batch([(1, i * cb, cb, i, 0, 100 + i, None) for i in range(2)]))
    real = os.preadv

    def preadv(fd, bufs, off):
        if os.readlink(f"/proc/self/fd/{fd}").endswith("/f1"):
            raise OSError(errno.EIO, "Input/output error")
        return real(fd, bufs, off)

    monkeypatch.setattr(engines_mod.os, "preadv", preadv)
    with engine(ext4_dir, cb) as eng:
        rep = eng.restore(chunks, lay)
    assert rep.failed_tags == frozenset({100, 101})
    exp = reference("mla", "page_first", N, data, subset(chunks, chunks.file_index == 0))
    assert torch.equal(kv_bytes(pool), exp)


@pytest.mark.parametrize("direct_io", [False, True])
def test_short_read_fails_covered_chunks_and_never_scatters_stale_staging_bytes(ext4_dir, direct_io):
    _, lay0 = make_pool("mha", "page_first", pages=N)
    cb = lay0.geometry.chunk_bytes
    garbage = write_extent(os.path.join(ext4_dir, "f0"), N, LAYERS, cb, seed=6)
    data = write_extent(os.path.join(ext4_dir, "f1"), N, LAYERS, cb, seed=7)
    n = N * LAYERS
    g_chunks = chunk_batch([(0, i * cb, cb, i % N, i // N, i, None) for i in range(n)])
    chunks = chunk_batch([(1, i * cb, cb, i % N, i // N, i, None) for i in range(n)])  # tag = chunk number
    with engine(ext4_dir, cb, direct_io, windows=1, verify_checksums=False, staging_bytes=32768) as eng:
        # 1) a previous restore leaves the garbage file's bytes in the (only) window
        assert eng.restore(g_chunks, lay0).failed_tags == frozenset()
        with eng.window() as win:  # the only window: the one the restore just used
            stage = win.buffers[0].array
        assert bytes(stage[: n * cb]) == garbage[: n * cb].tobytes()
        # 2) the data file is truncated behind the engine, in the middle of chunk 21 (layer 1)
        cut = 21 * cb + 100
        os.truncate(os.path.join(ext4_dir, "f1"), cut)
        pool, lay = make_pool("mha", "page_first", pages=N)
        pool.kv_buffer.view(torch.uint8).fill_(0x5A)  # sentinel
        rep = eng.restore(chunks, lay)
        if not direct_io:  # (an O_DIRECT read zero-fills its buffer past EOF; a buffered one does not)
            # the staging past the cut still holds garbage: stale bytes were there ...
            assert bytes(stage[cut : n * cb]) == garbage[cut : n * cb].tobytes()
    assert rep.failed_tags == frozenset(range(21, n))
    assert rep.merged_reads == 1
    got = pool.kv_buffer.view(torch.uint8)
    exp = reference("mha", "page_first", N, data, subset(chunks, np.arange(len(chunks)) < 21))
    filled = exp.clone()
    sentinel_mask = reference("mha", "page_first", N, np.full(len(data), 1, np.uint8), subset(chunks, np.arange(len(chunks)) < 21)) == 0
    filled[sentinel_mask] = 0x5A
    # ... and never reached a slot: delivered chunks hold the data, failed slots the sentinel
    assert torch.equal(got, filled)


def test_checksum_mismatch_fails_that_chunk_only(ext4_dir):
    pool, lay = make_pool("mha", "page_first_direct", pages=N)
    cb = lay.geometry.chunk_bytes
    data = write_extent(os.path.join(ext4_dir, "f0"), N, LAYERS, cb, seed=8)
    chunks = extent_chunks(data, 0, N, LAYERS, cb)
    k = int(np.flatnonzero((chunks.page == 5) & (chunks.layer == 2))[0])
    chunks.checksum[k] ^= np.uint64(1)
    with engine(ext4_dir, cb) as eng:
        rep = eng.restore(chunks, lay)
        assert eng.errors.count == 1
    assert rep.failed_tags == frozenset({5})
    assert torch.equal(kv_bytes(pool), reference("mha", "page_first_direct", N, data, subset(chunks, np.arange(len(chunks)) != k)))
    # with verification off the same bytes are delivered
    pool2, lay2 = make_pool("mha", "page_first_direct", pages=N)
    with engine(ext4_dir, cb, verify_checksums=False) as eng:
        assert eng.restore(chunks, lay2).failed_tags == frozenset()
    assert torch.equal(kv_bytes(pool2), reference("mha", "page_first_direct", N, data, chunks))


def test_two_concurrent_restores_sharing_one_window_match_their_solo_bytes(ext4_dir):
    _, lay = make_pool("mha", "page_first", pages=N)
    cb = lay.geometry.chunk_bytes
    datas = [write_extent(os.path.join(ext4_dir, f"f{i}"), N, LAYERS, cb, seed=10 + i) for i in range(2)]
    chunk_sets = [extent_chunks(datas[i], i, N, LAYERS, cb) for i in range(2)]
    expected = [reference("mha", "page_first", N, datas[i], chunk_sets[i]) for i in range(2)]
    # staging of one layer per buffer: each restore runs three pipeline steps in the one window
    with engine(ext4_dir, cb, windows=1, staging_bytes=8192, max_io_bytes=8192) as eng:
        for _ in range(3):
            pools = [make_pool("mha", "page_first", pages=N) for _ in range(2)]
            reports = [None, None]
            barrier = threading.Barrier(2)

            def run(i):
                barrier.wait()
                reports[i] = eng.restore(chunk_sets[i], pools[i][1])

            ts = [threading.Thread(target=run, args=(i,)) for i in range(2)]
            for t in ts:
                t.start()
            for t in ts:
                t.join()
            for i in range(2):
                assert reports[i].failed_tags == frozenset() and reports[i].batches == LAYERS
                assert torch.equal(kv_bytes(pools[i][0]), expected[i])
        assert eng.staging_total_bytes == 2 * 8192  # one window, whatever the concurrency


def test_restore_waits_for_a_busy_window_instead_of_failing(ext4_dir):
    pool, lay = make_pool("mla", "layer_first", pages=N)
    cb = lay.geometry.chunk_bytes
    data = write_extent(os.path.join(ext4_dir, "f0"), N, LAYERS, cb, seed=12)
    chunks = extent_chunks(data, 0, N, LAYERS, cb)
    with engine(ext4_dir, cb, windows=1) as eng:
        out = {}
        t = threading.Thread(target=lambda: out.setdefault("rep", eng.restore(chunks, lay)))
        with eng.window():  # another restore holds the only window
            t.start()
            deadline = time.monotonic() + 30
            while eng.window_waits == 0 and time.monotonic() < deadline:
                time.sleep(0.005)
            assert eng.window_waits == 1 and "rep" not in out  # waiting, not failed
        t.join()
    assert out["rep"].failed_tags == frozenset()
    assert torch.equal(kv_bytes(pool), reference("mla", "layer_first", N, data, chunks))


def test_o_direct_reads_are_4k_aligned_on_ext4(ext4_dir, monkeypatch, python_pipeline):
    pool, lay = make_pool("mha", "page_first", pages=N)
    cb = lay.geometry.chunk_bytes
    data = write_extent(os.path.join(ext4_dir, "f0"), N, LAYERS, cb, seed=13, base=1000, tail=77)
    chunks = extent_chunks(data, 0, N, LAYERS, cb, base=1000)
    calls = []
    real = os.preadv

    def preadv(fd, bufs, off):
        b = bufs[0]
        calls.append((fcntl.fcntl(fd, fcntl.F_GETFL) & os.O_DIRECT, b.__array_interface__["data"][0], b.nbytes, off))
        return real(fd, bufs, off)

    monkeypatch.setattr(engines_mod.os, "preadv", preadv)
    with engine(ext4_dir, cb, max_io_bytes=8192, staging_bytes=8192) as eng:
        assert eng.direct_io
        rep = eng.restore(chunks, lay)
    assert rep.failed_tags == frozenset()
    assert torch.equal(kv_bytes(pool), reference("mha", "page_first", N, data, chunks))
    assert len(calls) >= rep.merged_reads >= 3
    for direct, addr, length, off in calls:
        assert direct == os.O_DIRECT
        assert (addr % 4096, length % 4096, off % 4096) == (0, 0, 0)


def test_engine_reads_buffered_when_told_the_filesystem_refused_o_direct(ext4_dir, monkeypatch):
    # the probe runs once, in the SSD pool (tests/media); the engine follows its verdict
    pool, lay = make_pool("mha", "page_first", pages=N)
    cb = lay.geometry.chunk_bytes
    data = write_extent(os.path.join(ext4_dir, "f0"), N, LAYERS, cb, seed=14)
    chunks = extent_chunks(data, 0, N, LAYERS, cb)
    flags = []
    real_open = os.open
    monkeypatch.setattr(engines_mod.os, "open", lambda path, fl, *a: flags.append(fl) or real_open(path, fl, *a))
    with engine(ext4_dir, cb, direct_io=False) as eng:
        assert eng.direct_io is False
        assert eng.restore(chunks, lay).failed_tags == frozenset()
    assert flags and not any(fl & os.O_DIRECT for fl in flags)
    assert torch.equal(kv_bytes(pool), reference("mha", "page_first", N, data, chunks))


def test_open_with_o_direct_raising_einval_falls_back_to_buffered_once(ext4_dir, monkeypatch, caplog):
    pool, lay = make_pool("mha", "page_first", pages=N)
    cb = lay.geometry.chunk_bytes
    datas = [write_extent(os.path.join(ext4_dir, f"f{i}"), N, LAYERS, cb, seed=15 + i) for i in range(2)]
    chunks = extent_chunks(datas[0], 0, N, LAYERS, cb)
    other = extent_chunks(datas[1], 1, N, LAYERS, cb)
    chunks = concat(subset(chunks, chunks.page < 8), subset(other, other.page >= 8))
    real_open = os.open
    refused = []

    def fake_open(path, flags, *a):
        if flags & os.O_DIRECT:
            refused.append(path)
            raise OSError(errno.EINVAL, "Invalid argument")
        return real_open(path, flags, *a)

    monkeypatch.setattr(engines_mod.os, "open", fake_open)
    with caplog.at_level(logging.INFO, logger="flatcake.cio"):
        with engine(ext4_dir, cb) as eng:
            assert eng.direct_io is True
            rep = eng.restore(chunks, lay)
            assert eng.direct_io is False
    assert rep.failed_tags == frozenset() and len(refused) >= 1
    assert sum("O_DIRECT" in r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING) == 1
    assert torch.equal(kv_bytes(pool), reference("mha", "page_first", N, {0: datas[0], 1: datas[1]}, chunks))


def test_auto_staging_size_alignment_and_empty_restore(ext4_dir):
    _, lay = make_pool("mha", "page_first", pages=N)
    cb = lay.geometry.chunk_bytes
    # one layer of 128 pages plus two 4 KiB blocks of slack, at least MIN_AUTO_STAGING_BYTES
    assert auto_staging_bytes(512 << 10, 128) == (64 << 20) + 8192
    assert auto_staging_bytes(cb, 128) == MIN_AUTO_STAGING_BYTES == 32 << 20
    eng = RestoreEngine(CioConfig(windows=3, io_workers=1), path_fn(ext4_dir), direct_io=False, chunk_bytes=cb)
    try:
        assert eng.staging_bytes == 32 << 20
        assert eng.staging_total_bytes == 3 * 2 * (32 << 20)
        assert eng.engine_name == "posix"  # no CUDA driver on this machine
        assert len(eng.staging.windows) == 3
        for w in eng.staging.windows:
            assert [b.tensor.data_ptr() % 4096 for b in w.buffers] == [0, 0]
        rep = eng.restore(chunk_batch([]), lay)
        assert (rep.merged_reads, rep.bytes_read, rep.pages, rep.failed_tags) == (0, 0, 0, frozenset())
        with pytest.raises(ValueError, match="outside layout"):
            eng.restore(chunk_batch([(0, 0, cb, N, 0, 0, None)]), lay)
        with pytest.raises(ValueError, match="nbytes"):
            eng.restore(chunk_batch([(0, 0, cb + 1, 0, 0, 0, None)]), lay)
    finally:
        eng.close()
    with pytest.raises(RuntimeError, match="closed"):
        eng.restore(chunk_batch([]), lay)
    with pytest.raises(ValueError, match="cannot hold one chunk"):
        RestoreEngine(CioConfig(staging_bytes=4096), path_fn(ext4_dir), direct_io=False, chunk_bytes=4096)


@pytest.mark.parametrize("cut_piece,native", [(None, True), (None, False), (1, False)])
def test_chunks_straddling_two_io_pieces_need_both_pieces(ext4_dir, monkeypatch, cut_piece, native):
    # 4 KiB pieces and 192-byte chunks at an odd base: many chunks straddle two pieces, so both the
    # worker-side (chunk inside one piece) and the restore-side (straddling) paths run
    monkeypatch.setattr(engines_mod, "MIN_PIECE_BYTES", 4096)
    if not native:  # the fault is injected at os.preadv, which only the Python pipeline calls
        monkeypatch.setitem(native_restore.LOOP.state, "fn", None)
    pool, lay = make_pool("mla", "page_first", pages=N)
    cb = lay.geometry.chunk_bytes
    data = write_extent(os.path.join(ext4_dir, "f0"), N, LAYERS, cb, seed=21, base=1000)
    chunks = extent_chunks(data, 0, N, LAYERS, cb, base=1000)
    chunks.tag[:] = chunks.layer * N + chunks.page  # tag = chunk number
    real = os.preadv

    def preadv(fd, bufs, off):  # piece 1 ([4096, 8192) of the file) fails with EIO
        if cut_piece is not None and off == 4096 * cut_piece:
            raise OSError(errno.EIO, "Input/output error")
        return real(fd, bufs, off)

    monkeypatch.setattr(engines_mod.os, "preadv", preadv)
    with engine(ext4_dir, cb, io_workers=4, staging_bytes=16384) as eng:
        assert eng.worker_scatter is True
        rep = eng.restore(chunks, lay)
    # chunk i covers file bytes [1000 + 192 i, 1192 + 192 i): those touching [4096, 8192) fail
    lost = set() if cut_piece is None else {i for i in range(N * LAYERS)
                                             if 1000 + 192 * i < 8192 and 1192 + 192 * i > 4096}
    assert rep.failed_tags == frozenset(lost)
    if cut_piece is not None:
        assert lost == set(range(16, 38))  # 22 chunks, two of them straddling a piece boundary
    exp = reference("mla", "page_first", N, data, chunks, skip_tags=lost)
    assert torch.equal(kv_bytes(pool), exp)


def test_explicit_kvikio_without_a_cuda_driver_is_a_clear_startup_error(ext4_dir):
    if kvikio_mod.real_cuda_driver():
        pytest.skip("a real CUDA driver is present")
    with pytest.raises(EngineUnavailableError, match="libcuda"):
        RestoreEngine(CioConfig(engine="kvikio"), path_fn(ext4_dir), direct_io=True, chunk_bytes=512)


@pytest.mark.skipif(not triton_available(torch.device("cpu")), reason="needs TRITON_INTERPRET=1 before triton import")
def test_restore_with_triton_scatter_matches_torch(ext4_dir):
    cb = make_pool("mla", "page_first_direct", pages=4)[1].geometry.chunk_bytes
    data = write_extent(os.path.join(ext4_dir, "f0"), 4, 2, cb, seed=20, base=48)
    chunks = extent_chunks(data, 0, 4, 2, cb, base=48)
    out = []
    for impl in ("torch", "triton"):
        pool, lay = make_pool("mla", "page_first_direct", pages=4)
        with engine(ext4_dir, cb, scatter=impl) as eng:
            assert eng.scatter_impl == impl
            assert eng.restore(chunks, lay).failed_tags == frozenset()
        out.append(kv_bytes(pool))
    assert torch.equal(out[0], out[1])
    assert torch.equal(out[0], reference("mla", "page_first_direct", 4, data, chunks))


def test_chunks_without_a_checksum_are_delivered_and_a_bad_sum_withholds_one_layer(ext4_dir):
    pool, lay = make_pool("mha", "page_first", pages=N)
    cb = lay.geometry.chunk_bytes
    data = write_extent(os.path.join(ext4_dir, "f0"), N, LAYERS, cb, seed=41, base=700)
    chunks = extent_chunks(data, 0, N, LAYERS, cb, base=700)
    k = int(np.flatnonzero((chunks.page == 3) & (chunks.layer == 1))[0])
    chunks.checksum[k] ^= np.uint64(1)  # bad sum
    chunks.has_checksum[0] = False  # no sum
    with engine(ext4_dir, cb, staging_bytes=8192, max_io_bytes=8192) as eng:
        rep = eng.restore(chunks, lay)
    assert rep.failed_tags == frozenset({3})
    # only the (page 3, layer 1) chunk is withheld: the page's other layers were delivered
    assert torch.equal(kv_bytes(pool), reference("mha", "page_first", N, data, subset(chunks, np.arange(len(chunks)) != k)))
    with engine(ext4_dir, cb) as eng:
        with pytest.raises(ValueError, match="outside layout"):
            eng.restore(ChunkBatch([0], [0], [N], [0], [5], cb), lay)
        with pytest.raises(ValueError, match="nbytes"):
            eng.restore(ChunkBatch([0, 0], [0, cb], [0, 1], [0, 0], [5, 6], [cb, cb + 1]), lay)


def test_reads_only_mode_reads_the_plan_into_staging_and_leaves_the_layout_alone(ext4_dir):
    pool, lay = make_pool("mha", "page_first", pages=N)
    cb = lay.geometry.chunk_bytes
    data = write_extent(os.path.join(ext4_dir, "f0"), N, LAYERS, cb, seed=42)
    chunks = extent_chunks(data, 0, N, LAYERS, cb)
    chunks.checksum[:] ^= np.uint64(1)  # every sum wrong: reads-only never checks them
    pool.kv_buffer.view(torch.uint8).fill_(0x5A)
    with engine(ext4_dir, cb, windows=1, staging_bytes=N * LAYERS * cb, max_io_bytes=N * LAYERS * cb) as eng:
        rep = eng.restore(chunks, lay, scatter=False)
        with eng.window() as win:
            staged = bytes(win.buffers[0].array[: N * LAYERS * cb])
    assert (rep.failed_tags, rep.merged_reads, rep.bytes_read) == (frozenset(), 1, N * LAYERS * cb)
    assert staged == data.tobytes()
    assert bool((pool.kv_buffer.view(torch.uint8) == 0x5A).all())
