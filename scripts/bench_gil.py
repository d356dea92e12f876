#!/usr/bin/env python3
"""GIL benchmark: does FlatCake's data path stall the Python threads it shares a process with?

Inside an SGLang server FlatCake runs in the scheduler's process, so every moment one of its
threads holds the GIL the scheduler loop cannot run, and every core its threads take is one the
scheduler may wait for. Each run (``--repeats`` of them, fixed before the run, every one
reported with the medians) measures:

1. **Tick overshoot.** A thread ticks every 1 ms (``time.sleep(0.001)``, as a scheduler loop
   polls) and records by how much each tick overshoots. p99 of the overshoot, in ms, while the
   process is otherwise idle (``idle``), while the main thread restores the session from SSD in
   calls of 128 pages (``restore``), and while it writes it under new keys in rounds of 128
   pages (``write``). No CPU-burning thread runs here: with one, every tick waits for CPython's
   switch interval (``sys.getswitchinterval()``, 5 ms) whatever FlatCake does.
2. **Next to a busy thread.** A thread burns Python CPU (the scheduler loop at full load) and
   counts its loops. Its own rate (``busy_loops_per_s``) alone (``idle``) and while FlatCake
   restores / writes, and FlatCake's GB/s with it over without it (``busy_over_idle``; 1.0 =
   unaffected). Each time one of FlatCake's threads gives up the GIL (a read, a copy, a hash) it
   may wait for the busy thread's switch interval to get it back, and each time it takes the GIL
   the busy thread stops.
3. **Every core busy** (``both_cores_busy``): the same, with ``cpu_count - 1`` processes spinning
   on the other cores besides the busy thread (on the 2-core machine: both cores busy). The
   restore runs twice, with its C threads in ``SCHED_IDLE`` (``cio.thread_policy: idle``, the
   default) and in ``SCHED_OTHER`` (``normal``): idle-class threads yield to every other thread,
   so this shows whether the default still restores at a useful rate when no core is free.
   Writes do not use ``cio.thread_policy``; they are measured once.

**The measured window** of a restore or a write runs from the start of its first call to the end
of its last (for writes: until the write queue has drained); setting up (dropping the page cache,
starting the write's new backend) and tearing down (closing it, removing its files) lie outside
it. FlatCake's GB/s and the busy thread's loops/s are both taken over that window; the JSON keeps
each window's timestamps (``windows``: ``setup_end_s <= start_s <= end_s <= teardown_start_s``,
``time.perf_counter`` seconds).

Every restore starts with the page cache of the pool files dropped; every write stores fresh keys
into a new backend whose directory is removed after it. The scratch directory is removed at exit,
and the spinning processes are stopped (they also exit by themselves if this process dies).

    python scripts/bench_gil.py --json runs/bench/gil.json

``--json FILE`` writes the medians over the runs, ``{"repeats", "tick_overshoot_p99_ms": {"idle",
"restore", "write"}, "busy_over_idle": {"restore", "write"}, "busy_loops_per_s": {"idle",
"restore", "write"}, "busy_loops_over_idle": {"restore", "write"}, "gb_per_s": {"restore_idle",
"restore_busy", "write_idle", "write_busy"}, "cpu_s_per_gb_idle": {"restore", "write"},
"both_cores_busy": {"hog_processes", "busy_loops_per_s": {"idle", "restore_policy_idle",
"restore_policy_normal", "write"}, "gb_per_s": {...same measurements...}, "over_idle": {...}}}``
(``over_idle``: GB/s over the run's GB/s with nothing else running), plus every run under
``runs`` (the same fields, each run's ``windows`` too). ``--switch-interval-ms`` sets CPython's
switch interval for the run, to observe how the busy thread's cost scales with it (FlatCake
itself never changes it).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import random
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Callable, Optional

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import torch  # noqa: E402

from bench_common import (PROFILES, cpu_seconds, drop_tree, flatcake_backend, make_host_pool, percentile,  # noqa: E402
                          setup_process, write_json)
from flatcake.config import STORAGE_BATCH_PAGES  # noqa: E402
from flatcake.common.layout import SUPPORTED_LAYOUTS  # noqa: E402

#: The spinning process of the every-core-busy run (``python -c HOG_SOURCE <parent pid>``): burns
#: CPU until its parent is gone (also when the parent died before it started).
HOG_SOURCE = ("import os, sys\nparent = int(sys.argv[1])\n"
              "while os.getppid() == parent:\n    for _ in range(100000): pass\n")


class Ticker(threading.Thread):
    """Sleeps ``period_s`` in a loop until stopped; ``ticks`` holds each tick's end
    (``time.perf_counter`` seconds) and lateness (ms)."""

    def __init__(self, period_s: float = 0.001):
        super().__init__(daemon=True, name="bench-ticker")
        self.period_s = period_s
        self.ticks: list[tuple[float, float]] = []
        self.stop = threading.Event()

    def run(self) -> None:
        pc, sleep = time.perf_counter, time.sleep
        while not self.stop.is_set():
            t = pc()
            sleep(self.period_s)
            e = pc()
            self.ticks.append((e, (e - t - self.period_s) * 1e3))

    def overshoot_ms(self, start_s: float, end_s: float) -> list[float]:
        """The overshoot of every tick that ended inside ``[start_s, end_s]``."""
        return [ms for e, ms in self.ticks if start_s <= e <= end_s]


class Burner(threading.Thread):
    """Burns Python CPU (holds the GIL except at switch-interval handoffs) until stopped;
    ``loops`` counts its loops (2,000 multiply-adds each)."""

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


class Window:
    """The measured part of one restore or write (``time.perf_counter`` seconds): set-up ended,
    the first call started, the last call ended (writes: the write queue drained), tear-down
    started; with the busy thread's loop count and the process CPU seconds at start and end.

    Lifecycle, called by the work in this order: ``setup_done -> begin -> end -> teardown``.
    """

    def __init__(self, burner: Optional[Burner] = None):
        self.burner = burner
        self.setup_end_s = self.start_s = self.end_s = self.teardown_start_s = 0.0
        self.loops_start = self.loops_end = 0
        self.cpu_start_s = self.cpu_end_s = 0.0

    def setup_done(self) -> None:
        self.setup_end_s = time.perf_counter()

    def begin(self) -> None:
        self.loops_start = self.burner.loops if self.burner is not None else 0
        self.cpu_start_s = cpu_seconds()
        self.start_s = time.perf_counter()

    def end(self) -> None:
        self.end_s = time.perf_counter()
        self.cpu_end_s = cpu_seconds()
        self.loops_end = self.burner.loops if self.burner is not None else 0

    def teardown(self) -> None:
        self.teardown_start_s = time.perf_counter()

    @property
    def seconds(self) -> float:
        return self.end_s - self.start_s

    @property
    def cpu_s(self) -> float:
        return self.cpu_end_s - self.cpu_start_s

    @property
    def loops_per_s(self) -> float:
        """The busy thread's rate inside the window (0.0 without one)."""
        return (self.loops_end - self.loops_start) / self.seconds if self.seconds > 0 else 0.0

    def as_dict(self) -> dict:
        return {"setup_end_s": self.setup_end_s, "start_s": self.start_s, "end_s": self.end_s,
                "teardown_start_s": self.teardown_start_s, "seconds": self.seconds, "cpu_s": self.cpu_s,
                "busy_loops": self.loops_end - self.loops_start}


