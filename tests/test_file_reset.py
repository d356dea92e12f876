"""A pool file removed or truncated behind the backend while readers and writers are inside it:
its pages are misses, never the bytes of whoever is written there next (file generations)."""

import os

import flatcake_testkit as testkit
from flatcake_testkit import page_matches, put_pages

from flatcake.gva.address import OFFSET_MASK
from flatcake.media.errors import StaleGeneration


def make_store(ssd_dir, **kw):
    """``testkit.make_store`` with synchronous SSD writes (``ssd.write_backlog_bytes: 0``): these tests
    are about the synchronous write contract (a put's True means on disk and journaled; a write
    fault fails the put)."""
    return testkit.make_store(ssd_dir, **{"ssd.write_backlog_bytes": 0, **kw})


CFG = {"cio.verify_checksums": False, "ssd.max_files": 1, "ssd.file_bytes": 1 << 20}  # no checksum to save us


def offset_of(store, key):
    return (store.index.get(key).gva & OFFSET_MASK) % store.ssd.file_bytes


def reset_and_refill(store, pool, lay, keys, first_page):
    """Remove pool file 0 behind the store, let the next puts find out (the file is reset and
    recreated) and write ``keys`` into the new file."""
    os.unlink(store.ssd.path_of(0))
    for _ in range(2):  # the first put is the one that finds the file gone
        if put_pages(store, pool, lay, keys, range(first_page, first_page + len(keys))) == [True] * len(keys):
            return
    raise AssertionError("the new file never took the writes")


def test_a_reader_inside_a_scope_whose_file_is_recreated_gets_a_miss_not_the_new_bytes(ssd_dir):
    store, pool, lay = make_store(ssd_dir, **CFG)
    put_pages(store, pool, lay, ["a0", "a1"], [0, 1])
    off = offset_of(store, "a0")
    entries = store.scopes.pin_leading_run(["a0", "a1"])  # a read of a is in flight
    reset_and_refill(store, pool, lay, ["z0", "z1"], 2)
    assert offset_of(store, "z0") == off  # the new scope got the same bytes of the new file
    try:  # the bytes read are z's: reported as a miss (a missed slot's content means nothing)
        assert store.reader.read(["a0", "a1"], entries, lay, [10, 11]) == 0
    finally:
        store.scopes.unpin(entries)
    assert store.get(["z0", "z1"], lay, [12, 13]) == [True, True] and page_matches(pool, 12 * pool.page_size, "z0")
    store.close()


def test_a_round_placed_before_its_file_was_recreated_is_never_written_or_published(ssd_dir):
    store, pool, lay = make_store(ssd_dir, **CFG)
    put_pages(store, pool, lay, ["a0"], [0])
    with store.scopes.lock:  # a put placed its round in file 0 and is about to write it
        plc = store.scopes.place_locked(["late0", "late1"], [4, 5], "a0", 8)
    reset_and_refill(store, pool, lay, ["z0", "z1"], 2)  # meanwhile the file is reset and refilled
    try:
        store.writer.write(plc, lay)
        raise AssertionError("a write under the old generation went through")
    except StaleGeneration:
        pass
    with store.scopes.lock:
        assert store.scopes.commit_locked(plc, [], "a0") is False  # and it is never published
        store.scopes.abort_locked(plc)
    store.scopes.release(plc)
    assert not store.index.contains("late0")
    assert store.get(["z0", "z1"], lay, [12, 13]) == [True, True]
    assert page_matches(pool, 12 * pool.page_size, "z0") and page_matches(pool, 13 * pool.page_size, "z1")
    store.close()


def test_a_write_in_flight_keeps_its_descriptor_when_the_file_is_reset(ssd_dir, tmp_path, monkeypatch):
    store, pool, lay = make_store(ssd_dir, **{"ssd.max_files": 2, "ssd.file_bytes": 1 << 20})
    victim = tmp_path / "unrelated.bin"
    real = os.pwritev
    state = {"done": False}

    def pwritev(fd, bufs, off):
        if not state["done"]:  # between taking the fd and writing, the file is reset ...
            state["done"] = True
            with store.scopes.lock:
                store.ssd.reset_file_locked(0)
            with open(victim, "wb") as f:  # ... and an unrelated open may get the same fd number
                f.write(b"\0" * 8192)
                f.flush()
                r = real(fd, bufs, off)
                f.flush()
            return r
        return real(fd, bufs, off)

    monkeypatch.setattr(os, "pwritev", pwritev)
    put_pages(store, pool, lay, ["w0"], [0])
    assert victim.read_bytes() == b"\0" * 8192  # FlatCake's bytes went to its own (old) inode
    assert store.ssd.open_fds() >= 1
    store.close()
    assert store.ssd.open_fds() == 0
