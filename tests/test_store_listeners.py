"""The store's publish and retire listeners (what the cluster member publishes from;
``docs/cluster.md``, "Backend wiring"): every round published — DRAM, SSD, a queued SSD round once
it is written — reaches the publish listener with its entries; every freed scope reaches the
retire listener with its keys and id; a raising listener never breaks the write or the reclaim."""

from __future__ import annotations

from flatcake.gva.address import MEDIUM_DRAM, MEDIUM_SSD, medium_of
from flatcake_testkit import make_store, put_pages, two_requests_share


def _keys(tag, n):
    return [f"{tag}{i:03d}".ljust(64, "k") for i in range(n)]


def test_publish_listener_sees_dram_ssd_and_queued_rounds_with_their_entries(tmp_path):
    store, pool, lay = make_store(str(tmp_path), **{"dram.capacity_bytes": 1 << 20, "placement.requery_window_s": 0})
    seen = []
    store.add_publish_listener(lambda plc, entries: seen.append((plc.scope.scope_id, plc.medium, list(plc.keys),
                                                                 list(entries))))
    try:
        dk, sk = _keys("d", 3), _keys("s", 4)
        two_requests_share(store.leading_run, dk)
        assert put_pages(store, pool, lay, dk, range(3)) == [True] * 3
        assert put_pages(store, pool, lay, sk, range(3, 7)) == [True] * 4  # queued (write queue on)
        assert store.flush_writes()
        assert [(m, k) for _, m, k, _ in seen] == [(MEDIUM_DRAM, dk), (MEDIUM_SSD, sk)]
        (_, _, _, de), (_, _, _, se) = seen
        assert [e.gva for e in de] == [store.index.get(k).gva for k in dk]
        assert {medium_of(e.gva) for e in de} == {MEDIUM_DRAM} and {medium_of(e.gva) for e in se} == {MEDIUM_SSD}
        assert all(e.checksums is not None and len(e.checksums) >= lay.geometry.layers for e in se)
        assert de[0].layer_stride == lay.geometry.chunk_bytes and se[0].layer_stride == 4 * lay.geometry.chunk_bytes
    finally:
        store.close()


def test_retire_listener_with_scope_gets_keys_and_scope_id_and_a_raising_listener_is_contained(tmp_path):
    store, pool, lay = make_store(str(tmp_path))
    plain, scoped, ids = [], [], {}
    store.add_retire_listener(lambda keys: plain.append(sorted(keys)))
    store.add_retire_listener(lambda keys: 1 / 0)  # logged once, never breaks the clear
    store.add_retire_listener(lambda keys, scope_id: scoped.append((scope_id, sorted(keys))), with_scope=True)
    store.add_publish_listener(lambda plc, entries: ids.setdefault(plc.scope.scope_id, list(plc.keys)))
    store.add_publish_listener(lambda plc, entries: 1 / 0)
    try:
        a, b = _keys("a", 2), _keys("b", 3)
        assert put_pages(store, pool, lay, a, range(2)) == [True] * 2
        assert put_pages(store, pool, lay, b, range(2, 5)) == [True] * 3
        assert store.flush_writes()
        assert store.leading_run(a) == 2 and store.leading_run(b) == 3  # published despite the raising listener
        store.clear()
        assert sorted(plain) == sorted([sorted(a), sorted(b)])
        assert sorted(scoped) == sorted((sid, sorted(k)) for sid, k in ids.items())
        assert len(scoped) == 2
        errs = store.errors.counts()  # counted, not raised: one per scope freed / round published
        assert sum(n for k, n in errs.items() if k.startswith("retire listener/")) == 2
        assert sum(n for k, n in errs.items() if k.startswith("publish listener/")) == 2
        assert [store.leading_run(k) for k in (a, b)] == [0, 0]
    finally:
        store.close()
