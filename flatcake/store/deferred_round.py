"""A deferred SSD round: its bytes prepared in the backup thread, written later by the write
queue's writer thread (``docs/design.md``, "Write queue"; Tutti, design notes §3).

The on-disk result is the one :class:`~flatcake.store.write_path.WritePath` produces for the same
placement (``docs/durability.md``): [extent header] | round header | layer-major data |
record, the record written only after the data. What differs is *when* and *in what pieces*:

* :func:`prepare_round` (backup thread, no lock, no I/O) gathers the round's pages from the
  host pool into a buffer of its own (the host pool may reuse its pages once the put returns),
  computes the per-chunk xxh3-64 and packs header and record. That buffer is also the
  in-memory copy the queue serves the round's pages from until they are on disk.
* :func:`write_prepared` (writer thread) writes it in chunks of at most ``chunk_bytes``,
  calling ``between()`` before each chunk after the first (the queue pauses there while a
  restore read is in flight), then the record, and returns the index entries to publish.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Optional

import numpy as np
import torch

from flatcake.cio.native_gather import gather_and_hash
from flatcake.cio.pagecopy import chunk_checksums, gather_layers, gather_pages
from flatcake.gva.address import MEDIUM_SSD, encode_gva
from flatcake.gva.index import PageEntry
from flatcake.kernels.fcds_native import fcds_host_chunks
from flatcake.common.layout import KvPageLayout, PageGeometry
from flatcake.media import extent as fmt
from flatcake.media.directio import AlignedBuffer
from flatcake.store.native_write import piece_writer


@dataclass(eq=False)
class PreparedRound:
    """The bytes of one SSD round, ready to write.

    Attributes:
        plc: the round's placement (SSD).
        buf: the page-aligned buffer that owns the bytes (``layout.total_bytes``).
        sums: uint64 ``[layers, n]`` xxh3-64 of every chunk.
        chunk_bytes: bytes of one (page, layer) chunk.
        extent_header: the 4 KiB extent header block when the round opens an extent, else None.
        devsums: uint64 ``[layers, n]`` device checksums of every chunk (record v3), or None.
        lead: bytes of ``buf`` before the round: :data:`~flatcake.media.extent.BLOCK` when the
            extent header sits there, right before the round header as on disk, so that the
            first data write carries it (one O_DIRECT write fewer per new extent); else 0.
    """

    plc: object
    buf: AlignedBuffer
    sums: np.ndarray
    chunk_bytes: int
    extent_header: Optional[bytes] = None
    devsums: Optional[np.ndarray] = None
    lead: int = 0

    @property
    def layout(self):
        """The round's :class:`~flatcake.media.extent.RoundLayout`."""
        return self.plc.layout

    def view(self) -> memoryview:
        """The whole round (``layout.total_bytes``)."""
        return self.buf.reserve(self.lead + self.layout.total_bytes)[self.lead:]

    def data(self) -> np.ndarray:
        """uint8 ``[layers, n, chunk_bytes]`` view of the layer-major page data."""
        lay = self.layout
        n = lay.n_pages
        L = self.sums.shape[0]
        arr = np.frombuffer(self.view(), dtype=np.uint8, count=L * n * self.chunk_bytes, offset=fmt.BLOCK)
        return arr.reshape(L, n, self.chunk_bytes)


def prepare_round(plc, layout: KvPageLayout, geometry: PageGeometry, namespace: str, node: int,
                  buf: Optional[AlignedBuffer] = None) -> PreparedRound:
    """Gather round ``plc`` (SSD placement) from ``layout`` into ``buf`` (grown as needed; a new
    aligned buffer when ``None``; nobody else may use it until the round is done): round
    header, layer-major data and its checksums (on CPU one GIL-free C call,
    :func:`~flatcake.cio.native_gather.gather_and_hash`; else one vectorized copy per plane for
    all layers, :func:`~flatcake.cio.pagecopy.gather_layers`, then the hash loops), zero
    padding, record.

    Raises:
        IndexError, RuntimeError: source pages outside ``layout`` (a caller bug).
        OSError: the buffer cannot be mapped (``ENOMEM``).
    """
    g, lay = geometry, plc.layout
    n, cb, L = lay.n_pages, geometry.chunk_bytes, geometry.layers
    buf = buf if buf is not None else AlignedBuffer()
    ext = plc.new_extent
    lead = fmt.BLOCK if ext is not None and ext.file_index == plc.extent_file and \
        ext.offset + fmt.BLOCK == plc.round_offset else 0
    view = buf.reserve(lead + lay.total_bytes)[lead:]
    arr = np.frombuffer(view, dtype=np.uint8, count=lay.total_bytes)
    view[: fmt.BLOCK] = fmt.pack_round_header(lay, plc.seq, plc.scope.scope_id, plc.nonce)
    data_end = fmt.BLOCK + L * n * cb
    src = np.asarray(plc.src_pages, dtype=np.int64)
    both = gather_and_hash(layout, src, arr[fmt.BLOCK: data_end]) if layout.device.type == "cpu" else None
    if both is not None:  # copy + both checksums in one GIL-free call (flatcake.cio.native_gather)
        sums, devsums = both
    else:  # (the torch view only here: a torch op gives the GIL up)
        data = torch.from_numpy(arr[fmt.BLOCK: data_end]).view(L, n, cb)
        if layout.device.type == "cpu":  # one GIL-free copy per plane for all layers (SGLang's host layouts)
            gather_layers(layout, src, 0, L, data)
        else:
            for layer in range(L):
                tmp = torch.empty((n, cb), dtype=torch.uint8, device=layout.device)
                gather_pages(layout, src, layer, tmp)
                data[layer].copy_(tmp)
        sums = chunk_checksums(arr[fmt.BLOCK: data_end], cb).reshape(L, n)
        devsums = fcds_host_chunks(arr[fmt.BLOCK: data_end], cb).reshape(L, n)
    arr[data_end: lay.record_offset] = 0
    rec = fmt.pack_record(namespace, plc.keys, g.layers, cb, sums, plc.scope.scope_id, plc.seq, plc.nonce, devsums)
    arr[lay.record_offset: lay.record_offset + len(rec)] = np.frombuffer(rec, dtype=np.uint8)
    arr[lay.record_offset + len(rec): lay.total_bytes] = 0
    eh = None
    if ext is not None:
        eh = fmt.pack_extent_header(namespace, node, plc.scope.scope_id, plc.extent_seq, ext.nbytes)
        if lead:
            buf.reserve(lead)[:lead] = eh
    return PreparedRound(plc, buf, sums, cb, eh, devsums, lead)


