"""Warm restart: rebuild the index from the pool journal and the self-describing rounds (§3.1, §3.3).

A store that opens a pool it wrote before (a server restart, SGLang's detach/attach in the same
process, a crash) serves every committed SSD page again. Lifecycle::

    replay the journal       ROUND entries in order; a RETIRE drops its scope's rounds
    read headers + records   per live round: one 4 KiB header read and one record read
                             (threads; never the data, never a directory listing);
                             a round counts only if header and record are intact and agree with
                             the journal entry (scope id, sequence number, nonce, geometry,
                             namespace); a torn or overwritten round is dropped
    claim the space          newest scope first, each extent's range marked used; a scope whose
                             range another (newer) scope already holds is stale and dropped
    publish                  keys -> PageEntry with ``verify=True``: their checksums are checked
                             on every read, since this process did not write the bytes
    compact the journal      the caller rewrites it with the live rounds

DRAM pages are not recovered (the DRAM region does not outlive the process).
"""

from __future__ import annotations

import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Optional

from flatcake.errorlog import ErrorLog
from flatcake.gva.address import MEDIUM_SSD, encode_gva
from flatcake.gva.index import GvaIndex, PageEntry
from flatcake.gva.journal import RETIRE, ROUND, JournalEntry, read_journal
from flatcake.gva.placement import reuse_of
from flatcake.layout import PageGeometry
from flatcake.media import extent as fmt
from flatcake.media.ssd import Extent, SsdFilePool

#: threads reading round headers and records at start-up
REBUILD_THREADS = 8


@dataclass(frozen=True)
class RebuildReport:
    """What a restart recovered.

    Attributes:
        journal_entries: entries read from the journal.
        rounds: live rounds recovered.
        rounds_dropped: live rounds not recovered (torn, overwritten, foreign, out of range).
        scopes: scopes recovered.
        scopes_dropped: scopes whose space a newer scope holds (stale journal entries).
        pages: pages published again.
        seconds: wall time of the rebuild.
    """

    journal_entries: int = 0
    rounds: int = 0
    rounds_dropped: int = 0
    scopes: int = 0
    scopes_dropped: int = 0
    pages: int = 0
    seconds: float = 0.0


def live_rounds(entries: list[JournalEntry]) -> dict[int, list[JournalEntry]]:
    """Scope id -> its ``ROUND`` entries in journal order, for scopes not retired afterwards
    (the dict is ordered by each scope's first entry)."""
    scopes: dict[int, list[JournalEntry]] = {}
    for e in entries:
        if e.kind == ROUND:
            scopes.setdefault(e.scope_id, []).append(e)
        elif e.kind == RETIRE:
            scopes.pop(e.scope_id, None)
    return scopes


def read_round(ssd: SsdFilePool, e: JournalEntry, ns_digest: bytes, geometry: PageGeometry) -> Optional[fmt.RoundRecord]:
    """The record of the round journal entry ``e`` points at, if that round is intact and is the
    one the entry names; else None.

    Reads the 4 KiB round header and the record only. Checks: header and record validate
    (xxh3), agree with each other and with ``e`` (scope id, sequence number, nonce, round
    bytes), have this store's geometry, and the record names this namespace.

    Raises:
        OSError: the pool file cannot be read (a missing file is a plain None).
    """
    if e.file_index >= ssd.max_files or e.round_offset + fmt.BLOCK > ssd.file_bytes:
        return None
    try:
        hdr = fmt.unpack_round_header(ssd.read_at(e.file_index, e.round_offset, fmt.BLOCK))
    except FileNotFoundError:
        return None
    if hdr is None or (hdr.scope_id, hdr.seq, hdr.nonce) != (e.scope_id, e.seq, e.nonce):
        return None
    lay = hdr.layout
    if (lay.layers, lay.chunk_bytes) != (geometry.layers, geometry.chunk_bytes) or lay.total_bytes != e.round_bytes:
        return None
    if e.round_offset + lay.total_bytes > ssd.file_bytes:
        return None
    rec = fmt.unpack_record(ssd.read_at(e.file_index, e.round_offset + lay.record_offset, lay.record_bytes))
    if rec is None or rec.ns_digest != ns_digest or not rec.matches(hdr):
        return None
    return rec


