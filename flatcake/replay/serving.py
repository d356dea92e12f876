"""Concurrent serving model: SGLang 0.5.23's scheduler and cache controller under load, with the
prefetch I/O in FC-MAS lanes or in SGLang's single FIFO (paper §3.2).

Many requests are in flight. Threads, as in SGLang's controller (``managers/cache_controller.py``)
and scheduler::

    arrivals      each request when due (:mod:`flatcake.replay.arrivals`: the rate sets when
                  conversations start, a turn keeps its offset in its conversation and waits for
                  the previous turn's last token): HBM prefix match (of the pages SGLang may
                  reuse: :func:`~flatcake.replay.engine.reusable_pages`), then queue
    hit queries   one thread, arrival order: batch_exists on the rest of those pages; the pages
                  of the hit on each medium (``medium_summary``); host pages for the hit, or the
                  prefetch is declined (host pool full: the request recomputes those tokens)
    prefetch I/O  the lanes (:mod:`flatcake.mas.lanes`): ``fcfs`` = SGLang's one I/O thread,
                  FIFO; ``mas`` = a DRAM lane and ``ssd_restores`` SSD restores picked by HRRN.
                  Reads in 128-page batch_get_v1 calls, stopping at the first page not delivered
    verify        one thread checks every delivered page's bytes, then frees its host pages
                  (harness work: outside every timed call, off the lanes)
    GPU           a modelled timeline in real time: admits ready requests (prefetch done, or,
                  with ``prefetch_policy: timeout``, SGLang's default, its deadline passed: the
                  clock starts at the first admission poll that finds the prefetch not done, as
                  SGLang's) in arrival order up to ``max_running``; each step runs up to
                  ``chunk_tokens`` of chunked prefill plus one decode token per running request,
                  and sleeps the step's modelled time
    backup        one thread writes each request's computed pages (batch_set_v1, 128 pages) once
                  its prefill is done, concurrently with the reads (SGLang's write-through)

Harness work around the calls, on the thread that made them and outside their timing, as in the
one-request-at-a-time engine: the system's ``prepare_set`` before each write and ``after_call``
after each read and write (``file``: count the page files written, flush them, and drop the
files written and read from the OS page cache, so its buffered reads come from the disk as
FlatCake's direct I/O does); and, where the hit query found pages in FlatCake's write backlog,
their medium again just before the read, so a page counts as a backlog hit only while its round
is still in memory.

What is measured and what is modelled: every storage call (hit query, reads, writes) runs for
real against the backend on its own thread, concurrently; the GPU's step times are modelled
(:meth:`ServingModel.step_s`: prefill FLOPs of :class:`~flatcake.replay.engine.ModelProfile`,
host→HBM load of the L3-delivered bytes at ``pcie_gbps``, and per decode step a fixed overhead
plus the weights and the running contexts' KV read at ``hbm_gbps``) and elapse as real sleeps,
so storage and GPU time overlap as they do in a server. TTFT = first token (end of the step that
finishes the request's prefill) − arrival, queueing included.
"""

from __future__ import annotations

import heapq
import queue
import threading
import time
from dataclasses import dataclass, field
from typing import Optional, Sequence

import numpy as np
import torch

from flatcake.mas.lanes import LaneOp, make_lanes
from flatcake.replay.arrivals import conversation_schedule, offered_qps, turns_before_previous_answer
from flatcake.replay.engine import ModelProfile
from flatcake.replay.engine_core import (EngineConfig, EngineCore, PageContent, prefill_tokens, read_batches,
                                         usable_hit, verify_pages, write_batches, write_dense_batch)
from flatcake.replay.traces import TraceRequest


@dataclass(frozen=True)
class ServingConfig:
    """Knobs of the concurrent serving model (units: tokens, seconds, GB/s = 1e9 bytes/s).

    Attributes:
        qps: requests per second offered; conversations start at ``qps`` / (mean requests per
            conversation), see :mod:`flatcake.replay.arrivals`.
        scheduler: ``"fcfs"`` (SGLang's FIFO prefetch I/O) or ``"mas"`` (FC-MAS lanes).
        ssd_restores: SSD restores at once in the ``mas`` lanes (FlatCake's ``cio.windows``).
        chunk_tokens: chunked-prefill tokens per GPU step (SGLang ``--chunked-prefill-size``).
        max_running: requests in the running batch at most (SGLang ``--max-running-requests``).
        max_output_tokens: decode tokens per request at most (bounds the run time).
        step_overhead_s: fixed cost of one GPU step (launches, sampling, scheduling).
        hbm_gbps: HBM bandwidth for the decode cost (weights + KV read per step).
        think_time_scale: factor on the gaps between a conversation's turns
            (:func:`~flatcake.replay.arrivals.conversation_schedule`).
    """

    qps: float
    scheduler: str = "mas"
    ssd_restores: int = 1
    chunk_tokens: int = 8192
    max_running: int = 64
    max_output_tokens: int = 64
    step_overhead_s: float = 0.005
    think_time_scale: float = 1.0
    hbm_gbps: float = 4800.0


