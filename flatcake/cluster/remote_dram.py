"""Remote DRAM reads (GVA node ≠ own, medium DRAM) over the Mooncake Transfer Engine (paper §3.1:
"remote DRAM by RDMA"; here the engine's tcp transport, RDMA where the NICs have it).

Lifecycle::

    owner:  export_dram(endpoint, region)      register the DRAM region once; its address and
                                                size go into the node's DataPlaneDescriptor
    owner:  dram_round_checksums(region, ...)  xxh3-64 per chunk of the round's slots, published
                                                with the round (DRAM rounds carry checksums)
    reader: RemoteDramReader.read(desc, pages) batch reads of the pages' chunks into a registered
                                                landing buffer -> checksums -> copy out

Integrity: the reader cannot pin the owner's scope, so a slot may be reclaimed and reused while
the bytes travel. Every page is checked against the checksums its round record carries; a page
whose bytes do not match (reused slot), whose record has no checksums, or whose transfer failed is
a miss — never other bytes. Reads never raise.
"""

from __future__ import annotations

import logging
import threading
from typing import Optional, Sequence

import numpy as np

from flatcake.cluster.records import RemotePage
from flatcake.cluster.transfer import (DataPlaneDescriptor, LandingPool, RemoteReadResult, TransferEndpoint,
                                       page_checksums, verify_landed)
from flatcake.gva.address import MEDIUM_DRAM, OFFSET_MASK, medium_of

log = logging.getLogger(__name__)

#: largest merged Transfer Engine entry (bytes): entries of ~1-4 MiB moved fastest in the
#: measurements of docs/cluster.md, one huge entry gains nothing
MAX_ENTRY_BYTES = 4 << 20


def export_dram(endpoint: TransferEndpoint, region) -> tuple[int, int]:
    """Register a :class:`~flatcake.media.dram.DramRegion` with the Transfer Engine (once, at
    start-up). Returns ``(address, bytes)`` for the node's descriptor; ``(0, 0)`` when the
    region is empty (DRAM disabled).

    Raises:
        TransferError: the engine refused the registration.
    """
    nbytes = region.region_bytes()
    if not nbytes:
        return 0, 0
    endpoint.register(region.region_address(), nbytes)
    return region.region_address(), nbytes


def dram_round_checksums(region, slots: Sequence[int], layers: int) -> np.ndarray:
    """uint64 ``[len(slots), layers]`` xxh3-64 of every chunk of the pages in ``slots`` (page-major
    slots: chunk ``l`` of a slot at ``l * page_bytes / layers``). Computed after the round's
    bytes are written, before it is published: what a remote reader verifies against."""
    chunk = region.page_bytes // layers
    pages = region.slots.numpy()[np.asarray(slots, dtype=np.int64)]
    return page_checksums(pages, layers, chunk)


def chunk_ranges(page: RemotePage, layers: int, chunk_bytes: int) -> list[tuple[int, int]]:
    """``(offset in the owner's medium, bytes)`` of the page's chunks in layer order, merged where
    they are adjacent (a DRAM slot's chunks are: one range per page)."""
    base = page.gva & OFFSET_MASK
    if page.layer_stride == chunk_bytes:
        return [(base, layers * chunk_bytes)]
    return [(base + l * page.layer_stride, chunk_bytes) for l in range(layers)]


def transfer_list(desc: DataPlaneDescriptor, pages: Sequence[RemotePage], layers: int, chunk_bytes: int,
                  landing_addr: int) -> tuple[list, list, list, list]:
    """The batch read that lands ``pages`` back to back at ``landing_addr`` (page ``i`` at
    ``landing_addr + i * layers * chunk_bytes``, chunks in layer order), entries merged where both
    sides are adjacent (consecutive slots: one entry).

    Returns:
        ``(local, remote, lengths, sent)``: addresses and byte counts of the entries, and the
        indices of the pages in them (a page not on ``desc``'s DRAM, or past its region, is left out).
    """
    page_bytes = layers * chunk_bytes
    local, remote, lengths, sent = [], [], [], []
    for i, p in enumerate(pages):
        ranges = chunk_ranges(p, layers, chunk_bytes)
        if medium_of(p.gva) != MEDIUM_DRAM or p.node != desc.node or \
                any(off + n > desc.dram_bytes for off, n in ranges):
            continue
        dst = landing_addr + i * page_bytes
        for off, n in ranges:
            src = desc.dram_addr + off
            if lengths and local[-1] + lengths[-1] == dst and remote[-1] + lengths[-1] == src \
                    and lengths[-1] + n <= MAX_ENTRY_BYTES:
                lengths[-1] += n
            else:
                local.append(dst)
                remote.append(src)
                lengths.append(n)
            dst += n
        sent.append(i)
    return local, remote, lengths, sent


