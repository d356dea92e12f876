"""What a failed SSD read takes with it (paper §3.1: a page read back is the page written, or a miss).

A restore that cannot read a page intact (EIO, a short read, a checksum mismatch) must stop
promising what can no longer be served, and only that:

* **the failed round and the rounds after it in that session scope** are unpublished (their
  pages are misses from now on): a prefix hit stops at the failed page anyway, and the rounds
  after it extend that prefix. The rounds before it keep serving; so do the scope's space and
  its other sessions' scopes, and every round on another drive. The scope's chain is cut back to
  the page before the failed round, so the next backup of the lost pages appends to the same
  scope again. No ``RETIRE`` is journaled: a restart serves a round again only if its record and
  checksums verify (a transient fault), never wrong bytes;
* the failure **counts against the drive** (:meth:`flatcake.media.pool_faults.PoolFileFaults.note_read_failure_locked`):
  :data:`~flatcake.media.pool_faults.READ_FAILURES_OUT` failures within
  :data:`~flatcake.media.pool_faults.READ_FAILURE_WINDOW_S` take the drive out of service as a
  whole — only its pages dropped, the other drives keep serving and take the new rounds — until
  a probe of its files succeeds (the out-of-service retry reads and rewrites each file's first
  block).

Before this, a failed read dropped the whole scope, including rounds on healthy drives, and the
drive stayed in service, so the loss repeated on every cycle (issue 24 item 4).
"""

from __future__ import annotations

from flatcake.gva.address import MEDIUM_SSD, OFFSET_MASK, medium_of
from flatcake.gva.drive_faults import drop_pages_in_files_locked


def drop_from_failed_round_locked(table, entry) -> int:
    """Unpublish the page of ``entry`` (an SSD page that failed to read), every other page of its
    round and every page written after it in its scope; forget those rounds for journal
    compaction and cut the scope's chain back to the last page kept. Writer lock held.

    Args:
        table: the :class:`~flatcake.gva.scopes.ScopeTable`.
        entry: the index entry whose page failed (``entry.gva`` on SSD, ``entry.scope`` its scope).

    Returns:
        Pages unpublished (0 when the scope is retired or doomed already). A scope left with no
        page is dropped (freed now, or when its last pin goes).
    """
    scope = entry.scope
    if scope.retired or scope.doomed or medium_of(entry.gva) != MEDIUM_SSD:
        return 0
    fb = table.ssd.file_bytes
    off = entry.gva & OFFSET_MASK
    f, in_file = off // fb, off % fb
    failed = next((r for r in scope.rounds if r.file_index == f and r.round_offset <= in_file < r.round_offset + r.round_bytes),
                  None)
    index = table.index
    keys = scope.keys
    if failed is not None:  # the first key of the failed round: keys are in write order, rounds too
        first = next((i for i, k in enumerate(keys) if _in_round(index.get(k), failed, fb, scope)), None)
    else:  # no journal round found (a round not yet journaled): from the failed page on
        first = next((i for i, k in enumerate(keys) if index.get(k) is entry), None)
    if first is None:
        return 0
    # pages on SSD only: a page of a later round still in the write queue is not on disk yet (its
    # commit swaps its entry); it stays published, unreachable by a prefix until the lost pages return
    lost = {id(e) for e in map(index.get, keys[first:]) if e is not None and medium_of(e.gva) == MEDIUM_SSD}
    n = index.unpublish_pages_locked(scope, lambda e: id(e) in lost)
    if failed is not None:
        kept = [r for r in scope.rounds if r.seq < failed.seq]
        table.live_rounds -= len(scope.rounds) - len(kept)
        scope.rounds = kept
    scope.tail_key = scope.keys[-1] if scope.keys else None
    if not scope.keys:
        table.drop_locked(scope)
    return n


def _in_round(e, r, fb: int, scope) -> bool:
    """Whether index entry ``e`` (of ``scope``) has its bytes inside journal round ``r``."""
    if e is None or e.scope is not scope or medium_of(e.gva) != MEDIUM_SSD:
        return False
    off = e.gva & OFFSET_MASK
    return off // fb == r.file_index and r.round_offset <= off % fb < r.round_offset + r.round_bytes


def take_failing_drive_out_locked(table, file_index: int) -> None:
    """The drive of ``file_index`` failed reads past the threshold: with several drives, drop the
    pages stored on it (the other drives keep serving) and take it out of service; with one
    drive, take each of its files out of service (their scopes dropped, kept on disk for a
    restart that finds them intact). Writer lock held."""
    ssd = table.ssd
    drive = ssd.drive_of(file_index)
    if ssd.n_drives > 1:
        drop_pages_in_files_locked(table, ssd.drive_files(drive))
        ssd.take_drive_out_of_service_locked(drive, "fails reads")
        return
    for i in ssd.drive_files(drive):
        if i not in ssd.out_of_service:
            table.take_file_out_of_service_locked(i)


__all__ = ["drop_from_failed_round_locked", "take_failing_drive_out_locked"]
