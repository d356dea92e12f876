"""The read path's per-call helpers (issue 11: a 128-page call at 1-token pages): the chunk batch
built with whole-array numpy equals the page-by-page construction, media split, run-wise scope
pins with the same refcounts, the adapter's page numbers, the cached destination table."""

from types import SimpleNamespace

import numpy as np
import pytest
import torch
from flatcake_testkit import make_store, put_pages

from flatcake.adapter.storage import page_numbers
from flatcake.cio.native_restore import dst_table
from flatcake.gva.address import MEDIUM_DRAM, MEDIUM_SSD, OFFSET_MASK, encode_gva
from flatcake.gva.index import GvaIndex, PageEntry, SessionScope, pin_entries, scope_runs
from flatcake.gva.placement import ReuseScope
from flatcake.common.layout import PageGeometry
from flatcake.store.read_path import ReadPath, split_media
from flatcake.store.write_queue import MEDIUM_QUEUED

L, CB, FILE = 3, 4096, 1 << 20


def reference(entries, ssd_pos, page_ids, verify):
    """The chunk arrays page by page (what ``chunk_batch`` built before issue 11)."""
    rows = {k: [] for k in ("file", "off", "page", "layer", "tag", "sum", "has", "dev", "hasdev")}
    for layer in range(L):
        for i in ssd_pos:
            e = entries[i]
            off = e.gva & OFFSET_MASK
            c = None if e.checksums is None or not (verify or e.verify) else np.asarray(e.checksums, dtype=np.uint64)
            rows["file"].append(off // FILE)
            rows["off"].append(off % FILE + layer * e.layer_stride)
            rows["page"].append(int(page_ids[i]))
            rows["layer"].append(layer)
            rows["tag"].append(i)
            rows["sum"].append(0 if c is None else int(c[layer]))
            rows["has"].append(c is not None)
            dev = c is not None and c.shape[0] >= 2 * L
            rows["dev"].append(int(c[L + layer]) if dev else 0)
            rows["hasdev"].append(dev)
    return rows


def as_rows(b):
    return {"file": b.file_index.tolist(), "off": b.offset.tolist(), "page": b.page.tolist(),
            "layer": b.layer.tolist(), "tag": b.tag.tolist(), "sum": b.checksum.tolist(),
            "has": b.has_checksum.tolist(), "dev": b.devsum.tolist(), "hasdev": b.has_devsum.tolist()}


def reader(verify):
    return ReadPath(PageGeometry(L, 1, (CB // 2, CB // 2)), None, SimpleNamespace(file_bytes=FILE), None, verify,
                    None, None)


def entries_of(checksums, verify_flags, scope=None):
    scope = scope or SessionScope(1, MEDIUM_SSD, ReuseScope.ONE_SHOT)
    return [PageEntry(encode_gva(MEDIUM_SSD, 0, (i % 3) * FILE + 8192 + i * CB), scope, 5 * CB, c, v)
            for i, (c, v) in enumerate(zip(checksums, verify_flags))]


V3 = [np.arange(10 * i, 10 * i + 2 * L, dtype=np.uint64) for i in range(5)]  # xxh3 then device sums
V2 = [np.arange(7 * i, 7 * i + L, dtype=np.uint64) for i in range(5)]  # xxh3 only
MIXED = [V3[0], None, V2[2], [2**64 - 1, 5, 6], V3[4]]  # a list, a missing one, both records


@pytest.mark.parametrize("sums", [V3, V2, MIXED], ids=["v3", "v2", "mixed"])
@pytest.mark.parametrize("verify", [True, False])
@pytest.mark.parametrize("ssd_pos", [range(5), [0, 2, 3], [4]], ids=["all", "some", "last"])
@pytest.mark.parametrize("ids", [[40, 41, 7, 9, 63], torch.tensor([40, 41, 7, 9, 63])], ids=["list", "tensor"])
def test_the_chunk_batch_equals_the_page_by_page_one(sums, verify, ssd_pos, ids):
    es = entries_of(sums, [False, True, False, True, False])
    b = reader(verify).chunk_batch(es, ssd_pos, ids)
    assert as_rows(b) == reference(es, list(ssd_pos), ids.tolist() if torch.is_tensor(ids) else ids, verify)
    assert b.nbytes == CB and len(b) == L * len(ssd_pos)


def test_the_chunk_batch_of_v3_pages_carries_both_checksums_layer_major():
    b = reader(True).chunk_batch(entries_of(V3[:2], [False, False]), range(2), [3, 4])
    assert b.checksum.tolist() == [0, 10, 1, 11, 2, 12] and b.devsum.tolist() == [3, 13, 4, 14, 5, 15]
    assert b.has_devsum.all() and b.page.tolist() == [3, 4] * 3 and b.tag.tolist() == [0, 1] * 3


def test_split_media_gives_each_mediums_positions_in_order():
    g = [encode_gva(m, 0, 4096 * i) for i, m in enumerate([MEDIUM_SSD, MEDIUM_DRAM, MEDIUM_QUEUED, MEDIUM_SSD, 9])]
    assert split_media(g) == ([1], [0, 3], [2])
    assert split_media([encode_gva(MEDIUM_SSD, 7, 4096 * i) for i in range(4)]) == ([], range(4), [])
    assert split_media([]) == ([], [], [])


def scopes(n):
    return [SessionScope(i + 1, MEDIUM_SSD, ReuseScope.ONE_SHOT) for i in range(n)]


def test_scope_runs_are_consecutive_pages_of_one_scope():
    a, b = scopes(2)
    es = [SimpleNamespace(scope=s) for s in (a, a, b, b, b, a)]
    assert scope_runs(es) == [(a, 2), (b, 3), (a, 1)]
    assert scope_runs(es[:2]) == [(a, 2)] and scope_runs([]) == []


def test_pin_entries_pins_once_per_page_up_to_the_first_retired_scope():
    a, b, c = scopes(3)
    assert c.try_retire()
    es = [SimpleNamespace(scope=s) for s in (a, a, b, c, a)]
    assert pin_entries(es) == 3  # a's two pages and b's; c refuses, a's last page is not pinned
    assert (a.refcount, b.refcount, c.refcount) == (2, 1, 0)
    a.release(2)
    b.release()
    assert (a.refcount, b.refcount) == (0, 0) and a.try_retire()


def test_leading_entries_stop_at_the_first_key_not_published():
    idx = GvaIndex()
    with idx.lock:
        s = idx.open_scope_locked(MEDIUM_SSD, ReuseScope.ONE_SHOT)
        es = [PageEntry(encode_gva(MEDIUM_SSD, 0, 4096 * i), s, 4096) for i in range(3)]
        idx.publish_locked(["a", "b", "c"], es)
    assert idx.leading_entries(["a", "b", "x", "c"]) == es[:2]
    assert idx.leading_entries(["a", "b", "c"]) == es and idx.leading_entries([]) == []


def test_a_read_pins_each_page_and_unpin_gives_every_pin_back(ssd_dir):
    store, pool, lay = make_store(ssd_dir)
    keys = [f"p{i}" for i in range(6)]
    put_pages(store, pool, lay, keys, range(6))
    assert store.flush_writes(30)
    scope = store.index.get("p0").scope
    base = scope.refcount
    entries = store.scopes.pin_leading_run(keys + ["missing", "p1"])
    assert len(entries) == 6 and scope.refcount == base + 6
    store.queue.release(entries)  # no queued page among them: nothing to give back
    store.scopes.unpin(entries)
    assert scope.refcount == base
    store.close()


@pytest.mark.parametrize("ps", [1, 4])
def test_page_numbers_accept_whole_aligned_pages_only(ps):
    ok = np.array([s + j for s in (8 * ps, 0, 3 * ps) for j in range(ps)], dtype=np.int64)
    assert page_numbers(ok, 3, ps) == [8, 0, 3]
    assert page_numbers(ok.astype(np.int32), 3, ps) == [8, 0, 3]
    assert page_numbers(ok, 2, ps) is None  # not n pages
    if ps > 1:
        assert page_numbers(ok + 1, 3, ps) is None  # not page-aligned
        bad = ok.copy()
        bad[1] += 1  # a slot out of order inside page 0
        assert page_numbers(bad, 3, ps) is None


def test_the_destination_table_is_computed_once_per_layout(ssd_dir):
    store, pool, lay = make_store(ssd_dir, layout="layer_first")
    t = dst_table(lay)
    assert dst_table(lay) is t
    assert t[0][1, 0] == lay.layer_planes(1)[0].data_ptr() and t[1][0, 1] == lay.layer_planes(0)[1].stride(0)
    assert not any(a.flags.writeable for a in t)
    store.close()
