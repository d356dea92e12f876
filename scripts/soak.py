#!/usr/bin/env python3
"""Soak: FlatCake under load, faults and kill -9 restarts, every byte read verified.

A worker process runs FlatCake as SGLang builds it (``StorageBackendFactory`` ``dynamic``
backend on a host-pool double) with small DRAM and SSD capacities, and ``--threads`` threads
calling it as SGLang's threads do: backups (``batch_set_v1`` of a session's next round, chained
by ``prefix_keys``), hit queries (``batch_exists``), prefetch reads (``batch_get_v1``, every page
delivered checked against the bytes its key was written with) and, rarely, ``clear()``; reclaim
runs all the time (the pool is small). Faults are injected on the way:

* in the worker: EIO and short reads (``preadv``), ENOSPC windows for writes and file creation
  (``pwritev``, ``posix_fallocate``), one pool file that starts refusing writes (EROFS);
* from the harness: flipped bytes in pool files, a pool file truncated, a pool file removed;
* ``--restarts N``: the worker is killed with SIGKILL N times at random moments and restarted
  on the same ``ssd.path``; each new worker first reads back what its predecessors committed.

The harness samples the bytes FlatCake holds under ``ssd.path`` throughout. ``--json FILE``
writes ``{"seconds", "ops", "gets", "puts", "faults_injected", "restarts", "verify_failures",
"exceptions_escaped", "pages_served_after_restart", "max_open_fds", "max_bytes_on_disk",
"capacity_bytes", "max_metadata_bytes"}``: ``max_bytes_on_disk`` counts pool files (this pool's
and any other under ``ssd.path``), the bytes the SSD capacity bounds; the pool journal and lock
file are ``max_metadata_bytes``. Exit status 1 when a byte read was wrong, an exception
escaped, nothing was served after a restart, or the pool files outgrew the capacity.

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
    """Faults injected inside the worker by wrapping the ``os`` calls FlatCake's I/O goes through."""

    def __init__(self, rng: random.Random, pool_prefix: str, rate: float):
        self.rng, self.prefix, self.rate = rng, pool_prefix, rate
        self.count = 0
        self.enospc_until = 0.0
        self.refusing: str | None = None
        self.real = {n: getattr(os, n) for n in ("preadv", "pwritev", "posix_fallocate")}

    def _path(self, fd: int) -> str:
        try:
            return os.readlink(f"/proc/self/fd/{fd}")
        except OSError:
            return ""

    def preadv(self, fd, bufs, off):
        r = self.rng.random()
        if r < self.rate:
            self.count += 1
            raise OSError(5, "Input/output error (injected)")
        if r < 2 * self.rate and len(bufs[0]) > 4096:
            self.count += 1
            return self.real["preadv"](fd, [memoryview(bufs[0])[:4096]], off)  # a short read
        return self.real["preadv"](fd, bufs, off)

    def pwritev(self, fd, bufs, off):
        path = self._path(fd)
        if self.refusing and path == self.refusing:
            self.count += 1
            raise OSError(30, "Read-only file system (injected)")
        if time.monotonic() < self.enospc_until and path.endswith(".pool"):
            self.count += 1
            raise OSError(28, "No space left on device (injected)")
        return self.real["pwritev"](fd, bufs, off)

    def posix_fallocate(self, fd, off, n):
        if time.monotonic() < self.enospc_until:
            self.count += 1
            raise OSError(28, "No space left on device (injected)")
        return self.real["posix_fallocate"](fd, off, n)

    def install(self) -> None:
        for name in self.real:
            setattr(os, name, getattr(self, name))

    def tick(self, ssd_dir: str) -> None:
        """Now and then: a window of ENOSPC; once, a pool file that refuses writes."""
        if self.rng.random() < 0.05:
            self.enospc_until = time.monotonic() + 0.3
        if self.refusing is None and self.rng.random() < 0.02:
            files = sorted(p for p in os.listdir(ssd_dir) if p.startswith(self.prefix) and p.endswith(".pool"))
            if files:
                self.refusing = os.path.join(ssd_dir, self.rng.choice(files))


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
    faults = Faults(rng, be.store.ssd.prefix, args.fault_rate)
    log = open(run_dir / f"committed-{args.incarnation}.log", "a", buffering=1)
    clients = [Client(be, pool, t, f"i{args.incarnation}", random.Random(args.seed * 31 + t), log) for t in range(args.threads)]
    after = 0
    for s in recovered_sessions(run_dir):  # what the killed predecessors committed
        after += clients[0].read(s)
    faults.install()
    print("ready", flush=True)  # the harness times this incarnation from here
    stop = time.monotonic() + args.seconds
    state = {"max_fds": 0}

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
    report(run_dir, args.incarnation, clients, faults, after, state["max_fds"])
    return 0


