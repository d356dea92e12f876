"""Warm restart: rebuild the index from the pool journal and the self-describing rounds (§3.1, §3.3).

A store that opens a pool it wrote before (a server restart, SGLang's detach/attach in the same
process, a crash) serves every committed SSD page again. Lifecycle::

    replay the journal       ROUND entries in order; a RETIRE drops its scope's rounds; an
                             entry whose checksum fails is skipped (its round is not recovered)
    read records             per live round: one record read at the offset its entry gives
                             (threads; never the header, never the data, never a directory
                             listing); a round counts only if its record is intact and agrees with
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

import os
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Optional

from flatcake.common.align import align_up
from flatcake.common.errorlog import ErrorLog
from flatcake.gva.address import MEDIUM_SSD, encode_gva
from flatcake.gva.index import GvaIndex, PageEntry
from flatcake.gva.journal import RETIRE, ROUND, JournalEntry, read_journal
from flatcake.gva.placement import reuse_of
from flatcake.common.layout import PageGeometry
from flatcake.media import extent as fmt
from flatcake.media.directio import aligned_host_buffer
from flatcake.media.ssd import Extent, SsdFilePool

#: threads reading round records at start-up
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
    (the dict is ordered by each scope's last entry: least recently written scope first)."""
    scopes: dict[int, list[JournalEntry]] = {}
    for e in entries:
        if e.kind == ROUND:
            es = scopes.pop(e.scope_id, [])
            es.append(e)
            scopes[e.scope_id] = es
        elif e.kind == RETIRE:
            scopes.pop(e.scope_id, None)
    return scopes


def read_round(ssd: SsdFilePool, e: JournalEntry, ns_digest: bytes, geometry: PageGeometry,
               read=None) -> Optional[fmt.RoundRecord]:
    """The record of the round journal entry ``e`` points at, if that round is intact and is the
    one the entry names; else None.

    Reads the record only — one read, at the offset the entry gives, through
    ``read(file, offset, nbytes)`` (default :meth:`SsdFilePool.read_at`); never the data. The
    record carries everything the round header does: it must validate (xxh3-64), name this
    namespace, and agree with ``e`` (scope id, sequence number, nonce) and with this store's
    geometry, and its page count must give exactly the data size that puts the record where
    the entry says. The round's data is checked later, by each read (``verify=True``).

    Raises:
        OSError: the pool file cannot be read (a missing file is a plain None).
    """
    end = e.round_offset + e.round_bytes
    if e.file_index >= ssd.max_files or end > ssd.file_bytes or e.record_bytes <= 0:
        return None
    read = read or ssd.read_at
    try:
        rec = fmt.unpack_record(read(e.file_index, e.round_offset + e.record_offset, e.record_bytes))
    except FileNotFoundError:
        return None
    if rec is None or rec.ns_digest != ns_digest or (rec.scope_id, rec.seq, rec.nonce) != (e.scope_id, e.seq, e.nonce):
        return None
    lay = fmt.round_layout(rec.keys, rec.layers, rec.chunk_bytes)
    if (rec.layers, rec.chunk_bytes) != (geometry.layers, geometry.chunk_bytes) or \
            (lay.record_offset, lay.record_bytes) != (e.record_offset, e.record_bytes):
        return None
    return rec


def round_entries(rec: fmt.RoundRecord, e: JournalEntry, scope, ssd: SsdFilePool, node: int) -> list[PageEntry]:
    """The index entries of a recovered round's pages (checked on every read)."""
    n, cb = len(rec.keys), rec.chunk_bytes
    base = e.file_index * ssd.file_bytes + e.round_offset + fmt.BLOCK
    gen = ssd.generation_of(e.file_index)
    return [PageEntry(encode_gva(MEDIUM_SSD, node, base + p * cb), scope, n * cb, rec.page_checksums(p), True, gen)
            for p in range(n)]


def _read_rounds(ssd: SsdFilePool, flat: list[JournalEntry], digest: bytes, geometry: PageGeometry,
                 errors: ErrorLog) -> dict[int, Optional[fmt.RoundRecord]]:
    """``id(entry) -> record or None`` for every entry: records read by
    :data:`REBUILD_THREADS` threads in file-offset order, through one descriptor per file."""
    fds: dict[int, int] = {}
    direct = os.O_DIRECT if ssd.direct_io and hasattr(os, "O_DIRECT") else 0
    for f in sorted({e.file_index for e in flat}):
        try:
            fds[f] = os.open(ssd.path_of(f), os.O_RDONLY | getattr(os, "O_CLOEXEC", 0) | direct)
        except OSError:
            pass  # a missing file: its rounds are dropped
    local = threading.local()

    def read(f: int, off: int, n: int) -> bytes:
        """``n`` bytes at ``off`` (4 KiB aligned: records are) with O_DIRECT when the
        filesystem takes it: no read-ahead of the data around them."""
        fd = fds.get(f)
        if fd is None:
            raise FileNotFoundError(f)
        if not direct:
            return os.pread(fd, n, off)
        buf = getattr(local, "buf", None)
        if buf is None or len(buf) < n:
            buf = local.buf = aligned_host_buffer(align_up(max(n, 64 << 10)))[1]
        got = os.preadv(fd, [buf[:n]], off)
        return buf[:got].tobytes()

    def part(es: list[JournalEntry]) -> list[Optional[fmt.RoundRecord]]:
        out = []
        for e in es:
            try:
                out.append(read_round(ssd, e, digest, geometry, read))
            except OSError as err:
                errors("rebuild read", err)
                out.append(None)
        return out

    order = sorted(flat, key=lambda e: (e.file_index, e.round_offset))
    step = max(64, -(-len(order) // (4 * REBUILD_THREADS)))
    parts = [order[i: i + step] for i in range(0, len(order), step)]
    try:
        with ThreadPoolExecutor(max_workers=REBUILD_THREADS) as ex:
            recs = [r for rs in ex.map(part, parts) for r in rs]
    finally:
        for fd in fds.values():
            os.close(fd)
    return dict(zip(map(id, order), recs))


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

    recs = _read_rounds(ssd, flat, digest, geometry, errors)
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