@dataclass(eq=False)
class Live:
    """One request in flight, and what it got (times: ``time.monotonic`` seconds)."""

    idx: int
    keys: Sequence[str]
    prompt_tokens: int
    output_tokens: int
    arrival: float
    reusable_pages: int = 0  # leading pages SGLang may take from a cache (engine.reusable_pages)
    hbm_pages: int = 0
    hit: int = 0
    delivered: int = 0
    read_pages: int = 0
    dram_pages: int = 0
    ssd_pages: int = 0  # placed on SSD, backlog_pages included
    backlog_pages: int = 0  # of ssd_pages: served from FlatCake's write backlog (in memory)
    declined_tokens: int = 0
    revoked_tokens: int = 0
    verify_failures: int = 0
    query_s: float = 0.0
    read_s: float = 0.0
    written_pages: int = 0
    failed_write_pages: int = 0  # pages whose put was refused (that batch and the rest)
    lane: str = ""
    lane_wait_s: float = 0.0
    prefetch_s: float = 0.0
    t_ready: float = 0.0
    t_admit: float = 0.0
    t_first: float = 0.0
    t_done: float = 0.0
    timeout_s: Optional[float] = None  # prefetch_policy timeout: SGLang's budget for the span asked
    deadline: float = float("inf")  # set at the first admission poll that finds the prefetch not done
    host: Optional[torch.Tensor] = None
    media: tuple = ()
    leader: Optional["Live"] = None
    followers: list = field(default_factory=list)
    cancelled: bool = False
    read_finished: bool = False
    ready: threading.Event = field(default_factory=threading.Event)
    prefill_left: int = 0
    decode_left: int = 0
    decode_total: int = 0
    started_prefill: bool = False

    @property
    def ttft_s(self) -> float:
        return self.t_first - self.arrival

    def deliver(self, pages: int, media: tuple) -> None:
        """The first ``pages`` of the hit reached the host pool in time: count them, split by
        medium from ``media`` (per key, as ``medium_summary`` gave it: ``dram``, ``ssd``, or
        ``queued`` for an SSD page still in FlatCake's write backlog, a backlog hit)."""
        self.delivered = pages
        head = media[:pages]
        self.dram_pages = head.count("dram")
        self.backlog_pages = head.count("queued")
        self.ssd_pages = pages - self.dram_pages

    @property
    def fetch_keys(self) -> Sequence[str]:
        return self.keys[self.hbm_pages:self.reusable_pages]