def write_prepared(prep: PreparedRound, ssd, node: int, stats, chunk_bytes: int,
                   between: Optional[Callable[[], None]] = None, readers=None) -> list[PageEntry]:
    """Write ``prep`` to its reserved space: extent header (if any; in the first piece when it
    sits right before the round, ``prep.lead``), header | data in pieces of at most
    ``chunk_bytes`` (a multiple of 4096) with ``between()`` before each piece after the first,
    then the record (only now does the round exist on disk). With ``readers`` (int64 ``[1]``,
    restores in flight) and the C loop of :mod:`flatcake.store.native_write`, the pieces and the
    record are one ``ssd.write`` in one GIL-free call that stops between two pieces while
    ``readers[0] > 0`` (then ``between()``, and the rest): same bytes, order and pause points.

    Returns:
        One :class:`~flatcake.gva.index.PageEntry` per page, as the write path returns them.

    Raises:
        OSError: a write failed (``PoolFileGone``, ``StaleGeneration``, ``ShortWrite``, ...).
    """
    plc, lay = prep.plc, prep.layout
    ops = 0
    if prep.extent_header is not None and not prep.lead:
        hb = AlignedBuffer(fmt.BLOCK)
        hv = hb.reserve(fmt.BLOCK)
        hv[:] = prep.extent_header
        ssd.write(plc.new_extent.file_index, plc.new_extent.offset, hv[: fmt.BLOCK], plc.generation)
        stats.add(ssd_write_bytes=fmt.BLOCK, ssd_write_ops=1)
    view = prep.view()
    ends = [plc.round_offset + min(off, lay.record_offset) for off in range(chunk_bytes, lay.record_offset + chunk_bytes,
                                                                            chunk_bytes)]
    pwrite = piece_writer(ends, readers, between) if readers is not None else None
    if pwrite is not None:  # header | data pieces, then the record: one call
        whole = prep.buf.reserve(prep.lead + lay.total_bytes)
        ssd.write(plc.extent_file, plc.round_offset - prep.lead, whole[: prep.lead + lay.total_bytes], plc.generation,
                  pwrite)
        stats.add(ssd_write_bytes=prep.lead)
        ops = len(ends)
    for off in range(0, lay.record_offset if pwrite is None else 0, chunk_bytes):
        if off and between is not None:
            between()
        end = min(lay.record_offset, off + chunk_bytes)
        if off == 0 and prep.lead:  # the extent header block, then the round header and data
            whole = prep.buf.reserve(prep.lead + end)
            ssd.write(plc.extent_file, plc.round_offset - prep.lead, whole[: prep.lead + end], plc.generation)
            stats.add(ssd_write_bytes=prep.lead)
        else:
            ssd.write(plc.extent_file, plc.round_offset + off, view[off:end], plc.generation)
        ops += 1
    if pwrite is None:
        if between is not None:
            between()
        ssd.write(plc.extent_file, plc.round_offset + lay.record_offset, view[lay.record_offset: lay.total_bytes],
                  plc.generation)
    n, cb = lay.n_pages, prep.chunk_bytes
    stats.add(ssd_write_bytes=lay.total_bytes, ssd_write_ops=ops + 1, pages_written_ssd=n)
    base_off = plc.extent_file * ssd.file_bytes + plc.round_offset + fmt.BLOCK
    both = prep.sums if prep.devsums is None else np.concatenate((prep.sums, prep.devsums))  # xxh3, device
    return [PageEntry(encode_gva(MEDIUM_SSD, node, base_off + p * cb), plc.scope, n * cb, both[:, p].copy(),
                      generation=plc.generation) for p in range(n)]


__all__ = ["PreparedRound", "prepare_round", "write_prepared"]
