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
from flatcake.cluster.transfer import (DataPlaneDescriptor, RegisteredBuffer, RemoteReadResult, TransferEndpoint,
                                       page_checksums, verify_landed)
from flatcake.gva.address import MEDIUM_DRAM, OFFSET_MASK, medium_of

log = logging.getLogger(__name__)


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


class RemoteDramReader:
    """Reads other nodes' DRAM pages with the Transfer Engine (one reader per thread, or share it:
    reads are serialised on its landing buffer).

    Args:
        endpoint: this node's :class:`TransferEndpoint`.
        landing_bytes: size of the registered landing buffer (multiple of 4096); a read of more
            pages than fit goes in several batches.

    Raises:
        TransferError: the landing buffer could not be registered.
    """

    def __init__(self, endpoint: TransferEndpoint, landing_bytes: int = 64 << 20):
        self.endpoint = endpoint
        self.landing = RegisteredBuffer(endpoint, landing_bytes)
        self._lock = threading.Lock()
        self.pages_read = 0
        self.pages_missed = 0

    def read(self, desc: Optional[DataPlaneDescriptor], pages: Sequence[RemotePage], layers: int,
             chunk_bytes: int) -> RemoteReadResult:
        """Read ``pages`` (all owned by ``desc.node``, medium DRAM) bit-exact or as misses.

        Args:
            desc: the owner's descriptor (None: the owner is unknown, every page a miss).
            pages: from the cluster view, ``[n]``.
            layers, chunk_bytes: the page geometry (chunks per page, bytes per chunk).

        Returns:
            :class:`RemoteReadResult` with ``data`` ``[n, layers * chunk_bytes]`` and ``hit`` ``[n]``.
        """
        page_bytes = layers * chunk_bytes
        res = RemoteReadResult.empty(len(pages), page_bytes)
        if desc is None or not desc.dram_bytes:
            res.misses["unknown_owner"] = len(pages)
            return res
        per_batch = max(1, self.landing.nbytes // page_bytes)
        if page_bytes > self.landing.nbytes:
            res.misses["failed"] = len(pages)
            return res
        with self._lock:
            for lo in range(0, len(pages), per_batch):
                self._read_batch(desc, pages, lo, min(len(pages), lo + per_batch), layers, chunk_bytes, res)
        n_hit = int(res.hit.sum())
        self.pages_read += n_hit
        self.pages_missed += len(pages) - n_hit
        return res

    def _read_batch(self, desc: DataPlaneDescriptor, pages: Sequence[RemotePage], lo: int, hi: int, layers: int,
                    chunk_bytes: int, res: RemoteReadResult) -> None:
        page_bytes = layers * chunk_bytes
        local, remote, lengths, ok_pages = [], [], [], []
        for i in range(lo, hi):
            p = pages[i]
            ranges = chunk_ranges(p, layers, chunk_bytes)
            if medium_of(p.gva) != MEDIUM_DRAM or p.node != desc.node or \
                    any(off + n > desc.dram_bytes for off, n in ranges):
                res.misses["failed"] += 1
                continue
            dst = self.landing.addr + (i - lo) * page_bytes
            for off, n in ranges:
                if lengths and local[-1] + lengths[-1] == dst and remote[-1] + lengths[-1] == desc.dram_addr + off:
                    lengths[-1] += n  # adjacent on both sides: one entry
                else:
                    local.append(dst)
                    remote.append(desc.dram_addr + off)
                    lengths.append(n)
                dst += n
            ok_pages.append(i)
        if not ok_pages:
            return
        if not self.endpoint.read(desc.te, local, remote, lengths):
            res.misses["failed"] += len(ok_pages)
            return
        land = self.landing.array[: (hi - lo) * page_bytes]
        sent = set(ok_pages)
        sums = [pages[i].checksums if i in sent else None for i in range(lo, hi)]
        good = verify_landed(land, sums, layers, chunk_bytes)
        for i in ok_pages:
            if good[i - lo]:
                res.data[i] = land[(i - lo) * page_bytes: (i - lo + 1) * page_bytes]
                res.hit[i] = True
            elif pages[i].checksums is None:
                res.misses["unverifiable"] += 1
            else:
                res.misses["mismatch"] += 1
