"""A real trace as token-id prompts for a real SGLang server (``scripts/serve_bench.py``).

**One page per hash id.** Every block id of a trace request becomes one page of ``page_size``
tokens whose ids are drawn from a generator seeded by the id's namespace and value
(:func:`page_tokens`), so two prompts share a token prefix exactly as long as they share block
ids from the start — the trace's ids are chained (an id stands for its block and everything
before it), so equal ids at a position mean equal prefixes, and SGLang's own page hashing then
finds the same reuse the trace records. The tokens after a request's last whole block (the
trace's partial last block, or WEKA's ``in`` beyond its blocks) become a tail of
``ceil(rest × page_size / block_tokens)`` tokens drawn from the request's own seed: computed,
never shared. Every trace token thus maps to ``page_size / block_tokens`` tokens, and the page
counts — what L3 stores, finds and reads — are the trace's.

**Slices** (both deterministic, read from ``../shared/traces/``, never copied):

* WEKA Claude Code sessions (:func:`weka_slice`): the first ``conversations`` conversations in
  archive order whose largest prompt has at most ``max_blocks`` blocks (the replay's
  ``max_context_tokens`` filter), sub-agents included; a conversation is a session.
* the Mooncake conversation trace (:func:`mooncake_slice`): the trace has no session ids, and its
  first requests share little beyond block 0 (every request starts with it); requests that share
  their first two ids share their first 1,024 tokens, and follow-ups come a median 123 s later
  with 90% of their blocks shared. A *prefix group* (the requests with the same second id, in
  arrival order) is taken as one conversation: the first ``groups`` groups with at least
  ``min_turns`` requests, at most ``max_turns`` each.

The arrival model is the replay's (:func:`flatcake.replay.arrivals.conversation_schedule`): the
rate sets when conversations start, turns keep their spacing scaled by ``think_time_scale`` and
wait for the previous turn's answer (the client does the waiting).
"""

from __future__ import annotations

import dataclasses
import hashlib
import math
import random
from dataclasses import dataclass
from pathlib import Path
from typing import Dict, List, Sequence

from flatcake.replay.arrivals import conversation_schedule
from flatcake.replay.traces import WEKA_BLOCK_TOKENS, TraceRequest, read_mooncake, read_weka
from flatcake.testing.serve_client import Turn
from flatcake.testing.tiny_model import SPECIAL_TOKENS

#: token ids are drawn from ``[FIRST_ID, VOCAB)``: no special tokens (the tiny model's vocabulary is 512)
FIRST_ID, VOCAB = len(SPECIAL_TOKENS), 400


def _rng(*parts: object) -> random.Random:
    digest = hashlib.sha256("/".join(map(str, parts)).encode()).digest()
    return random.Random(int.from_bytes(digest[:8], "little"))


def page_tokens(namespace: str, block_id: int, page_size: int) -> List[int]:
    """The ``page_size`` token ids standing for block ``block_id`` of ``namespace``."""
    rng = _rng("page", namespace, block_id)
    return [rng.randrange(FIRST_ID, VOCAB) for _ in range(page_size)]


@dataclass(frozen=True)
class Prompt:
    """One trace request as token ids: ``pages`` whole pages (one per block id) then a tail."""

    index: int
    session: str
    input_ids: tuple
    pages: int
    max_new_tokens: int
    arrival_s: float


def full_blocks(req: TraceRequest) -> int:
    """Leading blocks of ``req`` that are whole (Mooncake's last block may be partial)."""
    n = len(req.block_ids)
    if n and req.prompt_tokens < n * req.block_tokens:
        n = max(0, req.prompt_tokens // req.block_tokens)
    return n


def build_prompts(reqs: Sequence[TraceRequest], page_size: int, max_new_tokens: int) -> List[Prompt]:
    """Token-id prompts for ``reqs`` (module docstring); ``max_new_tokens`` caps each request's
    output (the trace's output length, at most this)."""
    out = []
    for i, q in enumerate(reqs):
        n = full_blocks(q)
        ids: List[int] = []
        for bid in q.block_ids[:n]:
            ids.extend(page_tokens(q.namespace, bid, page_size))
        rest = max(0, q.prompt_tokens - n * q.block_tokens)
        tail = math.ceil(rest * page_size / q.block_tokens)
        rng = _rng("tail", q.namespace, q.session, i)
        ids.extend(rng.randrange(FIRST_ID, VOCAB) for _ in range(tail))
        if not ids:  # an empty request still needs a token
            ids.append(rng.randrange(FIRST_ID, VOCAB))
        out.append(Prompt(index=i, session=q.session, input_ids=tuple(ids), pages=n,
                          max_new_tokens=max(1, min(int(q.output_tokens) or 1, max_new_tokens)),
                          arrival_s=q.arrival_s))
    return out


def weka_slice(path: str | Path, conversations: int, max_blocks: int) -> List[TraceRequest]:
    """The first ``conversations`` WEKA conversations of at most ``max_blocks`` blocks per prompt
    (in archive order; streamed from the archive, which stops once they are read)."""
    return read_weka(path, sessions=conversations, max_context_tokens=max_blocks * WEKA_BLOCK_TOKENS)


def mooncake_slice(path: str | Path, groups: int, min_turns: int = 2, max_turns: int = 8,
                   max_blocks: int = 256) -> List[TraceRequest]:
    """The first ``groups`` prefix groups (module docstring) of the Mooncake trace with at least
    ``min_turns`` requests of at most ``max_blocks`` blocks, each cut to its first ``max_turns``
    requests; a group's requests get ``session = "mooncake-group:<second id>"``. In arrival order."""
    reqs = read_mooncake(path)
    by_group: Dict[int, List[TraceRequest]] = {}
    for q in reqs:
        if len(q.block_ids) >= 2 and len(q.block_ids) <= max_blocks:
            by_group.setdefault(q.block_ids[1], []).append(q)
    chosen: List[TraceRequest] = []
    taken = 0
    for second, members in by_group.items():  # dicts keep insertion (= first arrival) order
        if len(members) < min_turns:
            continue
        chosen.extend(dataclasses.replace(q, session=f"mooncake-group:{second}") for q in members[:max_turns])
        taken += 1
        if taken >= groups:
            break
    chosen.sort(key=lambda q: q.arrival_s)
    return chosen


def schedule(reqs: Sequence[TraceRequest], prompts: Sequence[Prompt], qps: float,
             think_time_scale: float) -> List[Turn]:
    """The turns of one run at ``qps`` requests per second (the replay's arrival model)."""
    due = conversation_schedule(reqs, qps, think_time_scale)
    return [Turn(index=p.index, session=p.session, input_ids=p.input_ids, max_new_tokens=p.max_new_tokens,
                 due_s=d) for p, (d, _) in zip(prompts, due)]


def unique_pages(prompts: Sequence[Prompt], page_size: int) -> int:
    """Distinct whole pages over ``prompts`` (prefix-chained, as SGLang keys them): what an L3
    holding every page of the run stores, outputs aside."""
    seen = set()
    for p in prompts:
        h = hashlib.sha256()
        for k in range(len(p.input_ids) // page_size):
            h.update(bytes(str(p.input_ids[k * page_size:(k + 1) * page_size]), "ascii"))
            seen.add(h.copy().digest())
    return len(seen)


__all__ = ["Prompt", "build_prompts", "full_blocks", "mooncake_slice", "page_tokens", "schedule",
           "unique_pages", "weka_slice"]
