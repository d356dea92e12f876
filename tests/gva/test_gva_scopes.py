"""The scope table (paper §3.1, FC-GVA) on its own: placement from the key chain, space at the
scope's tail, publish on commit, exactly-once give-back on abort, whole-scope reclaim. No SGLang,
no bytes moved: entries are published as the write path would return them."""

import logging

import pytest
from flatcake_testkit import two_requests_share

from flatcake.config import load_config
from flatcake.common.errorlog import ErrorLog
from flatcake.gva.address import MEDIUM_DRAM, MEDIUM_SSD, encode_gva
from flatcake.gva.index import PageEntry
from flatcake.gva.placement import ReuseScope
from flatcake.gva.scopes import ScopeTable
from flatcake.common.layout import PageGeometry
from flatcake.media import extent as fmt
from flatcake.media.dram import DramRegion
from flatcake.media.ssd import SsdFilePool
from flatcake.store.stats import StoreStats

GEOM = PageGeometry(layers=2, page_size=4, plane_row_bytes=(64, 64))  # 512 B chunks, 1 KiB pages


@pytest.fixture
def make_table(ssd_dir):
    made = []

    def _make(**overrides):
        cfg = load_config(None, {"ssd.path": ssd_dir, "ssd.file_bytes": 1 << 20, "ssd.max_files": 2,
                                 "dram.capacity_bytes": 8 * GEOM.page_bytes, "placement.l_agent_tokens": 40,
                                 "placement.tau_tokens": 24, "placement.short_reply_tokens": 12, **overrides})
        dram = DramRegion(cfg.dram, GEOM.page_bytes)
        ssd = SsdFilePool(cfg.ssd, "ns")
        made.append(ssd)
        return ScopeTable(cfg, GEOM, dram, ssd, StoreStats(), ErrorLog(logging.getLogger("test")))

    yield _make
    for ssd in made:
        ssd.close()


def entries_for(t: ScopeTable, plc) -> list[PageEntry]:
    """The entries the write path returns for ``plc`` (addresses only; no bytes)."""
    if plc.medium == MEDIUM_DRAM:
        return [PageEntry(encode_gva(MEDIUM_DRAM, 0, s * GEOM.page_bytes), plc.scope, GEOM.chunk_bytes) for s in plc.slots]
    base = plc.extent_file * t.ssd.file_bytes + plc.round_offset + fmt.BLOCK
    n = len(plc.keys)
    return [PageEntry(encode_gva(MEDIUM_SSD, 0, base + p * GEOM.chunk_bytes), plc.scope, n * GEOM.chunk_bytes)
            for p in range(n)]


def put(t: ScopeTable, keys, parent=None, context_pages=None):
    """Place, commit and release one round; returns the placement."""
    ctx = (context_pages if context_pages is not None else len(keys)) * GEOM.page_size
    with t.lock:
        plc = t.place_locked(keys, list(range(len(keys))), parent, ctx)
        assert plc is not None
        t.commit_locked(plc, entries_for(t, plc), parent)
    t.release(plc)
    return plc


def test_first_round_opens_an_ssd_scope_whose_keys_appear_only_on_commit(make_table):
    t = make_table()
    with t.lock:
        plc = t.place_locked(["a0", "a1"], [0, 1], None, 8)
    assert plc.medium == MEDIUM_SSD and plc.scope.reuse == ReuseScope.ONE_SHOT and plc.scope.turn == 1
    assert plc.new_extent is not None and plc.round_offset == plc.new_extent.offset + fmt.BLOCK
    assert plc.scope.refcount == 1  # pinned while the bytes are written
    assert t.index.get("a0") is None  # not visible before the bytes are written
    with t.lock:
        t.commit_locked(plc, entries_for(t, plc), None)
    t.release(plc)
    assert t.index.get("a1").scope is plc.scope and plc.scope.tail_key == "a1" and plc.scope.refcount == 0
    assert t.ssd.used_bytes == plc.new_extent.nbytes


