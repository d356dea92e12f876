"""The disk's own limit, measured by ``fio`` (Debian's ``fio`` package), for the benchmarks.

Every bench reports its GB/s against fio's best sequential figure on the same file system in the
same run (issue 23, item 6): O_DIRECT, ``libaio``, queue depth 32, one job, the best of 1, 4 and
16 MiB requests, reads from a file fio lays out first and writes into a fresh file. fio is the
reference because it is not our code: our own single-stream ``sequential`` read stays in the
benches, labelled as what it is (one synchronous O_DIRECT stream, queue depth 1).

``python scripts/fio_limit.py --dir DIR --size-mib 1024`` prints the figures as JSON.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Optional, Sequence

MIB = 1 << 20
BLOCK_SIZES_MIB = (1, 4, 16)
IODEPTH = 32


def fio_path() -> Optional[str]:
    """The ``fio`` executable on ``PATH``, or ``None`` (install it: ``apt-get install fio``)."""
    return shutil.which("fio")


def fio_command(path: str, rw: str, bs_mib: int, size_bytes: int, iodepth: int = IODEPTH,
                runtime_s: Optional[float] = None) -> list[str]:
    """The fio command line for one O_DIRECT libaio job: ``rw`` is ``read`` or ``write``
    (sequential), ``bs_mib`` the request size in MiB, ``size_bytes`` the bytes moved (rounded down
    to whole requests); ``runtime_s`` caps the job's time (fio stops at whichever comes first)."""
    if rw not in ("read", "write"):
        raise ValueError(f"rw must be 'read' or 'write', not {rw!r}")
    size = max(bs_mib * MIB, size_bytes // (bs_mib * MIB) * bs_mib * MIB)
    cmd = ["fio", "--name=fc-limit", f"--filename={path}", f"--rw={rw}", f"--bs={bs_mib}M",
           f"--size={size}", "--direct=1", "--ioengine=libaio", f"--iodepth={iodepth}",
           "--numjobs=1", "--group_reporting", "--output-format=json", "--invalidate=1"]
    if rw == "write":
        cmd += ["--end_fsync=1"]
    if runtime_s:
        cmd += [f"--runtime={runtime_s:g}"]
    return cmd


def run_fio(cmd: Sequence[str]) -> dict:
    """Run one fio job; returns ``{"gb_per_s", "bytes", "seconds"}`` (GB = 1e9 bytes). Raises
    ``RuntimeError`` with fio's stderr when it fails."""
    p = subprocess.run(list(cmd), capture_output=True, text=True)
    if p.returncode != 0:
        raise RuntimeError(f"fio failed ({p.returncode}): {p.stderr.strip()[-500:]}")
    out = json.loads(p.stdout[p.stdout.index("{"):])
    job = out["jobs"][0]
    side = job["read"] if job["read"]["io_bytes"] else job["write"]
    nbytes = int(side["io_bytes"])
    seconds = side["runtime"] / 1000.0  # ms
    return {"gb_per_s": nbytes / seconds / 1e9 if seconds else 0.0, "bytes": nbytes, "seconds": seconds}


def fio_limit(directory: str, size_bytes: int, rw: str = "read",
              block_sizes_mib: Sequence[int] = BLOCK_SIZES_MIB, iodepth: int = IODEPTH,
              runtime_s: Optional[float] = None) -> dict:
    """fio's best sequential ``rw`` (``read`` / ``write``) rate in ``directory``'s file system.

    One file of ``size_bytes`` (at least the largest request) is created in a temporary
    directory under ``directory`` and removed afterwards (no storage files left). Returns
    ``{"tool": "fio", "version", "rw", "iodepth", "size_bytes", "by_bs_mib": {bs: gb_per_s},
    "best_gb_per_s", "best_bs_mib", "commands": [...]}``; ``{"tool": "fio", "error": ...}``
    when fio is not installed or fails (benches then report no ratio rather than a wrong one).
    """
    if not fio_path():
        return {"tool": "fio", "error": "fio not installed (apt-get install fio)"}
    size_bytes = max(int(size_bytes), max(block_sizes_mib) * MIB)
    tmp = tempfile.mkdtemp(prefix="fc-fio-", dir=directory)
    path = os.path.join(tmp, "fio.bin")
    by_bs: dict = {}
    cmds = []
    try:
        version = subprocess.run(["fio", "--version"], capture_output=True, text=True).stdout.strip()
        if rw == "read":  # lay the file out first (fio's own write, not timed)
            run_fio(fio_command(path, "write", max(block_sizes_mib), size_bytes, iodepth))
        for bs in block_sizes_mib:
            if rw == "write" and os.path.exists(path):
                os.unlink(path)  # every write run into a fresh file
            cmd = fio_command(path, rw, bs, size_bytes, iodepth, runtime_s)
            cmds.append(" ".join(cmd))
            by_bs[bs] = run_fio(cmd)["gb_per_s"]
    except (RuntimeError, ValueError, OSError) as e:
        return {"tool": "fio", "error": str(e), "by_bs_mib": by_bs, "commands": cmds}
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    best = max(by_bs, key=by_bs.get)
    return {"tool": "fio", "version": version, "rw": rw, "iodepth": iodepth, "size_bytes": size_bytes,
            "by_bs_mib": by_bs, "best_gb_per_s": by_bs[best], "best_bs_mib": best, "commands": cmds}


def ratio_to_fio(gb_per_s: float, fio: dict) -> Optional[float]:
    """``gb_per_s / fio["best_gb_per_s"]``, or ``None`` when fio gave no figure."""
    best = fio.get("best_gb_per_s")
    return gb_per_s / best if best else None


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--dir", default=tempfile.gettempdir(), help="a directory on the file system to measure")
    ap.add_argument("--size-mib", type=int, default=1024, help="bytes per job (MiB)")
    ap.add_argument("--rw", choices=("read", "write", "both"), default="both")
    args = ap.parse_args(argv)
    out = {rw: fio_limit(args.dir, args.size_mib * MIB, rw)
           for rw in (("read", "write") if args.rw == "both" else (args.rw,))}
    print(json.dumps(out, indent=2))
    return 0 if all("error" not in v for v in out.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
