"""L3 systems of a hybrid profile, called through SGLang 0.5.23's v2 pool interface exactly as
its ``HybridCacheController`` calls them (``mem_cache/hybrid_cache/hybrid_cache_controller.py``
and ``managers/cache_controller.py``):

* hit query: ``batch_exists_v2(keys, [PoolTransfer per pool], extra_info)`` once for the span
  (``_storage_hit_query``); the hit is its ``kv_hit_pages``;
* read, per 128-page batch: the KV anchor (``batch_get_v1`` zero-copy for FlatCake, the
  generic ``batch_get`` + ``set_from_flat_data_page`` for HiCacheFile), then
  ``batch_get_v2`` of the KV-derived pools at the anchor's host indices; the batch delivers the
  minimum of the leading runs (``_page_transfer_kv_batch``). Once every KV batch completed,
  the trailing pools in one ``batch_get_v2`` (``_page_transfer_sidecar``);
* write-back: ``batch_set_v2`` of the pools, then the KV anchor
  (``_page_backup_with_stable_layout``).

Systems: ``flatcake`` (:class:`FlatCakeV2System`, created by SGLang's factory as a ``dynamic``
backend; the anchor is a ``LogicalHostPool``, so FlatCake's v1 calls move no bytes and its
extra-pool stores carry the pages) and ``file`` (:class:`FileV2System`, SGLang's HiCacheFile,
which implements v2: one file per page and pool, ``<key>.<pool><suffix>.bin``, and an empty
file per KV anchor page). Other systems cannot run a hybrid profile
(:data:`HYBRID_SYSTEMS`); the CLI skips them with the reason.
"""

from __future__ import annotations

import logging
import os
import shutil
import threading
import time
from pathlib import Path
from typing import Any, Mapping, Optional

import torch

from flatcake.config import FLATCAKE_EXTRA
from flatcake.media.directio import drop_page_cache
from flatcake.replay.budget import file_extra_at_equal_capacity, flatcake_keys_at_equal_capacity
from flatcake.replay.engine import ModelProfile
from flatcake.replay.hybrid import HybridPools, pool_transfer
from flatcake.replay.systems import COUNTER_KEYS, STORAGE_DIRS, L3System, extra_info, profile_storage_config

log = logging.getLogger(__name__)

#: systems that run a hybrid profile through v2 (``recompute`` moves no bytes)
HYBRID_SYSTEMS = ("flatcake", "file", "recompute")
#: why each other system is skipped with a hybrid profile
HYBRID_SKIP_REASON = ("cannot run a hybrid model profile (model.pools): it has no v2 pool interface "
                      "(batch_exists_v2/batch_get_v2/batch_set_v2) in the replay")


def _leading(res) -> int:
    n = 0
    for r in res or []:
        if not r:
            break
        n += 1
    return n