def test_a_round_chained_on_the_tail_joins_the_scope_right_after_the_previous_round(make_table):
    t = make_table()
    p1 = put(t, ["a0", "a1"])
    p2 = put(t, ["a2"], parent="a1", context_pages=3)
    assert p2.scope is p1.scope and p2.new_extent is None and p2.seq == 1
    assert p2.round_offset == p1.round_offset + p1.layout.total_bytes
    assert p1.scope.keys == ["a0", "a1", "a2"] and p1.scope.tail_key == "a2"
    p3 = put(t, ["b2"], parent="a0", context_pages=2)  # a branch from the middle: a new scope
    assert p3.scope is not p1.scope


def test_hit_query_reaching_the_tail_starts_the_sessions_next_turn(make_table):
    t = make_table()
    scope = put(t, ["c0", "c1"]).scope
    t.note_hit_query(["c0", "c1", "c2"], 2, None)
    assert (scope.turn, scope.prev_turn_tokens, scope.cur_turn_tokens) == (2, 8, 0)
    t.note_hit_query(["c0"], 1, None)  # everything stored: not a new request of the session
    assert scope.turn == 2


def test_prefix_asked_for_by_two_requests_is_a_shared_prompt_on_dram(make_table):
    t = make_table()
    two_requests_share(lambda ks: t.note_hit_query(ks, 0, None), ["s0", "s1"])
    plc = put(t, ["s0", "s1"])
    assert plc.medium == MEDIUM_DRAM and plc.scope.reuse == ReuseScope.SHARED_PROMPT
    assert len(plc.slots) == 2 and t.dram.free_slots == 6


def test_a_dram_session_past_l_agent_continues_in_a_new_ssd_scope(make_table):
    t = make_table()
    two_requests_share(lambda ks: t.note_hit_query(ks, 0, None), ["s0"])
    first = put(t, ["s0"])
    more = put(t, [f"s{i}" for i in range(1, 4)], parent="s0", context_pages=11)  # 44 tokens >= 40
    assert first.medium == MEDIUM_DRAM and more.medium == MEDIUM_SSD
    assert more.scope is not first.scope and more.scope.reuse == ReuseScope.AGENT_SESSION
    assert t.index.get("s0").scope is first.scope  # written pages never move


def test_aborted_dram_round_gives_each_slot_back_exactly_once(make_table):
    t = make_table()
    two_requests_share(lambda ks: t.note_hit_query(ks, 0, None), ["k0", "x0", "x1"])  # shared: DRAM
    keep = put(t, ["k0"])  # a committed page in DRAM
    with t.lock:
        plc = t.place_locked(["x0", "x1"], [0, 1], "k0", 12)  # joins k0's DRAM scope
        assert plc.scope is keep.scope and plc.medium == MEDIUM_DRAM
        t.abort_locked(plc)  # the gather failed
    t.release(plc)
    assert t.dram.free_slots == 7 and keep.scope.slots == keep.slots
    others = [f"o{i}" for i in range(7)]
    two_requests_share(lambda ks: t.note_hit_query(ks, 0, None), others)
    other = put(t, others)  # another shared prompt takes every free slot
    assert other.medium == MEDIUM_DRAM and t.dram.free_slots == 0
    with t.lock:  # reclaiming k0's scope frees its one slot, not the aborted ones twice
        assert t.free_scope_locked(keep.scope)
    assert t.dram.free_slots == 1
    assert set(other.slots).isdisjoint(keep.slots) and len(set(other.slots)) == 7


def test_aborted_ssd_round_gives_its_bytes_back_to_the_scope_tail(make_table):
    t = make_table()
    p1 = put(t, ["a0"])
    with t.lock:
        p2 = t.place_locked(["a1"], [0], "a0", 8)
        t.abort_locked(p2)
    t.release(p2)
    p3 = put(t, ["a1"], parent="a0", context_pages=2)
    assert p3.round_offset == p2.round_offset and p3.scope is p1.scope
    # an aborted first round frees the extent it opened, and the empty scope goes
    with t.lock:
        p4 = t.place_locked(["z0"], [0], None, 4)
        used = t.ssd.used_bytes
        t.abort_locked(p4)
    t.release(p4)
    assert t.ssd.used_bytes == used - p4.new_extent.nbytes
    assert p4.scope.scope_id not in t.index.scopes


