"""One-call gather + hash of a round (flatcake.cio.native_gather): the bytes and both checksums
of the numpy gather and the hash loops, bit for bit."""

import numpy as np
import pytest
import torch

from cio_util import LAYERS, make_pool
from flatcake.cio import native_gather
from flatcake.cio.pagecopy import chunk_checksums, gather_layers
from flatcake.kernels.fcds_native import fcds_host_chunks

pytestmark = pytest.mark.skipif(native_gather.LOOP.fn() is None, reason="extension not built: the numpy path runs")


@pytest.mark.parametrize("kind", ["mha", "mla"])
@pytest.mark.parametrize("layout", ["layer_first", "page_first", "page_first_direct"])
def test_gather_and_hash_matches_numpy_gather_and_the_hash_loops(kind, layout):
    pool, lay = make_pool(kind, layout, pages=24)
    g = torch.Generator().manual_seed(7)
    kv = pool.kv_buffer.view(torch.uint8)
    kv.copy_(torch.randint(0, 256, kv.shape, dtype=torch.uint8, generator=g))
    ids = np.array([5, 6, 7, 20, 0, 13], dtype=np.int64)  # a run, then scattered pages
    cb, n = lay.geometry.chunk_bytes, len(ids)
    out = np.full(LAYERS * n * cb, 0xEE, dtype=np.uint8)
    sums, dev = native_gather.gather_and_hash(lay, ids, out)
    ref = torch.zeros((LAYERS, n, cb), dtype=torch.uint8)
    gather_layers(lay, ids, 0, LAYERS, ref)
    ref_np = ref.numpy().reshape(-1)
    assert np.array_equal(out, ref_np)
    assert np.array_equal(sums.reshape(-1), chunk_checksums(ref_np, cb))
    assert np.array_equal(dev.reshape(-1), fcds_host_chunks(ref_np, cb))


def test_gather_and_hash_refuses_a_page_outside_the_layout_before_copying():
    pool, lay = make_pool("mha", "page_first", pages=4)
    out = np.zeros(LAYERS * 2 * lay.geometry.chunk_bytes, dtype=np.uint8)
    with pytest.raises(IndexError):
        native_gather.gather_and_hash(lay, [1, 4], out)
    assert not out.any()
    with pytest.raises(ValueError):
        native_gather.gather_and_hash(lay, [1], out)