def round_entries(rec: fmt.RoundRecord, e: JournalEntry, scope, ssd: SsdFilePool, node: int) -> list[PageEntry]:
    """The index entries of a recovered round's pages (checked on every read)."""
    n, cb = len(rec.keys), rec.chunk_bytes
    base = e.file_index * ssd.file_bytes + e.round_offset + fmt.BLOCK
    gen = ssd.generation_of(e.file_index)
    return [PageEntry(encode_gva(MEDIUM_SSD, node, base + p * cb), scope, n * cb, rec.checksums[:, p].copy(), True, gen)
            for p in range(n)]


def _claim_extents(ssd: SsdFilePool, rounds: list[tuple[JournalEntry, fmt.RoundRecord]]) -> Optional[list[Extent]]:
    """Mark the extents of a scope's valid rounds used (extent header block to the end of its
    last valid round). None, with nothing claimed, when any of it is already used."""
    ends: dict[tuple[int, int], int] = {}
    for e, _ in rounds:
        k = (e.file_index, e.extent_offset)
        ends[k] = max(ends.get(k, 0), e.round_offset + e.round_bytes)
    exts = [Extent(f, off, end - off) for (f, off), end in ends.items()]
    taken: list[Extent] = []
    for x in exts:
        if not ssd.take_locked(x.file_index, x.offset, x.nbytes):
            for t in taken:
                ssd.free_locked(t)
            return None
        taken.append(x)
    return taken


def rebuild_locked(index: GvaIndex, ssd: SsdFilePool, namespace: str, geometry: PageGeometry, node: int,
                   errors: ErrorLog) -> RebuildReport:
    """Rebuild ``index`` (empty) and ``ssd``'s allocator from the pool journal. Writer lock held.

    Returns:
        A :class:`RebuildReport`; the recovered scopes are in ``index.scopes`` with their
        ``rounds`` (journal entries) set, for the caller's journal compaction.

    Never raises for what it finds on disk: an unreadable round is dropped (logged once).
    """
    t0 = time.perf_counter()
    try:
        entries = read_journal(ssd.journal_path)
    except OSError as err:
        errors("journal read", err)
        entries = []
    if entries:
        index.reserve_scope_ids_locked(max(e.scope_id for e in entries))
    scopes = live_rounds(entries)
    flat = [e for es in scopes.values() for e in es]
    digest = fmt.namespace_digest(namespace)

    def one(e: JournalEntry):
        try:
            return read_round(ssd, e, digest, geometry)
        except OSError as err:
            errors("rebuild read", err)
            return None

    with ThreadPoolExecutor(max_workers=REBUILD_THREADS) as ex:
        recs = dict(zip(map(id, flat), ex.map(one, flat)))
    rounds = scopes_dropped = pages = 0
    order = list(scopes.items())[::-1]  # newest first: a stale older scope loses its overlapping space
    now = time.monotonic()
    for rank, (sid, es) in enumerate(order):
        valid = [(e, recs[id(e)]) for e in es if recs[id(e)] is not None]
        if not valid:
            continue
        extents = _claim_extents(ssd, valid)
        if extents is None:
            scopes_dropped += 1
            continue
        valid.sort(key=lambda er: er[0].seq)
        first = valid[0][0]
        scope = index.open_scope_locked(MEDIUM_SSD, reuse_of(first.reuse), scope_id=sid)
        scope.extents = sorted(extents, key=lambda x: (x.file_index, x.offset))
        scope.nbytes = sum(x.nbytes for x in extents)
        last_e, last_rec = valid[-1]
        last_ext = next(x for x in extents if (x.file_index, x.offset) == (last_e.file_index, last_e.extent_offset))
        scope.extents.remove(last_ext)
        scope.extents.append(last_ext)  # the extent that holds the last round is the tail extent
        scope.tail_offset = last_e.round_offset + last_e.round_bytes
        scope.round_seq = last_e.seq + 1
        scope.last_used_s = now - rank * 1e-6  # keeps the journal's recency order for reclaim
        for e, rec in valid:
            fresh = [(k, pe) for k, pe in zip(rec.keys, round_entries(rec, e, scope, ssd, node))
                     if not index.contains(k)]
            index.publish_locked([k for k, _ in fresh], [pe for _, pe in fresh])
            pages += len(fresh)
            scope.rounds.append(e)
        index.set_tail_locked(scope, last_rec.keys[-1])
        rounds += len(valid)
    return RebuildReport(journal_entries=len(entries), rounds=rounds, rounds_dropped=len(flat) - rounds,
                         scopes=len(index.scopes), scopes_dropped=scopes_dropped, pages=pages,
                         seconds=time.perf_counter() - t0)


__all__ = ["REBUILD_THREADS", "RebuildReport", "live_rounds", "read_round", "rebuild_locked", "round_entries"]
