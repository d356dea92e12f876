"""FC-MAS (paper §3.2): DRAM-Ready FIFO by arrival, SSD-Preparing by HRRN over bytes, restored
requests re-enter by their original arrival time. A fake clock makes every order exact."""

from __future__ import annotations

import math

import pytest

from flatcake.config import load_config
from flatcake.gva.address import MEDIUM_SSD, encode_gva
from flatcake.mas import (
    SSD_BOUNDARY,
    Dispatch,
    MasRequest,
    MediumAwareScheduler,
    QueueKind,
    RestoreStart,
    hrrn_priority,
)

DRAM_GVA = 4096  # medium 0, node 0, offset 4096
SSD_GVA = encode_gva(MEDIUM_SSD, 0, 4096)


class FakeClock:
    def __init__(self, now_s: float = 0.0):
        self.now_s = now_s

    def __call__(self) -> float:
        return self.now_s


def dram(rid: str, arrival_s: float) -> MasRequest:
    return MasRequest.from_gvas(rid, arrival_s, [0, DRAM_GVA])


def ssd(rid: str, arrival_s: float, kv_bytes: int) -> MasRequest:
    return MasRequest.from_gvas(rid, arrival_s, [DRAM_GVA, SSD_GVA], kv_bytes)


def drain_ready(s: MediumAwareScheduler) -> list[str]:
    out = []
    while (d := s.pop_ready()) is not None:
        out.append(d.request.request_id)
    return out


def started(decisions: list[RestoreStart]) -> list[str]:
    return [d.request.request_id for d in decisions]


# ---- classification ---------------------------------------------------------------------------


def test_boundary_is_two_to_the_sixty():
    assert SSD_BOUNDARY == 1 << 60 == 2**60


@pytest.mark.parametrize(
    "gvas, kind",
    [
        ([2**60 - 1], QueueKind.DRAM_READY),
        ([2**60], QueueKind.SSD_PREPARING),
        ([0, 2**60 - 1, 5], QueueKind.DRAM_READY),
        ([0, 2**60, 5], QueueKind.SSD_PREPARING),  # one SSD page is enough: the slowest medium
        ([encode_gva(MEDIUM_SSD, 4095, 0), 0], QueueKind.SSD_PREPARING),
        ([], QueueKind.DRAM_READY),  # nothing cached: nothing to restore
    ],
)
def test_classification_by_max_gva(gvas, kind):
    s = MediumAwareScheduler(clock=FakeClock())
    req = MasRequest.from_gvas("r", 0.0, gvas, kv_bytes=4096)
    assert s.submit(req) is kind
    assert req.max_gva == (max(gvas) if gvas else None)


def test_ssd_request_without_bytes_is_rejected():
    s = MediumAwareScheduler(clock=FakeClock())
    with pytest.raises(ValueError, match="kv_bytes=0"):
        s.submit(MasRequest.from_gvas("r", 0.0, [SSD_GVA], kv_bytes=0))


def test_duplicate_request_id_is_rejected():
    s = MediumAwareScheduler(clock=FakeClock())
    s.submit(dram("a", 0.0))
    with pytest.raises(ValueError, match="already scheduled"):
        s.submit(ssd("a", 0.0, 10))


def test_zero_restore_slots_is_rejected():
    with pytest.raises(ValueError, match="max_concurrent_restores"):
        MediumAwareScheduler(0)


def test_hrrn_priority_formula():
    assert hrrn_priority(0.0, 100) == 1.0
    assert hrrn_priority(2.0, 4) == 1.5
    with pytest.raises(ValueError):
        hrrn_priority(1.0, 0)


def test_from_config_uses_cio_windows_as_restore_slots():
    cfg = load_config(None, {"cio.windows": 3})
    assert MediumAwareScheduler.from_config(cfg, FakeClock()).max_concurrent_restores == 3


# ---- DRAM-Ready ---------------------------------------------------------------------------------


