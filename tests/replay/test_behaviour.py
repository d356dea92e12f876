"""Inputs the evaluation must behave on (issue 9), on every system: a request served from SSD
beats recomputing it when prefill is the expensive part, and with no reuse at all no L3 makes the
misses slower than recompute (write-backs run beside the misses, not in front of them)."""

import dataclasses
import time

import pytest

from flatcake.replay.engine import Engine, EngineConfig
from flatcake.replay.keys import PageKeyer
from flatcake.replay.serving import ServingConfig, ServingModel, serving_summary
from flatcake.replay.systems import make_system
from flatcake.replay.traces import TraceRequest
from replay_fixtures import tiny_profile  # noqa: F401  (pytest fixture)

FC = {"dram.capacity_bytes": 1 << 20, "ssd.file_bytes": 8 << 20, "ssd.max_files": 4, "placement.l_agent_tokens": 1024}
L3 = ["flatcake", "tiered", "file", "dram-only"]


def req(at, blocks, ns, tail=32):
    return TraceRequest(at, ns, ns, tuple(blocks), 64, len(blocks) * 64 + tail, 4)


@pytest.mark.parametrize("system", ["flatcake", "tiered", "file"])
def test_a_request_served_from_ssd_beats_recomputing_it(tmp_path, tiny_profile, system):
    """A 7B-class compute model (prefill ~0.3 ms a token here) over the tiny 16 KiB pages: a
    4,096-token prefix is 1.2 s of prefill and 1 MiB to read back."""
    profile = dataclasses.replace(tiny_profile, params=7e9)
    keyer = PageKeyer(profile.page_size)
    first, second = req(0.0, range(64), "weka:a"), req(1.0, list(range(64)) + [999], "weka:a")
    ttft = {}
    for name in (system, "recompute"):
        sysm = make_system(name, profile, 256, tmp_path / name, FC)
        try:
            eng = Engine(sysm, profile, EngineConfig(hbm_pages=0, host_pool_pages=256, prefetch_threshold_tokens=0))
            eng.run(keyer.keys(first), first.prompt_tokens)
            if name == "tiered":
                sysm.drain()
            out = eng.run(keyer.keys(second), second.prompt_tokens)
            ttft[name] = out.ttft_s
            if name == system:
                assert out.l3_pages == 64 and out.verify_failures == 0 and out.computed_pages == 1
        finally:
            sysm.close()
    # 1 MiB read against 1.2 s of modelled prefill; a margin of 3x, not more: a loaded 2-core CI
    # machine has taken 0.12 s for the read
    assert ttft[system] < ttft["recompute"] / 3


@pytest.mark.parametrize("system", L3)
def test_with_no_reuse_no_l3_makes_misses_slower_than_recompute(tmp_path, tiny_profile, system):
    """Every write-back call slowed by 0.4 s: if any miss waited for one, its TTFT would grow by it."""
    slow = 0.4
    keyer = PageKeyer(tiny_profile.page_size)
    reqs = [req(0.02 * i, [10_000 + 100 * i + j for j in range(6)], f"weka:n{i}") for i in range(10)]
    summaries = {}
    for name in (system, "recompute"):
        sysm = make_system(name, tiny_profile, 512, tmp_path / name, FC)
        try:
            if name == system:
                real_set = sysm.set
                sysm.set = lambda *a: (time.sleep(slow), real_set(*a))[1]
            ecfg = EngineConfig(hbm_pages=0, host_pool_pages=512, prefetch_threshold_tokens=0)
            lives = ServingModel(sysm, tiny_profile, ecfg, ServingConfig(qps=50.0)).run(reqs, [keyer.keys(r) for r in reqs])
            summaries[name] = serving_summary(lives, tiny_profile.page_size, 1.0)
            if name == system:
                assert [r.written_pages for r in lives] == [6] * 10  # every full page written back
                assert max(r.t_ready - r.arrival for r in lives) < slow / 2  # no hit query waited for a write
        finally:
            sysm.close()
    assert summaries[system]["delivered_hit_rate"] == 0.0
    for stat in ("mean", "p99"):
        assert summaries[system]["ttft_s"][stat] < summaries["recompute"]["ttft_s"][stat] + slow / 2


@pytest.mark.parametrize("system", ["flatcake", "tiered", "file"])
def test_a_multi_turn_session_whose_hit_rate_rises_keeps_its_ttft(tmp_path, tiny_profile, system):
    """Eight turns of one session, each adding 256 tokens to the context (7B-class compute): the
    hit rate rises turn over turn and TTFT stays at the new tokens' prefill, not growing with the
    context restored from L3."""
    profile = dataclasses.replace(tiny_profile, params=7e9)
    keyer = PageKeyer(profile.page_size)
    sysm = make_system(system, profile, 256, tmp_path / system, FC)
    try:
        eng = Engine(sysm, profile, EngineConfig(hbm_pages=0, host_pool_pages=256, prefetch_threshold_tokens=0))
        outs = []
        for turn in range(1, 9):
            r = req(float(turn), range(4 * turn), "weka:multi", tail=0)
            outs.append(eng.run(keyer.keys(r), r.prompt_tokens))
            if system == "tiered":
                sysm.drain()
    finally:
        sysm.close()
    hit = [o.l3_pages / o.pages for o in outs]
    assert hit == sorted(hit) and hit[-1] == 28 / 32  # all but the 4 new pages, from turn 2 on
    assert all(o.verify_failures == 0 and o.computed_pages == 4 for o in outs[1:])
    # the modelled part of TTFT (host->HBM load of the restored context + the new tokens' prefill),
    # deterministic: no timed assertion on the measured storage time (it lives in the benches)
    later = [o.load_s + o.prefill_s for o in outs[1:]]
    assert max(later) < 1.5 * min(later)  # 256 new tokens' prefill each turn; loading the restored context is small beside it
