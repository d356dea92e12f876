#!/usr/bin/env python3
"""Soak: FlatCake under load, faults and kill -9 restarts, every byte read verified.

A worker process runs FlatCake as SGLang builds it (``StorageBackendFactory`` ``dynamic``
backend on a host-pool double) with small DRAM and SSD capacities and the default I/O paths (the
C restore, the write queue with its C piece writer), and ``--threads`` threads calling it as
SGLang's threads do: backups (``batch_set_v1`` of a session's next round, chained by
``prefix_keys``), hit queries (``batch_exists``), prefetch reads (``batch_get_v1``, every page
delivered checked against the bytes its key was written with) and, rarely, ``clear()``; reclaim
runs all the time (the pool is small). Faults are injected on the way:

* in the worker, where its I/O runs: the worker starts with the LD_PRELOAD interposer of
  :mod:`flatcake.testing.fault_preload` (built at the start with the system C compiler; without
  one the run says so loudly and injects none here), which fails libc's positioned reads and
  writes on the pool files whoever calls them, the C loops included: EIO and short reads
  (``--fault-rate`` per read call each), ENOSPC windows for writes and file allocation, one pool
  file that starts refusing writes (EROFS);
* from the harness: flipped bytes in pool files, a pool file truncated, a pool file removed;
* ``--restarts N``: the worker is killed with SIGKILL N times at random moments and restarted
  on the same ``ssd.path``; each new worker first reads back what its predecessors committed.

The harness samples the bytes FlatCake holds under ``ssd.path`` throughout. ``--json FILE``
writes ``{"seconds", "ops", "gets", "puts", "faults_injected", "restarts", "verify_failures",
"exceptions_escaped", "pages_served_after_restart", "max_open_fds", "max_bytes_on_disk",
"capacity_bytes", "max_metadata_bytes", "workers_reporting", "outside_faults",
"faults_in_c_loops", "faults_by_caller", "native_loops", "fault_injection",
"worker_exit_codes", "failures"}``: ``max_bytes_on_disk`` counts pool files (this pool's and
any other under ``ssd.path``), the bytes the SSD capacity bounds; the pool journal and lock file
are ``max_metadata_bytes``; ``faults_by_caller`` counts the worker's injected faults by the
object that made the call (``_native.cpython-*.so``: FlatCake's C loops, where ``pread`` is the
C restore's and ``pwrite`` the C piece writer's; libpython: ``os``) and ``faults_in_c_loops``
those the C loops saw (each worker binds its C restore and piece writer before it starts;
``native_loops``: the last worker's loop states). Exit status 1, with each reason in ``failures``, when a byte read was
wrong, an exception escaped, nothing was served after a restart, the pool files outgrew the
capacity, a worker exited badly (the last one, or one before it was killed), or a worker's
report is missing (the last one's final report included).

    python scripts/soak.py --seconds 120 --restarts 3 --json runs/soak/soak.json
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

PAGE_TOKENS, LAYERS, HEADS, HEAD_DIM = 4, 4, 2, 16  # 2 KiB pages: many rounds, fast
FILE_BYTES, MAX_FILES = 1 << 20, 6  # 6 MiB of SSD
DRAM_BYTES = 48 * 2048  # 48 page slots
HOST_PAGES_PER_THREAD = 64


def flatcake_extra(ssd_dir: str) -> dict:
    from flatcake.config import FLATCAKE_EXTRA

    return {**FLATCAKE_EXTRA, "ssd.path": ssd_dir, "ssd.file_bytes": FILE_BYTES, "ssd.max_files": MAX_FILES,
            "dram.capacity_bytes": DRAM_BYTES, "cio.verify_checksums": True, "placement.l_agent_tokens": 96,
            "placement.tau_tokens": 64, "placement.short_reply_tokens": 32}


# ================================================================================ the worker
class Faults:
    """Faults injected inside the worker, where its I/O runs: the LD_PRELOAD interposer
    (:mod:`flatcake.testing.fault_preload`) fails libc's ``pread``/``preadv``/``pwrite``/... on the
    pool files, so the C restore and the write queue's C piece writer see them as Python's ``os``
    calls do. Random EIO and short reads (``--fault-rate`` per call) come from the interposer's
    draws; :meth:`tick` adds ENOSPC windows and one pool file that starts refusing writes (EROFS).
    Without the interposer (no C compiler) nothing is injected in the worker."""

    def __init__(self, rng: random.Random, pool_prefix: str):
        from flatcake.testing.fault_preload import Interposer

        self.rng, self.prefix = rng, pool_prefix
        self.fi = Interposer.attach()
        self.refusing: str | None = None

    def install(self) -> None:
        """Start injecting (after the reads of what the predecessors committed)."""
        if self.fi is not None:
            self.fi.arm()

    def report(self) -> list[dict]:
        """Faults injected so far: ``{"symbol", "kind", "caller", "count"}`` each."""
        return [f.__dict__ for f in self.fi.report()] if self.fi is not None else []

    def tick(self, ssd_dir: str) -> None:
        """Now and then: a window of ENOSPC; once, a pool file that refuses writes."""
        if self.fi is None:
            return
        if self.rng.random() < 0.05:
            self.fi.enospc_for(0.3)
        if self.refusing is None and self.rng.random() < 0.02:
            files = sorted(p for p in os.listdir(ssd_dir) if p.startswith(self.prefix) and p.endswith(".pool"))
            if files:
                self.refusing = os.path.join(ssd_dir, self.rng.choice(files))
                self.fi.refuse(self.refusing)


class Client:
    """One SGLang-like thread: its own host pages, sessions and counters."""

    def __init__(self, be, pool, tid: int, run: str, rng: random.Random, log):
        from flatcake.replay.engine import PageContent

        self.be, self.pool, self.tid, self.run, self.rng, self.log = be, pool, tid, run, rng, log
        self.content = PageContent(pool)
        self.first = tid * HOST_PAGES_PER_THREAD
        self.sessions: list[list[str]] = []
        self.c = dict(ops=0, gets=0, puts=0, verify_failures=0, exceptions_escaped=0, served=0)

    def slots(self, n: int, at: int = 0):
        import torch

        pages = torch.arange(self.first + at, self.first + at + n, dtype=torch.int64)
        return (pages[:, None] * PAGE_TOKENS + torch.arange(PAGE_TOKENS)).reshape(-1)

    def call(self, fn, *a):
        try:
            return fn(*a)
        except Exception:  # noqa: BLE001 - the backend must never raise into SGLang
            self.c["exceptions_escaped"] += 1
            return None

    def read(self, keys: list[str]) -> int:
        """Hit query then read of a session's leading run; every delivered page verified."""
        from sglang.srt.mem_cache.hicache_storage import HiCacheStorageExtraInfo

        n = self.call(self.be.batch_exists, keys, HiCacheStorageExtraInfo(prefix_keys=[])) or 0
        n = min(int(n), 32)
        if not n:
            return 0
        self.c["gets"] += 1
        got = self.call(self.be.batch_get_v1, keys[:n], self.slots(n, 32)) or []
        served = 0
        for i, ok in enumerate(got):
            if not ok:
                break
            if not self.content.verify((self.first + 32 + i) * PAGE_TOKENS, keys[i]):
                self.c["verify_failures"] += 1
            served += 1
        return served

    def write(self, session: list[str]) -> None:
        from sglang.srt.mem_cache.hicache_storage import HiCacheStorageExtraInfo

        n = self.rng.randint(1, 8)
        new = [f"{self.run}-{self.tid}-{len(self.sessions)}-{len(session) + i}" for i in range(n)]
        for i, k in enumerate(new):
            self.content.fill((self.first + i) * PAGE_TOKENS, k)
        self.c["puts"] += 1
        ok = self.call(self.be.batch_set_v1, new, self.slots(n), HiCacheStorageExtraInfo(prefix_keys=list(session)))
        if ok and all(ok):
            session.extend(new)
            self.log.write(" ".join(session) + "\n")

    def step(self) -> None:
        self.c["ops"] += 1
        r = self.rng.random()
        if r < 0.002:
            self.call(self.be.clear)
        elif r < 0.35 or not self.sessions:
            if not self.sessions or self.rng.random() < 0.3:
                self.sessions.append([])
            s = self.rng.choice(self.sessions[-8:])
            if len(s) < 48:
                self.write(s)
        else:
            s = self.rng.choice(self.sessions[-16:])
            if s:
                self.c["served"] += self.read(s)


