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

from flatcake.errorlog import ErrorLog
from flatcake.gva.scopes import ScopeTable
from flatcake.layout import KvPageLayout, PageGeometry
from flatcake.media import extent as fmt
from flatcake.media.errors import PoolFileGone, ShortWrite
from flatcake.media.ssd import REFUSED_ERRNOS, SsdFilePool
from flatcake.read_path import ReadPath
from flatcake.stats import StoreStats
from flatcake.write_path import WritePath

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
        max_round_pages: pages per round at most (:func:`~flatcake.write_path.max_round_pages`).
        stats, errors: the store's stats object and error-once log.
    """

    def __init__(self, scopes: ScopeTable, writer: WritePath, reader: ReadPath, ssd: SsdFilePool,
                 geometry: PageGeometry, max_round_pages: int, stats: StoreStats, errors: ErrorLog):
        self.scopes, self.writer, self.reader, self.ssd = scopes, writer, reader, ssd
        self.geometry, self.max_round_pages, self.stats, self.errors = geometry, max_round_pages, stats, errors
        self._min_extent_bytes = fmt.round_layout(["k" * 64], geometry.layers, geometry.chunk_bytes).total_bytes + fmt.BLOCK

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
            if self.scopes.index.contains(k):  # same key = same page bytes (chained hash)
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
            out[i] = self.scopes.index.contains(keys[i])
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
        if plc is None:
            self.stats.add(put_failures=1)
            return 0
        try:
            entries = self.writer.write(plc, layout)
        except Exception as e:
            self.errors("write", e)
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
