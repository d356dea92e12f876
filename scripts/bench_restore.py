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
                   dummy pages, then ``set_from_flat_data_page``);
* ``scattered``    the same pages one per slot in eviction order (a random permutation) in one
                   shared file, as tiered stores lay them out, read page by page (O_DIRECT, the
                   same number of I/O threads as FlatCake) and copied into the pool;
* ``scattered-layerwise``  the same (page, layer) chunks, one per 4 KiB-aligned slot, each
                   layer's pages in eviction order, read one chunk per O_DIRECT read, layer by
                   layer (as a layer-pipelined tiered restore issues them), same I/O threads;
* ``sequential``   one O_DIRECT sequential read of the same number of bytes from one file
                   (16 MiB calls, one stream): the disk's practical limit in this run.

The disk here is virtual and throttles, so only ratios measured in the same pass are compared.
Each pass reads every system (rotating their order); the JSON holds per-system medians over
the passes and the median of the per-pass ratios.

    python scripts/bench_restore.py --json runs/bench/restore.json
    python scripts/bench_restore.py --sweep --json runs/bench/restore-sweep.json

One cell (one profile, page size and layout): ``--json FILE`` writes ``{"tokens", "bytes",
"systems": {name: {"gb_per_s", "read_ops", "cpu_s", "wall_s"}}, "ratio_to_sequential":
{name: x}, "speedup_vs_hicache_file": x, "ratio_to_best_scattered": x, ...}``.

