"""Zero-copy restores (flatcake.cio.native_zero_copy): pieces read straight into the page slots,
checked in place; the same bytes as the staging path, the same failed tags, nothing written
outside the requested slots (issue 11)."""

import logging
import os

import numpy as np
import pytest
import torch

from cio_util import chunk_batch, concat, extent_chunks, path_fn, rows, subset, write_extent
from flatcake.adapter.host_pool import MHAHostPoolDouble, MLAHostPoolDouble
from flatcake.cio import RestoreEngine
from flatcake.cio import engines as engines_mod
from flatcake.cio import native_restore, native_zero_copy
from flatcake.config import CioConfig
from flatcake.common.layout import KvPageLayout
from flatcake.media.directio import dio_alignment

ZC_FN = native_zero_copy.LOOP.build()[0]  # built here: the mode is off unless FLATCAKE_ZERO_COPY=1
pytestmark = pytest.mark.skipif(ZC_FN is None, reason="extension not built, or no streaming XXH3")


@pytest.fixture(autouse=True)
def zero_copy_on(monkeypatch):
    """Every test here runs with the mode on (as ``FLATCAKE_ZERO_COPY=1``)."""
    monkeypatch.setitem(native_zero_copy.LOOP.state, "fn", ZC_FN)

L, P = 3, 4  # layers, tokens per page: MHA 1 KiB rows (4 KiB planes, 8 KiB chunks), MLA 1 KiB (4 KiB)
BASE = 3 * 4096  # extent start in the file (aligned)


def pool_of(kind, layout, pages, seed=7):
    """A pool whose every byte is noise (the guard bytes), its layout view."""
    pool = MHAHostPoolDouble(pages * P, P, L, 8, 64, layout=layout) if kind == "mha" else \
        MLAHostPoolDouble(pages * P, P, L, 512, layout=layout)
    u8 = pool.kv_buffer.view(torch.uint8)
    u8.copy_(torch.from_numpy(np.random.default_rng(seed).integers(0, 256, u8.numel(), dtype=np.uint8)).view(u8.shape))
    return pool, KvPageLayout.from_host_pool(pool)


def expected(kind, layout, pages, data, chunks, skip_tags=()):
    """The noise pool after delivering ``chunks`` (except ``skip_tags``) from ``data``."""
    pool, lay = pool_of(kind, layout, pages)
    for f, off, nb, page, layer, tag, _ in rows(chunks):
        if tag not in skip_tags:
            d = data[f] if isinstance(data, dict) else data
            lay.scatter_chunks(torch.from_numpy(d[off: off + nb].copy()).view(1, -1), torch.tensor([page]), layer)
    return pool.kv_buffer.view(torch.uint8).clone()


@pytest.fixture
def natives(monkeypatch):
    """The NativeRestore objects that served restores (their ``zero_copy.calls`` counts)."""
    seen = []
    real = native_restore.NativeRestore.restore

    def wrapped(self, chunks, layout):
        seen.append(self)
        return real(self, chunks, layout)

    monkeypatch.setattr(native_restore.NativeRestore, "restore", wrapped)
    return seen


def restore(d, cb, chunks, lay, pages, direct_io=True, **cfg):
    kw = dict(io_workers=3, gap_bytes=3 * 4096)
    kw.update(cfg)
    with RestoreEngine(CioConfig(**kw), path_fn(d), direct_io=direct_io, chunk_bytes=cb,
                       max_pages_per_restore=pages) as eng:
        return eng.restore(chunks, lay)


def holey(data, f, M, cb, pages):
    """Every page but 5, 6 (a 2-chunk hole, bridged) and 20-24 (5 chunks: a new read), in a
    shuffled order, to the destination pages ``pages``."""
    ch = extent_chunks(data, f, M, L, cb, base=BASE, pages=pages)
    keep = ~np.isin(np.arange(len(ch)) % M, [5, 6, 20, 21, 22, 23, 24])
    order = np.random.default_rng(f).permutation(int(keep.sum()))
    return subset(ch, np.flatnonzero(keep)[order])


