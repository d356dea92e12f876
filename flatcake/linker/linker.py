"""``FlatCakeLinker``: SGLang 0.5.23's direct L3 ``UnifiedCacheLinker`` over FlatCake's page store.

The HiCache door (:class:`flatcake.adapter.storage.FlatCakeStorage`) moves pages between the
store and SGLang's host pool; this door moves them between the store and the **device** pools,
with no host tier: a load is FC-CIO's sorted, merged direct reads into the staging window and the
scatter straight into the device slots, layer by layer under the forward (paper §3.3); an offload
gathers device pages into a round placed by the session that produced it (paper §3.1). Both
doors use one store per rank (:mod:`flatcake.adapter.rank_store`).

Lifecycle (as ``UnifiedCacheLinkerWrapper`` drives it)::

    FlatCakeLinker(server_args, params, components=..., extra_config=..., forward_stream=...)
        config parsed + validated (names the field), device pool mapped, store opened or borrowed
    lookup(rid, transfers)            -> every restorable prefix length, in pages
    load(rid, transfers)              queue; start_layer_wise_loading() -> counter index
    (forward waits per layer)         finish_layer_wise_loading(index) -> True when all landed
    cancel_queued_load(rid)
    offload(transfers, session_id)    queue; num_completed_offloads() / pop_completed_offload()
    reset() / close()

Selected with::

    --enable-unified-cache-external-linker --unified-cache-external-linker-backend dynamic
    --unified-cache-external-linker-config '{"linker": "FlatCakeLinker",
        "linker_module_path": "flatcake.linker", "linker_extra_config": {"ssd.path": "/nvme/fc"}}'

``linker_extra_config`` takes FlatCake's configuration exactly as the HiCache door's extra
config does (dotted or nested keys, ``flatcake_config`` for a YAML file;
``docs/configuration.md``); ``docs/linker.md`` describes this door.

Errors as values at the boundary: bad configuration, an unusable ``ssd.path`` or an unsupported
device pool raise at construction (the field or pool named). After that no method raises into
SGLang's threads: a fault is an empty lookup, a refused load (``False``), a failed layer
(reported by ``finish_layer_wise_loading``) or a failed offload (``False`` from
``pop_completed_offload``), each logged once per errno.
"""

from __future__ import annotations

import logging
import threading
from collections import deque
from copy import deepcopy
from dataclasses import dataclass
from types import SimpleNamespace
from typing import Optional

import torch
from sglang.srt.mem_cache.hicache_storage import HiCacheStorageConfig, PoolName, PoolTransfer
from sglang.srt.mem_cache.unified_cache.unified_cache_linker import LayerWiseLoadCounter, UnifiedCacheLinker
from sglang.srt.utils import get_device_module

from flatcake.adapter import rank_store
from flatcake.adapter.identity import (base_identity, expand_advertise, expand_ssd_paths, open_pool,
                                       rank_port_offset, rank_values, sglang_replica)
from flatcake.adapter.startup import check_file_bytes
from flatcake.adapter.storage import make_namespace
from flatcake.adapter.v2 import TP_SHARDED_POOLS, capacity_weight, pool_config, pool_key
from flatcake.common.errorlog import ErrorLog
from flatcake.config import FlatCakeConfig, config_from_extra
from flatcake.linker.device_kv import DeviceKv, device_kv_of, page_ids_of
from flatcake.linker.hybrid_pools import LINKER_COMPONENTS, LinkerPool, plan_pools, restorable_lengths
from flatcake.linker.layer_loads import (LinkerLoadError, LoadBatch, QueuedLoad, first_unlanded, layer_groups,
                                         mas_order, monotonic)
from flatcake.linker.sessions import SessionChains
from flatcake.linker.worker import SerialWorker
from flatcake.media.pool_dir import check_pool_dir
from flatcake.store.page_store import PageStore

log = logging.getLogger("flatcake.linker")
device_module = get_device_module()

