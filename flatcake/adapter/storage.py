"""``FlatCakeStorage``: the SGLang ``HiCacheStorage`` (L3) adapter over :class:`flatcake.store.page_store.PageStore`.

Lifecycle (as SGLang 0.5.23's ``HiCacheController.attach_storage_backend`` drives it)::

    FlatCakeStorage(storage_config, kwargs)     # config parsed + validated, ssd.path checked
      -> register_mem_pool_host(host_pool)      # layout checked, namespace fixed, store opened
      -> batch_exists / batch_get_v1 / batch_set_v1 from 3 threads (prefetch, prefetch IO, backup)
      -> clear() / close()

Selected with ``--hicache-storage-backend dynamic`` and the extra config
:data:`flatcake.config.FLATCAKE_EXTRA` plus FlatCake's own keys, or the literal
``--hicache-storage-backend flatcake`` through the ``flatcake-sglang`` launcher.

Errors as values at the boundary: bad configuration, an unusable ``ssd.path`` or an
unsupported host-pool layout raise at start-up (construction / registration, so the attach
fails with the field named). After that no method raises into SGLang's threads: an I/O fault
is a miss (``False`` / ``None`` / a shorter leading run) or a failed put, logged once per errno.

Every call SGLang makes is counted per method (:class:`CallCounters`: calls, pages asked, pages
answered), in ``flatcake_stats()["sglang_calls"]`` and the ``flatcake_sglang_*`` metrics.
"""

from __future__ import annotations

import logging
import threading
import time
from typing import Any, List, Optional

import numpy as np
import torch
from sglang.srt.mem_cache.hicache_storage import HiCacheStorage, HiCacheStorageConfig, HiCacheStorageExtraInfo

from flatcake.config import FlatCakeConfig, config_from_extra
from flatcake.common.errorlog import ErrorLog
from flatcake.common.layout import KvPageLayout, UnsupportedLayoutError
from flatcake.adapter.v2 import HybridPoolsMixin, is_logical_anchor
from flatcake.adapter.identity import (PoolIdentity, base_identity, dp_rank_of, expand_advertise, expand_ssd_paths,
                                       open_pool, rank_port_offset, rank_values, sglang_replica)
from flatcake.adapter import rank_store
from flatcake.adapter.cluster_hook import start_member, stop_member
from flatcake.adapter.cluster_walk import hit_run, read_run
from flatcake.adapter.startup import (check_file_bytes, default_path_warning, native_warning, prefix_keys_warning,
                                      startup_line)
from flatcake.native import loops as native_loop
from flatcake.media.pool_dir import check_pool_dir
from flatcake.metrics import REFRESH_S, SGLANG_METHODS, make_exporter
from flatcake.store.page_store import MediumSummary, PageStore
from flatcake.store.write_queue import BacklogBudget

log = logging.getLogger("flatcake")

#: bytes in one "GB" of SGLang's storage bandwidth metrics (its Mooncake and HF3FS backends
#: divide by ``1 << 30``: GiB/s, labelled GB/s)
GB = 1 << 30


def make_namespace(cfg: HiCacheStorageConfig, pool, layout: KvPageLayout) -> str:
    """The key namespace: pages written under one namespace are never read under another.

    Includes the model name, TP rank/size (MHA only: MLA KV is replicated across TP ranks),
    PP and attention-CP ranks, page size, KV dtype, host layout, bytes per page.
    """
    parts = ["flatcake-v1", f"model={cfg.model_name or ''}"]
    if cfg.is_mla_model:
        parts.append("mla")
    else:
        parts.append(f"tp={cfg.tp_rank}/{cfg.tp_size}")
    parts += [
        f"pp={cfg.pp_rank}/{cfg.pp_size}",
        f"cp={cfg.attn_cp_rank}/{cfg.attn_cp_size}",
        f"page={layout.geometry.page_size}",
        f"dtype={str(pool.dtype).replace('torch.', '')}",
        f"layout={pool.layout}",
        f"page_bytes={layout.geometry.page_bytes}",
    ]
    if getattr(cfg, "dcp_size", 1) > 1:
        parts.append(f"dcp={cfg.dcp_rank}/{cfg.dcp_size}")
    return "|".join(parts)


