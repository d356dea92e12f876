"""Read planning (paper §3.3 FC-CIO): merge, bridge, align, split, batch."""

import pytest

from flatcake.cio import ChunkRead, batch_reads, plan_reads

KIB = 1024


def ch(off, n=16 * KIB, file=0, page=0, layer=0, tag=0):
    return ChunkRead(file, off, n, page, layer, tag, None)


def test_adjacent_chunks_merge_into_one_read():
    chunks = [ch(i * 16 * KIB, page=i, tag=i) for i in (3, 0, 2, 1)]
    plan = plan_reads(chunks, gap_bytes=64 * KIB, max_io_bytes=16 << 20)
    assert len(plan.reads) == 1
    r = plan.reads[0]
    assert (r.file_index, r.offset, r.nbytes) == (0, 0, 64 * KIB)
    assert [pc.offset_in_read for pc in r.chunks] == [0, 16 * KIB, 32 * KIB, 48 * KIB]
    assert [pc.chunk.tag for pc in r.chunks] == [0, 1, 2, 3]
    assert (plan.pages, plan.chunks, plan.bytes_read, plan.bytes_over_read) == (4, 4, 64 * KIB, 0)
    assert plan.read_amplification == 1.0


def test_gap_of_60k_is_bridged_and_70k_is_not():
    a, b = ch(0, tag=0), ch(16 * KIB + 60 * KIB, tag=1)
    plan = plan_reads([a, b], gap_bytes=64 * KIB, max_io_bytes=16 << 20)
    assert [(r.offset, r.nbytes) for r in plan.reads] == [(0, 92 * KIB)]
    assert plan.bytes_over_read == 60 * KIB
    assert plan.reads[0].chunks[1].offset_in_read == 76 * KIB

    c = ch(16 * KIB + 70 * KIB, tag=1)
    plan = plan_reads([a, c], gap_bytes=64 * KIB, max_io_bytes=16 << 20)
    # 86 KiB is not 4 KiB aligned: the second read starts at 84 KiB and over-reads 4 KiB
    assert [(r.offset, r.nbytes) for r in plan.reads] == [(0, 16 * KIB), (84 * KIB, 20 * KIB)]
    assert plan.bytes_read == 36 * KIB and plan.bytes_over_read == 4 * KIB


def test_gap_equal_to_gap_bytes_is_not_bridged():
    plan = plan_reads([ch(0), ch(16 * KIB + 64 * KIB)], gap_bytes=64 * KIB, max_io_bytes=16 << 20)
    assert len(plan.reads) == 2


def test_unaligned_chunks_are_aligned_outward_and_slack_counted():
    # 10 000-byte chunks starting at byte 100: the read runs [0, align_up(100 + 30 000))
    chunks = [ch(100 + i * 10_000, n=10_000, page=i, tag=i) for i in range(3)]
    plan = plan_reads(chunks, gap_bytes=0, max_io_bytes=1 << 20)
    assert [(r.offset, r.nbytes) for r in plan.reads] == [(0, 32 * KIB)]
    assert plan.bytes_over_read == 32 * KIB - 30_000
    assert [pc.offset_in_read for pc in plan.reads[0].chunks] == [100, 10_100, 20_100]
    # a lone chunk in the middle of a block: offset rounds down, end rounds up
    plan = plan_reads([ch(5000, n=3000)], gap_bytes=0, max_io_bytes=1 << 20)
    assert (plan.reads[0].offset, plan.reads[0].nbytes, plan.reads[0].chunks[0].offset_in_read) == (4096, 4096, 904)


