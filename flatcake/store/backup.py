"""Backup: storing a call's pages, as SGLang's backup thread asks (paper §3.1 write-time placement).

The write side of the store, between the scope table (which decides) and the write path (which
moves bytes). Lifecycle of one ``put``::

    claim the new keys (KeyClaims)       a concurrent put of the same keys waits, then skips them
    cut them into rounds                 <= max_round_pages pages, chained by their parent key
    per round:
      place     (writer lock)            scope, medium, space; no free range holds the round?
                                         split it in two while a one-page round fits somewhere,
                                         then evict whole scopes (only if that makes it fit)
      write     (no lock)                WritePath: DRAM slots, or SSD header+data, then record
      commit    (writer lock)            journal entry, publish; or abort: the space goes back
      release, reclaim above the high watermark
    release the claims

A failed write is a failed put (``False``), never an exception, and the fault is handled here:
a pool file removed or truncated behind the backend is reset (its scopes dropped, its
generation bumped); one that refuses writes (EIO, EROFS, EPERM) is taken out of service.
"""

from __future__ import annotations

from typing import Optional

from flatcake.store.deferred_round import prepare_round, write_prepared
from flatcake.common.errorlog import ErrorLog
from flatcake.gva.address import MEDIUM_DRAM
from flatcake.gva.placement import Placement, ReuseScope
from flatcake.gva.scopes import ScopeTable
from flatcake.common.layout import KvPageLayout, PageGeometry
from flatcake.media import extent as fmt
from flatcake.media.errors import PoolFileGone, ShortWrite
from flatcake.media.ssd import REFUSED_ERRNOS, SsdFilePool
from flatcake.store.read_path import ReadPath
from flatcake.store.stats import StoreStats
from flatcake.store.write_path import WritePath
from flatcake.store.write_queue import WRITE_CHUNK_BYTES, QueuedRound, WriteQueue

MAX_KEY_BYTES = 4096  # bytes of UTF-8 per page key (SGLang's are 64 hex characters)


def count_keys(keys) -> int:
    """``len(keys)``, or 0 for something that has none (a call with no usable keys)."""
    try:
        return len(keys)
    except TypeError:
        return 0


def valid_key(k) -> bool:
    """True for a page key FlatCake can store: a non-empty ``str`` of at most
    :data:`MAX_KEY_BYTES` UTF-8 bytes."""
    if not isinstance(k, str) or not k:
        return False
    try:
        return len(k.encode()) <= MAX_KEY_BYTES
    except UnicodeEncodeError:
        return False


