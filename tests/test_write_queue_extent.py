"""A deferred round that opens an extent (write queue; docs/performance.md "The busy-thread ratio
is GIL hand-offs"): the extent header travels in the round's first data write."""

import os

import numpy as np
import pytest
from flatcake_testkit import make_store, page_matches, put_pages

from flatcake import native_write

BACKLOG = {"ssd.write_backlog_bytes": 64 << 20}


def keys_of(name: str, n: int = 2) -> list[str]:
    return [f"{name}{i}" for i in range(n)]


@pytest.mark.parametrize("native", [False, True])
def test_a_deferred_round_opening_an_extent_writes_the_extent_header_with_its_first_piece(ssd_dir, monkeypatch,
                                                                                          native):
    # the extent header block sits right before the round header: one write carries both, the
    # record still comes last (Python loop: its own write; C piece loop: its last piece); on
    # disk the header is where a warm restart looks for it
    from flatcake.media import extent as fmt

    if not native:
        monkeypatch.setitem(native_write.LOOP.state, "fn", None)
    elif native_write.LOOP.fn() is None:
        pytest.skip("extension not built")
    store, pool, lay = make_store(ssd_dir, **BACKLOG)
    calls = []
    real = store.ssd.write

    def write(file_index, offset, buf, generation=None, pwrite=None):
        calls.append((file_index, offset, len(buf), bytes(memoryview(buf)[:8])))
        return real(file_index, offset, buf, generation, pwrite)

    store.ssd.write = write
    assert put_pages(store, pool, lay, keys_of("eh", 3), [0, 1, 2]) == [True] * 3
    assert store.flush_writes(30)
    info = store.page_info("eh0")
    f, first = calls[0][0], calls[0][1]
    assert calls[0][3] == fmt.EXTENT_MAGIC and calls[0][2] > fmt.BLOCK  # header + round in one write
    assert all(c[0] == f and c[1] > first for c in calls[1:]) and len(calls) == 1 + (not native)  # the record
    with open(store.ssd.path_of(f), "rb") as fh:
        fh.seek(first)
        hdr = fmt.unpack_extent_header(fh.read(fmt.BLOCK))
    assert hdr is not None and info.file_index == f
    assert store.get(keys_of("eh", 3), lay, [10, 11, 12]) == [True] * 3
    assert all(page_matches(pool, (10 + i) * pool.page_size, k) for i, k in enumerate(keys_of("eh", 3)))
    store.close()
    store2, pool2, lay2 = make_store(ssd_dir, **BACKLOG)  # warm restart finds the extent and its round
    assert store2.get(keys_of("eh", 3), lay2, [0, 1, 2]) == [True] * 3
    assert all(page_matches(pool2, i * pool2.page_size, k) for i, k in enumerate(keys_of("eh", 3)))
    store2.close()


def test_the_c_piece_loop_writes_in_order_and_stops_between_pieces_while_a_restore_reads(tmp_path):
    if native_write.LOOP.fn() is None:
        pytest.skip("extension not built")
    data = np.random.default_rng(5).integers(0, 256, size=5 * 4096 + 100, dtype=np.uint8)
    readers = np.ones(1, dtype=np.int64)  # a restore in flight from the start
    pauses = []

    def between():
        pauses.append(readers[0])
        readers[0] = 0  # the restore ended

    off = 8192
    pw = native_write.piece_writer([off + 4096, off + 3 * 4096], readers, between)
    fd = os.open(tmp_path / "f", os.O_RDWR | os.O_CREAT, 0o600)
    try:
        mv = memoryview(data)
        assert pw(fd, mv, off) == 4096 and pauses == [1]  # the first piece, then the pause
        assert pw(fd, mv[4096:], off + 4096) == data.shape[0] - 4096 and pauses == [1]  # the rest at once
        with open(tmp_path / "f", "rb") as fh:
            fh.seek(off)
            assert fh.read() == data.tobytes()
        with pytest.raises(OSError) as e:
            pw(-1, mv, off)
        assert e.value.errno == 9  # EBADF: the errno of the failed pwrite
    finally:
        os.close(fd)
