"""Helpers shared by the ``scripts/bench_*.py`` benchmarks: medians over repeated runs, the
``--json`` output, the disk's limit by fio (:class:`FioRead`, :func:`nearest_fio`) and the
baselines' pre-faulted buffers (:func:`prefaulted`)."""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import statistics
import tempfile
from pathlib import Path
from typing import Any, Optional, Sequence


def setup_process(torch_threads: int) -> None:
    """What every storage bench does first in ``main``: WARNING-level logging for FlatCake's and
    SGLang's loggers, and ``torch_threads`` intra-op threads for torch (0: torch's default)."""
    import logging

    import torch

    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    if torch_threads > 0:
        torch.set_num_threads(torch_threads)


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


# ---------------------------------------------------------------- FlatCake data-path benchmarks
#: Model profiles of bench_restore / bench_write / bench_gil: layers, KV shape per token and
#: layer, default tokens per page. MHA: K and V planes of ``kv_heads * head_dim`` bf16 each;
#: MLA: one latent plane of ``kv_cache_dim`` bf16.
PROFILES = {
    # Llama-3.2-1B: 16 layers, 8 KV heads x 64; 16-token page = 512 KiB
    "llama3.2-1b": dict(layers=16, kv_heads=8, head_dim=64, page_size=16),
    # Qwen2.5-0.5B: 24 layers, 2 KV heads x 64; 32-token page = 384 KiB
    "qwen2.5-0.5b": dict(layers=24, kv_heads=2, head_dim=64, page_size=32),
    # Llama-3.1-8B: 32 layers, 8 KV heads x 128; 4-token page = 512 KiB (chunk 16 KiB)
    "llama3.1-8b": dict(layers=32, kv_heads=8, head_dim=128, page_size=4),
    # DeepSeek-V2-Lite (MLA): 27 layers, kv_cache_dim 576 (512 latent + 64 rope); 64-token page = 1.9 MiB
    "deepseek-v2-lite": dict(layers=27, kv_cache_dim=576, page_size=64, mla=True),
}


def cpu_seconds() -> float:
    """User + system CPU seconds of this process (all threads)."""
    import resource

    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime


def drop_tree(d: str) -> int:
    """``fdatasync`` + ``posix_fadvise(DONTNEED)`` every file under ``d``; returns the file count."""
    import os

    from flatcake.media.directio import drop_page_cache

    n = 0
    for root, _, files in os.walk(d):
        for f in files:
            drop_page_cache(os.path.join(root, f))
            n += 1
    return n


def make_host_pool(profile: str, tokens: int, page_size: int, layout: str, seed: int = 0):
    """An SGLang host-pool double (bf16) of ``tokens`` token slots for ``profile``
    (:data:`PROFILES`), filled with random bytes (a 16 MiB random block, tiled and rotated).

    Returns:
        ``(pool, is_mla)``.
    """
    import numpy as np
    import torch

    from flatcake.adapter.host_pool import MHAHostPoolDouble, MLAHostPoolDouble

    prof = PROFILES[profile]
    if prof.get("mla"):
        pool = MLAHostPoolDouble(tokens, page_size, prof["layers"], prof["kv_cache_dim"], dtype=torch.bfloat16,
                                 layout=layout)
    else:
        pool = MHAHostPoolDouble(tokens, page_size, prof["layers"], prof["kv_heads"], prof["head_dim"],
                                 dtype=torch.bfloat16, layout=layout)
    rng = np.random.default_rng(seed)
    block = torch.from_numpy(rng.integers(0, 256, 16 << 20, dtype=np.uint8))
    flat = pool.kv_buffer.view(torch.uint8).view(-1)
    for o in range(0, flat.numel(), block.numel()):
        k = min(block.numel(), flat.numel() - o)
        flat[o: o + k] = block[:k]
        block = block.roll(4099)
    return pool, bool(prof.get("mla"))


