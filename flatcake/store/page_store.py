"""PageStore: FlatCake's core for one namespace, independent of SGLang (paper §3.1 + §3.3).

A short facade that composes the parts, each in its own module:

=============================== ================================================================
part                            job
=============================== ================================================================
:class:`~flatcake.gva.scopes.ScopeTable`     decides: scopes, placement (Table 2), space, publish, reclaim
:class:`~flatcake.store.backup.Backup`             a put's rounds: claims, placement, write, commit, write faults
:class:`~flatcake.store.write_path.WritePath`      moves bytes in: DRAM slot writes, SSD rounds, extent headers
:class:`~flatcake.store.read_path.ReadPath`        moves bytes out: DRAM copies, SSD restores through FC-CIO
:class:`~flatcake.gva.mirror.FollowerMirror` MLA follower ranks: mirrors the writer's journal
:class:`~flatcake.store.stats.StoreStats`          the one stats object every part adds to
=============================== ================================================================

Lifecycle of a write (:meth:`PageStore.put`, :mod:`flatcake.store.backup`)::

    claim the new keys -> split into rounds (<= 128 pages) -> per round:
    place (writer lock: scope, medium, space) -> write (no lock) -> commit (writer lock:
    journal, publish) | abort (give the space back) -> unpin -> reclaim above the watermark

Lifecycle of a read (:meth:`PageStore.get`)::

    pin the leading run of stored keys (no lock) -> DRAM copies / FC-CIO restore -> unpin
    -> per-page results, leading run only; a page that failed to read drops its scope
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from typing import Callable, Optional, Sequence

from flatcake.store import native_write
from flatcake.store.backup import Backup, count_keys
from flatcake.config import ConfigError, FlatCakeConfig
from flatcake.common.errorlog import ErrorLog
from flatcake.store.gate import OperationGate
from flatcake.gva.address import MEDIUM_NAMES, medium_of
from flatcake.gva.journal import JournalReader, JournalWriter
from flatcake.gva.mirror import FollowerMirror
from flatcake.gva.read_faults import drop_from_failed_round_locked, take_failing_drive_out_locked
from flatcake.gva.rebuild import RebuildReport, rebuild_locked
from flatcake.gva.scopes import ScopeTable
from flatcake.common.layout import KvPageLayout, PageGeometry
from flatcake.media.dram import DramRegion
from flatcake.media.ssd import SsdFilePool
from flatcake.store.read_path import ReadPath
from flatcake.store.stats import StoreStats, write_rates
from flatcake.store.write_path import WritePath, max_round_pages
from flatcake.store.write_queue import BACKLOG_POOL_SHARE, BacklogBudget, WriteQueue

log = logging.getLogger("flatcake.store.page_store")

ROLES = ("single", "writer", "follower")


@dataclass(frozen=True)
class PageInfo:
    """Where a stored page lives (for tests, tools and logs).

    Attributes:
        gva: its 64-bit address.
        medium: ``"dram"`` or ``"ssd"``.
        scope_id: its session scope.
        reuse: the scope's reuse class (``ReuseScope`` value, e.g. ``"agent_session"``).
        turn: the scope's current turn.
        file_index: SSD pool file holding the page (-1 for a DRAM page).
    """

    gva: int
    medium: str
    scope_id: int
    reuse: str
    turn: int
    file_index: int = -1


@dataclass(frozen=True)
class MediumSummary:
    """What reading a run of stored pages needs, by medium (FC-MAS lanes, paper §3.2).

    Attributes:
        dram_pages: pages of the run on DRAM.
        ssd_pages: pages of the run on SSD.
        ssd_bytes: bytes a restore of the SSD pages reads (``ssd_pages × page_bytes``).
        media: per key, ``"dram"``, ``"ssd"`` or ``None`` (not stored).
    """

    dram_pages: int
    ssd_pages: int
    ssd_bytes: int
    media: tuple

    @property
    def needs_ssd(self) -> bool:
        """True when some page is on SSD (the request goes to the SSD lane)."""
        return self.ssd_pages > 0


class PageStore:
    """FlatCake's page store for one namespace.

    Args:
        cfg: validated configuration.
        geometry: page geometry of every page in this namespace.
        namespace: string naming model, ranks, page size, dtype, layout (see the adapter).
        restore_engine: FC-CIO engine for SSD reads; built from ``cfg.cio`` when ``None``.
        instance: extra pool-name component (attention-DP replicas: ``"dp<rank>"``).
        role: ``"single"``; or for MLA with TP > 1 ``"writer"`` (rank that stores and journals;
            DRAM and the SSD write queue off: its pages must be on disk for the followers)
            / ``"follower"`` (ranks that mirror the writer's pool; DRAM off, checksums on).

    Raises:
        ValueError: an unknown ``role``; ``cio.staging_bytes`` too small for one chunk.
        flatcake.media.errors.SsdStartupError: ``ssd.path`` unusable, the pool in use by another
            process, or its first file cannot be created (``ENOSPC``, ...).
        ConfigError: ``ssd.file_bytes`` too small for one page, ``dram.capacity_bytes`` not
            allocatable.
        flatcake.cio.engines.EngineUnavailableError: ``cio.engine: kvikio`` where kvikio cannot
            move bytes (no CUDA driver).
        OSError: the pool journal cannot be written.

        Every resource taken before the failure is released (SGLang may retry the attach).
    """

    def __init__(self, cfg: FlatCakeConfig, geometry: PageGeometry, namespace: str, restore_engine=None,
                 *, instance: str = "", role: str = "single", backlog_budget: Optional[BacklogBudget] = None):
        if role not in ROLES:
            raise ValueError(f"role must be one of {ROLES}, got {role!r}")
        if role == "follower":  # another process writes these files: always check what we read
            cfg = cfg.model_copy(update={"cio": cfg.cio.model_copy(update={"verify_checksums": True})})
        self.cfg = cfg
        self.role = role
        self.geometry = geometry
        self.namespace = namespace
        self.instance = instance  # pool-name component (the v2 adapter opens extra pools with it)
        self.backlog_budget = backlog_budget  # the rank's write-backlog bound (None: this store's own)
        self.stats = StoreStats()
        self.errors = ErrorLog(log)
        self.dram = self.ssd = self.cio = self._journal = self.mirror = self.queue = self._device_cio = None
        self._opened_s = time.monotonic()
        self.rebuilt = RebuildReport()
        self._gate = OperationGate()
        try:
            self._open(restore_engine, instance)
        except BaseException:
            self._release_resources()
            raise

    def _open(self, restore_engine, instance: str) -> None:
        cfg, role, g = self.cfg, self.role, self.geometry
        dram_cfg = cfg.dram
        if role != "single" and dram_cfg.capacity_bytes:
            # DRAM pages live in this process only; ranks that share pages need them on SSD
            log.warning("flatcake: DRAM medium off: pages are shared with other TP ranks through SSD")
            dram_cfg = dram_cfg.model_copy(update={"capacity_bytes": 0})
        try:
            self.dram = DramRegion(dram_cfg, g.page_bytes)
        except RuntimeError as e:
            raise ConfigError(f"dram.capacity_bytes: cannot allocate {dram_cfg.capacity_bytes} bytes: {e}") from None
        self.ssd = SsdFilePool(cfg.ssd, self.namespace, instance, follower=role == "follower", errors=self.errors)
        self.max_round_pages = max_round_pages(cfg.ssd.file_bytes, g)
        if self.max_round_pages == 0:
            raise ConfigError(
                f"ssd.file_bytes: {cfg.ssd.file_bytes} bytes cannot hold one page of {g.page_bytes} bytes plus headers"
            )
        self.scopes = ScopeTable(cfg, g, self.dram, self.ssd, self.stats, self.errors)
        self.index = self.scopes.index
        if role == "follower":
            self.mirror = FollowerMirror(self.index, JournalReader(self.ssd.journal_path), self.ssd, g,
                                         self.namespace, cfg.node_id, self.errors)
        else:  # warm restart: serve what the pool holds, then start a compacted journal
            with self.scopes.lock:
                self.rebuilt = rebuild_locked(self.index, self.ssd, self.namespace, g, cfg.node_id, self.errors)
                self._journal = JournalWriter(self.ssd.journal_path, self.scopes.journal_entries_locked())
                self.scopes.journal = self._journal
                self.scopes.live_rounds = self.rebuilt.rounds
            if self.rebuilt.pages:
                log.info("flatcake: rebuilt %d pages in %d scopes from %s in %.2f s (%d rounds dropped)",
                         self.rebuilt.pages, self.rebuilt.scopes, self.ssd.journal_path, self.rebuilt.seconds,
                         self.rebuilt.rounds_dropped)
        if restore_engine is None:
            from flatcake.cio.restore import RestoreEngine

            # the engine checks every chunk that carries a checksum; the read path decides which do
            restore_engine = RestoreEngine(cfg.cio.model_copy(update={"verify_checksums": True}), self.ssd.path_of,
                                           direct_io=self.ssd.direct_io, chunk_bytes=g.chunk_bytes, errors=self.errors)
        self.cio = restore_engine
        self.writer = WritePath(g, self.namespace, cfg.node_id, self.dram, self.ssd, self.stats)
        self.reader = ReadPath(g, self.dram, self.ssd, self.cio, cfg.cio.verify_checksums, self.stats, self.errors)
        self.ssd.add_forget_listener(self.reader.forget_file)  # a file leaving/re-entering service with its drive
        self.backup = Backup(self.scopes, self.writer, self.reader, self.ssd, g, self.max_round_pages, self.stats,
                             self.errors)
        if cfg.ssd.write_backlog_bytes > 0 and role == "writer":
            # like DRAM pages, queued rounds live in this process only: the follower ranks see a
            # round once it is on disk and journaled, and SGLang takes the MIN hit count over the
            # ranks, so the put writes its rounds itself (they are hits on every rank when it returns)
            log.info("flatcake: SSD write queue off: pages are shared with other TP ranks through SSD")
        if cfg.ssd.write_backlog_bytes > 0 and role == "single":  # reads first, writes in the gaps
            # this pool's share: at most BACKLOG_POOL_SHARE of its SSD capacity queued (pinned) at
            # once, so a small pool keeps taking rounds; the rank's bound is shared by its pools
            own = max(1, min(cfg.ssd.write_backlog_bytes, int(BACKLOG_POOL_SHARE * self.ssd.configured_capacity_bytes)))
            self.queue = WriteQueue(own, self.backup.complete_queued, self.backup.drop_queued,
                                    self.stats, self.errors, cfg.node_id, defer_max_s=cfg.ssd.write_defer_max_s,
                                    urgent_fraction=cfg.ssd.write_urgent_fraction,
                                    budget=self.backlog_budget or BacklogBudget(cfg.ssd.write_backlog_bytes))
            self.backup.attach_queue(self.queue, cfg.ssd.write_backlog_wait_s, cfg.node_id)
            self.reader.queue = self.queue
            native_write.warm_up()  # the writer's C piece loop, ready before the first round

    # ================================================================ queries
    def exists(self, key: str) -> bool:
        """True if ``key`` is published (lock-free). Never raises (an unusable key is absent)."""
        try:
            return (self.queue is not None and self.queue.contains(key)) or self.index.contains(key)
        except TypeError:
            return False

    def leading_run(self, keys: Sequence[str], prefix_keys: Optional[Sequence[str]] = None) -> int:
        """Length of the leading run of stored keys (SGLang's hit query). Lock-free; also feeds
        the placement signals (turns, prefix reference counts). 0 once closed. Never raises."""
        if self._gate.closed:
            return 0
        try:
            self._sync()
            keys = list(keys)
            get, queued = self.index.get, (self.queue.contains if self.queue is not None else lambda k: False)
            n = 0
            for k in keys:
                if not queued(k) and get(k) is None:  # the queue first: a round leaves it once published
                    break
                n += 1
        except Exception as e:  # an unusable key list: nothing is stored under it
            self.errors("hit query", e)
            return 0
        try:
            self.scopes.note_hit_query(keys, n, prefix_keys)
        except Exception as e:  # signals are best-effort
            self.errors("hit-query bookkeeping", e)
        return n

    def page_info(self, key: str) -> Optional[PageInfo]:
        """Where ``key``'s page lives, or ``None`` if it is not stored (lock-free, never raises)."""
        try:
            e = (self.queue.lookup(key) if self.queue is not None else None) or self.index.get(key)
        except TypeError:
            return None
        if e is None:
            return None
        s = e.scope
        medium = MEDIUM_NAMES.get(medium_of(e.gva), "queued")  # queued: in the write queue, not yet on disk
        return PageInfo(e.gva, medium, s.scope_id, s.reuse.value, s.turn, self.reader.file_of(e))

    def medium_of(self, key: str) -> Optional[str]:
        """``"dram"`` or ``"ssd"`` for a stored key, ``None`` otherwise (lock-free)."""
        info = self.page_info(key)
        return info.medium if info is not None else None

    def medium_summary(self, keys: Sequence[str]) -> MediumSummary:
        """Pages of ``keys`` on each medium and the SSD bytes to restore (lock-free, never
        raises; a key not stored counts on neither medium). Used after a hit query to put a
        request's prefetch in FC-MAS's DRAM or SSD lane (paper §3.2)."""
        media = tuple(self.medium_of(k) for k in keys)
        ssd = media.count("ssd")  # a page in the write queue is read from memory: DRAM lane
        return MediumSummary(media.count("dram") + media.count("queued"), ssd, ssd * self.geometry.page_bytes, media)

    # ================================================================ reads
    def get(self, keys: Sequence[str], layout: KvPageLayout, page_ids: Sequence[int]) -> list[bool]:
        """Read pages ``keys[i]`` into page ``page_ids[i]`` of ``layout``.

        Args:
            keys: page keys.
            layout: destination :class:`~flatcake.common.layout.KvPageLayout`.
            page_ids: int page ids in ``layout`` (a list or an int64 tensor), one per key.

        Returns:
            ``[True] * n + [False] * (len(keys) - n)``: ``n`` is the leading run of pages that
            were stored, pinned and read intact. A page after the first miss is never reported.
            All misses once the store is closed. Never raises; I/O faults are misses, logged
            once per errno, and the failed page's scope is dropped.
        """
        n = count_keys(keys)
        if not self._gate.enter():
            return [False] * n
        try:
            self._sync()
            return self._get(list(keys), layout, page_ids)
        except Exception as e:
            self.errors("get", e)
            return [False] * n
        finally:
            self._gate.exit()

    def _get(self, keys: list, layout: KvPageLayout, page_ids: Sequence[int]) -> list[bool]:
        out = [False] * len(keys)
        entries: list = []
        unreadable = None
        try:
            entries = (self.queue.pin_leading_run(keys, self.index) if self.queue is not None
                       else self.scopes.pin_leading_run(keys))
            if not entries:
                return out
            good = self.reader.read(keys, entries, layout, page_ids)
            out[:good] = [True] * good
            if good < len(entries):
                self.stats.add(get_failures=1)
                unreadable = entries[good]
            return out
        except Exception as e:
            self.errors("get", e)
            return [False] * len(keys)
        finally:
            self.scopes.unpin(entries)
            if self.queue is not None:  # queued pages: their round's buffer may be reused now
                self.queue.release(entries)
            if unreadable is not None:
                self._drop_unreadable(unreadable)

    def get_layer_wise(self, keys: Sequence[str], layout: KvPageLayout, page_ids: Sequence[int],
                       layer_groups: Sequence[Sequence[int]], on_group: Callable[[Sequence[int], int], None]) -> int:
        """Read pages ``keys[i]`` into page ``page_ids[i]`` of ``layout`` one layer group at a time
        (the direct linker's layer-wise restore, :mod:`flatcake.linker`; paper §3.3: layer ``l+1``
        is read while layer ``l`` is used).

        The leading run of ``keys`` is pinned once; each group (ascending layer indices, the groups
        in order) is one :meth:`~flatcake.store.read_path.ReadPath.read` of those layers (FC-CIO:
        sorted, merged reads into the staging window, then the scatter); after each group
        ``on_group(group, good)`` is called with ``good`` the pages delivered intact in every
        group so far. A group stops the read when ``good < len(keys)`` (a miss or a failed page);
        a failed page's scope is dropped as :meth:`get` drops it.

        Args:
            keys: page keys.
            layout: destination (device KV or host pages) with this store's geometry.
            page_ids: int page ids in ``layout``, one per key.
            layer_groups: the layer groups, each a non-empty ascending sequence of layer indices.
            on_group: called on this thread after each group; must not call back into this store.

        Returns:
            ``good``: pages delivered intact in every layer read (``len(keys)`` when all landed);
            0 once closed. Never raises (an exception of ``on_group`` is logged and reads as 0).
        """
        if not self._gate.enter():
            return 0
        entries: list = []
        unreadable = None
        good = 0
        try:
            self._sync()
            keys = list(keys)
            entries = (self.queue.pin_leading_run(keys, self.index) if self.queue is not None
                       else self.scopes.pin_leading_run(keys))
            good = len(entries)
            for group in layer_groups:
                if good < len(keys):
                    break
                got = self.reader.read(keys, entries, layout, page_ids, group) if entries else 0
                if got < good:
                    good = got
                    self.stats.add(get_failures=1)
                    unreadable = entries[got]
                on_group(group, good)
            return good
        except Exception as e:
            self.errors("get", e)
            return 0
        finally:
            self.scopes.unpin(entries)
            if self.queue is not None:
                self.queue.release(entries)
            if unreadable is not None:
                self._drop_unreadable(unreadable)
            self._gate.exit()

    def attach_device_restore(self, device) -> None:
        """Give the read path an FC-CIO engine staging on ``device`` (``"cuda:N"``: HBM windows,
        the Triton scatter, device checksums) for reads into layouts on that device (the direct
        linker's device pools, :mod:`flatcake.linker`); reads into host layouts keep the host
        engine. Once per store (a later call is a no-op, as is a CPU ``device``); the engine is
        released with the store.

        Raises:
            ValueError: ``cio.staging_bytes`` too small for one chunk.
            RuntimeError: the device's staging cannot be allocated.
        """
        if str(device).startswith("cpu") or self._device_cio is not None:
            return
        from flatcake.cio.restore import RestoreEngine

        self._device_cio = RestoreEngine(self.cfg.cio.model_copy(update={"verify_checksums": True}), self.ssd.path_of,
                                         direct_io=self.ssd.direct_io, chunk_bytes=self.geometry.chunk_bytes,
                                         device=str(device), errors=self.errors)
        self.reader.device_cio = self._device_cio

    def _drop_unreadable(self, entry) -> None:
        """``entry``'s page could not be read intact (file truncated or removed behind the
        backend, EIO, short read, checksum mismatch). An SSD page: unpublish its round and the
        rounds after it in its scope (the rounds before keep serving) and count the failure
        against its drive, which goes out of service — only its pages dropped — after
        :data:`~flatcake.media.pool_faults.READ_FAILURES_OUT` failures in a window
        (:mod:`flatcake.gva.read_faults`). A DRAM page (its slot holds another page): drop its
        whole scope. Either way the readers reopen the file by path (it may have been replaced)."""
        f = self.reader.file_of(entry)
        if f >= 0:
            try:
                self.reader.forget_file(f)
            except Exception as e:
                self.errors("forget file", e)
        with self.scopes.lock:
            if entry.scope.retired or entry.scope.doomed:
                return
            if f < 0:
                n = len(entry.scope.keys)
                self.scopes.drop_locked(entry.scope)  # freed now, or when its other readers leave
                what = f"scope {entry.scope.scope_id} ({n} pages) dropped"
            else:
                n = drop_from_failed_round_locked(self.scopes, entry)
                what = (f"{n} pages of scope {entry.scope.scope_id} dropped (the failed round and the rounds after it; "
                        f"{len(entry.scope.keys)} earlier pages keep serving)")
                if self.ssd.note_read_failure_locked(f):
                    take_failing_drive_out_locked(self.scopes, f)
        self.stats.add(quarantined_scopes=1, quarantined_pages=n)
        self.errors.report("read", "pages dropped", f"{what} after a failed read in {self.ssd.path_of(f) if f >= 0 else 'DRAM'}; "
                           "those pages are misses from now on")

    # ================================================================ writes
    def put(self, keys: Sequence[str], layout: KvPageLayout, page_ids: Sequence[int],
            prefix_keys: Optional[Sequence[str]] = None) -> list[bool]:
        """Store pages ``keys[i]`` taken from page ``page_ids[i]`` of ``layout``.

        Args:
            keys: page keys (``str``, 1..4096 UTF-8 bytes).
            layout: source :class:`~flatcake.common.layout.KvPageLayout`.
            page_ids: int page ids in ``layout`` (a list or an int64 tensor), one per key.
            prefix_keys: the keys before ``keys[0]`` in the request (SGLang's
                ``extra_info.prefix_keys``), or None.

        Keys already stored are skipped (reported True). Returns per-page success; a failed
        page (no space, I/O error) is False and nothing stored before is touched; the pages
        after an invalid key are not stored. All ``False`` once the store is closed. Never raises.
        """
        return self.put_counted(keys, layout, page_ids, prefix_keys)[0]

    def put_counted(self, keys: Sequence[str], layout: KvPageLayout, page_ids: Sequence[int],
                    prefix_keys: Optional[Sequence[str]] = None) -> tuple[list[bool], int]:
        """:meth:`put`, also returning how many pages this call wrote.

        Returns:
            ``(ok, written)``: ``ok`` as :meth:`put` returns it; ``written`` the pages this call
            wrote and published (pages; keys already stored and pages of failed rounds are not
            counted). SGLang's backup metrics (``get_stats``) count these. Never raises.
        """
        n = count_keys(keys)
        out, written = [False] * n, 0
        if not self._gate.enter():
            return out, 0
        try:
            written = self.backup.put(list(keys), layout, page_ids, prefix_keys, out)
        except Exception as e:
            self.errors("put", e)
        finally:
            self._gate.exit()
        return out, written

    def flush_writes(self, timeout_s: float = 30.0) -> bool:
        """Wait until the SSD write queue is empty: every queued round written and journaled, or
        failed (its pages misses). True at once without a queue; False after ``timeout_s``
        seconds (writes still yield to reads in flight). Never raises."""
        return self.queue is None or self.queue.flush(timeout_s)

    def reads_pending(self, delta: int) -> None:
        """Count ``delta`` (+1 / -1) restore reads queued but not yet issued (FC-MAS SSD lane):
        while any is counted the write queue holds writes not yet started, as for reads in flight
        (``docs/design.md``, "Write queue"). A no-op without a queue. Never raises."""
        for _ in range(abs(delta) if self.queue is not None else 0):
            (self.queue.reads_begin if delta > 0 else self.queue.reads_end)()

    # ================================================================ scopes of other stores
    def add_retire_listener(self, fn, with_scope: bool = False) -> None:
        """Call ``fn(keys)`` (``with_scope``: ``fn(keys, scope_id)``) for every scope this store
        frees (reclaim, drop after a failed read, clear), under its writer lock; ``fn`` must not
        call back into this store. Retires a session's extra-pool pages with its KV pages
        (``docs/design.md``, "Hybrid models") and its cluster records (``docs/cluster.md``)."""
        self.scopes.retire_listeners.append(fn if with_scope else (lambda keys, scope_id: fn(keys)))

    def add_publish_listener(self, fn) -> None:
        """Call ``fn(placement, entries)`` for every round published (DRAM, SSD, queued rounds
        once written), under the writer lock: queue work only (:mod:`flatcake.gva.listeners`)."""
        self.scopes.publish_listeners.append(fn)

    def drop_keys(self, keys: Sequence[str]) -> int:
        """Drop (free now, or when their last reader leaves) every scope holding one of
        ``keys``. Returns the scopes dropped. A no-op once closed. Never raises."""
        if self._gate.closed:
            return 0
        dropped = 0
        try:
            with self.scopes.lock:
                seen = set()
                for k in keys:
                    e = (self.queue.lookup(k) if self.queue is not None else None) or self.index.get(k)
                    if e is None or id(e.scope) in seen or e.scope.retired or e.scope.doomed:
                        continue
                    seen.add(id(e.scope))
                    self.scopes.drop_locked(e.scope)
                    dropped += 1
            if dropped and self.queue is not None:  # their queued rounds are never written
                self.queue.discard_dead()
        except Exception as e:
            self.errors("drop keys", e)
        return dropped

    # ================================================================ follower ranks
    def _sync(self) -> None:
        if self.mirror is not None:
            self.mirror.sync()

    # ================================================================ admin
    def clear(self) -> None:
        """Forget every page (SGLang's ``/hicache/storage-backend/clear``): each scope is
        unpublished at once; its space is freed now, or when the last reader inside it leaves.
        Counted as reclaimed scopes. A no-op once closed. Never raises."""
        if not self._gate.enter():
            return
        try:
            self.scopes.clear()
            if self.queue is not None:  # queued rounds of the cleared scopes are never written
                self.queue.discard_dead()
        except Exception as e:
            self.errors("clear", e)
        finally:
            self._gate.exit()

    def snapshot_stats(self) -> dict:
        """Counters (:class:`~flatcake.store.stats.StoreStats`: bytes, pages, ops, seconds) plus
        current state (``docs/configuration.md``, "Stats"): pages indexed, scopes, SSD bytes
        used, DRAM slots used, I/O errors (total and ``errors`` by ``op/reason``), checksum
        failures, pages rebuilt at start-up, the I/O engine, and ``media``: per medium its
        ``state`` (``healthy`` / ``degraded`` / ``disabled``), ``used_bytes`` and
        ``capacity_bytes`` (SSD: also files out of service, stale pools removed and ``drives``:
        the same per ``ssd.path`` drive, :meth:`~flatcake.media.ssd.SsdFilePool.drive_states`)."""
        d = self.stats.snapshot()
        d.update(
            pages_indexed=len(self.index),
            scopes=len(self.index.scopes),
            ssd_used_bytes=self.ssd.used_bytes,
            dram_used_slots=self.dram.n_slots - self.dram.free_slots,
            io_errors=self.errors.count,
            errors=self.errors.counts(),
            checksum_failures=self.errors.count_of("verify", "checksum") + self.errors.count_of("verify", "dram identity"),
            pages_rebuilt=self.rebuilt.pages,
            **(self.queue.snapshot() if self.queue is not None else
               {"write_backlog_pages": 0, "write_backlog_bytes": 0, "write_backlog_limit_bytes": 0, "reads_in_flight": 0,
                "write_backlog_rank_bytes": 0, "write_backlog_rank_limit_bytes": 0,
                "write_deferral_p50_s": 0.0, "write_deferral_p99_s": 0.0, "write_deferral_max_s": 0.0,
                "write_deferral_rounds": 0, "write_urgent_rounds": 0}),
            **write_rates(d["ssd_write_bytes"], time.monotonic() - self._opened_s, self.ssd.configured_capacity_bytes),
            rebuild_s=self.rebuilt.seconds,
            cio_engine=getattr(self.cio, "engine_name", "?"),
            media={"dram": self.dram.state(), "ssd": self.ssd.state()},
        )
        return d

    def describe(self) -> str:
        """One line for the start-up log: role, page bytes, DRAM slots, SSD path, I/O mode, engine,
        round size, and the SSD write queue's bound when there is one."""
        return (f"{self.role}, page {self.geometry.page_bytes} bytes, DRAM {self.dram.n_slots} slots, "
                f"SSD {', '.join(self.cfg.ssd.paths)} ({self.ssd.capacity_bytes} bytes, "
                f"{'direct' if self.ssd.direct_io else 'buffered'} I/O, "
                f"{getattr(self.cio, 'engine_name', '?')} engine), rounds of <= {self.max_round_pages} pages"
                + (f", write queue <= {self.queue.backlog_limit} bytes" if self.queue is not None else ""))

    @property
    def closed(self) -> bool:
        """True once :meth:`close` was called."""
        return self._gate.closed

    def close(self, timeout_s: float = 10.0) -> None:
        """Refuse new operations, wait up to ``timeout_s`` seconds for running ones, then
        release staging, files and pinned memory. Idempotent; never raises."""
        if self._gate.closed:
            return
        if not self._gate.close(timeout_s):
            # Tearing the I/O engine down under a running read could strand it; leave the
            # engine's daemon threads and the files to process exit instead.
            log.warning("flatcake close: operations still running after %.0f s; leaving I/O resources to exit", timeout_s)
            return
        if self.queue is not None:  # drain the queued rounds (no reads any more), drop what is left
            dropped = self.queue.close(timeout_s)
            if dropped:
                log.warning("flatcake close: %d queued rounds not written in %.0f s were dropped", dropped, timeout_s)
        self._release_resources()

    def _release_resources(self) -> None:
        """Close every part that was opened (also after a failed start-up)."""
        for part in (self.cio, self._device_cio, self.ssd, self.dram, self._journal, self.mirror):
            if part is None:
                continue
            try:
                part.close()
            except Exception as e:  # best effort at shutdown
                log.warning("flatcake close: %s: %s", type(part).__name__, e)