@pytest.mark.parametrize("kind", ["mha", "mla"])
@pytest.mark.parametrize("layout", ["layer_first", "page_first_direct"])
def test_zero_copy_restore_is_bit_exact_and_writes_only_the_requested_slots(ext4_dir, monkeypatch, natives, kind,
                                                                            layout):
    monkeypatch.setattr(engines_mod, "MIN_PIECE_BYTES", 4096)  # several pieces a read
    M = 40
    pool, lay = pool_of(kind, layout, 3 * M)
    cb = lay.geometry.chunk_bytes
    data = {f: write_extent(os.path.join(ext4_dir, f"f{f}"), M, L, cb, seed=40 + f, base=BASE, tail=4096)
            for f in (0, 1)}
    chunks = concat(holey(data[0], 0, M, cb, [3 * i for i in range(M)]),
                    holey(data[1], 1, M, cb, [3 * i + 1 for i in range(M)]))
    rep = restore(ext4_dir, cb, chunks, lay, 3 * M, gap_bytes=2 * cb + 4096)
    assert rep.failed_tags == frozenset() and rep.batches == 0
    assert natives[-1].zero_copy.calls == 1
    # each file: a layer's pages 25-39 and the next layer's 0-19 are one read: L + 1 reads
    assert rep.io_requests > rep.merged_reads == 2 * (L + 1)
    assert rep.bytes_over_read == 2 * L * 2 * cb  # the bridged 2-chunk holes (pages 5, 6)
    assert torch.equal(pool.kv_buffer.view(torch.uint8), expected(kind, layout, 3 * M, data, chunks))


@pytest.mark.parametrize("layout,zero_copy", [("page_first", True), ("layer_first", False)])
def test_page_first_and_the_env_switch_take_the_staging_path_with_the_same_bytes(ext4_dir, monkeypatch, natives,
                                                                                layout, zero_copy):
    if not zero_copy:
        monkeypatch.setitem(native_zero_copy.LOOP.state, "fn", None)  # as FLATCAKE_ZERO_COPY=0
    M = 24
    pool, lay = pool_of("mha", layout, M)
    cb = lay.geometry.chunk_bytes
    data = write_extent(os.path.join(ext4_dir, "f0"), M, L, cb, seed=50, base=BASE)
    chunks = extent_chunks(data, 0, M, L, cb, base=BASE, pages=list(range(M))[::-1])
    rep = restore(ext4_dir, cb, chunks, lay, M)
    assert rep.failed_tags == frozenset() and rep.batches >= 1
    assert natives[-1].zero_copy.calls == 0
    assert torch.equal(pool.kv_buffer.view(torch.uint8), expected("mha", layout, M, data, chunks))


def test_unaligned_chunk_offsets_fall_back_to_the_staging_path(ext4_dir, natives):
    M = 8
    pool, lay = pool_of("mla", "layer_first", M)
    cb = lay.geometry.chunk_bytes
    data = write_extent(os.path.join(ext4_dir, "f0"), M, L, cb, seed=51, base=1000)
    chunks = extent_chunks(data, 0, M, L, cb, base=1000)
    rep = restore(ext4_dir, cb, chunks, lay, M)
    assert rep.failed_tags == frozenset() and natives[-1].zero_copy.calls == 0
    assert torch.equal(pool.kv_buffer.view(torch.uint8), expected("mla", "layer_first", M, data, chunks))


def test_checksum_mismatch_and_short_file_fail_exactly_their_chunks(ext4_dir, monkeypatch, natives, caplog):
    monkeypatch.setattr(engines_mod, "MIN_PIECE_BYTES", 4096)
    M = 16
    pool, lay = pool_of("mha", "layer_first", M)
    cb = lay.geometry.chunk_bytes
    data = write_extent(os.path.join(ext4_dir, "f0"), M, L, cb, seed=52, base=BASE)
    rs = rows(extent_chunks(data, 0, M, L, cb, base=BASE))
    bad = [i for i, r in enumerate(rs) if r[3] == 3 and r[4] == 0][0]
    rs[bad] = rs[bad][:6] + (rs[bad][6] ^ 1,)
    chunks = chunk_batch(rs)
    os.truncate(os.path.join(ext4_dir, "f0"), BASE + ((L - 1) * M + 10) * cb + 4096)  # ends inside page 10
    with caplog.at_level(logging.WARNING, logger="flatcake.cio"):
        rep = restore(ext4_dir, cb, chunks, lay, M)
    assert natives[-1].zero_copy.calls == 1
    short = {r[5] for r in rs if r[4] == L - 1 and r[3] >= 10}
    assert rep.failed_tags == frozenset({3} | short)  # tags: page positions (layer 0's page 3, last layer's 10-15)
    msgs = " ".join(r.getMessage() for r in caplog.records)
    assert "checksum" in msgs and "short read" in msgs
    ok = [i != bad and not (r[4] == L - 1 and r[3] >= 10) for i, r in enumerate(rs)]
    got, exp = pool.kv_buffer.view(torch.uint8), expected("mha", "layer_first", M, data, subset(chunks, ok))
    # delivered pages exact; a failed chunk's slots are undefined, every other byte exact
    k_view = lambda t: t.view(2, L, M, P * 1024)  # noqa: E731 ([K|V, layer, page, plane bytes])
    fail = torch.zeros(2, L, M, P * 1024, dtype=torch.bool)
    fail[:, 0, 3] = True
    fail[:, L - 1, 10:] = True
    assert torch.equal(k_view(got)[~fail], k_view(exp)[~fail])


