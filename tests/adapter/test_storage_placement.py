"""Write-time placement (paper Table 2) from the signals derived from SGLang's key chain, driven
through the backend as SGLang drives it (hit queries, then ``batch_set_v1`` with prefix keys)."""

import pytest
import flatcake_testkit as testkit
from flatcake_testkit import two_requests_share

from flatcake.gva.address import MEDIUM_DRAM, MEDIUM_SSD
from flatcake.gva.placement import ReuseScope


def write_pages(be, pool, keys, pages, prefix=()):
    """``testkit.write_pages``, then wait for the SSD write queue (``PageStore.flush_writes``): these
    tests check which medium a round was placed on (a queued round reports 'queued' until written)."""
    out = testkit.write_pages(be, pool, keys, pages, prefix)
    assert be.store.flush_writes(30)
    return out


@pytest.fixture
def backend(make_backend):
    def _b(**extra):
        ex = {
            "dram.capacity_bytes": 1 << 20,
            "placement.l_agent_tokens": 40,
            "placement.tau_tokens": 24,
            "placement.short_reply_tokens": 12,
        }
        ex.update(extra)
        return make_backend(extra=ex, pages=128)

    return _b


def put(be, pool, keys, first_page, prefix):
    return write_pages(be, pool, keys, range(first_page, first_page + len(keys)), prefix)


def media(be, keys):
    return [be.store.medium_of(k) for k in keys]


def test_turn1_one_shot_goes_to_ssd(backend):
    be, pool = backend()
    keys = ["a0", "a1"]
    be.batch_exists(keys)
    put(be, pool, keys, 0, [])
    assert media(be, keys) == ["ssd"] * 2
    assert be.store.page_info("a0").reuse == ReuseScope.ONE_SHOT


def test_shared_prompt_queried_by_two_requests_goes_to_dram(backend):
    be, pool = backend()
    sys_prompt = ["sys0", "sys1"]
    assert be.batch_exists(sys_prompt + ["u1"]) == 0  # request 1
    assert be.batch_exists(sys_prompt + ["u2"]) == 0  # request 2, same prefix
    put(be, pool, sys_prompt, 0, [])
    assert media(be, sys_prompt) == ["dram"] * 2
    assert be.store.page_info("sys0").reuse == ReuseScope.SHARED_PROMPT


def test_short_chat_turn2_after_short_reply_goes_to_dram_and_later_turns_join(backend):
    be, pool = backend()
    t1 = ["c0", "c1"]  # 8 tokens: short
    be.batch_exists(t1)
    put(be, pool, t1, 0, [])
    scope1 = be.store.index.get("c0").scope
    assert scope1.medium == MEDIUM_SSD and scope1.turn == 1
    # turn 2: the hit query's stored run ends on the session's tail -> new turn
    t2 = ["c2"]
    assert be.batch_exists(t1 + t2) == 2
    assert scope1.turn == 2 and scope1.prev_turn_tokens == 8
    put(be, pool, t2, 2, t1)
    # the session's scope and medium are kept: turn-2 pages join the SSD scope
    assert be.store.index.get("c2").scope is scope1
    # a branch (edited turn 2) from the middle opens a new scope that inherits the turn;
    # its previous reply was short (8 tokens < 12) -> short chat -> DRAM
    branch = ["c1x"]
    put(be, pool, branch, 3, ["c0"])
    s = be.store.index.get("c1x").scope
    assert s is not scope1 and s.medium == MEDIUM_DRAM and s.reuse == ReuseScope.SHORT_CHAT and s.turn == 2


@pytest.mark.parametrize("query_prefix", [None, ["c0"]])
def test_turn2_whose_turn1_sglang_holds_in_its_device_cache_starts_the_next_turn(backend, query_prefix):
    """As a real SGLang 0.5.23 server calls it (tests/e2e/test_server_vs_doubles.py): turn 1 is
    still in the device cache, so turn 2's hit query asks only for the new page, and its
    ``prefix_keys`` hold the keys before the radix node the match ends in (``None`` when there
    are none, or a shorter chain), not turn 1's tail. The next turn then starts when the new page
    is backed up (the backup's ``prefix_keys`` end on the tail), exactly once."""
    from sglang.srt.mem_cache.hicache_storage import HiCacheStorageExtraInfo

    be, pool = backend()
    t1 = ["c0", "c1"]  # 8 tokens
    be.batch_exists(t1)
    put(be, pool, t1, 0, [])
    scope1 = be.store.index.get("c0").scope
    assert be.batch_exists(["c2"], HiCacheStorageExtraInfo(prefix_keys=query_prefix)) == 0
    assert scope1.turn == 1  # the query cannot tell
    put(be, pool, ["c2"], 2, t1)
    assert be.store.index.get("c2").scope is scope1
    assert (scope1.turn, scope1.prev_turn_tokens, scope1.cur_turn_tokens) == (2, 8, 4)
    put(be, pool, ["c3"], 3, t1 + ["c2"])  # the same request's next round (its output page): same turn
    assert scope1.turn == 2
    assert be.batch_exists(["d0"]) == 0  # an unrelated request at the root: nothing to continue
    put(be, pool, ["d0"], 4, [])
    assert be.store.index.get("d0").scope.turn == 1


def test_context_over_l_agent_goes_to_ssd_and_dram_scope_continues_on_ssd(backend):
    be, pool = backend()
    shared = ["s0", "s1"]
    two_requests_share(be.batch_exists, shared)
    put(be, pool, shared, 0, [])
    assert media(be, shared) == ["dram"] * 2
    # the same session appends past L_agent (40 tokens = 10 pages): new rounds on SSD
    more = [f"s{i}" for i in range(2, 12)]
    put(be, pool, more, 2, shared)
    assert media(be, more) == ["ssd"] * 10
    assert be.store.page_info("s2").reuse == ReuseScope.AGENT_SESSION
    assert media(be, shared) == ["dram"] * 2  # never migrates


def test_dram_full_overflows_to_ssd(backend, make_backend):
    be, pool = backend(**{"dram.capacity_bytes": 3 * 1536})  # 3 page slots
    assert be.store.dram.n_slots == 3
    keys = [f"o{i}" for i in range(4)]
    two_requests_share(be.batch_exists, keys)
    put(be, pool, keys, 0, [])
    assert media(be, keys) == ["ssd"] * 4
    assert be.store.page_info("o0").reuse == ReuseScope.OVERFLOW