def test_split_at_max_io_bytes_never_splits_a_chunk():
    chunks = [ch(i * 16 * KIB, page=i, tag=i) for i in range(10)]  # 160 KiB contiguous
    plan = plan_reads(chunks, gap_bytes=64 * KIB, max_io_bytes=64 * KIB)
    assert [(r.offset, r.nbytes) for r in plan.reads] == [(0, 64 * KIB), (64 * KIB, 64 * KIB), (128 * KIB, 32 * KIB)]
    assert [len(r.chunks) for r in plan.reads] == [4, 4, 2]
    assert all(r.nbytes <= 64 * KIB for r in plan.reads)
    # 24 KiB chunks with max 64 KiB: two per read (72 KiB would exceed), chunks stay whole
    chunks = [ch(i * 24 * KIB, n=24 * KIB, page=i, tag=i) for i in range(5)]
    plan = plan_reads(chunks, gap_bytes=0, max_io_bytes=64 * KIB)
    assert [len(r.chunks) for r in plan.reads] == [2, 2, 1]
    assert [(r.offset, r.nbytes) for r in plan.reads] == [(0, 48 * KIB), (48 * KIB, 48 * KIB), (96 * KIB, 24 * KIB)]


def test_chunk_larger_than_max_io_gets_its_own_read():
    chunks = [ch(0, n=16 * KIB, tag=0), ch(16 * KIB, n=100 * KIB, tag=1), ch(116 * KIB, n=16 * KIB, tag=2)]
    plan = plan_reads(chunks, gap_bytes=64 * KIB, max_io_bytes=32 * KIB)
    assert [(r.offset, r.nbytes) for r in plan.reads] == [(0, 16 * KIB), (16 * KIB, 100 * KIB), (116 * KIB, 16 * KIB)]
    assert [[pc.chunk.tag for pc in r.chunks] for r in plan.reads] == [[0], [1], [2]]


def test_chunks_of_different_files_never_merge():
    plan = plan_reads([ch(0, file=1, tag=0), ch(16 * KIB, file=0, tag=1), ch(0, file=0, tag=2)],
                      gap_bytes=64 * KIB, max_io_bytes=1 << 20)
    assert [(r.file_index, r.offset, r.nbytes) for r in plan.reads] == [(0, 0, 32 * KIB), (1, 0, 16 * KIB)]


def test_layer_major_extent_is_one_read_per_layer():
    # 128 pages x 4 layers, 16 KiB chunks, layer-major: each layer is 2 MiB contiguous
    n, layers, cb = 128, 4, 16 * KIB
    chunks = [ch((l * n + p) * cb, page=p, layer=l, tag=p) for l in range(layers) for p in range(n)]
    plan = plan_reads(chunks, gap_bytes=64 * KIB, max_io_bytes=2 * n * cb // 2)  # 2 MiB cap
    assert len(plan.reads) == layers
    assert [r.min_layer for r in plan.reads] == [0, 1, 2, 3]
    assert plan.bytes_over_read == 0 and plan.pages == n and plan.chunks == n * layers


def test_batches_fit_staging_and_follow_layer_order():
    reads = plan_reads(
        [ch(l * 64 * KIB + p * 16 * KIB, page=p, layer=l, tag=p) for l in (2, 0, 1) for p in range(4)],
        gap_bytes=0, max_io_bytes=32 * KIB).reads
    batches = batch_reads(reads, 64 * KIB)
    assert [[(r.offset, r.min_layer) for r in b] for b in batches] == [
        [(0, 0), (32 * KIB, 0)], [(64 * KIB, 1), (96 * KIB, 1)], [(128 * KIB, 2), (160 * KIB, 2)]]
    with pytest.raises(ValueError, match="exceeds staging buffer"):
        batch_reads(reads, 16 * KIB)


def test_empty_plan_and_bad_arguments():
    plan = plan_reads([], gap_bytes=0, max_io_bytes=4096)
    assert (plan.reads, plan.pages, plan.bytes_read, plan.read_amplification) == ((), 0, 0, 0.0)
    with pytest.raises(ValueError, match="max_io_bytes"):
        plan_reads([ch(0)], gap_bytes=0, max_io_bytes=100)
    with pytest.raises(ValueError, match="bad chunk"):
        plan_reads([ch(-1)], gap_bytes=0, max_io_bytes=4096)