def report(run_dir: Path, inc: int, clients, faults: Faults, after: int, max_fds: int) -> None:
    out = {k: sum(c.c[k] for c in clients) for k in clients[0].c}
    out.update(faults_injected=faults.count, pages_served_after_restart=after, max_open_fds=max_fds)
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


def harness(args) -> int:
    run_dir = Path(tempfile.mkdtemp(prefix="fc-soak-", dir=args.dir))
    ssd_dir = str(run_dir / "ssd")
    rng = random.Random(args.seed)
    segments = args.restarts + 1
    seg_s = args.seconds / segments
    peak_pool = peak_meta = outside = 0
    t0 = time.monotonic()
    try:
        for inc in range(segments):
            last = inc == segments - 1
            run_s = max(1.0, t0 + args.seconds - time.monotonic()) if last else seg_s + 5  # the last: what is left
            cmd = [sys.executable, __file__, "--worker", "--run-dir", str(run_dir), "--incarnation", str(inc),
                   "--seconds", str(run_s), "--threads", str(args.threads),
                   "--seed", str(args.seed + inc), "--fault-rate", str(args.fault_rate)]
            err_path = run_dir / f"worker-{inc}.err"
            with open(err_path, "w") as err:  # a file, not a pipe: the worker never blocks on it
                proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=err, text=True)
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
            if proc.poll() is None:
                proc.send_signal(signal.SIGKILL)
            proc.wait()
            if last and proc.returncode != 0:
                print(err_path.read_text()[-3000:], file=sys.stderr)
        out = summarize(run_dir, args, time.monotonic() - t0, outside, peak_pool, peak_meta)
    finally:
        shutil.rmtree(run_dir, ignore_errors=True)  # never leave storage files behind
    print(json.dumps(out, indent=2))
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps(out, indent=2) + "\n")
    bad = (out["verify_failures"] or out["exceptions_escaped"] or out["max_bytes_on_disk"] > out["capacity_bytes"]
           or (args.restarts and not out["pages_served_after_restart"]))
    return 1 if bad else 0


def summarize(run_dir: Path, args, seconds: float, outside: int, peak_pool: int, peak_meta: int) -> dict:
    reports = [json.loads(p.read_text()) for p in sorted(run_dir.glob("worker-*.json"))]
    tot = {k: sum(r.get(k, 0) for r in reports) for k in
           ("ops", "gets", "puts", "verify_failures", "exceptions_escaped", "faults_injected")}
    return {
        "seconds": round(seconds, 1), **{k: tot[k] for k in ("ops", "gets", "puts")},
        "faults_injected": tot["faults_injected"] + outside, "restarts": args.restarts,
        "verify_failures": tot["verify_failures"], "exceptions_escaped": tot["exceptions_escaped"],
        "pages_served_after_restart": sum(r.get("pages_served_after_restart", 0) for r in reports),
        "max_open_fds": max((r.get("max_open_fds", 0) for r in reports), default=0),
        "max_bytes_on_disk": peak_pool, "capacity_bytes": FILE_BYTES * MAX_FILES, "max_metadata_bytes": peak_meta,
        "workers_reporting": len(reports),
    }


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--seconds", type=float, default=120.0, help="total run time (default 120)")
    ap.add_argument("--restarts", type=int, default=3, help="kill -9 and restart cycles (default 3)")
    ap.add_argument("--threads", type=int, default=4, help="SGLang-like threads in the worker (default 4)")
    ap.add_argument("--fault-rate", type=float, default=0.01, help="probability of an injected read fault (default 0.01)")
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
