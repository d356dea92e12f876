#!/usr/bin/env python3
"""Write rate floor with restores that never stop (issue 24 item 1; ``docs/durability.md``,
"Write rate floor").

FlatCake's SSD write queue writes in the gaps between restore reads, and a deferral bound
(``ssd.write_defer_max_s``, ``ssd.write_urgent_fraction``) makes writes urgent once a round waited
too long or the backlog grew: then they share the disk with the reads. This measures what rate
that leaves the writes. Each mode runs in a new pool directory (removed right after), through
SGLang's dynamic factory with the default write queue and DRAM off (every page on SSD):

* ``no_readers``: store the read set, then write ``--write-mib`` of one session (``batch_set_v1``
  of 128-page calls chained by their prefix keys, as SGLang's backup thread calls it) until the
  write queue has drained (every round written with O_DIRECT and journaled);
* ``readers``: the same, while ``--readers`` threads restore the read set (``batch_get_v1`` of
  128 pages) back to back from before the first put until the queue has drained, and one more
  restore is always queued in the FC-MAS SSD lane (``PageStore.reads_pending``, as on a loaded
  server): no write finds a gap, every round is written because the bound made it urgent
  (``--gaps`` drops the queued one: writes then also use the gaps between two restores).

Reported per mode: ``write_gb_per_s`` (session bytes / first put to drained), ``drain_gb_per_s``
(session bytes / first round's write start to drained: the rate once writing, without the
deadline the first round waits), pages stored of pages put, the restore rate during the write
(and alone, before it, in ``readers``), and the queue's deferral distribution (submit to write
start: p50, p99, max over the rounds) with ``write_urgent_rounds``. ``floor_ratio`` is
``readers`` over ``no_readers`` write rate, taken within one repeat (the two modes run back to
back); ``--repeats`` (decided before running, default 3) repeats the pair, each run is reported
and the top-level ratios are the medians over the repeats.

    python scripts/bench_write_floor.py --write-mib 512 --read-mib 256 --json runs/bench/write_floor.json

``--json FILE`` writes ``{"config": {...}, "runs": [{"modes": {...}, "floor_ratio": x,
"drain_floor_ratio": x}, ...], "modes": {"no_readers": {...}, "readers": {...}}, "floor_ratio": x,
"drain_floor_ratio": x}``: ``runs`` every repeat in order; ``floor_ratio`` and
``drain_floor_ratio`` their medians; ``modes`` the repeat whose ``floor_ratio`` is the median (the
lower middle one for an even count).
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import torch  # noqa: E402

from bench_common import PROFILES, flatcake_backend, make_host_pool, percentile, setup_process, write_json  # noqa: E402
from flatcake.config import STORAGE_BATCH_PAGES  # noqa: E402

MODES = ("no_readers", "readers")


class FloorBench:
    """Host pool: the read set (pages ``[0, R)``), the session (``[R, R + W)``) and one restore
    destination of ``R`` pages per reader after them."""

    def __init__(self, args):
        self.args = args
        prof = PROFILES[args.profile]
        self.P = prof["page_size"]
        probe, _ = make_host_pool(args.profile, self.P, self.P, "page_first")
        self.page_bytes = probe.get_size_per_token() * self.P
        del probe
        self.R = max(1, (args.read_mib << 20) // self.page_bytes)
        self.W = max(1, (args.write_mib << 20) // self.page_bytes)
        pages = self.R + self.W + args.readers * self.R
        self.pool, self.mla = make_host_pool(args.profile, pages * self.P, self.P, "page_first", seed=args.seed)
        self.dir = tempfile.mkdtemp(prefix="fc-bench-floor-", dir=args.dir)

    def idx(self, a: int, b: int) -> torch.Tensor:
        """int64 token slots of host pages ``[a, b)``."""
        return torch.arange(a * self.P, b * self.P, dtype=torch.int64)

    def run(self, mode: str) -> dict:
        from sglang.srt.mem_cache.hicache_storage import HiCacheStorageExtraInfo

        d = tempfile.mkdtemp(prefix=mode + "-", dir=self.dir)
        be = flatcake_backend(self.pool, d, "page_first", self.mla, (self.R + self.W) * self.page_bytes,
                              self.page_bytes, **{"dram.capacity_bytes": 0})
        try:
            rkeys = [f"{mode}-read-{i:06d}" for i in range(self.R)]
            for a in range(0, self.R, STORAGE_BATCH_PAGES):
                b = min(self.R, a + STORAGE_BATCH_PAGES)
                assert all(be.batch_set_v1(rkeys[a:b], self.idx(a, b))), "storing the read set failed"
            assert be.store.flush_writes(600), "the read set was not written"
            st0 = be.flatcake_stats()
            stop, restored, bad = threading.Event(), [0] * self.args.readers, []

            def reader(r: int) -> None:
                base = self.R + self.W + r * self.R
                while not stop.is_set():
                    for a in range(0, self.R, STORAGE_BATCH_PAGES):
                        b = min(self.R, a + STORAGE_BATCH_PAGES)
                        ok = be.batch_get_v1(rkeys[a:b], self.idx(base + a, base + b))
                        if not all(ok):
                            bad.append((a, ok.count(True)))
                        restored[r] += ok.count(True) * self.page_bytes
                        if stop.is_set():
                            return

            threads = [threading.Thread(target=reader, args=(r,), daemon=True) for r in range(self.args.readers)]
            alone = None
            if mode == "readers":
                if not self.args.gaps:  # one restore always queued in the FC-MAS SSD lane
                    be.store.reads_pending(+1)
                for t in threads:
                    t.start()
                r0, t0 = sum(restored), time.perf_counter()
                time.sleep(self.args.read_alone_s)  # restores alone, for comparison
                alone = (sum(restored) - r0) / (time.perf_counter() - t0) / 1e9
            wkeys = [f"{mode}-write-{i:06d}" for i in range(self.W)]
            ok_pages = 0
            r0, t0 = sum(restored), time.perf_counter()
            for a in range(0, self.W, STORAGE_BATCH_PAGES):
                b = min(self.W, a + STORAGE_BATCH_PAGES)
                info = HiCacheStorageExtraInfo(prefix_keys=wkeys[:a])
                ok_pages += be.batch_set_v1(wkeys[a:b], self.idx(self.R + a, self.R + b), info).count(True)
            drained = be.store.flush_writes(600)
            t1 = time.perf_counter()
            during = (sum(restored) - r0) / (t1 - t0) / 1e9
            stop.set()
            for t in threads:
                if t.is_alive():
                    t.join(120)
            if mode == "readers" and not self.args.gaps:
                be.store.reads_pending(-1)
            st = be.flatcake_stats()
            deferrals = list(be.store.queue.deferral_s)[-(st["write_deferral_rounds"] - st0["write_deferral_rounds"]):] \
                if st["write_deferral_rounds"] > st0["write_deferral_rounds"] else []
            wall = t1 - t0
            first_write = min(wall, deferrals[0]) if deferrals else 0.0
            nbytes = self.W * self.page_bytes
            return {
                "write_bytes": nbytes, "pages_put": self.W, "pages_stored": ok_pages, "drained": drained,
                "write_s": wall, "write_gb_per_s": nbytes / wall / 1e9,
                "drain_gb_per_s": nbytes / max(1e-9, wall - first_write) / 1e9,
                "restore_gb_per_s_during_write": during if mode == "readers" else None,
                "restore_gb_per_s_alone": alone, "restore_failures": len(bad),
                "rounds": len(deferrals),
                "deferral_p50_s": percentile(deferrals, 50), "deferral_p99_s": percentile(deferrals, 99),
                "deferral_max_s": max(deferrals, default=0.0),
                "write_urgent_rounds": st["write_urgent_rounds"] - st0["write_urgent_rounds"],
                "put_failures": st["put_failures"] - st0["put_failures"],
                "write_backlog_full_failures": st["write_backlog_full_failures"],
                "write_backlog_dropped_rounds": st["write_backlog_dropped_rounds"],
                "ssd_write_bytes": st["ssd_write_bytes"] - st0["ssd_write_bytes"],
                "backlog_limit_bytes": st["write_backlog_limit_bytes"],
                "write_defer_max_s": be.store.queue.defer_max_s, "write_urgent_fraction": be.store.queue.urgent_fraction,
            }
        finally:
            be.close()
            shutil.rmtree(d, ignore_errors=True)

    def close(self) -> None:
        shutil.rmtree(self.dir, ignore_errors=True)


def parse_args(argv=None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--profile", choices=sorted(PROFILES), default="llama3.2-1b")
    ap.add_argument("--write-mib", type=int, default=512, help="session bytes written per mode (MiB, default 512)")
    ap.add_argument("--read-mib", type=int, default=256, help="read set restored over and over (MiB, default 256)")
    ap.add_argument("--readers", type=int, default=1, help="threads restoring back to back (default 1)")
    ap.add_argument("--read-alone-s", type=float, default=1.0,
                    help="seconds the readers run alone before the writes, for the restore rate alone (default 1)")
    ap.add_argument("--gaps", action="store_true",
                    help="let the writes use the gaps between two restores (default: one restore is always queued "
                         "in the FC-MAS SSD lane, store.reads_pending, as on a loaded server: no gap, every write "
                         "is one the bound made urgent)")
    ap.add_argument("--torch-threads", type=int, default=1, help="torch intra-op threads (default 1)")
    ap.add_argument("--repeats", type=int, default=3,
                    help="times the pair of modes runs, each reported, medians on top (default 3)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--dir", default=None, help="parent of the scratch directory on the disk under test (default /tmp)")
    ap.add_argument("--json", default=None, help="write the results here")
    args = ap.parse_args(argv)
    if args.write_mib < 1 or args.read_mib < 1 or args.readers < 1 or args.repeats < 1:
        ap.error("--write-mib, --read-mib, --readers and --repeats must be >= 1")
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    setup_process(args.torch_threads)
    t0 = time.perf_counter()
    b = FloorBench(args)
    print(f"profile {args.profile}: page {b.P} tokens = {b.page_bytes} B; read set {b.R} pages, session {b.W} pages, "
          f"{args.readers} reader(s); dir {b.dir}")
    runs = []
    try:
        for k in range(args.repeats):
            modes = {}
            for mode in MODES:
                m = modes[mode] = b.run(mode)
                print(f"run {k + 1}/{args.repeats} {mode}: write {m['write_gb_per_s']:.3f} GB/s "
                      f"(drain {m['drain_gb_per_s']:.3f}), {m['pages_stored']}/{m['pages_put']} pages stored, "
                      f"deferral p50 {m['deferral_p50_s']:.3f} s p99 {m['deferral_p99_s']:.3f} s max "
                      f"{m['deferral_max_s']:.3f} s, urgent rounds {m['write_urgent_rounds']}/{m['rounds']}"
                      + (f"; restores {m['restore_gb_per_s_during_write']:.3f} GB/s during the write, "
                         f"{m['restore_gb_per_s_alone']:.3f} alone" if mode == "readers" else ""))
            runs.append({"modes": modes,
                         "floor_ratio": modes["readers"]["write_gb_per_s"] / modes["no_readers"]["write_gb_per_s"],
                         "drain_floor_ratio": modes["readers"]["drain_gb_per_s"] / modes["no_readers"]["drain_gb_per_s"]})
            print(f"run {k + 1}/{args.repeats}: floor ratio {runs[-1]['floor_ratio']:.3f}, "
                  f"drain floor ratio {runs[-1]['drain_floor_ratio']:.3f}")
    finally:
        b.close()
    by_ratio = sorted(runs, key=lambda r: r["floor_ratio"])
    mid = by_ratio[(len(runs) - 1) // 2]
    out = {"config": {"profile": args.profile, "page_bytes": b.page_bytes, "write_mib": args.write_mib,
                      "read_mib": args.read_mib, "readers": args.readers, "gaps": args.gaps, "dram": "off",
                      "repeats": args.repeats,
                      **{k: mid["modes"]["readers"][k]
                         for k in ("write_defer_max_s", "write_urgent_fraction", "backlog_limit_bytes")}},
           "runs": runs, "modes": mid["modes"],
           "floor_ratio": statistics.median(r["floor_ratio"] for r in runs),
           "drain_floor_ratio": statistics.median(r["drain_floor_ratio"] for r in runs)}
    print(f"floor ratio per run {[round(r['floor_ratio'], 3) for r in runs]}, drain floor ratio per run "
          f"{[round(r['drain_floor_ratio'], 3) for r in runs]}; medians:")
    print(json.dumps({k: out[k] for k in ("floor_ratio", "drain_floor_ratio")}))
    print(f"runtime {time.perf_counter() - t0:.0f} s; command: "
          f"{' '.join(['bench_write_floor.py'] + (argv if argv is not None else sys.argv[1:]))}")
    write_json(args.json, out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
