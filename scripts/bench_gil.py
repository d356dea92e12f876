#!/usr/bin/env python3
"""GIL benchmark: does FlatCake's data path stall the Python threads it shares a process with?

Inside an SGLang server FlatCake runs in the scheduler's process, so every moment one of its
threads holds the GIL the scheduler loop cannot run. Two measurements, in one run:

1. **Tick overshoot.** A thread ticks every 1 ms (``time.sleep(0.001)``, as a scheduler loop
   polls) and records by how much each tick overshoots. p99 of the overshoot, in ms, while the
   process is otherwise idle (``idle``), while the main thread restores the session from SSD in
   calls of 128 pages (``restore``), and while it writes new sessions in rounds of 128 pages
   (``write``). No CPU-burning thread runs here: with one, every tick waits for CPython's
   switch interval (``sys.getswitchinterval()``, 5 ms) whatever FlatCake does.
2. **Throughput next to a busy thread.** FlatCake's restore and write GB/s with another thread
   burning Python CPU, over the same without it (``busy_over_idle``; 1.0 = unaffected). Each
   time one of FlatCake's threads gives up the GIL (a read, a copy, a hash) it may wait for the
   busy thread's switch interval to get it back, so the fewer, larger GIL-free steps per GB the
   data path takes, the closer to 1.0.

Every restore starts with the page cache of the pool files dropped; every write stores fresh keys
into a new backend whose directory is removed after it. The scratch directory is removed at exit.

    python scripts/bench_gil.py --json runs/bench/gil.json

``--json FILE`` writes ``{"tick_overshoot_p99_ms": {"idle", "restore", "write"},
"busy_over_idle": {"restore", "write"}}``, plus the GB/s behind the ratios (``gb_per_s``) and
the process CPU seconds per GB of the idle runs (``cpu_s_per_gb_idle``).
``--switch-interval-ms`` sets CPython's switch interval for the run, to observe how the busy
thread's cost scales with it (FlatCake itself never changes it).
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
from pathlib import Path
from typing import Optional

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import torch  # noqa: E402

from bench_common import PROFILES, cpu_seconds, drop_tree, flatcake_backend, make_host_pool, percentile, write_json  # noqa: E402
from flatcake.config import STORAGE_BATCH_PAGES  # noqa: E402
from flatcake.layout import SUPPORTED_LAYOUTS  # noqa: E402


class Ticker(threading.Thread):
    """Sleeps ``period_s`` in a loop until stopped; ``overshoot_ms`` holds each tick's lateness."""

    def __init__(self, period_s: float = 0.001):
        super().__init__(daemon=True, name="bench-ticker")
        self.period_s = period_s
        self.overshoot_ms: list[float] = []
        self.stop = threading.Event()

    def run(self) -> None:
        pc, sleep = time.perf_counter, time.sleep
        while not self.stop.is_set():
            t = pc()
            sleep(self.period_s)
            self.overshoot_ms.append((pc() - t - self.period_s) * 1e3)


class Burner(threading.Thread):
    """Burns Python CPU (holds the GIL except at switch-interval handoffs) until stopped."""

    def __init__(self):
        super().__init__(daemon=True, name="bench-burner")
        self.stop = threading.Event()
        self.loops = 0

    def run(self) -> None:
        while not self.stop.is_set():
            x = 0
            for i in range(2000):
                x += i * i
            self.loops += 1


class GilBench:
    """A session in a host pool, stored once in FlatCake for the restores."""

    def __init__(self, args):
        self.args = args
        self.P = args.page_size or PROFILES[args.profile]["page_size"]
        self.pages = args.tokens // self.P
        self.pool, self.mla = make_host_pool(args.profile, self.pages * self.P, self.P, args.layout, seed=args.seed)
        self.page_bytes = self.pool.get_size_per_token() * self.P
        self.bytes = self.pages * self.page_bytes
        os.makedirs(args.dir or tempfile.gettempdir(), exist_ok=True)
        self.dir = tempfile.mkdtemp(prefix="fc-bench-gil-", dir=args.dir or "/tmp")
        self.n = 0
        self.rd_dir = os.path.join(self.dir, "restore")
        self.rd = self.backend(self.rd_dir)
        self.rd_keys = self.keys()
        self.put(self.rd, self.rd_keys)

    def backend(self, d: str):
        return flatcake_backend(self.pool, d, self.args.layout, self.mla, self.bytes, self.page_bytes,
                                **{"cio.io_workers": self.args.io_workers})

    def keys(self) -> list[str]:
        self.n += 1
        r = random.Random(self.args.seed * 1000 + self.n).getrandbits(64)
        return [f"{r:016x}-{i:06d}" for i in range(self.pages)]

    def _calls(self):
        """``(first page, end page, host_indices)`` of each 128-page call. The index tensors are
        made once, outside the clock: in SGLang the scheduler hands them to the backend, and a
        torch op here would give the GIL up like one of FlatCake's own."""
        if not hasattr(self, "_idx"):
            self._idx = [(a, min(self.pages, a + STORAGE_BATCH_PAGES),
                          torch.arange(a * self.P, min(self.pages, a + STORAGE_BATCH_PAGES) * self.P, dtype=torch.int64))
                         for a in range(0, self.pages, STORAGE_BATCH_PAGES)]
        return iter(self._idx)

    def put(self, be, keys) -> None:
        for a, b, idx in self._calls():
            assert all(be.batch_set_v1(keys[a:b], idx)), f"flatcake put failed at page {a}"
        assert be.store.flush_writes(600), "flatcake write queue did not drain"  # on disk (write queue)

    def restore(self) -> float:
        """Drop the page cache, restore the session; returns the restore's wall seconds."""
        drop_tree(self.rd_dir)
        t0 = time.perf_counter()
        for a, b, idx in self._calls():
            ok = self.rd.batch_get_v1(self.rd_keys[a:b], idx)
            assert all(ok), f"flatcake get missed from page {a}"
        return time.perf_counter() - t0

    def write(self) -> float:
        """Store the session under fresh keys in a new backend; returns the writes' wall seconds."""
        d = tempfile.mkdtemp(prefix="write-", dir=self.dir)
        be = self.backend(d)
        try:
            keys = self.keys()
            t0 = time.perf_counter()
            self.put(be, keys)
            return time.perf_counter() - t0
        finally:
            be.close()
            shutil.rmtree(d, ignore_errors=True)

    def close(self) -> None:
        self.rd.close()
        shutil.rmtree(self.dir, ignore_errors=True)


