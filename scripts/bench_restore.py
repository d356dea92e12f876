#!/usr/bin/env python3
"""Restore benchmark (paper §3.3 FC-CIO): one long session's prefix read back from SSD.

Writes a session of ``--tokens`` tokens of a model profile through five layouts, drops the page
cache of every file it will read (``fdatasync`` + ``posix_fadvise(DONTNEED)``), restores the
whole prefix into an SGLang host pool, verifies the bytes, and reports in one run:

* ``flatcake``     FlatCake through SGLang's dynamic factory (``FlatCakeStorage``):
                   ``batch_set_v1`` in rounds of 128 pages (layer-major extents), then
                   ``batch_get_v1`` in calls of 128 pages (FC-CIO: coalesced O_DIRECT reads,
                   double-buffered staging window, scatter);
* ``hicache_file`` SGLang's HiCacheFile (one file per page) through sglang's factory, read the
                   way SGLang's controller reads a generic backend (``batch_get`` into flat
                   dummy pages, then ``set_from_flat_data_page``); as SGLang ships it, except
                   that the dummy pages are allocated once, outside the clock;
* ``scattered``    page-wise: the same pages one per slot in eviction order (a random
                   permutation) in one shared file, as tiered stores lay them out, one O_DIRECT
                   read per page;
* ``scattered-layerwise``  page-wise by layer: the same (page, layer) chunks, one per 4 KiB-aligned
                   slot, each layer's pages in eviction order, one O_DIRECT read per chunk,
                   layer by layer (as a layer-pipelined tiered restore issues them);
* ``sequential``   one O_DIRECT stream of 16 MiB reads of the same number of bytes from one file,
                   queue depth 1, no copy: our own single-stream read, kept for comparison with
                   earlier runs (it is *not* the disk's limit);
* ``fio``          the disk's limit: fio's best sequential O_DIRECT read (libaio, queue depth
                   32, the best of 1, 4 and 16 MiB requests; ``scripts/fio_limit.py``) of a file
                   of the same size on the same file system, laid out once per cell and read
                   once in every measured pass, in the rotation with the systems. Each system's
                   ``ratio_to_fio`` is the median over the passes of its GB/s over that pass's fio.

The page-wise baselines are the best page-wise reader we could write (issue 23, item 7): the
whole restore's reads go to ``csrc/pagewise_read.c`` (in FlatCake's extension) in one call (``--io-workers``
POSIX threads, one blocking ``pread`` in flight each: queue depth = ``--io-workers``), each
thread reads into its own bounce slot and copies the page's (or chunk's) regions into the host
pool (streaming stores where FlatCake's restore uses them); without the extension a Python thread
pool does the same (``"pagewise_reader": "python-threads"`` in the JSON, and said in the output).
Every system's buffers (FlatCake's staging windows, the bounce slots, the sequential buffer,
HiCacheFile's dummy pages) are allocated and faulted in before the clock starts, with
FlatCake's staging huge-page policy (``MADV_HUGEPAGE``, ``FLATCAKE_HUGEPAGES=0``: off for all);
FlatCake (``cio.io_workers``) and both page-wise readers get the same ``--io-workers`` threads.

The disk here is virtual and throttles, so only ratios measured in the same pass are compared.
Each pass reads every system (rotating their order); the JSON holds per-system medians over
the passes and the median of the per-pass ratios.

    python scripts/bench_restore.py --json runs/bench/restore.json
    python scripts/bench_restore.py --sweep --json runs/bench/restore-sweep.json

One cell (one profile, page size and layout): ``--json FILE`` writes ``{"tokens", "bytes",
"systems": {name: {"gb_per_s", "read_ops", "cpu_s", "wall_s"}}, "ratio_to_fio": {name: x},
"fio_read": {...}, "ratio_to_sequential": {name: x}, "speedup_vs_hicache_file": x,
"ratio_to_best_pagewise": x, "best_pagewise", "pagewise_reader", "io_workers", "labels", ...}``
(``ratio_to_fio`` values are ``null`` when fio gave no figure, ``fio_read`` then holds its error).

``--sweep`` (or comma lists in ``--profile``, ``--page-size``, ``--layout``) runs every cell of
profiles x page sizes x layouts in one command (default: ``llama3.2-1b`` (MHA) and
``deepseek-v2-lite`` (MLA), pages of 1, 16, 64 and 256 tokens, the three host layouts), each
with its own files (removed before the next cell starts), prints one table row per cell and
writes ``{"cells": [one cell's JSON, ...], "table": [row, ...], "targets", "command"}``. A cell
meets its targets when FlatCake reads at >= 0.85x fio's sequential read, >= 1.0x the best
page-wise reader, and at a CPU cost per GB at or below that reader's.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Optional

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import numpy as np  # noqa: E402
import torch  # noqa: E402

from bench_common import (PROFILES, FioRead, cpu_seconds, drop_tree, flatcake_backend, make_host_pool,  # noqa: E402
                          pool_digest, prefaulted, setup_process)
from fio_limit import ratio_to_fio  # noqa: E402
from native.pagewise import PagewiseReader, Segments  # noqa: E402
from flatcake.common.align import align_up  # noqa: E402
from flatcake.config import STORAGE_BATCH_PAGES  # noqa: E402
from flatcake.common.layout import SUPPORTED_LAYOUTS, KvPageLayout  # noqa: E402
from flatcake.replay.systems import storage_config  # noqa: E402

SYSTEMS = ("flatcake", "hicache_file", "scattered", "scattered-layerwise", "sequential")
PAGEWISE = ("scattered", "scattered-layerwise")
#: what each system is, for the output (``sequential`` is our own read, not the disk's limit)
LABELS = {
    "flatcake": "FlatCake (FC-CIO), batch_get_v1 of 128 pages",
    "hicache_file": "SGLang HiCacheFile, one file per page, as SGLang reads it",
    "scattered": "page-wise reader, one O_DIRECT read per page slot",
    "scattered-layerwise": "page-wise reader, one O_DIRECT read per (page, layer) chunk slot, layer by layer",
    "sequential": "sequential (one O_DIRECT stream, QD 1, our own read)",
    "fio": "fio sequential read (O_DIRECT, libaio, QD 32, best of 1/4/16 MiB): the disk's limit",
}
SWEEP_PROFILES = ("llama3.2-1b", "deepseek-v2-lite")
SWEEP_PAGE_SIZES = (1, 16, 64, 256)
SWEEP_TOKENS = 8192
#: the sweep's targets: FlatCake's GB/s over fio's sequential read, and over the best page-wise
#: reader's (CPU per GB at or below that reader's is the third)
TARGET_FIO = 0.85
TARGET_PAGEWISE = 1.0
SEQ_STEP = 16 << 20  # the sequential read's request size


def strided_runs(view: torch.Tensor) -> tuple[np.ndarray, int, int, int]:
    """Where a strided tensor's bytes lie, in its row-major order, as 2-D segments.

    Returns:
        ``(offsets, rows, row_bytes, row_stride)``: bytes ``[i * rows * row_bytes, (i + 1) *
        rows * row_bytes)`` of the flattened view are ``rows`` rows of ``row_bytes`` bytes at
        ``view.data_ptr() + offsets[i] + r * row_stride`` (``offsets``: int64 ``[segments]``).
    """
    isz = view.element_size()
    dims = [(n, st * isz) for n, st in zip(view.shape, view.stride()) if n != 1]
    run = isz
    while dims and dims[-1][1] == run:  # merge the contiguous inner dimensions
        run *= dims.pop()[0]
    rows, row_stride = dims.pop() if dims else (1, 0)
    offs = np.zeros(1, dtype=np.int64)
    for n, st in dims:
        offs = (offs[:, None] + np.arange(n, dtype=np.int64)[None, :] * st).reshape(-1)
    return offs, rows, run, row_stride


def segments(dst: np.ndarray, src: np.ndarray, rows: np.ndarray, row_bytes: np.ndarray,
             row_stride: np.ndarray) -> Segments:
    """:class:`Segments` of jobs that each have the same ``K`` segments: ``dst`` is int64
    ``[jobs, K]`` (addresses), the others ``[K]`` (the same for every job)."""
    n, k = dst.shape
    return Segments(start=np.arange(n + 1, dtype=np.int64) * k, src=np.tile(src, n), dst=dst.reshape(-1),
                    rows=np.tile(rows, n), row_bytes=np.tile(row_bytes, n), dst_stride=np.tile(row_stride, n))



class Bench:
    """One cell: ``profile`` (:data:`PROFILES`), ``page_size`` tokens per page, host-pool
    ``layout``; writes every system's files under a new scratch directory (removed by
    :meth:`close`) and reads them back (:meth:`measure`)."""

    def __init__(self, args, profile: str, page_size: int, layout: str, reader: Optional[PagewiseReader] = None):
        self.args, self.profile, self.layout = args, profile, layout
        self.reader = reader or PagewiseReader(args.io_workers)
        self.fio: Optional[FioRead] = None
        prof = PROFILES[profile]
        self.P = prof["page_size"] if page_size is None else page_size
        self.L = prof["layers"]
        self.pages = args.tokens // self.P
        self.tokens = self.pages * self.P
        self.pool, self.mla = make_host_pool(profile, self.tokens, self.P, layout, seed=args.seed)
        self.kv = KvPageLayout.from_host_pool(self.pool)
        self.page_bytes = self.pool.get_size_per_token() * self.P
        self.bytes = self.page_bytes * self.pages
        self.chunk_bytes = self.page_bytes // self.L
        self.keys = [f"{random.Random(args.seed).getrandbits(64):016x}-{i:06d}" for i in range(self.pages)]
        os.makedirs(args.dir or tempfile.gettempdir(), exist_ok=True)
        self.dir = tempfile.mkdtemp(prefix="fc-bench-", dir=args.dir or "/tmp")
        self.rounds = -(-self.pages // STORAGE_BATCH_PAGES)
        perm = list(range(self.pages))
        random.Random(args.seed + 1).shuffle(perm)  # slot s holds page perm[s] (eviction order)
        self.sc_slot = np.empty(self.pages, dtype=np.int64)
        self.sc_slot[np.asarray(perm)] = np.arange(self.pages)
        self.digest = pool_digest(self.pool)

    def indices(self, a: int, b: int) -> torch.Tensor:
        return torch.arange(a * self.P, b * self.P, dtype=torch.int64)

    def clear_pool(self) -> None:
        self.pool.kv_buffer.view(torch.uint8).zero_()

    # ------------------------------------------------------------------ writes
    def write_flatcake(self) -> None:
        d = os.path.join(self.dir, "flatcake")
        be = flatcake_backend(self.pool, d, self.layout, self.mla, self.bytes, self.page_bytes, **{
            "cio.io_workers": self.args.io_workers, "cio.staging_bytes": self.args.staging_bytes,
            "cio.verify_checksums": not self.args.no_verify})
        self.fc, self.fc_dir = be, d
        for a in range(0, self.pages, STORAGE_BATCH_PAGES):
            b = min(self.pages, a + STORAGE_BATCH_PAGES)
            ok = be.batch_set_v1(self.keys[a:b], self.indices(a, b))
            assert all(ok), f"flatcake batch_set_v1 failed at page {a}"
        assert be.store.flush_writes(600), "flatcake write queue did not drain"  # restores read from SSD
        st = be.flatcake_stats()
        assert st["pages_written_ssd"] == self.pages, f"only {st['pages_written_ssd']} pages placed on SSD"

    def write_hicache_file(self) -> None:
        from sglang.srt.mem_cache.storage.backend_factory import StorageBackendFactory

        d = os.path.join(self.dir, "hicache_file")
        be = StorageBackendFactory.create_backend(
            "file", storage_config({"file_storage_path": d}, model="bench/model", mla=self.mla, layout=self.layout), None)
        for a in range(0, self.pages, STORAGE_BATCH_PAGES):
            b = min(self.pages, a + STORAGE_BATCH_PAGES)
            vals = [self.pool.get_data_page(i * self.P, flat=True) for i in range(a, b)]
            assert be.batch_set(self.keys[a:b], vals), "HiCacheFile batch_set failed"
        self.hf = be
        self.hf_dir = d

    def write_scattered(self) -> None:
        """Page ``p`` at slot ``sc_slot[p]`` of 4 KiB-aligned page slots (O_DIRECT reads)."""
        self.sc_path = os.path.join(self.dir, "scattered.bin")
        self.sc_stride = align_up(self.page_bytes)
        fd = os.open(self.sc_path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        try:
            os.posix_fallocate(fd, 0, self.pages * self.sc_stride)
            for p in range(self.pages):
                data = self.pool.get_data_page(p * self.P, flat=True).contiguous().view(torch.uint8).numpy()
                os.pwrite(fd, data, int(self.sc_slot[p]) * self.sc_stride)
        finally:
            os.close(fd)

    def write_scattered_layerwise(self) -> None:
        """Chunk (page ``p``, layer ``l``) at slot ``l * pages + sc_slot[p]`` of 4 KiB-aligned slots."""
        from flatcake.cio.pagecopy import gather_pages

        self.lw_path = os.path.join(self.dir, "scattered_layerwise.bin")
        self.lw_slot = align_up(self.chunk_bytes)
        slots = self.sc_slot
        rows = torch.empty((self.pages, self.chunk_bytes), dtype=torch.uint8)
        buf = np.zeros((self.pages, self.lw_slot), dtype=np.uint8)
        with open(self.lw_path, "wb") as f:
            for layer in range(self.L):
                gather_pages(self.kv, np.arange(self.pages), layer, rows)
                buf[slots, : self.chunk_bytes] = rows.numpy()
                f.write(buf.tobytes())

    def write_sequential(self) -> None:
        self.seq_path = os.path.join(self.dir, "sequential.bin")
        with open(self.seq_path, "wb") as f:
            f.write(self.pool.kv_buffer.view(torch.uint8).numpy().tobytes()[: self.bytes])

    def write_fio(self) -> None:
        """fio's file of the same size on the same file system (laid out by fio, once a cell)."""
        if not self.args.no_fio:
            self.fio = FioRead(self.dir, self.bytes)

    def prepare(self) -> None:
        """Every baseline's buffers, made once before any clock starts, with FlatCake's staging
        huge-page policy (:func:`bench_common.prefaulted`); FlatCake's staging windows were made
        with its backend. The page-wise readers' per-thread bounce slots, the sequential read's
        16 MiB buffer, and HiCacheFile's dummy flat pages (one call's worth, reused by every
        call: SGLang's controller allocates them per call)."""
        n = self.args.io_workers
        self.sc_bounce = prefaulted(n * self.sc_stride)
        self.lw_bounce = prefaulted(n * self.lw_slot)
        self.seq_buf = prefaulted(SEQ_STEP)
        per_call = min(self.pages, STORAGE_BATCH_PAGES)
        nbytes = per_call * self.page_bytes
        flat = torch.from_numpy(prefaulted(nbytes)[:nbytes]).view(self.pool.dtype)
        self.hf_dummies = list(flat.view(per_call, -1).unbind(0))
        assert self.hf_dummies[0].numel() == self.pool.get_dummy_flat_data_page().numel()

    def drop_all(self) -> None:
        drop_tree(self.dir)

    # ------------------------------------------------------------------ reads
    def read_flatcake(self) -> int:
        before = self.fc.flatcake_stats()
        for a in range(0, self.pages, STORAGE_BATCH_PAGES):
            b = min(self.pages, a + STORAGE_BATCH_PAGES)
            ok = self.fc.batch_get_v1(self.keys[a:b], self.indices(a, b))
            assert all(ok), f"flatcake batch_get_v1 missed from page {a + ok.index(False)}"
        after = self.fc.flatcake_stats()
        assert after["hit_pages_ssd"] - before["hit_pages_ssd"] == self.pages, "pages did not come from SSD"
        # read ops = FC-CIO's merged reads (one contiguous device range each); the engine cuts
        # each into up to io_workers parallel preadv pieces, reported as io_requests
        self.fc_io_requests = after["ssd_read_ops"] - before["ssd_read_ops"]
        return after["merged_reads"] - before["merged_reads"]

    def read_hicache_file(self) -> int:
        for a in range(0, self.pages, STORAGE_BATCH_PAGES):
            b = min(self.pages, a + STORAGE_BATCH_PAGES)
            got = self.hf.batch_get(self.keys[a:b], self.hf_dummies[: b - a])
            for i, t in zip(range(a, b), got):
                assert t is not None, f"HiCacheFile missed page {i}"
                self.pool.set_from_flat_data_page(i * self.P, t)
        return self.pages

    def read_scattered(self) -> int:
        """One O_DIRECT read per page slot, every page of the restore in one call of the
        page-wise reader (``--io-workers`` reads in flight); each page's regions (MHA: its K and
        V blocks; ``layer_first``: one per layer and plane) copied into its pool slot by the
        thread that read it."""
        pages = np.arange(self.pages, dtype=np.int64)
        offs, rows, run, rstride = strided_runs(self.pool.get_data_page(0, flat=False))
        base = self.page_base(pages)
        seg = segments(base[:, None] + offs[None, :], np.arange(len(offs), dtype=np.int64) * rows * run,
                       np.full(len(offs), rows), np.full(len(offs), run), np.full(len(offs), rstride))
        fd = os.open(self.sc_path, os.O_RDONLY | os.O_DIRECT)
        try:
            got = self.reader.read_copy(np.full(self.pages, fd), self.sc_slot[pages] * self.sc_stride,
                                        np.full(self.pages, self.sc_stride), self.sc_bounce.ctypes.data,
                                        self.sc_stride, seg)
        finally:
            os.close(fd)
        assert (got == self.sc_stride).all(), "scattered: a page slot was read short"
        return self.pages

    def page_base(self, pages: np.ndarray) -> np.ndarray:
        """Address of each page's first byte in the pool's flat-page view (``get_data_page``),
        int64; the pool's pages are evenly spaced."""
        b0 = self.pool.get_data_page(0, flat=False).data_ptr()
        step = self.pool.get_data_page(self.P, flat=False).data_ptr() - b0 if self.pages > 1 else 0
        last = self.pool.get_data_page((self.pages - 1) * self.P, flat=False).data_ptr()
        assert last == b0 + (self.pages - 1) * step, "pool pages are not evenly spaced"
        return b0 + pages * step

    def read_scattered_layerwise(self) -> int:
        """One O_DIRECT read per (layer, page) chunk slot, layer by layer (layer 0's pages, then
        layer 1's, ...), all in one call of the page-wise reader; each chunk's planes copied
        into the page's token rows of that layer by the thread that read it."""
        n, L = self.pages, self.L
        pages = np.arange(n, dtype=np.int64)
        g = self.kv.geometry
        dst_rows, src, rows, rb, rs = [], [], [], [], []
        for layer in range(L):
            per_plane = []
            for j, plane in enumerate(self.kv.layer_planes(layer)):
                offs, r, run, rstride = strided_runs(plane[0])
                per_plane.append(plane.data_ptr() + pages[:, None] * plane.stride(0) + offs[None, :])
                if layer == 0:  # the same in every layer
                    k = len(offs)
                    src.append(g.plane_offsets()[j] + np.arange(k, dtype=np.int64) * r * run)
                    rows.append(np.full(k, r))
                    rb.append(np.full(k, run))
                    rs.append(np.full(k, rstride))
            dst_rows.append(np.concatenate(per_plane, axis=1))
        seg = segments(np.concatenate(dst_rows, axis=0), *(np.concatenate(x) for x in (src, rows, rb, rs)))
        layers = np.repeat(np.arange(L, dtype=np.int64), n)
        offs = (layers * n + np.tile(self.sc_slot, L)) * self.lw_slot
        fd = os.open(self.lw_path, os.O_RDONLY | os.O_DIRECT)
        try:
            got = self.reader.read_copy(np.full(L * n, fd), offs, np.full(L * n, self.lw_slot),
                                        self.lw_bounce.ctypes.data, self.lw_slot, seg)
        finally:
            os.close(fd)
        assert (got == self.lw_slot).all(), "scattered-layerwise: a chunk slot was read short"
        return L * n

    def read_sequential(self) -> int:
        buf = self.seq_buf
        fd = os.open(self.seq_path, os.O_RDONLY | os.O_DIRECT)
        ops = done = 0
        try:
            while done < self.bytes:
                k = os.preadv(fd, [buf[: min(SEQ_STEP, align_up(self.bytes - done))]], done)
                ops += 1
                if k <= 0:
                    break
                done += k
        finally:
            os.close(fd)
        assert done >= self.bytes, f"sequential read stopped at {done}"
        return ops

    def measure(self, name: str) -> dict:
        verify = name != "sequential"
        if verify:
            self.clear_pool()
        self.drop_all()
        c0, t0 = cpu_seconds(), time.perf_counter()
        ops = getattr(self, f"read_{name.replace('-', '_')}")()
        wall, cpu = time.perf_counter() - t0, cpu_seconds() - c0
        if verify:
            assert pool_digest(self.pool) == self.digest, f"{name}: restored bytes differ"
        out = {"gb_per_s": self.bytes / wall / 1e9, "read_ops": ops, "cpu_s": cpu, "wall_s": wall}
        if name == "flatcake":
            out["io_requests"] = self.fc_io_requests
        return out

    def close(self) -> None:
        for be in (getattr(self, "fc", None),):
            if be is not None:
                be.close()
        if self.fio is not None:
            self.fio.close()
        if not self.args.keep:
            shutil.rmtree(self.dir, ignore_errors=True)


