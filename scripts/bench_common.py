"""Helpers shared by the ``scripts/bench_*.py`` benchmarks: medians over repeated runs and the
``--json`` output."""

from __future__ import annotations

import contextlib
import json
import shutil
import statistics
import tempfile
from pathlib import Path
from typing import Any, Optional, Sequence


def median_of(runs: Sequence[dict], field: str, value: str, *path: str) -> float:
    """Median of ``run[path[0]][path[1]]...`` over the runs whose ``run[field] == value``."""
    vals = []
    for r in runs:
        if r[field] == value:
            v: Any = r
            for p in path:
                v = v[p]
            vals.append(v)
    return statistics.median(vals)


def write_json(path: Optional[str], obj: dict) -> None:
    """Write ``obj`` as indented JSON to ``path`` (parents created); nothing when ``path`` is None."""
    if path:
        Path(path).parent.mkdir(parents=True, exist_ok=True)
        Path(path).write_text(json.dumps(obj, indent=2) + "\n")


def add_common_args(ap, root: Path, repeats: int, what: str) -> None:
    """The arguments every serving benchmark takes: ``--profile``, ``--host-pool-pages``,
    ``--repeats`` (``what`` names the compared thing), ``--seed``, ``--dir``, ``--json``."""
    ap.add_argument("--profile", default=str(root / "configs" / "model-qwen2.5-0.5b.yaml"))
    ap.add_argument("--host-pool-pages", type=int, default=1024)
    ap.add_argument("--repeats", type=int, default=repeats,
                    help=f"runs of each {what} (default {repeats}; medians reported)")
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--dir", default=tempfile.gettempdir(), help="where the temporary storage goes")
    ap.add_argument("--json", help="write the results here")


@contextlib.contextmanager
def temp_system(name: str, profile, host_pool_pages: int, base: Path, flatcake_keys: dict, prefix: str):
    """System ``name`` (:func:`flatcake.replay.systems.make_system`) with its storage in a new
    temporary directory under ``base``; closed and removed on exit (no storage files left)."""
    from flatcake.replay.systems import make_system

    out = Path(tempfile.mkdtemp(prefix=prefix, dir=base))
    system = make_system(name, profile, host_pool_pages, out, flatcake_keys)
    try:
        yield system
    finally:
        system.close()
        shutil.rmtree(out, ignore_errors=True)
