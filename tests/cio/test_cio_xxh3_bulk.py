"""flatcake.cio.xxh3_bulk: the GIL-free checksum loop gives exactly xxhash.xxh3_64_intdigest, as
does its pure-Python fallback (the on-disk checksums must not depend on which one ran)."""

from __future__ import annotations

import shutil

import numpy as np
import pytest
import xxhash

from flatcake.cio import xxh3_bulk

SIZES = [1, 7, 64, 240, 241, 1152, 2048, 32768]


def _want(buf: np.ndarray, starts, cb: int) -> list[int]:
    return [xxhash.xxh3_64_intdigest(buf[s: s + cb].tobytes()) for s in starts]


@pytest.fixture
def buf() -> np.ndarray:
    return np.frombuffer(np.random.default_rng(7).bytes(1 << 20), dtype=np.uint8)


@pytest.mark.parametrize("cb", SIZES)
def test_native_loop_is_bit_exact_with_xxhash(buf, cb):
    starts = np.random.default_rng(cb).integers(0, buf.shape[0] - cb, 300)  # unaligned offsets
    got = xxh3_bulk.xxh3_at(buf, starts, cb)
    assert got.dtype == np.uint64 and got.tolist() == _want(buf, starts.tolist(), cb)


def test_native_loop_is_used_where_a_compiler_is(buf):
    assert xxh3_bulk.native() is (shutil.which("cc") is not None or shutil.which("gcc") is not None)


@pytest.mark.parametrize("cb", [241, 2048])
def test_python_fallback_gives_the_same_sums(buf, cb, monkeypatch):
    starts = list(range(0, 64 * cb, cb))
    native = xxh3_bulk.xxh3_at(buf, starts, cb).tolist()
    monkeypatch.setitem(xxh3_bulk.LOOP.state, "fn", None)
    assert xxh3_bulk.native() is False
    assert xxh3_bulk.xxh3_at(buf, starts, cb).tolist() == native == _want(buf, starts, cb)


def test_offsets_outside_the_buffer_are_refused(buf):
    with pytest.raises(ValueError):
        xxh3_bulk.xxh3_at(buf, [buf.shape[0] - 10], 64)
    with pytest.raises(ValueError):
        xxh3_bulk.xxh3_at(buf, [-1], 64)
    assert xxh3_bulk.xxh3_at(buf, [], 64).shape == (0,)


@pytest.mark.parametrize("native", [True, False])
def test_xxh3_copy_copies_exactly_the_matching_chunks(buf, monkeypatch, native):
    # fused check and copy (remote reads): unaligned chunks out of order, one torn
    if not native:
        monkeypatch.setitem(xxh3_bulk.LOOP.state, "fn", None)
    cb, k = 1152, 40
    starts = np.random.default_rng(3).permutation(k) * cb + 5
    want = np.array(_want(buf, starts.tolist(), cb), dtype=np.uint64)
    want[7] ^= np.uint64(1)
    dst = np.zeros(k * cb + 64, dtype=np.uint8)
    at = np.arange(k, dtype=np.int64)[::-1] * cb + 64
    state = xxh3_bulk.xxh3_copy(buf, starts, cb, want, dst, at)
    assert state.dtype == np.int8 and state.tolist() == [1] * 7 + [-1] + [1] * (k - 8)
    for i in range(k):
        got = dst[at[i]: at[i] + cb]
        assert (not got.any()) if i == 7 else got.tobytes() == buf[starts[i]: starts[i] + cb].tobytes()
    assert not dst[:64].any()
    with pytest.raises(ValueError):
        xxh3_bulk.xxh3_copy(buf, starts, cb, want, dst, at + cb)  # last destination past the end
    with pytest.raises(ValueError):
        xxh3_bulk.xxh3_copy(buf, starts, cb, want[:-1], dst, at)


def test_bad_buffers_and_sizes_are_refused_before_any_byte_moves(buf):
    # a negative or zero chunk size, a read-only or non-uint8 destination, a 2-D buffer:
    # ValueError on both paths, never a crash of the C loop
    dst = np.zeros(4096, dtype=np.uint8)
    want = np.zeros(1, dtype=np.uint64)
    for cb in (-1, 0):
        with pytest.raises(ValueError, match="chunk_bytes"):
            xxh3_bulk.xxh3_at(buf, [10], cb)
        with pytest.raises(ValueError, match="chunk_bytes"):
            xxh3_bulk.xxh3_copy(buf, [10], cb, want, dst, [0])
    ro = np.frombuffer(bytes(4096), dtype=np.uint8)
    with pytest.raises(ValueError, match="read-only"):
        xxh3_bulk.xxh3_copy(buf, [0], 64, want, ro, [0])
    with pytest.raises(ValueError, match="uint8"):
        xxh3_bulk.xxh3_copy(buf, [0], 64, want, np.zeros(2048, dtype=np.uint16), [0])
    with pytest.raises(ValueError, match="uint8"):
        xxh3_bulk.xxh3_at(buf.view(np.uint32), [0], 64)
    with pytest.raises(ValueError, match="uint8"):
        xxh3_bulk.xxh3_at(buf.reshape(1024, 1024), [0], 64)
    assert not ro.any() and not dst.any()