def test_dram_ready_is_fifo_by_arrival_not_submit_order():
    clock = FakeClock(10.0)
    s = MediumAwareScheduler(clock=clock)
    s.submit(dram("late", 3.0))
    s.submit(dram("early", 1.0))
    s.submit(dram("mid", 2.0))
    d = s.pop_ready()
    assert d == Dispatch(dram("early", 1.0), 10.0, 9.0, False)
    assert drain_ready(s) == ["mid", "late"]
    assert s.pop_ready() is None


def test_equal_arrivals_keep_submit_order():
    s = MediumAwareScheduler(clock=FakeClock())
    for rid in "xyz":
        s.submit(dram(rid, 1.0))
    assert drain_ready(s) == ["x", "y", "z"]


def test_dram_request_never_queues_behind_an_ssd_restore():
    clock = FakeClock(0.0)
    s = MediumAwareScheduler(1, clock)
    s.submit(ssd("big", 0.0, 1 << 30))
    assert started(s.start_restores()) == ["big"]
    s.submit(ssd("waiting", 0.0, 1 << 20))
    assert s.start_restores() == []  # the only slot is busy
    assert s.restoring_count == 1 and s.preparing_count == 1
    clock.now_s = 1.0
    s.submit(dram("d", 1.0))
    d = s.pop_ready()
    assert d is not None and d.request.request_id == "d"
    assert d.wait_s == 0.0 and d.restored is False
    # both SSD requests are still in their queues: the DRAM request went past them
    assert s.restoring_count == 1 and s.preparing_count == 1
    assert s.pop_ready() is None


# ---- SSD-Preparing: HRRN ------------------------------------------------------------------------


def test_equal_wait_smaller_kv_bytes_restores_first():
    clock = FakeClock(0.0)
    s = MediumAwareScheduler(1, clock)
    s.submit(ssd("filler", 0.0, 1))
    assert started(s.start_restores()) == ["filler"]
    for rid, kv in [("c300", 300), ("a100", 100), ("b200", 200)]:
        s.submit(ssd(rid, 0.0, kv))
    order = []
    current = "filler"
    for t in (1.0, 2.0, 3.0):
        clock.now_s = t
        s.finish_restore(current)
        (dec,) = s.start_restores()
        current = dec.request.request_id
        order.append(current)
    assert order == ["a100", "b200", "c300"]


def test_restore_start_reports_wait_and_priority():
    clock = FakeClock(0.0)
    s = MediumAwareScheduler(1, clock)
    s.submit(ssd("r", 0.5, 8))
    clock.now_s = 4.5
    (dec,) = s.start_restores()
    assert dec == RestoreStart(ssd("r", 0.5, 8), 4.5, 4.0, 1.5)


def test_free_slots_are_filled_by_priority_and_capped():
    clock = FakeClock(10.0)
    s = MediumAwareScheduler(2, clock)
    s.submit(ssd("p_1.5", 0.0, 20))  # 1 + 10/20  = 1.5
    s.submit(ssd("p_2.0", 0.0, 10))  # 1 + 10/10  = 2.0
    s.submit(ssd("p_1.1", 0.0, 100))  # 1 + 10/100 = 1.1
    decs = s.start_restores()
    assert started(decs) == ["p_2.0", "p_1.5"]
    assert [d.priority for d in decs] == [2.0, 1.5]
    assert s.start_restores() == []  # both slots busy
    s.finish_restore("p_1.5")
    assert started(s.start_restores()) == ["p_1.1"]


