"""The one-call C restore (flatcake.cio.native_restore): same bytes, same failures as the
Python pipeline, with one GIL-free call per restore (issue 11, docs/performance.md)."""

import logging
import os

import numpy as np
import pytest
import torch

from cio_util import (LAYERS, concat, extent_chunks, kv_bytes, make_pool, path_fn, reference, subset,
                      write_extent)
from flatcake.cio import RestoreEngine
from flatcake.cio import engines as engines_mod
from flatcake.cio import native_restore
from flatcake.config import CioConfig

N = 16

pytestmark = pytest.mark.skipif(native_restore.LOOP.fn() is None, reason="extension not built: the Python pipeline runs")


def engine(d, cb, direct_io=True, **cfg):
    kw = dict(io_workers=3)
    kw.update(cfg)
    return RestoreEngine(CioConfig(**kw), path_fn(d), direct_io=direct_io, chunk_bytes=cb, max_pages_per_restore=N)


@pytest.fixture
def calls(monkeypatch):
    """Counts restores the C call served (``None`` results, i.e. Python fallbacks, not counted)."""
    seen = []
    real = native_restore.NativeRestore.restore

    def wrapped(self, chunks, layout):
        rep = real(self, chunks, layout)
        if rep is not None:
            seen.append(rep)
        return rep

    monkeypatch.setattr(native_restore.NativeRestore, "restore", wrapped)
    return seen


@pytest.mark.parametrize("streaming", [True, False])
@pytest.mark.parametrize("kind", ["mha", "mla"])
@pytest.mark.parametrize("layout", ["layer_first", "page_first", "page_first_direct"])
def test_one_call_restore_matches_the_python_pipeline_bit_for_bit(ext4_dir, monkeypatch, calls, kind, layout,
                                                                  streaming):
    # 4 KiB pieces, an odd base and small staging buffers: several batches over both buffers,
    # chunks owned by one piece and chunks straddling two, non-contiguous destination pages;
    # MHA's 64 B rows take the streaming stores (when on), MLA's 48 B rows memcpy
    monkeypatch.setattr(engines_mod, "MIN_PIECE_BYTES", 4096)
    monkeypatch.setattr(native_restore, "STREAMING_STORES", streaming)
    M = 64  # pages: enough bytes for several 8 KiB batches with either kind
    out = {}
    for native in (True, False):
        pool, lay = make_pool(kind, layout, pages=2 * M)
        cb = lay.geometry.chunk_bytes
        data = write_extent(os.path.join(ext4_dir, "f0"), M, LAYERS, cb, seed=31, base=1000, tail=99)
        dst = [2 * M - 1 - 2 * i for i in range(M)]
        chunks = extent_chunks(data, 0, M, LAYERS, cb, base=1000, pages=dst)
        with monkeypatch.context() as m:
            if not native:
                m.setitem(native_restore.LOOP.state, "fn", None)
            with engine(ext4_dir, cb, staging_bytes=8192) as eng:
                rep = eng.restore(chunks, lay)
        assert rep.failed_tags == frozenset() and rep.batches >= 3
        out[native] = kv_bytes(pool)
        assert torch.equal(out[native], reference(kind, layout, 2 * M, data, chunks))
    assert len(calls) == 1 and calls[0].io_requests > calls[0].batches  # the native run took the C call
    assert torch.equal(out[True], out[False])


def test_read_error_in_the_c_call_fails_only_that_files_chunks_logged_once(ext4_dir, calls, caplog):
    pool, lay = make_pool("mha", "page_first", pages=N)
    cb = lay.geometry.chunk_bytes
    data = write_extent(os.path.join(ext4_dir, "f0"), N, LAYERS, cb, seed=32)
    os.mkdir(os.path.join(ext4_dir, "f1"))  # opens, but every read of it fails (EISDIR)
    good = extent_chunks(data, 0, N, LAYERS, cb)
    bad = extent_chunks(data, 1, N, LAYERS, cb)
    bad.tag[:] += 100
    keep = good.page >= 4
    chunks = concat(subset(good, keep), subset(bad, bad.page < 4))  # pages 0-3 from the directory
    with caplog.at_level(logging.WARNING, logger="flatcake.cio"):
        with engine(ext4_dir, cb, direct_io=False) as eng:
            rep = eng.restore(chunks, lay)
            assert eng.errors.count >= 1
    os.rmdir(os.path.join(ext4_dir, "f1"))
    assert len(calls) == 1
    assert rep.failed_tags == frozenset({100, 101, 102, 103})
    assert sum("EISDIR" in r.getMessage() for r in caplog.records) == 1
    assert torch.equal(kv_bytes(pool), reference("mha", "page_first", N, data, subset(good, keep)))


