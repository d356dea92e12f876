"""Trace readers: turn a public request trace into :class:`TraceRequest` objects in arrival order.

Two formats (see ``../shared/traces/README.md``):

* **Mooncake JSONL** (``*.jsonl``): one request per line with ``timestamp`` (ms), ``input_length``
  and ``output_length`` (tokens) and ``hash_ids`` — one id per 512-token block, chained (an id
  stands for its block *and* everything before it) and global within the file. All requests share
  one id namespace (the file's stem).
* **WEKA Claude Code archive** (``*.tar.xz`` / ``*.tar``): one JSON object per conversation
  (``traces/trace_NNNN.json``); each request has ``t`` (seconds since the conversation began),
  ``in``/``out`` (tokens) and ``hash_ids`` over 64-token blocks, numbered **locally** per
  conversation. Sub-agents (``type: "subagent"``) nest a whole ``requests[]`` whose ``t`` is
  relative to the marker's ``t``; they share their parent's id numbering, so ids are qualified by
  the conversation (namespace = conversation id) and a sub-agent's requests join the parent's
  namespace. The archive is streamed (``tarfile`` mode ``r|xz``), never unpacked, and reading
  stops as soon as the requested number of conversations has been read.

Arrival mix for WEKA (conversations carry no absolute time): conversation ``k`` (0-based, archive
order) starts at ``k * session_gap_s`` seconds; each request arrives at
``start + t`` (sub-agent requests at ``start + t_marker + t_sub``). All requests are then sorted by
arrival time (stable: ties keep conversation order, then request order).
"""

from __future__ import annotations

import json
import tarfile
from dataclasses import dataclass
from pathlib import Path
from typing import Iterable, Iterator, Optional, Sequence


class TraceFormatError(ValueError):
    """The trace file cannot be read as a Mooncake JSONL or WEKA archive (message names it)."""

MOONCAKE_BLOCK_TOKENS = 512  # tokens per Mooncake hash_id block
WEKA_BLOCK_TOKENS = 64  # tokens per WEKA hash_id block (the files' block_size)


@dataclass(frozen=True)
class TraceRequest:
    """One request of a trace.

    Attributes:
        arrival_s: arrival time in seconds from the start of the replay.
        namespace: id namespace (``"mooncake:<file stem>"`` or ``"weka:<conversation id>"``);
            block ids are only comparable within one namespace.
        session: conversation/session label for reports (same as ``namespace`` for WEKA;
            ``"request-<i>"`` for Mooncake, which has no session ids).
        block_ids: the trace's chained block ids, in prompt order.
        block_tokens: tokens per block (512 Mooncake, 64 WEKA).
        prompt_tokens: prompt length in tokens as the trace reports it (may exceed
            ``len(block_ids) * block_tokens`` by a partial tail; Mooncake's last block may be
            partial).
        output_tokens: generated tokens.
        subagent: True for a request inside a WEKA sub-agent.
    """

    arrival_s: float
    namespace: str
    session: str
    block_ids: tuple[int, ...]
    block_tokens: int
    prompt_tokens: int
    output_tokens: int
    subagent: bool = False


def read_mooncake(path: str | Path, max_requests: Optional[int] = None) -> list[TraceRequest]:
    """Read a Mooncake JSONL trace.

    Args:
        path: the ``.jsonl`` file.
        max_requests: stop after this many requests (``None``: all).

    Returns:
        Requests in file (= arrival) order; ``arrival_s = timestamp / 1000``.
    """
    p = Path(path)
    ns = f"mooncake:{p.stem}"
    out: list[TraceRequest] = []
    with p.open("r") as f:
        for i, line in enumerate(f):
            if max_requests is not None and len(out) >= max_requests:
                break
            line = line.strip()
            if not line:
                continue
            r = json.loads(line)
            out.append(
                TraceRequest(
                    arrival_s=float(r["timestamp"]) / 1000.0,
                    namespace=ns,
                    session=f"request-{i}",
                    block_ids=tuple(int(x) for x in r["hash_ids"]),
                    block_tokens=MOONCAKE_BLOCK_TOKENS,
                    prompt_tokens=int(r["input_length"]),
                    output_tokens=int(r["output_length"]),
                )
            )
    return out


def _weka_conversation_requests(conv: dict, start_s: float) -> list[TraceRequest]:
    """Flatten one WEKA conversation (sub-agents included) into requests with absolute times."""
    cid = str(conv.get("id"))
    ns = f"weka:{cid}"
    block = int(conv.get("block_size", WEKA_BLOCK_TOKENS))
    out: list[TraceRequest] = []

    def walk(reqs: Sequence[dict], t0: float, sub: bool) -> None:
        for r in reqs:
            if r.get("type") == "subagent":
                walk(r.get("requests", []), t0 + float(r.get("t", 0.0)), True)
                continue
            ids = tuple(int(x) for x in r.get("hash_ids", []))
            out.append(
                TraceRequest(
                    arrival_s=t0 + float(r.get("t", 0.0)),
                    namespace=ns,
                    session=ns,
                    block_ids=ids,
                    block_tokens=block,
                    # `in` uses another tokenizer than the ids; never below the blocks' tokens
                    prompt_tokens=max(int(r.get("in", 0)), len(ids) * block),
                    output_tokens=int(r.get("out", 0)),
                    subagent=sub,
                )
            )

    walk(conv.get("requests", []), start_s, False)
    return out


