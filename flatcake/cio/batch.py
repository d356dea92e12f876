"""One staging batch of an FC-CIO restore: its I/O pieces and which piece owns which chunk
(paper §3.3; the restore pipeline is in :mod:`flatcake.cio.restore`).

A batch is the merged reads that fit one staging buffer (:func:`~flatcake.cio.plan.batch_reads`).
Each merged read is cut into up to ``io_workers`` aligned *pieces* read in parallel
(:func:`~flatcake.cio.engines.split_pieces`), laid back to back in the buffer. A chunk that lies
wholly inside one piece is *owned* by it: with host staging its verify + scatter can run as soon
as that piece lands, overlapping the other reads. Chunks straddling two pieces (and, on the
kvikio/GPU path, every chunk) are handled once the whole batch has landed. Ownership is array
arithmetic over the batch's chunks, no per-chunk Python work.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional, Sequence

import numpy as np
import torch

from flatcake.cio.engines import IoPiece, split_pieces
from flatcake.cio.pagecopy import checksums_at
from flatcake.cio.plan import ChunkBatch, MergedRead
from flatcake.common.errorlog import ErrorLog


@dataclass(eq=False)
class StagingBatch:
    """In-flight state of one staging batch.

    Chunk arrays (numpy int64, one entry per chunk; ``*_idx`` are positions in ``chunks``,
    ``*_b0`` byte offsets in the staging buffer): ``own_*`` the chunks owned by one piece,
    grouped by piece (piece ``k``'s are ``[own_lo[k]:own_lo[k+1]]``); ``rest_*`` the others,
    with ``rest_k0``/``rest_k1`` the pieces holding their first/last byte.

    Attributes:
        reads: the merged reads of the batch, in buffer order.
        buf: the :class:`~flatcake.cio.staging.StagingBuffer` they land in.
        layout: destination :class:`~flatcake.common.layout.KvPageLayout`.
        chunks: the restore's :class:`ChunkBatch`.
        pieces: the I/O pieces, in buffer order.
        piece_start, piece_end: int64 ``[pieces]`` buffer offsets where each piece starts / ends.
        used: bytes of the buffer the batch fills.
        failed: tags of chunks that failed in worker-side callbacks (``list.extend`` is atomic).
        futures: scatter-pool jobs of this batch.
        pending: the engine's :class:`~flatcake.cio.engines.PendingIo`.
    """

    reads: list
    buf: object
    layout: object
    chunks: Optional[ChunkBatch] = None
    pieces: list = field(default_factory=list)
    piece_start: Optional[np.ndarray] = None
    piece_end: Optional[np.ndarray] = None
    own_b0: Optional[np.ndarray] = None
    own_idx: Optional[np.ndarray] = None
    own_lo: Optional[np.ndarray] = None  # int64 [pieces + 1]
    rest_b0: Optional[np.ndarray] = None
    rest_idx: Optional[np.ndarray] = None
    rest_k0: Optional[np.ndarray] = None
    rest_k1: Optional[np.ndarray] = None
    failed: list = field(default_factory=list)
    futures: list = field(default_factory=list)
    used: int = 0
    pending: object = None

    @classmethod
    def build(cls, reads: Sequence[MergedRead], buf, layout, chunk_bytes: int, io_workers: int,
              owned: bool) -> "StagingBatch":
        """Cut ``reads`` into pieces laid back to back in ``buf`` and assign chunks to pieces.

        Args:
            reads: merged reads of one batch (non-empty, all from one :class:`ChunkBatch`).
            buf: the staging buffer.
            layout: the destination layout.
            chunk_bytes: bytes per chunk.
            io_workers: pieces per merged read at most.
            owned: give chunks that lie wholly in one piece to that piece (worker-side scatter);
                when False every chunk is a ``rest`` chunk.

        Piece of a chunk's first byte: ``first + offset_in_read // step``; it is owned when its
        last byte is in the same piece.
        """
        st = cls(reads=list(reads), buf=buf, layout=layout)
        pieces: list[IoPiece] = []
        pos = 0
        b0s, idxs, k0s, k1s = [], [], [], []
        for r in reads:
            ps = split_pieces(r.file_index, r.offset, r.nbytes, pos, io_workers)
            first = len(pieces)
            pieces.extend(ps)
            step = ps[0].nbytes
            offs = r.offsets
            b0s.append(offs + pos)
            idxs.append(r.index)
            k0s.append(offs // step + first)  # piece holding the chunk's first byte
            k1s.append((offs + (chunk_bytes - 1)) // step + first)  # piece holding its last byte
            pos += r.nbytes
        st.chunks = reads[0].batch
        st.pieces = pieces
        st.used = pos
        st.piece_start = np.fromiter((p.buf_offset for p in pieces), dtype=np.int64, count=len(pieces))
        st.piece_end = st.piece_start + np.fromiter((p.nbytes for p in pieces), dtype=np.int64, count=len(pieces))
        b0, idx, k0, k1 = (np.concatenate(x) for x in (b0s, idxs, k0s, k1s))
        if owned:
            own = k0 == k1  # the whole chunk lies in one piece
            if own.all():
                st.own_b0, st.own_idx, own_k = b0, idx, k0
            else:
                st.own_b0, st.own_idx, own_k = b0[own], idx[own], k0[own]
                rest = ~own
                st.rest_b0, st.rest_idx, st.rest_k0, st.rest_k1 = b0[rest], idx[rest], k0[rest], k1[rest]
            # own_k is non-decreasing (reads back to back, chunks sorted in each read):
            # the chunks of piece k are own_*[own_lo[k]:own_lo[k + 1]]
            st.own_lo = np.searchsorted(own_k, np.arange(len(pieces) + 1), side="left")
        else:
            st.rest_b0, st.rest_idx, st.rest_k0, st.rest_k1 = b0, idx, k0, k1
        return st

    @property
    def has_owned(self) -> bool:
        """True when some chunk is owned by a piece (worker-side verify + scatter)."""
        return self.own_idx is not None and self.own_idx.shape[0] > 0


def verify_chunks(host, b0: np.ndarray, idx: np.ndarray, chunks: ChunkBatch, chunk_bytes: int,
                  errors: ErrorLog) -> np.ndarray:
    """Checksum check of fully read chunks in a host staging buffer.

    Args:
        host: uint8 numpy view of the staging buffer.
        b0: int64 ``[m]`` byte offsets of the chunks in the buffer.
        idx: int64 ``[m]`` positions of the chunks in ``chunks``.
        chunks: the restore's batch (``checksum``, ``has_checksum``).
        chunk_bytes: bytes per chunk.
        errors: where each mismatch is reported (``verify`` / ``checksum``, logged once).

    Returns:
        bool ``[m]``: True where the chunk may be scattered (no checksum given, or its xxh3-64
        matches).
    """
    m = b0.shape[0]
    has = chunks.has_checksum[idx]
    ok = np.ones(m, dtype=bool)
    sel = np.flatnonzero(has) if not has.all() else None
    if sel is not None and sel.shape[0] == 0:
        return ok
    got = checksums_at(host, b0 if sel is None else b0[sel], chunk_bytes)
    want = chunks.checksum[idx if sel is None else idx[sel]]
    bad = np.flatnonzero(got != want)
    if bad.shape[0]:
        pos = bad if sel is None else sel[bad]
        ok[pos] = False
        for i in idx[pos].tolist():
            errors.report("verify", "checksum", f"chunk tag {int(chunks.tag[i])} (file "
                          f"{int(chunks.file_index[i])} @ {int(chunks.offset[i])})")
    return ok


def verify_chunks_device(buf, b0: np.ndarray, idx: np.ndarray, chunks: ChunkBatch, chunk_bytes: int,
                         errors: ErrorLog, impl: Optional[str] = None, counter=None) -> np.ndarray:
    """Checksum check of fully read chunks where they landed: a staging buffer in HBM (or any
    tensor), without copying chunk bytes to the host (paper §3.3; the GPU restore's verify).

    Chunks with a device checksum (record v3) are checked by the device checksum kernel
    (:func:`flatcake.kernels.device_checksum.fcds_at`: Triton on CUDA, or on CPU under
    ``TRITON_INTERPRET=1``; else the bit-identical torch version) on ``buf``'s device, compared
    there; only the bool mask (one byte per chunk) comes back. Chunks with only an xxh3-64 (a
    record v2 round from an older pool) are copied to the host and checked
    with xxh3 as :func:`verify_chunks` does (one device-to-host copy of the buffer span that
    holds them) — never served unverified.

    Args:
        buf: uint8 ``[nbytes]`` staging tensor (CUDA or CPU).
        b0: int64 ``[m]`` byte offsets of the chunks in ``buf``.
        idx: int64 ``[m]`` positions of the chunks in ``chunks``.
        chunks: the restore's batch (``devsum``/``has_devsum``, ``checksum``/``has_checksum``).
        chunk_bytes: bytes per chunk.
        errors: where each mismatch is reported (``verify`` / ``checksum``, logged once).
        impl: ``"triton"``, ``"torch"`` or ``None`` (Triton where it runs).
        counter: optional object with a ``d2h_bytes`` int attribute, incremented by the bytes
            copied device-to-host (the mask, and the chunks of v2 records).

    Returns:
        bool ``[m]``: True where the chunk may be scattered.
    """
    from flatcake.kernels.device_checksum import as_int64, fcds_at

    m = b0.shape[0]
    ok = np.ones(m, dtype=bool)
    dev = chunks.has_devsum[idx]
    old = chunks.has_checksum[idx] & ~dev
    on_gpu = buf.device.type != "cpu"
    if dev.any():
        sel = np.flatnonzero(dev)
        aligned = bool((b0[sel] % 4 == 0).all())  # from the host copy: no device sync
        starts = torch.from_numpy(np.ascontiguousarray(b0[sel])).to(buf.device, non_blocking=True)
        want = torch.from_numpy(as_int64(chunks.devsum[idx[sel]])).to(buf.device, non_blocking=True)
        good = (fcds_at(buf, starts, chunk_bytes, impl, aligned) == want).cpu().numpy()  # the mask: m bytes
        if counter is not None and on_gpu:
            counter.d2h_bytes += int(good.nbytes)
        ok[sel] = good
    if old.any():
        sel = np.flatnonzero(old)
        lo, hi = int(b0[sel].min()), int(b0[sel].max()) + chunk_bytes
        host = buf[lo:hi].cpu().numpy()  # one copy of the span holding the record-v2 chunks
        if counter is not None and on_gpu:
            counter.d2h_bytes += int(host.nbytes)
        got = checksums_at(host, b0[sel] - lo, chunk_bytes)
        ok[sel] = got == chunks.checksum[idx[sel]]
    for i in idx[~ok].tolist():
        errors.report("verify", "checksum", f"chunk tag {int(chunks.tag[i])} (file "
                      f"{int(chunks.file_index[i])} @ {int(chunks.offset[i])})")
    return ok
