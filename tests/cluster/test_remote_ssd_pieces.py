"""Remote SSD reads without a namespace: the owner's graduated pieces (small first and last
piece, equal middle ones) and the reader's bulk check-and-copy of a pulled piece."""

from __future__ import annotations

import numpy as np
import xxhash

from flatcake.cluster.remote_ssd import plan_pieces
from flatcake.cluster.remote_ssd_reader import copy_verified

MIB = 1 << 20
FILE = 1 << 30


def _layer_major(pages: int, layers: int, chunk: int) -> list:
    """Request ranges of a layer-major round: chunk (p, l) at (l * pages + p) * chunk, page-major order."""
    return [((l * pages + p) * chunk, chunk) for p in range(pages) for l in range(layers)]


def test_edge_bytes_make_the_first_and_last_piece_small_and_the_middle_ones_equal():
    ranges = _layer_major(128, 4, 65536)  # 32 MiB, one run
    assert [p.used for p in plan_pieces(ranges, FILE, 16 * MIB)] == [16 * MIB, 16 * MIB]
    pieces = plan_pieces(ranges, FILE, 16 * MIB, edge_bytes=4 * MIB)
    assert [p.used for p in pieces] == [4 * MIB, 12 * MIB, 12 * MIB, 4 * MIB]
    assert [[(fi, fo, n) for fi, fo, n, _ in p.runs] for p in pieces] == \
        [[(0, 0, 4 * MIB)], [(0, 4 * MIB, 12 * MIB)], [(0, 16 * MIB, 12 * MIB)], [(0, 28 * MIB, 4 * MIB)]]
    # every range exactly once, at its offset in its piece's run
    where = {j: (k, so) for k, p in enumerate(pieces) for j, so in p.chunks}
    assert sorted(where) == list(range(len(ranges)))
    for j, (off, _n) in enumerate(ranges):
        k, so = where[j]
        fi, fo, n, run_so = pieces[k].runs[0]
        assert fo <= off < fo + n and so == run_so + off - fo
    # 64 MiB in 16 MiB slots: 4 MiB, then the 56 MiB between the edges as 4 equal pieces of <= a slot
    big = plan_pieces(_layer_major(256, 4, 65536), FILE, 16 * MIB, edge_bytes=4 * MIB)
    assert [p.used for p in big] == [4 * MIB, 14 * MIB, 14 * MIB, 14 * MIB, 14 * MIB, 4 * MIB]
    # a request of at most two edges is packed as before
    assert [p.used for p in plan_pieces(_layer_major(32, 4, 65536), FILE, 16 * MIB, edge_bytes=4 * MIB)] == [8 * MIB]


def test_copy_verified_copies_matching_chunks_and_marks_mismatches():
    rng = np.random.default_rng(7)
    cb, pages, layers = 4096, 16, 4
    land = rng.integers(0, 256, (pages * layers + 4) * cb, dtype=np.uint8)
    # layer-major in the landing buffer (after 2 chunks of something else), pages' chunks as rows
    starts = np.array([(2 + l * pages + p) * cb for l in range(layers) for p in range(pages)], dtype=np.int64)
    rows_at = np.array([p * layers + l for l in range(layers) for p in range(pages)], dtype=np.int64)
    want = np.zeros(pages * layers, dtype=np.uint64)
    for s, g in zip(starts, rows_at):
        want[g] = xxhash.xxh3_64_intdigest(land[s: s + cb].tobytes())
    want[9] ^= 1  # page 2, layer 1 torn
    state = np.zeros(pages * layers, dtype=np.int8)
    rows = np.zeros((pages * layers, cb), dtype=np.uint8)
    copy_verified(land, starts, rows_at, want, state, rows)
    assert state[9] == -1 and (np.delete(state, 9) == 1).all()
    assert not rows[9].any()  # a mismatch is never copied
    for s, g in zip(starts, rows_at):
        if g != 9:
            assert bytes(rows[g]) == land[s: s + cb].tobytes()
    # chunks in no particular order (one copy each) land the same way
    perm = rng.permutation(len(starts))
    state2, rows2 = np.zeros_like(state), np.zeros_like(rows)
    copy_verified(land, starts[perm], rows_at[perm], want, state2, rows2)
    assert (state2 == state).all() and (rows2 == rows).all()