def test_io_error_and_missing_file_fail_only_their_files_chunks(ext4_dir, natives, caplog):
    M = 8
    pool, lay = pool_of("mla", "page_first_direct", 3 * M)
    cb = lay.geometry.chunk_bytes
    data = write_extent(os.path.join(ext4_dir, "f0"), M, L, cb, seed=53, base=BASE)
    os.mkdir(os.path.join(ext4_dir, "f1"))  # opens, every read fails (EISDIR); f2 does not exist
    good = extent_chunks(data, 0, M, L, cb, base=BASE)
    bad1 = chunk_batch([(1, o, nb, p + M, la, t + 100, c) for (_, o, nb, p, la, t, c) in rows(good)])
    bad2 = chunk_batch([(2, o, nb, p + 2 * M, la, t + 200, c) for (_, o, nb, p, la, t, c) in rows(good)])
    try:
        with caplog.at_level(logging.WARNING, logger="flatcake.cio"):
            rep = restore(ext4_dir, cb, concat(good, bad1, bad2), lay, 3 * M, direct_io=False)
    finally:
        os.rmdir(os.path.join(ext4_dir, "f1"))
    assert natives[-1].zero_copy.calls == 1
    assert rep.failed_tags == frozenset(range(100, 100 + M)) | frozenset(range(200, 200 + M))
    assert "EISDIR" in " ".join(r.getMessage() for r in caplog.records)
    got, exp = pool.kv_buffer.view(torch.uint8), expected("mla", "page_first_direct", 3 * M, data, good)
    assert torch.equal(got, exp)  # EISDIR / ENOENT: nothing read, so nothing written either


def test_a_piece_of_more_than_iov_max_iovecs_is_read_in_several_calls(ext4_dir, natives):
    M = 200  # 600 MHA chunks in one read and one piece: 1,200 plane iovecs + 3 holes
    pool, lay = pool_of("mha", "page_first_direct", M)
    cb = lay.geometry.chunk_bytes
    data = write_extent(os.path.join(ext4_dir, "f0"), M, L, cb, seed=54, base=BASE)
    chunks = extent_chunks(data, 0, M, L, cb, base=BASE)
    chunks = subset(chunks, (np.arange(len(chunks)) % M) != 7)
    rep = restore(ext4_dir, cb, chunks, lay, M, io_workers=1)
    assert rep.failed_tags == frozenset() and rep.io_requests == 1 and natives[-1].zero_copy.calls == 1
    assert torch.equal(pool.kv_buffer.view(torch.uint8), expected("mha", "page_first_direct", M, data, chunks))