class RemoteDramReader:
    """Reads other nodes' DRAM pages with the Transfer Engine, pipelined: the landing buffer is two
    halves, and while one batch's bytes travel into one half the previous batch (other half) is
    checked and copied out. One reader per thread, or share it (reads are serialised).

    Args:
        endpoint: this node's :class:`TransferEndpoint`.
        landing_bytes: size of the registered landing buffer (multiple of 8192); a batch is at
            most half of it (and at most ``batch_bytes``).
        batch_bytes: bytes per pipelined batch (default 8 MiB).

    Raises:
        TransferError: the landing buffer could not be registered.
    """

    def __init__(self, endpoint: TransferEndpoint, landing_bytes: int = 64 << 20, batch_bytes: int = 8 << 20):
        self.endpoint = endpoint
        self.pool = LandingPool(endpoint, landing_bytes)
        self.landing = self.pool.current
        self.half = landing_bytes // 2
        self.batch_bytes = min(batch_bytes, self.half)
        self._lock = threading.Lock()
        self.pages_read = 0
        self.pages_missed = 0

    def read(self, desc: Optional[DataPlaneDescriptor], pages: Sequence[RemotePage], layers: int,
             chunk_bytes: int, out: Optional[np.ndarray] = None) -> RemoteReadResult:
        """Read ``pages`` (all owned by ``desc.node``, medium DRAM) bit-exact or as misses.

        Args:
            desc: the owner's descriptor (None: the owner is unknown, every page a miss).
            pages: from the cluster view, ``[n]``.
            layers, chunk_bytes: the page geometry (chunks per page, bytes per chunk).
            out: optional uint8 ``[>= n, layers * chunk_bytes]`` the pages are copied into.

        Returns:
            :class:`RemoteReadResult` with ``data`` ``[n, layers * chunk_bytes]`` and ``hit`` ``[n]``.

        Raises:
            ValueError: ``out`` has the wrong shape (a caller's bug, not an I/O fault).
        """
        page_bytes = layers * chunk_bytes
        res = RemoteReadResult.empty(len(pages), page_bytes, out)
        if desc is None or not desc.dram_bytes:
            res.misses["unknown_owner"] = len(pages)
            return res
        with self._lock:
            self.landing = self.pool.get()
            if page_bytes > self.batch_bytes or self.landing is None:  # too large / every buffer quarantined
                res.misses["failed"] = len(pages)
                return res
            self._pipeline(desc, pages, layers, chunk_bytes, res)
        n_hit = int(res.hit.sum())
        self.pages_read += n_hit
        self.pages_missed += len(pages) - n_hit
        return res

    def _pipeline(self, desc: DataPlaneDescriptor, pages: Sequence[RemotePage], layers: int, chunk_bytes: int,
                  res: RemoteReadResult) -> None:
        """Batch ``b`` lands in half ``b % 2`` while batch ``b - 1`` is finished. After a failed
        batch (owner gone or cut off) nothing more is sent: the rest are misses at once, and the
        landing buffer is quarantined (the engine may still write into it; :class:`LandingPool`)."""
        page_bytes = layers * chunk_bytes
        per = self.batch_bytes // page_bytes
        pending, failed = None, False
        for b, lo in enumerate(range(0, len(pages), per)):
            hi = min(len(pages), lo + per)
            if failed:
                res.misses["failed"] += hi - lo
                continue
            local, remote, lengths, sent = transfer_list(desc, pages[lo:hi], layers, chunk_bytes,
                                                         self.landing.addr + (b % 2) * self.half)
            res.misses["failed"] += (hi - lo) - len(sent)
            bid = self.endpoint.submit(desc.te, local, remote, lengths) if sent else 0
            if sent and not bid:
                res.misses["failed"] += len(sent)
                failed = True
                continue
            if pending is not None:
                failed |= not self._finish(pages, layers, chunk_bytes, res, *pending)
            pending = (bid, lo, hi, b % 2, sent)
        if pending is not None:
            failed |= not self._finish(pages, layers, chunk_bytes, res, *pending)
        if failed:
            self.pool.retire()
            log.info("remote DRAM read from node %d failed; landing buffer quarantined", desc.node)

    def _finish(self, pages: Sequence[RemotePage], layers: int, chunk_bytes: int, res: RemoteReadResult,
                bid: int, lo: int, hi: int, half: int, sent: list) -> bool:
        """Wait for one batch, check its pages against their checksums, copy the good ones out.
        Returns False when the transfer failed (its pages are misses)."""
        if not sent:
            return True
        if not self.endpoint.wait(bid):
            res.misses["failed"] += len(sent)
            return False
        page_bytes = layers * chunk_bytes
        land = self.landing.array[half * self.half: half * self.half + (hi - lo) * page_bytes]
        sums = [None] * (hi - lo)
        for j in sent:
            sums[j] = pages[lo + j].checksums
        good = verify_landed(land, sums, layers, chunk_bytes)
        if good.all():
            res.data[lo:hi] = land.reshape(hi - lo, page_bytes)
            res.hit[lo:hi] = True
            return True
        for j in sent:
            if good[j]:
                res.data[lo + j] = land[j * page_bytes: (j + 1) * page_bytes]
                res.hit[lo + j] = True
            elif pages[lo + j].checksums is None:
                res.misses["unverifiable"] += 1
            else:
                res.misses["mismatch"] += 1
        return True
