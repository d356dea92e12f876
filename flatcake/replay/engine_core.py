"""The engine core every replay model shares: what SGLang 0.5.23's scheduler and cache
controller do with one request's prefix, minus the GPU, each step written once (issue 25).

The replay has three engines over it: the one-request-at-a-time :class:`~flatcake.replay.engine.Engine`
(also each node's engine in the cluster replay, :mod:`flatcake.replay.node_agent`), its hybrid
twin :class:`~flatcake.replay.hybrid_engine.HybridEngine` (SGLang's v2 pools) and the concurrent
:class:`~flatcake.replay.serving.ServingModel`. Each is an :class:`EngineCore` and runs a request
through these steps::

    EngineCore(profile, cfg, pool)   HBM prefix cache (HbmCache, LRU of pages), the host pool's free
                                     list (HostPages; host_pool_pages >= 2 x 128 or ValueError)
    0. match(keys, prompt_tokens)    -> Prefix: the pages SGLang may take from a cache
                                     (reusable_pages: prompt - 1 tokens at most) and the leading
                                     run of them in HBM; Prefix.rest is the span asked of L3
    1. asks_l3(pages)                the prefetch threshold: a span, and then a hit, of fewer than
                                     prefetch_threshold_tokens is not fetched (SGLang)
       prefetch_budget_s(prefix)     prefetch_policy timeout: SGLang's budget for the span asked
                                     (EngineConfig.prefetch_timeout_s); None under wait_complete
    2. hit query                     the engine's own call (batch_exists / batch_exists_v2), its
                                     leading run clamped by usable_hit
    3. read_batches(hit, read, stop) the hit in 128-page calls, stopping at the first call short
                                     of its pages or once stop() says the budget is spent /
                                     the request was admitted without them
       verify_pages(content, ...)    every delivered page checked bit-exact (harness, untimed)
    4. prefill_tokens(...)           (new, cached) tokens of the prefill: the pages not delivered
                                     are computed (the last prompt token always is)
    5. write_batches(keys, start, write)  the computed pages keys[start:] in 128-page calls, each
                                     with the keys before it as prefix keys; the first refused
                                     put counts that call and the rest as failed
       write_dense_batch(...)        one dense call: fill the bytes, prepare_set, batch_set,
                                     after_call (the harness work around it untimed)
    6. insert(keys)                  every page of the prompt becomes most recent in HBM

What stays each engine's own: the serial engines run the steps in order on one thread and sum
the storage calls' times into TTFT (the medium of each delivered page from the system's counters
around the call); the serving model runs them on its threads and lanes (host pages for the whole
hit reserved before the read, as SGLang's prefetch; the medium from ``medium_summary``; the
budget on the GPU thread's clock; the backup after the first token), so a request's results
there depend on what else is in flight; the hybrid engine calls the v2 pools (trailing windows);
the cluster replay routes requests to nodes, each a serial engine. The serial engine is not the
serving model with one request in flight because those differences would change its hit rates
and medium split (docs/replay.md, "Engine model").
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass, fields
from typing import Any, Callable, Mapping, Optional, Sequence

import numpy as np
import torch
import xxhash

from flatcake.config import STORAGE_BATCH_PAGES


# ------------------------------------------------------------------------------------ HBM cache
class HbmCache:
    """HBM prefix cache at page granularity with LRU eviction.

    Keys are chained, so "longest prefix match" is the leading run of keys present. On insert the
    request's keys are touched last-to-first, so a prefix page is always more recent than the
    pages after it and eviction takes a sequence's tail first (as a radix tree evicts leaves).

    Args:
        capacity_pages: pages HBM can hold (0 disables the cache).
    """

    def __init__(self, capacity_pages: int):
        self.capacity_pages = int(capacity_pages)
        self._lru: OrderedDict[str, None] = OrderedDict()
        self.evicted_pages = 0

    def __len__(self) -> int:
        return len(self._lru)

    def __contains__(self, key: str) -> bool:
        return key in self._lru

    def match_prefix(self, keys: Sequence[str]) -> int:
        """Number of leading ``keys`` held in HBM (no recency update)."""
        n = 0
        for k in keys:
            if k not in self._lru:
                break
            n += 1
        return n

    def insert(self, keys: Sequence[str]) -> None:
        """Make ``keys`` most recent (``keys[0]`` the most recent of all), then evict LRU pages
        down to capacity."""
        if self.capacity_pages <= 0:
            return
        lru = self._lru
        for k in reversed(keys):
            if k in lru:
                lru.move_to_end(k)
            else:
                lru[k] = None
        while len(lru) > self.capacity_pages:
            lru.popitem(last=False)
            self.evicted_pages += 1


# ------------------------------------------------------------------------------- host pages
class HostPages:
    """Free list of whole pages of a host pool; hands out SGLang-style token-slot indices.

    Args:
        pool: a host pool (``page_size``, ``size`` attributes).
    """

    def __init__(self, pool):
        self.pool = pool
        self.page_size = int(pool.page_size)
        self._free: list[int] = list(range(int(pool.size) // self.page_size - 1, -1, -1))
        self._offsets = torch.arange(self.page_size, dtype=torch.int64)

    @property
    def free_pages(self) -> int:
        return len(self._free)

    def alloc(self, pages: int) -> torch.Tensor:
        """Token slots of ``pages`` free pages: int64 CPU tensor, shape ``[pages * page_size]``,
        page ``i`` at ``[i*page_size, (i+1)*page_size)``, each page's slots contiguous and
        page-aligned."""
        if pages > len(self._free):
            raise MemoryError(f"host pool has {len(self._free)} free pages, {pages} requested")
        ids = [self._free.pop() for _ in range(pages)]
        starts = torch.tensor(ids, dtype=torch.int64) * self.page_size
        return (starts[:, None] + self._offsets[None, :]).reshape(-1)

    def free(self, host_indices: torch.Tensor) -> None:
        """Return the pages of ``host_indices`` (as from :meth:`alloc`) to the free list."""
        for s in host_indices[:: self.page_size].tolist():
            self._free.append(s // self.page_size)


# --------------------------------------------------------------------------------- page bytes
_MIX = 0x5851F42D4C957F2D  # odd 63-bit multiplier


class PageContent:
    """Deterministic page bytes from a page key, and their verification in a host pool.

    ``bytes(key) = int64 words w[i] = i * 0x5851F42D4C957F2D + xxh64(key)`` (wrapping), laid out
    in the order of the pool's data page (``get_data_page(idx)``). One vector add per page.

    Args:
        pool: the host pool whose pages are filled and checked.
    """

    def __init__(self, pool):
        self.pool = pool
        page = pool.get_data_page(0, flat=False)
        self._shape = tuple(page.shape)
        isz = page.element_size()
        self.page_bytes = page.numel() * isz
        if self.page_bytes % 8:
            raise ValueError("page bytes must be a multiple of 8")
        base = np.arange(self.page_bytes // 8, dtype=np.uint64) * np.uint64(_MIX)
        self._base = torch.from_numpy(base.view(np.int64))
        self._buf = torch.empty_like(self._base)  # reused: no allocation (page faults) per page
        # compare in the widest unit the page's last dimension allows
        row_bytes = self._shape[-1] * isz
        self._cmp_dtype = torch.int64 if row_bytes % 8 == 0 else torch.uint8
        self._cmp_shape = self._shape[:-1] + (row_bytes // self._cmp_dtype.itemsize,)

    def expected(self, key: str, out: Optional[torch.Tensor] = None) -> torch.Tensor:
        """The page's bytes as a flat int64 tensor of ``page_bytes / 8`` words (into ``out``)."""
        seed = xxhash.xxh64_intdigest(key.encode()) - (1 << 63)
        return torch.add(self._base, seed, out=out) if out is not None else self._base + seed

    def fill(self, host_slot: int, key: str) -> None:
        """Write ``key``'s bytes into the page starting at token slot ``host_slot``."""
        self.pool.set_from_flat_data_page(host_slot, self.expected(key, self._buf).view(self.pool.dtype))

    def verify(self, host_slot: int, key: str) -> bool:
        """True when the page at ``host_slot`` holds exactly ``key``'s bytes."""
        got = self.pool.get_data_page(host_slot, flat=False).view(self._cmp_dtype)
        want = self.expected(key, self._buf).view(self._cmp_dtype).view(self._cmp_shape)
        return torch.equal(got, want)