def test_o_direct_refusing_the_pools_memory_turns_zero_copy_off_and_the_staging_path_serves(ext4_dir, monkeypatch,
                                                                                           natives):
    # a pool 64 bytes off a page boundary, declared eligible: O_DIRECT refuses the reads (EINVAL)
    monkeypatch.setattr(native_zero_copy, "eligible", lambda *a: True)
    M = 8
    pool, _ = pool_of("mla", "layer_first", M)
    raw = torch.zeros(pool.kv_buffer.numel() * 2 + 4096, dtype=torch.uint8)
    off = (-raw.data_ptr()) % 4096 + 64
    pool.kv_buffer = raw[off: off + pool.kv_buffer.numel() * 2].view(torch.bfloat16).view(pool.kv_buffer.shape)
    lay = KvPageLayout.from_host_pool(pool)
    cb = lay.geometry.chunk_bytes
    data = write_extent(os.path.join(ext4_dir, "f0"), M, L, cb, seed=55, base=BASE)
    chunks = extent_chunks(data, 0, M, L, cb, base=BASE)
    with RestoreEngine(CioConfig(io_workers=3), path_fn(ext4_dir), direct_io=True, chunk_bytes=cb,
                       max_pages_per_restore=M) as eng:
        reps = [eng.restore(chunks, lay) for _ in range(2)]  # the second one goes straight to staging
    zc = natives[-1].zero_copy
    assert [(r.failed_tags, r.batches >= 1) for r in reps] == [(frozenset(), True)] * 2
    assert zc.calls == 0 and zc.refused
    assert torch.equal(pool.kv_buffer.view(torch.uint8), expected("mla", "layer_first", M, data, chunks))


def _pool_512(kind, layout, pages, seed=7):
    """MLA at 16-token pages (576-dim latent rows: 18,432-byte planes) or MHA at 1-token pages
    (1 KiB planes): planes that are multiples of 512 bytes, not of 4 KiB; every byte noise."""
    pool = MLAHostPoolDouble(pages * 16, 16, L, 576, layout=layout) if kind == "mla16" else \
        MHAHostPoolDouble(pages, 1, L, 8, 64, layout=layout)
    u8 = pool.kv_buffer.view(torch.uint8)
    u8.copy_(torch.from_numpy(np.random.default_rng(seed).integers(0, 256, u8.numel(), dtype=np.uint8)).view(u8.shape))
    return pool, KvPageLayout.from_host_pool(pool)


@pytest.mark.parametrize("kind", ["mla16", "mha1"])
@pytest.mark.parametrize("layout", ["layer_first", "page_first_direct"])
@pytest.mark.parametrize("device_align", [512, 4096])
def test_planes_of_512_byte_multiples_read_straight_into_the_slots_at_a_512_byte_alignment(
        ext4_dir, monkeypatch, natives, kind, layout, device_align):
    """The engine's zero-copy alignment 512 (the C path at the alignment a device without a
    virtual boundary takes; not the default, docs/performance.md): zero copy; 4096 (the
    default): the staging path. The same bytes; slots of pages not requested (every other page,
    and the holes) untouched."""
    if device_align == 512:
        a = dio_alignment(ext4_dir)
        if a != 512:
            pytest.skip(f"the test directory's device needs {a}-byte O_DIRECT alignment, not 512")
    monkeypatch.setattr(engines_mod.PosixEngine, "dio_align", device_align)
    monkeypatch.setattr(engines_mod, "MIN_PIECE_BYTES", 4096)
    M = 40
    pool, lay = _pool_512(kind, layout, 2 * M)
    cb = lay.geometry.chunk_bytes
    assert cb % 512 == 0 and cb % 4096 != 0
    data = write_extent(os.path.join(ext4_dir, "f0"), M, L, cb, seed=60, base=BASE, tail=4096)
    chunks = holey(data, 0, M, cb, [2 * i + 1 for i in range(M)])  # odd pages; even ones are guards
    rep = restore(ext4_dir, cb, chunks, lay, 2 * M, gap_bytes=2 * cb + 4096)
    assert rep.failed_tags == frozenset()
    exp_pool, _ = _pool_512(kind, layout, 2 * M)
    exp_lay = KvPageLayout.from_host_pool(exp_pool)
    for f, off, nb, page, layer, tag, _ in rows(chunks):
        exp_lay.scatter_chunks(torch.from_numpy(data[off: off + nb].copy()).view(1, -1), torch.tensor([page]), layer)
    assert torch.equal(pool.kv_buffer.view(torch.uint8), exp_pool.kv_buffer.view(torch.uint8))
    if device_align == 512:
        assert natives[-1].zero_copy.calls == 1 and rep.batches == 0
        assert rep.merged_reads == L + 1 and rep.bytes_over_read == L * 2 * cb  # bridged pages 5, 6
    else:
        assert natives[-1].zero_copy.calls == 0 and rep.batches >= 1
