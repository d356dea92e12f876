"""Follower mirroring: how a non-writer MLA TP rank sees the writer's pages (paper §3.1 index).

The writer rank appends a ``ROUND`` entry to the pool journal after each SSD round is written
and a ``RETIRE`` entry before it frees a scope (:mod:`flatcake.gva.journal`). A follower rank
calls :meth:`FollowerMirror.sync` before each hit query and read: it reads the new entries,
reads each new round's record (never its data) from the shared pool file and checks them against
the entry exactly as a restart does (:func:`flatcake.gva.rebuild.read_round`), then publishes
the round's keys in its own index under a mirror scope; a retired scope is forced out of the
index. When the writer compacts the journal (or restarts) the follower starts over from the
compacted journal, which holds only the live rounds: a mirrored scope all of whose rounds
reappear in it, with the same (scope id, sequence number, nonce), is kept as it is (no record
is read again, so a compaction costs the follower one read of the journal); any other is
forgotten and its rounds mirrored afresh. A follower never writes.

Lifecycle of a mirrored scope::

    ROUND (first of a scope id)  -> open mirror scope, publish keys
    ROUND (later)                -> publish keys, move the tail
    RETIRE                       -> force-retire (no new pins) and unpublish
    journal rewritten            -> kept if every round it mirrored is still in the journal,
                                    else force-retired, unpublished and mirrored afresh

A round the writer reclaimed and reused before the follower saw its ``RETIRE`` may be read by
the follower: followers always verify checksums, so such a read is a miss, never other bytes.
"""

from __future__ import annotations

from flatcake.common.errorlog import ErrorLog
from flatcake.gva.address import MEDIUM_SSD
from flatcake.gva.index import GvaIndex, SessionScope
from flatcake.gva.journal import RETIRE, ROUND, JournalEntry, JournalReader
from flatcake.gva.placement import reuse_of
from flatcake.gva.rebuild import read_round, round_entries
from flatcake.common.layout import PageGeometry
from flatcake.media import extent as fmt
from flatcake.media.ssd import SsdFilePool


class FollowerMirror:
    """Mirrors the writer rank's published SSD rounds into a follower's index.

    Args:
        index: the follower's index (written under ``index.lock``).
        journal: the reader side of the writer's scope journal.
        ssd: the (shared) SSD pool, opened in follower mode.
        geometry: page geometry; rounds of another geometry are ignored.
        namespace: the namespace; records of another namespace are ignored.
        node: GVA node field of the published addresses.
        errors: the store's error-once log.
    """

    def __init__(self, index: GvaIndex, journal: JournalReader, ssd: SsdFilePool, geometry: PageGeometry,
                 namespace: str, node: int, errors: ErrorLog):
        self.index = index
        self.journal = journal
        self.ssd = ssd
        self.geometry = geometry
        self.ns_digest = fmt.namespace_digest(namespace)
        self.node = node
        self.errors = errors
        self._scopes: dict[int, SessionScope] = {}  # writer scope id -> mirror scope
        self._rounds: dict[int, set[tuple[int, int]]] = {}  # writer scope id -> its mirrored (seq, nonce)

    def sync(self) -> None:
        """Apply the journal entries appended since the last call (one ``stat`` when nothing
        is new). Takes the writer lock. Never raises: a failure leaves fewer pages visible."""
        try:
            with self.index.lock:
                restarted, entries = self.journal.poll()
                known: set[tuple[int, int, int]] = set()
                if restarted:
                    known = self._keep_unchanged_locked(entries)
                for e in entries:
                    if e.kind == ROUND:
                        if (e.scope_id, e.seq, e.nonce) not in known:
                            self._mirror_round_locked(e)
                    elif e.kind == RETIRE and e.scope_id in self._scopes:
                        self._forget_locked(self._scopes.pop(e.scope_id))
                        self._rounds.pop(e.scope_id, None)
        except Exception as err:  # never into SGLang: the follower just sees fewer pages
            self.errors("journal sync", err)

    def _keep_unchanged_locked(self, entries: list[JournalEntry]) -> set[tuple[int, int, int]]:
        """The journal was rewritten: keep each mirrored scope whose rounds all reappear in
        ``entries`` (same scope id, sequence number and nonce: the same bytes on disk), forget
        the others. Returns the ``(scope id, seq, nonce)`` of the kept rounds (not read again)."""
        now: dict[int, set[tuple[int, int]]] = {}
        for e in entries:
            if e.kind == ROUND:
                now.setdefault(e.scope_id, set()).add((e.seq, e.nonce))
        known = set()
        for sid, scope in list(self._scopes.items()):
            mine = self._rounds.get(sid, set())
            if mine and mine <= now.get(sid, set()) and not scope.retired and not scope.doomed:
                known.update((sid, seq, nonce) for seq, nonce in mine)
                continue
            self._forget_locked(scope)
            del self._scopes[sid]
            self._rounds.pop(sid, None)
        return known

    def _forget_locked(self, scope: SessionScope) -> None:
        scope.force_retire()
        self.index.unpublish_scope_locked(scope)

    def _mirror_round_locked(self, e: JournalEntry) -> None:
        """Read round ``e``'s record and publish its keys. Writer lock held."""
        try:
            rec = read_round(self.ssd, e, self.ns_digest, self.geometry)
        except OSError as err:
            self.errors("journal round read", err)
            return
        if rec is None:
            return
        scope = self._scopes.get(e.scope_id)
        if scope is None or scope.retired or scope.doomed:  # (dropped here after a failed read: start anew)
            scope = self._scopes[e.scope_id] = self.index.open_scope_locked(MEDIUM_SSD, reuse_of(e.reuse))
            self._rounds[e.scope_id] = set()
        self._rounds[e.scope_id].add((e.seq, e.nonce))
        self.index.publish_locked(rec.keys, round_entries(rec, e, scope, self.ssd, self.node))
        self.index.set_tail_locked(scope, rec.keys[-1])

    def close(self) -> None:
        """Close the journal."""
        self.journal.close()