def _csv(value: str, cast=str) -> list:
    return [cast(v) for v in str(value).split(",") if v != ""]


def parse_args(argv=None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tokens", type=int, default=None,
                    help=f"session length in tokens (default 32768; {SWEEP_TOKENS} a cell with --sweep)")
    ap.add_argument("--profile", default=None, help=f"profile(s), comma-separated, of {sorted(PROFILES)} "
                    f"(default llama3.2-1b; with --sweep {','.join(SWEEP_PROFILES)})")
    ap.add_argument("--page-size", default=None, help="tokens per page, comma-separated for a sweep "
                    f"(default: the profile's; with --sweep {','.join(map(str, SWEEP_PAGE_SIZES))})")
    ap.add_argument("--layout", default=None, help=f"host layout(s), comma-separated or 'all', of {list(SUPPORTED_LAYOUTS)} "
                    "(default page_first; with --sweep all)")
    ap.add_argument("--sweep", action="store_true", help="every cell of profiles x page sizes x layouts (defaults above)")
    ap.add_argument("--io-workers", type=int, default=32,
                    help="I/O threads of flatcake (cio.io_workers) and of both page-wise readers, whose threads "
                         "each keep one read in flight (default 32: queue depth 32, as fio's)")
    ap.add_argument("--staging-bytes", type=int, default=0,
                    help="flatcake cio.staging_bytes per buffer (0 = auto: one layer of 128 pages, at least 32 MiB)")
    ap.add_argument("--no-verify", action="store_true", help="flatcake: skip the per-chunk xxh3 check")
    ap.add_argument("--systems", default=",".join(SYSTEMS),
                    help="comma-separated subset to read (all are always written; flatcake and sequential always read)")
    ap.add_argument("--torch-threads", type=int, default=1,
                    help="torch intra-op threads (default 1: on a shared 2-core machine the 2-thread "
                         "pool spins and HiCacheFile's page copies collapse; 1 gives the baselines their best case)")
    ap.add_argument("--warmup", type=int, default=1, help="read passes run first and discarded")
    ap.add_argument("--passes", type=int, default=3, help="read passes (each reads every system once)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--dir", default=None, help="parent of the scratch directory on the disk under test (default /tmp)")
    ap.add_argument("--no-fio", action="store_true", help="skip fio's read limit (ratio_to_fio is then null and "
                    "the fio target is not met)")
    ap.add_argument("--keep", action="store_true", help="keep the written files")
    ap.add_argument("--json", default=None, help="write the results here")
    args = ap.parse_args(argv)
    if args.io_workers < 1:
        ap.error("--io-workers must be >= 1")
    args.names = [n for n in args.systems.split(",") if n]
    for must in ("flatcake", "sequential"):
        if must not in args.names:
            args.names.append(must)
    unknown = set(args.names) - set(SYSTEMS)
    if unknown:
        ap.error(f"unknown systems {sorted(unknown)}")
    args.profiles = _csv(args.profile) if args.profile else list(SWEEP_PROFILES if args.sweep else ["llama3.2-1b"])
    bad = set(args.profiles) - set(PROFILES)
    if bad:
        ap.error(f"unknown profiles {sorted(bad)} (choose from {sorted(PROFILES)})")
    try:
        args.page_sizes = _csv(args.page_size, int) if args.page_size else (list(SWEEP_PAGE_SIZES) if args.sweep else [None])
    except ValueError:
        ap.error(f"--page-size: not a comma-separated list of integers: {args.page_size!r}")
    if any(p is not None and p <= 0 for p in args.page_sizes):
        ap.error("--page-size: page sizes must be positive")
    lay = args.layout or ("all" if args.sweep else "page_first")
    args.layouts = list(SUPPORTED_LAYOUTS) if lay == "all" else _csv(lay)
    if set(args.layouts) - set(SUPPORTED_LAYOUTS):
        ap.error(f"unknown layouts {sorted(set(args.layouts) - set(SUPPORTED_LAYOUTS))}")
    args.cells = [(pr, ps, la) for pr in args.profiles for ps in args.page_sizes for la in args.layouts]
    if args.tokens is None:
        args.tokens = SWEEP_TOKENS if len(args.cells) > 1 else 32768
    too_small = [(pr, ps) for pr, ps, _ in args.cells if args.tokens // (ps or PROFILES[pr]["page_size"]) < 1]
    if too_small:
        ap.error(f"--tokens {args.tokens} is less than one page for {too_small}")
    return args


def run_passes(b: Bench, args) -> list[dict]:
    """Write every system once (and fio's file), make every buffer, then read each system once
    per pass, rotating their order; fio reads in the rotation of every measured pass. The first
    ``--warmup`` passes are discarded. Returns the measured passes (``{name: {...}, "fio": {...}}``)."""
    names = args.names
    print(f"profile {b.profile} ({'MLA' if b.mla else 'MHA'}, {b.layout}): {b.L} layers, page {b.P} tokens = "
          f"{b.page_bytes} B (chunk {b.chunk_bytes} B), {b.pages} pages, {b.bytes / 2**20:.0f} MiB per system, dir {b.dir}")
    wt = {}
    for n in (*SYSTEMS, "fio"):
        t = time.perf_counter()
        getattr(b, f"write_{n.replace('-', '_')}")()
        wt[n] = round(time.perf_counter() - t, 1)
    b.prepare()
    print(f"written (s): {wt}; flatcake engine: {b.fc.flatcake_stats().get('cio_engine')}; io threads "
          f"{args.io_workers} (flatcake, page-wise); page-wise reader {b.reader.kind}"
          + (f" (no C reader: {b.reader.why})" if b.reader.why else ""))
    if b.fio is not None and b.fio.error:
        print(f"fio: no figure ({b.fio.error})")
    passes = []
    rotation = names + (["fio"] if b.fio is not None else [])
    for k in range(-args.warmup, args.passes):
        entries = rotation if k >= 0 else names
        order = entries[k % len(entries):] + entries[: k % len(entries)]
        res = {n: (b.fio.measure() if n == "fio" else b.measure(n)) for n in order}
        if k < 0:
            print("warm-up pass (discarded): " + ", ".join(f"{n} {res[n]['gb_per_s']:.2f}" for n in names))
            continue
        passes.append(res)
        fio = res.get("fio", {})
        print(f"pass {k}: " + ", ".join(f"{n} {res[n]['gb_per_s']:.2f} GB/s ({res[n]['read_ops']} ops, "
                                         f"{res[n]['cpu_s']:.2f} cpu-s)" for n in names)
              + (f", fio {fio['best_gb_per_s']:.2f} GB/s ({fio['best_bs_mib']} MiB)"
                 if fio.get("best_gb_per_s") else ""))
    return passes


def best_pagewise(p: dict) -> Optional[str]:
    """Name of the faster page-wise reader in pass ``p`` (``None`` when neither was read)."""
    pw = [n for n in PAGEWISE if n in p]
    return max(pw, key=lambda n: p[n]["gb_per_s"]) if pw else None


def fio_summary(passes: list[dict], b: Bench) -> dict:
    """fio's read limit over the passes: the median best GB/s, every pass's figures and how it
    was measured; ``{"error": ...}`` when it gave none (or ``--no-fio``)."""
    if b.fio is None:
        return {"tool": "fio", "error": "not run (--no-fio)"}
    runs = [p.get("fio", {}) for p in passes]
    best = [r["best_gb_per_s"] for r in runs if r.get("best_gb_per_s")]
    if not best:
        return {"tool": "fio", "error": next((r["error"] for r in runs if r.get("error")), b.fio.error or "no pass")}
    first = next(r for r in runs if r.get("best_gb_per_s"))
    return {"tool": "fio", "gb_per_s": statistics.median(best), "per_pass_gb_per_s": best,
            "per_pass_best_bs_mib": [r.get("best_bs_mib") for r in runs],
            "per_pass_by_bs_mib": [r.get("by_bs_mib") for r in runs],
            "version": first["version"], "rw": "read", "iodepth": first["iodepth"], "size_bytes": first["size_bytes"],
            "commands": first["commands"], "when": "once in every measured pass, in the rotation with the systems",
            "label": LABELS["fio"]}


def summarize(b: Bench, args, passes: list[dict], argv, t_start: float) -> dict:
    """Per-system medians over the passes and the medians of the per-pass ratios."""
    names = args.names
    med = {n: {m: statistics.median(p[n][m] for p in passes) for m in ("gb_per_s", "read_ops", "cpu_s", "wall_s")}
           for n in names}
    ratio = {n: statistics.median(p[n]["gb_per_s"] / p["sequential"]["gb_per_s"] for p in passes) for n in names}
    to_fio = {}
    for n in names:
        r = [ratio_to_fio(p[n]["gb_per_s"], p.get("fio", {})) for p in passes]
        r = [x for x in r if x is not None]
        to_fio[n] = statistics.median(r) if r else None
    speedup = statistics.median(p["flatcake"]["gb_per_s"] / p["hicache_file"]["gb_per_s"] for p in passes) \
        if "hicache_file" in names else None
    best = [best_pagewise(p) for p in passes]
    to_best = statistics.median(p["flatcake"]["gb_per_s"] / p[s]["gb_per_s"] for p, s in zip(passes, best)) \
        if best and best[0] else None
    cpu_per_gb = {n: med[n]["cpu_s"] / (b.bytes / 1e9) for n in names}
    return {
        "tokens": b.tokens,
        "bytes": b.bytes,
        "systems": med,
        "ratio_to_fio": to_fio,
        "fio_read": fio_summary(passes, b),
        "ratio_to_sequential": ratio,
        "speedup_vs_hicache_file": speedup,
        "ratio_to_best_pagewise": to_best,
        "best_pagewise": statistics.mode(best) if best and best[0] else None,
        "pagewise_reader": b.reader.kind,
        "pagewise_reader_note": b.reader.why or None,
        "io_workers": args.io_workers,
        "labels": {n: LABELS[n] for n in (*names, "fio")},
        "profile": b.profile,
        "attention": "mla" if b.mla else "mha",
        "layout": b.layout,
        "page_size": b.P,
        "page_bytes": b.page_bytes,
        "chunk_bytes": b.chunk_bytes,
        "layers": b.L,
        "rounds_written": b.rounds,
        "read_ops_bound": 2 * b.L * b.rounds,
        "cpu_s_per_gb": cpu_per_gb,
        "passes": passes,
        "runtime_s": time.perf_counter() - t_start,
        "command": " ".join([Path(sys.argv[0]).name] + (argv if argv is not None else sys.argv[1:])),
    }


def table_row(cell: dict) -> dict:
    """One row of the sweep table: FlatCake's GB/s, fio's, FlatCake's ratios to fio, to the best
    page-wise reader and to our single-stream ``sequential`` read, CPU s/GB of FlatCake and of
    that reader, and which targets the cell meets (``targets``: >= :data:`TARGET_FIO` x fio,
    >= :data:`TARGET_PAGEWISE` x the best page-wise reader, CPU s/GB at or below it; no fio
    figure: that target is not met; no page-wise reader read: those two are not checked)."""
    best = cell["best_pagewise"]
    fc_cpu = cell["cpu_s_per_gb"]["flatcake"]
    pw_cpu = cell["cpu_s_per_gb"].get(best) if best else None
    r_fio, r_pw = cell["ratio_to_fio"]["flatcake"], cell["ratio_to_best_pagewise"]
    targets = {"fio": r_fio is not None and r_fio >= TARGET_FIO,
               "pagewise": r_pw is None or r_pw >= TARGET_PAGEWISE,
               "cpu": pw_cpu is None or fc_cpu <= pw_cpu}
    return {
        "profile": cell["profile"], "attention": cell["attention"], "page_size": cell["page_size"],
        "layout": cell["layout"], "page_bytes": cell["page_bytes"],
        "flatcake_gb_per_s": cell["systems"]["flatcake"]["gb_per_s"], "fio_gb_per_s": cell["fio_read"].get("gb_per_s"),
        "ratio_to_fio": r_fio, "ratio_to_best_pagewise": r_pw, "best_pagewise": best,
        "ratio_to_sequential": cell["ratio_to_sequential"]["flatcake"],
        "cpu_s_per_gb": fc_cpu, "best_pagewise_cpu_s_per_gb": pw_cpu,
        "targets": targets, "meets_targets": all(targets.values()),
    }


def _f(x, fmt: str) -> str:
    return "-" if x is None else format(x, fmt)


def print_table(rows: list[dict]) -> None:
    print(f"targets: flatcake >= {TARGET_FIO}x fio's sequential read (/fio), >= {TARGET_PAGEWISE}x the best page-wise "
          f"reader (/best pw), CPU s/GB <= that reader's; /seq1 = over {LABELS['sequential']}, for reference")
    print(f"{'profile':<17} {'attn':<4} {'page':>4} {'layout':<17} {'page B':>9} {'fc GB/s':>7} {'fio':>5} {'/fio':>5} "
          f"{'/best pw':>8} {'best pw':<19} {'/seq1':>5} {'cpu/GB':>6} {'pw cpu/GB':>9} ok")
    for r in rows:
        missed = [k for k, ok in r["targets"].items() if not ok]
        print(f"{r['profile']:<17} {r['attention']:<4} {r['page_size']:>4} {r['layout']:<17} {r['page_bytes']:>9} "
              f"{r['flatcake_gb_per_s']:>7.2f} {_f(r['fio_gb_per_s'], '.2f'):>5} {_f(r['ratio_to_fio'], '.2f'):>5} "
              f"{_f(r['ratio_to_best_pagewise'], '.2f'):>8} {str(r['best_pagewise']):<19} "
              f"{r['ratio_to_sequential']:>5.2f} "
              f"{r['cpu_s_per_gb']:>6.3f} {_f(r['best_pagewise_cpu_s_per_gb'], '.3f'):>9} "
              f"{'yes' if not missed else 'NO (' + ', '.join(missed) + ')'}")


def run_cell(args, argv, reader: PagewiseReader, profile: str, page_size, layout: str) -> dict:
    """Write, read and summarize one cell; its files are removed before returning."""
    t_start = time.perf_counter()
    b = Bench(args, profile, page_size, layout, reader)
    try:
        passes = run_passes(b, args)
    finally:
        b.close()
    return summarize(b, args, passes, argv, t_start)


def main(argv=None) -> int:
    args = parse_args(argv)
    setup_process(args.torch_threads)
    t0 = time.perf_counter()
    reader = PagewiseReader(args.io_workers)  # compiled once, before any clock
    if reader.why:
        print(f"page-wise reader: {reader.kind} (the C reader is unavailable: {reader.why})")
    try:
        cells = [run_cell(args, argv, reader, *c) for c in args.cells]
    finally:
        reader.close()
    rows = [table_row(c) for c in cells]
    if len(cells) == 1:
        out = cells[0]
        fio = out["fio_read"]
        print("fio read: " + (f"{fio['gb_per_s']:.2f} GB/s (median of the passes' best; QD {fio['iodepth']})"
                              if "gb_per_s" in fio else f"no figure ({fio['error']})"))
        print(json.dumps({k: out[k] for k in ("ratio_to_fio", "ratio_to_sequential", "speedup_vs_hicache_file",
                                              "ratio_to_best_pagewise", "read_ops_bound", "pagewise_reader",
                                              "io_workers")}))
        print(f"cpu-s/GB {json.dumps({n: round(v, 3) for n, v in out['cpu_s_per_gb'].items()})}; "
              f"runtime {out['runtime_s']:.0f} s; sequential = {LABELS['sequential']}")
    else:
        out = {"cells": cells, "table": rows, "pagewise_reader": reader.kind, "io_workers": args.io_workers,
               "targets": {"ratio_to_fio": TARGET_FIO, "ratio_to_best_pagewise": TARGET_PAGEWISE,
                           "cpu_s_per_gb": "<= the best page-wise reader's"},
               "runtime_s": time.perf_counter() - t0, "command": cells[0]["command"]}
    print_table(rows)
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps(out, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
