"""The concurrent serving model (flatcake.replay.serving) against real backends: storage calls
really run on their threads, every page read is verified, and the counts are exact."""

import json
import time

import pytest

from flatcake.replay.cli import main
from flatcake.replay.engine import Engine, EngineConfig
from flatcake.replay.keys import PageKeyer
from flatcake.replay.serving import ServingConfig, ServingModel, serving_summary
from flatcake.replay.systems import make_system
from flatcake.replay.traces import TraceRequest
from replay_fixtures import mooncake_path, tiny_profile, weka_path  # noqa: F401  (pytest fixtures)

PAGE_BYTES = 16384
FC = {"dram.capacity_bytes": 1 << 20, "ssd.file_bytes": 8 << 20, "ssd.max_files": 4, "placement.l_agent_tokens": 1024}


def req(at, blocks, tail=32, ns="weka:t", session=None):
    """A request in id namespace ``ns``; its conversation is ``session`` (default: ``ns``)."""
    return TraceRequest(at, ns, session or ns, tuple(blocks), 64, len(blocks) * 64 + tail, 4)


def warm_then_serve(tmp_path, profile, warm, measured, scheduler="mas", host_pool_pages=512, asks=(), slow_get_s=0.0,
                    **engine):
    """Hit-query ``asks``, write ``warm`` one request at a time, then serve ``measured``
    concurrently; returns ``(lives, summary, counter deltas)``. The prefetch policy is
    ``wait_complete`` unless ``engine`` says otherwise: these counts must not depend on how fast
    this machine reads (the default, SGLang's ``timeout``, cuts a slow prefetch)."""
    engine.setdefault("prefetch_policy", "wait_complete")
    keyer = PageKeyer(profile.page_size)
    system = make_system("flatcake", profile, host_pool_pages, tmp_path, FC)
    try:
        ecfg = EngineConfig(hbm_pages=0, host_pool_pages=host_pool_pages, prefetch_threshold_tokens=0, **engine)
        eng = Engine(system, profile, ecfg)
        for r in asks:
            system.exists(keyer.keys(r), [])
        for r in warm:
            eng.run(keyer.keys(r), r.prompt_tokens)
        before = system.counters()
        if slow_get_s:
            real_get = system.get
            system.get = lambda *a: (time.sleep(slow_get_s), real_get(*a))[1]
        model = ServingModel(system, profile, ecfg, ServingConfig(qps=100.0, scheduler=scheduler))
        lives = model.run(measured, [keyer.keys(r) for r in measured])
        after = system.counters()
        return lives, serving_summary(lives, profile.page_size, 1.0), {k: after[k] - before[k] for k in after}
    finally:
        system.close()


@pytest.mark.parametrize("scheduler", ["fcfs", "mas"])
def test_two_requests_for_the_same_session_prefix_read_it_from_ssd_once(tmp_path, tiny_profile, scheduler):
    history = list(range(40))  # 40 pages of agent context: on SSD
    warm = [req(0.0, history)]
    # two conversations forked from one context arrive together (one conversation's turns would
    # wait for each other's answers)
    measured = [req(0.0, history + [100], session="a"), req(0.0, history + [200], session="b")]
    lives, s, d = warm_then_serve(tmp_path, tiny_profile, warm, measured, scheduler)
    assert [r.delivered for r in lives] == [40, 40] and [r.ssd_pages for r in lives] == [40, 40]
    assert s["shared_reads"] == 1 and s["verify_failures"] == 0
    assert d["logical_read_bytes_ssd"] == 40 * PAGE_BYTES  # once, not twice
    assert s["hit_tokens"] == {"hbm": 0, "dram": 0, "backlog": 0, "ssd": 80 * 64}  # warm rounds flushed to disk
    assert all(r.t_first > r.arrival for r in lives)


def test_a_prefetch_declined_for_lack_of_host_memory_is_recomputed_not_left_waiting(tmp_path, tiny_profile):
    history = list(range(300))  # more pages than the 256-page host pool holds
    lives, s, d = warm_then_serve(tmp_path, tiny_profile, [req(0.0, history)],
                                  [req(0.0, history + [1]), req(0.01, [7, 8, 9])], host_pool_pages=256)
    big = lives[0]
    assert big.hit == 0 and big.delivered == 0 and big.declined_tokens == 300 * 64
    assert s["declined_prefetch_tokens"] == 300 * 64 and d["logical_read_bytes_ssd"] == 0
    assert all(r.t_first > 0 for r in lives) and s["requests"] == 2