def _prefix(extra_info: Optional[HiCacheStorageExtraInfo]) -> Optional[list]:
    return extra_info.prefix_keys if extra_info is not None else None


class CallCounters:
    """Calls SGLang made into the backend, per method of :data:`flatcake.metrics.SGLANG_METHODS`: ``calls``,
    ``asked`` (keys / pages passed in) and the answer (``present``: the leading run
    ``batch_exists`` reported; ``delivered``: pages read into the host pool; ``stored``: pages
    the call reported stored, keys already held included). Three integer adds under a lock per
    call; nothing per page."""

    def __init__(self):
        self._lock = threading.Lock()
        self._c = {m: [0, 0, 0] for m in SGLANG_METHODS}

    def note(self, method: str, asked: int, answered: int) -> None:
        with self._lock:
            c = self._c[method]
            c[0] += 1
            c[1] += asked
            c[2] += answered

    def snapshot(self) -> dict:
        """``{method: {"calls": n, "asked": pages, <answer>: pages}}`` for every method."""
        with self._lock:
            return {m: {"calls": c[0], "asked": c[1], SGLANG_METHODS[m]: c[2]} for m, c in self._c.items()}


class FlatCakeStorage(HybridPoolsMixin, HiCacheStorage):
    """SGLang L3 backend implementing FlatCake (paper §3; ``docs/design.md``).

    Args:
        storage_config: SGLang's :class:`HiCacheStorageConfig`; FlatCake keys come from its
            ``extra_config`` (dotted or nested, see ``docs/configuration.md``).
        kwargs: the dynamic factory's extra kwargs (unused; accepted for its signature).

    Raises:
        flatcake.config.ConfigError: unknown key or bad value (message names the field).
        flatcake.media.errors.SsdStartupError: ``ssd.path`` cannot be created or written.
    """

    def __init__(self, storage_config: HiCacheStorageConfig, kwargs: Optional[dict] = None):
        self.storage_config = storage_config
        #: the data-parallel replica SGLang spawned this process for (None: no DP controller)
        self.replica = sglang_replica()
        cfg = config_from_extra(storage_config.extra_config if storage_config else None)
        # {tp_rank}/{pp_rank}/{dp_rank} in ssd.path filled for this rank (ConfigError naming ssd.path);
        # cluster.advertise's port + this rank's offset (one data plane per rank)
        ranks = rank_values(storage_config, self.replica)
        self.cfg: FlatCakeConfig = expand_advertise(expand_ssd_paths(cfg, ranks), rank_port_offset(storage_config, ranks))
        #: this rank's write-backlog bound, shared by the KV store and every v2 extra pool's store
        self.backlog_budget = (BacklogBudget(self.cfg.ssd.write_backlog_bytes) if self.cfg.ssd.write_backlog_bytes > 0
                               else None)
        # fail at construction, naming ssd.path, without creating it: a missing drive directory of
        # an existing pool is a drive that is not mounted (flatcake.media.ssd.SsdFilePool decides)
        check_pool_dir(self.cfg.ssd.path)
        #: this process's pool identity (:mod:`flatcake.adapter.identity`), once registered
        self.identity: Optional[PoolIdentity] = None
        self.store: Optional[PageStore] = None
        self.cluster = None  # ClusterMember when cluster.etcd is set (flatcake.adapter.cluster_hook)
        #: the FC-MAS plugin's restore lanes driving this backend's prefetches (flatcake.adapter.plugin)
        self.prefetch_lanes = None
        self.layout: Optional[KvPageLayout] = None
        self.mem_pool_host = None
        self.is_writer = storage_config.is_storage_writer if storage_config else True
        self._lock = threading.Lock()
        self._metrics_lock = threading.Lock()
        self._prefetch_pgs: list = []
        self._backup_pgs: list = []
        self._prefetch_bw: list = []
        self._backup_bw: list = []
        self.errors = ErrorLog(log)  # the store's once it is open
        #: where FlatCake's own metrics go (``prometheus_client`` registry; None: the default one)
        self.prometheus_registry = None
        self._exporter = None
        self._exporter_tried = False
        self._metrics_refreshed_at = float("-inf")
        #: SGLang's calls into this backend, per method (``flatcake_stats()["sglang_calls"]``)
        self.calls = CallCounters()

    # ------------------------------------------------------------------ registration
    def register_mem_pool_host(self, mem_pool_host) -> None:
        """Bind the KV host pool: checks its layout (``layer_first``, ``page_first``,
        ``page_first_direct``; MHA or MLA), fixes the namespace and opens the store.

        Raises:
            UnsupportedLayoutError: any other layout (named in the message).
            ConfigError: ``ssd.file_bytes`` cannot hold one 128-page round of these pages
                (:func:`flatcake.adapter.startup.check_file_bytes`; names the field).
            SsdStartupError: the SSD pool cannot be created.

        A KV anchor without bytes (SGLang's ``LogicalHostPool``, DeepSeek-V4) opens no KV
        store: :meth:`~flatcake.adapter.v2.HybridPoolsMixin.register_logical_anchor`.
        """
        if is_logical_anchor(mem_pool_host):
            self.register_logical_anchor(mem_pool_host)
            return
        super().register_mem_pool_host(mem_pool_host)
        layout = KvPageLayout.from_host_pool(mem_pool_host)
        check_file_bytes(self.cfg, layout.geometry)  # ConfigError naming ssd.file_bytes
        with self._lock:
            stop_member(self.cluster)
            self.cluster = None
            if self.store is not None:
                self.refresh_metrics(force=True)
                rank_store.withdraw(self.store)
                self.store.close()
            self.layout = layout
            self.namespace = make_namespace(self.storage_config, mem_pool_host, layout)
            sc = self.storage_config
            # MLA KV is replicated over TP ranks and only the writer rank stores it; the other
            # ranks follow the writer's pool through its scope journal (flatcake.gva.journal).
            shared = bool(sc and sc.is_mla_model and sc.tp_size > 1)
            role = ("writer" if self.is_writer else "follower") if shared else "single"
            # DP replicas and servers sharing ssd.path with this namespace get separate pools
            # (DP rank, then a free slot or ssd.pool_id); a follower finds its writer's
            self.store, self.identity = open_pool(
                lambda instance: PageStore(self.cfg, layout.geometry, self.namespace, instance=instance, role=role,
                                           backlog_budget=self.backlog_budget),
                self.cfg, self.namespace, base_identity(sc, self.cfg, self.replica), role)
            self.errors = self.store.errors
            rank_store.publish(self.store)  # the direct linker of this rank uses it too
            self.cluster = start_member(self.cfg, self.store, self.namespace)
            if self._exporter is not None:
                self._exporter.new_store(self._metric_labels())
        self._log_startup(role, self.identity)

    def _log_startup(self, role: str, ident: PoolIdentity) -> None:
        """Log this rank's start-up line (INFO) and a WARNING each when ``ssd.path`` is the
        per-user default, SGLang passes no prefix keys or a C loop fell back
        (:mod:`flatcake.adapter.startup`); the namespace goes to DEBUG. Binds every C loop of
        the extension first (:func:`flatcake.native.loops.wait_all`; no compiler runs)."""
        sc, store = self.storage_config, self.store
        ranks = (f"tp {sc.tp_rank}/{sc.tp_size} pp {sc.pp_rank}/{sc.pp_size} {ident.base}" if sc else ident.base)
        native_loop.wait_all()
        loops = native_loop.report()
        log.info("%s", startup_line(
            store.snapshot_stats(), ssd_path=self.cfg.ssd.path, pool_prefix=store.ssd.prefix,
            pool_identity=ident.describe(),
            file_bytes=self.cfg.ssd.file_bytes, max_files=self.cfg.ssd.max_files, pinned=store.dram.pinned,
            direct_io=store.ssd.direct_io, page_bytes=self.layout.geometry.page_bytes, ranks=ranks, role=role,
            native_loops=loops))
        for warning in (default_path_warning(self.cfg.ssd.path), prefix_keys_warning(), native_warning(loops)):
            if warning:
                log.warning("%s", warning)
        log.debug("flatcake: namespace %s: %s", self.namespace, store.describe())

    def _closed(self) -> bool:
        return self.store is not None and self.store.closed

    def _ready(self) -> bool:
        if self.store is not None:
            return True
        self.errors.report("call", "not registered", "called before register_mem_pool_host; every call is a miss")
        return False

    def _v1_page_ids(self, keys: List[str], host_indices: torch.Tensor) -> Optional[list]:
        """Host page numbers for a zero-copy call, or ``None`` when there is nothing to do
        (not registered yet, no keys, or unusable ``host_indices``)."""
        if not self._ready() or not keys:
            return None
        return self._page_ids(host_indices, len(keys))

    def _page_ids(self, host_indices: torch.Tensor, n: int) -> Optional[list]:
        """Host page numbers of ``n`` pages, or ``None`` (logged once) unless ``host_indices``
        holds exactly ``n`` whole, page-aligned pages of token slots."""
        ps = self.mem_pool_host.page_size
        hi = torch.as_tensor(host_indices)
        # no torch op (each would give the GIL up, docs/performance.md): a CPU int tensor is
        # checked in numpy (issue 11), anything else converted once and checked in plain Python
        if ps == 1 and hi.dim() == 1 and hi.dtype in (torch.int64, torch.int32):  # every slot is a page
            ids = hi.tolist()
            ids = ids if len(ids) == n else None
        elif hi.device.type == "cpu" and hi.dtype in (torch.int64, torch.int32) and not hi.requires_grad:
            ids = page_numbers(hi.numpy().reshape(-1), n, ps)
        else:
            v = hi.tolist() if hi.dim() == 1 else hi.flatten().tolist()
            starts = v[::ps]
            ok = len(v) == n * ps and all(s % ps == 0 for s in starts) and v == [s + j for s in starts for j in range(ps)]
            ids = [s // ps for s in starts] if ok else None
        if ids is None:
            self.errors("host_indices", ValueError(f"host_indices must be {n} whole page-aligned pages of {ps} slots"))
        return ids

    # ------------------------------------------------------------------ queries
    def exists(self, key: str) -> bool:
        """True if ``key`` is stored. Never raises."""
        try:
            ok = bool(self._ready() and self.store.exists(key))
        except Exception as e:  # pragma: no cover - defensive
            self.errors("exists", e)
            ok = False
        self.calls.note("exists", 1, ok)
        return ok

    def batch_exists(self, keys: List[str], extra_info: Optional[HiCacheStorageExtraInfo] = None) -> int:
        """Length of the leading run of stored keys (SGLang's hit query). Never raises."""
        n = self._leading_run(keys, extra_info)
        self.calls.note("batch_exists", len(keys), n)
        return n

    def _leading_run(self, keys: List[str], extra_info: Optional[HiCacheStorageExtraInfo]) -> int:
        """:meth:`batch_exists` without counting the call (also the v2 hit query's KV run)."""
        try:
            if self.logical_anchor or not self._ready():  # a logical anchor holds no KV page
                return 0
            # the local run, then other nodes' runs and local ones in turn (cluster_walk)
            return hit_run(self.store, self.cluster, keys, _prefix(extra_info))
        except Exception as e:
            self.errors("batch_exists", e)
            return 0

    def medium_summary(self, keys: List[str]):
        """:class:`~flatcake.store.page_store.MediumSummary` of ``keys``: pages on DRAM, pages and bytes on
        SSD (FC-MAS puts the request's prefetch in the DRAM or the SSD lane by it; paper §3.2).
        Before the host pool is registered, or after close, every key counts on neither medium.
        With a logical KV anchor (DeepSeek-V4) the extra pools' pages count. Never raises."""
        try:
            if self.logical_anchor:
                return self.pools_medium_summary(keys)
            if self._ready():
                return self.store.medium_summary(keys)
        except Exception as e:  # pragma: no cover - defensive
            self.errors("medium_summary", e)
        return MediumSummary(0, 0, 0, (None,) * len(keys))

    # ------------------------------------------------------------------ zero-copy (interface_v1)
    def batch_get_v1(self, keys: List[str], host_indices: torch.Tensor, extra_info: Optional[HiCacheStorageExtraInfo] = None) -> List[bool]:
        """Read pages into host-pool slots ``host_indices`` (int64, ``len(keys) * page_size``
        token slots, page ``i`` at ``host_indices[i * page_size]``). Returns per-page success;
        only the leading run is True. Never raises."""
        out = self._get_v1(keys, host_indices, extra_info)
        self.calls.note("batch_get_v1", len(keys), sum(out))
        return out

    def _get_v1(self, keys, host_indices, extra_info) -> List[bool]:
        try:
            if self.logical_anchor:  # no KV bytes (DeepSeek-V4): the v2 pools carry the data
                return [True] * len(keys)
            ids = self._v1_page_ids(keys, host_indices)
            if ids is None:
                return [False] * len(keys)
            t0 = _now()
            out = read_run(self.store, self.cluster, keys, self.layout, ids)  # local and other nodes' runs
            self._note_metric("prefetch", sum(out), t0)  # pages read
            return out
        except Exception as e:
            self.errors("batch_get_v1", e)
            return [False] * len(keys)

    def batch_set_v1(self, keys: List[str], host_indices: torch.Tensor, extra_info: Optional[HiCacheStorageExtraInfo] = None) -> List[bool]:
        """Store pages from host-pool slots ``host_indices``. Ranks that are not the storage
        writer (MLA, ``tp_rank != 0``) write nothing and report success. Never raises."""
        out = self._set_v1(keys, host_indices, extra_info)
        self.calls.note("batch_set_v1", len(keys), sum(out))
        return out

    def _set_v1(self, keys, host_indices, extra_info) -> List[bool]:
        try:
            if self.logical_anchor:  # no KV bytes (DeepSeek-V4): the v2 pools carry the data
                return [True] * len(keys)
            if not self.is_writer:
                return [not self._closed()] * len(keys)
            ids = self._v1_page_ids(keys, host_indices)
            if ids is None:
                return [False] * len(keys)
            t0 = _now()
            out, written = self.store.put_counted(keys, self.layout, ids, _prefix(extra_info))
            self._note_metric("backup", written, t0)  # pages written by this call
            return out
        except Exception as e:
            self.errors("batch_set_v1", e)
            return [False] * len(keys)

    # ------------------------------------------------------------------ generic path (flat pages)
    def batch_get(self, keys: List[str], target_locations: Optional[Any] = None, target_sizes: Optional[Any] = None) -> List[Optional[torch.Tensor]]:
        """Generic read path: fills ``target_locations[i]`` (flat data pages, e.g.
        ``get_dummy_flat_data_page()``) and returns it, or ``None`` from the first miss on."""
        out = self._get_flat(keys, target_locations)
        self.calls.note("batch_get", len(keys), len(out) - out.count(None))
        return out

    def _get_flat(self, keys, target_locations) -> List[Optional[torch.Tensor]]:
        try:
            if not self._ready() or not keys:
                return [None] * len(keys)
            n = len(keys)
            if target_locations is None:
                target_locations = [self.mem_pool_host.get_dummy_flat_data_page() for _ in range(n)]
            flat = torch.empty((n, target_locations[0].numel()), dtype=target_locations[0].dtype)
            lay = KvPageLayout.from_flat_pages(flat, self.mem_pool_host)
            t0 = _now()
            ok = read_run(self.store, self.cluster, keys, lay, list(range(n)))
            self._note_metric("prefetch", sum(ok), t0)
            out: List[Optional[torch.Tensor]] = []
            for i, good in enumerate(ok):
                if not good:
                    out += [None] * (n - i)
                    break
                target_locations[i].copy_(flat[i])
                out.append(target_locations[i])
            return out
        except Exception as e:
            self.errors("batch_get", e)
            return [None] * len(keys)

    def batch_set(self, keys: List[str], values: Optional[Any] = None, target_locations: Optional[Any] = None, target_sizes: Optional[Any] = None) -> bool:
        """Generic write path: ``values[i]`` are flat data pages (views into the host pool,
        copied before returning). True only if every page is stored."""
        ok = self._set_flat(keys, values)
        self.calls.note("batch_set", len(keys), len(keys) if ok else 0)
        return ok

    def _set_flat(self, keys, values) -> bool:
        try:
            if not self.is_writer:
                return not self._closed()
            if not self._ready() or not keys:
                return False
            flat = torch.stack([v.reshape(-1) for v in values])
            lay = KvPageLayout.from_flat_pages(flat, self.mem_pool_host)
            t0 = _now()
            out, written = self.store.put_counted(keys, lay, list(range(len(keys))), None)
            self._note_metric("backup", written, t0)
            return all(out)
        except Exception as e:
            self.errors("batch_set", e)
            return False

    def get(self, key: str, target_location: Optional[Any] = None, target_sizes: Optional[Any] = None) -> Optional[torch.Tensor]:
        """One page through the generic path; ``None`` on a miss."""
        page = self._get_flat([key], [target_location] if target_location is not None else None)[0]
        self.calls.note("get", 1, page is not None)
        return page

    def set(self, key: str, value: Optional[Any] = None, target_location: Optional[Any] = None, target_sizes: Optional[Any] = None) -> bool:
        """Store one flat page through the generic path."""
        ok = self._set_flat([key], [value])
        self.calls.note("set", 1, ok)
        return ok

    # ------------------------------------------------------------------ admin
    def clear(self) -> None:
        """Drop every stored page not currently being read. Never raises."""
        try:
            if self.store is not None:
                self.store.clear()
            self.clear_extra_pools()  # v2 pools (flatcake.adapter.v2)
        except Exception as e:
            self.errors("clear", e)

    def flush_writes(self, timeout_s: float = 10.0) -> bool:
        """Wait until the pages stored so far are on their medium (the write queues drained: the
        KV store's and every v2 extra pool's, :meth:`flush_extra_pools`) and, in a cluster,
        their rounds are committed to the index (tests, the replays). Returns False after
        ``timeout_s`` seconds per stage (seconds) or before registration (no store open: with a
        logical KV anchor, only the pools' stores)."""
        pools = self.flush_extra_pools(timeout_s)  # None: no extra pool store
        if self.store is None:
            return bool(pools)
        ok = self.store.flush_writes(timeout_s) and pools is not False
        if self.cluster is not None:
            ok = self.cluster.flush(timeout_s) and ok
        return bool(ok)

    def close(self) -> None:
        """Release files, staging buffers and pinned memory (of the v2 extra pools too)."""
        self.close_extra_pools()
        with self._lock:
            stop_member(self.cluster)
            self.cluster = None
            if self.store is not None:
                try:
                    self.refresh_metrics(force=True)
                    rank_store.withdraw(self.store)
                    self.store.close()
                except Exception as e:  # pragma: no cover - best effort at shutdown
                    log.warning("flatcake close: %s", e)

    def flatcake_stats(self) -> dict:
        """FlatCake's cumulative counters (see :class:`flatcake.store.page_store.StoreStats`); with a
        cluster also ``cluster`` (:meth:`flatcake.cluster.member.ClusterMember.stats`); while the
        FC-MAS plugin drives the prefetches also ``mas_lanes``
        (:meth:`flatcake.mas.lanes.Lanes.stats`: prefetches per lane, overtakes). Always
        ``sglang_calls`` (:meth:`CallCounters.snapshot`: SGLang's calls per method, since this
        backend was created, also before registration) and ``native_loops``
        (:func:`flatcake.native.loops.report`: each C loop's ``state`` and ``reason``)."""
        d = self.store.snapshot_stats() if self.store is not None else {}
        d["sglang_calls"] = self.calls.snapshot()
        d["native_loops"] = native_loop.report()
        if self.cluster is not None:
            d["cluster"] = self.cluster.stats()
        lanes = self.prefetch_lanes
        if lanes is not None:
            d["mas_lanes"] = lanes.stats()
        return d

    def _metrics_on(self) -> bool:
        return bool(self.storage_config and self.storage_config.enable_storage_metrics)

    def _note_metric(self, kind: str, pages: int, t0: float) -> None:
        """Record one call for SGLang's storage histograms: ``pages`` moved (pages) and
        ``pages * page_bytes / seconds / 2**30`` (SGLang's "GB/s", as its Mooncake backend
        computes it), into the ``kind`` (``"prefetch"`` / ``"backup"``) lists. A call that moved no
        page records nothing. The lists are looked up under the lock :meth:`get_stats` swaps them
        under, so a count never lands in a list already handed to SGLang (issue 24 item 9)."""
        if not self._metrics_on() or not pages:
            return
        dt = max(_now() - t0, 1e-9)
        with self._metrics_lock:
            getattr(self, f"_{kind}_pgs").append(pages)
            getattr(self, f"_{kind}_bw").append(pages * self.layout.geometry.page_bytes / dt / GB)

    def get_stats(self):
        """SGLang storage metrics since the last call (SGLang drains it once per scheduler step
        with ``--enable-metrics``), or ``None`` when storage metrics are off.

        Returns:
            ``StorageMetrics`` with one entry per ``batch_get*`` / ``batch_set*`` call that moved
            pages: ``prefetch_pgs`` the pages read, ``backup_pgs`` the pages this call wrote
            (keys the store already held and pages of failed rounds excluded), bandwidths in
            SGLang's "GB/s" (``2**30`` bytes per second over the store call's wall time). Also
            refreshes FlatCake's own ``flatcake_*`` metrics (at most every
            :data:`~flatcake.metrics.REFRESH_S` seconds; ``docs/metrics.md``). Never raises.
        """
        if not self._metrics_on():
            return None
        self.refresh_metrics()
        try:
            from sglang.srt.observability.metrics_collector import StorageMetrics
        except Exception:  # pragma: no cover - metrics module needs prometheus
            return None
        with self._metrics_lock:
            m = StorageMetrics()
            m.prefetch_pgs, self._prefetch_pgs = self._prefetch_pgs, []
            m.backup_pgs, self._backup_pgs = self._backup_pgs, []
            m.prefetch_bandwidth, self._prefetch_bw = self._prefetch_bw, []
            m.backup_bandwidth, self._backup_bw = self._backup_bw, []
        return m

    def refresh_metrics(self, force: bool = False) -> None:
        """Bring FlatCake's own Prometheus metrics (:mod:`flatcake.metrics`) to the store's
        counters: at most once per :data:`~flatcake.metrics.REFRESH_S` seconds unless
        ``force``. A no-op while storage metrics are off, before registration, or without
        ``prometheus_client`` (logged once). Never raises."""
        if not self._metrics_on() or self.store is None or self.store.closed:
            return
        now = _now()
        if not force and now - self._metrics_refreshed_at < REFRESH_S:
            return
        self._metrics_refreshed_at = now
        try:
            with self._metrics_lock:  # get_stats (scheduler thread) and close may race here
                if not self._exporter_tried:
                    self._exporter_tried = True
                    self._exporter = make_exporter(self._metric_labels(), self.prometheus_registry)
            if self._exporter is not None:
                self._exporter.update(self.flatcake_stats())
        except Exception as e:
            self.errors("metrics", e)

    def _metric_labels(self) -> dict:
        """Labels of FlatCake's own metrics for the open store: its pool (file prefix, unique
        per process: :mod:`flatcake.adapter.identity`) and ranks; ``dp_rank`` is the replica the
        pool identity uses (SGLang's replica number when it gives every replica DP rank 0)."""
        sc = self.storage_config
        return {"pool": self.store.ssd.prefix, "tp_rank": sc.tp_rank if sc else 0,
                "pp_rank": sc.pp_rank if sc else 0, "dp_rank": dp_rank_of(sc, self.replica) if sc else 0}

#: the clock of the per-call timings (seconds; tests may replace it)
clock = time.perf_counter


def page_numbers(slots: np.ndarray, n: int, page_size: int) -> Optional[list]:
    """Host page numbers (a list of ``n`` ints, ``slots[i * page_size] // page_size``) when
    ``slots`` (int ``[n * page_size]`` token slots) holds exactly ``n`` whole page-aligned pages
    of ``page_size`` consecutive slots each, else ``None``. Numpy only (no torch op)."""
    if slots.shape[0] != n * page_size:
        return None
    if page_size == 1:  # every slot is a whole page
        return slots.tolist()
    starts = slots[::page_size]
    if (starts % page_size).any() or not (slots.reshape(n, page_size) == starts[:, None] + np.arange(page_size)).all():
        return None
    return (starts // page_size).tolist()


def _now() -> float:
    return clock()
