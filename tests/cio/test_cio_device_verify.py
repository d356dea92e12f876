"""The GPU restore's verify step (device checksums checked where the chunks landed, only a mask
back; ``flatcake.cio.batch.verify_chunks_device``) run through a real FC-CIO restore on CPU:
``verify_in_place`` on, worker-side scatter off, so every chunk takes the path HBM staging takes."""

import os

import numpy as np
import torch
from cio_util import LAYERS, extent_chunks, kv_bytes, make_pool, path_fn, reference, write_extent

from flatcake.cio import ChunkBatch, RestoreEngine
from flatcake.config import CioConfig
from flatcake.kernels.fcds_native import fcds_host_at

N = 16


def with_devsums(c: ChunkBatch, data: np.ndarray, cb: int, v2_tags=()) -> ChunkBatch:
    """``c`` with device checksums from ``data`` (record v3), except pages ``v2_tags`` (record v2)."""
    has = ~np.isin(c.tag, list(v2_tags))
    return ChunkBatch(c.file_index, c.offset, c.page, c.layer, c.tag, cb, checksum=c.checksum,
                      devsum=np.where(has, fcds_host_at(data, c.offset, cb), 0), has_devsum=has)


def restore_in_place(d, cb, chunks, lay):
    with RestoreEngine(CioConfig(io_workers=2, staging_bytes=32768), path_fn(d), direct_io=True, chunk_bytes=cb,
                       max_pages_per_restore=N) as eng:
        eng.verify_in_place, eng.worker_scatter = True, False
        return eng.restore(chunks, lay), eng.device_verify.d2h_bytes


def test_in_place_verify_restores_bit_exact_and_catches_a_corrupted_chunk(ext4_dir):
    pool, lay = make_pool("mha", "page_first", pages=N)
    cb = lay.geometry.chunk_bytes
    path = os.path.join(ext4_dir, "f0")
    data = write_extent(path, N, LAYERS, cb, seed=4)
    chunks = with_devsums(extent_chunks(data, 0, N, LAYERS, cb), data, cb, v2_tags=[3])
    rep, d2h = restore_in_place(ext4_dir, cb, chunks, lay)
    assert rep.failed_tags == frozenset() and d2h == 0  # host staging: nothing counted as D2H
    assert torch.equal(kv_bytes(pool), reference("mha", "page_first", N, data, chunks))
    bad = data.copy()  # a stale / torn chunk on disk: page 6 layer 1 (device checksum), page 3 layer 2 (xxh3)
    bad[(1 * N + 6) * cb + 10] ^= 0x01
    bad[(2 * N + 3) * cb + cb - 1] ^= 0x80
    bad.tofile(path)
    pool2, lay2 = make_pool("mha", "page_first", pages=N)
    rep, _ = restore_in_place(ext4_dir, cb, chunks, lay2)
    assert rep.failed_tags == frozenset({6, 3})
    got = kv_bytes(pool2)
    # every chunk but the two failed ones was delivered bit-exact; the two failed slots kept zeros
    failed = ((chunks.tag == 6) & (chunks.layer == 1)) | ((chunks.tag == 3) & (chunks.layer == 2))
    keep = ChunkBatch(*(getattr(chunks, f)[~failed] for f in ("file_index", "offset", "page", "layer", "tag")), cb)
    assert torch.equal(got, reference("mha", "page_first", N, bad, keep))
    assert not torch.equal(got, reference("mha", "page_first", N, bad, chunks))
