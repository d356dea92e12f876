"""The scope table: FC-GVA's metadata manager — placement, space, publish and reclaim (paper §3.1).

It decides and never moves bytes (the write and read paths, :mod:`flatcake.store.write_path` and
:mod:`flatcake.store.read_path`, do). One :class:`Placement` passes from it to the write path and
back, as vLLM's offloading manager hands a spec to its worker-side handler.

Lifecycle of a round of pages (writer lock = :attr:`ScopeTable.lock`)::

    place_locked   find the session scope from the key chain, decide the medium (Table 2),
                   reserve DRAM slots or bytes at the scope's SSD tail (reclaiming whole
                   scopes when the pool is full); the scope is pinned     -> Placement
      (write path: gather and write the bytes, no lock)
    commit_locked  publish key -> PageEntry, advance the scope's tail     (readers see it now)
    abort_locked   or, when the write failed: give the reservation back, exactly once
    release        unpin the scope
    reclaim        above a high watermark, free the least recently used unpinned scopes whole

How the session scope, its turn and the other Table 2 signals come from SGLang's key chain:
:mod:`flatcake.gva.signals`.
"""

from __future__ import annotations

import time
from typing import Optional, Sequence

from flatcake.config import FlatCakeConfig
from flatcake.common.errorlog import ErrorLog
from flatcake.gva.address import MEDIUM_DRAM, MEDIUM_SSD
from flatcake.gva.drive_faults import drop_pages_in_files_locked
from flatcake.gva.index import GvaIndex, KeyClaims, PageEntry, SessionScope, pin_entries, scope_runs
from flatcake.gva.journal import COMPACT_MIN_ENTRIES, RETIRE, ROUND, JournalEntry, JournalWriter
from flatcake.gva.listeners import Listeners
from flatcake.gva.placement import Placement, PlacementDecision, PlacementPolicy, PlacementSignals, ReuseScope, reuse_code
from flatcake.gva.signals import InterestCounter, RequeryFilter, TurnStarts
from flatcake.common.layout import PageGeometry
from flatcake.media import extent as fmt
from flatcake.media.dram import DramRegion
from flatcake.media.ssd import Extent, SsdFilePool
from flatcake.store.stats import StoreStats


