"""SGLang 0.5.23's v2 pool interface on FlatCake: hybrid models (``docs/design.md``, "Hybrid models").

A model whose KV stack is not plain KV (sliding-window attention, Mamba state, the DSA indexer,
DeepSeek-V4's compressed pools, MiniMax sparse KV, EAGLE3 draft sidecars) makes SGLang's
``HybridCacheController`` register each extra host pool with :meth:`register_mem_host_pool_v2`
(then :meth:`on_host_pools_registered` once; dynamic sidecars later through v2 alone) and move
their pages with :meth:`batch_exists_v2`, :meth:`batch_get_v2` and :meth:`batch_set_v2`, each
carrying :class:`~sglang.srt.mem_cache.hicache_storage.PoolTransfer` s.

Every extra pool gets its own :class:`~flatcake.store.page_store.PageStore` (its own page geometry, the
pool name in its namespace so pages of different pools never alias) with the same placement,
session scopes, on-SSD layout and checksums as KV; its keys are the KV page hashes the
transfer names. When the KV store frees a session scope, each extra store drops the scopes
holding those keys (:meth:`flatcake.store.page_store.PageStore.add_retire_listener`). The ``kv`` pool
keeps the v1 store (``FlatCakeStorage.store``), so the v1 path is unchanged.

After registration nothing here raises into SGLang's threads: a fault is a miss (``False``
entries, a shorter hit), logged once through the store's ErrorLog.
"""

from __future__ import annotations

import logging
import math
import threading
from dataclasses import dataclass
from typing import List, Optional

import torch
from sglang.srt.mem_cache.hicache_storage import (HiCacheStorageExtraInfo, PoolHitPolicy, PoolName, PoolTransfer,
                                                  PoolTransferResult)

from flatcake.adapter.identity import base_identity, open_pool
from flatcake.common.layout import KvPageLayout, page_layout_from_meta
from flatcake.store.page_store import MediumSummary, PageStore

log = logging.getLogger("flatcake")

#: pools whose pages are sharded over TP ranks even when the model's MLA KV is replicated
#: (SGLang's file backend keys ``mamba`` by TP rank; its hybrid controller backs it up on every rank)
TP_SHARDED_POOLS = (PoolName.MAMBA.value,)


def pool_key(name) -> str:
    """The pool name as a plain string (``PoolName.SWA`` and ``"swa"`` are the same pool)."""
    return name.value if isinstance(name, PoolName) else str(name)


@dataclass
class ExtraPool:
    """One registered extra host pool.

    Attributes:
        name: SGLang's pool name (``PoolName`` value, e.g. ``"swa"``).
        host_pool: SGLang's host pool object.
        layout: its byte views (:func:`flatcake.common.layout.page_layout_from_meta`).
        store: its page store (``None`` until the KV pool is registered).
    """

    name: str
    host_pool: object
    layout: KvPageLayout
    store: Optional[PageStore] = None

    @property
    def page_size(self) -> int:
        """Token slots per page of this pool (Mamba: 1)."""
        return int(self.host_pool.page_size or 1)


#: pools SGLang restores with ``trailing_pages`` (a window at the end of each backed-up prefix:
#: SWA, Mamba and DeepSeek-V4 compression states), by name (``PoolName``); they hold a window
#: per request, not a page per KV page
TRAILING_POOLS = frozenset({PoolName.SWA.value, PoolName.AUXILIARY_SWA.value, PoolName.MAMBA.value,
                            PoolName.DRAFT_SWA.value, PoolName.DEEPSEEK_V4_C4_STATE.value,
                            PoolName.DEEPSEEK_V4_C4_INDEXER_STATE.value, PoolName.DEEPSEEK_V4_C128_STATE.value})

#: pages a trailing pool holds per KV page: one window page per 8 prefix pages, well above what
#: traces need (the demo's 100 WEKA requests wrote 73 SWA windows for 8,613 KV pages) and far
#: below a page per KV page (which gave the SWA pool of DeepSeek-V4-Flash 77% of the capacity)
TRAILING_SHARE = 0.125


def capacity_weight(name: str, page_bytes: int) -> float:
    """Bytes of capacity pool ``name`` needs per KV page: ``page_bytes`` for ``all_pages``
    pools, ``page_bytes × TRAILING_SHARE`` for :data:`TRAILING_POOLS`."""
    return page_bytes * (TRAILING_SHARE if pool_key(name) in TRAILING_POOLS else 1.0)