def recovered_sessions(run_dir: Path, limit: int = 200) -> list[list[str]]:
    """The sessions earlier workers committed (the last line written per session), the most
    recently committed first (the least likely to have been evicted or cleared since)."""
    last: dict[str, list[str]] = {}
    logs = sorted(run_dir.glob("committed-*.log"), key=lambda p: int(p.stem.rsplit("-", 1)[1]))
    for p in logs:
        for line in p.read_text().splitlines():
            keys = line.split()
            if keys:
                sid = keys[0].rsplit("-", 1)[0]
                last.pop(sid, None)
                last[sid] = keys
    return list(last.values())[::-1][:limit]


def worker(args) -> int:
    import threading

    from flatcake.adapter.host_pool import MHAHostPoolDouble
    from flatcake.replay.systems import storage_config
    from sglang.srt.mem_cache.storage.backend_factory import StorageBackendFactory

    run_dir, ssd_dir = Path(args.run_dir), str(Path(args.run_dir) / "ssd")
    rng = random.Random(args.seed)
    be = StorageBackendFactory.create_backend("dynamic", storage_config(flatcake_extra(ssd_dir), model="soak"), None)
    pool = MHAHostPoolDouble(args.threads * HOST_PAGES_PER_THREAD * PAGE_TOKENS + 1024, PAGE_TOKENS, LAYERS, HEADS,
                             HEAD_DIM, layout="page_first")
    be.register_mem_pool_host(pool)
    from flatcake.store import native_write
    from flatcake.cio import native_restore

    for loop in (native_restore.LOOP, native_write.LOOP):  # the shipped paths run from the first op
        loop.wait_built()
    faults = Faults(rng, be.store.ssd.prefix)
    log = open(run_dir / f"committed-{args.incarnation}.log", "a", buffering=1)
    clients = [Client(be, pool, t, f"i{args.incarnation}", random.Random(args.seed * 31 + t), log) for t in range(args.threads)]
    after = 0
    for s in recovered_sessions(run_dir):  # what the killed predecessors committed
        after += clients[0].read(s)
    faults.install()
    state = {"max_fds": 0}
    report(run_dir, args.incarnation, clients, faults, after, state["max_fds"])  # a report from here on
    print("ready", flush=True)  # the harness times this incarnation from here
    stop = time.monotonic() + args.seconds

    def run(c: Client):
        while time.monotonic() < stop:
            c.step()

    threads = [threading.Thread(target=run, args=(c,), daemon=True) for c in clients]
    for t in threads:
        t.start()
    while any(t.is_alive() for t in threads):
        time.sleep(0.2)
        faults.tick(ssd_dir)
        state["max_fds"] = max(state["max_fds"], len(os.listdir("/proc/self/fd")))
        report(run_dir, args.incarnation, clients, faults, after, state["max_fds"])
    be.close()
    report(run_dir, args.incarnation, clients, faults, after, state["max_fds"], final=True)
    return 0


