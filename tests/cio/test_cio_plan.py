"""Read planning (paper §3.3 FC-CIO): merge, bridge, align, split, batch."""

import pytest

from cio_util import chunk_batch, rows
from flatcake.cio import batch_reads, plan_reads

KIB = 1024


def ch(off, n=16 * KIB, file=0, page=0, layer=0, tag=0):
    """One descriptor row: (file, offset, nbytes, page, layer, tag, checksum)."""
    return (file, off, n, page, layer, tag, None)


def planned(chunks, **kw):
    return plan_reads(chunk_batch(chunks), **kw)


def test_adjacent_chunks_merge_into_one_read():
    chunks = [ch(i * 16 * KIB, page=i, tag=i) for i in (3, 0, 2, 1)]
    plan = planned(chunks, gap_bytes=64 * KIB, max_io_bytes=16 << 20)
    assert len(plan.reads) == 1
    r = plan.reads[0]
    assert (r.file_index, r.offset, r.nbytes) == (0, 0, 64 * KIB)
    assert r.offsets.tolist() == [0, 16 * KIB, 32 * KIB, 48 * KIB]
    assert r.tags == [0, 1, 2, 3]
    assert (plan.pages, plan.chunks, plan.bytes_read, plan.bytes_over_read) == (4, 4, 64 * KIB, 0)
    assert plan.read_amplification == 1.0


def test_gap_of_60k_is_bridged_and_70k_is_not():
    a, b = ch(0, tag=0), ch(16 * KIB + 60 * KIB, tag=1)
    plan = planned([a, b], gap_bytes=64 * KIB, max_io_bytes=16 << 20)
    assert [(r.offset, r.nbytes) for r in plan.reads] == [(0, 92 * KIB)]
    assert plan.bytes_over_read == 60 * KIB
    assert plan.reads[0].offsets[1] == 76 * KIB

    c = ch(16 * KIB + 70 * KIB, tag=1)
    plan = planned([a, c], gap_bytes=64 * KIB, max_io_bytes=16 << 20)
    # 86 KiB is not 4 KiB aligned: the second read starts at 84 KiB and over-reads 4 KiB
    assert [(r.offset, r.nbytes) for r in plan.reads] == [(0, 16 * KIB), (84 * KIB, 20 * KIB)]
    assert plan.bytes_read == 36 * KIB and plan.bytes_over_read == 4 * KIB


def test_gap_equal_to_gap_bytes_is_not_bridged():
    plan = planned([ch(0), ch(16 * KIB + 64 * KIB)], gap_bytes=64 * KIB, max_io_bytes=16 << 20)
    assert len(plan.reads) == 2


def test_unaligned_chunks_are_aligned_outward_and_slack_counted():
    # 10 000-byte chunks starting at byte 100: the read runs [0, align_up(100 + 30 000))
    chunks = [ch(100 + i * 10_000, n=10_000, page=i, tag=i) for i in range(3)]
    plan = planned(chunks, gap_bytes=0, max_io_bytes=1 << 20)
    assert [(r.offset, r.nbytes) for r in plan.reads] == [(0, 32 * KIB)]
    assert plan.bytes_over_read == 32 * KIB - 30_000
    assert plan.reads[0].offsets.tolist() == [100, 10_100, 20_100]
    # a lone chunk in the middle of a block: offset rounds down, end rounds up
    plan = planned([ch(5000, n=3000)], gap_bytes=0, max_io_bytes=1 << 20)
    assert (plan.reads[0].offset, plan.reads[0].nbytes, plan.reads[0].offsets[0]) == (4096, 4096, 904)


