"""Record v3 (device checksums beside xxh3, ``docs/durability.md``) through the store: rounds
written now carry both checksums per chunk, a warm restart rebuilds both, and a pool whose
rounds have version-2 records (written before device checksums) restarts, serves its pages
bit-exact and still catches a corrupted chunk with xxh3."""

import numpy as np
from flatcake_testkit import make_store, page_matches, put_pages

from flatcake.gva.address import OFFSET_MASK
from flatcake.kernels.fcds_native import fcds_host_at
from flatcake.media import extent as fmt


def served(store, pool, lay, keys, first_page=40) -> list[bool]:
    got = store.get(keys, lay, list(range(first_page, first_page + len(keys))))
    return [ok and page_matches(pool, (first_page + i) * pool.page_size, k) for i, (ok, k) in enumerate(zip(got, keys))]


def chunk_on_disk(store, key, layer) -> np.ndarray:
    """The bytes of (page ``key``, ``layer``) as they are in the pool file."""
    e = store.index.get(key)
    off = (e.gva & OFFSET_MASK) + layer * e.layer_stride
    fb = store.ssd.file_bytes
    with open(store.ssd.path_of(off // fb), "rb") as f:
        f.seek(off % fb)
        return np.frombuffer(f.read(store.geometry.chunk_bytes), dtype=np.uint8)


def test_warm_restart_rebuilds_xxh3_and_device_checksums_of_record_v3(ssd_dir):
    store, pool, lay = make_store(ssd_dir)
    keys = [f"v3-{i}" for i in range(5)]
    assert put_pages(store, pool, lay, keys, range(5)) == [True] * 5
    store.close()
    store, pool2, lay2 = make_store(ssd_dir)
    try:
        L, cb = store.geometry.layers, store.geometry.chunk_bytes
        assert store.snapshot_stats()["pages_rebuilt"] == 5
        for k in keys:
            c = store.index.get(k).checksums
            assert c.shape == (2 * L,)
            for layer in range(L):
                want = int(fcds_host_at(chunk_on_disk(store, k, layer), [0], cb)[0])
                assert int(c[L + layer]) == want
        b = store.reader.chunk_batch([store.index.get(k) for k in keys], range(5), list(range(5)))
        assert b.has_devsum.all() and b.has_checksum.all() and len(b) == 5 * L
        assert served(store, pool2, lay2, keys) == [True] * 5
    finally:
        store.close()


def test_a_pool_of_version_2_records_restarts_and_verifies_with_xxh3(ssd_dir, monkeypatch):
    real = fmt.pack_record

    def old_writer(*a, **k):  # the writer before record v3: no device checksums
        if len(a) > 8:
            a = a[:8]
        k.pop("devsums", None)
        return real(*a, **k)

    monkeypatch.setattr(fmt, "pack_record", old_writer)
    store, pool, lay = make_store(ssd_dir)
    keys = [f"v2-{i}" for i in range(4)]
    assert put_pages(store, pool, lay, keys, range(4)) == [True] * 4
    store.close()
    monkeypatch.setattr(fmt, "pack_record", real)
    store, pool2, lay2 = make_store(ssd_dir)
    try:
        L = store.geometry.layers
        assert store.snapshot_stats()["pages_rebuilt"] == 4
        assert all(store.index.get(k).checksums.shape == (L,) for k in keys)  # xxh3 only
        b = store.reader.chunk_batch([store.index.get(k) for k in keys], range(4), list(range(4)))
        assert not b.has_devsum.any() and b.has_checksum.all()
        assert served(store, pool2, lay2, keys) == [True] * 4
        e = store.index.get("v2-2")
        off = (e.gva & OFFSET_MASK) + e.layer_stride  # layer 1 of page v2-2
        fb = store.ssd.file_bytes
        with open(store.ssd.path_of(off // fb), "r+b") as f:
            f.seek(off % fb + 5)
            x = f.read(1)
            f.seek(off % fb + 5)
            f.write(bytes([x[0] ^ 0x10]))
        assert served(store, pool2, lay2, keys, first_page=50) == [True, True, False, False]
        assert store.snapshot_stats()["checksum_failures"] == 1
    finally:
        store.close()