def pool_config(cfg, kv_page_bytes: float, weight: float):
    """The configuration of an extra pool's store: capacities scaled by ``weight /
    kv_page_bytes`` (``weight``: :func:`capacity_weight`; an ``all_pages`` pool holds as many
    pages as the KV store, a trailing pool :data:`TRAILING_SHARE` of that; ``ssd.max_files``
    rounded up, at least 1 file of ``ssd.file_bytes``; DRAM rounded down). Everything else is
    KV's."""
    r = weight / max(kv_page_bytes, 1)
    dram = cfg.dram.model_copy(update={"capacity_bytes": int(cfg.dram.capacity_bytes * r)})
    ssd = cfg.ssd.model_copy(update={"max_files": max(1, math.ceil(cfg.ssd.max_files * r))})
    return cfg.model_copy(update={"dram": dram, "ssd": ssd})


class HybridPoolsMixin:
    """The v2 entry points of :class:`flatcake.adapter.storage.FlatCakeStorage`.

    Expects the host class to provide ``cfg``, ``storage_config``, ``store``, ``layout``,
    ``namespace``, ``mem_pool_host``, ``is_writer``, ``errors`` and ``batch_exists`` /
    ``batch_get_v1`` / ``batch_set_v1`` (the KV pool).
    """

    #: True when the KV anchor is SGLang's ``LogicalHostPool`` (DeepSeek-V4): no KV bytes, the
    #: extra pools carry every page (:meth:`register_logical_anchor`)
    logical_anchor = False

    # ------------------------------------------------------------------ registration
    def _v2_state(self) -> dict:
        st = self.__dict__.get("_v2_pools")
        if st is None:
            st = self.__dict__.setdefault("_v2_pools", {})
            self.__dict__.setdefault("_v2_lock", threading.RLock())
            self.__dict__.setdefault("_v2_hooked", None)
            self.__dict__.setdefault("_v2_burst_done", False)
            self.__dict__.setdefault("_v2_ref_bytes", 0)
            self.__dict__.setdefault("_v2_retired", [])
        return st

    def register_logical_anchor(self, pool) -> None:
        """Bind a KV anchor that holds no bytes (SGLang's ``LogicalHostPool``: DeepSeek-V4's
        HiCache keeps every byte in its v2 pools and uses the anchor for page indices only).

        No KV store is opened: v1 calls move nothing (``batch_get_v1`` / ``batch_set_v1``
        report success, ``batch_exists`` 0, as SGLang's Mooncake backend does) and the extra
        pools' stores open at :meth:`on_host_pools_registered`, sharing the configured
        capacities in proportion to their bytes per page. The namespace is KV's without
        dtype, layout and page bytes (:func:`logical_namespace`).
        """
        self._v2_state()
        self.mem_pool_host = pool
        self.logical_anchor = True
        self.namespace = logical_namespace(self.storage_config, pool)
        log.info("flatcake: KV anchor %s holds no bytes (page %d tokens); extra pools carry the pages",
                 type(pool).__name__, int(pool.page_size))

    def _v2_can_open(self) -> bool:
        """Stores open beside an open KV store, or, with a logical anchor, once the initial
        pool set is known (capacities are split over it)."""
        return self.store is not None or (self.logical_anchor and self._v2_burst_done)

    def _v2_role_instance(self) -> tuple[str, Optional[str]]:
        """(role, instance) of the extra stores: the KV store's; with a logical anchor the
        same role rule the KV store follows (writer/follower for MLA over TP ranks) and the
        pool identity of the first store opened (``None`` until then: see
        :meth:`_open_pool_store`)."""
        if self.store is not None:
            return self.store.role, self.store.instance
        sc = self.storage_config
        shared = bool(sc and sc.is_mla_model and sc.tp_size > 1)
        role = ("writer" if self.is_writer else "follower") if shared else "single"
        ident = getattr(self, "identity", None)
        return role, ident.instance if ident is not None else None

    def register_mem_host_pool_v2(self, host_pool, host_pool_name) -> None:
        """Register one extra host pool (SGLang calls it once per pool after
        ``register_mem_pool_host``, and again for a sidecar added later).

        The ``kv`` pool is the v1 store's (nothing to do). Any other pool is mapped from its
        ``get_page_buffer_meta`` byte ranges and gets its own store (opened now when the KV
        pool is registered); registering a name again replaces its store.

        Raises:
            flatcake.common.layout.UnsupportedLayoutError: a pool FlatCake cannot serve correctly —
                separate scale tensors (MXFP8 KV), no page-addressable buffers, pages not at a
                fixed stride — naming the pool (the attach, or the sidecar, fails).
            ConfigError / SsdStartupError: its store cannot be opened (as for KV).
        """
        name = pool_key(host_pool_name)
        pools = self._v2_state()
        if name == PoolName.KV.value:
            return
        layout = page_layout_from_meta(host_pool, name)  # raises, naming the pool
        with self._v2_lock:
            old = pools.pop(name, None)
            if old is not None and old.store is not None:
                old.store.close()
            pools[name] = ExtraPool(name, host_pool, layout)
            if self._v2_can_open():
                self._open_pool_store(pools[name])
                self._hook_kv_retire()

    def on_host_pools_registered(self) -> None:
        """The initial registration burst is over: open any store still waiting for the KV
        pool, tie extra-pool scopes to KV scope retirement, log one line per extra pool.

        Raises:
            ConfigError / SsdStartupError: a store cannot be opened (the attach fails).
        """
        pools = self._v2_state()
        with self._v2_lock:
            self._v2_burst_done = True
            if self.logical_anchor and not self._v2_ref_bytes:  # split the totals over this pool set
                self._v2_ref_bytes = sum(capacity_weight(p.name, p.layout.geometry.page_bytes)
                                         for p in pools.values())
            # replicated pools first: with a logical anchor the first one fixes the pool identity
            # the way KV's does (a follower rank finds its writer's slot)
            for p in sorted(pools.values(), key=lambda q: q.name in TP_SHARDED_POOLS):
                if p.store is None and self._v2_can_open():
                    self._open_pool_store(p)
            self._hook_kv_retire()
        for p in pools.values():
            if p.store is not None:
                st = p.store.snapshot_stats()["media"]
                log.info("flatcake: extra pool %s: page %d bytes (%d layers), DRAM %d bytes, SSD %d bytes, %s",
                         p.name, p.layout.geometry.page_bytes, p.layout.geometry.layers,
                         st["dram"].get("capacity_bytes", 0), st["ssd"].get("capacity_bytes", 0), p.store.role)

    def _open_pool_store(self, p: ExtraPool) -> None:
        """Open ``p``'s store beside the KV store: namespace = KV's + pool name, page bytes,
        layout (+ TP rank for TP-sharded pools); role as KV's, except TP-sharded pools under a
        shared (MLA) KV pool, which every rank writes itself."""
        sc = self.storage_config
        g = p.layout.geometry
        ns = f"{self.namespace}|pool={p.name}|pool_layout={p.layout.name}|pool_page_bytes={g.page_bytes}"
        role, instance = self._v2_role_instance()
        if p.name in TP_SHARDED_POOLS and role != "single":
            ns += f"|tp={sc.tp_rank}/{sc.tp_size}"
            role = "single"
        ref = self.layout.geometry.page_bytes if self.store is not None else (self._v2_ref_bytes or g.page_bytes)
        cfg = pool_config(self.cfg, ref, capacity_weight(p.name, g.page_bytes))
        if instance is None:  # logical anchor, first pool: it takes this process's pool identity
            budget = getattr(self, "backlog_budget", None)  # the rank's one write-backlog bound
            p.store, self.identity = open_pool(lambda inst: PageStore(cfg, g, ns, instance=inst, role=role,
                                                                      backlog_budget=budget),
                                               cfg, ns, base_identity(sc, cfg, getattr(self, "replica", None)), role)
        else:
            p.store = PageStore(cfg, g, ns, instance=instance, role=role,
                                backlog_budget=getattr(self, "backlog_budget", None))
        if self.logical_anchor:  # no KV store: the pools retire a session's pages together
            p.store.add_retire_listener(lambda keys, src=p.name: self._v2_retired.append((src, keys)))
        if g.page_bytes * 128 > cfg.ssd.file_bytes:
            log.warning("flatcake: extra pool %s: ssd.file_bytes %d holds fewer than 128 pages of %d bytes; "
                        "its backups go in smaller rounds", p.name, cfg.ssd.file_bytes, g.page_bytes)

    def _hook_kv_retire(self) -> None:
        """Make the current KV store retire extra-pool pages with each freed KV scope (once per
        KV store: a re-registered KV pool gets a new store)."""
        kv = self.store
        if kv is None or self._v2_hooked is kv:
            return
        kv.add_retire_listener(self._retire_extra_pages)
        self._v2_hooked = kv

    def _retire_extra_pages(self, keys: list, skip: Optional[str] = None) -> None:
        """KV (or, with a logical anchor, pool ``skip``) freed a scope with ``keys``: drop the
        extra-pool scopes holding any of them."""
        for p in list(self._v2_state().values()):
            if p.store is not None and p.name != skip:
                p.store.drop_keys(keys)

    def _drain_retired(self) -> None:
        """Logical anchor: pages one pool freed (queued by its retire listener, under its lock)
        are dropped from the other pools here, outside every store lock (no lock order)."""
        q = self._v2_retired
        try:
            while q:
                try:
                    src, keys = q.pop(0)
                except IndexError:  # another thread took the last one
                    break
                self._retire_extra_pages(keys, skip=src)
        except Exception as e:  # dropping is best-effort: a miss later at worst
            self.errors("retire extra pages", e)

    def extra_pool(self, name) -> Optional[ExtraPool]:
        """The registered extra pool ``name`` (``PoolName`` or str), or ``None``."""
        return self._v2_state().get(pool_key(name))

    def extra_pool_stats(self) -> dict:
        """Per extra pool (name), its store's counters and state
        (:meth:`flatcake.store.page_store.PageStore.snapshot_stats`); ``flatcake_stats()`` stays KV's."""
        return {p.name: p.store.snapshot_stats() for p in list(self._v2_state().values()) if p.store is not None}

    def flush_extra_pools(self, timeout_s: float = 10.0) -> Optional[bool]:
        """Wait until every extra pool's SSD write queue is empty
        (:meth:`flatcake.store.page_store.PageStore.flush_writes`, up to ``timeout_s`` seconds per pool).
        True when all drained, False when one did not, ``None`` when no extra pool has a store.
        Never raises."""
        stores = [p.store for p in list(self._v2_state().values()) if p.store is not None]
        if not stores:
            return None
        return all([s.flush_writes(timeout_s) for s in stores])  # every store, also after a False

    def close_extra_pools(self) -> None:
        """Close every extra pool's store (from ``close``). Never raises."""
        for p in list(self._v2_state().values()):
            if p.store is not None:
                try:
                    p.store.close()
                except Exception as e:  # pragma: no cover - best effort at shutdown
                    log.warning("flatcake close: pool %s: %s", p.name, e)

    def clear_extra_pools(self) -> None:
        """Drop every extra pool's pages (from ``clear``). Never raises."""
        for p in list(self._v2_state().values()):
            if p.store is not None:
                p.store.clear()

    def pools_medium_summary(self, keys: List[str]) -> MediumSummary:
        """:class:`~flatcake.store.page_store.MediumSummary` of ``keys`` over the extra pools (a logical
        KV anchor's pages: FC-MAS puts the prefetch in the DRAM or SSD lane by it). A key is on
        ``"ssd"`` when some pool holds it on SSD, on ``"dram"`` when pools hold it on DRAM only,
        ``None`` when none holds it; ``ssd_bytes`` adds every pool's SSD pages (bytes).
        Never raises."""
        try:
            stores = [p.store for p in self._v2_state().values() if p.store is not None]
            media, ssd_bytes = [], 0
            for k in keys:
                found = [(s.medium_of(k), s.geometry.page_bytes) for s in stores]
                ssd_bytes += sum(b for m, b in found if m == "ssd")
                ms = {m for m, _ in found if m is not None}
                media.append("ssd" if "ssd" in ms else ("dram" if ms else None))
            return MediumSummary(media.count("dram"), media.count("ssd"), ssd_bytes, tuple(media))
        except Exception as e:  # pragma: no cover - defensive
            self.errors("medium_summary", e)
            return MediumSummary(0, 0, 0, (None,) * len(keys))

    # ------------------------------------------------------------------ hit query
    def batch_exists_v2(self, keys: List[str], pool_transfers: Optional[List[PoolTransfer]] = None,
                        extra_info: Optional[HiCacheStorageExtraInfo] = None) -> PoolTransferResult:
        """Usable prefix of ``keys`` (page hashes) over KV and every pool in ``pool_transfers``.

        Semantics of SGLang's ``file`` and Mooncake backends: ``kv_hit_pages`` is the largest
        prefix length (pages) every pool can restore: ``all_pages`` needs each of its pages,
        ``trailing_pages`` only the last ``len(transfer.keys)`` pages before the cut,
        ``block_groups`` reports its leading complete groups and never gates the hit.
        ``extra_pool_hit_pages`` holds each pool's own boundary (KV's leading run under
        ``"kv"``), omitted when 0; ``restorable_prefix_pages`` every usable prefix length.
        A pool not registered holds no page. Never raises (a fault: no hit, logged once).
        """
        try:
            self._v2_state()
            self._drain_retired()
            self._hook_kv_retire()  # a re-registered KV pool has a new store
            kv = self._kv_run(keys, pool_transfers, extra_info)
            hits: dict = {PoolName.KV: kv} if kv else {}
            restorable = list(range(1, kv + 1))
            for t in pool_transfers or []:
                if pool_key(t.name) == PoolName.KV.value:
                    continue
                boundary, ok = self._pool_restorable(t, keys, kv, extra_info)
                if boundary:
                    hits[t.name] = boundary
                if ok is not None:
                    restorable = [n for n in restorable if n in ok]
            return PoolTransferResult(restorable[-1] if restorable else 0, hits, restorable)
        except Exception as e:
            self.errors("batch_exists_v2", e)
            return PoolTransferResult(0, {}, [])

    def _kv_run(self, keys: List[str], pool_transfers, extra_info) -> int:
        """KV's leading run; with a logical anchor every page, when some pool gates the hit
        (``all_pages`` / ``trailing_pages``), else 0 (no pool would vouch for any byte)."""
        if not self.logical_anchor:
            return self._leading_run(keys, extra_info)  # not counted as an SGLang batch_exists call
        gates = any(pool_key(t.name) != PoolName.KV.value
                    and PoolHitPolicy(t.hit_policy) != PoolHitPolicy.BLOCK_GROUPS for t in pool_transfers or [])
        return len(keys) if gates else 0

    def _pool_restorable(self, t: PoolTransfer, keys: List[str], kv: int, extra_info=None) -> tuple[int, Optional[set]]:
        """(this pool's boundary in pages, the prefix lengths it can restore or ``None`` when
        it does not gate the hit) for the KV leading run of ``kv`` pages of ``keys``."""
        p = self.extra_pool(t.name)
        has = p.store.exists if p is not None and p.store is not None else (lambda k: False)
        policy = PoolHitPolicy(t.hit_policy)
        if policy == PoolHitPolicy.BLOCK_GROUPS:
            g = max(int(t.group_pages or 1), 1)
            n = 0
            while n + g <= len(keys) and all(has(k) for k in keys[n:n + g]):
                n += g
            return n, None
        if policy == PoolHitPolicy.TRAILING_PAGES:
            window = max(1, len(t.keys) if t.keys else 1)
            present = [has(k) for k in keys[:kv]]
            ok = {n for n in range(1, kv + 1) if all(present[max(0, n - window):n])}
            return max(ok, default=0), ok
        b = 0  # all_pages: leading run (its store's hit query, which also feeds its placement signals)
        if p is not None and p.store is not None:
            b = p.store.leading_run(keys[:kv], extra_info_prefix(extra_info))
        return b, set(range(1, b + 1))

    # ------------------------------------------------------------------ reads and writes
    def batch_get_v2(self, transfers: List[PoolTransfer],
                     extra_info: Optional[HiCacheStorageExtraInfo] = None) -> dict:
        """Read each transfer's pages (``keys[i]`` into host page ``host_indices[i*page_size]``
        of its pool). Returns ``{transfer.name: [bool] * len(keys)}``, only a leading run True.
        Never raises."""
        try:
            self._v2_state()
            self._drain_retired()
            self._hook_kv_retire()  # a re-registered KV pool has a new store
            return {t.name: self._transfer(t, extra_info, write=False) for t in transfers or []}
        except Exception as e:  # an unusable transfer list: nothing moved
            self.errors("batch_get_v2", e)
            return {}

    def batch_set_v2(self, transfers: List[PoolTransfer],
                     extra_info: Optional[HiCacheStorageExtraInfo] = None) -> dict:
        """Store each transfer's pages (``extra_info.prefix_keys + keys`` is the session's key
        chain, as for KV). Returns ``{transfer.name: [bool] * len(keys)}``. A pool this rank
        does not write (replicated under MLA, not the writer rank) reports success. Never raises."""
        try:
            self._v2_state()
            self._drain_retired()
            self._hook_kv_retire()  # a re-registered KV pool has a new store
            return {t.name: self._transfer(t, extra_info, write=True) for t in transfers or []}
        except Exception as e:  # an unusable transfer list: nothing moved
            self.errors("batch_set_v2", e)
            return {}

    def _transfer(self, t: PoolTransfer, extra_info, write: bool) -> list:
        keys = list(t.keys or [])
        n = len(keys)
        try:
            if not n:
                return []
            if pool_key(t.name) == PoolName.KV.value:
                fn = self.batch_set_v1 if write else self.batch_get_v1
                return list(fn(keys, t.host_indices, extra_info))
            p = self.extra_pool(t.name)
            if p is None or p.store is None:
                self.errors.report("v2", "unregistered pool", f"pool {pool_key(t.name)!r} was never registered; "
                                   "its pages are misses")
                return [False] * n
            if write and p.store.role == "follower":
                return [not p.store.closed] * n
            ids = pool_page_ids(t.host_indices, n, p.page_size)
            if ids is None:
                self.errors.report("v2", "host_indices", f"pool {p.name}: host_indices must be {n} whole "
                                   f"page-aligned pages of {p.page_size} slots")
                return [False] * n
            if write:
                return p.store.put(keys, p.layout, ids, extra_info_prefix(extra_info))
            return p.store.get(keys, p.layout, ids)
        except Exception as e:
            self.errors("batch_set_v2" if write else "batch_get_v2", e)
            return [False] * n