def test_split_at_max_io_bytes_never_splits_a_chunk():
    chunks = [ch(i * 16 * KIB, page=i, tag=i) for i in range(10)]  # 160 KiB contiguous
    plan = planned(chunks, gap_bytes=64 * KIB, max_io_bytes=64 * KIB)
    assert [(r.offset, r.nbytes) for r in plan.reads] == [(0, 64 * KIB), (64 * KIB, 64 * KIB), (128 * KIB, 32 * KIB)]
    assert [r.num_chunks for r in plan.reads] == [4, 4, 2]
    assert all(r.nbytes <= 64 * KIB for r in plan.reads)
    # 24 KiB chunks with max 64 KiB: two per read (72 KiB would exceed), chunks stay whole
    chunks = [ch(i * 24 * KIB, n=24 * KIB, page=i, tag=i) for i in range(5)]
    plan = planned(chunks, gap_bytes=0, max_io_bytes=64 * KIB)
    assert [r.num_chunks for r in plan.reads] == [2, 2, 1]
    assert [(r.offset, r.nbytes) for r in plan.reads] == [(0, 48 * KIB), (48 * KIB, 48 * KIB), (96 * KIB, 24 * KIB)]


def test_chunk_larger_than_max_io_gets_its_own_read():
    chunks = [ch(0, n=16 * KIB, tag=0), ch(16 * KIB, n=100 * KIB, tag=1), ch(116 * KIB, n=16 * KIB, tag=2)]
    plan = planned(chunks, gap_bytes=64 * KIB, max_io_bytes=32 * KIB)
    assert [(r.offset, r.nbytes) for r in plan.reads] == [(0, 16 * KIB), (16 * KIB, 100 * KIB), (116 * KIB, 16 * KIB)]
    assert [r.tags for r in plan.reads] == [[0], [1], [2]]


def test_chunks_of_different_files_never_merge():
    plan = planned([ch(0, file=1, tag=0), ch(16 * KIB, file=0, tag=1), ch(0, file=0, tag=2)],
                      gap_bytes=64 * KIB, max_io_bytes=1 << 20)
    assert [(r.file_index, r.offset, r.nbytes) for r in plan.reads] == [(0, 0, 32 * KIB), (1, 0, 16 * KIB)]