class V2System(L3System):
    """Base of a system driven through v2: one backend, the :class:`HybridPools` registered
    with it (anchor by ``register_mem_pool_host``, then each pool by
    ``register_mem_host_pool_v2``, then ``on_host_pools_registered``). Subclasses implement
    the KV anchor's read and write (:meth:`kv_get`, :meth:`kv_set`) and the counters.

    Attributes:
        hybrid: the host pools.
        pool_errors: backend exceptions of v2 calls (also in ``errors``).
    """

    def __init__(self, profile: ModelProfile, pools: HybridPools, backend):
        from sglang.srt.mem_cache.hicache_storage import PoolName

        backend.register_mem_pool_host(pools.anchor)
        backend.register_mem_host_pool_v2(pools.anchor, PoolName.KV)
        for s in pools.specs:
            backend.register_mem_host_pool_v2(pools.pools[s.name], PoolName(s.name))
        backend.on_host_pools_registered()
        super().__init__(profile, pools.anchor, backend)
        self.hybrid = pools

    # -------------------------------------------------------------- the v2 calls
    def exists_v2(self, keys: list[str], prefix_keys: list[str]) -> tuple[int, dict]:
        """Timed ``batch_exists_v2`` of ``keys`` over every pool (trailing pools' windows are
        the last ``window_pages`` of ``keys``). Returns ``(kv_hit_pages, {pool: boundary})``;
        ``(0, {})`` when the backend raised (counted in ``errors``)."""
        ts = [pool_transfer(s, keys[-s.window_pages:] if s.trailing else None) for s in self.hybrid.specs]
        info = extra_info(prefix_keys)
        t0 = time.perf_counter()
        try:
            r = self.backend.batch_exists_v2(keys, ts, info)
        except Exception:
            r = None
        self.last_call_s = time.perf_counter() - t0
        if r is None:
            self._error("batch_exists_v2")
            return 0, {}
        hits = {str(getattr(k, "value", k)): int(v) for k, v in (r.extra_pool_hit_pages or {}).items()}
        return max(0, int(r.kv_hit_pages)), hits

    def pools_call(self, specs, keys: list[str], host: torch.Tensor, prefix_keys: list[str],
                   write: bool) -> dict[str, int]:
        """One timed ``batch_get_v2`` / ``batch_set_v2`` of ``keys`` at the host pages of
        ``host`` in each pool of ``specs``: ``{pool: leading run of pages that succeeded}``
        (0 for every pool when the backend raised, counted in ``errors``). Seconds in
        ``last_call_s``."""
        ts = [pool_transfer(s, list(keys), host) for s in specs]
        fn = self.backend.batch_set_v2 if write else self.backend.batch_get_v2
        t0 = time.perf_counter()
        try:
            res = fn(ts, extra_info=extra_info(prefix_keys))
        except Exception:
            res = None
        self.last_call_s = time.perf_counter() - t0
        if res is None:
            self._error("batch_set_v2" if write else "batch_get_v2")
            res = {}
        by_name = {str(getattr(k, "value", k)): v for k, v in res.items()}
        return {s.name: _leading(by_name.get(s.name)) for s in specs}

    def get_batch(self, keys: list[str], host: torch.Tensor, prefix_keys: list[str]) -> tuple[int, dict, float]:
        """One read batch as ``_page_transfer_kv_batch``: the KV anchor, then the KV-derived
        pools. Returns ``(delivered, {pool: leading run}, seconds)``: delivered is the minimum
        over the anchor and the pools."""
        kv, t_kv = self.kv_get(keys, host, prefix_keys)
        runs = self.pools_call(self.hybrid.derived, keys, host, prefix_keys, write=False)
        return min([kv, *runs.values()]), runs, t_kv + self.last_call_s

    def set_batch(self, keys: list[str], host: torch.Tensor, prefix_keys: list[str]) -> tuple[bool, float]:
        """One write-back batch as ``_page_backup_with_stable_layout``: the KV-derived pools
        (``batch_set_v2``), then the KV anchor. Returns ``(all pages stored, seconds)``."""
        runs = self.pools_call(self.hybrid.derived, keys, host, prefix_keys, write=True)
        t = self.last_call_s
        ok_kv, t_kv = self.kv_set(keys, host, prefix_keys)
        return ok_kv and all(v == len(keys) for v in runs.values()), t + t_kv

    def kv_get(self, keys, host, prefix_keys) -> tuple[int, float]:
        """Read the KV anchor's pages: ``(leading run, seconds)``."""
        raise NotImplementedError

    def kv_set(self, keys, host, prefix_keys) -> tuple[bool, float]:
        """Write the KV anchor's pages: ``(all stored, seconds)``."""
        raise NotImplementedError

    def get(self, keys, host_indices, prefix_keys):
        """Not used: a hybrid system is read by :meth:`get_batch`. Raises ``TypeError``."""
        raise TypeError("a hybrid system is driven by HybridEngine (get_batch)")

    def set(self, keys, host_indices, prefix_keys):
        """Not used: a hybrid system is written by :meth:`set_batch`. Raises ``TypeError``."""
        raise TypeError("a hybrid system is driven by HybridEngine (set_batch)")