def test_reclaim_frees_least_recently_used_unpinned_scopes_whole(make_table):
    # one 1 MiB file holds 4 extents (256 KiB grid) of 16 KiB each: 64 KiB used; reclaim to 4%
    t = make_table(**{"ssd.max_files": 1, "ssd.high_watermark": 0.05, "ssd.low_watermark": 0.04})
    scopes = [put(t, [f"r{s}p{i}" for i in range(3)]).scope for s in range(4)]
    assert t.ssd.used_bytes == 4 * (16 << 10)
    assert scopes[0].try_acquire()  # a reader is inside the oldest scope
    with t.lock:
        t.reclaim_locked(MEDIUM_SSD)
    assert not scopes[0].retired  # pinned: never freed under its reader
    assert [s.retired for s in scopes[1:]] == [True, True, False]  # oldest unpinned first, down to 4%
    assert t.ssd.used_bytes == 2 * (16 << 10)
    assert all(t.index.get(f"r1p{i}") is None for i in range(3))  # whole scopes
    assert t.stats.snapshot()["reclaimed_scopes_ssd"] == 2
    scopes[0].release()


def page_keys(prefix: str, n: int) -> list[str]:
    return [f"{prefix}-{i}" for i in range(n)]


def test_a_round_that_cannot_fit_evicts_nothing(make_table):
    # one 1 MiB file; a 64-page round is a 76 KiB extent (4 KiB extent header + 4 KiB round
    # header + 64 KiB data + 4 KiB record): 13 of them pack from offset 0, 36 KiB stay free
    t = make_table(**{"ssd.max_files": 1})
    scopes = [put(t, page_keys(f"s{s}", 64)).scope for s in range(13)]
    assert [sc.extents[0].offset for sc in scopes] == [s * (76 << 10) for s in range(13)]
    for sc in scopes[1:]:  # every scope but the first (oldest) one has a reader
        assert sc.try_acquire()
    with t.lock:  # 100 KiB: freeing the first extent (76 KiB) and the free tail (36 KiB, elsewhere) won't do
        assert t.place_locked(page_keys("big", 88), list(range(88)), None, 88 * 4) is None
    assert not scopes[0].retired and t.stats.snapshot()["reclaimed_scopes_ssd"] == 0  # admission before eviction
    with t.lock:  # 76 KiB fits in the first scope's place: that one (only) is evicted
        plc = t.place_locked(page_keys("fits", 64), list(range(64)), None, 64 * 4)
        assert plc is not None and plc.new_extent.offset == 0 and scopes[0].retired
        t.abort_locked(plc)
    t.release(plc)
    for sc in scopes[1:]:
        sc.release()
    assert t.stats.snapshot()["reclaimed_scopes_ssd"] == 1


def test_clear_dooms_a_pinned_scope_and_frees_it_when_its_reader_leaves(make_table):
    t = make_table()
    a, b = put(t, ["a0"]).scope, put(t, ["b0"]).scope
    entries = t.pin_leading_run(["b0"])
    t.clear()
    assert a.retired and t.index.get("a0") is None
    assert t.index.get("b0") is None and b.doomed and not b.retired  # hidden now, bytes kept for the reader
    used = t.ssd.used_bytes
    t.unpin(entries)
    assert b.retired and t.ssd.used_bytes == used - b.nbytes == 0


def test_drop_file_drops_its_scopes_and_a_pinned_one_later(make_table):
    t = make_table()
    b = put(t, ["b0"]).scope
    assert b.try_acquire()
    with t.lock:
        t.drop_file_scopes_locked(b.extents[0].file_index)
    assert t.index.get("b0") is None and b.extents == [] and b.doomed
    b.release()
    assert not b.retired  # a plain release does not free; the store unpins through the table
    with t.lock:
        assert t.free_scope_locked(b)