def test_layer_major_extent_is_one_read_per_layer():
    # 128 pages x 4 layers, 16 KiB chunks, layer-major: each layer is 2 MiB contiguous
    n, layers, cb = 128, 4, 16 * KIB
    chunks = [ch((l * n + p) * cb, page=p, layer=l, tag=p) for l in range(layers) for p in range(n)]
    plan = planned(chunks, gap_bytes=64 * KIB, max_io_bytes=2 * n * cb // 2)  # 2 MiB cap
    assert len(plan.reads) == layers
    assert [r.min_layer for r in plan.reads] == [0, 1, 2, 3]
    assert plan.bytes_over_read == 0 and plan.pages == n and plan.chunks == n * layers


def test_batches_fit_staging_and_follow_layer_order():
    reads = planned(
        [ch(l * 64 * KIB + p * 16 * KIB, page=p, layer=l, tag=p) for l in (2, 0, 1) for p in range(4)],
        gap_bytes=0, max_io_bytes=32 * KIB).reads
    batches = batch_reads(reads, 64 * KIB)
    assert [[(r.offset, r.min_layer) for r in b] for b in batches] == [
        [(0, 0), (32 * KIB, 0)], [(64 * KIB, 1), (96 * KIB, 1)], [(128 * KIB, 2), (160 * KIB, 2)]]
    with pytest.raises(ValueError, match="exceeds staging buffer"):
        batch_reads(reads, 16 * KIB)


def test_empty_plan_and_bad_arguments():
    plan = planned([], gap_bytes=0, max_io_bytes=4096)
    assert (plan.reads, plan.pages, plan.bytes_read, plan.read_amplification) == ((), 0, 0, 0.0)
    with pytest.raises(ValueError, match="max_io_bytes"):
        planned([ch(0)], gap_bytes=0, max_io_bytes=100)
    with pytest.raises(ValueError, match="bad chunk"):
        planned([ch(-1)], gap_bytes=0, max_io_bytes=4096)


# ---------------------------------------------------------------- vectorized planning (ChunkBatch)
import random  # noqa: E402

import numpy as np  # noqa: E402

from flatcake.cio import ChunkBatch  # noqa: E402


def _scalar_plan(chunks, gap_bytes, max_io_bytes, align):
    """The per-chunk merge loop the vectorized planner replaced (the rules of the module
    docstring, one chunk at a time), over rows (file, offset, nbytes, page, layer, tag, sum):
    [(file, offset, nbytes, min_layer, [(tag, offset_in_read)])]."""
    items = sorted(chunks, key=lambda c: (c[0], c[1], c[2], c[5]))
    reads, cur = [], []
    cur_file = cur_end = cur_a0 = 0

    def close():
        a1 = -(-cur_end // align) * align
        reads.append((cur_file, cur_a0, a1 - cur_a0, min(c[4] for c in cur), [(c[5], c[1] - cur_a0) for c in cur]))

    for c in items:
        off, end = c[1], c[1] + c[2]
        if cur and c[0] == cur_file:
            gap = off - cur_end
            if gap <= 0 or gap < gap_bytes or off - off % align < -(-cur_end // align) * align:
                new_end = max(end, cur_end)
                if -(-new_end // align) * align - cur_a0 <= max_io_bytes:
                    cur.append(c)
                    cur_end = new_end
                    continue
        if cur:
            close()
        cur, cur_file, cur_end, cur_a0 = [c], c[0], end, off - off % align
    if cur:
        close()
    return reads


def test_vectorized_plan_matches_the_per_chunk_merge_loop():
    rng = random.Random(7)
    for it in range(600):
        mixed = rng.random() < 0.4  # mixed sizes with overlaps: non-monotonic ends (scalar fallback)
        chunks = []
        for t in range(rng.randint(1, 40)):
            nb = rng.choice([512, 3000, 4096, 16384, 100_000]) if mixed else (4096 if it % 2 else 3000)
            off = rng.randint(0, 200_000) if rng.random() < 0.5 else rng.randint(0, 50) * nb
            chunks.append((rng.randint(0, 2), off, nb, rng.randint(0, 9), rng.randint(0, 5), t, None))
        gap = rng.choice([0, 4096, 64 * KIB])
        mx = rng.choice([4096, 8192, 64 * KIB, 1 << 20])
        al = rng.choice([4096, 512, 1])
        plan = planned(chunks, gap_bytes=gap, max_io_bytes=mx, align=al)
        got = [(r.file_index, r.offset, r.nbytes, r.min_layer, list(zip(r.tags, r.offsets.tolist())))
               for r in plan.reads]
        assert got == _scalar_plan(chunks, gap, mx, al), (it, chunks, gap, mx, al)
        assert plan.bytes_read == sum(r.nbytes for r in plan.reads)
        assert plan.bytes_over_read == max(0, plan.bytes_read - sum(c[2] for c in chunks))  # overlaps: 0
        assert plan.pages == len({c[3] for c in chunks}) and plan.chunks == len(chunks)


def test_chunk_batch_arrays_and_plan_index_arrays():
    chunks = [(0, (l * 8 + p) * 16 * KIB, 16 * KIB, p, l, p, (p * 31 + l) if p % 2 else None)
              for l in range(3) for p in range(8)][::-1]
    batch = chunk_batch(chunks)
    assert len(batch) == 24 and batch.nbytes == 16 * KIB
    assert batch.file_index.dtype == np.int64 and batch.checksum.dtype == np.uint64
    assert rows(batch) == chunks
    assert list(batch.has_checksum) == [c[6] is not None for c in chunks]
    p_batch = plan_reads(batch, gap_bytes=0, max_io_bytes=64 * KIB)
    assert [r.num_chunks for r in p_batch.reads] == [4] * 6
    for r in p_batch.reads:
        assert r.batch is batch and r.index.dtype == np.int64 and r.offsets.dtype == np.int64
        assert r.tags == [chunks[i][5] for i in r.index.tolist()]
        assert (r.offsets == batch.offset[r.index] - r.offset).all()
    assert len(chunk_batch([])) == 0
    with pytest.raises(ValueError, match="entries"):
        ChunkBatch([0, 1], [0, 1], [0], [0, 0], [0, 1], 4096)
