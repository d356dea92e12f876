"""Session chains: where the direct linker's offloads are placed (paper §3.1, FC-GVA).

FC-GVA places a round of pages in the session scope whose tail is the round's parent key (the
key just before its first page), and Table 2 decides a new scope's medium from the context
length. Through HiCache FlatCake sees only SGLang's ``prefix_keys``; the linker's ``offload``
is told the session: ``session_id`` names the session whose insert produced the pages
(``UnifiedRadixCache.insert_session_id``).

So the linker keeps, per session, what a put reads of a request's prefix keys: how many pages
the session has offloaded (its context length) and the last of them (the tail its scope goes on
from). A session's next offload is put with that :class:`ChainTail` as its prefix keys: its
rounds join the session's scope and Table 2 sees the session's context length. Two sessions
interleaved stay in two scopes. Without a session id the offload's own key chain is all there
is: its first round has no parent and opens a scope by Table 2, and its later rounds follow it
(as the HiCache door does when SGLang passes no prefix keys).

Lifecycle::

    prefix(session_id)          the chain so far (None: no session id, or a new session)
    extend(session_id, keys)    after the offload's pages were stored
    clear()                     (reset)

At most :data:`MAX_SESSIONS` sessions are remembered (least recently offloaded dropped first;
one key and one count each); a dropped session's next offload opens a new scope, as a new
session would.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Sequence
from typing import Optional

#: sessions remembered at once (each holds one key and one count)
MAX_SESSIONS = 65536


class ChainTail(Sequence):
    """A session's key chain as :meth:`flatcake.store.page_store.PageStore.put` reads its prefix keys:
    ``len()`` is the pages offloaded for the session so far, ``[-1]`` the last of them (the
    parent of the next round). Earlier keys are not kept: indexing them raises IndexError.

    Args:
        tail: the session's last offloaded key.
        pages: pages offloaded for the session (>= 1).
    """

    __slots__ = ("tail", "pages")

    def __init__(self, tail: str, pages: int):
        self.tail, self.pages = tail, pages

    def __len__(self) -> int:
        return self.pages

    def __getitem__(self, i):
        if isinstance(i, int) and i in (-1, self.pages - 1):
            return self.tail
        raise IndexError(f"a session chain keeps only its last key (asked for {i!r} of {self.pages})")

    def __eq__(self, other) -> bool:
        return isinstance(other, ChainTail) and (self.tail, self.pages) == (other.tail, other.pages)

    def __repr__(self) -> str:
        return f"ChainTail({self.tail!r}, pages={self.pages})"


class SessionChains:
    """Per-session chain tails (thread-safe)."""

    def __init__(self, max_sessions: int = MAX_SESSIONS):
        self._max = max_sessions
        self._lock = threading.Lock()
        self._chains: OrderedDict[str, ChainTail] = OrderedDict()

    def prefix(self, session_id: Optional[str]) -> Optional[ChainTail]:
        """``session_id``'s :class:`ChainTail`, or None for no session id or a session with
        nothing offloaded yet."""
        if not session_id:
            return None
        with self._lock:
            return self._chains.get(session_id)

    def extend(self, session_id: Optional[str], keys: Sequence[str]) -> None:
        """Record ``keys`` (stored for ``session_id``, in chain order) as its chain's continuation;
        a no-op without a session id or keys."""
        if not session_id or not keys:
            return
        with self._lock:
            old = self._chains.pop(session_id, None)
            self._chains[session_id] = ChainTail(keys[-1], (old.pages if old else 0) + len(keys))
            while len(self._chains) > self._max:
                self._chains.popitem(last=False)

    def clear(self) -> None:
        """Forget every session."""
        with self._lock:
            self._chains.clear()

    def __len__(self) -> int:
        with self._lock:
            return len(self._chains)