class ServingModel(EngineCore):
    """One system under one scheduler at one rate; :meth:`run` replays the requests. The
    :class:`~flatcake.replay.engine_core.EngineCore` (HBM cache, host pool, the request steps)
    with its steps on the threads of the module docstring.

    Args:
        system: an :class:`~flatcake.replay.systems.L3System`; ``None`` or one whose ``has_l3``
            is False (``recompute``) serves with no L3: no hit queries, reads or write-backs.
        profile: model profile (cost model, page geometry).
        engine: the engine knobs shared with the sequential replay (HBM and host-pool pages,
            prefetch threshold and policy).
        cfg: the serving knobs.
        host_pool: the host pool when ``system`` is ``None`` (else the system's).

    Raises:
        ValueError: an unknown scheduler, a rate <= 0, or a host pool under 2 × 128 pages.
    """

    def __init__(self, system, profile: ModelProfile, engine: EngineConfig, cfg: ServingConfig, host_pool=None):
        if cfg.qps <= 0:
            raise ValueError(f"qps must be > 0 (got {cfg.qps})")
        pool = system.pool if system is not None else host_pool
        if system is not None and not system.has_l3:
            system = None
        super().__init__(profile, engine, pool)
        self.system, self.cfg = system, cfg  # (self.cfg: the serving knobs; engine_cfg: the engine's)
        self.pool = pool
        store = getattr(getattr(system, "inner", None), "store", None)  # FlatCake: queued restores hold its writes
        self.lanes = make_lanes(cfg.scheduler, cfg.ssd_restores, getattr(store, "reads_pending", None))
        self._hbm_lock = threading.Lock()
        self._pages_lock = threading.Lock()
        self._cv = threading.Condition()
        self._waiting: list[Live] = []
        self._inflight: dict[str, Live] = {}  # first fetch key -> the request reading it
        self._query_q: "queue.SimpleQueue[Optional[Live]]" = queue.SimpleQueue()
        self._verify_q: "queue.SimpleQueue[Optional[Live]]" = queue.SimpleQueue()
        self._backup_q: "queue.SimpleQueue[Optional[Live]]" = queue.SimpleQueue()
        self._answered_q: "queue.SimpleQueue[int]" = queue.SimpleQueue()  # idx of each request done
        self.backup_skipped_pages = 0

    # ------------------------------------------------------------------ cost model
    def step_s(self, prefill: Sequence[tuple[int, int]], decode_ctx: Sequence[int], load_bytes: int) -> float:
        """Modelled seconds of one GPU step: ``prefill`` as ``(new, cached)`` token chunks,
        ``decode_ctx`` the context tokens of each decoding request, ``load_bytes`` of L3 pages
        copied host→HBM before their prefill."""
        p = self.profile
        t = self.cfg.step_overhead_s + p.load_s(load_bytes)
        t += sum(p.prefill_s(n, c) for n, c in prefill)
        if decode_ctx:
            kv = sum(decode_ctx) * p.bytes_per_token
            t += (2.0 * p.params + kv) / (self.cfg.hbm_gbps * 1e9)
        return t

    # ------------------------------------------------------------------ host pages
    def _alloc(self, n: int) -> Optional[torch.Tensor]:
        with self._pages_lock:
            return self.pages.alloc(n) if n <= self.pages.free_pages else None

    def _free(self, host: Optional[torch.Tensor]) -> None:
        if host is not None:
            with self._pages_lock:
                self.pages.free(host)

    # ------------------------------------------------------------------ hit queries + prefetch
    def _query_loop(self) -> None:
        while (r := self._query_q.get()) is not None:
            self._prefetch(r)

    def _set_ready(self, r: Live) -> None:
        with self._cv:
            if r.cancelled:  # admitted on its deadline: that admission was its ready time
                return
            r.t_ready = time.monotonic()
            r.prefetch_s = r.t_ready - r.arrival
            r.ready.set()
            self._cv.notify_all()

    def _prefetch(self, r: Live) -> None:
        P, sysm = self.profile.page_size, self.system
        rest = list(r.fetch_keys)
        if r.cancelled:  # its deadline passed before its hit query ran: admitted without L3
            return
        if sysm is not None and self.asks_l3(len(rest)):
            t0 = time.perf_counter()
            hit = sysm.exists(rest, list(r.keys[: r.hbm_pages]))
            r.query_s = time.perf_counter() - t0
            hit = usable_hit(hit, len(rest))
            r.hit = hit if self.asks_l3(hit) else 0
        if not r.hit:
            return self._set_ready(r)
        lead = self._inflight.get(rest[0])
        if lead is not None and lead.hit >= r.hit and list(lead.fetch_keys[: r.hit]) == rest[: r.hit]:
            with self._cv:  # the same prefix is being read for another request: read it once
                if not lead.read_finished:
                    r.leader, r.lane = lead, "shared"
                    lead.followers.append(r)
                    return
        summary = sysm.medium_summary(rest[: r.hit])
        r.media = summary.media
        r.host = self._alloc(r.hit)
        if r.host is None:  # SGLang declines the prefetch when the host pool cannot hold it
            r.declined_tokens, r.hit = r.hit * P, 0
            return self._set_ready(r)
        self._inflight[rest[0]] = r
        op = LaneOp(str(r.idx), r.arrival, summary.dram_pages, summary.ssd_pages, summary.ssd_bytes,
                    run=lambda: self._read(r), on_done=lambda op: self._read_done(r, op))
        self.lanes.submit(op)

    def _read(self, r: Live) -> None:
        """The request's reads (a lane thread): 128-page calls, timed, stopping at the first
        page not delivered or once the request was admitted without them (``timeout``). Around
        each call, untimed: the pages' medium again when the hit query found some in the write
        backlog (its writer may have put them on disk since), and the system's ``after_call``."""
        P, rest, prefix = self.profile.page_size, list(r.fetch_keys), list(r.keys[: r.hbm_pages])
        sysm = self.system

        def read(b: int, e: int) -> int:
            batch = rest[b:e]
            host = r.host[b * P: e * P]
            if "queued" in r.media[b:e]:  # harness: still in the backlog now?
                r.media = r.media[:b] + tuple(sysm.medium_summary(batch).media) + r.media[e:]
            t0 = time.perf_counter()
            got, _, _ = sysm.get(batch, host, prefix + rest[:b])
            r.read_s += time.perf_counter() - t0
            sysm.after_call()  # harness: e.g. file drops the page files it read from the page cache
            r.read_pages += got
            return got

        read_batches(r.hit, read, lambda: r.cancelled)

    def _read_done(self, r: Live, op: LaneOp) -> None:
        r.lane, r.lane_wait_s = op.lane, op.started_s - op.submitted_s
        if self._inflight.get(r.fetch_keys[0]) is r:  # (a later, longer read may have taken the key)
            del self._inflight[r.fetch_keys[0]]
        with self._cv:
            if not r.cancelled:  # a request admitted on its deadline keeps what it had then
                r.deliver(r.read_pages, r.media)
            followers, r.followers, r.read_finished = r.followers, [], True
        for f in followers:
            f.deliver(min(f.hit, r.read_pages), r.media)  # admitted after the whole read: all of it counts
            self._set_ready(f)
        self._verify_q.put(r)
        if not r.cancelled:
            self._set_ready(r)

    def _verify_loop(self) -> None:
        content = PageContent(self.pool)
        P = self.profile.page_size
        while (r := self._verify_q.get()) is not None:
            # every page read, also those a timeout left unused
            r.verify_failures += verify_pages(content, r.host, r.fetch_keys, r.read_pages, P)
            self._free(r.host)

    # ------------------------------------------------------------------ backup
    def _backup_loop(self) -> None:
        content = PageContent(self.pool)
        P = self.profile.page_size

        def write(batch, prefix_keys) -> Optional[bool]:
            host = self._alloc(len(batch))
            if host is None:  # no host pages now: the rest of this request is not backed up
                return None
            try:  # prepare_set / after_call around the set, untimed (file: flush and drop the pages)
                return write_dense_batch(self.system, content, host, batch, prefix_keys, P)
            finally:
                self._free(host)

        while (r := self._backup_q.get()) is not None:
            wb = write_batches(r.keys, r.hbm_pages + r.delivered, write)
            r.written_pages += wb.written
            r.failed_write_pages += wb.failed
            self.backup_skipped_pages += wb.skipped

    # ------------------------------------------------------------------ GPU
    def _admit_locked(self, running: list[Live], now: float) -> None:
        for r in list(self._waiting):
            if len(running) >= self.cfg.max_running:
                return
            if not r.ready.is_set():
                if r.timeout_s is None or r.leader is not None:
                    continue  # SGLang skips a request whose prefetch is not done
                if r.deadline == float("inf"):  # SGLang starts the wait at the first blocked poll
                    r.deadline = now + r.timeout_s
                if now < r.deadline:
                    continue
                r.cancelled = True  # timeout: admitted with what was read so far
                r.deliver(r.read_pages, r.media)
                r.revoked_tokens = (r.hit - r.delivered) * self.profile.page_size
                r.t_ready = now
                r.prefetch_s = now - r.arrival
            self._waiting.remove(r)
            r.t_admit = now
            new, _ = prefill_tokens(r.prompt_tokens, r.hbm_pages + r.delivered, self.profile.page_size)
            r.prefill_left = max(1, new)  # one step at least: it gives the first token
            r.decode_total = min(r.output_tokens, self.cfg.max_output_tokens)
            r.decode_left = r.decode_total - 1  # the first token comes with the prefill
            running.append(r)

    def _gpu_loop(self, n_requests: int) -> None:
        running: list[Live] = []
        done = 0
        while done < n_requests:
            with self._cv:
                self._admit_locked(running, time.monotonic())
                if not running:
                    self._cv.wait(0.005)
                    continue
            budget, prefill, decode_ctx, load, finishing = self.cfg.chunk_tokens, [], [], 0, []
            for r in running:
                if r.prefill_left > 0 and budget > 0:
                    n = min(r.prefill_left, budget)
                    cached = r.prompt_tokens - r.prefill_left
                    prefill.append((n, cached))
                    if not r.started_prefill:
                        r.started_prefill = True
                        load += r.delivered * self.profile.page_bytes
                    budget -= n
                    r.prefill_left -= n
                    if r.prefill_left == 0:
                        finishing.append(r)
                elif r.prefill_left == 0:
                    decode_ctx.append(r.prompt_tokens + r.decode_total - r.decode_left)
            t_end = time.monotonic() + self.step_s(prefill, decode_ctx, load)
            time.sleep(max(0.0, t_end - time.monotonic()))
            now = time.monotonic()
            for r in running:
                if r.prefill_left == 0 and r not in finishing:
                    r.decode_left -= 1
            for r in finishing:
                r.t_first = now
                with self._hbm_lock:
                    self.insert(r.keys)
                if self.system is not None:
                    self._backup_q.put(r)
            for r in [r for r in running if r.prefill_left == 0 and r.decode_left <= 0]:
                r.t_done = now
                running.remove(r)
                done += 1
                self._answered_q.put(r.idx)  # releases the next turn of its conversation

    # ------------------------------------------------------------------ run
    def run(self, reqs: Sequence[TraceRequest], keys: Sequence[Sequence[str]]) -> list[Live]:
        """Replay ``reqs`` (with page keys ``keys``) at ``cfg.qps``, each request released as
        :func:`~flatcake.replay.arrivals.conversation_schedule` says: when due, and not before
        the previous request of its conversation has its last token. Returns every request's
        record (in the order of ``reqs``) once all are served, written back and verified."""
        threads = [threading.Thread(target=f, name=f"fc-serve-{n}", daemon=True) for n, f in
                   (("query", self._query_loop), ("verify", self._verify_loop), ("backup", self._backup_loop))]
        gpu = threading.Thread(target=self._gpu_loop, args=(len(reqs),), name="fc-serve-gpu", daemon=True)
        for t in threads + [gpu]:
            t.start()
        lives = self._release(reqs, keys)
        gpu.join()
        self.lanes.close()
        for q in (self._query_q, self._verify_q, self._backup_q):
            q.put(None)
        for t in threads:
            t.join()
        return lives

    def _release(self, reqs: Sequence[TraceRequest], keys: Sequence[Sequence[str]]) -> list[Live]:
        """The arrivals (the calling thread): a request enters once due and, if it has a
        previous turn, once that turn is answered (the GPU thread announces each answer)."""
        sched = conversation_schedule(reqs, self.cfg.qps, self.cfg.think_time_scale)
        due = [(at, i) for i, (at, dep) in enumerate(sched) if dep is None]  # (due_s, idx) heap
        heapq.heapify(due)
        after = {dep: i for i, (_, dep) in enumerate(sched) if dep is not None}  # turn -> next turn
        lives: list[Optional[Live]] = [None] * len(reqs)
        t0 = time.monotonic()
        released = 0
        while released < len(reqs):
            now = time.monotonic()
            if due and t0 + due[0][0] <= now:
                i = heapq.heappop(due)[1]
                lives[i] = self._arrive(i, reqs[i], keys[i])
                released += 1
                continue
            try:
                j = self._answered_q.get(timeout=t0 + due[0][0] - now if due else None)
            except queue.Empty:
                continue
            nxt = after.pop(j, None)
            if nxt is not None:  # due at its own time, or now if that has passed
                heapq.heappush(due, (max(sched[nxt][0], lives[j].t_done - t0), nxt))
        return lives

    def _arrive(self, i: int, q: TraceRequest, ks: Sequence[str]) -> Live:
        r = Live(i, ks, q.prompt_tokens, max(1, q.output_tokens), time.monotonic())
        with self._hbm_lock:
            prefix = self.match(ks, q.prompt_tokens)
        r.reusable_pages, r.hbm_pages = prefix.reusable, prefix.hbm
        # SGLang's requested span: its timeout budget, known before the query
        if self.system is not None and self.asks_l3(len(prefix.rest)):
            r.timeout_s = self.prefetch_budget_s(prefix)
        with self._cv:
            self._waiting.append(r)
        self._query_q.put(r)
        return r


