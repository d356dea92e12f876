"""The one-call restore's C plan (flatcake/cio/native_plan_c.py) builds the same arrays, in the
same order, as the Python plan (plan_reads + batch_reads + StagingBatch.build)."""

from types import SimpleNamespace

import numpy as np
import pytest
import torch

from flatcake.cio import engines as engines_mod
from flatcake.cio import native_restore
from flatcake.cio.plan import ChunkBatch

pytestmark = pytest.mark.skipif(native_restore.LOOP.fn() is None, reason="extension not built: the Python pipeline runs")

KEYS = ("pfile", "poff", "plen", "paddr", "pbatch", "left", "bbase", "own_lo", "rest_lo", "rest_hi", "cb0", "cidx",
        "ck0", "ck1")


def native(cb, gap, max_io, staging, workers):
    eng = SimpleNamespace(cfg=SimpleNamespace(gap_bytes=gap, io_workers=workers), max_io_bytes=max_io,
                          staging_bytes=staging, chunk_bytes=cb)
    return native_restore.NativeRestore(eng, posix=None)


def random_chunks(rng, n, cb, files, spread):
    slots = rng.choice(spread, size=n, replace=n > spread)  # repeats: duplicate descriptors
    off = slots * cb + rng.integers(0, 3, size=n) * 512 * (cb % 4096 != 0)
    return ChunkBatch(file_index=rng.integers(0, files, size=n), offset=off, page=rng.integers(0, 50, size=n),
                      layer=rng.integers(0, 6, size=n), tag=rng.permutation(n), nbytes=cb)


@pytest.mark.parametrize("seed", range(24))
def test_c_plan_arrays_equal_the_python_plan(monkeypatch, seed):
    rng = np.random.default_rng(seed)
    monkeypatch.setattr(engines_mod, "MIN_PIECE_BYTES", int(rng.choice([4096, 8192, 8 << 20])))
    cb = int(rng.choice([1536, 4096, 6000, 12288, 24576]))
    max_io = int(rng.choice([4096, 16384, 65536, 1 << 20]))
    nr = native(cb, gap=int(rng.choice([0, 2048, 65536])), max_io=max_io,
                staging=max(max_io, align_up(cb) + 4096) * int(rng.integers(1, 5)), workers=int(rng.integers(1, 5)))
    chunks = random_chunks(rng, int(rng.integers(1, 700)), cb, files=int(rng.integers(1, 4)),
                           spread=int(rng.integers(4, 900)))
    bufs = [SimpleNamespace(tensor=torch.empty(8, dtype=torch.uint8)) for _ in range(2)]
    got = nr.plan_arrays(chunks, [b.tensor.data_ptr() for b in bufs])
    want = nr.reference_arrays(chunks, bufs, layout=None)
    assert got is not None and got["nb"] == want["nb"] >= 1
    assert (got["reads"], got["bytes_read"]) == (want["reads"], want["bytes_read"])
    for k in KEYS:
        assert np.array_equal(got[k], want[k]), k
    assert got["cstatus"].tolist() == [1] * len(chunks)  # nothing delivered until the run says so
    assert sorted(got["cidx"].tolist()) == list(range(len(chunks)))  # every chunk exactly once


def align_up(n):
    return -(-n // 4096) * 4096


def test_c_plan_refuses_what_the_python_plan_raises_on():
    nr = native(4096, gap=0, max_io=8192, staging=8192, workers=2)
    bad = ChunkBatch(file_index=[0, 0], offset=[0, -4096], page=[0, 1], layer=[0, 0], tag=[0, 1], nbytes=4096)
    assert nr.plan_arrays(bad, [0, 0]) is None
    big = native(16384, gap=0, max_io=16384, staging=8192, workers=2)  # a read over the staging buffer
    one = ChunkBatch(file_index=[0], offset=[0], page=[0], layer=[0], tag=[0], nbytes=16384)
    assert big.plan_arrays(one, [0, 0]) is None