class GilBench:
    """A session in a host pool, stored once per ``cio.thread_policy`` for the restores."""

    POLICIES = ("idle", "normal")

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
        self.rd_keys = self.keys()
        self.readers: dict = {}  # policy -> (backend, directory)
        try:
            for policy in self.POLICIES:
                d = os.path.join(self.dir, f"restore-{policy}")
                self.readers[policy] = (self.backend(d, policy), d)
                self.put(self.readers[policy][0], self.rd_keys)
        except BaseException:
            self.close()
            raise

    def backend(self, d: str, policy: str = "idle"):
        return flatcake_backend(self.pool, d, self.args.layout, self.mla, self.bytes, self.page_bytes,
                                **{"cio.io_workers": self.args.io_workers, "cio.thread_policy": policy})

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

    def restore(self, win: Window, policy: str = "idle") -> None:
        """Drop the page cache (set-up), restore the session with the ``policy`` backend."""
        be, d = self.readers[policy]
        drop_tree(d)
        win.setup_done()
        win.begin()
        for a, b, idx in self._calls():
            ok = be.batch_get_v1(self.rd_keys[a:b], idx)
            assert all(ok), f"flatcake get missed from page {a}"
        win.end()
        win.teardown()

    def write(self, win: Window) -> None:
        """Start a new backend (set-up), store the session under fresh keys until the write queue
        drained, close the backend and remove its files (tear-down)."""
        d = tempfile.mkdtemp(prefix="write-", dir=self.dir)
        be = self.backend(d)
        try:
            keys = self.keys()
            win.setup_done()
            win.begin()
            self.put(be, keys)
            win.end()
        finally:
            win.teardown()
            be.close()
            shutil.rmtree(d, ignore_errors=True)

    def close(self) -> None:
        for be, _ in self.readers.values():
            be.close()
        self.readers = {}
        shutil.rmtree(self.dir, ignore_errors=True)


