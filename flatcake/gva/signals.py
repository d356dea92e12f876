"""Placement signals derived from SGLang's hit queries (paper Table 2, FC-GVA).

SGLang's backend sees only page keys, so two Table 2 signals come from the hit queries
(``batch_exists``) that precede the writes:

* :class:`InterestCounter` — a page that several requests asked for before it was written has
  prefix reference count > 1: a shared prompt;
* :class:`RequeryFilter` — SGLang re-issues a request's hit query (a prefetch retried or
  re-queued); a re-issued query must count once, or one retry would turn a one-shot prompt
  into a "shared" one and make a first turn look like a later one.

Session scope and turn from the key chain (SGLang passes ``extra_info.prefix_keys`` when
``hicache_storage_pass_prefix_keys`` is true; every key already hashes its whole prefix):

* the *parent* of a round is the key just before its first page (the previous key in the
  call, else ``prefix_keys[-1]``);
* a round whose parent is a scope's tail joins that scope (same medium; later turns of a
  session stay together); any other round opens a new scope, inheriting the parent scope's
  turn if the parent is stored;
* a hit query whose stored run ends on a scope's tail and continues with new keys is a new
  request of that session: the scope's turn is incremented (:meth:`~flatcake.gva.scopes.ScopeTable.note_hit_query`).
  When nothing of the query is stored, the key before its first key is ``prefix_keys[-1]``, and
  SGLang 0.5.23 gives a hit query only the keys before the radix node its device/host match ends
  in (``None`` when there are none; backups get them all): such a query's first key is
  remembered (:class:`TurnStarts`) and the turn is incremented when that page is backed up into
  a round whose parent is a scope's tail;
* "reply tokens" is measured as tokens appended to the scope in the current turn (SGLang's
  backend cannot tell prompt from reply pages);
* prefix reference count = hit queries that asked for a page before it was written, the
  writer included (:class:`InterestCounter`).

A DRAM scope whose next round is placed on SSD (context grew past ``L_agent``, or DRAM full)
continues in a new SSD scope; pages already written never move.
"""

from __future__ import annotations

import threading
import time
from collections import OrderedDict
from typing import Optional, Sequence


class RequeryFilter:
    """Remembers hit-query signatures for ``window_s`` seconds (at most ``capacity`` of them).

    A signature is (key before the query, first key, last key, number of keys). Keys hash their
    whole prefix, so two requests that share only a prompt prefix differ in their last key; a
    re-issued query of the same request is identical. Two requests with exactly the same
    prompt inside the window also count once (the cost: a shared prompt is seen one request
    later).

    Args:
        window_s: seconds a signature is remembered (0 disables the filter).
        capacity: signatures kept at most (the oldest go first).
    """

    def __init__(self, window_s: float, capacity: int = 1 << 16):
        self.window_s = window_s
        self.capacity = capacity
        self._seen: "OrderedDict[tuple, float]" = OrderedDict()
        self._lock = threading.Lock()

    def seen(self, keys: Sequence[str], prefix_keys: Optional[Sequence[str]]) -> bool:
        """True if this query was seen within the window; else remember it and return False."""
        if self.window_s <= 0 or not keys:
            return False
        sig = (prefix_keys[-1] if prefix_keys else None, keys[0], keys[-1], len(keys))
        now = time.monotonic()
        with self._lock:
            t = self._seen.get(sig)
            if t is not None and now - t < self.window_s:
                return True
            self._seen[sig] = now
            self._seen.move_to_end(sig)
            while self._seen and (len(self._seen) > self.capacity or now - next(iter(self._seen.values())) >= self.window_s):
                self._seen.popitem(last=False)
        return False


class TurnStarts:
    """First keys of hit queries of which nothing was stored (bounded FIFO set): whether such a
    request continues a session is known only once its first page is backed up (module
    docstring). At most ``capacity`` keys are remembered (the oldest go first)."""

    def __init__(self, capacity: int = 1 << 16):
        self.capacity = capacity
        self._keys: "OrderedDict[str, None]" = OrderedDict()
        self._lock = threading.Lock()

    def note(self, key: str) -> None:
        with self._lock:
            self._keys[key] = None
            self._keys.move_to_end(key)
            while len(self._keys) > self.capacity:
                self._keys.popitem(last=False)

    def take(self, key: str) -> bool:
        """True (once) if ``key`` was noted and not taken since."""
        with self._lock:
            if key in self._keys:
                del self._keys[key]
                return True
            return False


class InterestCounter:
    """How many hit queries asked for a key that was not stored yet (bounded FIFO map).

    A page that several requests wanted before it was written has prefix reference count > 1
    (a shared prompt, Table 2). At most ``per_query`` keys are counted per query and at most
    ``capacity`` keys are remembered.
    """

    def __init__(self, capacity: int = 1 << 20, per_query: int = 256):
        self.capacity = capacity
        self.per_query = per_query
        self._m: "OrderedDict[str, int]" = OrderedDict()
        self._lock = threading.Lock()

    def note_missing(self, keys: list[str]) -> None:
        with self._lock:
            for k in keys[: self.per_query]:
                self._m[k] = self._m.get(k, 0) + 1
            while len(self._m) > self.capacity:
                self._m.popitem(last=False)

    def take(self, keys: list[str]) -> int:
        """Largest count over ``keys`` (forgetting them); at least 1 (the writer)."""
        best = 1
        with self._lock:
            for k in keys:
                c = self._m.pop(k, 0)
                if c > best:
                    best = c
        return best
