"""The serving replay's arrival model (flatcake.replay.arrivals): the rate sets when conversations
start, turns keep their own spacing, and a turn is never released before the previous turn of its
conversation is answered — checked on the pure schedule and on a real ServingModel run."""

import dataclasses

import pytest

from flatcake.replay.arrivals import conversation_schedule, offered_qps
from flatcake.replay.engine import EngineConfig
from flatcake.replay.keys import PageKeyer
from flatcake.replay.serving import ServingConfig, ServingModel, serve
from flatcake.replay.systems import make_system
from flatcake.replay.traces import TraceRequest
from replay_fixtures import tiny_profile  # noqa: F401  (pytest fixture)


def req(at, session, blocks=(1, 2), ns=None):
    return TraceRequest(at, ns or session, session, tuple(blocks), 64, len(blocks) * 64 + 32, 4)


@pytest.mark.parametrize("qps", [0.3, 1.0, 7.0, 1000.0])
def test_one_request_per_session_reproduces_the_old_scaled_times_exactly(qps):
    times = [1.7, 2.05, 2.05, 3.3, 10.123, 11.0]  # Mooncake: every request its own session
    reqs = [req(t, f"request-{i}", ns="mooncake:x") for i, t in enumerate(times)]
    native = (len(times) - 1) / (times[-1] - times[0])
    old = [(t - times[0]) * (native / qps) for t in times]  # the previous model, bit for bit
    assert conversation_schedule(reqs, qps) == [(t, None) for t in old]


@pytest.mark.parametrize("qps", [0.1, 1.0, 1000.0])
def test_a_conversation_keeps_its_turn_gaps_at_any_rate(qps):
    reqs = [req(0.0, "a"), req(60.0, "b"), req(64.0, "a"), req(70.5, "b"), req(73.0, "a")]
    sched = conversation_schedule(reqs, qps)
    assert [d for _, d in sched] == [None, None, 0, 1, 2]  # the previous turn of the same session
    due = [t for t, _ in sched]
    assert due[0] == 0.0 and due[2] - due[0] == pytest.approx(64.0) and due[4] - due[2] == pytest.approx(9.0)
    assert due[3] - due[1] == pytest.approx(10.5)


def test_think_time_scale_compresses_only_the_gaps_inside_a_conversation():
    reqs = [req(0.0, "a"), req(60.0, "b"), req(64.0, "a"), req(70.5, "b"), req(73.0, "a")]
    full, fast = conversation_schedule(reqs, 1.0), conversation_schedule(reqs, 1.0, think_time_scale=0.05)
    assert [d for _, d in fast] == [d for _, d in full]
    assert fast[0][0] == full[0][0] == 0.0 and fast[1][0] == pytest.approx(full[1][0])  # starts unchanged
    assert fast[2][0] == pytest.approx(64.0 * 0.05) and fast[4][0] == pytest.approx(73.0 * 0.05)
    assert fast[3][0] - fast[1][0] == pytest.approx(10.5 * 0.05)
    with pytest.raises(ValueError, match="think_time_scale"):
        conversation_schedule(reqs, 1.0, think_time_scale=-1.0)


def test_conversations_start_at_the_rate_divided_by_their_mean_length():
    # 2 conversations, 6 requests: at 30 requests/s they start at 10 per second, 0.1 s apart
    reqs = sorted([req(t, "a") for t in (0.0, 0.001, 0.002)] + [req(t, "b") for t in (60.0, 60.3, 60.6)],
                  key=lambda r: r.arrival_s)
    due = [t for t, _ in conversation_schedule(reqs, 30.0)]
    assert due == pytest.approx([0.0, 0.001, 0.002, 0.1, 0.4, 0.7])


def test_one_conversation_or_none_is_not_scaled_and_bad_rates_are_refused():
    reqs = [req(5.0, "a"), req(5.5, "a"), req(9.0, "a")]
    assert conversation_schedule(reqs, 100.0) == [(0.0, None), (0.5, 0), (4.0, 1)]
    assert conversation_schedule([], 1.0) == []
    with pytest.raises(ValueError, match="qps"):
        conversation_schedule(reqs, 0.0)


def test_offered_rate_counts_gaps_over_the_span():
    assert offered_qps([0.0, 1.0, 2.0, 4.0]) == 0.75
    assert offered_qps([3.0]) is None and offered_qps([]) is None and offered_qps([1.0, 1.0]) is None


def test_a_turn_waits_for_the_previous_answer_and_otherwise_keeps_its_own_time(tmp_path, tiny_profile):
    """Conversation ``a``'s turns are 1 ms apart natively, far less than an answer (four modelled
    GPU steps of >= 5 ms): each waits for the previous one's last token. Conversation ``b``'s are
    300 ms apart, more than an answer: they arrive at their own times."""
    profile = dataclasses.replace(tiny_profile, params=1e9)
    a = [req(t, "weka:a", blocks=range(4 * k + 4)) for k, t in enumerate((0.0, 0.001, 0.002))]
    b = [req(t, "weka:b", blocks=range(100, 104 + 4 * k)) for k, t in enumerate((60.0, 60.3, 60.6))]
    reqs = sorted(a + b, key=lambda r: r.arrival_s)
    keyer = PageKeyer(profile.page_size)
    system = make_system("recompute", profile, 512, tmp_path, {})
    try:
        ecfg = EngineConfig(hbm_pages=0, host_pool_pages=512, prefetch_threshold_tokens=0)
        cfg = ServingConfig(qps=30.0)
        lives = ServingModel(system, profile, ecfg, cfg).run(reqs, [keyer.keys(r) for r in reqs])
        s = serve(system, profile, ecfg, cfg, reqs, [keyer.keys(r) for r in reqs])  # the summary of a second run
    finally:
        system.close()
    la, lb = lives[:3], lives[3:]
    for prev, nxt in zip(la, la[1:]):
        assert prev.t_done - prev.arrival >= 0.02 and nxt.arrival >= prev.t_done  # released by the answer
    assert lb[0].arrival - la[0].arrival == pytest.approx(0.1, abs=0.03)  # b starts at 30 / 3 per second
    for prev, nxt in zip(lb, lb[1:]):
        assert prev.t_done < prev.arrival + 0.3 and nxt.arrival - prev.arrival == pytest.approx(0.3, abs=0.03)
    assert s["turns_before_previous_answer"] == 0 and s["requests"] == 6 and s["qps"] == 30.0
    # 5 gaps over b's last turn at ~0.7 s: the slice is offered ~7 requests/s, not 30 (b runs on)
    assert s["offered_qps"] == pytest.approx(5 / 0.7, rel=0.1)