@contextlib.contextmanager
def running(thread: threading.Thread):
    """Start a :class:`Burner` or :class:`Ticker`; stop and join it on exit."""
    thread.start()
    try:
        yield thread
    finally:
        thread.stop.set()
        thread.join()


@contextlib.contextmanager
def hogs(n: int):
    """``n`` processes spinning on the CPU (:data:`HOG_SOURCE`); killed and reaped on exit."""
    procs = []
    try:
        for _ in range(n):
            procs.append(subprocess.Popen([sys.executable, "-c", HOG_SOURCE, str(os.getpid())],
                                          stdin=subprocess.DEVNULL))
        time.sleep(0.1)  # running before anything is measured
        yield procs
    finally:
        for p in procs:
            p.kill()
        for p in procs:
            p.wait()


def default_hogs() -> int:
    """Processes that, with the busy thread, keep every core this process may use busy."""
    try:
        cores = len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        cores = os.cpu_count() or 2
    return max(1, cores - 1)


def alone_rate(burner: Burner, seconds: float) -> float:
    """The busy thread's loops/s over ``seconds`` while FlatCake does nothing."""
    l0, t0 = burner.loops, time.perf_counter()
    time.sleep(seconds)
    return (burner.loops - l0) / (time.perf_counter() - t0)


def one_run(b: GilBench, args) -> dict:
    """One run of every measurement (module docstring); returns its record (``windows``: every
    measured window, by measurement)."""
    gb = lambda win: b.bytes / win.seconds / 1e9  # noqa: E731
    wins: dict = {}

    def measure(name: str, work: Callable[[Window], None], burner: Optional[Burner] = None) -> Window:
        win = Window(burner)
        work(win)
        wins[name] = win.as_dict()
        return win

    ticks = {}
    with running(Ticker()) as tk:
        t0 = time.perf_counter()
        time.sleep(args.idle_s)
        ticks["idle"] = percentile(tk.overshoot_ms(t0, time.perf_counter()), 99)
        for w in ("restore", "write"):
            win = measure(f"tick_{w}", getattr(b, w))
            ticks[w] = percentile(tk.overshoot_ms(win.start_s, win.end_s), 99)
    idle = {w: measure(f"{w}_idle", getattr(b, w)) for w in ("restore", "write")}
    with running(Burner()) as bn:
        loops = {"idle": alone_rate(bn, args.idle_s)}
        busy = {w: measure(f"{w}_busy", getattr(b, w), bn) for w in ("restore", "write")}
    loops.update({w: busy[w].loops_per_s for w in busy})
    with hogs(args.hogs), running(Burner()) as bn:
        both_loops = {"idle": alone_rate(bn, args.idle_s)}
        both = {f"restore_policy_{p}": measure(f"both_restore_policy_{p}", lambda w, p=p: b.restore(w, p), bn)
                for p in GilBench.POLICIES}
        both["write"] = measure("both_write", b.write, bn)
    both_loops.update({k: w.loops_per_s for k, w in both.items()})
    return {
        "tick_overshoot_p99_ms": ticks,
        "busy_over_idle": {w: gb(busy[w]) / gb(idle[w]) for w in idle},
        "busy_loops_per_s": loops,
        "busy_loops_over_idle": {w: loops[w] / loops["idle"] if loops["idle"] else None for w in idle},
        "gb_per_s": {**{f"{w}_idle": gb(idle[w]) for w in idle}, **{f"{w}_busy": gb(busy[w]) for w in busy}},
        "cpu_s_per_gb_idle": {w: idle[w].cpu_s / (b.bytes / 1e9) for w in idle},
        "both_cores_busy": {
            "hog_processes": args.hogs,
            "busy_loops_per_s": both_loops,
            "gb_per_s": {k: gb(w) for k, w in both.items()},
            "over_idle": {k: gb(w) / gb(idle["write" if k == "write" else "restore"]) for k, w in both.items()},
        },
        "windows": wins,
    }


def medians(runs: list) -> dict:
    """Field by field, the median over ``runs`` of every number (``windows`` left out; a field
    that is ``None`` in some run is ``None``)."""
    def med(vals):
        if isinstance(vals[0], dict):
            return {k: med([v[k] for v in vals]) for k in vals[0] if k != "windows"}
        return None if any(v is None for v in vals) else statistics.median(vals)
    return med(runs)