def extra_info_prefix(extra_info: Optional[HiCacheStorageExtraInfo]) -> Optional[list]:
    """``extra_info.prefix_keys`` (the key chain before the call's keys), or ``None``."""
    return extra_info.prefix_keys if extra_info is not None else None


def pool_page_ids(host_indices, n: int, page_size: int) -> Optional[list]:
    """Host page numbers of ``n`` pages, or ``None`` unless ``host_indices`` (int64 token
    slots) holds exactly ``n`` whole page-aligned pages of ``page_size`` slots."""
    if host_indices is None:
        return None
    hi = torch.as_tensor(host_indices).reshape(-1).cpu()
    if hi.numel() != n * page_size:
        return None
    pages = hi.view(n, page_size)
    starts = pages[:, 0]
    if not bool((starts % page_size == 0).all()):
        return None
    if page_size > 1 and not bool((pages == starts[:, None] + torch.arange(page_size, dtype=hi.dtype)).all()):
        return None
    return (starts // page_size).tolist()


def is_logical_anchor(pool) -> bool:
    """True for a KV anchor that holds no bytes: SGLang's ``LogicalHostPool`` (``kv_buffer``
    ``None``, no layers), used by DeepSeek-V4's HiCache."""
    return getattr(pool, "kv_buffer", 0) is None and not int(getattr(pool, "layer_num", 0) or 0)


def logical_namespace(cfg, pool) -> str:
    """Namespace of a logical anchor's pools: model, TP rank (MHA only), PP, attention-CP and
    DCP ranks, page size (tokens); each pool adds its name, layout and page bytes."""
    parts = ["flatcake-v1", f"model={cfg.model_name or ''}" if cfg else "model="]
    if cfg is not None:
        parts.append("mla" if cfg.is_mla_model else f"tp={cfg.tp_rank}/{cfg.tp_size}")
        parts += [f"pp={cfg.pp_rank}/{cfg.pp_size}", f"cp={cfg.attn_cp_rank}/{cfg.attn_cp_size}"]
        if getattr(cfg, "dcp_size", 1) > 1:
            parts.append(f"dcp={cfg.dcp_rank}/{cfg.dcp_size}")
    parts += [f"page={int(pool.page_size)}", "anchor=logical"]
    return "|".join(parts)