def test_checksum_mismatch_and_short_file_in_one_call(ext4_dir, calls, caplog):
    pool, lay = make_pool("mla", "layer_first", pages=N)
    cb = lay.geometry.chunk_bytes
    data = write_extent(os.path.join(ext4_dir, "f0"), N, LAYERS, cb, seed=33)
    chunks = extent_chunks(data, 0, N, LAYERS, cb)
    k = int(np.flatnonzero((chunks.page == 3) & (chunks.layer == 0))[0])
    chunks.checksum[k] ^= np.uint64(1)
    cut = (LAYERS - 1) * N * cb + 10 * cb + 7  # the file ends inside page 10 of the last layer
    os.truncate(os.path.join(ext4_dir, "f0"), cut)
    with caplog.at_level(logging.WARNING, logger="flatcake.cio"):
        with engine(ext4_dir, cb) as eng:
            rep = eng.restore(chunks, lay)
    assert len(calls) == 1
    assert rep.failed_tags == frozenset({3} | set(range(10, N)))
    msgs = " ".join(r.getMessage() for r in caplog.records)
    assert "checksum" in msgs and "short read" in msgs
    ok = np.ones(len(chunks), bool)
    ok[k] = False
    ok &= ~((chunks.layer == LAYERS - 1) & (chunks.page >= 10))
    exp = reference("mla", "layer_first", N, data, subset(chunks, ok))
    assert torch.equal(kv_bytes(pool), exp)


def test_shared_fds_of_a_forgotten_file_close_after_the_last_restore_released_them(ext4_dir):
    write_extent(os.path.join(ext4_dir, "f0"), 1, 1, 4096, seed=34)
    eng = engines_mod.PosixEngine(path_fn(ext4_dir), 1, direct_io=False, errors=None)
    try:
        fds = eng.shared_fds([0, 7])
        fd = fds[0][0]
        assert fd >= 0 and fds[7][0] == -1 and fds[7][1] == 2  # f7 does not exist: ENOENT
        eng.forget_file(0)  # the file is replaced while a restore holds its fd: not closed yet
        os.fstat(fd)
        eng.release_shared()
        with pytest.raises(OSError):
            os.fstat(fd)
        assert eng.shared_fds([0])[0][0] >= 0  # reopened on the next restore
        eng.release_shared()
    finally:
        eng.close()


@pytest.mark.parametrize("policy,idle", [("idle", 3), ("normal", 0)])
def test_thread_policy_idle_runs_every_reader_in_sched_idle_and_leaves_the_caller_as_it_was(
        ext4_dir, monkeypatch, policy, idle):
    # cio.thread_policy idle: all io_workers (3) are new threads switched to SCHED_IDLE (SGLang's
    # scheduler thread takes their core at once when it wakes); the calling thread only waits
    seen = []
    real = native_restore.NativeRestore.restore

    def wrapped(self, chunks, layout):
        rep = real(self, chunks, layout)
        seen.append((rep, self.idle_threads, os.sched_getscheduler(0)))
        return rep

    monkeypatch.setattr(native_restore.NativeRestore, "restore", wrapped)
    monkeypatch.setattr(engines_mod, "MIN_PIECE_BYTES", 4096)
    pool, lay = make_pool("mha", "layer_first", pages=N)
    cb = lay.geometry.chunk_bytes
    data = write_extent(os.path.join(ext4_dir, "f0"), N, LAYERS, cb, seed=35)
    chunks = extent_chunks(data, 0, N, LAYERS, cb)
    before = os.sched_getscheduler(0)
    with engine(ext4_dir, cb, staging_bytes=8192, thread_policy=policy) as eng:
        rep = eng.restore(chunks, lay)
    assert rep.failed_tags == frozenset() and rep.io_requests >= 3
    assert [(s[1], s[2]) for s in seen] == [(idle, before)]
    assert torch.equal(kv_bytes(pool), reference("mha", "layer_first", N, data, chunks))
