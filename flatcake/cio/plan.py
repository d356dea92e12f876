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
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Iterable, NamedTuple, Optional, Sequence

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


class PlannedChunk(NamedTuple):
    """A chunk placed inside a merged read (a named tuple: plans build one per chunk, so
    construction cost matters).

    Attributes:
        chunk: the descriptor.
        offset_in_read: byte offset of the chunk's first byte from the merged read's start.
    """

    chunk: ChunkRead
    offset_in_read: int


@dataclass(frozen=True, slots=True)
class MergedRead:
    """One aligned read that covers one or more chunks of one file.

    Attributes:
        file_index: SSD pool file number.
        offset: aligned byte offset in the file (multiple of the plan's ``align``).
        nbytes: aligned length in bytes (multiple of ``align``).
        chunks: the chunks it carries, sorted by offset.
        min_layer: smallest destination layer among the chunks (orders reads layer by layer).
    """

    file_index: int
    offset: int
    nbytes: int
    chunks: tuple[PlannedChunk, ...]
    min_layer: int = 0


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


def _sort_key(c: ChunkRead):
    return (c.file_index, c.offset, c.nbytes, c.tag)


def plan_reads(
    chunks: Iterable[ChunkRead], *, gap_bytes: int, max_io_bytes: int, align: int = ALIGN
) -> ReadPlan:
    """Coalesce chunk descriptors into aligned merged reads (paper §3.3 FC-CIO).

    Args:
        chunks: chunk descriptors, any order; offsets and lengths in bytes, any alignment.
        gap_bytes: bridge holes strictly smaller than this many bytes by over-reading
            (0 merges only adjacent/overlapping chunks).
        max_io_bytes: upper bound of an aligned merged read in bytes, unless a single chunk
            alone needs more (then that chunk gets its own read).
        align: alignment in bytes of every read offset and length (4096 for O_DIRECT/GDS).

    Returns:
        A :class:`ReadPlan`.

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
    items = sorted(chunks, key=_sort_key)
    reads: list[MergedRead] = []
    useful = 0
    pages: set[int] = set()
    add_page = pages.add
    PC = PlannedChunk

    cur: list[ChunkRead] = []
    cur_file = cur_start = cur_end = 0  # raw (unaligned) byte range of the current read
    cur_a0 = 0  # cur_start aligned down

    def close() -> None:
        a1 = -(-cur_end // align) * align
        reads.append(
            MergedRead(cur_file, cur_a0, a1 - cur_a0, tuple([PC(c, c.offset - cur_a0) for c in cur]),
                       min([c.layer for c in cur]))
        )

    for c in items:
        off, n = c.offset, c.nbytes
        if off < 0 or n <= 0:
            raise ValueError(f"bad chunk (offset {off}, nbytes {n}) for tag {c.tag}")
        useful += n
        add_page(c.page)
        end = off + n
        if cur and c.file_index == cur_file:
            gap = off - cur_end
            # merge: adjacent/overlapping, a hole below gap_bytes, or the aligned ranges share a block
            if gap <= 0 or gap < gap_bytes or off - off % align < -(-cur_end // align) * align:
                new_end = end if end > cur_end else cur_end
                if -(-new_end // align) * align - cur_a0 <= max_io_bytes:
                    cur.append(c)
                    cur_end = new_end
                    continue
        if cur:
            close()
        cur = [c]
        cur_file, cur_start, cur_end = c.file_index, off, end
        cur_a0 = off - off % align
    if cur:
        close()

    bytes_read = sum(r.nbytes for r in reads)
    return ReadPlan(
        reads=tuple(reads),
        pages=len(pages),
        chunks=len(items),
        bytes_read=bytes_read,
        bytes_over_read=max(0, bytes_read - useful),
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