def report(run_dir: Path, inc: int, clients, faults: Faults, after: int, max_fds: int, final: bool = False) -> None:
    out = {k: sum(c.c[k] for c in clients) for k in clients[0].c}
    injected = faults.report()
    from flatcake.native import loops as native_loop

    out.update(faults_injected=sum(f["count"] for f in injected), faults=injected, pages_served_after_restart=after,
               max_open_fds=max_fds, final=final, native_loops={n: r["state"] for n, r in native_loop.report().items()})
    tmp = run_dir / f"worker-{inc}.json.tmp"
    tmp.write_text(json.dumps(out))
    os.replace(tmp, run_dir / f"worker-{inc}.json")


# ================================================================================ the harness
def disk_bytes(ssd_dir: str) -> tuple[int, int]:
    """``(pool file bytes, journal + lock bytes)`` FlatCake holds under ``ssd_dir``: blocks
    allocated to pool files (at most their size: a file refilled after a truncation may also
    hold an extent-tree block of the filesystem's), and to the other files."""
    pool = meta = 0
    for name in os.listdir(ssd_dir) if os.path.isdir(ssd_dir) else []:
        if not name.startswith("fc-"):
            continue
        try:
            st = os.stat(os.path.join(ssd_dir, name))
        except OSError:
            continue
        b = st.st_blocks * 512
        if name.endswith(".pool"):
            pool += min(b, st.st_size)  # data blocks; not the filesystem's extent-tree blocks
        else:
            meta += b
    return pool, meta


