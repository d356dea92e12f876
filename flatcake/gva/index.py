"""Key -> GVA index and session scopes (paper §3.1, FC-GVA).

Lifecycle of a page write::

    allocate GVA (writer lock)  ->  write bytes (no lock)  ->  publish key -> PageEntry (writer lock)

Lifecycle of a session scope::

    open (first round placed)  ->  append rounds (same medium)  ->  retire (no readers)  ->  unpublish + free

Readers never lock the index: :meth:`GvaIndex.get` is one ``dict.get`` (atomic under the
GIL). That is safe because

* an entry is inserted only after its bytes are written (publish-after-write), so a reader
  that sees a key finds its bytes;
* a published :class:`PageEntry` is immutable and its GVA never changes;
* before touching the bytes a reader pins the entry's scope (:meth:`SessionScope.try_acquire`,
  a per-scope lock, not the index). Reclaim retires a scope only when its pin count is zero,
  and a retired scope refuses new pins, so a reader holding a scope never sees it freed and a
  reader that lost the race gets a miss, never another scope's bytes.
"""

from __future__ import annotations

import operator
import threading
import time
from collections import OrderedDict
from dataclasses import dataclass
from functools import partial
from itertools import takewhile
from typing import Iterable, Optional, Sequence

import numpy as np

from flatcake.gva.placement import ReuseScope


class SessionScope:
    """A session's pages on one medium: the unit of placement and of reclaim.

    Attributes:
        scope_id: unique id (monotonic).
        medium: 0 DRAM / 1 SSD; fixed for the scope's life.
        reuse: the :class:`ReuseScope` it was opened as.
        turn: the session's turn (1 for a new session; bumped by hit queries that reach the tail).
        prev_turn_tokens / cur_turn_tokens: tokens appended in the previous / current turn.
        keys: every published key, in write order.
        extents: SSD extents owned (``flatcake.media.ssd.Extent``), in order.
        slots: DRAM slot numbers owned (each slot has exactly one owning scope).
        tail_key: the last key of the session's chain (the next round joins here), or None.
        tail_offset: SSD: next free byte inside ``extents[-1]``.
        round_seq: SSD: sequence number of the next round.
        rounds: SSD: the journal entries of its published rounds (for journal compaction).
        nbytes: bytes of medium held.
        doomed: cleared or dropped while a reader pinned it: unpublished already, freed when
            its last pin goes (:meth:`~flatcake.gva.scopes.ScopeTable.unpin`).
        last_used_s: ``time.monotonic()`` of the last read or write (reclaim picks the oldest).
        keep_on_disk: dropped because its pool file was taken out of service, not because its
            bytes went: freeing it writes no ``RETIRE``, so a restart may serve it again.
    """

    __slots__ = (
        "scope_id", "medium", "reuse", "turn", "prev_turn_tokens", "cur_turn_tokens", "keys",
        "extents", "slots", "tail_key", "tail_offset", "round_seq", "rounds", "nbytes",
        "last_used_s", "_refs", "_lock", "retired", "doomed", "keep_on_disk",
    )

    def __init__(self, scope_id: int, medium: int, reuse: ReuseScope, turn: int = 1, prev_turn_tokens: Optional[int] = None):
        self.scope_id = scope_id
        self.medium = medium
        self.reuse = reuse
        self.turn = turn
        self.prev_turn_tokens = prev_turn_tokens
        self.cur_turn_tokens = 0
        self.keys: list[str] = []
        self.extents: list = []
        self.slots: list[int] = []
        self.tail_key: Optional[str] = None
        self.tail_offset = 0  # SSD: next free byte inside extents[-1]
        self.round_seq = 0
        self.rounds: list = []
        self.nbytes = 0
        self.last_used_s = time.monotonic()
        self._refs = 0
        self._lock = threading.Lock()
        self.retired = False
        self.doomed = False
        self.keep_on_disk = False

    def try_acquire(self, n: int = 1) -> bool:
        """Pin the scope ``n`` times (``n >= 1``: one pin per page a read holds) for
        reading/writing. False, and no pin, if it was retired (treat as a miss)."""
        with self._lock:
            if self.retired:
                return False
            self._refs += n
            return True

    def release(self, n: int = 1) -> None:
        """Drop ``n`` pins taken by :meth:`try_acquire`."""
        with self._lock:
            self._refs -= n
        self.last_used_s = time.monotonic()

    @property
    def refcount(self) -> int:
        return self._refs

    def try_retire(self) -> bool:
        """Mark retired if nobody holds a pin; afterwards every :meth:`try_acquire` fails."""
        with self._lock:
            if self._refs or self.retired:
                return False
            self.retired = True
            return True

    def force_retire(self) -> None:
        """Refuse new pins even if some are held (a follower mirroring a scope the writer
        retired: readers inside it finish and their checksums catch reused bytes)."""
        with self._lock:
            self.retired = True

    def new_turn(self) -> None:
        """A new request of this session reached its tail: turn + 1."""
        self.turn += 1
        self.prev_turn_tokens = self.cur_turn_tokens
        self.cur_turn_tokens = 0