@pytest.mark.parametrize("scheduler", ["fcfs", "mas"])
def test_every_page_delivered_under_load_is_verified_and_counted_by_medium(tmp_path, tiny_profile, scheduler):
    shared = list(range(1000, 1008))  # a system prompt asked twice before it is written: DRAM
    sessions = [list(range(s * 100, s * 100 + 24)) for s in range(4)]  # agent contexts: SSD
    warm = [req(0.0, s, ns=f"weka:s{i}") for i, s in enumerate(sessions)] + [req(0.0, shared + [1], ns="weka:sys")]
    measured = [req(0.01 * i, s + [500 + i], ns=f"weka:s{i}") for i, s in enumerate(sessions)]
    measured += [req(0.005 + 0.01 * i, shared + [900 + i], ns="weka:sys") for i in range(4)]
    measured.sort(key=lambda r: r.arrival_s)
    asks = [req(0.0, shared + [x], ns="weka:sys") for x in (2, 3)]  # two requests share the prompt
    lives, s, d = warm_then_serve(tmp_path, tiny_profile, warm, measured, scheduler, asks=asks)
    assert s["verify_failures"] == 0 and s["requests"] == 8
    assert s["hit_tokens"]["ssd"] == 4 * 24 * 64
    assert s["hit_tokens"]["dram"] == 4 * 8 * 64
    assert s["ssd_restore_requests"] == 4 and s["dram_hit_requests"] + s["shared_reads"] == 4
    assert {r.lane for r in lives if r.ssd_pages} == ({"fifo"} if scheduler == "fcfs" else {"ssd"})


def test_a_timeout_admits_with_what_was_read_and_never_counts_a_page_twice(tmp_path, tiny_profile):
    history = list(range(200))  # two 128-page read calls
    # the wait starts at the GPU's first poll (within a step of the arrival): the hit query has
    # 0.2 s to answer, the first read call takes 0.6 s
    lives, s, d = warm_then_serve(tmp_path, tiny_profile, [req(0.0, history)], [req(0.0, history + [1])],
                                  slow_get_s=0.6, prefetch_policy="timeout", prefetch_timeout_base_s=0.2,
                                  prefetch_timeout_per_ki_token_s=0.0)
    r = lives[0]
    assert (r.hit, r.delivered, r.revoked_tokens) == (200, 0, 200 * 64)  # admitted before any call returned
    assert r.read_pages == 128  # the call in flight finished; the next one never started
    assert s["hit_tokens"]["ssd"] == 0 and s["revoked_prefetch_tokens"] == 200 * 64 and s["verify_failures"] == 0
    assert r.written_pages == 201  # every page after the HBM hit recomputed and backed up (200 known + 1 new)


def test_a_refused_write_back_is_counted_as_failed_write_pages(tmp_path, tiny_profile):
    keyer = PageKeyer(tiny_profile.page_size)
    system = make_system("flatcake", tiny_profile, 512, tmp_path, FC)
    real_set, calls = system.set, []

    def refuse_second(*a):  # the store accepts the first call, then is full
        calls.append(len(a[0]))
        return real_set(*a) if len(calls) == 1 else False

    system.set = refuse_second
    try:
        ecfg = EngineConfig(hbm_pages=0, host_pool_pages=512, prefetch_threshold_tokens=0,
                            prefetch_policy="wait_complete")
        measured = [req(0.0, list(range(300)))]
        lives = ServingModel(system, tiny_profile, ecfg, ServingConfig(qps=100.0)).run(
            measured, [keyer.keys(r) for r in measured])
    finally:
        system.close()
    s = serving_summary(lives, tiny_profile.page_size, 1.0)
    assert calls == [128, 128]  # 128 stored, the next 128 refused, the last 44 never tried
    assert s["written_pages"] == 128 and s["failed_write_pages"] == 172


def sweep(out, trace, systems, qps, scheduler="fcfs,mas"):
    """``flatcake-replay --qps`` into ``out``; returns the runs of its summary.json."""
    rc = main(["--trace", str(trace), "--systems", systems, "--out", str(out), "--qps", qps, "--scheduler", scheduler,
               "--no-progress"])
    assert rc == 0
    return json.loads((out / "summary.json").read_text())["runs"]


