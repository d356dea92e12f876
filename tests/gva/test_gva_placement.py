"""Write-time placement (paper Table 2): the policy row by row, then the signals the store
derives from SGLang's key chain."""

import pytest
import torch
from flatcake_testkit import fill_page, slots_of
from sglang.srt.mem_cache.hicache_storage import HiCacheStorageExtraInfo

from flatcake.config import PlacementConfig
from flatcake.gva.address import MEDIUM_DRAM, MEDIUM_SSD, medium_of
from flatcake.gva.placement import PlacementPolicy, PlacementSignals, ReuseScope

CFG = PlacementConfig(l_agent_tokens=1000, tau_tokens=300, short_reply_tokens=100, shared_refcount=2)


def sig(**kw):
    base = dict(prefix_refcount=1, turn=1, prev_reply_tokens=None, context_tokens=10, reply_tokens=10, dram_full=False)
    base.update(kw)
    return PlacementSignals(**base)


@pytest.mark.parametrize(
    "signals,medium,scope",
    [
        (sig(prefix_refcount=2), MEDIUM_DRAM, ReuseScope.SHARED_PROMPT),
        (sig(turn=2, prev_reply_tokens=99), MEDIUM_DRAM, ReuseScope.SHORT_CHAT),
        (sig(turn=2, prev_reply_tokens=100), MEDIUM_SSD, ReuseScope.ONE_SHOT),  # long previous reply
        (sig(context_tokens=1000), MEDIUM_SSD, ReuseScope.AGENT_SESSION),
        (sig(turn=3, prev_reply_tokens=5, context_tokens=1000), MEDIUM_SSD, ReuseScope.AGENT_SESSION),
        (sig(reply_tokens=300), MEDIUM_SSD, ReuseScope.AGENT_SESSION),
        (sig(turn=1), MEDIUM_SSD, ReuseScope.ONE_SHOT),
        (sig(prefix_refcount=5, dram_full=True), MEDIUM_SSD, ReuseScope.OVERFLOW),
        (sig(turn=2, prev_reply_tokens=1, dram_full=True), MEDIUM_SSD, ReuseScope.OVERFLOW),
        (sig(prefix_refcount=3, context_tokens=5000), MEDIUM_DRAM, ReuseScope.SHARED_PROMPT),
    ],
)
def test_table2_rows(signals, medium, scope):
    d = PlacementPolicy(CFG).decide(signals)
    assert (d.medium, d.scope) == (medium, scope)


# ---------------------------------------------------------------- derived from the key chain
PS = 4  # tokens per page in the test pools


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
    for i, k in enumerate(keys):
        fill_page(pool, (first_page + i) * PS, k)
    return be.batch_set_v1(keys, slots_of(pool, range(first_page, first_page + len(keys))), HiCacheStorageExtraInfo(prefix_keys=list(prefix)))


def media(be, keys):
    return [medium_of(be.store.index.get(k).gva) for k in keys]


def test_turn1_one_shot_goes_to_ssd(backend):
    be, pool = backend()
    keys = ["a0", "a1"]
    be.batch_exists(keys)
    put(be, pool, keys, 0, [])
    assert media(be, keys) == [MEDIUM_SSD] * 2
    assert be.store.index.get("a0").scope.reuse == ReuseScope.ONE_SHOT


def test_shared_prompt_queried_by_two_requests_goes_to_dram(backend):
    be, pool = backend()
    sys_prompt = ["sys0", "sys1"]
    assert be.batch_exists(sys_prompt + ["u1"]) == 0  # request 1
    assert be.batch_exists(sys_prompt + ["u2"]) == 0  # request 2, same prefix
    put(be, pool, sys_prompt, 0, [])
    assert media(be, sys_prompt) == [MEDIUM_DRAM] * 2
    assert be.store.index.get("sys0").scope.reuse == ReuseScope.SHARED_PROMPT


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


def test_context_over_l_agent_goes_to_ssd_and_dram_scope_continues_on_ssd(backend):
    be, pool = backend()
    shared = ["s0", "s1"]
    be.batch_exists(shared)
    be.batch_exists(shared)
    put(be, pool, shared, 0, [])
    assert media(be, shared) == [MEDIUM_DRAM] * 2
    # the same session appends past L_agent (40 tokens = 10 pages): new rounds on SSD
    more = [f"s{i}" for i in range(2, 12)]
    put(be, pool, more, 2, shared)
    assert media(be, more) == [MEDIUM_SSD] * 10
    assert be.store.index.get("s2").scope.reuse == ReuseScope.AGENT_SESSION
    assert media(be, shared) == [MEDIUM_DRAM] * 2  # never migrates


def test_dram_full_overflows_to_ssd(backend, make_backend):
    be, pool = backend(**{"dram.capacity_bytes": 3 * 1536})  # 3 page slots
    assert be.store.dram.n_slots == 3
    keys = [f"o{i}" for i in range(4)]
    be.batch_exists(keys)
    be.batch_exists(keys)
    put(be, pool, keys, 0, [])
    assert media(be, keys) == [MEDIUM_SSD] * 4
    assert be.store.index.get("o0").scope.reuse == ReuseScope.OVERFLOW