class ScopeTable:
    """Session scopes, placement, space reservation, publication and whole-scope reclaim.

    Args:
        cfg: validated configuration (``placement``, watermarks).
        geometry: page geometry of the namespace.
        dram: the DRAM region (its slot allocator is used under :attr:`lock`).
        ssd: the SSD file pool (its extent allocator is used under :attr:`lock`).
        stats: the store's stats object (reclaim counters).
        errors: the store's error-once log.
        journal: the pool journal (:mod:`flatcake.gva.journal`) of the store that writes the
            pool; None for a follower rank (which never writes).

    Attributes:
        index: the lock-free key -> :class:`PageEntry` map and the live scope table.
        lock: the writer lock (re-entrant). Methods suffixed ``_locked`` expect the caller to
            hold it; readers (:meth:`pin_leading_run`) never take it.
    """

    def __init__(self, cfg: FlatCakeConfig, geometry: PageGeometry, dram: DramRegion, ssd: SsdFilePool,
                 stats: StoreStats, errors: ErrorLog, journal: Optional[JournalWriter] = None):
        self.cfg = cfg
        self.geometry = geometry
        self.dram = dram
        self.ssd = ssd
        self.stats = stats
        self.errors = errors
        self.journal = journal
        self.policy = PlacementPolicy(cfg.placement)
        self.index = GvaIndex()
        self.interest = InterestCounter()
        self.lock = self.index.lock
        self.live_rounds = 0  # SSD rounds published and not freed (journal compaction)
        self._journal_broken = False  # an append failed: rewrite the journal before the next one
        self.claims = KeyClaims(self.index)  # keys a put is writing now
        self.requeries = RequeryFilter(cfg.placement.requery_window_s)
        self.turn_starts = TurnStarts()  # hit queries whose session shows at their first backup
        #: ``fn(keys, scope_id)`` for every scope freed (reclaim, drop, clear), under the writer
        #: lock (the v2 adapter retires a session's extra-pool pages, the cluster its records)
        self.retire_listeners = Listeners(errors, "retire listener")
        #: ``fn(placement, entries)`` for every round published (:meth:`commit_locked`), same lock
        self.publish_listeners = Listeners(errors, "publish listener")
        #: the SSD write queue (:class:`~flatcake.store.write_queue.WriteQueue`) when rounds are
        #: deferred: reclaim frees a scope pinned only by rounds waiting in it (:meth:`evictable`)
        self.queue = None

    # ================================================================ hit queries and readers
    def note_hit_query(self, keys: Sequence[str], n: int, prefix_keys: Optional[Sequence[str]]) -> None:
        """Placement signals from a hit query whose leading stored run is ``n`` of ``keys``:
        a run that ends on a scope's tail and goes on with new keys starts that session's next
        turn; the missing keys' prefix reference counts go up. A query identical to one seen in
        the last ``placement.requery_window_s`` seconds (SGLang re-issues a request's hit query)
        counts once (:class:`~flatcake.gva.signals.RequeryFilter`). When nothing is stored
        (``n`` 0) and ``prefix_keys`` do not end on a scope's tail (SGLang 0.5.23 passes a hit
        query only the keys before the radix node its match ends in), the turn is decided when
        ``keys[0]`` is backed up (:class:`~flatcake.gva.signals.TurnStarts`). Lock-free (best
        effort)."""
        if n >= len(keys) or self.requeries.seen(keys, prefix_keys):
            return
        last = keys[n - 1] if n else (prefix_keys[-1] if prefix_keys else None)
        scope = self.index.tails.get(last) if last is not None else None
        if scope is not None and not scope.retired:
            scope.new_turn()
        elif n == 0:
            self.turn_starts.note(keys[0])
        self.interest.note_missing(list(keys[n:]))

    def pin_leading_run(self, keys: Sequence[str]) -> list[PageEntry]:
        """Entries of the leading run of published ``keys`` whose scopes could be pinned (no
        lock: a dict probe each, a per-scope pin per run of one scope). The caller reads their bytes,
        then calls :meth:`unpin`. A scope retired between the lookup and the pin ends the run (a miss)."""
        entries = self.index.leading_entries(keys)
        del entries[pin_entries(entries):]
        return entries

    def unpin(self, entries: Sequence[PageEntry]) -> None:
        """Drop the pins :meth:`pin_leading_run` took; a doomed scope whose last pin this was is
        freed now."""
        doomed = []
        for scope, k in scope_runs(entries):  # one release per run of one scope's pages
            scope.release(k)
            if scope.doomed:
                doomed.append(scope)
        if doomed:
            with self.lock:
                for scope in doomed:
                    self.free_scope_locked(scope)

    # ================================================================ placement (writer lock)
    def _decide_locked(self, n_pages: int, turn: int, prev: Optional[int], cur: int, keys,
                       context_tokens: int) -> PlacementDecision:
        """Table 2 decision for a round of ``n_pages``. DRAM counts as full when the round does
        not fit in the free slots (the watermark reclaim after each write keeps headroom)."""
        return self.policy.decide(
            PlacementSignals(
                prefix_refcount=self.interest.take(list(keys)),
                turn=turn,
                prev_reply_tokens=prev,
                context_tokens=context_tokens,
                reply_tokens=cur + n_pages * self.geometry.page_size,
                dram_full=self.dram.free_slots < n_pages,
            )
        )

    def _scope_for_round_locked(self, keys, parent: Optional[str], context_tokens: int) -> SessionScope:
        """The scope a round with ``parent`` joins or opens (Table 2 for a new scope, or for a
        DRAM session that may have to continue on SSD). Writer lock held."""
        n = len(keys)
        scope = self.index.tails.get(parent) if parent is not None else None
        if scope is not None and scope.retired:
            scope = None
        if self.turn_starts.take(keys[0]) and scope is not None:
            scope.new_turn()  # a hit query that could not see its session (note_hit_query)
        if scope is None:
            pe = self.index.get(parent) if parent is not None else None
            turn = pe.scope.turn if pe is not None else 1
            prev = pe.scope.prev_turn_tokens if pe is not None else None
            dec = self._decide_locked(n, turn, prev, 0, keys, context_tokens)
            return self.index.open_scope_locked(dec.medium, dec.scope, turn, prev)
        if scope.medium == MEDIUM_DRAM:
            dec = self._decide_locked(n, scope.turn, scope.prev_turn_tokens, scope.cur_turn_tokens, keys, context_tokens)
            if dec.medium != MEDIUM_DRAM:  # the session continues on SSD; written pages stay
                old = scope
                scope = self.index.open_scope_locked(MEDIUM_SSD, dec.scope, old.turn, old.prev_turn_tokens)
                scope.cur_turn_tokens = old.cur_turn_tokens
            return scope
        self.interest.take(list(keys))
        return scope

    def place_locked(self, keys: Sequence[str], src_pages: Sequence[int], parent: Optional[str],
                     context_tokens: int, evict: bool = True) -> Optional[Placement]:
        """Choose the scope and medium of a round and reserve its space. Writer lock held.

        Args:
            keys: the round's new page keys (none of them published).
            src_pages: their page ids in the source layout.
            parent: the key just before the round's first page, or ``None`` at the root.
            context_tokens: tokens of context up to the end of the round.
            evict: free whole scopes when no free range holds the round (and freeing makes it
                fit); with False the placement just fails (the caller may split the round).

        Returns:
            A :class:`Placement` whose scope is pinned, or ``None`` (logged) when the round
            cannot be given SSD space even after reclaiming unpinned scopes.
        """
        g = self.geometry
        n = len(keys)
        scope = self._scope_for_round_locked(keys, parent, context_tokens)
        scope.try_acquire()
        scope.last_used_s = time.monotonic()
        if scope.medium == MEDIUM_DRAM:
            slots = self.dram.allocate_locked(n)
            if slots is not None:
                scope.slots.extend(slots)
                scope.nbytes += n * g.page_bytes
                return Placement(scope, list(keys), list(src_pages), slots=slots)
            # raced with the signal; fall back to SSD for this round
            scope.release()
            old = scope
            scope = self.index.open_scope_locked(MEDIUM_SSD, ReuseScope.OVERFLOW, old.turn, old.prev_turn_tokens)
            self._forget_if_empty_locked(old)
            scope.try_acquire()
        lay = fmt.round_layout(keys, g.layers, g.chunk_bytes)
        where = None
        prev_tail = scope.tail_offset
        if lay.total_bytes + fmt.BLOCK <= self.ssd.file_bytes:  # else no extent could ever hold it
            try:
                where = self._ssd_space_locked(scope, lay.total_bytes, evict)
            except BaseException:
                scope.release()
                raise
        if where is None:
            scope.release()
            self._forget_if_empty_locked(scope)
            if evict:
                self.errors.report("put", "SSD pool full", f"{self.ssd.used_bytes} bytes used, nothing evictable "
                                   f"makes room for {n} pages; the put fails")
            return None
        f, off, new_ext, ext_off = where
        seq = scope.round_seq
        scope.round_seq += 1
        return Placement(scope, list(keys), list(src_pages), extent_file=f, round_offset=off, layout=lay, seq=seq,
                         new_extent=new_ext, extent_seq=len(scope.extents) - 1, prev_tail=prev_tail,
                         nonce=fmt.new_nonce(), extent_offset=ext_off, generation=self.ssd.generation_of(f))

    def _ssd_space_locked(self, scope: SessionScope, nbytes: int,
                          evict: bool = True) -> Optional[tuple[int, int, Optional[Extent], int]]:
        """Reserve ``nbytes`` at the scope's tail: in its last extent, by growing it in place,
        or in a new extent (whose header block comes first). Reclaims when the pool is full.

        Returns:
            ``(file_index, offset, new_extent, extent_offset)`` (``new_extent`` is None unless one
            was opened), or ``None`` when nothing fits even after freeing every unpinned scope
            (nothing is evicted then).
        """
        if scope.extents:
            ext: Extent = scope.extents[-1]
            room = ext.end - scope.tail_offset
            if room >= nbytes:
                off = scope.tail_offset
                scope.tail_offset += nbytes
                return ext.file_index, off, None, ext.offset
            grown = self.ssd.try_extend_locked(ext, nbytes - room)
            if grown is not None:
                scope.extents[-1] = grown
                scope.nbytes += grown.nbytes - ext.nbytes
                off = scope.tail_offset
                scope.tail_offset += nbytes
                return ext.file_index, off, None, ext.offset
        need = nbytes + fmt.BLOCK
        after = scope.extents[-1].file_index if scope.extents else None  # round-robin over drives
        ext = self.ssd.allocate_locked(need, after)
        if ext is None and not evict:
            return None
        if ext is None:  # admission before eviction: evict only if that makes the round fit
            freeable = [x for sc in self.index.scopes.values()
                        if sc is not scope and sc.medium == MEDIUM_SSD and self.evictable(sc) for x in sc.extents]
            if not self.ssd.fits_after_freeing_locked(need, freeable):
                return None
        while ext is None:  # no free range fits (full or fragmented): free oldest scopes one by one
            if not self.reclaim_one_locked(MEDIUM_SSD, exclude=scope, queued=True):
                return None
            ext = self.ssd.allocate_locked(need, after)
        scope.extents.append(ext)
        scope.nbytes += ext.nbytes
        scope.tail_offset = ext.offset + fmt.BLOCK + nbytes
        return ext.file_index, ext.offset + fmt.BLOCK, ext, ext.offset

    def commit_locked(self, plc: Placement, entries: Sequence[PageEntry], parent: Optional[str]) -> bool:
        """Publish a written round: the journal's ``ROUND`` entry (SSD), then key -> entry
        (readers see it from now on), the scope's tail and reply tokens. Writer lock held.

        Returns:
            False, publishing nothing, when the round's space was taken away while it was
            written (its scope was dropped, or its pool file reset), or its journal entry could
            not be written (a published round survives a restart, or is not published): the
            caller aborts it.
        """
        scope = plc.scope
        if scope.retired or scope.doomed or (
                plc.medium == MEDIUM_SSD and self.ssd.generation_of(plc.extent_file) != plc.generation):
            return False
        if plc.medium == MEDIUM_SSD:
            lay = plc.layout
            e = JournalEntry(ROUND, scope.scope_id, plc.extent_file, plc.round_offset, plc.extent_offset, plc.nonce,
                             lay.record_offset, lay.record_bytes, plc.seq, reuse_code(scope.reuse))
            if not self._journal(e):  # not in the journal: a restart would not find it; not published
                return False
            scope.rounds.append(e)
            self.live_rounds += 1
        self.index.publish_locked(plc.keys, entries)
        self.publish_listeners(plc, entries)
        if scope.tail_key is None or scope.tail_key == parent:  # appended at the tail
            self.index.set_tail_locked(scope, plc.keys[-1])
        scope.cur_turn_tokens += len(plc.keys) * self.geometry.page_size
        return True

    def abort_locked(self, plc: Placement) -> None:
        """Give back a round's reservation after its write failed. Writer lock held.

        DRAM slots go back to the free list *and* leave the scope's slot list, so a slot has
        exactly one owner (a later reclaim of the scope cannot free it a second time). SSD
        bytes at the scope's tail are taken back while nothing was appended after them; an
        extent this round opened is freed whole when it holds nothing else.
        """
        scope = plc.scope
        g = self.geometry
        if plc.slots is not None:
            mine = set(plc.slots)
            scope.slots = [s for s in scope.slots if s not in mine]
            scope.nbytes -= len(plc.slots) * g.page_bytes
            self.dram.free_locked(plc.slots)
            return
        lay = plc.layout
        if self.ssd.generation_of(plc.extent_file) != plc.generation:
            return  # its file was reset or went out of service: the scope lost that extent already
        if scope.tail_offset != plc.round_offset + lay.total_bytes:
            return  # another round was placed after it: the hole stays until the scope goes
        ext = plc.new_extent
        if ext is not None and scope.extents and scope.extents[-1].offset == ext.offset \
                and scope.extents[-1].file_index == ext.file_index:
            last = scope.extents.pop()
            self.ssd.free_locked(last)
            scope.nbytes -= last.nbytes
        scope.tail_offset = plc.prev_tail

    def release(self, plc: Placement) -> None:
        """Unpin the placement's scope; drop it from the table if the failed round left it
        empty, free it if it was doomed while the round was written."""
        scope = plc.scope
        scope.release()
        if not scope.keys or scope.doomed:
            with self.lock:
                if scope.doomed:
                    self.free_scope_locked(scope)
                else:
                    self._forget_if_empty_locked(scope)

    def _forget_if_empty_locked(self, scope: SessionScope) -> None:
        if not scope.keys and not scope.extents and not scope.slots and scope.try_retire():
            self.index.unpublish_scope_locked(scope)

    # ================================================================ reclaim
    def reclaim_if_needed(self, exclude: Optional[SessionScope] = None) -> None:
        """Reclaim each medium above its high watermark down to its low watermark, never
        freeing ``exclude`` (the scope a put just wrote)."""
        if self.ssd.used_fraction() > self.cfg.ssd.high_watermark or (
            self.dram.n_slots and self.dram.used_fraction() > self.cfg.dram.high_watermark
        ):
            with self.lock:
                if self.ssd.used_fraction() > self.cfg.ssd.high_watermark:
                    self.reclaim_locked(MEDIUM_SSD, exclude)
                if self.dram.n_slots and self.dram.used_fraction() > self.cfg.dram.high_watermark:
                    self.reclaim_locked(MEDIUM_DRAM, exclude)

    def reclaim_locked(self, medium: int, exclude: Optional[SessionScope] = None) -> None:
        """Free the oldest unpinned scopes of ``medium`` (never ``exclude``) whole until usage
        is at or below the low watermark. Writer lock held."""
        if medium == MEDIUM_SSD:
            target = self.cfg.ssd.low_watermark * self.ssd.capacity_bytes
            above = lambda: self.ssd.used_bytes > target  # noqa: E731
        else:
            target = self.cfg.dram.low_watermark * self.dram.n_slots
            above = lambda: self.dram.n_slots - self.dram.free_slots > target  # noqa: E731
        while above() and self.reclaim_one_locked(medium, exclude):
            pass

    def evictable(self, scope: SessionScope) -> bool:
        """True when a round that finds the pool full may evict ``scope``: not retired, and
        pinned by nobody but its rounds waiting in the write queue (issue 24 item 3: a queued
        round is not yet written, so it is no reason to keep the pool full; with the queue off
        the same scope would be written and unpinned). A reader, or a round being written,
        keeps it. Writer lock held."""
        if scope.retired:
            return False
        refs = scope.refcount
        return refs == 0 or (self.queue is not None and refs == self.queue.waiting_pins(scope))

    def reclaim_one_locked(self, medium: int, exclude: Optional[SessionScope] = None, queued: bool = False) -> bool:
        """Retire, unpublish and free the least recently used scope of ``medium`` that nobody
        pins (a reader or writer inside it is never freed under it). False if none can go.
        Writer lock held.

        With ``queued`` (a round that finds the pool full, :meth:`_ssd_space_locked`) a scope
        pinned only by its rounds waiting in the write queue counts as unpinned (:meth:`evictable`):
        those rounds leave the queue unwritten (:meth:`~flatcake.store.write_queue.WriteQueue.evict_scope`),
        so scopes go in the same least-recently-used order as with the queue off. The watermark
        reclaim (``queued`` False) leaves them alone: it makes headroom ahead of need, and a
        round not yet written is the newest data the pool holds."""
        q = self.queue if queued else None
        for scope in self.index.oldest_scopes_locked(medium):
            if scope is exclude:
                continue
            if self.free_scope_locked(scope):
                return True
            if q is not None and q.waiting_pins(scope) and q.evict_scope(
                    scope, lambda jobs, s=scope: self.free_scope_locked(s, [k for j in jobs for k in j.keys])):
                return True
        return False

    def free_scope_locked(self, scope: SessionScope, queued_keys: Sequence[str] = ()) -> bool:
        """Retire ``scope`` if unpinned, then unpublish its keys and free its space (whole).
        Writer lock held. Returns False (and changes nothing) when a reader or writer pins it.
        ``queued_keys``: keys of its rounds leaving the write queue unwritten (an eviction,
        :meth:`reclaim_one_locked`), told to the retire listeners with its published keys."""
        if not scope.try_retire():
            return False
        keys = list(scope.keys) + list(queued_keys) if self.retire_listeners else None
        self.index.unpublish_scope_locked(scope)
        if scope.medium == MEDIUM_SSD:
            if scope.rounds and not scope.keep_on_disk:
                self._journal(JournalEntry(RETIRE, scope.scope_id))
            self.live_rounds -= len(scope.rounds)
            for ext in scope.extents:
                self.ssd.free_locked(ext)
            self.stats.add(reclaimed_scopes_ssd=1, reclaimed_bytes=scope.nbytes)
        else:
            self.dram.free_locked(scope.slots)
            self.stats.add(reclaimed_scopes_dram=1, reclaimed_bytes=scope.nbytes)
        if keys:
            self.notify_retired(keys, scope.scope_id)
        return True

    def notify_retired(self, keys: list, scope_id: int = 0) -> None:
        """Tell every :attr:`retire_listeners` callable the keys and id of a freed scope. A
        listener that raises is logged once (op ``retire listener``) and never stops the reclaim."""
        self.retire_listeners(keys, scope_id)

    def drop_locked(self, scope: SessionScope) -> bool:
        """Free ``scope`` now, or, while a reader or writer pins it, *doom* it: its keys are
        unpublished at once (hit queries stop promising them) and its space is freed when the
        last pin goes (:meth:`unpin`, :meth:`release`). Returns True if freed now. Writer lock held."""
        if self.free_scope_locked(scope):
            return True
        if not scope.retired:
            scope.doomed = True
            self.index.hide_scope_locked(scope)
        return False

    def clear(self) -> None:
        """Drop every scope (SGLang's ``/hicache/storage-backend/clear``): unpinned ones are
        freed at once, pinned ones are retired when their last reader leaves."""
        with self.lock:
            for scope in list(self.index.scopes.values()):
                self.drop_locked(scope)

    def drop_file_scopes_locked(self, file_index: int) -> None:
        """Pool file ``file_index`` lost its bytes (removed or truncated behind the backend, or
        taken out of service): drop every scope with an extent in it. A pinned one loses that
        file's extents now (their space is not the pool's any more) and is freed when its last
        pin goes. Writer lock held.

        With several drives only the pages in that file go (the scopes keep their other pages,
        :mod:`flatcake.gva.drive_faults`), and when the file's drive directory is gone the whole
        drive goes out of service with its pages."""
        if self.ssd.n_drives > 1:
            drive = self.ssd.drive_of(file_index)
            if self.ssd.drive_lost(file_index):
                drop_pages_in_files_locked(self, self.ssd.drive_files(drive))
                self.ssd.take_drive_out_of_service_locked(drive, "directory is gone")
            else:
                drop_pages_in_files_locked(self, [file_index])
            return
        for scope in [s for s in self.index.scopes.values() if any(x.file_index == file_index for x in s.extents)]:
            if not self.free_scope_locked(scope):
                gone = [x for x in scope.extents if x.file_index == file_index]
                scope.extents = [x for x in scope.extents if x.file_index != file_index]
                scope.nbytes -= sum(x.nbytes for x in gone)
                self.drop_locked(scope)

    def take_file_out_of_service_locked(self, file_index: int) -> None:
        """Pool file ``file_index`` refuses writes: no more extents in it; its scopes dropped
        from the index but not retired in the journal — their bytes were not lost, so a restart
        that finds them intact (record and checksums) serves them again. Writer lock held.

        With several drives the file's whole drive goes out of service, and only the pages
        stored on it are dropped (:mod:`flatcake.gva.drive_faults`)."""
        if self.ssd.n_drives > 1:
            drive = self.ssd.drive_of(file_index)
            drop_pages_in_files_locked(self, self.ssd.drive_files(drive))
            self.ssd.take_drive_out_of_service_locked(drive, "refuses writes")
            return
        for scope in self.index.scopes.values():
            if any(x.file_index == file_index for x in scope.extents):
                scope.keep_on_disk = True
        self.drop_file_scopes_locked(file_index)
        self.ssd.take_out_of_service_locked(file_index)

    # ================================================================ journal
    def journal_entries_locked(self) -> list[JournalEntry]:
        """``ROUND`` entries of every live SSD round, scope by scope, least recently used scope
        first (a compacted journal; a restart keeps this order for reclaim)."""
        return [e for sc in self.index.oldest_scopes_locked(MEDIUM_SSD) if not sc.retired for e in sc.rounds]

    def maybe_compact_journal_locked(self) -> bool:
        """Rewrite the journal with the live rounds once it holds more than ``2 × live rounds +
        COMPACT_MIN_ENTRIES`` entries: it stays bounded by the live scopes, so a follower that
        starts late (and a restart) replays only those. Writer lock held."""
        j = self.journal
        if j is None or j.entries <= 2 * self.live_rounds + COMPACT_MIN_ENTRIES:
            return False
        try:
            j.rewrite(self.journal_entries_locked())
        except OSError as err:
            self.errors("journal compaction", err)
            return False
        return True

    def _journal(self, e: JournalEntry) -> bool:
        """Append ``e`` to the pool journal; False on failure (logged once per errno, not
        raised). Writer lock held: entries must reach the journal in the order of the events
        they record. After a failed append (the journal may end in a torn entry) the journal is
        rewritten from the live rounds before the next append: it never loses a published
        round."""
        if self.journal is None:
            return True
        try:
            if self._journal_broken:
                self.journal.rewrite(self.journal_entries_locked())
                self._journal_broken = False
            self.journal.append(e)
            return True
        except OSError as err:
            self._journal_broken = True
            self.errors("journal append", err)
            return False
