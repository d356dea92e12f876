"""The engine model of a hybrid profile (:mod:`flatcake.replay.hybrid`): the same request
lifecycle as :class:`flatcake.replay.engine.Engine`, with the L3 calls of SGLang 0.5.23's
``HybridCacheController`` (:mod:`flatcake.replay.hybrid_systems`)::

    1. HBM match      longest prefix of keys in the HBM prefix cache
    2. L3 hit query   batch_exists_v2(rest, [a PoolTransfer per pool]) once -> kv_hit_pages h
                      (skipped below prefetch_threshold tokens, as SGLang)
    3. L3 read        per 128-page batch: KV anchor + batch_get_v2 of the all_pages pools at the
                      anchor's host pages; a batch delivers the minimum of their leading runs;
                      stop at the first short batch. Then, only when all h pages came back, the
                      trailing_pages pools' windows (the last window_pages pages before the cut)
                      in one batch_get_v2; when a window does not come back the restore is
                      unusable: the request recomputes every page (trailing_misses)
    4. prefill        pages not delivered are computed: every pool's bytes filled
    5. L3 write       per 128-page batch: batch_set_v2 of the all_pages pools, then the anchor;
                      then the trailing pools' pages of the last window_pages computed pages
    6. HBM insert

A page counts as delivered (``dram_pages`` + ``ssd_pages``, the hit rate) only when *every*
pool restored it (and the trailing window at the cut); its medium is the first KV-derived pool's
(``ssd_pages`` includes ``backlog_pages``: SSD pages FlatCake served from its write backlog in
memory before their round reached the disk). Every page each pool delivered is
verified bit-exact (``verify_failures``, per pool in ``pool_verify_failures``). TTFT as in
the dense engine; the modelled host -> HBM load covers every pool's delivered bytes.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Sequence

from flatcake.replay.engine import ModelProfile, RequestOutcome
from flatcake.replay.engine_core import (EngineConfig, EngineCore, HostPages, fill_pages, prefill_tokens,
                                         read_batches, usable_hit, verify_pages, write_batches)
from flatcake.replay.hybrid import PoolContent


@dataclass
class HybridOutcome(RequestOutcome):
    """A request's outcome with the pools' view.

    Attributes:
        pool_pages: pages each pool delivered (verified; trailing pools: their window pages).
        pool_verify_failures: delivered pages per pool whose bytes differed.
        pool_written_pages: pages each pool stored.
        trailing_misses: 1 when the pages were restored but a trailing window was not (the
            restore was dropped and the request recomputed).
    """

    pool_pages: dict = field(default_factory=dict)
    pool_verify_failures: dict = field(default_factory=dict)
    pool_written_pages: dict = field(default_factory=dict)
    trailing_misses: int = 0


class HybridEngine(EngineCore):
    """One system's engine for a hybrid profile: the
    :class:`~flatcake.replay.engine_core.EngineCore` (HBM cache, the KV anchor's host pages, the
    request steps) over the system's :class:`~flatcake.replay.hybrid.HybridPools` and its v2
    calls, one request at a time as :class:`~flatcake.replay.engine.Engine`.

    Args:
        system: a :class:`~flatcake.replay.hybrid_systems.V2System` (or ``recompute``).
        profile: the hybrid model profile (``profile.pools``).
        cfg: engine knobs.

    Raises:
        ValueError: ``host_pool_pages`` below 2 × 128.
    """

    def __init__(self, system, profile: ModelProfile, cfg: EngineConfig):
        super().__init__(profile, cfg, system.pool)
        self.system = system
        hybrid = getattr(system, "hybrid", None)
        self.derived = hybrid.derived if hybrid is not None else ()
        self.trailing = hybrid.trailing if hybrid is not None else ()
        self.content = {s.name: PoolContent(hybrid.pools[s.name], s.name) for s in hybrid.specs} if hybrid else {}
        # the trailing pools' own host pages (one free list: they all have the same page count)
        self.tpages = HostPages(hybrid.pools[self.trailing[0].name]) if self.trailing else None

    def run(self, keys: Sequence[str], prompt_tokens: int) -> HybridOutcome:
        """Serve one request whose prompt has page keys ``keys`` and ``prompt_tokens`` tokens."""
        t_start = time.perf_counter()
        P = self.profile.page_size
        out = HybridOutcome(pages=len(keys), prompt_tokens=prompt_tokens)
        out.pool_pages = {s.name: 0 for s in (*self.derived, *self.trailing)}
        out.pool_verify_failures = dict.fromkeys(out.pool_pages, 0)
        out.pool_written_pages = dict.fromkeys(out.pool_pages, 0)
        prefix = self.match(keys, prompt_tokens)  # SGLang matches prompt - 1 tokens at most
        n_hbm = out.hbm_pages = prefix.hbm
        rest = list(prefix.rest)
        loaded, trailing_bytes = 0, 0
        if self.system.has_l3 and self.asks_l3(len(rest)):
            hit, _ = self.system.exists_v2(rest, list(keys[:n_hbm]))
            out.query_s = self.system.last_call_s
            hit = usable_hit(hit, len(rest))
            out.l3_query_pages = hit
            if self.asks_l3(hit):
                loaded, trailing_bytes = self._read(rest, list(keys[:n_hbm]), hit, self.prefetch_budget_s(prefix), out)
        computed = list(keys[n_hbm + loaded:])
        out.computed_pages = len(computed)
        out.prefill_s = self.profile.prefill_s(*prefill_tokens(prompt_tokens, n_hbm + loaded, P))
        out.load_s = self.profile.load_s(loaded * self.profile.page_bytes + trailing_bytes)
        if self.system.has_l3 and computed:
            self._backup(list(keys), n_hbm + loaded, out)
        self.insert(keys)
        out.wall_s = time.perf_counter() - t_start
        return out

    # ---------------------------------------------------------------- read
    def _verify(self, specs, keys, host, n_by_pool: dict, out: HybridOutcome) -> None:
        """Check each pool's delivered pages bit-exact (harness work, untimed)."""
        for s in specs:
            n = n_by_pool.get(s.name, 0)
            bad = verify_pages(self.content[s.name], host, keys, n, self.profile.page_size)
            out.pool_pages[s.name] += n
            out.pool_verify_failures[s.name] += bad
            out.verify_failures += bad

    def _read(self, rest: list, prefix: list, hit: int, budget_s, out: HybridOutcome) -> tuple[int, int]:
        """Step 3 (``budget_s``: the prefetch budget of the span asked, None under
        ``wait_complete``): returns ``(pages delivered by every pool, trailing bytes delivered)``."""
        sysm = self.system
        media = {"dram": 0, "backlog": 0}

        def read(b: int, e: int) -> int:
            batch = rest[b:e]
            host = self.pages.alloc(len(batch))
            try:
                before = self._hits()
                got, runs, secs = sysm.get_batch(batch, host, prefix + rest[:b])
                out.read_s += secs
                after = self._hits()
                d = min(got, max(0, after[0] - before[0]))
                media["dram"] += d
                media["backlog"] += min(got - d, max(0, after[1] - before[1]))
                self._verify(self.derived, batch, host, runs, out)
            finally:
                self.pages.free(host)
            return got

        loaded = read_batches(hit, read, lambda: budget_s is not None and out.read_s > budget_s)
        dram, backlog = media["dram"], media["backlog"]
        if loaded and self.trailing:
            ok, tbytes = self._read_trailing(rest, prefix, loaded, hit, out)
            if not ok:
                out.trailing_misses += 1
                return 0, 0
        else:
            tbytes = 0
        out.dram_pages, out.ssd_pages, out.backlog_pages = dram, loaded - dram, backlog
        return loaded, tbytes

    def _read_trailing(self, rest: list, prefix: list, loaded: int, hit: int, out: HybridOutcome) -> tuple[bool, int]:
        """The trailing pools' windows at the cut ``loaded`` (read only when all ``hit`` pages
        came back, as ``_page_transfer_sidecar``): ``(every window delivered, bytes)``."""
        if loaded < hit:
            return False, 0
        ok, nbytes = True, 0
        for w in sorted({s.window_pages for s in self.trailing}):
            specs = [s for s in self.trailing if s.window_pages == w]
            tkeys = rest[max(0, loaded - w):loaded]
            covered = loaded - len(tkeys)
            host = self.tpages.alloc(len(tkeys))
            try:
                runs = self.system.pools_call(specs, tkeys, host, prefix + rest[:covered], write=False)
                out.read_s += self.system.last_call_s
                self._verify(specs, tkeys, host, runs, out)
            finally:
                self.tpages.free(host)
            ok = ok and all(runs[s.name] == len(tkeys) for s in specs)
            nbytes += sum(runs[s.name] * s.page_bytes for s in specs)
        return ok, nbytes

    def _hits(self) -> tuple[int, int]:
        """Pages the first all_pages pool served so far from L3 DRAM and from its SSD write
        backlog in memory (FlatCake; ``(0, 0)`` otherwise)."""
        pc = getattr(self.system, "pool_counters", None)
        if pc is None or not self.derived:
            return 0, 0
        c = pc().get(self.derived[0].name, {})
        return c.get("hit_pages_dram", 0), c.get("queued_hit_pages", 0)

    # ---------------------------------------------------------------- write-back
    def _fill(self, specs, keys, host) -> None:
        for s in specs:
            fill_pages(self.content[s.name], host, keys, self.profile.page_size)

    def _backup(self, keys: list, start: int, out: HybridOutcome) -> None:
        """Step 5: the computed pages ``keys[start:]`` in 128-page batches, then the trailing
        pools' last window."""
        computed = keys[start:]

        def write(batch, prefix_keys) -> bool:
            host = self.pages.alloc(len(batch))
            try:
                self._fill(self.derived, batch, host)
                ok, secs = self.system.set_batch(batch, host, prefix_keys)
                out.write_s += secs
            finally:
                self.pages.free(host)
            if ok:
                for s in self.derived:
                    out.pool_written_pages[s.name] += len(batch)
            return bool(ok)

        wb = write_batches(keys, start, write)
        out.written_pages += wb.written
        out.failed_write_pages += wb.failed
        if wb.failed:
            return
        for w in sorted({s.window_pages for s in self.trailing}):
            specs = [s for s in self.trailing if s.window_pages == w]
            tkeys = computed[-w:]
            host = self.tpages.alloc(len(tkeys))
            try:
                self._fill(specs, tkeys, host)
                runs = self.system.pools_call(specs, tkeys, host, keys[: len(keys) - len(tkeys)], write=True)
                out.write_s += self.system.last_call_s
            finally:
                self.tpages.free(host)
            for s in specs:
                out.pool_written_pages[s.name] += runs[s.name]


