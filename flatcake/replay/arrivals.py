"""Arrival model of the concurrent serving replay: the rate sets when conversations start; the
turns of one conversation keep their own spacing and wait for the previous turn's answer.

A *conversation* is the requests sharing :attr:`~flatcake.replay.traces.TraceRequest.session`:
one WEKA conversation, its sub-agents' requests included (they are sequential in the trace), or
a single Mooncake request (``session`` ``"request-<i>"``). With ``N`` requests in ``C``
conversations and ``R`` = ``qps`` (requests per second offered):

* conversation ``c`` starts at its first arrival ``s_c``; the starts are shifted so the first one
  is at 0 and scaled by ``scale = native / (R × C / N)``, where ``native = (C − 1) / (max s_c −
  min s_c)`` is the trace's own rate of conversation starts. Conversations thus start at
  ``R × C / N`` per second — ``R`` divided by the mean requests per conversation — so the
  conversations offer ``R`` requests per second in the long run. With one request per
  conversation (``C = N``, Mooncake) this is exactly the old model: every arrival scaled by
  ``((N − 1) / span) / R``. With one conversation, or all starting together, nothing is scaled;
* a request of conversation ``c`` is due at ``scale × (s_c − min s) + think × (arrival − s_c)``:
  its own offset from the conversation's start, unscaled by the rate. ``think`` (the replay's
  ``think_time_scale``, default 1) compresses the users' think time between turns: a WEKA slice
  has turns a median 13 s apart and conversations up to ~500 s long, so with ``think`` = 1 a
  small slice is offered about the same load at any rate (its length bounds the run);
* and it is released no earlier than the previous request of its conversation is answered
  (its last token): ``max(due, previous answer)``. The serving model does the waiting
  (:meth:`flatcake.replay.serving.ServingModel.run`); this module only computes the schedule.

The offered rate a finite slice actually sees (``offered_qps`` of a serving summary) is lower
than ``R`` when conversations run on after the last one started: their turns keep their native
spacing and wait for answers.
"""

from __future__ import annotations

from typing import Optional, Sequence

from flatcake.replay.traces import TraceRequest


def conversation_schedule(reqs: Sequence[TraceRequest], qps: float,
                          think_time_scale: float = 1.0) -> list[tuple[float, Optional[int]]]:
    """When each request is due, and which request it waits for.

    Args:
        reqs: the requests in arrival order (as the trace readers return them);
            ``arrival_s`` in seconds.
        qps: requests per second offered (see the module docstring for how it sets the
            conversations' starts).
        think_time_scale: factor on each request's offset from its conversation's start (1.0:
            the trace's own spacing; 0.05 compresses a 13 s gap between turns to 0.65 s). A
            turn still waits for the previous answer.

    Returns:
        Per request, ``(due_s, depends_on)``: ``due_s`` seconds after the replay starts (the first
        conversation's start is 0), and ``depends_on`` the index in ``reqs`` of the previous
        request of the same conversation — to be answered before this one is released — or
        ``None`` for a conversation's first request.

    Raises:
        ValueError: ``qps`` <= 0 or ``think_time_scale`` < 0.
    """
    if qps <= 0:
        raise ValueError(f"qps must be > 0 (got {qps})")
    if think_time_scale < 0:
        raise ValueError(f"think_time_scale must be >= 0 (got {think_time_scale})")
    starts: dict[str, float] = {}
    last: dict[str, int] = {}
    deps: list[Optional[int]] = []
    for i, q in enumerate(reqs):
        starts[q.session] = min(starts.get(q.session, q.arrival_s), q.arrival_s)
        deps.append(last.get(q.session))
        last[q.session] = i
    if not reqs:
        return []
    first = min(starts.values())
    span = max(starts.values()) - first
    n_conv = len(starts)
    # C / N is exactly 1.0 for one-request conversations: the old scale, bit for bit
    scale = ((n_conv - 1) / span) / (qps * (n_conv / len(reqs))) if span > 0 else 1.0
    out = []
    for q, dep in zip(reqs, deps):
        s = starts[q.session]
        out.append(((s - first) * scale + (q.arrival_s - s) * think_time_scale, dep))
    return out


def offered_qps(arrivals: Sequence[float]) -> Optional[float]:
    """Requests per second a run was offered: ``(n − 1) / (last − first arrival)`` over the
    arrival times (seconds) it really had; ``None`` with fewer than two arrivals or a zero span.
    ``n − 1`` gaps over the span, as the trace's native rate is counted, so a Mooncake run at
    ``--qps R`` reports ``R`` up to timer jitter."""
    if len(arrivals) < 2:
        return None
    span = max(arrivals) - min(arrivals)
    return (len(arrivals) - 1) / span if span > 0 else None


def turns_before_previous_answer(reqs: Sequence[TraceRequest], lives: Sequence) -> int:
    """Requests that arrived before the previous request of their conversation (same
    ``session``: a WEKA conversation) had its first token — what a real chat cannot do.

    ``lives`` are the runs' records (:class:`~flatcake.replay.serving.Live`: ``arrival`` and
    ``t_first``, seconds), one per request of ``reqs``. A check on the arrival model: the serving
    model releases a turn only after the previous one's last token, so a run counts 0 (the
    previous model, which scaled every arrival by ``native rate / qps``, squeezed turns at high
    rates). Always 0 for a Mooncake trace (one session per request)."""
    last: dict = {}
    n = 0
    for q, r in sorted(zip(reqs, lives), key=lambda p: p[1].arrival):
        prev = last.get(q.session)
        if prev is not None and r.arrival < prev.t_first:
            n += 1
        last[q.session] = r
    return n


__all__ = ["conversation_schedule", "offered_qps", "turns_before_previous_answer"]