class FlatCakeV2System(V2System):
    """FlatCakeStorage (SGLang's factory, ``dynamic``, ``interface_v1``) with a logical KV
    anchor: the anchor's v1 calls run as SGLang runs them (zero-copy) and move no bytes; the
    extra-pool stores hold the pages. Counters are the sums over the extra pools'
    ``extra_pool_stats()`` (:meth:`pool_counters`), read once every pool's SSD write queue
    drained (:meth:`counters`)."""

    name = "flatcake"

    #: seconds :meth:`counters` waits for the pools' write queues to drain (as the dense replay's)
    FLUSH_TIMEOUT_S = 600.0

    def __init__(self, profile: ModelProfile, pools: HybridPools, ssd_dir: Path, flatcake_keys: Mapping[str, Any]):
        from sglang.srt.mem_cache.storage.backend_factory import StorageBackendFactory

        extra = {**FLATCAKE_EXTRA, **dict(flatcake_keys), "ssd.path": str(ssd_dir)}
        backend = StorageBackendFactory.create_backend("dynamic", profile_storage_config(profile, extra), None)
        super().__init__(profile, pools, backend)
        #: per pool, the counters :meth:`counters` read (kept past ``close``)
        self.last_pool_counters: dict[str, dict[str, int]] = {}

    def kv_get(self, keys, host, prefix_keys):
        n = self.get_v1(keys, host, prefix_keys)
        return n, self.last_call_s

    def kv_set(self, keys, host, prefix_keys):
        res = self.set_v1(keys, host, prefix_keys)
        return bool(res) and all(res), self.last_call_s

    def pool_counters(self) -> dict[str, dict[str, int]]:
        """Per pool, its store's cumulative counters (:data:`COUNTER_KEYS`) now, as the store
        counts them: ``hit_pages_ssd`` are pages read from the disk (``logical_read_bytes_ssd``),
        ``queued_hit_pages`` the SSD pages copied from the write backlog's in-memory round before
        it reached the disk (memory, not SSD: the replay reports them as backlog hits). Which of
        the two served an SSD page depends on when the queue's writer thread ran, so only their
        sum is reproducible."""
        stats = self.inner.extra_pool_stats()
        return {n: {k: int(s.get(k, 0)) for k in COUNTER_KEYS} for n, s in stats.items()}

    def counters(self):
        """Sums over the pools, read once every pool's SSD write queue drained
        (``FlatCakeStorage.flush_writes``: rounds still queued would be missing from
        ``ssd_write_bytes``/``logical_write_bytes``) and before ``close``; each pool's in
        ``last_pool_counters`` (kept past ``close``)."""
        if not self.inner.flush_writes(self.FLUSH_TIMEOUT_S):
            log.warning("flatcake: the pools' write queues did not drain in %.0f s; write counters are short",
                        self.FLUSH_TIMEOUT_S)
        self.last_pool_counters = self.pool_counters()
        tot: dict[str, int] = {}
        for c in self.last_pool_counters.values():
            for k, v in c.items():
                tot[k] = tot.get(k, 0) + v
        return {**dict.fromkeys(COUNTER_KEYS, 0), **tot}

    def medium_summary(self, keys):
        return self.inner.medium_summary(keys)