@dataclass(frozen=True, slots=True)
class PageEntry:
    """Immutable index entry of one published page.

    Attributes:
        gva: 64-bit address of the page's layer-0 chunk.
        scope: owning scope (pin it before touching the bytes).
        layer_stride: bytes from layer ``l``'s chunk to layer ``l+1``'s (SSD: round pages ×
            chunk bytes; DRAM: chunk bytes).
        checksums: SSD: uint64 ``[2 * layers]``, xxh3-64 of each chunk then its device checksum
            (record v3, :mod:`flatcake.kernels.device_checksum`), or ``[layers]`` xxh3 only (rounds
            of record v2); ``None`` (DRAM).
        verify: always check the checksums on read, whatever ``cio.verify_checksums`` says
            (pages rebuilt at start-up, whose bytes this process did not write).
        generation: SSD: the generation of the pool file the page was written under; a read
            after the file was reset (removed or truncated behind the backend, taken out of
            service) is a miss, whatever its bytes.
    """

    gva: int
    scope: SessionScope
    layer_stride: int
    checksums: Optional[np.ndarray] = None
    verify: bool = False
    generation: int = 0


class GvaIndex:
    """The first-level key -> :class:`PageEntry` map plus the live scope table.

    Writers (methods suffixed ``_locked``) must hold :attr:`lock`; :meth:`get` and
    :meth:`contains` take no lock.
    """

    def __init__(self):
        self.lock = threading.RLock()
        self._map: dict[str, PageEntry] = {}
        self.scopes: "OrderedDict[int, SessionScope]" = OrderedDict()
        self.tails: dict[str, SessionScope] = {}
        self._next_scope = 1

    # readers --------------------------------------------------------------
    def get(self, key: str) -> Optional[PageEntry]:
        """Lock-free lookup."""
        return self._map.get(key)

    def contains(self, key: str) -> bool:
        """Lock-free membership test."""
        return key in self._map

    def leading_entries(self, keys: Iterable[str]) -> list[PageEntry]:
        """Lock-free: the entries of ``keys`` up to the first key not published (one
        ``dict.get`` each, stopping there; the loop runs in C)."""
        return list(takewhile(_is_entry, map(self._map.get, keys)))

    def __len__(self) -> int:
        return len(self._map)

    # writers --------------------------------------------------------------
    def open_scope_locked(self, medium: int, reuse: ReuseScope, turn: int = 1, prev_turn_tokens: Optional[int] = None,
                          scope_id: Optional[int] = None) -> SessionScope:
        """Add a new scope to the table. ``scope_id`` reuses an id written on disk (restart
        rebuild); new ids are always above every id used so far."""
        sid = self._next_scope if scope_id is None else scope_id
        s = SessionScope(sid, medium, reuse, turn, prev_turn_tokens)
        self._next_scope = max(self._next_scope, sid + 1)
        self.scopes[s.scope_id] = s
        return s

    def reserve_scope_ids_locked(self, above: int) -> None:
        """New scope ids start above ``above`` (ids found in the pool journal)."""
        self._next_scope = max(self._next_scope, above + 1)

    def publish_locked(self, keys: Iterable[str], entries: Iterable[PageEntry]) -> None:
        """Make entries visible. Call only after their bytes are written."""
        for k, e in zip(keys, entries):
            self._map[k] = e
            e.scope.keys.append(k)

    def set_tail_locked(self, scope: SessionScope, key: str) -> None:
        if scope.tail_key is not None and self.tails.get(scope.tail_key) is scope:
            del self.tails[scope.tail_key]
        scope.tail_key = key
        self.tails[key] = scope

    def hide_scope_locked(self, scope: SessionScope) -> int:
        """Remove a scope's keys (and tail) from the index, keeping it in the scope table;
        returns how many keys were removed."""
        n = 0
        for k in scope.keys:
            e = self._map.get(k)
            if e is not None and e.scope is scope:
                del self._map[k]
                n += 1
        if scope.tail_key is not None and self.tails.get(scope.tail_key) is scope:
            del self.tails[scope.tail_key]
        return n

    def unpublish_pages_locked(self, scope: SessionScope, lost) -> int:
        """Remove the keys of ``scope`` whose entry ``lost(entry)`` says is gone (their bytes
        were on a failed drive), from the index and from ``scope.keys``; the scope, its other
        pages and its tail stay. Returns how many keys were removed."""
        keep, n = [], 0
        for k in scope.keys:
            e = self._map.get(k)
            if e is not None and e.scope is scope and lost(e):
                del self._map[k]
                n += 1
            else:
                keep.append(k)
        scope.keys = keep
        return n

    def unpublish_scope_locked(self, scope: SessionScope) -> int:
        """Remove every key of a retired scope and the scope itself; returns keys removed."""
        n = self.hide_scope_locked(scope)
        self.scopes.pop(scope.scope_id, None)
        return n

    def oldest_scopes_locked(self, medium: int) -> list[SessionScope]:
        """Live scopes of ``medium``, least recently used first."""
        return sorted((s for s in self.scopes.values() if s.medium == medium), key=lambda s: (s.last_used_s, s.scope_id))