class Backup:
    """Stores pages round by round (see the module docstring).

    Args:
        scopes: the scope table.
        writer: the write path.
        reader: the read path (to forget a pool file's cached descriptors).
        ssd: the SSD pool (free space, file resets).
        geometry: page geometry of the namespace.
        max_round_pages: pages per round at most (:func:`~flatcake.store.write_path.max_round_pages`).
        stats, errors: the store's stats object and error-once log.
    """

    def __init__(self, scopes: ScopeTable, writer: WritePath, reader: ReadPath, ssd: SsdFilePool,
                 geometry: PageGeometry, max_round_pages: int, stats: StoreStats, errors: ErrorLog):
        self.scopes, self.writer, self.reader, self.ssd = scopes, writer, reader, ssd
        self.geometry, self.max_round_pages, self.stats, self.errors = geometry, max_round_pages, stats, errors
        self._min_extent_bytes = fmt.round_layout(["k" * 64], geometry.layers, geometry.chunk_bytes).total_bytes + fmt.BLOCK
        self.queue: Optional[WriteQueue] = None  # ssd.write_backlog_bytes > 0: SSD rounds are deferred
        self.backlog_wait_s = 0.0
        self.node = 0
        #: ``fn(keys, src_pages, layout, parent) -> pages stored elsewhere``, asked for a round
        #: no local space holds (cluster write-time placement, ``docs/cluster.md``); None = off
        self.overflow = None

    def attach_queue(self, queue: WriteQueue, backlog_wait_s: float, node: int) -> None:
        """Defer SSD rounds through ``queue`` (``docs/design.md``, "Write queue"); a round of a
        scope other than one-shot waits up to ``backlog_wait_s`` seconds for room in a full
        backlog (then the put fails). ``node``: the GVA node field of the entries."""
        self.queue, self.backlog_wait_s, self.node = queue, backlog_wait_s, node
        self.scopes.queue = queue  # reclaim frees a scope pinned only by its waiting rounds

    def stored(self, key: str) -> bool:
        """True when ``key`` is published, or waits in the write queue (its bytes are kept)."""
        q = self.queue
        return (q is not None and q.contains(key)) or self.scopes.index.contains(key)

    def put(self, keys: list, layout: KvPageLayout, page_ids, prefix_keys, out: list[bool]) -> int:
        """Store pages ``keys[i]`` from page ``page_ids[i]`` of ``layout``, filling ``out``
        (per-page success) round by round; stops at the first failed round. The new keys are
        claimed first, so a concurrent put of the same keys writes them once (it waits, then
        finds them published). Raises only for a caller bug (the facade catches it).

        Returns:
            Pages this call wrote and published (pages): keys already stored, repeats within the
            call and pages of failed rounds are not counted; the first half of a split round
            that was published is, even when the round's second half failed.
        """
        n_valid = next((i for i, k in enumerate(keys) if not valid_key(k)), len(keys))
        if n_valid < len(keys):
            k = keys[n_valid]
            self.errors("put", ValueError(f"invalid page key {str(k)[:80]!r} (need a str of 1..{MAX_KEY_BYTES} "
                                          "UTF-8 bytes)"))
        mine = self.scopes.claims.claim(keys[:n_valid])  # the pages after an unusable key cannot be chained to it
        try:
            return self._put_claimed(keys[:n_valid], set(mine), layout, page_ids, prefix_keys, out)
        finally:
            self.scopes.claims.release(mine)

    def _put_claimed(self, keys, mine: set, layout, page_ids, prefix_keys, out: list[bool]) -> int:
        todo, parent, seen, repeats, stored = [], None, set(), [], 0
        for i, k in enumerate(keys):
            if self.stored(k):  # same key = same page bytes (chained hash)
                out[i] = True
                continue
            if k in seen:  # given twice in one call: stored with its first copy
                repeats.append(i)
                continue
            if k not in mine:  # another put still holds it (it did not finish in time)
                break
            seen.add(k)
            if not todo:
                parent = keys[i - 1] if i > 0 else (prefix_keys[-1] if prefix_keys else None)
            todo.append(i)
        ctx0 = (len(prefix_keys) if prefix_keys else 0) * self.geometry.page_size
        for a in range(0, len(todo), self.max_round_pages):  # rounds, each written as one unit
            part = todo[a: a + self.max_round_pages]
            done = self._put_round([keys[i] for i in part], [int(page_ids[i]) for i in part], layout, parent,
                                   ctx0 + (part[-1] + 1) * self.geometry.page_size)
            stored += done
            ok = done == len(part)
            for i in part:
                out[i] = ok
            if not ok:
                break
            parent = keys[part[-1]]
        for i in repeats:
            out[i] = self.stored(keys[i])
        return stored

    def _put_round(self, keys, src_pages, layout, parent, context_tokens) -> int:
        """Place, write and publish one round; returns the pages published: ``len(keys)``, or
        fewer on a failure (0 unless a split round's first half was published).

        Free space first: a round that no free range holds is split in two (each half placed
        the same way) while some free range holds a one-page round; only then are whole scopes
        evicted to make room (paper §3.1: reclaim by scope, and only when it helps)."""
        with self.scopes.lock:
            plc = self.scopes.place_locked(keys, src_pages, parent, context_tokens, evict=False)  # pins plc.scope
            split = plc is None and len(keys) > 1 and self.ssd.largest_free_range() >= self._min_extent_bytes
            if plc is None and not split:
                plc = self.scopes.place_locked(keys, src_pages, parent, context_tokens)
        if split:
            h = len(keys) // 2
            first = self._put_round(keys[:h], src_pages[:h], layout, parent,
                                    context_tokens - (len(keys) - h) * self.geometry.page_size)
            if first < h:
                return first
            return first + self._put_round(keys[h:], src_pages[h:], layout, keys[h - 1], context_tokens)
        if plc is None:  # no space, even after the local policy reclaimed what it could
            placed = self._overflow(keys, src_pages, layout, parent)
            if placed:
                return placed
            self.stats.add(put_failures=1)
            return 0
        if self.queue is not None and plc.slots is None:
            return self._put_deferred(plc, layout, parent, context_tokens)
        return self._write_and_commit(plc, lambda: self.writer.write(plc, layout), parent)

    def _overflow(self, keys, src_pages, layout, parent) -> int:
        """Pages of a round without local space that :attr:`overflow` stored on another node
        (all or 0); 0 without one. Never raises."""
        fn = self.overflow
        if fn is None:
            return 0
        try:
            return len(keys) if fn(keys, src_pages, layout, parent) == len(keys) else 0
        except Exception as e:  # noqa: BLE001 - a failed placement is a failed put
            self.errors("remote placement", e)
            return 0

    def _write_and_commit(self, plc, write, parent, op: str = "write") -> int:
        """Write round ``plc`` (``write()`` returns its entries), then commit it; on a fault or
        a refused commit abort it (the space goes back) and count a failed put. Returns the
        pages published (``len(plc.keys)`` or 0)."""
        keys = plc.keys
        try:
            entries = write()
        except Exception as e:
            self.errors(op, e)
            with self.scopes.lock:
                self.scopes.abort_locked(plc)
            self.scopes.release(plc)
            if isinstance(e, PoolFileGone):
                self._on_pool_file_gone(plc.extent_file)
            elif isinstance(e, OSError) and e.errno in REFUSED_ERRNOS and not isinstance(e, ShortWrite) \
                    and plc.extent_file >= 0:
                with self.scopes.lock:  # the file refuses writes: keep writing into the others
                    self.scopes.take_file_out_of_service_locked(plc.extent_file)
                self.reader.forget_file(plc.extent_file)
            self.stats.add(put_failures=1)
            return 0
        with self.scopes.lock:
            committed = self.scopes.commit_locked(plc, entries, parent)
            if committed:
                self.scopes.maybe_compact_journal_locked()
            else:  # its scope was dropped or its file reset while the bytes were written
                self.scopes.abort_locked(plc)
        self.scopes.release(plc)
        if not committed:
            self.stats.add(put_failures=1)
            return 0
        self.stats.add(logical_write_bytes=len(keys) * self.geometry.page_bytes)
        self.scopes.reclaim_if_needed(exclude=plc.scope)
        return len(keys)

    # ------------------------------------------------------------------ deferred SSD rounds
    def _put_deferred(self, plc: Placement, layout, parent, context_tokens: int) -> int:
        """Queue SSD round ``plc`` (Tutti: written later, in a gap between restores). A full
        backlog first moves the round to DRAM (if it has room), else drops a one-shot round
        whole (counted; the put of those pages fails, nothing stored is touched), else waits up
        to ``backlog_wait_s`` for room (then the put fails). Returns pages stored (queued)."""
        q, n = self.queue, len(plc.keys)
        if not q.has_room(plc.layout.total_bytes):
            with self.scopes.lock:
                dram = self._to_dram_locked(plc)
            if dram is not None:
                self.stats.add(write_backlog_dram_rounds=1)
                return self._write_and_commit(dram, lambda: self.writer.write(dram, layout), parent)
            if self._one_shot(plc, context_tokens):
                self._give_back(plc)
                self.stats.add(write_backlog_dropped_rounds=1, write_backlog_dropped_pages=n)
                return 0
            if not q.wait_for_room(plc.layout.total_bytes, self.backlog_wait_s):
                self._give_back(plc)
                self.stats.add(write_backlog_full_failures=1, put_failures=1)
                self.errors.report("put", "write backlog full", f"no room in ssd.write_backlog_bytes="
                                   f"{q.backlog_limit} within {self.backlog_wait_s} s; the put fails")
                return 0
        try:
            prep = prepare_round(plc, layout, self.geometry, self.writer.namespace, self.node, q.take_buffer())
        except Exception as e:
            self.errors("write", e)
            self._give_back(plc)
            self.stats.add(put_failures=1)
            return 0
        scope = plc.scope
        with self.scopes.lock:  # the session's next round joins this scope while this one waits
            if scope.tail_key is None or scope.tail_key == parent:
                self.scopes.index.set_tail_locked(scope, plc.keys[-1])
            queued = q.submit(QueuedRound(plc, parent, prep))
        if not queued:  # closing
            self._give_back(plc)
            return 0
        self.stats.add(queued_rounds=1)
        return n

    def _one_shot(self, plc: Placement, context_tokens: int) -> bool:
        """True for a round of the one-shot row of Table 2: its scope was opened as one-shot,
        or as overflow (DRAM full) while the signals say turn 1, context below ``L_agent`` and
        reply below ``tau``. (The prefix reference count was consumed by the placement: an
        overflowing turn-1 shared prompt counts as one-shot here.)"""
        scope, pc = plc.scope, self.scopes.cfg.placement
        if scope.reuse == ReuseScope.ONE_SHOT:
            return True
        reply = scope.cur_turn_tokens + len(plc.keys) * self.geometry.page_size
        return scope.reuse == ReuseScope.OVERFLOW and scope.turn <= 1 and context_tokens < pc.l_agent_tokens \
            and reply < pc.tau_tokens

    def _to_dram_locked(self, plc: Placement) -> Optional[Placement]:
        """SSD placement ``plc`` given back and the round placed in a new DRAM scope (same
        reuse class and turn), or ``None`` (``plc`` untouched) when DRAM has no room."""
        n = len(plc.keys)
        dram = self.scopes.dram
        if dram.n_slots == 0 or dram.free_slots < n:
            return None
        slots = dram.allocate_locked(n)
        if slots is None:
            return None
        old = plc.scope
        self.scopes.abort_locked(plc)
        self.scopes.release(plc)
        scope = self.scopes.index.open_scope_locked(MEDIUM_DRAM, old.reuse, old.turn, old.prev_turn_tokens)
        scope.try_acquire()
        scope.slots.extend(slots)
        scope.nbytes += n * self.geometry.page_bytes
        return Placement(scope, list(plc.keys), list(plc.src_pages), slots=slots)

    def _give_back(self, plc: Placement) -> None:
        """Abort ``plc`` (its space goes back) and unpin its scope."""
        with self.scopes.lock:
            self.scopes.abort_locked(plc)
        self.scopes.release(plc)

    def complete_queued(self, job: QueuedRound) -> None:
        """Writer thread: write queued round ``job`` (pausing between chunks while restores
        are in flight), then publish its SSD entries. A fault makes it a failed put after the
        fact: nothing published, its pages leave the queue (misses from then on), counted
        (``deferred_write_failures``), logged once with the errno (op ``deferred write``)."""
        plc = job.plc
        done = self._write_and_commit(
            plc, lambda: write_prepared(job.prepared, self.ssd, self.node, self.stats, WRITE_CHUNK_BYTES,
                                        self.queue.pause_for_reads, self.queue.readers_now), job.parent,
            op="deferred write")
        if done == 0:
            self.stats.add(deferred_write_failures=1, deferred_write_failed_pages=len(plc.keys))
            self._untail(job)

    def drop_queued(self, job: QueuedRound) -> None:
        """A queued round that will not be written (its scope was dropped or cleared, or the
        store closed before it was drained): its space goes back, nothing is published or
        journaled. Counted (``write_backlog_discarded_rounds``)."""
        self._give_back(job.plc)
        self._untail(job)
        self.stats.add(write_backlog_discarded_rounds=1)

    def _untail(self, job: QueuedRound) -> None:
        """The session's tail goes back to ``job``'s parent when ``job`` was its last round
        and the parent is a page of the same scope (the next round can still join it)."""
        scope, parent = job.plc.scope, job.parent
        with self.scopes.lock:
            if scope.retired or scope.tail_key != job.keys[-1]:
                return
            pe = self.scopes.index.get(parent) if parent is not None else None
            if pe is not None and pe.scope is scope:
                self.scopes.index.set_tail_locked(scope, parent)

    def _on_pool_file_gone(self, file_index: int) -> None:
        """Pool file ``file_index`` was removed behind the backend: drop every scope with an
        extent in it (their pages are gone), close the readers' handles, start the file afresh."""
        with self.scopes.lock:
            self.scopes.drop_file_scopes_locked(file_index)
            try:
                self.reader.forget_file(file_index)  # the readers' cached fds point at the old inode
                self.ssd.reset_file_locked(file_index)
            except OSError as e:
                self.errors("pool file reset", e)
        self.errors.report("write", "pool file gone", f"pool file {self.ssd.path_of(file_index)} was removed or "
                           "truncated behind the backend; its scopes were dropped and the file recreated")