def test_cli_qps_sweep_writes_one_row_per_rate_scheduler_and_system(tmp_path, mooncake_path):
    out = tmp_path / "out"
    runs = sweep(out, mooncake_path, "flatcake,file", "20,40")
    assert [(r["qps"], r["scheduler"], r["system"]) for r in runs] == [
        (q, s, n) for q in (20.0, 40.0) for s in ("fcfs", "mas") for n in ("flatcake", "file")]
    assert all(r["requests"] == 5 and r["verify_failures"] == 0 for r in runs)
    md = (out / "summary.md").read_text()
    # 47 of 88 pages (48 seen before; r4, exactly 512 tokens, may reuse 7 of its 8: prompt - 1 tokens)
    assert "| 40 | mas | file |" in md and "ideal hit rate 53.41%" in md
    result = json.loads((out / "summary.json").read_text())
    assert result["ideal_hit_rate"] == pytest.approx(47 / 88)
    assert [p["qps"] for p in result["points"]] == [20.0, 40.0]
    assert sorted(result["points"][1]["systems"]) == ["file/fcfs", "file/mas", "flatcake/fcfs", "flatcake/mas"]
    for name in ("hit_rate_vs_qps.png", "ttft_vs_qps.png", "throughput_vs_qps.png", "hit_tokens_by_medium.png",
                 "ssd_prefetch_vs_qps.png", "read_amplification.png"):
        assert (out / name).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and f"]({name})" in md
    from flatcake.replay.sweep import read_amplification

    run = {"hit_tokens": {"ssd": 10 * 64}, "counters": {"ssd_read_bytes": 12 * PAGE_BYTES}}
    assert read_amplification(run, 64, PAGE_BYTES) == 1.2
    assert read_amplification({"hit_tokens": {"ssd": 0}, "counters": {}}, 64, PAGE_BYTES) is None
    # FlatCake served 2 of the 10 SSD pages from its write queue's in-memory copy: they count
    # as SSD hits by placement, but the denominator is the bytes it read from SSD
    run = {"hit_tokens": {"ssd": 10 * 64}, "counters": {"ssd_read_bytes": 12 * PAGE_BYTES,
                                                         "logical_read_bytes_ssd": 8 * PAGE_BYTES}}
    assert read_amplification(run, 64, PAGE_BYTES) == 1.5
    assert not (out / "flatcake-ssd").exists() and not (out / "hicache-file").exists()


@pytest.mark.parametrize("flags,msg", [(["--qps", "0"], "--qps"), (["--qps", "x"], "--qps"), (["--qps", "1,,4"], "--qps"),
                                       (["--qps", "1", "--scheduler", "lifo"], "--scheduler"),
                                       (["--scheduler", "lifo"], "--scheduler"), (["--scheduler", "fcfs"], "add --qps"),
                                       (["--qps", "1", "--ssd-restores", "0"], "--ssd-restores"),
                                       (["--systems", "flatcake,flatcake-fcfs"], "flatcake-fcfs differs from flatcake only under load")])
def test_bad_serving_flags_exit_2_naming_the_flag(tmp_path, mooncake_path, capsys, flags, msg):
    assert main(["--trace", str(mooncake_path), "--out", str(tmp_path / "o"), *flags]) == 2
    assert msg in capsys.readouterr().err


def test_flatcake_fcfs_runs_once_per_rate_under_fifo_beside_the_scheduler_sweep(tmp_path, mooncake_path):
    out = tmp_path / "out"
    runs = sweep(out, mooncake_path, "flatcake,flatcake-fcfs,dram-only", "20")
    assert [(r["scheduler"], r["system"]) for r in runs] == [
        ("fcfs", "flatcake"), ("fcfs", "dram-only"), ("mas", "flatcake"), ("mas", "dram-only"), ("fcfs", "flatcake-fcfs")]
    by = {(r["scheduler"], r["system"]): r for r in runs}
    # same backend, same trace: the same hits, up to a page or two a concurrent write-back races
    assert by[("fcfs", "flatcake-fcfs")]["delivered_hit_rate"] == pytest.approx(
        by[("mas", "flatcake")]["delivered_hit_rate"], abs=2 / 88)
    assert all(r["verify_failures"] == 0 for r in runs) and not any(out.glob("*-ssd"))


def test_turns_arriving_before_the_previous_answer_are_counted():
    from flatcake.replay.serving import Live, turns_before_previous_answer

    reqs = [req(0.0, [1], ns="weka:a"), req(0.1, [1, 2], ns="weka:a"), req(0.2, [9], ns="weka:b"),
            req(5.0, [1, 2, 3], ns="weka:a")]
    lives = [Live(i, (), 64, 1, q.arrival_s) for i, q in enumerate(reqs)]
    for r, first in zip(lives, (1.0, 2.0, 0.5, 6.0)):
        r.t_first = first
    assert turns_before_previous_answer(reqs, lives) == 1  # a's 2nd turn came before a's 1st answer


def test_a_sweep_table_shows_the_offered_rate_and_flags_a_squeezed_turn():
    from flatcake.replay.sweep import serving_markdown

    run = {"qps": 4.0, "scheduler": "mas", "system": "flatcake", "offered_qps": 1.25, "delivered_hit_rate": 0.5,
           "ttft_s": {"mean": 0.1, "p99": 0.2}, "queue_s": {"p99": 0.0}, "ssd_prefetch_s": {"p99": None},
           "dram_lane_wait_p99_s": None, "declined_prefetch_tokens": 0, "revoked_prefetch_tokens": 0,
           "tokens_per_s": 100.0, "verify_failures": 0, "requests": 6, "turns_before_previous_answer": 0}
    result = {"trace": "t", "requests": 6, "ideal_hit_rate": 0.5, "runs": [run]}
    md = serving_markdown(result)
    assert "| 4 | mas | flatcake | 1.25 | 50.00% |" in md and "Note:" not in md
    assert "up to 2 of 6 requests, at 4 QPS" in serving_markdown({**result, "runs": [{**run, "turns_before_previous_answer": 2}]})
