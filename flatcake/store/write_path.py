"""The write path: moves a placed round's bytes from the KV buffer onto its medium (paper §3.1
write-time placement, §3.3 layer-major layout). It decides nothing: the scope table
(:mod:`flatcake.gva.scopes`) has already chosen the medium and reserved the space, and
publishes the returned entries only after this path has written the bytes.

Lifecycle of one round (no lock held)::

    DRAM:  gather the pages layer by layer -> copy into the reserved slots -> record each
           slot's identity (its key)                                       -> PageEntry per page
    SSD:   [extent header, if the round opens an extent: one 4 KiB pwrite]
           gather the pages layer-major into this thread's aligned buffer (one numpy copy per
           layer and plane) -> xxh3-64 and device checksum per chunk (one GIL-free C call each
           per slab; flatcake.kernels.fcds_native)
           -> pwrite(s) 1: round header | data       (the bytes; slabs of ~8 MiB of whole layers
                                                     written while the next are gathered)
           -> pwrite 2: record v3 (identity, keys, checksums) (only now does the round exist)
           -> PageEntry per page (GVA, layer stride, checksums: xxh3 [layers] then device [layers])

The two SSD writes are ordered: a crash before the second leaves a round without a valid
record, which a restart drops (``docs/durability.md``); the store appends the journal entry
and publishes only after both returned.

A failed write raises (``OSError``; :class:`~flatcake.media.errors.PoolFileGone` when the pool
file vanished); the store then aborts the placement and reports a failed put.
"""

from __future__ import annotations

import threading
from concurrent.futures import ThreadPoolExecutor
from typing import Optional

import numpy as np
import torch

from flatcake.common.align import align_down, align_up
from flatcake.cio import xxh3_bulk
from flatcake.cio.pagecopy import chunk_checksums, gather_layers, gather_pages
from flatcake.config import STORAGE_BATCH_PAGES
from flatcake.gva.address import MEDIUM_DRAM, MEDIUM_SSD, encode_gva
from flatcake.gva.index import PageEntry
from flatcake.gva.placement import Placement
from flatcake.kernels import fcds_native
from flatcake.common.layout import KvPageLayout, PageGeometry
from flatcake.media import extent as fmt
from flatcake.media.dram import DramRegion
from flatcake.media.directio import AlignedBuffer
from flatcake.media.ssd import SsdFilePool
from flatcake.store.stats import StoreStats

#: pages in one round at most: one SGLang backup call
MAX_ROUND_PAGES = STORAGE_BATCH_PAGES

#: bytes of a round handed to the write thread at a time (whole layers; at least one): the
#: next layers are gathered and hashed while they are written
PIPELINE_BYTES = 8 << 20

#: key length assumed when sizing the largest round a pool file can hold (SGLang keys are 64 hex chars)
_SIZING_KEY = "k" * 80


#: a round size must let back-to-back rounds fill at least this fraction of a pool file
MIN_FILE_FILL = 0.9


def round_extent_bytes(n: int, geometry: PageGeometry) -> int:
    """Bytes of a pool file that an extent holding one round of ``n`` pages takes: extent
    header + round header + page data + round record, each 4096-aligned (keys sized as
    SGLang's 64-hex-digit keys, with room to spare)."""
    return 2 * fmt.BLOCK + align_up(n * geometry.page_bytes) + align_up(
        fmt.record_size([_SIZING_KEY] * n, geometry.layers))


def max_round_pages(file_bytes: int, geometry: PageGeometry) -> int:
    """Pages of the largest round (at most :data:`MAX_ROUND_PAGES`) that fits one pool file of
    ``file_bytes`` bytes with its extent header, round header and record, and whose extents,
    packed back to back, fill at least :data:`MIN_FILE_FILL` of a file (a round of a bit more
    than a third of a file would leave a third of every file empty); 0 when not even one page
    fits."""
    n = MAX_ROUND_PAGES
    while n > 0 and round_extent_bytes(n, geometry) > file_bytes:
        n -= 1
    while n > 1:
        extent = round_extent_bytes(n, geometry)
        if file_bytes // extent * extent >= MIN_FILE_FILL * file_bytes:
            break
        n -= 1
    return n


_pool: Optional[ThreadPoolExecutor] = None
_pool_lock = threading.Lock()


def _writer() -> ThreadPoolExecutor:
    """The process's write threads (2, shared by every store): they write a round's leading
    slabs while the next layers are gathered."""
    global _pool
    if _pool is None:
        with _pool_lock:
            if _pool is None:
                _pool = ThreadPoolExecutor(max_workers=2, thread_name_prefix="fc-write")
    return _pool