def flatcake_backend(pool, directory: str, layout: str, mla: bool, nbytes: int, page_bytes: int, **extra):
    """FlatCake through SGLang's dynamic factory (``FlatCakeStorage``), registered on ``pool``,
    its pool files in ``directory`` (created on first use): files of at least 256 MiB and one
    128-page round of ``page_bytes`` pages, enough of them for ``2 * nbytes`` bytes.
    ``extra`` are dotted config keys (``cio.io_workers`` as ``**{"cio.io_workers": 8}``)."""
    from sglang.srt.mem_cache.storage.backend_factory import StorageBackendFactory

    from flatcake.config import FLATCAKE_EXTRA, STORAGE_BATCH_PAGES
    from flatcake.replay.systems import storage_config

    mib = 1 << 20
    file_bytes = -(-max(256 * mib, STORAGE_BATCH_PAGES * page_bytes + 4 * mib) // mib) * mib
    cfg = {**FLATCAKE_EXTRA, "ssd.path": directory, "ssd.file_bytes": file_bytes,
           "ssd.max_files": max(8, 2 * nbytes // file_bytes + 4), **extra}
    be = StorageBackendFactory.create_backend(
        "dynamic", storage_config(cfg, model="bench/model", mla=mla, layout=layout), None)
    be.register_mem_pool_host(pool)
    return be


def percentile(values: Sequence[float], q: float) -> float:
    """The ``q``-th percentile (0..100, nearest rank) of ``values``; 0.0 when empty."""
    if not values:
        return 0.0
    import math

    s = sorted(values)
    k = max(0, min(len(s) - 1, math.ceil(q / 100 * len(s)) - 1))
    return float(s[k])


def aligned(nbytes: int):
    """A page-aligned uint8 numpy host buffer of at least ``nbytes`` bytes (for O_DIRECT I/O)."""
    from flatcake.common.align import align_up
    from flatcake.media.directio import aligned_host_buffer

    return aligned_host_buffer(align_up(nbytes))[1]


def prefaulted(nbytes: int):
    """A page-aligned uint8 numpy buffer of at least ``nbytes`` bytes under FlatCake's staging
    policy (``aligned_host_buffer(huge=True)``: ``MADV_HUGEPAGE`` unless ``FLATCAKE_HUGEPAGES=0``,
    every page faulted in now), for a baseline's buffers: made once, outside the timed region,
    as FlatCake's staging windows are (issue 23, item 7). The array keeps the mapping alive."""
    from flatcake.common.align import align_up
    from flatcake.media.directio import aligned_host_buffer

    return aligned_host_buffer(align_up(max(1, nbytes)), huge=True)[1]  # np.frombuffer holds the mapping


# ---------------------------------------------------------------- the disk's limit (fio)
class FioRead:
    """fio's best sequential O_DIRECT read (``scripts/fio_limit.py``'s job: libaio, queue depth
    32, the best of 1, 4 and 16 MiB requests) of one file, laid out once and read again at every
    :meth:`measure`, so a bench can measure the limit next to each of its passes without writing
    the file again each time (a write burst just before a timed read would slow that read on a
    throttled virtual disk).

    Args:
        directory: where the file goes (the file system under test); removed by :meth:`close`.
        size_bytes: bytes per read job, rounded up to whole 16 MiB requests.
        block_sizes_mib: request sizes tried (fio_limit's default).

    Attributes:
        error: why fio gives no figure (not installed, a failed lay-out), else ``None``.
    """

    def __init__(self, directory: str, size_bytes: int, block_sizes_mib=None):
        import subprocess

        import fio_limit as fl

        self.fl = fl
        self.block_sizes_mib = tuple(block_sizes_mib or fl.BLOCK_SIZES_MIB)
        big = max(self.block_sizes_mib) * fl.MIB
        self.size_bytes = -(-max(int(size_bytes), 1) // big) * big
        self.dir = tempfile.mkdtemp(prefix="fc-fio-", dir=directory)
        self.path = os.path.join(self.dir, "fio.bin")
        self.error: Optional[str] = None
        self.version = ""
        if not fl.fio_path():
            self.error = "fio not installed (apt-get install fio)"
            return
        try:
            self.version = subprocess.run(["fio", "--version"], capture_output=True, text=True).stdout.strip()
            fl.run_fio(fl.fio_command(self.path, "write", max(self.block_sizes_mib), self.size_bytes))
        except (RuntimeError, ValueError, OSError) as e:
            self.error = str(e)

    def measure(self) -> dict:
        """One read of the file at every request size: the dict :func:`fio_limit.fio_limit`
        returns (``best_gb_per_s``, ``best_bs_mib``, ``by_bs_mib``, ``commands``, ...; plus
        ``at`` = ``time.time()``), or ``{"tool": "fio", "error": ...}``."""
        import time

        if self.error:
            return {"tool": "fio", "error": self.error}
        by_bs, cmds, t = {}, [], time.time()
        try:
            for bs in self.block_sizes_mib:
                cmd = self.fl.fio_command(self.path, "read", bs, self.size_bytes)
                cmds.append(" ".join(cmd))
                by_bs[bs] = self.fl.run_fio(cmd)["gb_per_s"]
        except (RuntimeError, ValueError, OSError) as e:
            return {"tool": "fio", "error": str(e), "by_bs_mib": by_bs, "commands": cmds}
        best = max(by_bs, key=by_bs.get)
        return {"tool": "fio", "version": self.version, "rw": "read", "iodepth": self.fl.IODEPTH,
                "size_bytes": self.size_bytes, "by_bs_mib": by_bs, "best_gb_per_s": by_bs[best],
                "best_bs_mib": best, "commands": cmds, "at": t}

    def close(self) -> None:
        """Remove the file (and its directory)."""
        shutil.rmtree(self.dir, ignore_errors=True)


def nearest_fio(i: int, n: int, before: dict, after: dict) -> dict:
    """For run ``i`` of ``n`` measured between two fio measurements: the nearer in time (runs
    in the first half: ``before``; the rest: ``after``), or whichever gave a figure."""
    first, second = (before, after) if 2 * i < n else (after, before)
    return first if first.get("best_gb_per_s") else second


def fio_ratios(values: Sequence[float], before: dict, after: dict) -> Optional[float]:
    """Median over runs ``i`` of ``values[i]`` / the best GB/s of :func:`nearest_fio`
    (``None`` when fio gave no figure either time)."""
    import fio_limit as fl

    r = [fl.ratio_to_fio(v, nearest_fio(i, len(values), before, after)) for i, v in enumerate(values)]
    r = [x for x in r if x is not None]
    return statistics.median(r) if r else None


def pool_digest(pool) -> int:
    """xxh3-64 of a host pool's whole ``kv_buffer`` (bytes)."""
    import torch
    import xxhash

    return xxhash.xxh3_64_intdigest(pool.kv_buffer.view(torch.uint8).numpy())


def cluster_refusal(script: str) -> Optional[int]:
    """For the cluster benchmarks: ``None`` when this machine can run a local cluster (root,
    network namespaces, the Mooncake Transfer Engine), else prints ``<script>: cannot run here:
    <reason>`` to stderr and returns 2 (the exit status)."""
    import sys

    from flatcake.cluster.netns import unavailable_reason
    from flatcake.cluster.transfer import te_unavailable_reason

    reason = unavailable_reason() or te_unavailable_reason()
    if reason:
        print(f"{script}: cannot run here: {reason}", file=sys.stderr)
        return 2
    return None