def tick_p99(work, reps: int, idle_s: float) -> float:
    """p99 tick overshoot (ms) while ``work()`` runs ``reps`` times (``None``: sleep ``idle_s``)."""
    tk = Ticker()
    tk.start()
    try:
        if work is None:
            time.sleep(idle_s)
        else:
            for _ in range(reps):
                work()
    finally:
        tk.stop.set()
        tk.join()
    return percentile(tk.overshoot_ms, 99)


def throughput(work, reps: int, nbytes: int, busy: bool, cpu: Optional[list] = None) -> float:
    """Median GB/s of ``reps`` runs of ``work()`` (returns wall seconds), with or without a
    Python-CPU-burning thread; ``cpu`` (idle runs only) gets each run's process CPU seconds."""
    bn = Burner() if busy else None
    if bn is not None:
        bn.start()
    try:
        runs = []
        for _ in range(reps):
            c0 = cpu_seconds()
            runs.append(nbytes / work() / 1e9)
            if cpu is not None:
                cpu.append(cpu_seconds() - c0)
        return statistics.median(runs)
    finally:
        if bn is not None:
            bn.stop.set()
            bn.join()


def parse_args(argv=None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tokens", type=int, default=8192, help="session length in tokens (default 8192)")
    ap.add_argument("--profile", choices=sorted(PROFILES), default="llama3.2-1b")
    ap.add_argument("--page-size", type=int, default=None, help="tokens per page (default: the profile's)")
    ap.add_argument("--layout", default="page_first", choices=list(SUPPORTED_LAYOUTS))
    ap.add_argument("--io-workers", type=int, default=8, help="FlatCake cio.io_workers")
    ap.add_argument("--reps", type=int, default=3, help="restores / writes per measurement (medians)")
    ap.add_argument("--idle-s", type=float, default=1.0, help="seconds of the idle tick measurement")
    ap.add_argument("--torch-threads", type=int, default=1, help="torch intra-op threads (default 1)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--switch-interval-ms", type=float, default=None,
                    help="set CPython's switch interval for this run (an observation; FlatCake never changes it)")
    ap.add_argument("--dir", default=None, help="parent of the scratch directory on the disk under test (default /tmp)")
    ap.add_argument("--json", default=None, help="write the results here")
    args = ap.parse_args(argv)
    if args.page_size is not None and args.page_size <= 0:
        ap.error("--page-size must be positive")
    if args.reps < 1 or args.idle_s <= 0:
        ap.error("--reps must be >= 1 and --idle-s > 0")
    if args.tokens // (args.page_size or PROFILES[args.profile]["page_size"]) < 1:
        ap.error(f"--tokens {args.tokens} is less than one page")
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    if args.torch_threads > 0:
        torch.set_num_threads(args.torch_threads)
    if args.switch_interval_ms is not None:
        sys.setswitchinterval(args.switch_interval_ms / 1e3)
    t0 = time.perf_counter()
    b = GilBench(args)
    print(f"profile {args.profile} ({'MLA' if b.mla else 'MHA'}, {args.layout}): page {b.P} tokens = "
          f"{b.page_bytes} B, {b.pages} pages, {b.bytes / 2**20:.0f} MiB a restore/write, "
          f"switch interval {sys.getswitchinterval() * 1e3:.1f} ms")
    try:
        ticks = {"idle": tick_p99(None, 0, args.idle_s), "restore": tick_p99(b.restore, args.reps, 0),
                 "write": tick_p99(b.write, args.reps, 0)}
        cpu: dict = {"restore": [], "write": []}
        gbps = {(w, busy): throughput(getattr(b, w), args.reps, b.bytes, busy, None if busy else cpu[w])
                for w in ("restore", "write") for busy in (False, True)}
    finally:
        b.close()
    out = {"tick_overshoot_p99_ms": ticks,
           "busy_over_idle": {w: gbps[(w, True)] / gbps[(w, False)] for w in ("restore", "write")},
           "gb_per_s": {f"{w}_{'busy' if busy else 'idle'}": v for (w, busy), v in gbps.items()},
           "cpu_s_per_gb_idle": {w: statistics.median(v) / (b.bytes / 1e9) for w, v in cpu.items()}}
    print("GB/s: " + ", ".join(f"{w} {'busy' if busy else 'idle'} {v:.2f}" for (w, busy), v in gbps.items())
          + "; CPU-s/GB idle: " + ", ".join(f"{w} {v:.2f}" for w, v in out["cpu_s_per_gb_idle"].items()))
    print(json.dumps(out))
    print(f"runtime {time.perf_counter() - t0:.0f} s; command: "
          f"{' '.join(['bench_gil.py'] + (argv if argv is not None else sys.argv[1:]))}")
    # --json holds exactly the schema; the GB/s and CPU-s behind the ratios are printed above
    write_json(args.json, {k: out[k] for k in ("tick_overshoot_p99_ms", "busy_over_idle")})
    return 0


if __name__ == "__main__":
    sys.exit(main())
