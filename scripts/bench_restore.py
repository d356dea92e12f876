#!/usr/bin/env python3
"""Restore benchmark (paper §3.3 FC-CIO): one long session's prefix read back from SSD.

Writes a session of ``--tokens`` tokens of a model profile through four layouts, drops the page
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
* ``sequential``   one O_DIRECT sequential read of the same number of bytes from one file
                   (16 MiB calls, one stream): the disk's practical limit in this run.

The disk here is virtual and throttles, so only ratios measured in the same pass are compared.
Each pass reads all four systems (rotating their order); the JSON holds per-system medians over
the passes and the median of the per-pass ratios.

    python scripts/bench_restore.py --json runs/bench/restore.json

``--json FILE`` writes ``{"tokens", "bytes", "systems": {name: {"gb_per_s", "read_ops", "cpu_s",
"wall_s"}}, "ratio_to_sequential": {name: x}, "speedup_vs_hicache_file": x, ...}``.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import random
import resource
import shutil
import statistics
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import numpy as np  # noqa: E402
import torch  # noqa: E402
import xxhash  # noqa: E402

from flatcake.adapter.host_pool import MHAHostPoolDouble  # noqa: E402
from flatcake.align import align_up  # noqa: E402
from flatcake.media.directio import aligned_host_buffer  # noqa: E402
from flatcake.config import FLATCAKE_EXTRA, STORAGE_BATCH_PAGES  # noqa: E402
from flatcake.layout import SUPPORTED_LAYOUTS  # noqa: E402
from flatcake.media.directio import drop_page_cache  # noqa: E402
from flatcake.replay.systems import storage_config  # noqa: E402

SYSTEMS = ("flatcake", "hicache_file", "scattered", "sequential")

#: Model profiles: (layers, kv_heads, head_dim, dtype bytes). KV per token per layer = 2*H*D*bytes.
PROFILES = {
    # Llama-3.2-1B: 16 layers, 8 KV heads x 64; 16-token page = 512 KiB
    "llama3.2-1b": dict(layers=16, kv_heads=8, head_dim=64, page_size=16),
    # Qwen2.5-0.5B: 24 layers, 2 KV heads x 64; 32-token page = 384 KiB
    "qwen2.5-0.5b": dict(layers=24, kv_heads=2, head_dim=64, page_size=32),
    # Llama-3.1-8B: 32 layers, 8 KV heads x 128; 4-token page = 512 KiB (chunk 16 KiB)
    "llama3.1-8b": dict(layers=32, kv_heads=8, head_dim=128, page_size=4),
}


def cpu_seconds() -> float:
    """User + system CPU seconds of this process (all threads)."""
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime


def drop_tree(d: str) -> int:
    n = 0
    for root, _, files in os.walk(d):
        for f in files:
            drop_page_cache(os.path.join(root, f))
            n += 1
    return n


def aligned(nbytes: int) -> np.ndarray:
    """A page-aligned host buffer of at least ``nbytes`` (for O_DIRECT reads)."""
    return aligned_host_buffer(align_up(nbytes))[1]


def pool_digest(pool) -> int:
    return xxhash.xxh3_64_intdigest(pool.kv_buffer.view(torch.uint8).numpy())


class Bench:
    def __init__(self, args):
        self.args = args
        prof = PROFILES[args.profile]
        self.P = prof["page_size"] if args.page_size is None else args.page_size
        self.L = prof["layers"]
        self.pages = args.tokens // self.P
        self.tokens = self.pages * self.P
        self.pool = MHAHostPoolDouble(self.tokens, self.P, self.L, prof["kv_heads"], prof["head_dim"],
                                      dtype=torch.bfloat16, layout=args.layout)
        self.page_bytes = self.pool.get_size_per_token() * self.P
        self.bytes = self.page_bytes * self.pages
        self.chunk_bytes = self.page_bytes // self.L
        self.keys = [f"{random.Random(args.seed).getrandbits(64):016x}-{i:06d}" for i in range(self.pages)]
        self.dir = args.dir or tempfile.mkdtemp(prefix="fc-bench-", dir="/tmp")
        os.makedirs(self.dir, exist_ok=True)
        self.rounds = -(-self.pages // STORAGE_BATCH_PAGES)
        # random KV bytes (tile a 16 MiB random block: cheap and incompressible enough)
        rng = np.random.default_rng(args.seed)
        block = torch.from_numpy(rng.integers(0, 256, 16 << 20, dtype=np.uint8))
        flat = self.pool.kv_buffer.view(torch.uint8).view(-1)
        for o in range(0, flat.numel(), block.numel()):
            k = min(block.numel(), flat.numel() - o)
            flat[o : o + k] = block[:k]
            block = block.roll(4099)
        self.digest = pool_digest(self.pool)
        self.systems = {}

    def indices(self, a: int, b: int) -> torch.Tensor:
        return torch.arange(a * self.P, b * self.P, dtype=torch.int64)

    def clear_pool(self) -> None:
        self.pool.kv_buffer.view(torch.uint8).zero_()

    # ------------------------------------------------------------------ writes
    def write_flatcake(self) -> None:
        from sglang.srt.mem_cache.storage.backend_factory import StorageBackendFactory

        d = os.path.join(self.dir, "flatcake")
        extra = {
            **FLATCAKE_EXTRA, "ssd.path": d, "ssd.max_files": max(8, 2 * self.bytes // (256 << 20) + 4),
            "cio.io_workers": self.args.io_workers,
            "cio.staging_bytes": self.args.staging_bytes,
            "cio.verify_checksums": not self.args.no_verify,
        }
        be = StorageBackendFactory.create_backend("dynamic", storage_config(extra, model="bench/model", layout=self.args.layout), None)
        be.register_mem_pool_host(self.pool)
        for a in range(0, self.pages, STORAGE_BATCH_PAGES):
            b = min(self.pages, a + STORAGE_BATCH_PAGES)
            ok = be.batch_set_v1(self.keys[a:b], self.indices(a, b))
            assert all(ok), f"flatcake batch_set_v1 failed at page {a}"
        st = be.flatcake_stats()
        assert st["pages_written_ssd"] == self.pages, f"only {st['pages_written_ssd']} pages placed on SSD"
        self.fc = be
        self.fc_dir = d

    def write_hicache_file(self) -> None:
        from sglang.srt.mem_cache.storage.backend_factory import StorageBackendFactory

        d = os.path.join(self.dir, "hicache_file")
        be = StorageBackendFactory.create_backend("file", storage_config({"file_storage_path": d}, model="bench/model", layout=self.args.layout), None)
        for a in range(0, self.pages, STORAGE_BATCH_PAGES):
            b = min(self.pages, a + STORAGE_BATCH_PAGES)
            vals = [self.pool.get_data_page(i * self.P, flat=True) for i in range(a, b)]
            assert be.batch_set(self.keys[a:b], vals), "HiCacheFile batch_set failed"
        self.hf = be
        self.hf_dir = d

    def write_scattered(self) -> None:
        self.sc_path = os.path.join(self.dir, "scattered.bin")
        perm = list(range(self.pages))
        random.Random(self.args.seed + 1).shuffle(perm)  # slot s holds page perm[s] (eviction order)
        self.sc_slot = [0] * self.pages
        fd = os.open(self.sc_path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        try:
            os.posix_fallocate(fd, 0, self.pages * self.page_bytes)
            for s, p in enumerate(perm):
                self.sc_slot[p] = s
                data = self.pool.get_data_page(p * self.P, flat=True).contiguous().view(torch.uint8).numpy()
                os.pwrite(fd, data, s * self.page_bytes)
        finally:
            os.close(fd)

    def write_sequential(self) -> None:
        self.seq_path = os.path.join(self.dir, "sequential.bin")
        with open(self.seq_path, "wb") as f:
            f.write(self.pool.kv_buffer.view(torch.uint8).numpy().tobytes()[: self.bytes])

    def drop_all(self) -> None:
        drop_tree(self.fc_dir)
        drop_tree(self.hf_dir)
        drop_page_cache(self.sc_path)
        drop_page_cache(self.seq_path)

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
        pb = self.page_bytes

        def one(job):
            w, pages = job
            buf = bufs[w]
            t = torch.from_numpy(buf)
            for p in pages:
                n = os.preadv(fd, [buf], self.sc_slot[p] * pb)
                assert n == pb
                self.pool.set_from_flat_data_page(p * self.P, t.view(self.pool.dtype))
            return len(pages)

        try:
            jobs = [(w, list(range(w, self.pages, self.args.io_workers))) for w in range(self.args.io_workers)]
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
        ops = getattr(self, f"read_{name}")()
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


def parse_args(argv=None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tokens", type=int, default=32768, help="session length in tokens (default 32768)")
    ap.add_argument("--profile", choices=sorted(PROFILES), default="llama3.2-1b")
    ap.add_argument("--page-size", type=int, default=None, help="tokens per page (default: the profile's)")
    ap.add_argument("--layout", default="page_first", choices=list(SUPPORTED_LAYOUTS))
    ap.add_argument("--io-workers", type=int, default=8, help="I/O threads for flatcake and scattered")
    ap.add_argument("--staging-bytes", type=int, default=0,
                    help="flatcake cio.staging_bytes per buffer (0 = auto: one layer of 128 pages, at least 32 MiB)")
    ap.add_argument("--no-verify", action="store_true", help="flatcake: skip the per-chunk xxh3 check")
    ap.add_argument("--systems", default=",".join(SYSTEMS),
                    help="comma-separated subset to read (all four are always written)")
    ap.add_argument("--torch-threads", type=int, default=1,
                    help="torch intra-op threads (default 1: on a shared 2-core machine the 2-thread "
                         "pool spins and HiCacheFile's page copies collapse; 1 gives the baselines their best case)")
    ap.add_argument("--warmup", type=int, default=1, help="read passes run first and discarded")
    ap.add_argument("--passes", type=int, default=3, help="read passes (each reads every system once)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--dir", default=None, help="scratch directory on the disk under test (default /tmp/fc-bench-*)")
    ap.add_argument("--keep", action="store_true", help="keep the written files")
    ap.add_argument("--json", default=None, help="write the results here")
    args = ap.parse_args(argv)
    args.names = [n for n in args.systems.split(",") if n]
    unknown = set(args.names) - set(SYSTEMS)
    if unknown:
        ap.error(f"unknown systems {sorted(unknown)}")
    return args


def run_passes(b: Bench, args) -> list[dict]:
    """Write every system once, then read each system once per pass (rotating their order);
    the first ``--warmup`` passes are discarded. Returns the measured passes."""
    names = args.names
    print(f"profile {args.profile}: {b.L} layers, page {b.P} tokens = {b.page_bytes} B "
          f"(chunk {b.chunk_bytes} B), {b.pages} pages, {b.bytes / 2**20:.0f} MiB per system, dir {b.dir}")
    wt = {}
    for n in SYSTEMS:
        t = time.perf_counter()
        getattr(b, f"write_{n}")()
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


def summarize(b: Bench, args, passes: list[dict], argv, t_start: float) -> dict:
    """Per-system medians over the passes and the medians of the per-pass ratios."""
    names = args.names
    med = {n: {m: statistics.median(p[n][m] for p in passes) for m in ("gb_per_s", "read_ops", "cpu_s", "wall_s")}
           for n in names}
    ratio = {n: statistics.median(p[n]["gb_per_s"] / p["sequential"]["gb_per_s"] for p in passes)
             for n in names} if "sequential" in names else {}
    speedup = statistics.median(p["flatcake"]["gb_per_s"] / p["hicache_file"]["gb_per_s"] for p in passes) \
        if {"flatcake", "hicache_file"} <= set(names) else None
    return {
        "tokens": b.tokens,
        "bytes": b.bytes,
        "systems": med,
        "ratio_to_sequential": ratio,
        "speedup_vs_hicache_file": speedup,
        "profile": args.profile,
        "page_bytes": b.page_bytes,
        "chunk_bytes": b.chunk_bytes,
        "layers": b.L,
        "rounds_written": b.rounds,
        "read_ops_bound": 2 * b.L * b.rounds,
        "cpu_s_per_gb": {n: med[n]["cpu_s"] / (b.bytes / 1e9) for n in names},
        "passes": passes,
        "runtime_s": time.perf_counter() - t_start,
        "command": " ".join([Path(sys.argv[0]).name] + (argv if argv is not None else sys.argv[1:])),
    }


def main(argv=None) -> int:
    args = parse_args(argv)
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    if args.torch_threads > 0:
        torch.set_num_threads(args.torch_threads)
    t_start = time.perf_counter()
    b = Bench(args)
    try:
        passes = run_passes(b, args)
    finally:
        b.close()
    out = summarize(b, args, passes, argv, t_start)
    print(json.dumps({k: out[k] for k in ("ratio_to_sequential", "speedup_vs_hicache_file", "read_ops_bound")}))
    print(f"cpu-s/GB {json.dumps({n: round(v, 3) for n, v in out['cpu_s_per_gb'].items()})}; "
          f"runtime {out['runtime_s']:.0f} s")
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps(out, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
