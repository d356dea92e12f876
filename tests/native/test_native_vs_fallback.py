"""The built extension and the forced fallbacks give the same bits (issue 25): checksums of odd
sizes at misaligned offsets, and pages written with every C loop and read back with every
fallback (and the reverse) through a store with its write queue, bit for bit. Each loop's own
bit-exactness test (tests/cio/, tests/kernels/, tests/test_write_queue.py) also runs it
both ways; here the two sides meet on the same pool files."""

from __future__ import annotations

import numpy as np
import pytest
import xxhash
from flatcake_testkit import fill_page, make_store, page_matches, put_pages

from flatcake.native import loops as native_loop

from flatcake.store import native_write
from flatcake.cio import native_gather, native_restore, native_zero_copy, xxh3_bulk
from flatcake.kernels import fcds_native
from flatcake.kernels.device_checksum import fcds_numpy

ALL = (native_restore.LOOP, native_restore.PLAN, native_zero_copy.LOOP, native_gather.LOOP, native_write.LOOP,
       xxh3_bulk.LOOP, fcds_native.LOOP)
pytestmark = pytest.mark.skipif(native_loop.library()[0] is None, reason="the extension is not built")


def force_fallback(m: pytest.MonkeyPatch) -> None:
    for loop in ALL:
        m.setitem(loop.state, "fn", None)


@pytest.mark.parametrize("cb", [1, 3, 4, 5, 63, 4097, 32771])
def test_checksums_of_the_extension_and_the_fallbacks_agree(cb, monkeypatch):
    raw = np.frombuffer(np.random.default_rng(cb).bytes((1 << 17) + 1), dtype=np.uint8)
    host = raw[1:]  # a misaligned buffer
    n = host.shape[0]
    starts = [0, 1, 3, n - cb, (n - cb) // 2 | 1]
    assert xxh3_bulk.native() and fcds_native.native()
    sums, dev = xxh3_bulk.xxh3_at(host, starts, cb), fcds_native.fcds_host_at(host, starts, cb)
    with monkeypatch.context() as m:
        force_fallback(m)
        assert not xxh3_bulk.native() and not fcds_native.native()
        assert xxh3_bulk.xxh3_at(host, starts, cb).tolist() == sums.tolist()
        assert fcds_native.fcds_host_at(host, starts, cb).tolist() == dev.tolist()
    assert sums.tolist() == [xxhash.xxh3_64_intdigest(host[s: s + cb].tobytes()) for s in starts]
    assert dev.tolist() == fcds_numpy(host, np.array(starts, dtype=np.int64), cb).tolist()


@pytest.mark.parametrize("layout", ["page_first", "layer_first"])
@pytest.mark.parametrize("write_native", [True, False])
def test_pages_written_by_one_side_are_read_bit_exact_by_the_other(ssd_dir, monkeypatch, layout, write_native):
    store, pool, lay = make_store(ssd_dir, layout=layout, **{"ssd.write_backlog_bytes": 64 << 20})
    keys = [f"{layout}-{write_native}-{i}" for i in range(8)]
    try:
        with monkeypatch.context() as m:
            if not write_native:
                force_fallback(m)
            assert (native_write.LOOP.fn() is not None) is write_native
            assert put_pages(store, pool, lay, keys, range(8)) == [True] * 8
            assert store.flush_writes(60)
        with monkeypatch.context() as m:
            if write_native:
                force_fallback(m)
            assert (native_restore.LOOP.fn() is not None) is not write_native
            first = 16
            for i in range(8):  # sentinels first: a page not restored keeps them
                fill_page(pool, (first + i) * pool.page_size, f"sentinel{i}")
            assert store.get(keys, lay, list(range(first, first + 8))) == [True] * 8
            assert all(page_matches(pool, (first + i) * pool.page_size, k) for i, k in enumerate(keys))
            assert store.snapshot_stats()["hit_pages_ssd"] == 8  # read from the pool files
    finally:
        store.close()