def outside_fault(rng: random.Random, ssd_dir: str) -> bool:
    """Damage a pool file behind the backend: flip bytes, truncate, or remove it."""
    files = [os.path.join(ssd_dir, n) for n in os.listdir(ssd_dir) if n.endswith(".pool")] if os.path.isdir(ssd_dir) else []
    if not files:
        return False
    path, r = rng.choice(files), rng.random()
    try:
        if r < 0.8:
            with open(path, "r+b") as f:
                size = os.fstat(f.fileno()).st_size
                f.seek(rng.randrange(max(1, size)))
                b = f.read(1) or b"\0"
                f.seek(-len(b), 1)
                f.write(bytes([b[0] ^ 0xFF]))
        elif r < 0.9:
            os.truncate(path, rng.randrange(FILE_BYTES // 2))
        else:
            os.unlink(path)
    except OSError:
        return False
    return True


def worker_command(run_dir: Path, inc: int, seconds: float, args) -> list[str]:
    """The command line of worker incarnation ``inc`` (it prints ``ready`` once started, then
    keeps ``run_dir/worker-{inc}.json`` current)."""
    return [sys.executable, __file__, "--worker", "--run-dir", str(run_dir), "--incarnation", str(inc),
            "--seconds", str(seconds), "--threads", str(args.threads), "--seed", str(args.seed + inc)]


def harness(args) -> int:
    from flatcake.testing import fault_preload

    run_dir = Path(os.path.realpath(tempfile.mkdtemp(prefix="fc-soak-", dir=args.dir)))  # as /proc/self/fd shows it
    ssd_dir = str(run_dir / "ssd")
    rng = random.Random(args.seed)
    segments = args.restarts + 1
    seg_s = args.seconds / segments
    peak_pool = peak_meta = outside = 0
    exits: list[int] = []
    failures: list[str] = []
    t0 = time.monotonic()
    try:
        lib, why = fault_preload.build(run_dir)
        if lib is None:
            injection = f"off: {why}"
            print(f"soak: NO I/O FAULTS INJECTED IN THE WORKER ({why}); only the harness's bit flips, truncations "
                  "and removals run", file=sys.stderr)
        else:
            injection = "LD_PRELOAD interposer: " + " ".join(fault_preload.SYMBOLS)
        for inc in range(segments):
            last = inc == segments - 1
            run_s = max(1.0, t0 + args.seconds - time.monotonic()) if last else seg_s + 5  # the last: what is left
            cmd = worker_command(run_dir, inc, run_s, args)
            env = dict(os.environ) if lib is None else fault_preload.environment(
                lib, path_prefix=ssd_dir + "/", suffix=".pool", rate=args.fault_rate, seed=args.seed + inc)
            # the worker's compiler files go under run_dir: a worker killed while it compiles leaves
            # its temporary directory there, removed with the run
            env["TMPDIR"] = str(run_dir / "tmp")
            (run_dir / "tmp").mkdir(exist_ok=True)
            err_path = run_dir / f"worker-{inc}.err"
            with open(err_path, "w") as err:  # a file, not a pipe: the worker never blocks on it
                proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=err, text=True, env=env)
            if proc.stdout.readline().strip() != "ready":  # start-up (and the reads after a restart) done
                proc.wait()
                raise RuntimeError(f"soak worker {inc} failed to start: {err_path.read_text()[-3000:]}")
            kill_at = time.monotonic() + (rng.uniform(0.6, 1.0) * seg_s if not last else 10 ** 9)
            while proc.poll() is None and time.monotonic() < kill_at:
                time.sleep(0.1)
                pb, mb = disk_bytes(ssd_dir)
                peak_pool, peak_meta = max(peak_pool, pb), max(peak_meta, mb)
                if rng.random() < 0.01 and outside_fault(rng, ssd_dir):
                    outside += 1
            killed = proc.poll() is None
            if killed:
                proc.send_signal(signal.SIGKILL)
            proc.wait()
            exits.append(proc.returncode)
            if proc.returncode != 0 and not killed:  # the last worker's exit, or one that died by itself
                failures.append(f"worker {inc}{' (the last)' if last else ''} exited with {proc.returncode}")
                print(err_path.read_text()[-3000:], file=sys.stderr)
        out = summarize(run_dir, args, time.monotonic() - t0, outside, peak_pool, peak_meta)
    finally:
        shutil.rmtree(run_dir, ignore_errors=True)  # never leave storage files behind
    out.update(fault_injection=injection, worker_exit_codes=exits)
    failures += out.pop("report_failures")
    if out["verify_failures"]:
        failures.append(f"{out['verify_failures']} pages read back were wrong")
    if out["exceptions_escaped"]:
        failures.append(f"{out['exceptions_escaped']} exceptions escaped the backend")
    if out["max_bytes_on_disk"] > out["capacity_bytes"]:
        failures.append(f"pool files held {out['max_bytes_on_disk']} bytes, above the capacity")
    if args.restarts and not out["pages_served_after_restart"]:
        failures.append("nothing was served after a restart")
    out["failures"] = failures
    print(json.dumps(out, indent=2))
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps(out, indent=2) + "\n")
    if failures:
        print("soak FAILED: " + "; ".join(failures), file=sys.stderr)
    return 1 if failures else 0


