#!/usr/bin/env python3
"""Warm-restart benchmark (docs/durability.md): how long a store takes to serve a full pool again.

Fills an SSD pool until its first eviction (watermarks 0.99 / 0.95: the pool is then as full
as it gets), closes the
store, drops the page cache of every pool file and the journal, and times opening the store
again: replaying the journal and reading each live round's header and record
(:mod:`flatcake.gva.rebuild`). Two round sizes: ``--round-pages`` as SGLang backs up (128 pages
a call) and a small one (sessions that grow a few pages at a time, the worst case: most rounds
per byte). Each rebuild is repeated ``--repeats`` times; the median is reported.

    python scripts/bench_rebuild.py --json runs/bench/rebuild.json

``--json FILE`` writes ``{"capacity_bytes", "runs": [{"round_pages", "pages", "rounds",
"fill_s", "rebuild_s": [...], "median_rebuild_s", "pages_per_s"}]}``.

No ratio to fio's sequential limit (issue 23, item 6): a rebuild reads a small header and record
per live round, not a stream of bytes, so its figure is pages per second, not GB/s.
"""

from __future__ import annotations

import argparse
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from bench_common import write_json  # noqa: E402
from flatcake.adapter.host_pool import MHAHostPoolDouble  # noqa: E402
from flatcake.config import STORAGE_BATCH_PAGES, load_config  # noqa: E402
from flatcake.common.layout import KvPageLayout  # noqa: E402
from flatcake.media.directio import drop_page_cache  # noqa: E402
from flatcake.replay.engine import PageContent  # noqa: E402
from flatcake.store.page_store import PageStore  # noqa: E402

LAYERS, HEADS, HEAD_DIM = 16, 8, 64  # Llama-3.2-1B: 32 KiB of KV per token (bf16)


def open_store(ssd_dir: str, args) -> PageStore:
    cfg = load_config(None, {"ssd.path": ssd_dir, "ssd.file_bytes": args.file_mib << 20, "ssd.max_files": args.files,
                             "dram.capacity_bytes": 0, "ssd.high_watermark": 0.99, "ssd.low_watermark": 0.95})
    lay = KvPageLayout.from_host_pool(make_pool(args))
    return PageStore(cfg, lay.geometry, "bench-rebuild")


def make_pool(args):
    """A host pool of one SGLang call's pages (the source of every round)."""
    return MHAHostPoolDouble(STORAGE_BATCH_PAGES * args.page_size, args.page_size, LAYERS, HEADS, HEAD_DIM,
                             layout="page_first")


def fill(ssd_dir: str, args, round_pages: int) -> tuple[int, int, float]:
    """Write sessions of ``round_pages``-page rounds until the first eviction; returns
    ``(pages published, rounds, seconds)``."""
    store = open_store(ssd_dir, args)
    pool = make_pool(args)
    lay = KvPageLayout.from_host_pool(pool)
    content = PageContent(pool)
    for i in range(round_pages):
        content.fill(i * pool.page_size, f"fill-{i}")  # the bytes do not matter here
    t0 = time.perf_counter()
    s = 0
    while store.snapshot_stats()["reclaimed_scopes_ssd"] == 0:
        session = []
        for r in range(4):  # four rounds a session, chained
            keys = [f"s{s}-r{r}-{i}" for i in range(round_pages)]
            ok = store.put(keys, lay, list(range(round_pages)), session or None)
            if not all(ok):
                break
            session += keys
        s += 1
    dt = time.perf_counter() - t0
    st = store.snapshot_stats()
    rounds = store.scopes.live_rounds
    args.used_fraction = store.ssd.used_fraction()
    store.close()
    return st["pages_indexed"], rounds, dt


def timed_rebuild(ssd_dir: str, args) -> tuple[float, int]:
    for p in Path(ssd_dir).iterdir():
        drop_page_cache(str(p))
    t0 = time.perf_counter()
    store = open_store(ssd_dir, args)
    dt = time.perf_counter() - t0
    pages = store.snapshot_stats()["pages_rebuilt"]
    store.close()
    return dt, pages


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--files", type=int, default=8, help="pool files (default 8)")
    ap.add_argument("--file-mib", type=int, default=256, help="MiB per pool file (default 256: a 2 GiB pool)")
    ap.add_argument("--round-pages", default=f"{STORAGE_BATCH_PAGES},4", help="round sizes to try (pages)")
    ap.add_argument("--page-size", type=int, default=16, help="tokens per page (default 16: 512 KiB pages)")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--dir", default=None, help="scratch directory on the disk under test (default /tmp)")
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)
    runs = []
    for rp in (int(x) for x in args.round_pages.split(",")):
        d = tempfile.mkdtemp(prefix="fc-rebuild-", dir=args.dir)
        try:
            pages, rounds, fill_s = fill(d, args, rp)
            times = []
            for _ in range(args.repeats):
                dt, rebuilt = timed_rebuild(d, args)
                assert rebuilt == pages, f"rebuilt {rebuilt} of {pages} pages"
                times.append(dt)
        finally:
            shutil.rmtree(d, ignore_errors=True)
        med = statistics.median(times)
        runs.append({"round_pages": rp, "pages": pages, "rounds": rounds, "used_fraction": round(args.used_fraction, 3),
                     "fill_s": round(fill_s, 1),
                     "rebuild_s": [round(t, 3) for t in times], "median_rebuild_s": round(med, 3),
                     "pages_per_s": round(pages / med)})
        print(f"rounds of {rp} pages: {pages} pages in {rounds} rounds ({args.used_fraction:.0%} of the pool) "
              f"rebuilt in {med:.3f} s (median of "
              f"{args.repeats}: {', '.join(f'{t:.3f}' for t in times)}); {pages / med:,.0f} pages/s", flush=True)
    out = {"capacity_bytes": args.files * (args.file_mib << 20), "page_bytes": 2 * LAYERS * HEADS * HEAD_DIM * 2 * args.page_size,
           "runs": runs, "command": " ".join([Path(sys.argv[0]).name] + (argv if argv is not None else sys.argv[1:]))}
    write_json(args.json, out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