#: tree components this linker restores (``docs/linker.md``, "Components")
SUPPORTED_COMPONENTS = LINKER_COMPONENTS


class FlatCakeLinker(UnifiedCacheLinker):
    """SGLang's direct L3 linker implementing FlatCake (paper §3; ``docs/linker.md``).

    Args:
        server_args: SGLang's ``ServerArgs`` (``model_path`` names the model in the namespace).
        params: SGLang's ``CacheInitParams``: ``page_size``, ``token_to_kv_pool_allocator``
            (its ``get_kvcache()`` is the device pool), ``tp_cache_group`` /
            ``attn_tp_cache_group``, ``pp_rank`` / ``pp_size``, ``attn_cp_rank`` / ``attn_cp_size``.
        components: the tree's components: FULL, + SWA (``SWAKVPool``), + MAMBA (``HybridLinearKVPool``
            / ``SWAKVPool`` with ``req_to_token_pool.mamba_pool``); :mod:`flatcake.linker.hybrid_pools`.
        extra_config: FlatCake's configuration (``linker_extra_config``: the HiCache door's keys).
        forward_stream: the stream the forward writes the device pools on (None: the current one).

    Raises:
        flatcake.linker.hybrid_pools.UnsupportedComponentError (a ValueError): a component or
            combination this linker cannot restore (named, with the reason).
        flatcake.common.layout.UnsupportedLayoutError: a FULL / SWA device pool other than MHA / MLA (named).
        flatcake.config.ConfigError: unknown key or bad value (the field named).
        flatcake.media.errors.SsdStartupError: ``ssd.path`` cannot be created or written.
    """

    def __init__(self, server_args, params, *, components=None, extra_config=None, forward_stream=None):
        self.forward_stream = forward_stream
        self.page_size = int(params.page_size)
        plan = plan_pools(params.token_to_kv_pool_allocator.get_kvcache(), params, components, self.page_size)
        self.device: DeviceKv = device_kv_of(plan.full_pool, self.page_size)
        #: the SWA / Mamba pools (empty for a plain model), each with its own store
        self.extras: tuple[LinkerPool, ...] = plan.extras
        self._extra = {p.name: p for p in self.extras}
        self.pools = {PoolName.KV: self.device.pool, **{PoolName(p.name): p.device_pool for p in self.extras}}
        self.num_layers = plan.num_layers or self.device.num_layers
        #: transfer layer -> FULL pool layer
        self.kv_layers = plan.full_layers if plan.full_layers is not None else {l: l for l in range(self.num_layers)}
        self.storage_config = _storage_config(server_args, params, self.device.is_mla, deepcopy(extra_config or {}))
        self.cfg = linker_config(self.storage_config)
        sc = self.storage_config
        #: MLA KV is replicated over TP ranks: only the writer rank (tp 0) stores it
        shared = bool(sc.is_mla_model and sc.tp_size > 1)
        self.is_writer = not shared or sc.tp_rank == 0
        self.role = ("writer" if self.is_writer else "follower") if shared else "single"
        self.store, self.owns_store = self._open_store()
        self.errors: ErrorLog = self.store.errors
        try:  # on a GPU: HBM staging windows and the Triton scatter for restores into the device pools
            self.store.attach_device_restore(self.device.layout.device)
            self._open_extra_stores()
        except BaseException:
            self._release_store()
            raise
        self.layer_done_counter = LayerWiseLoadCounter(self.num_layers)
        if plan.state_pool is not None:  # Mamba layers wait on the counter through req_to_token_pool
            plan.state_pool.register_layer_transfer_counter(self.layer_done_counter)
        self.sessions = SessionChains()
        self._lock = threading.Lock()  # pending loads, completed offloads, stats
        self._pending: dict[str, QueuedLoad] = {}
        self._batches: dict[int, LoadBatch] = {}
        self._completed: deque = deque()
        self._stats = {"lookups": 0, "lookup_hit_pages": 0, "loads": 0, "load_pages": 0, "load_batches": 0,
                       "load_failures": 0, "offloads": 0, "offload_pages": 0, "offload_failures": 0}
        tag = f"tp{sc.tp_rank}"
        self._loader = SerialWorker(self._run_batch, self._crashed_batch, f"flatcake-linker-load-{tag}")
        self._offloader = SerialWorker(self._run_offload, lambda job, e: self._offload_done(job, False),
                                       f"flatcake-linker-offload-{tag}")
        self._closed = False
        log.info("flatcake linker: %s%s, %d layers, page %d tokens, %s store (%s), namespace %s",
                 "MLA" if self.device.is_mla else "MHA", "".join(f" + {p.name}" for p in self.extras),
                 self.num_layers, self.page_size, "own" if self.owns_store else "shared", self.role, self.namespace)

    # ------------------------------------------------------------------ start-up
    def _open_store(self) -> tuple[PageStore, bool]:
        """This rank's store: the one the HiCache door published for the same ``ssd.path`` and
        page geometry, else a new one (published for the other door)."""
        g = self.device.layout.geometry
        shared = rank_store.borrow(self.cfg.ssd.paths, g)
        if shared is not None:
            self.namespace = shared.namespace
            return shared, False
        check_file_bytes(self.cfg, g)  # ConfigError naming ssd.file_bytes
        check_pool_dir(self.cfg.ssd.path)
        sc = self.storage_config
        pool_desc = SimpleNamespace(dtype=self.device.dtype, layout="device")
        self.namespace = make_namespace(sc, pool_desc, self.device.layout)
        replica = sglang_replica()
        store, self.identity = open_pool(
            lambda instance: PageStore(self.cfg, g, self.namespace, instance=instance, role=self.role),
            self.cfg, self.namespace, base_identity(sc, self.cfg, replica), self.role)
        rank_store.publish(store)
        return store, True

    def _open_extra_stores(self) -> None:
        """One store per SWA / Mamba pool beside the KV store, as the HiCache door's v2 interface
        opens them (:mod:`flatcake.adapter.v2`): namespace = KV's + the pool's name, layout and
        page bytes (+ the TP rank for a TP-sharded pool beside a replicated MLA KV); capacity
        scaled by :func:`~flatcake.adapter.v2.capacity_weight`; the pool's pages dropped with
        every KV scope the KV store frees."""
        if not self.extras:
            return
        sc, kv_g = self.storage_config, self.device.layout.geometry
        for p in self.extras:
            g = p.layout.geometry
            ns = f"{self.namespace}|pool={p.name}|pool_layout={p.layout.name}|pool_page_bytes={g.page_bytes}"
            role = self.store.role
            if p.name in TP_SHARDED_POOLS and role != "single":
                ns += f"|tp={sc.tp_rank}/{sc.tp_size}"
                role = "single"
            cfg = pool_config(self.cfg, kv_g.page_bytes, capacity_weight(p.name, g.page_bytes))
            p.store = PageStore(cfg, g, ns, instance=self.store.instance, role=role,
                                backlog_budget=getattr(self.store, "backlog_budget", None))
            p.store.attach_device_restore(p.layout.device)
        self.store.add_retire_listener(self._retire_extra_pages)

    def _retire_extra_pages(self, keys) -> None:
        """The KV store freed a scope holding ``keys``: drop the extra pools' scopes holding them."""
        for p in self.extras:
            if p.store is not None and not p.store.closed:
                p.store.drop_keys(keys)

    # ------------------------------------------------------------------ lookup
    def lookup(self, rid: str, transfers: list[PoolTransfer]) -> list[int]:
        """Every prefix length (pages, tail-relative) restorable on this rank, ascending.

        FULL only: ``[1, ..., n]`` for the leading run of ``n`` stored KV pages (every boundary
        of the run is restorable). With SWA / MAMBA transfers, only the lengths of that run at
        which every pool is satisfied (:func:`~flatcake.linker.hybrid_pools.restorable_lengths`:
        SWA the window of pages before the cut stored, MAMBA the state keyed by the cut's last
        page): a sparse set, since windows and states exist at offloaded node boundaries.
        ``[]`` on a miss, a transfer for a pool this linker does not store, or a fault. Never raises."""
        try:
            kv = _kv(transfers)
            if kv is None or not kv.keys:
                return []
            keys = list(kv.keys)
            n = self.store.leading_run(keys)
            ok = list(range(1, n + 1))
            for t in transfers:
                if t.name == PoolName.KV or not ok:
                    continue
                p = self._extra.get(pool_key(t.name))
                if p is None:
                    self.errors.report("linker lookup", "unknown pool", f"no store for pool {pool_key(t.name)!r}")
                    return []
                allowed = restorable_lengths(p.store.exists, keys[:n], t)
                ok = [m for m in ok if m in allowed]
            with self._lock:
                self._stats["lookups"] += 1
                self._stats["lookup_hit_pages"] += ok[-1] if ok else 0
            return ok
        except Exception as e:
            self.errors("linker lookup", e)
            return []

    # ------------------------------------------------------------------ loads
    def load(self, rid: str, transfers: list[PoolTransfer]) -> bool:
        """Queue ``rid``'s KV transfer (keys and device slots) for the next
        :meth:`start_layer_wise_loading`. False (nothing queued) when the transfer has no KV
        pages, its slots are not whole page-aligned pages, ``rid`` is already queued, or the
        linker is closed. Never raises."""
        try:
            pages = self._device_pages(transfers, "linker load")
            if pages is None:
                return False
            kv, ids, extras = pages
            with self._lock:
                if rid in self._pending:
                    return False
                self._pending[rid] = QueuedLoad(rid, tuple(kv.keys), tuple(ids), monotonic(), extras)
            return True
        except Exception as e:
            self.errors("linker load", e)
            return False

    def _device_pages(self, transfers, what: str) -> Optional[tuple]:
        """``(kv transfer, KV device page ids, extra pools' pages)`` of a load's or an offload's
        transfers, or None when the linker is closed, there is no KV page, or some slots are not
        whole page-aligned pages (that last logged under ``what``)."""
        kv = _kv(transfers)
        if self._closed or kv is None or not kv.keys:
            return None
        ids = page_ids_of(kv.device_indices, len(kv.keys), self.page_size)
        if ids is None:
            self.errors(what, ValueError(
                f"device_indices must be {len(kv.keys)} whole page-aligned pages of {self.page_size} slots"))
            return None
        extras = self._extra_pages(transfers, what)
        return None if extras is None else (kv, ids, extras)

    def _extra_pages(self, transfers, what: str) -> Optional[tuple]:
        """``((pool name, keys, device page ids), ...)`` of the SWA / Mamba transfers, or None
        (logged) when one names a pool this linker does not store or its slots are not whole
        page-aligned pages of that pool."""
        out = []
        for t in transfers:
            if t.name == PoolName.KV or not t.keys:
                continue
            p = self._extra.get(pool_key(t.name))
            if p is None:
                self.errors.report(what, "unknown pool", f"no store for pool {pool_key(t.name)!r}")
                return None
            ids = page_ids_of(t.device_indices, len(t.keys), p.page_size)
            if ids is None:
                self.errors(what, ValueError(f"pool {p.name}: device_indices must be {len(t.keys)} whole "
                                             f"page-aligned pages of {p.page_size} slots"))
                return None
            out.append((p.name, tuple(t.keys), tuple(ids)))
        return tuple(out)

    def cancel_queued_load(self, rid: str) -> bool:
        """Drop ``rid``'s load if it has not started; True when one was dropped. Never raises."""
        with self._lock:
            return self._pending.pop(rid, None) is not None

    def start_layer_wise_loading(self) -> int:
        """Start the queued loads as one batch in FC-MAS order (:func:`~flatcake.linker.layer_loads.mas_order`)
        on the load thread; returns its ``layer_done_counter`` index, or -1 when nothing was
        queued. Never raises (a batch that cannot start has every layer failed)."""
        with self._lock:
            pending, self._pending = list(self._pending.values()), {}
        if not pending:
            return -1
        index = self.layer_done_counter.update_producer()
        try:
            if self._closed:
                raise LinkerLoadError("the linker is closed")
            loads = mas_order(pending, lambda keys: self.store.medium_summary(keys).ssd_bytes, monotonic())
            batch = LoadBatch(index, loads, ready=self._device_ready_event())
            with self._lock:
                self._batches[index] = batch
                self._stats["load_batches"] += 1
                self._stats["loads"] += len(loads)
            self._loader.submit(batch)
        except Exception as e:
            self.errors("linker load", e)
            with self._lock:
                self._batches.pop(index, None)  # never submitted: nothing to wait for
            self.layer_done_counter.fail(index, LinkerLoadError(f"load batch {index} did not start: {e}"))
        return index

    def finish_layer_wise_loading(self, counter_index: int) -> bool:
        """Wait until batch ``counter_index`` stops writing device memory; True when every layer
        of every load landed. Never raises."""
        try:
            landed = self.layer_done_counter.finish(counter_index)
        except Exception as e:
            self.errors("linker finish", e)
            landed = False
        with self._lock:
            batch = self._batches.pop(counter_index, None)
            if not landed:
                self._stats["load_failures"] += 1
        if batch is not None:
            batch.done.wait()
        return bool(landed)

    def _device_ready_event(self):
        """An event recorded on the current stream (SGLang's device module: CUDA, or the CPU's
        trivial one): the load thread writes the device slots only after the work queued
        before it."""
        ev = device_module.Event()
        ev.record()
        return ev

    def _run_batch(self, batch: LoadBatch) -> None:
        """Load thread: read ``batch`` layer by layer into the device pool, completing each layer
        in order; fail the first layer that did not land and every later one."""
        try:
            self._read_batch(batch)
        finally:
            batch.done.set()

    def _read_batch(self, batch: LoadBatch) -> None:
        if batch.ready is not None:
            batch.ready.synchronize()
        keys, ids = batch.keys, batch.page_ids
        counter, index = self.layer_done_counter, batch.counter_index

        def landed(group, good: int) -> None:
            if good < len(keys):
                return
            for layer in group:
                batch.landed_layers.append(layer)
                counter.complete(index, layer)

        if self.extras:
            good, total, pool = self._read_hybrid_batch(batch)
        else:
            good, total, pool = (self.store.get_layer_wise(keys, self.device.layout, ids,
                                                           layer_groups(self.num_layers), landed), len(keys), "kv")
        bad = first_unlanded(batch, self.num_layers)
        if bad is None:
            with self._lock:
                self._stats["load_pages"] += len(keys)
            return
        what = "pages" if pool == "kv" else f"{pool} pages"
        err = LinkerLoadError(f"load batch {index}: layer {bad} did not land ({good} of {total} {what} "
                              "stored and read intact)")
        self.errors.report("linker load", "layer failed", str(err))
        counter.fail(index, err)

    def _read_hybrid_batch(self, batch: LoadBatch) -> tuple[int, int, str]:
        """Read a hybrid batch transfer layer by transfer layer: layer ``L`` is the FULL, SWA or
        Mamba layer it maps to, read from that pool's store into its device pages, then
        completed; the first that does not land stops the batch. Returns
        ``(good, total, pool)`` of the last pool read (the failed one on a fault)."""
        counter, index = self.layer_done_counter, batch.counter_index
        sources = [("kv", self.store, self.device.layout, self.kv_layers, batch.keys, batch.page_ids)]
        for p in self.extras:
            keys, ids = batch.pool_pages(p.name)
            if keys:
                sources.append((p.name, p.store, p.layout, p.layer_map, keys, ids))
        good, total, name = 0, 0, "kv"
        for layer in range(self.num_layers):
            for name, store, layout, layer_map, keys, ids in sources:
                local = layer_map.get(layer)
                if local is None:
                    continue
                total = len(keys)
                good = store.get_layer_wise(keys, layout, ids, [range(local, local + 1)], _ignore_group)
                if good < total:
                    return good, total, name
            batch.landed_layers.append(layer)
            counter.complete(index, layer)
        return good, total, name

    def _crashed_batch(self, batch: LoadBatch, error: BaseException) -> None:
        self.layer_done_counter.fail(batch.counter_index, error)

    # ------------------------------------------------------------------ offloads
    def offload(self, transfers: list[PoolTransfer], session_id: Optional[str] = None) -> bool:
        """Queue the KV transfer's device pages for storage, placed by ``session_id`` (the
        session whose insert produced them; :mod:`flatcake.linker.sessions`) or, without one, by
        their own key chain. The pages are read only after :meth:`record_offload_ready`'s
        events. False (nothing queued, nothing counted) when the transfer has no KV pages, its
        slots are not whole pages, or the linker is closed. Never raises."""
        try:
            pages = self._device_pages(transfers, "linker offload")
            if pages is None:
                return False
            kv, ids, extras = pages
            extras = tuple(e for e in extras if self._extra[e[0]].store.role != "follower")
            if not self.is_writer and not extras:  # an MLA follower rank: the writer rank stores the replicated KV
                self._offload_done(None, True)
                return True
            events = self.record_offload_ready()  # the forward's writes of these pages, and their indices
            self._offloader.submit(OffloadJob(list(kv.keys), ids, events, session_id, extras))
            return True
        except Exception as e:
            self.errors("linker offload", e)
            return False

    def _run_offload(self, job) -> None:
        """Offload thread: wait for the device pages, store them as rounds placed in the
        session's scope, count the completion."""
        for ev in job.events:
            ev.synchronize()
        prefix = self.sessions.prefix(job.session_id)
        ok = True
        for name, keys, ids in job.extras:  # the windows / states first: a lookup needs the KV run too
            p = self._extra[name]
            ok = all(p.store.put(keys, p.layout, ids, prefix)) and ok
        if self.is_writer:
            ok = all(self.store.put(job.keys, self.device.layout, job.page_ids, prefix)) and ok
        if ok:
            self.sessions.extend(job.session_id, job.keys)
        self._offload_done(job if self.is_writer else None, ok)  # KV pages counted where they were stored

    def _offload_done(self, job, ok: bool) -> None:
        with self._lock:
            self._completed.append(bool(ok))
            self._stats["offloads"] += 1
            if job is not None and ok:
                self._stats["offload_pages"] += len(job.keys)
            if not ok:
                self._stats["offload_failures"] += 1

    def num_completed_offloads(self) -> int:
        """Offloads finished (stored or failed) and not yet popped."""
        with self._lock:
            return len(self._completed)

    def pop_completed_offload(self) -> bool:
        """The oldest finished offload's result (True: every page stored), consumed; False when
        none is waiting. Never raises."""
        with self._lock:
            return self._completed.popleft() if self._completed else False

    def flush_writes(self, timeout_s: float = 30.0) -> bool:
        """Wait until every offload queued so far finished (its result countable) and the
        store's write queue drained (its pages on their medium: tests, tools). False after
        ``timeout_s`` seconds on the write queue. Never raises."""
        try:
            self._offloader.join()
            return all([self.store.flush_writes(timeout_s)] + [p.store.flush_writes(timeout_s) for p in self.extras])
        except Exception as e:
            self.errors("linker flush", e)
            return False

    # ------------------------------------------------------------------ lifecycle
    def reset(self) -> None:
        """Drop queued loads, wait for the started loads and queued offloads to finish, forget
        their results, the sessions' chains and the layer counter. Never raises."""
        try:
            with self._lock:
                self._pending.clear()
            self._loader.join()
            self._offloader.join()
            with self._lock:
                self._completed.clear()
                self._batches.clear()
            self.sessions.clear()
            self.layer_done_counter.reset()
        except Exception as e:
            self.errors("linker reset", e)

    def close(self) -> None:
        """Quiesce (:meth:`reset`), stop the threads and close the store when this door opened
        it (a store borrowed from the HiCache door stays open). Idempotent; never raises."""
        if self._closed:
            return
        self._closed = True
        self.reset()
        try:
            self._loader.close()
            self._offloader.close()
            log.info("flatcake linker stats: %s", self.linker_stats())
            self._release_store()
        except Exception as e:
            log.warning("flatcake linker close: %s", e)

    def _release_store(self) -> None:
        """Close the extra pools' stores, and the KV store when this door opened it (a borrowed
        one stays with its owner)."""
        for p in getattr(self, "extras", ()):
            if p.store is not None:
                p.store.close()
        if self.owns_store:
            rank_store.withdraw(self.store)
            self.store.close()

    def linker_stats(self) -> dict:
        """Counters since construction: ``lookups``, ``lookup_hit_pages``, ``loads`` (requests),
        ``load_pages`` (pages landed), ``load_batches``, ``load_failures`` (batches), ``offloads``,
        ``offload_pages`` (pages stored), ``offload_failures``."""
        with self._lock:
            return dict(self._stats)


