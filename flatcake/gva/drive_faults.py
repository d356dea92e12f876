"""A failed drive takes only its own pages with it (several NVMe drives, :mod:`flatcake.media.drives`).

A session scope's extents go round-robin over the drives, so nearly every scope that is more
than one round long has bytes on every drive. Dropping every scope that touches a failed drive
(what a single pool file's fault does, :meth:`ScopeTable.drop_file_scopes_locked`) would empty
the whole cache when one drive of eight fails. So with several drives a fault drops *pages*:

* every page whose bytes were in one of the failed files is unpublished (a miss from now on;
  a reader that already holds its entry fails it by generation, the file's generation was
  bumped), and the scope's extents and journal rounds in those files are forgotten;
* the scope's other pages keep serving. A hit query's leading run stops at the first lost
  page; the next backup of that request writes the lost pages again (into a new scope, since
  they no longer end a chain), and the pages after them are found again, so the whole prefix
  hits once more;
* a scope whose last extent was lost never appends into another extent's space: its next round
  opens a new extent (on a drive in service);
* a scope left with no page is dropped whole (freed now, or when its last pin goes).

The journal is not written: a round on a drive that only refused writes may be served again
after a restart if its record and checksums are intact; one whose file was removed is not.
"""

from __future__ import annotations

from typing import Iterable

from flatcake.gva.address import MEDIUM_SSD, OFFSET_MASK, medium_of


def drop_pages_in_files_locked(table, files: Iterable[int]) -> int:
    """Unpublish every page stored in pool files ``files`` and forget the scopes' extents and
    rounds there, keeping each scope's other pages (see the module docstring). Writer lock held.

    Args:
        table: the :class:`~flatcake.gva.scopes.ScopeTable`.
        files: pool file indices whose bytes are lost or out of service.

    Returns:
        Pages unpublished.
    """
    files = set(files)
    index, fb = table.index, table.ssd.file_bytes

    def lost(e) -> bool:
        return medium_of(e.gva) == MEDIUM_SSD and (e.gva & OFFSET_MASK) // fb in files

    dropped = 0
    for scope in [s for s in index.scopes.values() if any(x.file_index in files for x in s.extents)]:
        dropped += index.unpublish_pages_locked(scope, lost)
        tail_lost = scope.extents[-1].file_index in files
        gone = [x for x in scope.extents if x.file_index in files]
        scope.extents = [x for x in scope.extents if x.file_index not in files]
        scope.nbytes -= sum(x.nbytes for x in gone)
        if tail_lost:  # never append at an offset that was meant for the lost extent
            scope.tail_offset = scope.extents[-1].end if scope.extents else 0
        kept = [r for r in scope.rounds if r.file_index not in files]
        table.live_rounds -= len(scope.rounds) - len(kept)
        scope.rounds = kept
        if not scope.keys:
            table.drop_locked(scope)
    return dropped


__all__ = ["drop_pages_in_files_locked"]
