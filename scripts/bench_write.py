#!/usr/bin/env python3
"""Write benchmark (paper §3.1 write-time placement, §3.3 layer-major rounds): one long session
stored to SSD, against fio's sequential write limit and SGLang's HiCacheFile.

Each pass writes the same ``--tokens`` tokens of a model profile (random bytes in an SGLang host
pool double) three ways, each into its own new directory, removed right after it was measured:

* ``flatcake``     FlatCake through SGLang's dynamic factory: ``batch_set_v1`` of whole rounds
                   (128 pages a call, as SGLang's backup thread calls it): gather layer-major,
                   per-chunk xxh3, one O_DIRECT write of header + data, one of the round record,
                   journal entry (the backend is started before the clock starts), until its
                   write queue has drained;
* ``hicache_file`` SGLang's HiCacheFile (one file per page), ``batch_set`` of 128 pages a call
                   (buffered writes into the page cache);
* ``sequential``   one O_DIRECT stream of 16 MiB writes of the same bytes to one file (copied
                   from the pool into an aligned buffer, as any writer must), queue depth 1: our
                   own single-stream figure, kept beside fio's.

**One durability rule for every system** (:data:`DURABILITY`): a system's write ends when its
data is on the medium, i.e. after one ``fdatasync`` of every file it wrote (every file under its
directory), inside the clock; fio's job ends the same way (``--end_fsync=1``). Neither real
system syncs when it reports a put done (FlatCake's O_DIRECT writes have reached the device,
HiCacheFile's only the page cache; ``docs/durability.md``), so the rule charges each the sync its
own "done" skips and nobody a sync the others skip; HiCacheFile pays one per file because it
writes one file per page. (Directory entries are synced for no system: a file's name is as
durable as its directory's last sync, equally for all.)

**The limit** is fio's best sequential write (O_DIRECT, libaio, queue depth 32, the best of 1, 4
and 16 MiB requests, the same bytes as one write, into a fresh file on the same file system;
``scripts/fio_limit.py``), measured in every pass, in the rotation with the systems. Each
system's ``ratio_to_fio`` is the median over the passes of its GB/s over that pass's fio.

The number of passes is fixed before the run (``--passes``, after ``--warmup`` discarded ones);
every pass is printed and kept in the JSON, with the medians. Passes rotate the order. Ratios
to ``sequential`` and the HiCacheFile speedup are medians of per-pass ratios (this virtual disk
varies about 2x between runs).

    python scripts/bench_write.py --json runs/bench/write.json

``--json FILE`` writes ``{"passes_planned": n, "warmup_passes": w, "durability": str,
"systems": {name: {"gb_per_s", "cpu_s"}}, "ratio_to_sequential": {name: x},
"speedup_vs_hicache_file": x, "fio_write": {"best_gb_per_s", "passes_gb_per_s", "commands", ...},
"ratio_to_fio": {name: x}, "passes": [{name: {"gb_per_s", "cpu_s", "ratio_to_fio"}, "fio": {...}}]}``
(medians over the passes, every pass under ``passes``; ``ratio_to_fio`` values are ``null`` when
fio gave no figure, ``fio_write`` then holds its ``error``; ``--no-fio`` skips it).
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

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import torch  # noqa: E402

from bench_common import PROFILES, aligned, cpu_seconds, flatcake_backend, make_host_pool, setup_process, write_json  # noqa: E402
from fio_limit import IODEPTH, fio_limit, ratio_to_fio  # noqa: E402
from flatcake.common.align import align_up  # noqa: E402
from flatcake.config import STORAGE_BATCH_PAGES  # noqa: E402
from flatcake.common.layout import SUPPORTED_LAYOUTS  # noqa: E402

SYSTEMS = ("flatcake", "hicache_file", "sequential")

#: The rule every system's write ends with (``--json``'s ``durability``; see the module docstring).
DURABILITY = ("on the medium: each system's write ends with one fdatasync of every file it wrote (every "
              "file under its directory), inside the clock; fio: --end_fsync=1")


def sync_tree(d: str) -> int:
    """``fdatasync`` every file under ``d`` once (:data:`DURABILITY`); returns the file count."""
    n = 0
    for root, _, files in os.walk(d):
        for f in files:
            fd = os.open(os.path.join(root, f), os.O_RDONLY)
            try:
                os.fdatasync(fd)
            finally:
                os.close(fd)
            n += 1
    return n


class WriteBench:
    """One session of ``args.tokens`` tokens in a host pool; :meth:`measure` writes it once."""

    def __init__(self, args):
        self.args = args
        self.P = args.page_size or PROFILES[args.profile]["page_size"]
        self.pages = args.tokens // self.P
        self.tokens = self.pages * self.P
        self.pool, self.mla = make_host_pool(args.profile, self.tokens, self.P, args.layout, seed=args.seed)
        self.page_bytes = self.pool.get_size_per_token() * self.P
        self.bytes = self.pages * self.page_bytes
        os.makedirs(args.dir or tempfile.gettempdir(), exist_ok=True)
        self.dir = tempfile.mkdtemp(prefix="fc-bench-write-", dir=args.dir or "/tmp")
        self.n = 0

    def keys(self) -> list[str]:
        """Fresh page keys for one write (no write finds its pages already stored)."""
        self.n += 1
        r = random.Random(self.args.seed * 1000 + self.n).getrandbits(64)
        return [f"{r:016x}-{i:06d}" for i in range(self.pages)]

    def indices(self, a: int, b: int) -> torch.Tensor:
        return torch.arange(a * self.P, b * self.P, dtype=torch.int64)

    def _timed(self, fn) -> dict:
        c0, t0 = cpu_seconds(), time.perf_counter()
        fn()
        wall, cpu = time.perf_counter() - t0, cpu_seconds() - c0
        return {"gb_per_s": self.bytes / wall / 1e9, "cpu_s": cpu}

    def measure(self, name: str) -> dict:
        """Write the session once with system ``name`` (or ``fio``: its write limit, the dict
        :func:`fio_limit.fio_limit` returns) into a new directory; remove it after."""
        d = tempfile.mkdtemp(prefix=name + "-", dir=self.dir)
        try:
            return getattr(self, f"write_{name}")(d)
        finally:
            shutil.rmtree(d, ignore_errors=True)

    def write_flatcake(self, d: str) -> dict:
        be = flatcake_backend(self.pool, d, self.args.layout, self.mla, self.bytes, self.page_bytes)
        keys = self.keys()

        def run():
            for a in range(0, self.pages, STORAGE_BATCH_PAGES):
                b = min(self.pages, a + STORAGE_BATCH_PAGES)
                assert all(be.batch_set_v1(keys[a:b], self.indices(a, b))), f"flatcake put failed at page {a}"
            assert be.store.flush_writes(600), "flatcake write queue did not drain"
            sync_tree(d)  # on the medium (DURABILITY)

        try:
            out = self._timed(run)
            st = be.flatcake_stats()
            assert st["pages_written_ssd"] == self.pages, f"only {st['pages_written_ssd']} pages on SSD"
        finally:
            be.close()
        return out

    def write_hicache_file(self, d: str) -> dict:
        from sglang.srt.mem_cache.storage.backend_factory import StorageBackendFactory
        from flatcake.replay.systems import storage_config

        be = StorageBackendFactory.create_backend(
            "file", storage_config({"file_storage_path": d}, model="bench/model", mla=self.mla,
                                   layout=self.args.layout), None)
        keys = self.keys()

        def run():
            for a in range(0, self.pages, STORAGE_BATCH_PAGES):
                b = min(self.pages, a + STORAGE_BATCH_PAGES)
                vals = [self.pool.get_data_page(i * self.P, flat=True) for i in range(a, b)]
                assert be.batch_set(keys[a:b], vals), "HiCacheFile batch_set failed"
            sync_tree(d)  # on the medium (DURABILITY)

        return self._timed(run)

    def write_fio(self, d: str) -> dict:
        return fio_limit(d, self.bytes, rw="write")

    def write_sequential(self, d: str) -> dict:
        step = 16 << 20
        src = self.pool.kv_buffer.view(torch.uint8).view(-1).numpy()[: self.bytes]
        buf = aligned(step)

        def run():
            fd = os.open(os.path.join(d, "sequential.bin"), os.O_WRONLY | os.O_CREAT | os.O_DIRECT, 0o644)
            try:
                for o in range(0, self.bytes, step):
                    k = min(step, self.bytes - o)
                    buf[:k] = src[o: o + k]
                    n = align_up(k)
                    buf[k:n] = 0
                    assert os.pwrite(fd, buf[:n], o) == n
            finally:
                os.close(fd)
            sync_tree(d)  # on the medium (DURABILITY)

        return self._timed(run)

    def close(self) -> None:
        shutil.rmtree(self.dir, ignore_errors=True)


def parse_args(argv=None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tokens", type=int, default=16384, help="session length in tokens (default 16384)")
    ap.add_argument("--profile", choices=sorted(PROFILES), default="llama3.2-1b")
    ap.add_argument("--page-size", type=int, default=None, help="tokens per page (default: the profile's)")
    ap.add_argument("--layout", default="page_first", choices=list(SUPPORTED_LAYOUTS))
    ap.add_argument("--systems", default=",".join(SYSTEMS),
                    help="comma-separated subset (flatcake and sequential are always written)")
    ap.add_argument("--torch-threads", type=int, default=1, help="torch intra-op threads (default 1)")
    ap.add_argument("--warmup", type=int, default=1, help="passes run first and discarded")
    ap.add_argument("--passes", type=int, default=3,
                    help="measured passes, fixed before the run (each writes every system once; all reported)")
    ap.add_argument("--no-fio", action="store_true", help="skip fio's write limit (ratio_to_fio is then null)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--dir", default=None, help="parent of the scratch directory on the disk under test (default /tmp)")
    ap.add_argument("--json", default=None, help="write the results here")
    args = ap.parse_args(argv)
    args.names = [n for n in args.systems.split(",") if n]
    for must in ("flatcake", "sequential"):
        if must not in args.names:
            args.names.append(must)
    if set(args.names) - set(SYSTEMS):
        ap.error(f"unknown systems {sorted(set(args.names) - set(SYSTEMS))}")
    if args.page_size is not None and args.page_size <= 0:
        ap.error("--page-size must be positive")
    if args.passes < 1 or args.warmup < 0:
        ap.error("--passes must be >= 1 and --warmup >= 0")
    if args.tokens // (args.page_size or PROFILES[args.profile]["page_size"]) < 1:
        ap.error(f"--tokens {args.tokens} is less than one page")
    return args


def summarize(passes: list[dict], names: list[str]) -> dict:
    """The ``--json`` object: per-system medians, medians of the per-pass ratios (to
    ``sequential``, to that pass's fio, FlatCake over HiCacheFile), fio's write limit (median
    over the passes, each pass's figure) and every pass, each system's entry with its own
    ``ratio_to_fio``. A pass without a ``fio`` entry, or whose fio failed, has no fio ratio."""
    med = {n: {m: statistics.median(p[n][m] for p in passes) for m in ("gb_per_s", "cpu_s")} for n in names}
    ratio = {n: statistics.median(p[n]["gb_per_s"] / p["sequential"]["gb_per_s"] for p in passes) for n in names}
    speedup = statistics.median(p["flatcake"]["gb_per_s"] / p["hicache_file"]["gb_per_s"] for p in passes) \
        if "hicache_file" in names else None
    fios = [p.get("fio") or {"tool": "fio", "error": "not run (--no-fio)"} for p in passes]
    runs = [{**{n: {**p[n], "ratio_to_fio": ratio_to_fio(p[n]["gb_per_s"], f)} for n in names}, "fio": f}
            for p, f in zip(passes, fios)]

    def median_or_none(vals):
        vals = [v for v in vals if v is not None]
        return statistics.median(vals) if vals else None

    bests = [f.get("best_gb_per_s") for f in fios]
    ok = [f for f in fios if f.get("best_gb_per_s")]
    fio = {"tool": "fio", "rw": "write", "iodepth": IODEPTH, "best_gb_per_s": median_or_none(bests),
           "passes_gb_per_s": bests, **({"version": ok[0].get("version"), "size_bytes": ok[0].get("size_bytes"),
                                         "commands": ok[0].get("commands")} if ok else {"error": fios[0].get("error")})}
    to_fio = {n: median_or_none(r[n]["ratio_to_fio"] for r in runs) for n in names}
    return {"durability": DURABILITY, "systems": med, "ratio_to_sequential": ratio,
            "speedup_vs_hicache_file": speedup, "fio_write": fio, "ratio_to_fio": to_fio, "passes": runs}


def main(argv=None) -> int:
    args = parse_args(argv)
    setup_process(args.torch_threads)
    t0 = time.perf_counter()
    b = WriteBench(args)
    names = args.names
    print(f"profile {args.profile} ({'MLA' if b.mla else 'MHA'}, {args.layout}): page {b.P} tokens = "
          f"{b.page_bytes} B, {b.pages} pages, {b.bytes / 2**20:.0f} MiB a write, dir {b.dir}")
    passes = []
    try:
        print(f"{args.passes} passes after {args.warmup} warm-up; durability: {DURABILITY}")
        rotation = names + ([] if args.no_fio else ["fio"])
        for k in range(-args.warmup, args.passes):
            order = rotation[k % len(rotation):] + rotation[: k % len(rotation)]
            res = {n: b.measure(n) for n in order}
            fio = res.get("fio", {})
            line = ", ".join(f"{n} {res[n]['gb_per_s']:.2f} GB/s ({res[n]['cpu_s']:.2f} cpu-s"
                             + (f", {res[n]['gb_per_s'] / fio['best_gb_per_s']:.2f}x fio)"
                                if fio.get("best_gb_per_s") else ")") for n in names)
            line += (f"; fio {fio['best_gb_per_s']:.2f} GB/s ({fio['best_bs_mib']} MiB, QD {fio['iodepth']})"
                     if fio.get("best_gb_per_s") else f"; fio: {fio.get('error', 'not run (--no-fio)')}")
            print(("warm-up pass (discarded): " if k < 0 else f"pass {k}: ") + line)
            if k >= 0:
                passes.append(res)
    finally:
        b.close()
    out = {"passes_planned": args.passes, "warmup_passes": args.warmup, **summarize(passes, names)}
    print("medians: " + ", ".join(f"{n} {out['systems'][n]['gb_per_s']:.2f} GB/s" for n in names))
    print(json.dumps({k: out[k] for k in ("ratio_to_sequential", "speedup_vs_hicache_file", "ratio_to_fio")}))
    print(f"runtime {time.perf_counter() - t0:.0f} s; command: {' '.join(['bench_write.py'] + (argv if argv is not None else sys.argv[1:]))}")
    write_json(args.json, out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