def test_big_restore_beats_new_small_ones_at_the_exact_crossover():
    """One slot; each restore holds it 1 s. A big request (B bytes) arrives at t=0; before every
    decision at t=k a fresh small request (s bytes) arrives at k - w. At t=k the small one has
    priority 1 + w/s, the big one 1 + k/B, so the big one wins at the first k with k/B > w/s:
    k* = floor(w*B/s) + 1."""
    big_bytes, small_bytes, small_wait_s = 10_000, 300, 0.5
    crossover = math.floor(small_wait_s * big_bytes / small_bytes) + 1
    assert crossover == 17

    clock = FakeClock(0.0)
    s = MediumAwareScheduler(1, clock)
    s.submit(ssd("filler", 0.0, 1))
    assert started(s.start_restores()) == ["filler"]
    s.submit(ssd("big", 0.0, big_bytes))
    winners = []
    current = "filler"
    for k in range(1, 25):
        clock.now_s = k - small_wait_s
        s.submit(ssd(f"small{k}", k - small_wait_s, small_bytes))
        clock.now_s = float(k)
        s.finish_restore(current)
        (dec,) = s.start_restores()
        current = dec.request.request_id
        winners.append(current)
        if current == "big":
            assert dec.priority == 1 + k / big_bytes
            assert dec.priority > 1 + small_wait_s / small_bytes
            break
    assert winners == [f"small{k}" for k in range(1, crossover)] + ["big"]
    assert len(winners) == crossover
    # the small request that lost at the crossover goes next
    clock.now_s = crossover + 1.0
    s.finish_restore("big")
    assert started(s.start_restores()) == [f"small{crossover}"]


def test_tie_in_priority_goes_to_earlier_arrival():
    clock = FakeClock(4.0)
    s = MediumAwareScheduler(1, clock)
    s.submit(ssd("later", 2.0, 100))  # 1 + 2/100 = 1.02
    s.submit(ssd("earlier", 0.0, 200))  # 1 + 4/200 = 1.02
    assert started(s.start_restores()) == ["earlier"]


# ---- re-entry by original arrival ----------------------------------------------------------------


def test_finished_restore_reenters_by_original_arrival_time():
    clock = FakeClock(0.0)
    s = MediumAwareScheduler(1, clock)
    s.submit(dram("d_before", -1.0))  # arrived before the SSD request
    s.submit(ssd("a", 0.0, 4096))
    assert started(s.start_restores()) == ["a"]
    clock.now_s = 1.0
    s.submit(dram("b_after", 1.0))
    clock.now_s = 2.0
    s.submit(dram("c_after", 2.0))
    clock.now_s = 3.0
    s.finish_restore("a")
    assert s.restoring_count == 0
    dispatches = []
    while (d := s.pop_ready()) is not None:
        dispatches.append(d)
    assert [d.request.request_id for d in dispatches] == ["d_before", "a", "b_after", "c_after"]
    assert dispatches[1] == Dispatch(ssd("a", 0.0, 4096), 3.0, 3.0, True)


def test_finish_restore_of_unknown_request_raises():
    s = MediumAwareScheduler(clock=FakeClock())
    s.submit(ssd("a", 0.0, 10))
    with pytest.raises(KeyError, match="not restoring"):
        s.finish_restore("a")  # still waiting, not restoring
    with pytest.raises(KeyError):
        s.finish_restore("nope")


def test_request_id_reusable_after_dispatch():
    s = MediumAwareScheduler(clock=FakeClock())
    s.submit(dram("a", 0.0))
    assert drain_ready(s) == ["a"]
    assert s.submit(dram("a", 1.0)) is QueueKind.DRAM_READY


def test_cancel_removes_waiting_and_ready_requests_only():
    s = MediumAwareScheduler(1, FakeClock())
    s.submit(ssd("r", 0.0, 10))
    s.submit(ssd("w", 0.0, 20))
    s.submit(dram("d1", 0.0))
    s.submit(dram("d2", 1.0))
    assert started(s.start_restores()) == ["r"]
    assert s.cancel("r") is False  # restoring
    assert s.cancel("w") is True
    assert s.cancel("d1") is True
    assert s.cancel("missing") is False
    assert s.preparing_count == 0
    assert drain_ready(s) == ["d2"]