def reusable_pages(n_keys: int, prompt_tokens: int, page_size: int) -> int:
    """Pages of a prompt SGLang can take from a cache (HBM, host or L3): it matches at most
    ``prompt_tokens - 1`` tokens (the last prompt token is always computed: its logits give the
    first output token; ``Req._compute_max_prefix_len``), in whole pages, and at most the
    prompt's ``n_keys`` whole pages. A prompt of exactly k pages reuses k - 1."""
    return max(0, min(n_keys, (prompt_tokens - 1) // page_size))


def reusable_counts(reqs: Sequence[Any], keys: Sequence[Sequence[str]], page_size: int) -> list[int]:
    """:func:`reusable_pages` of every request (``reqs[i].prompt_tokens`` with ``keys[i]``), for
    :func:`flatcake.replay.traces.ideal_hit_rate`."""
    return [reusable_pages(len(ks), r.prompt_tokens, page_size) for r, ks in zip(reqs, keys)]


@dataclass
class EngineConfig:
    """Engine-model knobs (the ``replay:`` config section).

    Attributes:
        hbm_pages: HBM prefix-cache capacity in pages.
        host_pool_pages: host-pool pages (>= 2 x 128 needed; the pool is a bounce buffer here).
        prefetch_threshold_tokens: SGLang's ``prefetch_threshold`` (skip L3 below this).
        prefetch_policy: ``timeout`` (SGLang 0.5.23's default ``--hicache-storage-prefetch-policy``:
            a prefetch still reading when its deadline passes is cut, the rest recomputed) or
            ``wait_complete`` (every hit page is waited for).
        prefetch_timeout_base_s, prefetch_timeout_per_ki_token_s: SGLang's timeout formula, with
            SGLang 0.5.23's defaults (extra-config ``prefetch_timeout_base`` 1 s and
            ``prefetch_timeout_per_ki_token`` 0.25 s, ``HybridCacheController``).
    """

    hbm_pages: int = 512
    host_pool_pages: int = 512
    prefetch_threshold_tokens: int = 256
    prefetch_policy: str = "timeout"
    prefetch_timeout_base_s: float = 1.0
    prefetch_timeout_per_ki_token_s: float = 0.25

    #: the prefetch policies the replay models (SGLang's ``best_effort`` is not modelled)
    POLICIES = ("timeout", "wait_complete")

    def prefetch_timeout_s(self, tokens: int) -> Optional[float]:
        """Seconds a prefetch of a requested span of ``tokens`` may take under
        ``prefetch_policy: timeout``; ``None`` under ``wait_complete``. As SGLang 0.5.23
        (``UnifiedRadixCache._start_storage_prefetch_wait``): ``base + pages × page_size / 1024
        × per_ki_token``, pages = the span asked of storage (``stats_requested_tokens``, the
        page-aligned tokens after the device match, known before the hit query), so ``tokens /
        1024 × per_ki_token`` for a page-aligned span."""
        if self.prefetch_policy != "timeout":
            return None
        return self.prefetch_timeout_base_s + tokens / 1024 * self.prefetch_timeout_per_ki_token_s

    @classmethod
    def from_settings(cls, settings: Mapping[str, Any]) -> "EngineConfig":
        """The knobs from the merged ``replay:`` settings (``flatcake.replay.cli.replay_settings``:
        every field is a key there)."""
        return cls(**{f.name: settings[f.name] for f in fields(cls)})




# ------------------------------------------------------------------------------------ the steps
@dataclass(frozen=True)
class Prefix:
    """Where a request's prompt stands before L3 (step 0), in pages.

    Attributes:
        keys: the prompt's page keys.
        reusable: leading pages SGLang may take from a cache (:func:`reusable_pages`).
        hbm: leading pages held in the HBM prefix cache (<= ``reusable``).
    """

    keys: Sequence[str]
    reusable: int
    hbm: int

    @property
    def rest(self) -> Sequence[str]:
        """The span asked of L3: the reusable pages after the HBM match."""
        return self.keys[self.hbm:self.reusable]


class EngineCore:
    """What every replay engine holds and how it takes a request's steps (the module docstring).

    Args:
        profile: the model profile (page geometry, cost model).
        cfg: the engine knobs (``engine_cfg``).
        pool: the host pool the engine's reads and writes go through (``page_size``, ``size``).

    Raises:
        ValueError: a host pool of fewer than 2 × 128 pages (names ``host_pool_pages``).
    """

    def __init__(self, profile, cfg: EngineConfig, pool):
        self.profile = profile
        self.engine_cfg = cfg
        self.hbm = HbmCache(cfg.hbm_pages)
        self.pages = HostPages(pool)
        if self.pages.free_pages < 2 * STORAGE_BATCH_PAGES:
            raise ValueError(f"host_pool_pages must be >= {2 * STORAGE_BATCH_PAGES}")

    def flush(self) -> None:
        """Drop the HBM prefix cache, as SGLang's ``POST /flush_cache`` drops its device (and
        host) tiers; the L3 keeps its pages."""
        self.hbm = HbmCache(self.engine_cfg.hbm_pages)

    def match(self, keys: Sequence[str], prompt_tokens: int) -> Prefix:
        """Step 0: the reusable pages of a prompt of ``prompt_tokens`` tokens with page keys
        ``keys``, and the leading run of them in HBM (no recency update)."""
        reusable = reusable_pages(len(keys), prompt_tokens, self.profile.page_size)
        return Prefix(keys, reusable, self.hbm.match_prefix(keys[:reusable]))

    def asks_l3(self, pages: int) -> bool:
        """Step 1's threshold: ``pages`` (a span, or a hit) is fetched from L3 only when it has
        pages and ``pages × page_size >= prefetch_threshold_tokens``, as SGLang."""
        return pages > 0 and pages * self.profile.page_size >= self.engine_cfg.prefetch_threshold_tokens

    def prefetch_budget_s(self, prefix: Prefix) -> Optional[float]:
        """Seconds the prefetch of ``prefix.rest`` may take (``prefetch_policy: timeout``), or
        None (``wait_complete``): :meth:`EngineConfig.prefetch_timeout_s` of the span asked."""
        return self.engine_cfg.prefetch_timeout_s(len(prefix.rest) * self.profile.page_size)

    def insert(self, keys: Sequence[str]) -> None:
        """Step 6: every page of the prompt becomes most recent in HBM (LRU eviction)."""
        self.hbm.insert(keys)


def usable_hit(hit: int, span_pages: int) -> int:
    """Step 2: a hit query's leading run, clamped to ``[0, span_pages]``."""
    return max(0, min(int(hit), span_pages))


def prefill_tokens(prompt_tokens: int, cached_pages: int, page_size: int) -> tuple[int, int]:
    """Step 4: ``(new, cached)`` tokens of the prefill once ``cached_pages`` leading pages came
    from HBM or L3 (the partial tail page and the last prompt token are always among ``new``)."""
    cached = cached_pages * page_size
    return max(0, prompt_tokens - cached), cached


def read_batches(hit: int, read: Callable[[int, int], int], stop: Callable[[], bool] = lambda: False) -> int:
    """Step 3: pages ``[0, hit)`` of the span asked in 128-page calls. ``read(b, e)`` reads
    pages ``[b, e)`` and returns the leading run delivered; the loop stops after the first call
    short of its pages, and before a call once ``stop()`` is true (the prefetch budget spent, or
    the request admitted without the rest). Returns the pages delivered."""
    loaded = 0
    for b in range(0, hit, STORAGE_BATCH_PAGES):
        if stop():
            break
        e = min(hit, b + STORAGE_BATCH_PAGES)
        got = read(b, e)
        loaded += got
        if got < e - b:
            break
    return loaded


@dataclass
class WriteBack:
    """What step 5 did with a request's computed pages (pages).

    Attributes:
        written: pages stored.
        failed: pages of the first refused put and every page after it (never tried).
        skipped: pages not tried for lack of host pages (the serving model's backup).
    """

    written: int = 0
    failed: int = 0
    skipped: int = 0


def write_batches(keys: Sequence[str], start: int,
                  write: Callable[[Sequence[str], Sequence[str]], Optional[bool]]) -> WriteBack:
    """Step 5: the computed pages ``keys[start:]`` in 128-page calls, each with every key before
    it as prefix keys: ``write(batch, prefix_keys)`` returns True (stored), False (the put was
    refused: this batch and the rest count as failed, the rest is not tried) or None (no host
    pages for it: the rest is skipped)."""
    out = WriteBack()
    todo = keys[start:]
    for b in range(0, len(todo), STORAGE_BATCH_PAGES):
        batch = list(todo[b: b + STORAGE_BATCH_PAGES])
        ok = write(batch, list(keys[: start + b]))
        if ok is None:
            out.skipped += len(todo) - b
            break
        if not ok:
            out.failed += len(todo) - b
            break
        out.written += len(batch)
    return out


def fill_pages(content, host: torch.Tensor, keys: Sequence[str], page_size: int) -> None:
    """The computed pages' bytes: ``keys[i]``'s into page ``i`` of ``host`` (int64 token slots,
    whole pages) with ``content`` (:class:`PageContent` or a hybrid pool's ``PoolContent``)."""
    for i, k in enumerate(keys):
        content.fill(int(host[i * page_size]), k)


def verify_pages(content, host: torch.Tensor, keys: Sequence[str], n: int, page_size: int) -> int:
    """Pages among the first ``n`` of ``host`` that do not hold exactly ``keys[i]``'s bytes
    (every delivered page is checked; harness work, outside the timed calls)."""
    return sum(1 for i in range(n) if not content.verify(int(host[i * page_size]), keys[i]))


def write_dense_batch(system, content, host: torch.Tensor, batch: Sequence[str], prefix_keys: Sequence[str],
                      page_size: int) -> bool:
    """One dense 128-page write-back call on ``system`` (an ``L3System``): fill the pages'
    bytes into ``host``, the system's ``prepare_set``, the (timed) ``set``, its ``after_call``.
    Returns True when every page was stored; the call's seconds are in ``system.last_call_s``
    where one call runs at a time."""
    fill_pages(content, host, batch, page_size)
    system.prepare_set(list(batch))
    ok = system.set(list(batch), host, list(prefix_keys))
    system.after_call()
    return bool(ok)


__all__ = ["EngineConfig", "EngineCore", "HbmCache", "HostPages", "PageContent", "Prefix", "WriteBack",
           "fill_pages", "prefill_tokens", "read_batches", "reusable_counts", "reusable_pages", "usable_hit",
           "verify_pages", "write_batches", "write_dense_batch"]