@dataclass(frozen=True)
class OffloadJob:
    """One queued offload.

    Attributes:
        keys: the node's page keys.
        page_ids: their device page numbers.
        events: :meth:`~UnifiedCacheLinker.record_offload_ready`'s events, waited on before the
            pages are read.
        session_id: the session whose insert produced the pages, or None.
        extras: ``(pool name, keys, device page ids)`` of the SWA / Mamba transfers this rank stores.
    """

    keys: list
    page_ids: list
    events: list
    session_id: Optional[str]
    extras: tuple = ()


def _ignore_group(group, good: int) -> None:
    """``get_layer_wise``'s per-group callback where the caller completes layers itself."""


def _kv(transfers) -> Optional[PoolTransfer]:
    """The KV pool's transfer of ``transfers``, or None."""
    return next((t for t in transfers or () if t.name == PoolName.KV), None)


def _storage_config(server_args, params, is_mla: bool, extra_config: dict) -> HiCacheStorageConfig:
    """The rank's identity as the HiCache door sees it (``HiCacheStorageConfig``), so both doors
    name the same pool: TP rank and size from the attention-TP (else TP) cache group when
    ``torch.distributed`` is up, PP and attention-CP ranks from ``params``."""
    tp_rank, tp_size = 0, 1
    group = getattr(params, "attn_tp_cache_group", None) or getattr(params, "tp_cache_group", None)
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        tp_rank = torch.distributed.get_rank(group=group)
        tp_size = torch.distributed.get_world_size(group=group)
    return HiCacheStorageConfig(
        tp_rank=tp_rank, tp_size=tp_size, pp_rank=int(getattr(params, "pp_rank", 0)),
        pp_size=int(getattr(params, "pp_size", 1)), attn_cp_rank=int(getattr(params, "attn_cp_rank", 0)),
        attn_cp_size=int(getattr(params, "attn_cp_size", 1)), is_mla_model=is_mla, enable_storage_metrics=False,
        is_page_first_layout=False, model_name=getattr(server_args, "model_path", None) or "",
        extra_config=extra_config)


def linker_config(sc: HiCacheStorageConfig) -> FlatCakeConfig:
    """FlatCake's configuration for this rank, as the HiCache door builds it: the extra config
    validated (:func:`flatcake.config.config_from_extra`), ``ssd.path`` placeholders filled for
    the rank, ``cluster.advertise``'s port offset by it.

    Raises:
        flatcake.config.ConfigError: unknown key or bad value (the field named).
    """
    cfg = config_from_extra(sc.extra_config)
    ranks = rank_values(sc, sglang_replica())
    return expand_advertise(expand_ssd_paths(cfg, ranks), rank_port_offset(sc, ranks))