def summarize(run_dir: Path, args, seconds: float, outside: int, peak_pool: int, peak_meta: int) -> dict:
    """The run's numbers from the workers' reports; ``report_failures`` lists the incarnations
    with no report, and the last one when it wrote no final report (it did not end cleanly)."""
    reports, missing = [], []
    for inc in range(args.restarts + 1):
        p = run_dir / f"worker-{inc}.json"
        if p.exists():
            reports.append(json.loads(p.read_text()))
        else:
            missing.append(f"no report from worker {inc}")
    if len(reports) == args.restarts + 1 and not reports[-1].get("final"):
        missing.append(f"worker {args.restarts} (the last) wrote no final report")
    tot = {k: sum(r.get(k, 0) for r in reports) for k in
           ("ops", "gets", "puts", "verify_failures", "exceptions_escaped", "faults_injected")}
    by_caller: dict = {}
    for f in (f for r in reports for f in r.get("faults", [])):
        kinds = by_caller.setdefault(f["caller"], {})
        kinds[f"{f['symbol']}/{f['kind']}"] = kinds.get(f"{f['symbol']}/{f['kind']}", 0) + f["count"]
    from flatcake.testing.fault_preload import C_LOOP_PREFIX

    return {
        "seconds": round(seconds, 1), **{k: tot[k] for k in ("ops", "gets", "puts")},
        "faults_injected": tot["faults_injected"] + outside, "restarts": args.restarts,
        "verify_failures": tot["verify_failures"], "exceptions_escaped": tot["exceptions_escaped"],
        "pages_served_after_restart": sum(r.get("pages_served_after_restart", 0) for r in reports),
        "max_open_fds": max((r.get("max_open_fds", 0) for r in reports), default=0),
        "max_bytes_on_disk": peak_pool, "capacity_bytes": FILE_BYTES * MAX_FILES, "max_metadata_bytes": peak_meta,
        "workers_reporting": len(reports), "outside_faults": outside,
        "faults_in_c_loops": sum(n for c, kinds in by_caller.items() if c.startswith(C_LOOP_PREFIX) for n in kinds.values()),
        "faults_by_caller": by_caller, "native_loops": reports[-1].get("native_loops", {}) if reports else {},
        "report_failures": missing,
    }


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--seconds", type=float, default=120.0, help="total run time (default 120)")
    ap.add_argument("--restarts", type=int, default=3, help="kill -9 and restart cycles (default 3)")
    ap.add_argument("--threads", type=int, default=4, help="SGLang-like threads in the worker (default 4)")
    ap.add_argument("--fault-rate", type=float, default=0.01,
                    help="probability per read call of an injected EIO, and of a short read (default 0.01)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--dir", default=None, help="where the run's ssd.path goes (default a temp dir under /tmp)")
    ap.add_argument("--json", default=None, help="write the result here")
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--run-dir", help=argparse.SUPPRESS)
    ap.add_argument("--incarnation", type=int, default=0, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.seconds <= 0 or args.restarts < 0 or args.threads < 1:
        ap.error("--seconds must be > 0, --restarts >= 0, --threads >= 1")
    return worker(args) if args.worker else harness(args)


if __name__ == "__main__":
    sys.exit(main())