class WritePath:
    """Writes placed rounds to DRAM slots or SSD extents.

    Args:
        geometry: page geometry of the namespace.
        namespace: namespace string (its digest goes into every extent header and record).
        node: GVA node field of the addresses it returns.
        dram: the DRAM region (its ``slots`` tensor ``[n_slots, page_bytes]`` uint8).
        ssd: the SSD file pool.
        stats: the store's stats object.
    """

    def __init__(self, geometry: PageGeometry, namespace: str, node: int, dram: DramRegion, ssd: SsdFilePool,
                 stats: StoreStats):
        self.geometry = geometry
        self.namespace = namespace
        self.node = node
        self.dram = dram
        self.ssd = ssd
        self.stats = stats
        self._tls = threading.local()
        xxh3_bulk.warm_up()  # the GIL-free checksum loop, ready before the first round
        fcds_native.warm_up()  # and the device checksum's host loop

    def write(self, plc: Placement, layout: KvPageLayout) -> list[PageEntry]:
        """Write round ``plc`` from pages ``plc.src_pages`` of ``layout``.

        Returns:
            One :class:`PageEntry` per page, in ``plc.keys`` order, for the scope table to publish.

        Raises:
            OSError: an SSD write failed (``PoolFileGone``: the pool file was removed or
                truncated; ``StaleGeneration``: it was reset since the placement; ``ShortWrite``:
                a write stopped short).
            IndexError, RuntimeError: source pages outside ``layout`` (a caller bug).
        """
        if plc.medium == MEDIUM_DRAM:
            return self._write_dram(plc, layout)
        return self._write_ssd(plc, layout)

    # ------------------------------------------------------------------ DRAM
    def _write_dram(self, plc: Placement, layout: KvPageLayout) -> list[PageEntry]:
        """Gather the pages (``[n, layers, chunk_bytes]``) and copy them into their slots."""
        g = self.geometry
        n = len(plc.keys)
        src = np.asarray(plc.src_pages, dtype=np.int64)
        tmp = torch.empty((n, g.layers, g.chunk_bytes), dtype=torch.uint8, device=layout.device)
        for layer in range(g.layers):
            gather_pages(layout, src, layer, tmp[:, layer])
        self.dram.slots[torch.tensor(plc.slots, dtype=torch.long)] = tmp.view(n, -1).to("cpu")
        self.dram.set_identity(plc.slots, plc.keys)
        self.stats.add(dram_write_bytes=n * g.page_bytes, pages_written_dram=n)
        return [PageEntry(encode_gva(MEDIUM_DRAM, self.node, s * g.page_bytes), plc.scope, g.chunk_bytes)
                for s in plc.slots]

    # ------------------------------------------------------------------ SSD
    def _scratch(self, nbytes: int) -> memoryview:
        """This thread's page-aligned write buffer, at least ``nbytes`` long (reused)."""
        buf = getattr(self._tls, "buf", None)
        if buf is None:
            buf = self._tls.buf = AlignedBuffer()
        return buf.reserve(nbytes)

    def _write_extent_header(self, plc: Placement) -> None:
        ext = plc.new_extent
        view = self._scratch(fmt.BLOCK)  # this thread's write buffer; the round reuses it after
        view[:] = fmt.pack_extent_header(self.namespace, self.node, plc.scope.scope_id, plc.extent_seq, ext.nbytes)
        self.ssd.write(ext.file_index, ext.offset, view[: fmt.BLOCK], plc.generation)
        self.stats.add(ssd_write_bytes=fmt.BLOCK, ssd_write_ops=1)

    def _gather_layers(self, plc: Placement, layout: KvPageLayout, data: torch.Tensor, l0: int, l1: int) -> None:
        """Copy layers ``l0..l1-1`` of the round's chunks into ``data`` (uint8 ``[layers, n,
        chunk_bytes]``, layer-major): one vectorized copy per plane for those layers
        (:func:`~flatcake.cio.pagecopy.gather_layers`; per layer through a device buffer on CUDA)."""
        g = self.geometry
        n = len(plc.keys)
        src = np.asarray(plc.src_pages, dtype=np.int64)
        if layout.device.type == "cpu":
            gather_layers(layout, src, l0, l1, data[l0:l1])
            return
        for layer in range(l0, l1):
            tmp = torch.empty((n, g.chunk_bytes), dtype=torch.uint8, device=layout.device)
            gather_pages(layout, src, layer, tmp)
            data[layer].copy_(tmp)

    def _write_data(self, plc: Placement, layout: KvPageLayout, view: memoryview, arr: np.ndarray) -> tuple:
        """Gather, checksum and write header | data (``view[:record_offset]``), pipelined: each
        slab of about :data:`PIPELINE_BYTES` (whole layers) is handed to the write thread as
        soon as it is gathered and hashed, cut at a 4 KiB boundary, while the next slab is
        gathered. Returns ``(sums, devsums, pwrite calls)``: uint64 ``[layers, n]`` xxh3-64 and
        device checksums (:mod:`flatcake.kernels.device_checksum`) of every chunk; every write
        has ended when it returns or raises (the buffer is this thread's and is reused next round)."""
        g, lay = self.geometry, plc.layout
        n, cb, L = lay.n_pages, g.chunk_bytes, g.layers
        slab = n * cb
        data_end = fmt.BLOCK + L * slab
        data = torch.from_numpy(arr[fmt.BLOCK: data_end]).view(L, n, cb)
        sums = np.empty((L, n), dtype=np.uint64)
        devsums = np.empty((L, n), dtype=np.uint64)
        step = max(1, PIPELINE_BYTES // max(1, slab))
        futures, sent = [], 0
        try:
            for l0 in range(0, L, step):
                l1 = min(L, l0 + step)
                self._gather_layers(plc, layout, data, l0, l1)
                part = arr[fmt.BLOCK + l0 * slab: fmt.BLOCK + l1 * slab]
                sums[l0:l1] = chunk_checksums(part, cb).reshape(l1 - l0, n)
                devsums[l0:l1] = fcds_native.fcds_host_chunks(part, cb).reshape(l1 - l0, n)
                cut = align_down(fmt.BLOCK + l1 * slab, fmt.BLOCK) if l1 < L else sent
                if cut > sent:
                    futures.append(_writer().submit(self.ssd.write, plc.extent_file, plc.round_offset + sent,
                                                         view[sent:cut], plc.generation))
                    sent = cut
            arr[data_end: lay.record_offset] = 0
            self.ssd.write(plc.extent_file, plc.round_offset + sent, view[sent: lay.record_offset], plc.generation)
        finally:
            errs = [f.exception() for f in futures]  # waits for every write
        err = next((e for e in errs if e is not None), None)
        if err is not None:
            raise err
        return sums, devsums, len(futures) + 1

    def _write_ssd(self, plc: Placement, layout: KvPageLayout) -> list[PageEntry]:
        """Write the round: header | layer-major data (pipelined slabs, :meth:`_write_data`), then,
        once every data write has ended, its record."""
        g = self.geometry
        lay = plc.layout
        n = lay.n_pages
        cb = g.chunk_bytes
        if plc.new_extent is not None:
            self._write_extent_header(plc)
        view = self._scratch(lay.total_bytes)
        arr = np.frombuffer(view, dtype=np.uint8, count=lay.total_bytes)
        view[: fmt.BLOCK] = fmt.pack_round_header(lay, plc.seq, plc.scope.scope_id, plc.nonce)
        sums, devsums, ops = self._write_data(plc, layout, view, arr)  # the bytes first
        rec = fmt.pack_record(self.namespace, plc.keys, g.layers, cb, sums, plc.scope.scope_id, plc.seq, plc.nonce,
                              devsums)
        arr[lay.record_offset: lay.record_offset + len(rec)] = np.frombuffer(rec, dtype=np.uint8)
        arr[lay.record_offset + len(rec): lay.total_bytes] = 0
        self.ssd.write(plc.extent_file, plc.round_offset + lay.record_offset, view[lay.record_offset: lay.total_bytes],
                       plc.generation)
        self.stats.add(ssd_write_bytes=lay.total_bytes, ssd_write_ops=ops + 1, pages_written_ssd=n)
        stride = n * cb
        base_off = plc.extent_file * self.ssd.file_bytes + plc.round_offset + fmt.BLOCK
        both = np.concatenate((sums, devsums))  # [2 * layers, n]: xxh3 rows, then device rows
        return [
            PageEntry(encode_gva(MEDIUM_SSD, self.node, base_off + p * cb), plc.scope, stride, both[:, p].copy(),
                      generation=plc.generation)
            for p in range(n)
        ]


__all__ = ["MAX_ROUND_PAGES", "WritePath", "max_round_pages", "round_extent_bytes"]
