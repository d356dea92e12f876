"""The SSD write path's pipelined slabs (flatcake.store.write_path._write_data): a round written as
several 4 KiB-aligned slab writes reads back bit-exact with verified checksums, and a slab
write that fails is a failed put that publishes nothing."""

from __future__ import annotations

import errno

import pytest

import flatcake.store.write_path as write_path_mod
from flatcake.media.errors import ShortWrite
from tests import flatcake_testkit as testkit
from tests.flatcake_testkit import page_matches, put_pages


def make_store(ssd_dir, **kw):
    """``testkit.make_store`` with synchronous SSD writes (``ssd.write_backlog_bytes: 0``): these tests
    are about the synchronous write path itself (WritePath slabs and faults), which the write queue
    bypasses."""
    return testkit.make_store(ssd_dir, **{"ssd.write_backlog_bytes": 0, **kw})


@pytest.fixture
def small_slabs(monkeypatch):
    monkeypatch.setattr(write_path_mod, "PIPELINE_BYTES", 4096)  # one layer per slab here


@pytest.mark.parametrize("mla", [False, True])
def test_a_round_written_in_slabs_reads_back_bit_exact(ssd_dir, small_slabs, mla):
    store, pool, lay = make_store(ssd_dir, mla=mla, **{"cio.verify_checksums": True})
    try:
        keys = [f"p{i}" for i in range(6)]
        assert put_pages(store, pool, lay, keys, range(6)) == [True] * 6
        st = store.snapshot_stats()
        g = store.geometry
        slab = 6 * g.chunk_bytes
        step = max(1, 4096 // slab)  # whole layers per slab
        cuts = sorted({(4096 + l1 * slab) // 4096 * 4096 for l1 in range(step, g.layers, step)} - {0})
        assert len(cuts) == (0 if mla else 2)  # MLA: 3 layers of 1152 B fit one slab; MHA: 3 KiB a layer
        # extent header + one write per slab cut before the last layer + the rest of the data + record
        assert st["ssd_write_ops"] == 1 + len(cuts) + 1 + 1
        pool.kv_buffer.view(-1).zero_()
        assert store.get(keys, lay, [10, 11, 12, 13, 14, 15]) == [True] * 6
        assert all(page_matches(pool, (10 + i) * pool.page_size, k) for i, k in enumerate(keys))
    finally:
        store.close()


def test_a_failed_slab_write_fails_the_put_and_publishes_nothing(ssd_dir, small_slabs):
    store, pool, lay = make_store(ssd_dir)
    real = store.ssd.write
    calls = []

    def flaky(file_index, offset, buf, generation=None):
        calls.append(offset)
        if len(calls) == 3:  # extent header, first slab, then this slab (on the write thread)
            raise ShortWrite(errno.EIO, "short write", "pool file")
        return real(file_index, offset, buf, generation)

    store.ssd.write = flaky
    try:
        keys = [f"f{i}" for i in range(6)]
        assert put_pages(store, pool, lay, keys, range(6)) == [False] * 6
        assert len(calls) >= 3 and not any(store.exists(k) for k in keys)
        assert store.snapshot_stats()["put_failures"] == 1
        store.ssd.write = real
        assert put_pages(store, pool, lay, keys, range(6)) == [True] * 6
        pool.kv_buffer.view(-1).zero_()
        assert store.get(keys, lay, range(6)) == [True] * 6
        assert all(page_matches(pool, i * pool.page_size, k) for i, k in enumerate(keys))
    finally:
        store.close()