def hybrid_summary(outcomes: Sequence[HybridOutcome], counters: dict, system) -> dict:
    """The hybrid fields of one system's summary (added to
    :func:`flatcake.replay.report.system_summary`'s).

    Returns:
        ``hybrid`` True; ``pools``: per pool ``hit_policy``, ``page_bytes``,
        ``delivered_pages`` (pages it restored, verified), ``verify_failures``,
        ``written_pages`` and, for FlatCake, its store's I/O ``counters``;
        ``trailing_misses`` (restores dropped: a trailing window missing at the cut);
        ``read_amplification`` replaced by SSD bytes read / logical bytes of the pages served
        from SSD, every pool's (trailing windows included).
    """
    pools = {}
    per_pool = getattr(system, "last_pool_counters", {}) or {}
    hybrid = getattr(system, "hybrid", None)
    for s in (hybrid.specs if hybrid is not None else ()):
        pools[s.name] = {
            "hit_policy": s.hit_policy,
            "window_pages": s.window_pages if s.trailing else None,
            "page_bytes": s.page_bytes,
            "delivered_pages": int(sum(o.pool_pages.get(s.name, 0) for o in outcomes)),
            "verify_failures": int(sum(o.pool_verify_failures.get(s.name, 0) for o in outcomes)),
            "written_pages": int(sum(o.pool_written_pages.get(s.name, 0) for o in outcomes)),
            **({"counters": per_pool[s.name]} if s.name in per_pool else {}),
        }
    logical = int(counters.get("logical_read_bytes_ssd", 0))
    return {
        "hybrid": True,
        "pools": pools,
        "trailing_misses": int(sum(o.trailing_misses for o in outcomes)),
        "read_amplification": int(counters.get("ssd_read_bytes", 0)) / logical if logical else None,
    }
