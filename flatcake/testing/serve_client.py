"""A streaming client for a real SGLang server, and an open-loop replay of conversations against it
(``scripts/serve_bench.py``).

:func:`stream_generate` sends one ``POST /generate`` with token ids and ``"stream": true`` and
measures **TTFT** on the client: from just before the request is sent to the first streamed chunk
that carries an output token. It reads what SGLang reports about the prompt from the chunks'
``meta_info`` (the server needs ``--enable-cache-report`` and ``--enable-metrics``, which
:class:`~flatcake.testing.server.ServerSpec` always passes):

* ``cached_tokens_details``: the prompt tokens served from the device pool, the host pool and L3
  storage (``{"device", "host", "storage"}``; absent when nothing was cached);
* ``storage_prefetch_wait``: seconds the scheduler held the request waiting for its L3 prefetch
  (SGLang polls the prefetch each scheduler step and accumulates from the first blocked poll to
  the ready one), and ``storage_staging_wait`` (waiting for host-pool staging); with the
  ``wait_complete`` prefetch policy their sum is the storage part of the request's TTFT;
* ``queue_time``: seconds in SGLang's waiting queue (the storage waits are inside it).

:func:`replay` runs conversations open-loop: each conversation has its own thread, which sends
its turns in order, each no earlier than its due time (:func:`flatcake.replay.arrivals.conversation_schedule`)
and no earlier than the previous turn's last token — the replay's arrival model, on a real
server. Nothing here knows about traces or storage backends.
"""

from __future__ import annotations

import json
import threading
import time
from dataclasses import asdict, dataclass, field
from typing import Dict, List, Optional, Sequence

import requests

#: a request that has not answered within this many seconds counts as an error
DEFAULT_TIMEOUT_S = 180.0


@dataclass
class Answer:
    """One streamed request as the client saw it (times in seconds).

    ``ttft_s``: send → first chunk with an output token; ``e2e_s``: send → last chunk;
    ``cached``: ``{"device", "host", "storage"}`` prompt tokens SGLang served from each tier;
    ``storage_wait_s``: ``storage_prefetch_wait + storage_staging_wait`` (None when the server
    did not report them); ``error``: why the request failed (None when it succeeded)."""

    index: int = -1
    session: str = ""
    due_s: float = 0.0
    sent_s: float = 0.0
    ttft_s: Optional[float] = None
    e2e_s: Optional[float] = None
    prompt_tokens: int = 0
    output_tokens: int = 0
    cached: Dict[str, int] = field(default_factory=lambda: {"device": 0, "host": 0, "storage": 0})
    storage_wait_s: Optional[float] = None
    queue_s: Optional[float] = None
    error: Optional[str] = None

    def to_dict(self) -> dict:
        return asdict(self)


def _parse_meta(answer: Answer, meta: dict) -> None:
    answer.prompt_tokens = int(meta.get("prompt_tokens") or answer.prompt_tokens)
    answer.output_tokens = int(meta.get("completion_tokens") or answer.output_tokens)
    details = meta.get("cached_tokens_details") or {}
    for tier in ("device", "host", "storage"):
        answer.cached[tier] = int(details.get(tier, 0) or 0)
    waits = [meta.get(k) for k in ("storage_prefetch_wait", "storage_staging_wait")]
    if any(w is not None for w in waits):
        answer.storage_wait_s = float(sum(w or 0.0 for w in waits))
    if meta.get("queue_time") is not None:
        answer.queue_s = float(meta["queue_time"])


def stream_generate(url: str, input_ids: Sequence[int], max_new_tokens: int,
                    timeout_s: float = DEFAULT_TIMEOUT_S, session: Optional[requests.Session] = None,
                    answer: Optional[Answer] = None) -> Answer:
    """Stream one greedy ``/generate`` (``ignore_eos``, so exactly ``max_new_tokens`` tokens) and
    measure it. Never raises for a failed request: the :class:`Answer` carries the ``error``."""
    answer = answer or Answer()
    payload = {"input_ids": list(input_ids), "stream": True,
               "sampling_params": {"max_new_tokens": int(max_new_tokens), "temperature": 0.0, "ignore_eos": True}}
    http = session or requests
    start = time.perf_counter()
    answer.sent_s = time.monotonic()
    try:
        with http.post(url + "/generate", json=payload, stream=True, timeout=timeout_s) as r:
            if r.status_code != 200:
                answer.error = f"HTTP {r.status_code}: {r.text[:300]}"
                return answer
            for line in r.iter_lines():
                if not line or not line.startswith(b"data:"):
                    continue
                data = line[5:].strip()
                if data == b"[DONE]":
                    break
                chunk = json.loads(data)
                if "error" in chunk:
                    answer.error = f"server error: {str(chunk['error'])[:300]}"
                    return answer
                if answer.ttft_s is None and chunk.get("output_ids"):
                    answer.ttft_s = time.perf_counter() - start
                if chunk.get("meta_info"):
                    _parse_meta(answer, chunk["meta_info"])
                if time.perf_counter() - start > timeout_s:
                    answer.error = f"no last token within {timeout_s:.0f} s"
                    return answer
        answer.e2e_s = time.perf_counter() - start
        if answer.ttft_s is None:
            answer.error = "the stream ended without an output token"
    except (requests.RequestException, ValueError) as e:
        answer.error = f"{type(e).__name__}: {e}"[:300]
    return answer


@dataclass(frozen=True)
class Turn:
    """One request to replay: its position in the run, its conversation, its token ids, how many
    tokens to generate, and when it is due (seconds after the run starts)."""

    index: int
    session: str
    input_ids: tuple
    max_new_tokens: int
    due_s: float


def replay(url: str, turns: Sequence[Turn], timeout_s: float = DEFAULT_TIMEOUT_S) -> List[Answer]:
    """Send ``turns`` open-loop and return one :class:`Answer` per turn, in ``turns`` order.

    One thread per conversation (``Turn.session``) sends that conversation's turns in ``index``
    order, each at ``max(due_s, previous turn's last token)``. A failed turn does not stop its
    conversation (the next turn is still sent, as a user would retry)."""
    by_session: Dict[str, List[Turn]] = {}
    for t in sorted(turns, key=lambda t: t.index):
        by_session.setdefault(t.session, []).append(t)
    answers: Dict[int, Answer] = {}
    t0 = time.monotonic() + 0.05

    def conversation(own: List[Turn]) -> None:
        with requests.Session() as http:
            for t in own:
                delay = t0 + t.due_s - time.monotonic()
                if delay > 0:
                    time.sleep(delay)
                a = Answer(index=t.index, session=t.session, due_s=t.due_s)
                stream_generate(url, t.input_ids, t.max_new_tokens, timeout_s, http, a)
                a.sent_s -= t0
                answers[t.index] = a

    threads = [threading.Thread(target=conversation, args=(own,), name=f"conv-{i}", daemon=True)
               for i, own in enumerate(by_session.values())]
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    return [answers[t.index] for t in turns]


__all__ = ["Answer", "DEFAULT_TIMEOUT_S", "Turn", "replay", "stream_generate"]