def serving_summary(lives: Sequence[Live], page_size: int, wall_s: float, backup_skipped_pages: int = 0) -> dict:
    """Per system and rate: delivered hit rate, hits by medium (``hit_tokens``: ``hbm``,
    ``dram``, ``backlog`` = SSD pages FlatCake served from its write backlog in memory, also as
    ``backlog_hit_pages``, and ``ssd`` = read from the disk), TTFT, queueing, SSD prefetch
    latency, DRAM-lane wait, declined and revoked prefetch tokens, throughput (seconds, tokens).
    ``makespan_s`` is first arrival to last token; ``wall_s`` (given) also covers the write-backs
    still draining after it, so ``tokens_per_s`` (over the makespan) does not charge a system
    for writing in the background. ``offered_qps`` is the rate the run was really offered,
    (requests − 1) / (last − first arrival) (:func:`~flatcake.replay.arrivals.offered_qps`;
    ``None`` under two requests). A statistic over no requests is ``None``."""

    def stats(xs) -> dict:  # None when there is nothing to measure (not 0: no such requests)
        a = np.asarray(list(xs), dtype=np.float64)
        if not a.size:
            return {"mean": None, "p50": None, "p99": None}
        return {"mean": float(a.mean()), "p50": float(np.percentile(a, 50)), "p99": float(np.percentile(a, 99))}

    pages = sum(len(r.keys) for r in lives)
    hbm = sum(r.hbm_pages for r in lives)
    dram = sum(r.dram_pages for r in lives)
    backlog = sum(r.backlog_pages for r in lives)
    ssd = sum(r.ssd_pages for r in lives) - backlog  # read from the disk
    ssd_lane = [r for r in lives if r.lane in ("ssd", "fifo") and r.ssd_pages]
    dram_only = [r for r in lives if r.lane in ("dram", "fifo") and r.hit and not r.media.count("ssd")]
    tokens = sum(r.prompt_tokens + r.decode_total for r in lives)
    makespan_s = max(r.t_done for r in lives) - min(r.arrival for r in lives) if lives else 0.0
    return {
        "requests": len(lives),
        "offered_qps": offered_qps([r.arrival for r in lives]),
        "delivered_hit_rate": (hbm + dram + backlog + ssd) / pages if pages else None,
        "hit_tokens": {"hbm": hbm * page_size, "dram": dram * page_size, "backlog": backlog * page_size,
                       "ssd": ssd * page_size},
        "backlog_hit_pages": backlog,
        "ttft_s": stats(r.ttft_s for r in lives),
        "queue_s": stats(r.t_admit - r.t_ready for r in lives),
        "prefetch_s": stats(r.prefetch_s for r in lives),
        "ssd_prefetch_s": stats(r.prefetch_s for r in ssd_lane),
        "dram_lane_wait_p99_s": stats(r.lane_wait_s for r in dram_only)["p99"],
        "dram_hit_requests": len(dram_only),
        "ssd_restore_requests": len(ssd_lane),
        "shared_reads": sum(1 for r in lives if r.lane == "shared"),
        "declined_prefetch_tokens": sum(r.declined_tokens for r in lives),
        "revoked_prefetch_tokens": sum(r.revoked_tokens for r in lives),
        "backup_skipped_pages": backup_skipped_pages,
        "written_pages": sum(r.written_pages for r in lives),
        "failed_write_pages": sum(r.failed_write_pages for r in lives),
        "verify_failures": sum(r.verify_failures for r in lives),
        "tokens_per_s": tokens / makespan_s if makespan_s > 0 else None,
        "makespan_s": makespan_s,
        "wall_s": wall_s,
    }


def serve(system, profile: ModelProfile, engine: EngineConfig, cfg: ServingConfig,
          reqs: Sequence[TraceRequest], keys: Sequence[Sequence[str]]) -> dict:
    """Serve ``reqs`` on ``system`` with a fresh :class:`ServingModel`; returns
    :func:`serving_summary` plus the configured ``qps`` (beside the measured ``offered_qps``),
    ``turns_before_previous_answer`` and the system's cumulative I/O ``counters``."""
    model = ServingModel(system, profile, engine, cfg)
    t0 = time.monotonic()
    lives = model.run(reqs, keys)
    s = serving_summary(lives, profile.page_size, time.monotonic() - t0, model.backup_skipped_pages)
    s["qps"] = cfg.qps
    s["turns_before_previous_answer"] = turns_before_previous_answer(reqs, lives)
    s["counters"] = system.counters()
    return s


__all__ = ["Live", "ServingConfig", "ServingModel", "serve", "serving_summary", "turns_before_previous_answer"]
