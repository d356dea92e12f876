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
Python loops run only over merged reads. A sequence of :class:`ChunkRead` is still accepted
(converted with :meth:`ChunkBatch.from_chunks`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Iterable, NamedTuple, Optional, Sequence, Union

import numpy as np

from flatcake.config import ALIGN


@dataclass(frozen=True, slots=True)
class ChunkRead:
    """One (page, layer) chunk to restore from SSD.

    Attributes:
        file_index: SSD pool file number (the engine maps it to a path with ``path_of``).
        offset: byte offset of the chunk in that file; any alignment.
        nbytes: chunk size in bytes (``PageGeometry.chunk_bytes``).
        page: destination page index in the target :class:`~flatcake.layout.KvPageLayout`.
        layer: destination layer.
        tag: caller's id (e.g. position of the page in the call); reported on failure.
        checksum: expected ``xxhash.xxh3_64_intdigest`` of the chunk bytes, or ``None``.
    """

    file_index: int
    offset: int
    nbytes: int
    page: int
    layer: int
    tag: int
    checksum: Optional[int] = None


def _i64(x) -> np.ndarray:
    return np.ascontiguousarray(x, dtype=np.int64).reshape(-1)


class ChunkBatch:
    """Chunk descriptors of one restore as parallel numpy arrays (the vectorized form of a
    sequence of :class:`ChunkRead`; entry ``i`` of every array describes chunk ``i``).

    Attributes:
        file_index: int64 ``[n]`` SSD pool file numbers.
        offset: int64 ``[n]`` byte offsets of the chunks in their files; any alignment.
        page: int64 ``[n]`` destination page indices in the target layout.
        layer: int64 ``[n]`` destination layers.
        tag: int64 ``[n]`` caller's ids, reported in ``failed_tags``.
        checksum: uint64 ``[n]`` expected ``xxh3_64_intdigest`` of the chunk bytes (0 where absent).
        has_checksum: bool ``[n]`` whether ``checksum[i]`` is meaningful.
        nbytes: chunk size in bytes: an ``int`` shared by every chunk (``chunk_bytes``: what the
            restore path builds), or an int64 ``[n]`` array when sizes differ (planner tests).

    The arrays are not copied when they already have the right dtype; do not mutate them while
    a plan built from the batch is in use.
    """

    __slots__ = ("file_index", "offset", "page", "layer", "tag", "checksum", "has_checksum", "nbytes")

    def __init__(self, file_index, offset, page, layer, tag, nbytes, checksum=None, has_checksum=None):
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
        if isinstance(nbytes, (int, np.integer)):
            self.nbytes = int(nbytes)
        else:
            nb = _i64(nbytes)
            self.nbytes = int(nb[0]) if (nb.shape[0] and (nb == nb[0]).all()) else nb
        for name in ("offset", "page", "layer", "tag", "checksum", "has_checksum"):
            if getattr(self, name).shape[0] != n:
                raise ValueError(f"ChunkBatch.{name} has {getattr(self, name).shape[0]} entries, expected {n}")
        if not isinstance(self.nbytes, int) and self.nbytes.shape[0] != n:
            raise ValueError(f"ChunkBatch.nbytes has {self.nbytes.shape[0]} entries, expected {n}")

    @classmethod
    def from_chunks(cls, chunks: Iterable[ChunkRead]) -> "ChunkBatch":
        """Convert :class:`ChunkRead` descriptors (any iterable) into a batch, in the same order."""
        cs = list(chunks)
        if not cs:
            return cls(*([np.zeros(0, np.int64)] * 5), nbytes=0)
        sums = [c.checksum for c in cs]
        has = np.array([s is not None for s in sums], dtype=bool)
        return cls(
            [c.file_index for c in cs], [c.offset for c in cs], [c.page for c in cs], [c.layer for c in cs],
            [c.tag for c in cs], [c.nbytes for c in cs],
            checksum=np.array([0 if s is None else s for s in sums], dtype=np.uint64), has_checksum=has,
        )

    def __len__(self) -> int:
        return int(self.file_index.shape[0])

    def sizes(self) -> np.ndarray:
        """int64 ``[n]`` chunk sizes in bytes (``nbytes`` broadcast)."""
        if isinstance(self.nbytes, int):
            return np.full(len(self), self.nbytes, dtype=np.int64)
        return self.nbytes

    def size_of(self, i: int) -> int:
        """Size in bytes of chunk ``i``."""
        return self.nbytes if isinstance(self.nbytes, int) else int(self.nbytes[i])

    def chunk(self, i: int) -> ChunkRead:
        """Descriptor ``i`` as a :class:`ChunkRead` (for messages, tests and compatibility)."""
        i = int(i)
        return ChunkRead(int(self.file_index[i]), int(self.offset[i]), self.size_of(i), int(self.page[i]),
                         int(self.layer[i]), int(self.tag[i]),
                         int(self.checksum[i]) if self.has_checksum[i] else None)

    def to_chunks(self) -> list[ChunkRead]:
        """All descriptors as :class:`ChunkRead` objects, in order."""
        return [self.chunk(i) for i in range(len(self))]

    def __repr__(self) -> str:
        return f"ChunkBatch({len(self)} chunks, nbytes={self.nbytes if isinstance(self.nbytes, int) else 'mixed'})"


class PlannedChunk(NamedTuple):
    """A chunk placed inside a merged read (compatibility view; see :attr:`MergedRead.chunks`).

    Attributes:
        chunk: the descriptor.
        offset_in_read: byte offset of the chunk's first byte from the merged read's start.
    """

    chunk: ChunkRead
    offset_in_read: int


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

    ``chunks`` (a tuple of :class:`PlannedChunk`) is built on access, for tests and callers of
    the per-object API; the restore path uses ``index``/``offsets``. Constructing a read from
    ``chunks`` (the old signature) still works.
    """

    __slots__ = ("file_index", "offset", "nbytes", "min_layer", "batch", "index", "offsets")

    def __init__(self, file_index: int, offset: int, nbytes: int, chunks: Sequence[PlannedChunk] = (),
                 min_layer: int = 0, *, batch: Optional[ChunkBatch] = None, index=None, offsets=None):
        self.file_index = file_index
        self.offset = offset
        self.nbytes = nbytes
        self.min_layer = min_layer
        if batch is None:
            chunks = tuple(chunks)
            batch = ChunkBatch.from_chunks([pc.chunk for pc in chunks])
            index = np.arange(len(chunks), dtype=np.int64)
            offsets = np.array([pc.offset_in_read for pc in chunks], dtype=np.int64)
        self.batch = batch
        self.index = index
        self.offsets = offsets

    @property
    def chunks(self) -> tuple[PlannedChunk, ...]:
        """The chunks it carries, sorted by offset, as :class:`PlannedChunk` (built on access)."""
        b = self.batch
        return tuple(PlannedChunk(b.chunk(i), o) for i, o in zip(self.index.tolist(), self.offsets.tolist()))

    @property
    def num_chunks(self) -> int:
        """Number of chunks carried."""
        return int(self.index.shape[0])

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


def _align_down(x: int, a: int) -> int:
    return x - x % a


def _align_up(x: int, a: int) -> int:
    return -(-x // a) * a


def _read_starts_scalar(fo, oo, eo, gap_bytes: int, max_io_bytes: int, align: int) -> list[int]:
    """Reference merge loop over sorted chunks (file ``fo``, offset ``oo``, end ``eo``: lists);
    returns the sorted positions where a merged read starts. Used when chunk ends are not
    monotonic within a file (overlapping chunks of different sizes), where the vectorized rules
    below would need the running maximum of the ends."""
    starts: list[int] = []
    cur_file = cur_end = cur_a0 = 0
    for i, (f, off, end) in enumerate(zip(fo, oo, eo)):
        if starts and f == cur_file:
            gap = off - cur_end
            if gap <= 0 or gap < gap_bytes or off - off % align < -(-cur_end // align) * align:
                new_end = end if end > cur_end else cur_end
                if -(-new_end // align) * align - cur_a0 <= max_io_bytes:
                    cur_end = new_end
                    continue
        starts.append(i)
        cur_file, cur_end, cur_a0 = f, end, off - off % align
    return starts


def plan_reads(
    chunks: Union[ChunkBatch, Iterable[ChunkRead]], *, gap_bytes: int, max_io_bytes: int, align: int = ALIGN
) -> ReadPlan:
    """Coalesce chunk descriptors into aligned merged reads (paper §3.3 FC-CIO).

    Vectorized: one ``np.lexsort`` by (file, offset, size, tag), merge boundaries from array
    differences, and a Python loop only over merge segments that exceed ``max_io_bytes``
    (one ``searchsorted`` per resulting read). Same rules and result as the scalar loop:
    a chunk joins the read before it when both are in the same file and it is adjacent or
    overlapping, or the hole before it is ``< gap_bytes``, or its aligned start falls in the
    read's last aligned block; and the aligned read stays ``<= max_io_bytes`` (a chunk is never
    split; one larger than ``max_io_bytes`` gets its own read).

    Args:
        chunks: a :class:`ChunkBatch`, or :class:`ChunkRead` descriptors in any order; offsets
            and lengths in bytes, any alignment.
        gap_bytes: bridge holes strictly smaller than this many bytes by over-reading
            (0 merges only adjacent/overlapping chunks).
        max_io_bytes: upper bound of an aligned merged read in bytes, unless a single chunk
            alone needs more (then that chunk gets its own read).
        align: alignment in bytes of every read offset and length (4096 for O_DIRECT/GDS).

    Returns:
        A :class:`ReadPlan` whose reads reference the (possibly converted) batch.

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
    batch = chunks if isinstance(chunks, ChunkBatch) else ChunkBatch.from_chunks(chunks)
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
    fo = batch.file_index[order]
    oo = batch.offset[order]
    eo = oo + so
    bad = (oo < 0) | (so <= 0)
    if bad.any():
        i = int(np.argmax(bad))
        raise ValueError(f"bad chunk (offset {int(oo[i])}, nbytes {batch.size_of(order[i])}) "
                         f"for tag {int(batch.tag[order[i]])}")
    useful = n * so if uniform else int(so.sum())
    a = align
    astart = oo - oo % a  # aligned start of each chunk
    aend = -(-eo // a) * a  # aligned end of each chunk
    same = fo[1:] == fo[:-1]
    if bool(np.all(~same | (eo[1:] >= eo[:-1]))):
        # ends monotonic within a file: the read's running end is the previous chunk's end
        prev_end = eo[:-1]
        gap = oo[1:] - prev_end
        link = same & ((gap <= 0) | (gap < gap_bytes) | (astart[1:] < aend[:-1]))
        seg = np.flatnonzero(~link) + 1
        seg_lo = np.concatenate(([0], seg))
        seg_hi = np.concatenate((seg, [n]))
        fits = aend[seg_hi - 1] - astart[seg_lo] <= max_io_bytes
        if fits.all():
            starts = seg_lo
        else:
            extra: list[int] = []
            for s, e in zip(seg_lo[~fits].tolist(), seg_hi[~fits].tolist()):
                i = s
                while i < e:  # greedy split: one searchsorted per read
                    if i != s:
                        extra.append(i)
                    j = i + int(np.searchsorted(aend[i:e], astart[i] + max_io_bytes, side="right"))
                    i = j if j > i else i + 1
            starts = np.sort(np.concatenate((seg_lo, np.asarray(extra, dtype=np.int64))))
    else:
        starts = np.asarray(_read_starts_scalar(fo.tolist(), oo.tolist(), eo.tolist(), gap_bytes,
                                                max_io_bytes, a), dtype=np.int64)
    r_a0 = astart[starts]
    r_a1 = -(-np.maximum.reduceat(eo, starts) // a) * a
    r_nb = r_a1 - r_a0
    r_minl = np.minimum.reduceat(batch.layer[order], starts)
    counts = np.diff(np.concatenate((starts, [n])))
    offs = oo - np.repeat(r_a0, counts)
    bounds = np.concatenate((starts, [n])).tolist()
    reads = tuple(
        MergedRead(f, o, nb, min_layer=ml, batch=batch, index=order[lo:hi], offsets=offs[lo:hi])
        for f, o, nb, ml, lo, hi in zip(fo[starts].tolist(), r_a0.tolist(), r_nb.tolist(), r_minl.tolist(),
                                        bounds[:-1], bounds[1:])
    )
    bytes_read = int(r_nb.sum())
    return ReadPlan(
        reads=reads,
        pages=int(np.unique(batch.page).shape[0]),
        chunks=n,
        bytes_read=bytes_read,
        bytes_over_read=max(0, bytes_read - int(useful)),
    )

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
