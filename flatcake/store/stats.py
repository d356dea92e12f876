"""The store's one stats object: cumulative counters shared by the scope table, the write path
and the read path (bytes, pages, operations, seconds).

Each component adds to it with :meth:`StoreStats.add` (thread-safe); the facade reads a
consistent copy with :meth:`StoreStats.snapshot`. ``flatcake_stats()`` on the SGLang adapter
and the replay's per-system counters are built from that snapshot.
"""

from __future__ import annotations

import dataclasses
import threading
from dataclasses import dataclass, field


@dataclass
class StoreStats:
    """Cumulative counters of one :class:`~flatcake.store.page_store.PageStore`.

    Attributes:
        hit_pages_dram, hit_pages_ssd: pages delivered by reads, per medium.
        logical_read_bytes_ssd: bytes of SSD pages delivered (pages × page_bytes).
        ssd_read_bytes: bytes read from the SSD (merged reads, over-read included).
        ssd_read_ops: read requests issued (a merged read is cut into pieces read in parallel).
        ssd_over_read_bytes: bridged holes and alignment slack read and thrown away.
        ssd_restores: FC-CIO restores (one per read call that needed SSD pages).
        merged_reads: merged reads planned by FC-CIO (contiguous ranges; a restore plans one or more).
        ssd_read_s: seconds spent in FC-CIO restores (first read to last scatter).
        ssd_write_bytes, ssd_write_ops: bytes and ``pwrite`` calls to the SSD (headers included).
        dram_write_bytes: bytes copied into DRAM slots.
        logical_write_bytes: bytes of pages stored (pages × page_bytes).
        pages_written_dram, pages_written_ssd: pages stored, per medium.
        put_failures, get_failures: rounds that failed to store; reads that stopped early.
        reclaimed_scopes_ssd, reclaimed_scopes_dram: whole scopes freed (reclaim, clear, faults).
        reclaimed_bytes: medium bytes those scopes held.
        quarantined_scopes: scopes that lost pages because a page of theirs failed to read intact.
        quarantined_pages: pages those failed reads unpublished (:mod:`flatcake.gva.read_faults`).
        queued_rounds: SSD rounds deferred through the write queue (``ssd.write_backlog_bytes``).
        queued_hit_pages: pages delivered from the write queue's in-memory copy.
        write_deferred_s: seconds the queue's writer held writes back while restores were in flight.
        deferred_write_failures, deferred_write_failed_pages: queued rounds (and their pages)
            whose write or commit failed after the put had returned (failed puts after the fact).
        write_backlog_dram_rounds: rounds placed on DRAM instead because the backlog was full.
        write_backlog_dropped_rounds, write_backlog_dropped_pages: one-shot rounds (pages) not
            stored because the backlog was full and DRAM had no room.
        write_backlog_full_failures: puts of other scopes that found no room within
            ``ssd.write_backlog_wait_s`` seconds.
        write_backlog_discarded_rounds: queued rounds never written (scope dropped or cleared,
            store closed before they were drained).
        write_backlog_evicted_rounds: queued rounds never written because reclaim freed their
            scope (pinned only by rounds waiting in the queue) to make room in a full pool.
    """

    hit_pages_dram: int = 0
    hit_pages_ssd: int = 0
    logical_read_bytes_ssd: int = 0
    ssd_read_bytes: int = 0
    ssd_read_ops: int = 0
    ssd_over_read_bytes: int = 0
    ssd_restores: int = 0
    merged_reads: int = 0
    ssd_read_s: float = 0.0
    ssd_write_bytes: int = 0
    ssd_write_ops: int = 0
    dram_write_bytes: int = 0
    logical_write_bytes: int = 0
    pages_written_dram: int = 0
    pages_written_ssd: int = 0
    put_failures: int = 0
    get_failures: int = 0
    reclaimed_scopes_ssd: int = 0
    reclaimed_scopes_dram: int = 0
    reclaimed_bytes: int = 0
    quarantined_scopes: int = 0
    quarantined_pages: int = 0
    queued_rounds: int = 0
    queued_hit_pages: int = 0
    write_deferred_s: float = 0.0
    deferred_write_failures: int = 0
    deferred_write_failed_pages: int = 0
    write_backlog_dram_rounds: int = 0
    write_backlog_dropped_rounds: int = 0
    write_backlog_dropped_pages: int = 0
    write_backlog_full_failures: int = 0
    write_backlog_discarded_rounds: int = 0
    write_backlog_evicted_rounds: int = 0
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False, compare=False)

    def add(self, **deltas: float) -> None:
        """Add ``deltas`` to the named counters (one lock round trip for all of them).

        Raises:
            AttributeError: a name that is not a counter.
        """
        with self._lock:
            for name, v in deltas.items():
                if name.startswith("_"):
                    raise AttributeError(name)
                setattr(self, name, getattr(self, name) + v)

    def snapshot(self) -> dict:
        """A consistent copy of every counter as a plain dict."""
        with self._lock:
            return {f.name: getattr(self, f.name) for f in dataclasses.fields(self) if not f.name.startswith("_")}


def write_rates(ssd_write_bytes: int, elapsed_s: float, capacity_bytes: int) -> dict:
    """Write-endurance view of ``ssd_write_bytes`` written over ``elapsed_s`` seconds:
    ``ssd_write_bytes_per_hour`` (bytes/h) and ``ssd_dwpd`` (projected drive writes per day:
    bytes per day / ``capacity_bytes``, the configured SSD capacity; 0.0 when either is 0)."""
    per_s = ssd_write_bytes / elapsed_s if elapsed_s > 0 else 0.0
    return {"ssd_write_bytes_per_hour": per_s * 3600.0,
            "ssd_dwpd": per_s * 86400.0 / capacity_bytes if capacity_bytes > 0 else 0.0}