def iter_weka_conversations(path: str | Path) -> Iterator[dict]:
    """Yield WEKA conversation objects from a ``.tar.xz``/``.tar`` archive (streamed) or a
    directory of ``*.json`` files (sorted by name), in archive order."""
    p = Path(path)
    if p.is_dir():
        for f in sorted(p.rglob("*.json")):
            yield json.loads(f.read_text())
        return
    mode = "r|xz" if p.name.endswith((".xz", ".txz")) else "r|*"
    with tarfile.open(p, mode) as tf:
        for m in tf:
            if not m.isfile() or not m.name.endswith(".json"):
                continue
            fobj = tf.extractfile(m)
            if fobj is None:
                continue
            yield json.loads(fobj.read())


#: seconds between the starts of consecutive WEKA conversations (the arrival mix), by default
DEFAULT_SESSION_GAP_S = 60.0


def read_weka(
    path: str | Path,
    *,
    sessions: Optional[int] = None,
    session_gap_s: float = DEFAULT_SESSION_GAP_S,
    max_requests: Optional[int] = None,
    skip_sessions: int = 0,
    max_context_tokens: Optional[int] = None,
) -> list[TraceRequest]:
    """Read the first ``sessions`` conversations of a WEKA archive and interleave them.

    Args:
        path: ``kv_cache_tester_traces_*.tar.xz`` (or a directory of conversation JSON files).
        sessions: conversations to read, in archive order (``None``: all).
        session_gap_s: seconds between consecutive conversations' starts (the arrival mix).
        max_requests: keep the first this many requests in arrival order (``None``: all).
        skip_sessions: conversations to skip at the start of the archive.
        max_context_tokens: skip conversations whose largest prompt (``len(hash_ids) * 64``
            tokens) exceeds this (``None``: keep all); bounds the bytes a replay writes.

    Returns:
        Requests sorted by ``arrival_s`` (stable).
    """
    reqs: list[TraceRequest] = []
    k = 0
    for i, conv in enumerate(iter_weka_conversations(path)):
        if i < skip_sessions:
            continue
        if sessions is not None and k >= sessions:
            break
        conv_reqs = _weka_conversation_requests(conv, k * float(session_gap_s))
        if max_context_tokens is not None and any(
            len(r.block_ids) * r.block_tokens > max_context_tokens for r in conv_reqs
        ):
            continue
        reqs.extend(conv_reqs)
        k += 1
    reqs.sort(key=lambda r: r.arrival_s)
    return reqs[:max_requests] if max_requests is not None else reqs


def detect_format(path: str | Path) -> str:
    """``"mooncake"`` for ``*.jsonl``, ``"weka"`` for archives and directories."""
    p = Path(path)
    if p.name.endswith(".jsonl"):
        return "mooncake"
    if p.is_dir() or p.name.endswith((".tar.xz", ".txz", ".tar", ".tar.gz", ".tgz")):
        return "weka"
    raise TraceFormatError(f"unknown trace format for {p} (expected .jsonl or a .tar.xz archive)")


def load_trace(
    path: str | Path,
    *,
    max_requests: Optional[int] = None,
    sessions: Optional[int] = None,
    session_gap_s: float = DEFAULT_SESSION_GAP_S,
    skip_sessions: int = 0,
    max_context_tokens: Optional[int] = None,
) -> list[TraceRequest]:
    """Read any supported trace (format from the file name); see :func:`read_mooncake` and
    :func:`read_weka` for the arguments."""
    fmt = detect_format(path)
    try:
        if fmt == "mooncake":
            return read_mooncake(path, max_requests)
        return read_weka(path, sessions=sessions, session_gap_s=session_gap_s, max_requests=max_requests,
                         skip_sessions=skip_sessions, max_context_tokens=max_context_tokens)
    except TraceFormatError:
        raise
    except (ValueError, KeyError, TypeError, OSError, EOFError, tarfile.TarError) as e:
        raise TraceFormatError(f"{path}: not a readable {fmt} trace ({type(e).__name__}: {e})") from None


def ideal_hit_rate(page_keys: Iterable[Sequence[str]], reusable: Optional[Iterable[int]] = None) -> tuple[int, int]:
    """Infinite-cache page hits: a page hits when its key appeared in any earlier request.

    Args:
        page_keys: per request (in replay order), its page keys.
        reusable: per request, how many of its leading pages a cache may serve at all
            (:func:`flatcake.replay.engine.reusable_pages`: SGLang matches at most the prompt's
            tokens but one); None: every page.

    Returns:
        ``(hit_pages, total_pages)``.
    """
    seen: set[str] = set()
    hits = total = 0
    caps = iter(reusable) if reusable is not None else None
    for keys in page_keys:
        total += len(keys)
        cap = next(caps) if caps is not None else len(keys)
        hits += sum(1 for k in keys[:cap] if k in seen)
        seen.update(keys)
    return hits, total