class FileV2System(V2System):
    """SGLang's HiCacheFile through v2: the anchor's pages by the generic path (empty pages of
    a ``LogicalHostPool``: one empty file per KV page, which its ``batch_exists_v2`` counts as
    the KV run), the pools' pages one file each. I/O is accounted by the harness per pool
    (a page read = one read op of the pool's page bytes; a page file created = one write op),
    every hit an SSD hit; with ``drop_page_cache`` the files read and written are dropped
    from the OS page cache outside the timed calls (as :class:`~flatcake.replay.systems.FileSystem`)."""

    name = "file"

    def __init__(self, profile: ModelProfile, pools: HybridPools, root: Path,
                 extra: Optional[Mapping[str, Any]] = None, drop_cache: bool = True):
        from sglang.srt.mem_cache.storage.backend_factory import StorageBackendFactory

        self.root = Path(root)
        cfg = {"file_storage_path": str(self.root), **dict(extra or {})}
        backend = StorageBackendFactory.create_backend("file", profile_storage_config(profile, cfg), None)
        super().__init__(profile, pools, backend)
        self.drop_cache = drop_cache
        self._c = dict.fromkeys(COUNTER_KEYS, 0)
        self._lock = threading.Lock()

    def _path(self, key: str, pool: Optional[str]) -> str:
        # HiCacheFile's naming: <file_path>/<key>[.<pool>]<config_suffix>.bin (MLA: no TP rank)
        stem = key if pool is None else f"{key}.{pool}"
        return os.path.join(self.inner.file_path, f"{stem}{self.inner.config_suffix}.bin")

    def kv_get(self, keys, host, prefix_keys):
        P = self.page_size
        t0 = time.perf_counter()
        try:
            data = self.backend.batch_get(keys, [self.pool.get_dummy_flat_data_page() for _ in keys])
        except Exception:
            data = None
        n = 0
        for i, d in enumerate(data or []):
            if d is None:
                break
            self.pool.set_from_flat_data_page(int(host[i * P]), d)
            n += 1
        t = time.perf_counter() - t0
        if data is None:
            self._error("batch_get")
        return n, t

    def kv_set(self, keys, host, prefix_keys):
        P = self.page_size
        t0 = time.perf_counter()
        try:
            ok = bool(self.backend.batch_set(keys, [self.pool.get_data_page(int(host[i * P])) for i in range(len(keys))]))
        except Exception:
            ok = None
        t = time.perf_counter() - t0
        if ok is None:
            self._error("batch_set")
        return bool(ok), t

    def pools_call(self, specs, keys, host, prefix_keys, write):
        new = {s.name: [k for k in keys if not os.path.exists(self._path(k, s.name))] for s in specs} if write else {}
        runs = super().pools_call(specs, keys, host, prefix_keys, write)
        pb = {s.name: s.page_bytes for s in self.hybrid.specs}
        files = []
        with self._lock:
            for s in specs:
                if write:
                    made = [k for k in new[s.name] if os.path.exists(self._path(k, s.name))]
                    self._c["ssd_write_bytes"] += len(made) * pb[s.name]
                    self._c["ssd_write_ops"] += len(made)
                    self._c["logical_write_bytes"] += len(made) * pb[s.name]
                    files += [self._path(k, s.name) for k in made]
                else:
                    n = runs[s.name]
                    self._c["ssd_read_bytes"] += n * pb[s.name]
                    self._c["ssd_read_ops"] += n
                    self._c["logical_read_bytes_ssd"] += n * pb[s.name]
                    files += [self._path(k, s.name) for k in keys[:n]]
        if self.drop_cache and files:  # harness work, outside the timed call
            if write:
                os.sync()
            for f in files:
                drop_page_cache(f, sync=False)
        return runs

    def counters(self):
        return dict(self._c)


def make_hybrid_system(name: str, profile: ModelProfile, host_pool_pages: int, out_dir: Path,
                       flatcake_keys: Mapping[str, Any], file_extra: Optional[Mapping[str, Any]] = None,
                       drop_cache: bool = True, equal_capacity: bool = False) -> L3System:
    """Create system ``name`` (one of :data:`HYBRID_SYSTEMS`) for a hybrid profile with fresh
    :class:`HybridPools` of ``host_pool_pages`` pages and an empty storage directory.
    ``equal_capacity``: FlatCake's write backlog counted in its DRAM budget, as
    :func:`~flatcake.replay.systems.make_system`.

    Raises:
        ValueError: ``name`` cannot run a hybrid profile.
    """
    pools = HybridPools(profile.pools, host_pool_pages, profile.page_size, profile.layout)
    if name == "recompute":
        from flatcake.replay.baselines import RecomputeSystem

        return RecomputeSystem(profile, pools.anchor)
    if name not in ("flatcake", "file"):
        raise ValueError(f"system {name!r} {HYBRID_SKIP_REASON}")
    root = Path(out_dir) / STORAGE_DIRS[name]
    shutil.rmtree(root, ignore_errors=True)
    if name == "file":
        return FileV2System(profile, pools, root, file_extra_at_equal_capacity(flatcake_keys, file_extra or {}),
                            drop_cache)
    return FlatCakeV2System(profile, pools, root,
                            flatcake_keys_at_equal_capacity(flatcake_keys) if equal_capacity else flatcake_keys)


def restrict_to_hybrid(settings: dict) -> None:
    """A hybrid profile: keep the systems of :data:`HYBRID_SYSTEMS` in ``settings["systems"]``
    and record every other one in ``settings["skipped_systems"]`` with the reason.

    Raises:
        ValueError: no system is left (names ``--systems``).
    """
    keep = [n for n in settings["systems"] if n in HYBRID_SYSTEMS]
    skipped = {n: HYBRID_SKIP_REASON for n in settings["systems"] if n not in HYBRID_SYSTEMS}
    if not keep:
        raise ValueError(f"--systems: none of {', '.join(settings['systems'])} runs a hybrid model profile "
                         f"(model.pools); use {', '.join(HYBRID_SYSTEMS)}")
    settings["systems"] = keep
    settings["skipped_systems"] = {**settings.get("skipped_systems", {}), **skipped}