def parse_args(argv=None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tokens", type=int, default=8192, help="session length in tokens (default 8192)")
    ap.add_argument("--profile", choices=sorted(PROFILES), default="llama3.2-1b")
    ap.add_argument("--page-size", type=int, default=None, help="tokens per page (default: the profile's)")
    ap.add_argument("--layout", default="page_first", choices=list(SUPPORTED_LAYOUTS))
    ap.add_argument("--io-workers", type=int, default=8, help="FlatCake cio.io_workers")
    ap.add_argument("--repeats", type=int, default=3,
                    help="runs, fixed before the run (each measures everything once; all reported, medians)")
    ap.add_argument("--idle-s", type=float, default=1.0,
                    help="seconds of each measurement with FlatCake idle (ticks, the busy thread alone)")
    ap.add_argument("--hogs", type=int, default=None,
                    help="spinning processes of the every-core-busy part (default: cores - 1)")
    ap.add_argument("--torch-threads", type=int, default=1, help="torch intra-op threads (default 1)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--switch-interval-ms", type=float, default=None,
                    help="set CPython's switch interval for this run (an observation; FlatCake never changes it)")
    ap.add_argument("--dir", default=None, help="parent of the scratch directory on the disk under test (default /tmp)")
    ap.add_argument("--json", default=None, help="write the results here")
    args = ap.parse_args(argv)
    if args.page_size is not None and args.page_size <= 0:
        ap.error("--page-size must be positive")
    if args.repeats < 1 or args.idle_s <= 0:
        ap.error("--repeats must be >= 1 and --idle-s > 0")
    if args.hogs is None:
        args.hogs = default_hogs()
    if args.hogs < 1:
        ap.error("--hogs must be >= 1")
    if args.tokens // (args.page_size or PROFILES[args.profile]["page_size"]) < 1:
        ap.error(f"--tokens {args.tokens} is less than one page")
    return args


def run_line(r: dict) -> str:
    """One run (or the medians) on one line."""
    t, g, lo, both = r["tick_overshoot_p99_ms"], r["gb_per_s"], r["busy_loops_per_s"], r["both_cores_busy"]
    return (f"tick p99 ms idle/restore/write {t['idle']:.2f}/{t['restore']:.2f}/{t['write']:.2f}; "
            f"GB/s restore {g['restore_idle']:.2f}->{g['restore_busy']:.2f}, write {g['write_idle']:.2f}->"
            f"{g['write_busy']:.2f} with the busy thread; its loops/s idle {lo['idle']:.0f}, restore "
            f"{lo['restore']:.0f}, write {lo['write']:.0f}; every core busy ({both['hog_processes']} hogs): GB/s "
            + ", ".join(f"{k} {v:.2f}" for k, v in both["gb_per_s"].items()) + ", loops/s "
            + ", ".join(f"{k} {v:.0f}" for k, v in both["busy_loops_per_s"].items()))


def main(argv=None) -> int:
    args = parse_args(argv)
    setup_process(args.torch_threads)
    if args.switch_interval_ms is not None:
        sys.setswitchinterval(args.switch_interval_ms / 1e3)
    t0 = time.perf_counter()
    b = GilBench(args)
    print(f"profile {args.profile} ({'MLA' if b.mla else 'MHA'}, {args.layout}): page {b.P} tokens = "
          f"{b.page_bytes} B, {b.pages} pages, {b.bytes / 2**20:.0f} MiB a restore/write, "
          f"switch interval {sys.getswitchinterval() * 1e3:.1f} ms; {args.repeats} runs", flush=True)
    runs = []
    try:
        for k in range(args.repeats):
            runs.append(one_run(b, args))
            print(f"run {k + 1}/{args.repeats}: " + run_line(runs[-1]), flush=True)
    finally:
        b.close()
    out = {"repeats": args.repeats, **medians(runs), "runs": runs}
    out["both_cores_busy"]["hog_processes"] = args.hogs  # (not a median)
    print("medians: " + run_line(out))
    print(json.dumps({k: out[k] for k in ("tick_overshoot_p99_ms", "busy_over_idle", "busy_loops_over_idle")}))
    print(f"runtime {time.perf_counter() - t0:.0f} s; command: "
          f"{' '.join(['bench_gil.py'] + (argv if argv is not None else sys.argv[1:]))}")
    write_json(args.json, out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