_is_entry = partial(operator.is_not, None)


def scope_runs(entries: Sequence) -> list[tuple[SessionScope, int]]:
    """``(scope, count)`` of each run of consecutive ``entries`` (anything with a ``scope``) of
    one scope, in order: a read of a session's prefix is a few runs of many pages."""
    scopes = [e.scope for e in entries]
    if not scopes or scopes.count(scopes[0]) == len(scopes):  # one scope (identity first, in C)
        return [(scopes[0], len(scopes))] if scopes else []
    runs, start = [], 0
    for i in range(1, len(scopes) + 1):
        if i == len(scopes) or scopes[i] is not scopes[start]:
            runs.append((scopes[start], i - start))
            start = i
    return runs


def pin_entries(entries: Sequence) -> int:
    """Pin the scope of each of ``entries`` once per entry, run by run (:func:`scope_runs`, one
    :meth:`SessionScope.try_acquire` of the run's length each), up to the first retired scope.
    Returns ``n``: ``entries[:n]`` are pinned (release each with :meth:`SessionScope.release`),
    none after them. The same pins, page for page, as one ``try_acquire`` per entry."""
    n = 0
    for scope, k in scope_runs(entries):
        if not scope.try_acquire(k):
            break
        n += k
    return n


class KeyClaims:
    """Keys a put is writing now, so that two puts of the same new keys write them once.

    A put claims its new keys before placing them (:meth:`claim`) and releases them once they
    are published or the put failed (:meth:`release`); a put that finds keys claimed by another
    waits for that put first. Thread-safe; never held across I/O by the claimer's waiters.

    Args:
        index: the index whose published keys need no claim.
    """

    def __init__(self, index: GvaIndex):
        self.index = index
        self._claims: dict[str, threading.Event] = {}
        self._lock = threading.Lock()

    def claim(self, keys: Sequence[str], wait_s: float = 60.0) -> list[str]:
        """Claim the keys of ``keys`` that are neither published nor claimed by another put,
        after waiting (up to ``wait_s`` seconds, then going ahead) for the puts that hold some
        of them. Returns the claimed keys, in order, each once."""
        deadline = time.monotonic() + wait_s
        while True:
            with self._lock:
                busy = [self._claims[k] for k in keys if k in self._claims]
                if not busy or time.monotonic() >= deadline:
                    mine = [k for k in dict.fromkeys(keys) if not self.index.contains(k) and k not in self._claims]
                    ev = threading.Event()  # one per claim, shared by its keys (an Event costs ~0.1 ms)
                    for k in mine:
                        self._claims[k] = ev
                    return mine
            busy[0].wait(max(0.0, deadline - time.monotonic()))

    def release(self, keys: Sequence[str]) -> None:
        """End this put's claim on ``keys`` (written or not) and wake the puts waiting for them."""
        with self._lock:
            events = {id(ev): ev for ev in (self._claims.pop(k) for k in keys if k in self._claims)}
        for ev in events.values():  # a waiter woken while other keys of its claim remain re-checks them
            ev.set()
