"""L3 systems under test, each an SGLang ``HiCacheStorage`` backend called exactly as SGLang's
cache controller calls it (``managers/cache_controller.py`` in sglang 0.5.23).

* ``flatcake``: :class:`flatcake.FlatCakeStorage`, created by SGLang's own
  ``StorageBackendFactory.create_backend("dynamic", config)`` with ``interface_v1: 1``, so the
  zero-copy path is used: ``batch_exists`` → ``batch_get_v1(keys, host_indices, extra_info)`` →
  ``batch_set_v1``; ``register_mem_pool_host(pool)`` right after construction. Its I/O counters
  come from ``backend.flatcake_stats()`` (cumulative; deltas are taken around calls).
* ``file``: SGLang's ``HiCacheFile`` (``create_backend("file", ...)``). It has no v1 methods in
  0.5.23, so it goes through the controller's generic path: ``batch_get(keys, [dummy flat
  page …])`` then ``set_from_flat_data_page`` for the leading run of non-None results, and
  ``batch_set(keys, [pool.get_data_page(slot) …])``. HiCacheFile keeps one file per page, so its
  I/O is accounted here: a delivered page = one read op of ``page_bytes``; a page written that did
  not exist before = one write op of ``page_bytes``; every hit is an SSD hit.

  HiCacheFile uses buffered I/O, so without care its reads would come from the OS page cache
  (this machine has more RAM than the demo writes). With ``drop_page_cache`` (default on) the
  harness flushes each newly written page file (one ``os.sync()`` per write call) and drops it and
  every file it read from the page cache (``posix_fadvise(DONTNEED)``), outside the timed calls,
  so its reads hit the disk as FlatCake's O_DIRECT reads do. Both replay models do this: each
  calls ``prepare_set`` before and ``after_call`` after every ``get``/``set``, on the thread that
  made the call (the serving model's lane and backup threads; the drop is advisory, so a drop
  while another thread reads the same file only sends that read to the disk).

Thread safety: the concurrent serving model (:mod:`flatcake.replay.serving`) calls ``exists``,
``get``, ``set`` and ``medium_summary`` from several threads at once and times each call itself;
``last_call_s`` is then meaningless, and ``get``'s DRAM/SSD split is taken from
``medium_summary`` instead of counter deltas.

Lifecycle: ``make_system(name, ...)`` → ``exists``/``get``/``set`` per request (each ``set``
preceded by ``prepare_set``, each ``get``/``set`` followed by ``after_call``) →
``counters()`` → ``close()``. Each call leaves the seconds spent in exactly the work SGLang's
controller does for it (the backend call plus, on the generic path, the dummy pages and
``set_from_flat_data_page``) in ``last_call_s``; harness bookkeeping (counter snapshots,
page-cache drops) is outside that. A backend exception is a miss / a failed write (counted in
``errors``), as in SGLang, which logs and carries on.
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
from flatcake.replay.budget import (dram_capacity, file_extra_at_equal_capacity, flatcake_keys_at_equal_capacity,
                                    ssd_capacity)
from flatcake.replay.engine import ModelProfile

log = logging.getLogger(__name__)

#: cumulative counters every system reports (bytes, ops, pages)
COUNTER_KEYS = (
    "hit_pages_dram",
    "hit_pages_ssd",
    "ssd_read_bytes",
    "ssd_read_ops",
    "ssd_over_read_bytes",
    "ssd_write_bytes",
    "ssd_write_ops",
    "dram_write_bytes",
    "logical_write_bytes",
    "logical_read_bytes_ssd",
    "merged_reads",
    "queued_hit_pages",  # FlatCake: pages served from its SSD write backlog (in memory); 0 elsewhere
)


def unwrap_failure_injector(backend):
    """The backend itself, also when SGLang's test fault injector wraps it.

    With ``SGLANG_TEST_HICACHE_BACKEND_RANDOM_{DELAY,FAILURE}`` set, SGLang's factory returns a
    ``HiCacheStorageFailureInjector`` around the backend; the harness calls the wrapper (as
    SGLang does) but reads counters and file paths from the backend inside. The injector keeps
    it in its ``_backend`` attribute and offers no public accessor (sglang 0.5.23), so this is
    the one place the harness reads it.
    """
    from sglang.srt.mem_cache.hicache_storage import HiCacheStorageFailureInjector

    if isinstance(backend, HiCacheStorageFailureInjector):
        return backend._backend
    return backend


def extra_info(prefix_keys):
    """SGLang's ``HiCacheStorageExtraInfo`` carrying ``prefix_keys`` (the page keys before a call's)."""
    from sglang.srt.mem_cache.hicache_storage import HiCacheStorageExtraInfo

    return HiCacheStorageExtraInfo(prefix_keys=list(prefix_keys))


def storage_config(extra_config: dict, *, model: str = "test-model", mla: bool = False, layout: str = "page_first",
                   tp_rank: int = 0, tp_size: int = 1):
    """The ``HiCacheStorageConfig`` SGLang's controller builds for one rank (PP = CP = 1, DP rank
    0, metrics off): ``is_page_first_layout`` is true for ``page_first`` only, as in SGLang.

    Args:
        extra_config: the ``--hicache-storage-backend-extra-config`` mapping.
        model: ``model_name`` (SGLang's ``--served-model-name``).
        mla: ``is_mla_model`` (KV replicated over TP ranks; only rank 0 writes).
        layout: the host-pool layout.
        tp_rank, tp_size: the rank's tensor-parallel position.
    """
    from sglang.srt.mem_cache.hicache_storage import HiCacheStorageConfig

    return HiCacheStorageConfig(
        tp_rank=tp_rank, tp_size=tp_size, pp_rank=0, pp_size=1, attn_cp_rank=0, attn_cp_size=1,
        is_mla_model=mla, enable_storage_metrics=False, is_page_first_layout=layout == "page_first",
        model_name=model, extra_config=extra_config,
    )


def profile_storage_config(profile: ModelProfile, extra_config: dict):
    """:func:`storage_config` for a model profile (its name, attention and layout)."""
    return storage_config(extra_config, model=profile.name, mla=profile.attention == "mla", layout=profile.layout)


class L3System:
    """Base: one backend + its host pool. Subclasses implement the three calls.

    Attributes:
        name: system name used in reports.
        pool: the host pool (a :mod:`flatcake.adapter.host_pool` double).
        backend: the ``HiCacheStorage`` instance.
        errors: backend exceptions caught (each treated as a miss / failed write).
    """

    name = "?"
    has_l3 = True  # False: no L3 at all (the serving model then runs no storage threads)

    def __init__(self, profile: ModelProfile, pool, backend):
        self.profile = profile
        self.pool = pool
        self.backend = backend
        self.page_size = profile.page_size
        self.errors = 0
        self.inner = unwrap_failure_injector(backend)  # harness bookkeeping uses this one
        self.last_call_s = 0.0  # seconds of the last exists/get/set call (storage time)
        #: of the last ``get``'s ``ssd_pages``, those served from a write backlog in memory before
        #: their bytes reached the disk (FlatCake's ``ssd.write_backlog_bytes``; 0 elsewhere).
        #: One-request-at-a-time replay only: the serving model takes it from the pages' media.
        self.last_backlog_pages = 0

    def exists(self, keys: list[str], prefix_keys: list[str]) -> int:
        """``batch_exists(keys, extra_info(prefix_keys))``: leading run of present pages."""
        info = extra_info(prefix_keys)
        t0 = time.perf_counter()
        try:
            n = int(self.backend.batch_exists(keys, info) or 0)
        except Exception:  # SGLang logs and treats it as 0 hits
            n = -1
        self.last_call_s = time.perf_counter() - t0
        if n < 0:
            self._error("batch_exists")
            return 0
        return n

    def get(self, keys: list[str], host_indices: torch.Tensor, prefix_keys: list[str]) -> tuple[int, int, int]:
        """Read ``keys`` into the host pages of ``host_indices``.

        Returns:
            ``(delivered, dram_pages, ssd_pages)``: the leading run of pages delivered, split by
            the L3 medium they are placed on (``dram_pages + ssd_pages == delivered``); of the
            ``ssd_pages``, those a write backlog served from memory are in ``last_backlog_pages``.
        """
        raise NotImplementedError

    def set(self, keys: list[str], host_indices: torch.Tensor, prefix_keys: list[str]) -> bool:
        """Write the host pages of ``host_indices`` under ``keys``; True when all succeeded."""
        raise NotImplementedError

    def get_v1(self, keys: list[str], host_indices: torch.Tensor, prefix_keys: list[str]) -> int:
        """Timed ``batch_get_v1`` (SGLang's zero-copy read) into ``host_indices``: returns the
        leading run of pages delivered (0 when the backend raised, counted in ``errors``) and
        leaves the call's seconds in ``last_call_s``."""
        info = extra_info(prefix_keys)
        t0 = time.perf_counter()
        failed, res = False, None
        try:
            res = self.backend.batch_get_v1(keys, host_indices, info)
        except Exception:
            failed = True
        count = 0
        for r in res or []:
            if not r:
                break
            count += 1
        self.last_call_s = time.perf_counter() - t0
        if failed:
            self._error("batch_get_v1")
        return count

    def set_v1(self, keys: list[str], host_indices: torch.Tensor, prefix_keys: list[str]) -> Optional[list]:
        """Timed ``batch_set_v1`` (SGLang's zero-copy write-back): the per-page results, or None
        when the backend raised (counted in ``errors``); seconds in ``last_call_s``."""
        info = extra_info(prefix_keys)
        t0 = time.perf_counter()
        try:
            res = list(self.backend.batch_set_v1(keys, host_indices, info) or [])
        except Exception:
            res = None
        self.last_call_s = time.perf_counter() - t0
        if res is None:
            self._error("batch_set_v1")
        return res

    def medium_summary(self, keys: list[str]):
        """:class:`~flatcake.store.page_store.MediumSummary` of stored ``keys`` (FC-MAS lanes). A backend
        without media reports every page on SSD."""
        from flatcake.store.page_store import MediumSummary

        n = len(keys)
        return MediumSummary(0, n, n * self.profile.page_bytes, ("ssd",) * n)

    def prepare_set(self, keys: list[str]) -> None:
        """Harness bookkeeping before a timed ``set`` (not storage time)."""

    def after_call(self) -> None:
        """Harness work after a timed ``get``/``set`` (not storage time)."""

    def counters(self) -> dict[str, int]:
        """Cumulative I/O counters (see :data:`COUNTER_KEYS`)."""
        raise NotImplementedError

    def close(self) -> None:
        close = getattr(self.inner, "close", None)  # the injector forwards close() blindly
        if close is not None:
            try:
                close()
            except Exception:
                self._error("close")

    def _error(self, what: str) -> None:
        self.errors += 1
        if self.errors <= 3:
            log.exception("%s: %s raised (counted as a miss/failure)", self.name, what)


class _CallKeys(threading.local):
    """Per thread: the keys its last ``get`` read and its pending ``set`` will write."""

    def __init__(self):
        self.read: list[str] = []
        self.new: list[str] = []


class FileSystem(L3System):
    """SGLang's HiCacheFile through the controller's generic (non-v1) path."""

    name = "file"

    def __init__(self, profile: ModelProfile, pool, root: Path, extra: Optional[Mapping[str, Any]] = None,
                 drop_page_cache: bool = True):
        from sglang.srt.mem_cache.storage.backend_factory import StorageBackendFactory

        self.root = Path(root)
        cfg = {"file_storage_path": str(self.root), **dict(extra or {})}
        backend = StorageBackendFactory.create_backend("file", profile_storage_config(profile, cfg), None)
        backend.register_mem_pool_host(pool)
        super().__init__(profile, pool, backend)
        self.drop_page_cache = drop_page_cache
        self._c = dict.fromkeys(COUNTER_KEYS, 0)
        self._c_lock = threading.Lock()
        self._tl = _CallKeys()  # keys read / about to be written by this thread's last call

    def _path(self, key: str) -> str:
        # HiCacheFile's own naming of a KV page: <file_path>/<key><config_suffix>.bin
        return os.path.join(self.inner.file_path, f"{key}{self.inner.config_suffix}.bin")

    def _drop(self, keys, sync: bool) -> None:
        if not self.drop_page_cache or not keys:
            return
        if sync:
            os.sync()
        for k in keys:
            drop_page_cache(self._path(k), sync=False)  # os.sync() above flushed them

    def get(self, keys, host_indices, prefix_keys):
        pool, P = self.pool, self.page_size
        t0 = time.perf_counter()
        dummy = [pool.get_dummy_flat_data_page() for _ in keys]
        failed = False
        try:
            data = self.backend.batch_get(keys, dummy)
        except Exception:
            failed, data = True, None
        count = 0
        if data is not None:
            for i in range(len(keys)):
                if data[i] is None:
                    break
                pool.set_from_flat_data_page(int(host_indices[i * P]), data[i])
                count += 1
        self.last_call_s = time.perf_counter() - t0
        if failed:
            self._error("batch_get")
        self._tl.read = keys[:count]
        pb = self.profile.page_bytes
        with self._c_lock:
            self._c["hit_pages_ssd"] += count
            self._c["ssd_read_bytes"] += count * pb
            self._c["ssd_read_ops"] += count
            self._c["logical_read_bytes_ssd"] += count * pb
        return count, 0, count

    def prepare_set(self, keys):
        # which pages HiCacheFile will really write (it skips keys whose file exists)
        self._tl.new = [k for k in keys if not self.inner.exists(k)]

    def set(self, keys, host_indices, prefix_keys):
        pool, P = self.pool, self.page_size
        t0 = time.perf_counter()
        data = [pool.get_data_page(int(host_indices[i * P])) for i in range(len(keys))]
        try:
            ok = bool(self.backend.batch_set(keys, data))
        except Exception:
            ok = None
        self.last_call_s = time.perf_counter() - t0
        if ok is None:
            self._error("batch_set")
        return bool(ok)

    def after_call(self) -> None:
        if self._tl.read:
            self._drop(self._tl.read, sync=False)
            self._tl.read = []
        if self._tl.new:
            written = [k for k in self._tl.new if self.inner.exists(k)]
            self._tl.new = []
            pb = self.profile.page_bytes
            with self._c_lock:
                self._c["ssd_write_bytes"] += len(written) * pb
                self._c["ssd_write_ops"] += len(written)
                self._c["logical_write_bytes"] += len(written) * pb
            self._drop(written, sync=True)

    def counters(self):
        return dict(self._c)


class FlatCakeSystem(L3System):
    """FlatCakeStorage created by SGLang's factory as a ``dynamic`` backend with ``interface_v1``."""

    name = "flatcake"

    def __init__(self, profile: ModelProfile, pool, ssd_dir: Path, flatcake_keys: Mapping[str, Any]):
        from sglang.srt.mem_cache.storage.backend_factory import StorageBackendFactory

        extra = {**FLATCAKE_EXTRA, **dict(flatcake_keys), "ssd.path": str(ssd_dir)}
        backend = StorageBackendFactory.create_backend("dynamic", profile_storage_config(profile, extra), None)
        backend.register_mem_pool_host(pool)
        super().__init__(profile, pool, backend)
        self._stats = getattr(self.inner, "flatcake_stats", None)

    def _snap(self) -> dict[str, int]:
        if self._stats is None:
            return dict.fromkeys(COUNTER_KEYS, 0)
        s = self._stats()
        return {k: int(s.get(k, 0)) for k in COUNTER_KEYS}

    def get(self, keys, host_indices, prefix_keys):
        """The split from counter deltas around the call (exact one request at a time): DRAM
        pages from ``hit_pages_dram``; the rest are SSD pages, of which ``queued_hit_pages``
        were copied from the write backlog's in-memory round (``last_backlog_pages``)."""
        before = self._snap()
        count = self.get_v1(keys, host_indices, prefix_keys)
        after = self._snap()
        dram = min(count, after["hit_pages_dram"] - before["hit_pages_dram"])
        self.last_backlog_pages = min(count - dram, after["queued_hit_pages"] - before["queued_hit_pages"])
        return count, dram, count - dram

    def set(self, keys, host_indices, prefix_keys):
        res = self.set_v1(keys, host_indices, prefix_keys)
        return bool(res) and all(res)

    def medium_summary(self, keys):
        return self.inner.medium_summary(keys)

    def counters(self):
        """Cumulative counters at the end of a run, after the SSD write queue drained (rounds
        still queued would otherwise be missing from ``ssd_write_bytes``)."""
        store = getattr(self.inner, "store", None)
        if store is not None:
            store.flush_writes(600)
        return self._snap()


SYSTEMS = ("flatcake", "flatcake-fcfs", "tiered", "mooncake", "file", "dram-only", "recompute")
#: Each system's storage directory under the run's output directory (the others have none).
STORAGE_DIRS = {"flatcake": "flatcake-ssd", "flatcake-fcfs": "flatcake-fcfs-ssd", "tiered": "tiered-ssd",
                "mooncake": "mooncake-ssd", "file": "hicache-file"}
#: The systems that are FlatCake (their DRAM budget includes the write backlog at equal capacity).
FLATCAKE_SYSTEMS = ("flatcake", "flatcake-fcfs")
#: Systems that fix the prefetch-I/O order under load (``flatcake-fcfs``: FlatCake with FC-MAS
#: off, SGLang's FIFO); they run only in the serving model (``--qps``).
FIXED_SCHEDULER = {"flatcake-fcfs": "fcfs"}


def make_system(name: str, profile: ModelProfile, host_pool_pages: int, out_dir: Path,
                flatcake_keys: Mapping[str, Any], file_extra: Optional[Mapping[str, Any]] = None,
                drop_page_cache: bool = True, tiered_extra: Optional[Mapping[str, Any]] = None,
                mooncake_extra: Optional[Mapping[str, Any]] = None, equal_capacity: bool = False) -> L3System:
    """Create system ``name`` with a fresh host pool and an empty storage directory
    ``out_dir/STORAGE_DIRS[name]`` (an old one is removed first; ``dram-only`` and ``recompute``
    have none). ``mooncake`` runs only inside the replay's network namespace
    (:mod:`flatcake.replay.mooncake`).

    The baselines get FlatCake's capacities (``flatcake_keys``: DRAM ``dram.capacity_bytes``, SSD
    ``ssd.max_files × ssd.file_bytes``). With ``equal_capacity`` (the replay's comparisons)
    FlatCake's write backlog is counted in that DRAM budget: FlatCake is built with
    ``dram.capacity_bytes − ssd.write_backlog_bytes``
    (:func:`~flatcake.replay.budget.flatcake_keys_at_equal_capacity`, ``ValueError`` when the
    backlog is larger); without it (benchmarks, the cluster replay's nodes) with its keys as given."""
    pool = profile.make_host_pool(host_pool_pages)
    if name in ("dram-only", "recompute"):
        from flatcake.replay.baselines import DramOnlySystem, RecomputeSystem

        if name == "recompute":
            return RecomputeSystem(profile, pool)
        return DramOnlySystem(profile, pool, dram_capacity(flatcake_keys))
    if name == "tiered":
        from flatcake.replay.tiered import TieredSystem

        root = Path(out_dir) / STORAGE_DIRS["tiered"]
        shutil.rmtree(root, ignore_errors=True)
        return TieredSystem(profile, pool, root, dram_capacity(flatcake_keys), ssd_capacity(flatcake_keys),
                            tiered_extra)
    if name == "mooncake":
        from flatcake.replay.mooncake import MooncakeSystem

        root = Path(out_dir) / STORAGE_DIRS["mooncake"]
        shutil.rmtree(root, ignore_errors=True)
        return MooncakeSystem(profile, pool, root, dram_capacity(flatcake_keys), ssd_capacity(flatcake_keys),
                              mooncake_extra)
    if name == "file":
        root = Path(out_dir) / STORAGE_DIRS["file"]
        shutil.rmtree(root, ignore_errors=True)
        extra = file_extra_at_equal_capacity(flatcake_keys, file_extra or {})  # equal capacity
        return FileSystem(profile, pool, root, extra, drop_page_cache)
    if name in FLATCAKE_SYSTEMS:
        root = Path(out_dir) / STORAGE_DIRS[name]
        shutil.rmtree(root, ignore_errors=True)
        keys = flatcake_keys_at_equal_capacity(flatcake_keys) if equal_capacity else flatcake_keys
        system = FlatCakeSystem(profile, pool, root, keys)
        system.name = name
        return system
    raise ValueError(f"unknown system {name!r} (known: {', '.join(SYSTEMS)})")