``--sweep`` (or comma lists in ``--profile``, ``--page-size``, ``--layout``) runs every cell of
profiles x page sizes x layouts in one command (default: ``llama3.2-1b`` (MHA) and
``deepseek-v2-lite`` (MLA), pages of 1, 16, 64 and 256 tokens, the three host layouts), each
with its own files (removed before the next cell starts), prints one table row per cell and
writes ``{"cells": [one cell's JSON, ...], "table": [row, ...], "command"}``.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import random
import shutil
import statistics
import sys
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import numpy as np  # noqa: E402
import torch  # noqa: E402

from bench_common import (PROFILES, aligned, cpu_seconds, drop_tree, flatcake_backend, make_host_pool,  # noqa: E402
                          pool_digest)
from flatcake.align import align_up  # noqa: E402
from flatcake.config import STORAGE_BATCH_PAGES  # noqa: E402
from flatcake.layout import SUPPORTED_LAYOUTS, KvPageLayout  # noqa: E402
from flatcake.replay.systems import storage_config  # noqa: E402

SYSTEMS = ("flatcake", "hicache_file", "scattered", "scattered-layerwise", "sequential")
SCATTERED = ("scattered", "scattered-layerwise")
SWEEP_PROFILES = ("llama3.2-1b", "deepseek-v2-lite")
SWEEP_PAGE_SIZES = (1, 16, 64, 256)
SWEEP_TOKENS = 8192



class Bench:
    """One cell: ``profile`` (:data:`PROFILES`), ``page_size`` tokens per page, host-pool
    ``layout``; writes every system's files under a new scratch directory (removed by
    :meth:`close`) and reads them back (:meth:`measure`)."""

    def __init__(self, args, profile: str, page_size: int, layout: str):
        self.args, self.profile, self.layout = args, profile, layout
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
        self.sc_slot = [0] * self.pages
        for s, p in enumerate(perm):
            self.sc_slot[p] = s
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
                os.pwrite(fd, data, self.sc_slot[p] * self.sc_stride)
        finally:
            os.close(fd)

    def write_scattered_layerwise(self) -> None:
        """Chunk (page ``p``, layer ``l``) at slot ``l * pages + sc_slot[p]`` of 4 KiB-aligned slots."""
        from flatcake.cio.pagecopy import gather_pages

        self.lw_path = os.path.join(self.dir, "scattered_layerwise.bin")
        self.lw_slot = align_up(self.chunk_bytes)
        slots = np.asarray(self.sc_slot, dtype=np.int64)
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
            dummies = [self.pool.get_dummy_flat_data_page() for _ in range(a, b)]
            got = self.hf.batch_get(self.keys[a:b], dummies)
            for i, t in zip(range(a, b), got):
                assert t is not None, f"HiCacheFile missed page {i}"
                self.pool.set_from_flat_data_page(i * self.P, t)
        return self.pages

    def read_scattered(self) -> int:
        fd = os.open(self.sc_path, os.O_RDONLY | os.O_DIRECT)
        bufs = [aligned(self.page_bytes) for _ in range(self.args.io_workers)]
        pb, stride = self.page_bytes, self.sc_stride

        def one(job):
            w, pages = job
            buf = bufs[w]
            t = torch.from_numpy(buf)
            for p in pages:
                n = os.preadv(fd, [buf], self.sc_slot[p] * stride)
                assert n >= pb
                self.pool.set_from_flat_data_page(p * self.P, t[:pb].view(self.pool.dtype))
            return len(pages)

        try:
            jobs = [(w, list(range(w, self.pages, self.args.io_workers))) for w in range(self.args.io_workers)]
            with ThreadPoolExecutor(self.args.io_workers) as ex:
                n = sum(ex.map(one, jobs))
        finally:
            os.close(fd)
        return n

    def read_scattered_layerwise(self) -> int:
        """One O_DIRECT read per (layer, page) chunk, layer by layer (jobs of up to 128 pages of
        one layer, submitted in layer order to ``io_workers`` threads); each job's chunks are
        then copied into the pool with one vectorized copy (the baseline's best case)."""
        from flatcake.cio.pagecopy import scatter_pages

        fd = os.open(self.lw_path, os.O_RDONLY | os.O_DIRECT)
        slot, cb, n_pages = self.lw_slot, self.chunk_bytes, self.pages
        step = STORAGE_BATCH_PAGES
        bufs = {}

        def one(job):
            layer, a, b = job
            key = threading.get_ident()
            buf = bufs.get(key)
            if buf is None:
                buf = bufs[key] = aligned(step * slot).reshape(step, slot)
            for i, p in enumerate(range(a, b)):
                n = os.preadv(fd, [buf[i]], (layer * n_pages + self.sc_slot[p]) * slot)
                assert n == slot
            scatter_pages(self.kv, torch.from_numpy(buf[: b - a, :cb]), np.arange(a, b), layer)
            return b - a

        try:
            jobs = [(layer, a, min(n_pages, a + step)) for layer in range(self.L) for a in range(0, n_pages, step)]
            with ThreadPoolExecutor(self.args.io_workers) as ex:
                n = sum(ex.map(one, jobs))
        finally:
            os.close(fd)
        return n

    def read_sequential(self) -> int:
        step = 16 << 20
        buf = aligned(step)
        fd = os.open(self.seq_path, os.O_RDONLY | os.O_DIRECT)
        ops = done = 0
        try:
            while done < self.bytes:
                k = os.preadv(fd, [buf[: min(step, align_up(self.bytes - done))]], done)
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
    ap.add_argument("--io-workers", type=int, default=8, help="I/O threads for flatcake and both scattered baselines")
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
    ap.add_argument("--keep", action="store_true", help="keep the written files")
    ap.add_argument("--json", default=None, help="write the results here")
    args = ap.parse_args(argv)
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
    """Write every system once, then read each system once per pass (rotating their order);
    the first ``--warmup`` passes are discarded. Returns the measured passes."""
    names = args.names
    print(f"profile {b.profile} ({'MLA' if b.mla else 'MHA'}, {b.layout}): {b.L} layers, page {b.P} tokens = "
          f"{b.page_bytes} B (chunk {b.chunk_bytes} B), {b.pages} pages, {b.bytes / 2**20:.0f} MiB per system, dir {b.dir}")
    wt = {}
    for n in SYSTEMS:
        t = time.perf_counter()
        getattr(b, f"write_{n.replace('-', '_')}")()
        wt[n] = round(time.perf_counter() - t, 1)
    print(f"written (s): {wt}; flatcake engine: {b.fc.flatcake_stats().get('cio_engine')}")
    passes = []
    for k in range(-args.warmup, args.passes):
        order = names[k % len(names):] + names[: k % len(names)]
        res = {n: b.measure(n) for n in order}
        if k < 0:
            print("warm-up pass (discarded): " + ", ".join(f"{n} {res[n]['gb_per_s']:.2f}" for n in names))
            continue
        passes.append(res)
        print(f"pass {k}: " + ", ".join(f"{n} {res[n]['gb_per_s']:.2f} GB/s ({res[n]['read_ops']} ops, "
                                         f"{res[n]['cpu_s']:.2f} cpu-s)" for n in names))
    return passes


def best_scattered(p: dict) -> str | None:
    """Name of the faster scattered baseline in pass ``p`` (``None`` when neither was read)."""
    sc = [n for n in SCATTERED if n in p]
    return max(sc, key=lambda n: p[n]["gb_per_s"]) if sc else None


def summarize(b: Bench, args, passes: list[dict], argv, t_start: float) -> dict:
    """Per-system medians over the passes and the medians of the per-pass ratios."""
    names = args.names
    med = {n: {m: statistics.median(p[n][m] for p in passes) for m in ("gb_per_s", "read_ops", "cpu_s", "wall_s")}
           for n in names}
    ratio = {n: statistics.median(p[n]["gb_per_s"] / p["sequential"]["gb_per_s"] for p in passes) for n in names}
    speedup = statistics.median(p["flatcake"]["gb_per_s"] / p["hicache_file"]["gb_per_s"] for p in passes) \
        if "hicache_file" in names else None
    best = [best_scattered(p) for p in passes]
    to_best = statistics.median(p["flatcake"]["gb_per_s"] / p[s]["gb_per_s"] for p, s in zip(passes, best)) \
        if best and best[0] else None
    cpu_per_gb = {n: med[n]["cpu_s"] / (b.bytes / 1e9) for n in names}
    return {
        "tokens": b.tokens,
        "bytes": b.bytes,
        "systems": med,
        "ratio_to_sequential": ratio,
        "speedup_vs_hicache_file": speedup,
        "ratio_to_best_scattered": to_best,
        "best_scattered": statistics.mode(best) if best and best[0] else None,
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
    """One row of the sweep table: FlatCake's GB/s, its ratios to sequential and to the best
    scattered baseline, CPU s/GB of FlatCake and of that baseline, and whether the cell meets
    the targets (>= 0.9x sequential, >= 1.0x best scattered, CPU s/GB at or below it)."""
    best = cell["best_scattered"]
    fc_cpu = cell["cpu_s_per_gb"]["flatcake"]
    sc_cpu = cell["cpu_s_per_gb"].get(best) if best else None
    r_seq, r_sc = cell["ratio_to_sequential"]["flatcake"], cell["ratio_to_best_scattered"]
    return {
        "profile": cell["profile"], "attention": cell["attention"], "page_size": cell["page_size"],
        "layout": cell["layout"], "page_bytes": cell["page_bytes"],
        "flatcake_gb_per_s": cell["systems"]["flatcake"]["gb_per_s"],
        "ratio_to_sequential": r_seq, "ratio_to_best_scattered": r_sc, "best_scattered": best,
        "cpu_s_per_gb": fc_cpu, "best_scattered_cpu_s_per_gb": sc_cpu,
        "meets_targets": bool(r_seq >= 0.9 and (r_sc is None or r_sc >= 1.0) and (sc_cpu is None or fc_cpu <= sc_cpu)),
    }


def print_table(rows: list[dict]) -> None:
    print(f"{'profile':<17} {'attn':<4} {'page':>4} {'layout':<17} {'page B':>9} {'fc GB/s':>7} {'/seq':>5} "
          f"{'/best sc':>8} {'best sc':<19} {'cpu/GB':>6} {'sc cpu/GB':>9} ok")
    for r in rows:
        sc = r["ratio_to_best_scattered"]
        sc_cpu = r["best_scattered_cpu_s_per_gb"]
        print(f"{r['profile']:<17} {r['attention']:<4} {r['page_size']:>4} {r['layout']:<17} {r['page_bytes']:>9} "
              f"{r['flatcake_gb_per_s']:>7.2f} {r['ratio_to_sequential']:>5.2f} "
              f"{'-' if sc is None else f'{sc:.2f}':>8} {str(r['best_scattered']):<19} {r['cpu_s_per_gb']:>6.3f} "
              f"{'-' if sc_cpu is None else f'{sc_cpu:.3f}':>9} {'yes' if r['meets_targets'] else 'NO'}")


def run_cell(args, argv, profile: str, page_size, layout: str) -> dict:
    """Write, read and summarize one cell; its files are removed before returning."""
    t_start = time.perf_counter()
    b = Bench(args, profile, page_size, layout)
    try:
        passes = run_passes(b, args)
    finally:
        b.close()
    return summarize(b, args, passes, argv, t_start)


def main(argv=None) -> int:
    args = parse_args(argv)
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    if args.torch_threads > 0:
        torch.set_num_threads(args.torch_threads)
    t0 = time.perf_counter()
    cells = [run_cell(args, argv, *c) for c in args.cells]
    rows = [table_row(c) for c in cells]
    if len(cells) == 1:
        out = cells[0]
        print(json.dumps({k: out[k] for k in ("ratio_to_sequential", "speedup_vs_hicache_file",
                                              "ratio_to_best_scattered", "read_ops_bound")}))
        print(f"cpu-s/GB {json.dumps({n: round(v, 3) for n, v in out['cpu_s_per_gb'].items()})}; "
              f"runtime {out['runtime_s']:.0f} s")
    else:
        out = {"cells": cells, "table": rows, "runtime_s": time.perf_counter() - t0, "command": cells[0]["command"]}
    print_table(rows)
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps(out, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
