"""Read planning for FC-CIO (paper §3.3): turn per-chunk descriptors into few large reads.

Lifecycle of a restore: **plan** (this module) → read (``engines``) → scatter (``kernels``)
→ release (``staging``). Planning is pure arithmetic on descriptors; it touches no file.

1. Sort the chunk descriptors by ``(file_index, offset)``.
2. Merge neighbours: a chunk joins the current merged read when it is adjacent or overlaps it,
   when the hole before it is smaller than ``gap_bytes`` (the hole is *over-read*: one larger
   sequential read beats two small ones on an SSD), or when the two aligned ranges share a block.
3. Align every merged read outward to ``align`` bytes (offset down, end up) so it can be issued
   with O_DIRECT / GDS into an aligned buffer.
4. Never let an aligned merged read exceed ``max_io_bytes``; a chunk that would push it over
   starts a new read. A chunk is never split across reads, so a chunk larger than
   ``max_io_bytes`` gets a read of its own.

Read amplification of a plan is ``bytes_read / chunk bytes``; ``bytes_over_read`` counts the
extra bytes (bridged holes plus alignment slack).

Descriptors travel as a :class:`ChunkBatch` (one numpy array per field): a 1 GiB restore of
512 KiB pages is 32K (page, layer) chunks, and per-chunk Python objects (build, sort, wrap)
used to cost more CPU than the reads. Planning is vectorized (``np.lexsort`` + boundary masks);
Python loops run only over merged reads. :class:`ChunkBatch` is the one descriptor type of
the planner and of :meth:`flatcake.cio.restore.RestoreEngine.restore`. The one-call restore
(:mod:`flatcake.cio.native_restore`) makes the same plan in C (:mod:`flatcake.cio.native_plan_c`,
tested array for array against this one): next to a busy Python thread each sort or gather
here over a few thousand descriptors gives the GIL up and can wait a 5 ms switch interval.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Sequence

import numpy as np

from flatcake.common.align import ALIGN, align_down, align_up


def _i64(x) -> np.ndarray:
    return np.ascontiguousarray(x, dtype=np.int64).reshape(-1)


class ChunkBatch:
    """Chunk descriptors of one restore as parallel numpy arrays: entry ``i`` of every array
    describes chunk ``i``, the bytes of one (page, layer) of a KV page on SSD.

    Attributes:
        file_index: int64 ``[n]`` SSD pool file numbers.
        offset: int64 ``[n]`` byte offsets of the chunks in their files; any alignment.
        page: int64 ``[n]`` destination page indices in the target layout.
        layer: int64 ``[n]`` destination layers.
        tag: int64 ``[n]`` caller's ids, reported in ``failed_tags``.
        checksum: uint64 ``[n]`` expected ``xxh3_64_intdigest`` of the chunk bytes (0 where absent).
        has_checksum: bool ``[n]`` whether ``checksum[i]`` is meaningful.
        devsum: uint64 ``[n]`` expected device checksum of the chunk bytes
            (:mod:`flatcake.kernels.device_checksum`; 0 where absent): a GPU restore verifies
            these in HBM; chunks without one fall back to ``checksum`` (host copy).
        has_devsum: bool ``[n]`` whether ``devsum[i]`` is meaningful (False everywhere unless given).
        nbytes: chunk size in bytes: an ``int`` shared by every chunk (``chunk_bytes``: what the
            restore path builds), or an int64 ``[n]`` array when sizes differ.

    Raises:
        ValueError: arrays of different lengths (the message names the field).

    The arrays are not copied when they already have the right dtype; do not mutate them while
    a plan built from the batch is in use.
    """

    __slots__ = ("file_index", "offset", "page", "layer", "tag", "checksum", "has_checksum", "devsum", "has_devsum",
                 "nbytes")

    def __init__(self, file_index, offset, page, layer, tag, nbytes, checksum=None, has_checksum=None, devsum=None,
                 has_devsum=None):
        self.file_index = _i64(file_index)
        n = self.file_index.shape[0]
        self.offset = _i64(offset)
        self.page = _i64(page)
        self.layer = _i64(layer)
        self.tag = _i64(tag)
        if checksum is None:
            self.checksum = np.zeros(n, dtype=np.uint64)
            self.has_checksum = np.zeros(n, dtype=bool) if has_checksum is None else \
                np.ascontiguousarray(has_checksum, dtype=bool).reshape(-1)
        else:
            self.checksum = np.ascontiguousarray(checksum, dtype=np.uint64).reshape(-1)
            self.has_checksum = np.ones(n, dtype=bool) if has_checksum is None else \
                np.ascontiguousarray(has_checksum, dtype=bool).reshape(-1)
        self.devsum = np.zeros(n, dtype=np.uint64) if devsum is None else \
            np.ascontiguousarray(devsum, dtype=np.uint64).reshape(-1)
        self.has_devsum = np.zeros(n, dtype=bool) if has_devsum is None else \
            np.ascontiguousarray(has_devsum, dtype=bool).reshape(-1)
        if isinstance(nbytes, (int, np.integer)):
            self.nbytes = int(nbytes)
        else:
            nb = _i64(nbytes)
            self.nbytes = int(nb[0]) if (nb.shape[0] and (nb == nb[0]).all()) else nb
        for name in ("offset", "page", "layer", "tag", "checksum", "has_checksum", "devsum", "has_devsum"):
            if getattr(self, name).shape[0] != n:
                raise ValueError(f"ChunkBatch.{name} has {getattr(self, name).shape[0]} entries, expected {n}")
        if not isinstance(self.nbytes, int) and self.nbytes.shape[0] != n:
            raise ValueError(f"ChunkBatch.nbytes has {self.nbytes.shape[0]} entries, expected {n}")

    def __len__(self) -> int:
        return int(self.file_index.shape[0])

    def size_of(self, i: int) -> int:
        """Size in bytes of chunk ``i``."""
        return self.nbytes if isinstance(self.nbytes, int) else int(self.nbytes[i])

    def __repr__(self) -> str:
        return f"ChunkBatch({len(self)} chunks, nbytes={self.nbytes if isinstance(self.nbytes, int) else 'mixed'})"


class MergedRead:
    """One aligned read that covers one or more chunks of one file.

    Attributes:
        file_index: SSD pool file number.
        offset: aligned byte offset in the file (multiple of the plan's ``align``).
        nbytes: aligned length in bytes (multiple of ``align``).
        min_layer: smallest destination layer among the chunks (orders reads layer by layer).
        batch: the :class:`ChunkBatch` the chunks come from.
        index: int64 ``[k]`` positions in ``batch`` of the chunks this read carries, sorted by
            file offset.
        offsets: int64 ``[k]`` byte offset of each of those chunks from the read's start.
    """

    __slots__ = ("file_index", "offset", "nbytes", "min_layer", "batch", "index", "offsets")

    def __init__(self, file_index: int, offset: int, nbytes: int, min_layer: int, batch: ChunkBatch,
                 index: np.ndarray, offsets: np.ndarray):
        self.file_index = file_index
        self.offset = offset
        self.nbytes = nbytes
        self.min_layer = min_layer
        self.batch = batch
        self.index = index
        self.offsets = offsets

    @property
    def num_chunks(self) -> int:
        """Number of chunks carried."""
        return int(self.index.shape[0])

    @property
    def tags(self) -> list[int]:
        """Tags of the chunks carried, in file-offset order."""
        return self.batch.tag[self.index].tolist()

    def __repr__(self) -> str:
        return (f"MergedRead(file_index={self.file_index}, offset={self.offset}, nbytes={self.nbytes}, "
                f"chunks={self.num_chunks}, min_layer={self.min_layer})")


@dataclass(frozen=True, slots=True)
class ReadPlan:
    """Result of :func:`plan_reads`.

    Attributes:
        reads: merged reads, sorted by (file, offset).
        pages: distinct destination pages.
        chunks: chunk descriptors planned.
        bytes_read: Σ merged read lengths in bytes (what the device will transfer).
        bytes_over_read: ``bytes_read - Σ chunk bytes`` (bridged holes + alignment slack), ≥ 0.
    """

    reads: tuple[MergedRead, ...]
    pages: int
    chunks: int
    bytes_read: int
    bytes_over_read: int

    @property
    def read_amplification(self) -> float:
        """``bytes_read / Σ chunk bytes`` (1.0 is ideal); 0.0 for an empty plan."""
        useful = self.bytes_read - self.bytes_over_read
        return self.bytes_read / useful if useful else 0.0


def _read_starts_scalar(fo, oo, eo, gap_bytes: int, max_io_bytes: int, align: int) -> list[int]:
    """Reference merge loop over sorted chunks (file ``fo``, offset ``oo``, end ``eo``: lists);
    returns the sorted positions where a merged read starts. Used when chunk ends are not
    monotonic within a file (overlapping chunks of different sizes), where the vectorized rules
    of :func:`_read_starts` would need the running maximum of the ends."""
    starts: list[int] = []
    cur_file = cur_end = cur_a0 = 0
    for i, (f, off, end) in enumerate(zip(fo, oo, eo)):
        if starts and f == cur_file:
            gap = off - cur_end
            if gap <= 0 or gap < gap_bytes or align_down(off, align) < align_up(cur_end, align):
                new_end = end if end > cur_end else cur_end
                if align_up(new_end, align) - cur_a0 <= max_io_bytes:
                    cur_end = new_end
                    continue
        starts.append(i)
        cur_file, cur_end, cur_a0 = f, end, align_down(off, align)
    return starts


def _read_starts(fo, oo, eo, astart, aend, gap_bytes: int, max_io_bytes: int, align: int) -> np.ndarray:
    """Sorted positions (into the sorted chunks) where a merged read starts.

    Args:
        fo, oo, eo: int64 ``[n]`` file, offset and end byte of each chunk, sorted by (file, offset).
        astart, aend: int64 ``[n]`` the chunks' aligned start and end.
        gap_bytes, max_io_bytes, align: as :func:`plan_reads`.
    """
    n = fo.shape[0]
    same = fo[1:] == fo[:-1]
    if not bool(np.all(~same | (eo[1:] >= eo[:-1]))):  # needs the running maximum of the ends
        return np.asarray(_read_starts_scalar(fo.tolist(), oo.tolist(), eo.tolist(), gap_bytes,
                                              max_io_bytes, align), dtype=np.int64)
    # ends monotonic within a file: the read's running end is the previous chunk's end
    gap = oo[1:] - eo[:-1]
    link = same & ((gap <= 0) | (gap < gap_bytes) | (astart[1:] < aend[:-1]))
    seg = np.flatnonzero(~link) + 1
    seg_lo = np.concatenate(([0], seg))
    seg_hi = np.concatenate((seg, [n]))
    fits = aend[seg_hi - 1] - astart[seg_lo] <= max_io_bytes
    if fits.all():
        return seg_lo
    extra: list[int] = []
    for s, e in zip(seg_lo[~fits].tolist(), seg_hi[~fits].tolist()):
        i = s
        while i < e:  # greedy split: one searchsorted per read
            if i != s:
                extra.append(i)
            j = i + int(np.searchsorted(aend[i:e], astart[i] + max_io_bytes, side="right"))
            i = j if j > i else i + 1
    return np.sort(np.concatenate((seg_lo, np.asarray(extra, dtype=np.int64))))


def plan_reads(batch: ChunkBatch, *, gap_bytes: int, max_io_bytes: int, align: int = ALIGN) -> ReadPlan:
    """Coalesce chunk descriptors into aligned merged reads (paper §3.3 FC-CIO).

    Vectorized: one ``np.lexsort`` by (file, offset, size, tag), merge boundaries from array
    differences, and a Python loop only over merge segments that exceed ``max_io_bytes``
    (one ``searchsorted`` per resulting read). A chunk joins the read before it when both are
    in the same file and it is adjacent or overlapping, or the hole before it is
    ``< gap_bytes``, or its aligned start falls in the read's last aligned block; and the
    aligned read stays ``<= max_io_bytes`` (a chunk is never split; one larger than
    ``max_io_bytes`` gets its own read).

    Args:
        batch: the chunks, in any order; offsets and lengths in bytes, any alignment.
        gap_bytes: bridge holes strictly smaller than this many bytes by over-reading
            (0 merges only adjacent/overlapping chunks).
        max_io_bytes: upper bound of an aligned merged read in bytes, unless a single chunk
            alone needs more (then that chunk gets its own read).
        align: alignment in bytes of every read offset and length (4096 for O_DIRECT/GDS).

    Returns:
        A :class:`ReadPlan` whose reads reference ``batch``.

    Raises:
        ValueError: ``align`` not positive, ``gap_bytes`` negative, ``max_io_bytes`` smaller than
            ``align``, or a chunk with negative offset or non-positive length.
    """
    if align <= 0:
        raise ValueError(f"align must be positive, got {align}")
    if gap_bytes < 0:
        raise ValueError(f"gap_bytes must be >= 0, got {gap_bytes}")
    if max_io_bytes < align:
        raise ValueError(f"max_io_bytes ({max_io_bytes}) must be >= align ({align})")
    n = len(batch)
    if n == 0:
        return ReadPlan(reads=(), pages=0, chunks=0, bytes_read=0, bytes_over_read=0)
    uniform = isinstance(batch.nbytes, int)
    if uniform:
        order = np.lexsort((batch.tag, batch.offset, batch.file_index))
        so = batch.nbytes
    else:
        order = np.lexsort((batch.tag, batch.nbytes, batch.offset, batch.file_index))
        so = batch.nbytes[order]
    fo, oo = batch.file_index[order], batch.offset[order]
    eo = oo + so
    bad = (oo < 0) | (so <= 0)
    if bad.any():
        i = int(np.argmax(bad))
        raise ValueError(f"bad chunk (offset {int(oo[i])}, nbytes {batch.size_of(order[i])}) "
                         f"for tag {int(batch.tag[order[i]])}")
    astart, aend = align_down(oo, align), align_up(eo, align)  # aligned range of each chunk
    starts = _read_starts(fo, oo, eo, astart, aend, gap_bytes, max_io_bytes, align)
    r_a0 = astart[starts]
    r_nb = align_up(np.maximum.reduceat(eo, starts), align) - r_a0
    r_minl = np.minimum.reduceat(batch.layer[order], starts)
    offs = oo - np.repeat(r_a0, np.diff(np.concatenate((starts, [n]))))
    bounds = np.concatenate((starts, [n])).tolist()
    reads = tuple(
        MergedRead(f, o, nb, ml, batch, order[lo:hi], offs[lo:hi])
        for f, o, nb, ml, lo, hi in zip(fo[starts].tolist(), r_a0.tolist(), r_nb.tolist(), r_minl.tolist(),
                                        bounds[:-1], bounds[1:])
    )
    bytes_read = int(r_nb.sum())
    useful = n * so if uniform else int(so.sum())
    # distinct pages by a Python set: np.unique sorts, and every sort gives the GIL up
    return ReadPlan(reads=reads, pages=len(set(batch.page.tolist())), chunks=n, bytes_read=bytes_read,
                    bytes_over_read=max(0, bytes_read - int(useful)))


def batch_reads(reads: Sequence[MergedRead], capacity: int) -> list[list[MergedRead]]:
    """Cut merged reads into batches that each fit one staging buffer, in layer order.

    Reads are ordered by (smallest destination layer, file, offset) so that, for layer-major
    extents, batch *i* holds the early layers and the scatter of layer *l* can run while the
    reads of layer *l+1* fill the other buffer. Reads are packed greedily and back to back
    (every read length is a multiple of the alignment, so each read's buffer slot stays aligned).

    Args:
        reads: merged reads of one plan.
        capacity: bytes of one staging buffer.

    Returns:
        Batches (lists of reads) whose total length is ``<= capacity`` each.

    Raises:
        ValueError: a single read longer than ``capacity`` (size the plan's ``max_io_bytes``
            to at most the staging buffer).
    """
    ordered = sorted(reads, key=lambda r: (r.min_layer, r.file_index, r.offset))
    batches: list[list[MergedRead]] = []
    cur: list[MergedRead] = []
    used = 0
    for r in ordered:
        if r.nbytes > capacity:
            raise ValueError(f"merged read of {r.nbytes} bytes exceeds staging buffer of {capacity} bytes")
        if cur and used + r.nbytes > capacity:
            batches.append(cur)
            cur, used = [], 0
        cur.append(r)
        used += r.nbytes
    if cur:
        batches.append(cur)
    return batches
