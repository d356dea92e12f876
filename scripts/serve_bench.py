#!/usr/bin/env python3
"""A real trace against a real SGLang 0.5.23 server on the CPU, one server per L3 system, at two
or more request rates: TTFT as a streaming client sees it, and where SGLang says each prompt's
cached tokens came from (docs/serve-bench.md).

    python scripts/serve_bench.py [--quick] [--json FILE] [--out DIR] [--systems a,b] [--rates 2,4]

Systems (``flatcake/testing/serve_systems.py``): ``flatcake`` (through ``flatcake-sglang``: its
DRAM is the host tier, SGLang's host pool a buffer), ``flatcake-hostcache`` (the same launcher with
SGLang's host tier kept and FlatCake on SSD only, the memory ``file`` has; full mode and
``--systems`` only), ``file`` (SGLang's HiCacheFile), ``mooncake`` (SGLang's Mooncake backend on the CPU wheel, in a
network namespace), ``peercache`` (PyPI's PeerCache, TCP transport) and ``none`` (HiCache without
L3); one that cannot run here is skipped with the reason (``"skipped"`` in the JSON). Traces: the
WEKA Claude Code sessions and the Mooncake conversation trace, one page per hash id
(``flatcake/testing/serve_workload.py``). Each system gets one server per trace (the traces'
page sizes differ), reused for every rate and run; before each run its pools are emptied
(``/flush_cache``, the L3's ``/hicache/storage-backend/clear``) and its storage files dropped
from the page cache.

``--quick``: the WEKA slice only, two rates, one run per point (under 10 minutes on the 2-core
machine when it is quiet). Full: both traces, the same two rates, three runs per point (every run and the
median in the JSON). Output: ``<out>/serve_bench.json`` (and ``--json FILE``), ``summary.md``,
figures. Timings of a CPU server mean nothing for a GPU: hit counts and the storage share of TTFT
are what carry over. Exit status: 0; 1 when a system's server failed (its reason under the
trace's ``"failed"``); 2 for bad arguments.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import shutil
import signal
import statistics
import sys
import time
from pathlib import Path
from typing import Any, Dict, List, Optional

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import requests  # noqa: E402

from flatcake.media.directio import drop_page_cache  # noqa: E402
from flatcake.replay import mooncake as mc  # noqa: E402
from flatcake.testing.serve_client import Answer, replay, stream_generate  # noqa: E402
from flatcake.testing.serve_systems import FLATCAKE_SYSTEMS, NETNS_ENV, SYSTEMS, Sizes, System, storage_files, unavailable  # noqa: E402
from flatcake.testing.serve_workload import (build_prompts, mooncake_slice, schedule, unique_pages,  # noqa: E402
                                             weka_slice)
from flatcake.testing.server import START_TIMEOUT_S, CpuServer, ServerError, metric_total  # noqa: E402
from flatcake.testing.tiny_model import TinyModelSpec, build, kv_bytes_per_token  # noqa: E402

TRACES = ROOT.parent / "shared" / "traces"
WEKA = TRACES / "weka_kv_cache_tester" / "kv_cache_tester_traces_710.tar.xz"
MOONCAKE = TRACES / "mooncake" / "conversation_trace.jsonl"

#: the tiny model: 2 layers, hidden 128, 32 query = 32 KV heads x head_dim 512, fp32: 256 KiB of KV
#: per token (docs/serve-bench.md, "Geometry": why KV bytes are large and prompts short)
MODEL = TinyModelSpec(kind="llama", layers=2, hidden=128, heads=32, kv_heads=32, head_dim=512)
#: tokens per page, per trace: one page per hash id, so a WEKA block (64 tokens) is one token and a
#: Mooncake block (512 tokens) four: prompts stay short enough for the CPU's attention, page counts
#: are the trace's (docs/serve-bench.md, "Geometry"); each trace gets its own servers
PAGE_SIZES = {"weka": 1, "mooncake": 4}
#: host pool / device pool (SGLang's --hicache-ratio; FlatCake's DRAM gets the host pool's bytes)
HICACHE_RATIO = 1.5

MODES: Dict[str, Dict[str, Any]] = {
    # weka: (conversations, largest prompt in blocks); mooncake: (prefix groups, turns per group, largest prompt)
    "quick": {"traces": ["weka"], "rates": [2.0, 4.0], "runs": 1, "weka": (6, 384), "mooncake": (12, 4, 100)},
    "full": {"traces": ["weka", "mooncake"], "rates": [2.0, 4.0], "runs": 3, "weka": (12, 512),
             "mooncake": (24, 6, 100)},
}
#: the systems both modes run by default: every one but ``flatcake-hostcache`` (FlatCake behind
#: SGLang's host tier, a variant: ``--systems`` runs it), so --quick stays under 10 minutes and the
#: full mode near 55 minutes (the five systems of issue 23)
DEFAULT_SYSTEMS = tuple(s for s in SYSTEMS if s != "flatcake-hostcache")
#: compression of the gaps between a conversation's turns (WEKA: a median 13 s; Mooncake prefix
#: groups: a median 123 s); a turn still waits for the previous answer
THINK = {"weka": 0.005, "mooncake": 0.01}


# ------------------------------------------------------------------------------------ workload
def load_workload(trace: str, mode: dict, args) -> dict:
    if trace == "weka":
        conv, max_blocks = (args.conversations or mode["weka"][0]), (args.max_blocks or mode["weka"][1])
        reqs = weka_slice(args.weka, conv, max_blocks)
        what = f"WEKA Claude Code: first {conv} conversations of <= {max_blocks} blocks per prompt"
    else:
        groups, turns, max_blocks = mode["mooncake"]
        groups, max_blocks = (args.conversations or groups), (args.max_blocks or max_blocks)
        reqs = mooncake_slice(args.mooncake, groups, max_turns=turns, max_blocks=max_blocks)
        what = (f"Mooncake conversation trace: first {groups} prefix groups (>= 2 requests of <= {max_blocks} "
                f"blocks, <= {turns} each)")
    if args.max_requests:
        reqs = reqs[:args.max_requests]
    page = PAGE_SIZES[trace]
    prompts = build_prompts(reqs, page, args.max_new_tokens)
    return {"name": trace, "what": what, "reqs": reqs, "prompts": prompts, "page_size": page,
            "sessions": len({p.session for p in prompts}), "prompt_tokens": sum(len(p.input_ids) for p in prompts),
            "unique_pages": unique_pages(prompts, page), "think_time_scale": THINK[trace]}


def sizes_for(w: dict, max_new_tokens: int, spec: TinyModelSpec, device_tokens: Optional[int] = None) -> Sizes:
    """Device pool: 1.5x the longest request (the replay's HBM holds about one long prompt too), so
    conversations interleaving evict each other's prefixes; host pool 1.5x the device pool; every
    L3's disk twice the run's distinct pages (nothing is evicted for capacity)."""
    kv = kv_bytes_per_token(spec)
    page = w["page_size"]
    longest = max(len(p.input_ids) for p in w["prompts"]) + max_new_tokens
    device = device_tokens or max(256, -(-3 * longest // 2 // 64) * 64)
    if device < longest:
        raise ValueError(f"--device-tokens {device} cannot hold the longest request ({longest} tokens)")
    pages = w["unique_pages"] + len(w["prompts"])  # + a page of output per request
    # FlatCake's SSD files hold at least one 128-page round (SGLang's backup batch) with its headers
    file_bytes = max(64 << 20, -(-130 * kv * page // (64 << 20)) * (64 << 20))
    ssd = max(2, -(-2 * pages * kv * page // file_bytes)) * file_bytes
    # SGLang's prefetch threshold is 256 tokens at 64-token pages: 4 pages, whatever the page size
    return Sizes(page_size=page, device_tokens=device, hicache_ratio=HICACHE_RATIO, kv_token_bytes=kv,
                 ssd_bytes=ssd, ssd_file_bytes=file_bytes, prefetch_threshold=4 * page)


# ------------------------------------------------------------------------------------ server ops
def quiesce(server: CpuServer, system: System, timeout_s: float = 90.0) -> float:
    """Wait until the writes a run left behind are done: FlatCake's SSD write queue empty
    (``flatcake_write_backlog_bytes`` on ``/metrics``: its puts return before queued rounds reach
    the disk) and, for every L3, the bytes under its storage directory unchanged over a second
    (PeerCache's asynchronous disk writer, Mooncake's offload buckets). The server's own CPU use
    says nothing here: SGLang's CPU scheduler polls a full core even when idle. Returns the seconds
    waited; gives up after ``timeout_s`` (the next run then starts anyway)."""
    t0 = time.monotonic()
    if system.name == "none":
        return 0.0
    last = -1
    while time.monotonic() - t0 < timeout_s:
        if system.name in FLATCAKE_SYSTEMS and metric_total(server.metrics(), "flatcake_write_backlog_bytes") > 0:
            time.sleep(0.5)
            continue
        size = 0
        for f in storage_files(system.storage_dir):
            try:
                size += f.stat().st_size
            except OSError:  # removed meanwhile
                pass
        if size == last:
            break
        last = size
        time.sleep(1.0)
    return time.monotonic() - t0


def empty_pools(server: CpuServer, system: System) -> float:
    """Device and host pools flushed (once SGLang is idle), the backend's leftover work done
    (:func:`quiesce`), the L3 cleared, its files dropped from the page cache. Returns the seconds
    :func:`quiesce` waited."""
    server.flush()
    waited = quiesce(server, system)
    if system.name != "none":
        r = requests.post(server.url + "/hicache/storage-backend/clear", timeout=120)
        if r.status_code != 200:
            raise ServerError(f"L3 clear -> {r.status_code}: {r.text[:300]}")
    for f in storage_files(system.storage_dir):
        drop_page_cache(str(f))
    return waited


def probe(server: CpuServer, system: System, prompts: List[tuple]) -> dict:
    """The storage share of a restore: per prompt, TTFT computed (cold), from the device pool,
    and from L3 after ``/flush_cache`` with the storage files dropped from the page cache; the
    medians, and SGLang's own ``storage_prefetch_wait + storage_staging_wait`` of the restore."""
    rows = []
    for ids in prompts:
        cold = stream_generate(server.url, ids, 1)
        quiesce(server, system, 30.0)  # its backup runs now, not during the next measured request
        device = stream_generate(server.url, ids, 1)
        server.flush()
        quiesce(server, system, 30.0)
        for f in storage_files(system.storage_dir):
            drop_page_cache(str(f))
        restore = stream_generate(server.url, ids, 1)
        rows.append((cold, device, restore))
    ok = [r for r in rows if all(a.error is None for a in r)]
    if not ok:
        return {"error": next(a.error for r in rows for a in r if a.error)}
    med = lambda xs: statistics.median(xs)  # noqa: E731
    out = {"prompt_tokens": med([len(ids) for ids in prompts]), "ttft_cold_s": med([c.ttft_s for c, _, _ in ok]),
           "ttft_device_s": med([d.ttft_s for _, d, _ in ok]), "ttft_restore_s": med([r.ttft_s for _, _, r in ok]),
           "restore_storage_tokens": med([r.cached["storage"] for _, _, r in ok])}
    waits = [r.storage_wait_s for _, _, r in ok if r.storage_wait_s is not None]
    out["restore_storage_wait_s"] = med(waits) if waits else None
    if out["restore_storage_tokens"] > 0:
        out["storage_share_by_wait"] = (out["restore_storage_wait_s"] or 0.0) / out["ttft_restore_s"]
        extra = max(0.0, out["ttft_restore_s"] - out["ttft_device_s"])
        out["storage_share_by_difference"] = extra / out["ttft_restore_s"]
    return out


# ------------------------------------------------------------------------------------ statistics
def _pct(xs: List[float], q: float) -> Optional[float]:
    if not xs:
        return None
    xs = sorted(xs)
    k = (len(xs) - 1) * q
    lo = int(k)
    hi = min(lo + 1, len(xs) - 1)
    return xs[lo] + (xs[hi] - xs[lo]) * (k - lo)


def run_stats(qps: float, answers: List[Answer], wall_s: float) -> dict:
    ok = [a for a in answers if a.error is None]
    ttft = [a.ttft_s for a in ok]
    restores = [a for a in ok if a.cached["storage"] > 0]
    waits = [a.storage_wait_s for a in restores if a.storage_wait_s is not None]
    return {"qps": qps, "requests": len(answers), "errors": len(answers) - len(ok),
            "ttft_p50_s": _pct(ttft, 0.5), "ttft_p99_s": _pct(ttft, 0.99),
            "ttft_mean_s": statistics.fmean(ttft) if ttft else None,
            "prompt_tokens": sum(a.prompt_tokens for a in ok),
            "cached_tokens": {t: sum(a.cached[t] for a in ok) for t in ("device", "host", "storage")},
            "restores": len(restores),
            "storage_wait_mean_s": statistics.fmean(waits) if waits else None,
            # the storage part of the TTFT of the requests that restored from L3 (SGLang's own waits)
            "storage_share_of_restore_ttft": (sum(waits) / sum(a.ttft_s for a in restores)) if waits else None,
            "wall_s": wall_s, "first_errors": [a.error for a in answers if a.error][:3]}


def median_point(runs: List[dict]) -> dict:
    """Per field, the median over the runs (``runs`` kept beside it)."""
    def med(key, sub=None):
        vals = [(r[key][sub] if sub else r.get(key)) for r in runs]
        vals = [v for v in vals if v is not None]
        return statistics.median(vals) if vals else None

    point = {k: med(k) for k in ("qps", "requests", "errors", "ttft_p50_s", "ttft_p99_s", "ttft_mean_s",
                                  "prompt_tokens", "restores", "storage_wait_mean_s",
                                  "storage_share_of_restore_ttft", "wall_s", "server_cpu_s")}
    point["cached_tokens"] = {t: med("cached_tokens", t) for t in ("device", "host", "storage")}
    point["runs"] = runs
    return point


# ------------------------------------------------------------------------------------ one system
def start_server(server: CpuServer, attempts: int = 3) -> None:
    """Start ``server`` and wait until it is ready; start it again on another port when its HTTP
    port was taken meanwhile (the harness picks a port that was free a moment before: Mooncake's
    transfer engine, started by the scheduler first, can bind it, and SGLang then never serves).

    Raises:
        ServerError: not ready within the harness's start-up limit, or exited for another reason.
    """
    for attempt in range(attempts):
        seen = len(server.log_text())
        server.start()
        deadline = time.monotonic() + START_TIMEOUT_S
        while True:
            try:
                server.wait_ready(timeout_s=10.0)
                return
            except ServerError:
                if "address already in use" in server.log_text()[seen:] and attempt + 1 < attempts:
                    break
                if not server.alive() or time.monotonic() > deadline:
                    raise
        server.stop()


def bench_system(name: str, sizes: Sizes, model: str, w: dict, rates: List[float], runs: int, out: Path,
                 log) -> dict:
    """Start ``name``'s server for trace ``w``, probe it, run every rate x run, stop it. Returns
    ``{"points": [point per rate], "probe": {...}, "start_s": s}``.

    Raises:
        ServerError: the server did not start, or died.
    """
    system = System(name, sizes, out / "work")
    server = CpuServer(system.spec(model), out / "work", f"{name}-{w['name']}")
    t0 = time.monotonic()
    tag = f"[{name}] {w['name']}"
    shm_before = set(os.listdir(SHM))
    try:
        system.before_start()
        start_server(server)
        result: Dict[str, Any] = {"start_s": time.monotonic() - t0}
        log(f"{tag}: ready in {result['start_s']:.0f} s")
        empty_pools(server, system)
        # the probe: the three longest first turns (conversations share nothing with each other)
        picks = sorted({p.session: p for p in reversed(w["prompts"])}.values(), key=lambda p: -len(p.input_ids))[:3]
        result["probe"] = probe(server, system, [p.input_ids for p in picks])
        log(f"{tag}: probe {json.dumps(result['probe'])}")
        result["points"] = []
        for qps in rates:
            turns = schedule(w["reqs"], w["prompts"], qps, w["think_time_scale"])
            done = []
            for k in range(runs):
                settle_s = empty_pools(server, system)
                t, cpu = time.monotonic(), group_cpu_s(server.proc.pid)
                answers = replay(server.url, turns)
                stats = run_stats(qps, answers, time.monotonic() - t)
                stats["server_cpu_s"] = group_cpu_s(server.proc.pid) - cpu
                stats["settle_before_s"] = settle_s
                with open(out / "requests.jsonl", "a") as f:  # every request of every run, for analysis
                    for a in answers:
                        f.write(json.dumps({"system": name, "trace": w["name"], "qps": qps, "run": k,
                                            **a.to_dict()}) + "\n")
                done.append(stats)
                log(f"{tag} {qps:g} req/s run {k + 1}/{runs}: {stats['requests']} requests, "
                    f"{stats['errors']} errors, TTFT p50 {_fmt(stats['ttft_p50_s'])} "
                    f"p99 {_fmt(stats['ttft_p99_s'])}, cached {stats['cached_tokens']}, {stats['wall_s']:.0f} s, "
                    f"server CPU {stats['server_cpu_s']:.0f} s (settled {settle_s:.1f} s before)")
                if not server.alive():
                    raise ServerError(f"{name} died during a run:\n{server.log_tail(40)}")
            result["points"].append(median_point(done))
        return result
    finally:
        server.stop()
        system.stop()
        system.remove_storage()
        remove_orphan_shm(shm_before)


#: where SGLang's processes keep their shared memory (load snapshot, queues, semaphores)
SHM = "/dev/shm"


def remove_orphan_shm(before: set) -> None:
    """Remove SGLang's ``/dev/shm`` files (``sglang_*``, ``sem.mp-*``) that appeared since
    ``before`` and no live process holds. The harness's ``stop()`` removes those its server's
    processes hold at that moment; a server whose processes died earlier (a failed start) leaves
    its own behind."""
    held = set()
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit():
            continue
        try:
            held.update(os.path.basename(os.readlink(fd)) for fd in (proc / "fd").iterdir())
            held.update(os.path.basename(line.split(None, 5)[5]).replace(" (deleted)", "")
                        for line in (proc / "maps").read_text().splitlines() if len(line.split(None, 5)) == 6)
        except OSError:
            continue
    for name in set(os.listdir(SHM)) - before - held:
        if name.startswith(("sglang_", "sem.mp-")):
            try:
                os.unlink(os.path.join(SHM, name))
            except OSError:
                pass


def group_cpu_s(pgid: int) -> float:
    """CPU seconds (user + system) used so far by the live processes of process group ``pgid``
    (the server: its main, scheduler and detokenizer processes)."""
    tick = os.sysconf("SC_CLK_TCK")
    total = 0
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit():
            continue
        try:
            fields = (proc / "stat").read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[2]) == pgid:  # fields after the name: state, ppid, pgrp, ...; utime, stime at 11, 12
            total += int(fields[11]) + int(fields[12])
    return total / tick


def _fmt(v: Optional[float]) -> str:
    return "-" if v is None else f"{v * 1000:.0f} ms"


# ------------------------------------------------------------------------------------ report
def _row(cells) -> str:
    return "| " + " | ".join(str(c) for c in cells) + " |"


def _share(v: Optional[float]) -> str:
    return "-" if v is None else f"{v:.0%}"


RUN_HEAD = ["system", "req/s", "requests", "errors", "TTFT p50", "TTFT p99", "TTFT mean", "device", "host",
            "storage", "storage share of restore TTFT", "server CPU"]
PROBE_HEAD = ["system", "prompt tokens", "TTFT cold", "from device", "from L3", "storage tokens",
              "SGLang's storage wait", "storage share (wait)", "storage share (difference)"]


def summary_md(doc: dict) -> str:
    lines = [f"# serve_bench ({'quick' if doc['quick'] else 'full'})", "",
             f"Model: {doc['model']['what']}. Runs per point: {doc['runs_per_point']} (medians). "
             f"Wall time {doc['wall_s']:.0f} s. CPU timings: see docs/serve-bench.md.", ""]
    for name, why in doc["skipped"].items():
        lines.append(f"- **{name} skipped**: {why}")
    for trace, t in doc["traces"].items():
        sz = t["sizes"]
        lines += ["", f"## {trace}: {t['what']}", "",
                  f"{t['requests']} requests in {t['sessions']} conversations, {t['prompt_tokens']} prompt tokens, "
                  f"{t['unique_pages']} distinct pages of {sz['page_size']} token(s) ({sz['page_bytes'] >> 10} KiB). "
                  f"Device pool {sz['device_tokens']} tokens, host pool x{sz['hicache_ratio']:g}, every L3's disk "
                  f"{sz['ssd_bytes'] >> 20} MiB.", "", _row(RUN_HEAD), _row(["---"] * len(RUN_HEAD))]
        for sysname, s in t["systems"].items():
            for p in s["per_rate"]:
                c = p["cached_tokens"]
                lines.append(_row([sysname, f"{p['qps']:g}", f"{p['requests']:g}", f"{p['errors']:g}",
                                   _fmt(p["ttft_p50_s"]), _fmt(p["ttft_p99_s"]), _fmt(p["ttft_mean_s"]),
                                   f"{c['device']:g}", f"{c['host']:g}", f"{c['storage']:g}",
                                   _share(p.get("storage_share_of_restore_ttft")),
                                   "-" if p.get("server_cpu_s") is None else f"{p['server_cpu_s']:.0f} s"]))
        lines += ["", f"Restore probe ({trace}, one request at a time):", "", _row(PROBE_HEAD),
                  _row(["---"] * len(PROBE_HEAD))]
        for sysname, pr in t["probe"].items():
            if "error" in pr:
                lines.append(_row([sysname, pr["error"]]))
                continue
            lines.append(_row([sysname, f"{pr['prompt_tokens']:g}", _fmt(pr["ttft_cold_s"]),
                               _fmt(pr["ttft_device_s"]), _fmt(pr["ttft_restore_s"]),
                               f"{pr['restore_storage_tokens']:g}", _fmt(pr["restore_storage_wait_s"]),
                               _share(pr.get("storage_share_by_wait")), _share(pr.get("storage_share_by_difference"))]))
    return "\n".join(lines) + "\n"


def figures(doc: dict, out: Path) -> List[str]:
    """Per trace: TTFT p50 / p99 / mean vs request rate, cached tokens by source per system at the
    highest rate, and SGLang's storage wait per restore vs rate (the replay's figure shapes)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    written = []
    for trace, t in doc["traces"].items():
        systems = {k: v for k, v in t["systems"].items() if v["per_rate"]}
        if not systems:
            continue
        fig, axes = plt.subplots(1, 3, figsize=(14, 4))
        for ax, key, title in zip(axes, ("ttft_p50_s", "ttft_p99_s", "ttft_mean_s"), ("P50", "P99", "mean")):
            for name, s in systems.items():
                pts = [(p["qps"], p[key]) for p in s["per_rate"] if p[key] is not None]
                if pts:
                    ax.plot([x for x, _ in pts], [y for _, y in pts], "-o", label=name)
            ax.set_xlabel("request rate (req/s)")
            ax.set_ylabel(f"TTFT {title} (s)")
            ax.set_title(f"{trace}: TTFT {title}")
            ax.grid(True, alpha=0.3)
        axes[0].legend()
        fig.tight_layout()
        fig.savefig(out / f"{trace}_ttft_vs_qps.png", dpi=110)
        plt.close(fig)

        fig, ax = plt.subplots(figsize=(7, 4))
        names = list(systems)
        bottom = [0.0] * len(names)
        for tier in ("device", "host", "storage"):
            vals = [systems[n]["per_rate"][-1]["cached_tokens"][tier] or 0 for n in names]
            ax.bar(names, vals, bottom=bottom, label=tier)
            bottom = [b + v for b, v in zip(bottom, vals)]
        ax.set_ylabel(f"cached prompt tokens at {t['rates'][-1]:g} req/s")
        ax.set_title(f"{trace}: cached tokens by source (SGLang's cached_tokens_details)")
        ax.legend()
        fig.tight_layout()
        fig.savefig(out / f"{trace}_cached_tokens_by_source.png", dpi=110)
        plt.close(fig)

        fig, ax = plt.subplots(figsize=(6, 4))
        drawn = False
        for name, s in systems.items():
            pts = [(p["qps"], p["storage_wait_mean_s"]) for p in s["per_rate"] if p["storage_wait_mean_s"] is not None]
            if pts:
                ax.plot([x for x, _ in pts], [y for _, y in pts], "-o", label=name)
                drawn = True
        ax.set_xlabel("request rate (req/s)")
        ax.set_ylabel("storage wait per restore, mean (s)")
        ax.set_title(f"{trace}: SGLang's storage_prefetch_wait + staging")
        ax.grid(True, alpha=0.3)
        if drawn:
            ax.legend()
        fig.tight_layout()
        fig.savefig(out / f"{trace}_storage_wait_vs_qps.png", dpi=110)
        plt.close(fig)
        written += [f"{trace}_{kind}.png" for kind in ("ttft_vs_qps", "cached_tokens_by_source", "storage_wait_vs_qps")]
    return written


# ------------------------------------------------------------------------------------ main
def parse_args(argv):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="WEKA only, two rates, one run per point (< 10 min)")
    ap.add_argument("--json", help="also write the results JSON here")
    ap.add_argument("--out", help="output directory (default runs/serve-bench or runs/serve-bench-quick)")
    ap.add_argument("--systems", help=f"comma list (default {','.join(DEFAULT_SYSTEMS)}; known {','.join(SYSTEMS)})")
    ap.add_argument("--traces", help="comma list of weka, mooncake (default: the mode's)")
    ap.add_argument("--rates", help="comma list of request rates, req/s (default: the mode's)")
    ap.add_argument("--runs", type=int, help="runs per point (default: quick 1, full 3)")
    ap.add_argument("--conversations", type=int,
                    help="WEKA conversations / Mooncake prefix groups (default: the mode's)")
    ap.add_argument("--max-blocks", type=int, help="largest prompt in blocks (default: the mode's)")
    ap.add_argument("--max-requests", type=int, help="keep the first N requests of each slice")
    ap.add_argument("--max-new-tokens", type=int, default=4, help="output tokens per request, at most (default 4)")
    ap.add_argument("--device-tokens", type=int,
                    help="the device KV pool, tokens (default: 1.5x the longest request, rounded up to 64)")
    ap.add_argument("--weka", default=str(WEKA), help="the WEKA archive")
    ap.add_argument("--mooncake", default=str(MOONCAKE), help="the Mooncake conversation trace")
    ap.add_argument("--kv-heads", type=int, default=MODEL.kv_heads,
                    help=f"the tiny model's KV heads (= its query heads; default {MODEL.kv_heads})")
    ap.add_argument("--head-dim", type=int, default=MODEL.head_dim, help=f"its head_dim (default {MODEL.head_dim})")
    ap.add_argument("--no-figures", action="store_true")
    return ap.parse_args(argv)


def in_namespace(argv: List[str]) -> int:
    """Run this script again inside a new network namespace with loopback only (the Mooncake
    master and transfer engine listen on every address): the replay's
    :func:`flatcake.replay.mooncake.run_in_namespace`; the namespace and anything left in it are
    removed afterwards, also on SIGTERM."""
    return mc.run_in_namespace(argv, command=[sys.executable, str(Path(__file__).resolve())], prefix="fc-serve-bench",
                               env_extra={NETNS_ENV: "1"}, stop_wait_s=60.0)


def main(argv=None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    args = parse_args(argv)
    systems = [s for s in (args.systems or ",".join(DEFAULT_SYSTEMS)).split(",") if s]
    bad = [s for s in systems if s not in SYSTEMS]
    if bad:
        print(f"unknown system(s) {bad}; known: {', '.join(SYSTEMS)}", file=sys.stderr)
        return 2
    skipped = {s: why for s in systems if (why := unavailable(s))}
    if "mooncake" in systems and "mooncake" not in skipped and not os.environ.get(NETNS_ENV):
        return in_namespace(argv)

    def on_term(signum, frame):  # a SIGTERM still stops the server and its helpers (bench_system's finally)
        raise KeyboardInterrupt

    signal.signal(signal.SIGTERM, on_term)
    t_start = time.monotonic()
    mode = MODES["quick" if args.quick else "full"]
    traces = args.traces.split(",") if args.traces else mode["traces"]
    rates = [float(r) for r in args.rates.split(",")] if args.rates else mode["rates"]
    runs = args.runs or mode["runs"]
    # absolute: the tiny model is written under it and each server is started from another directory
    out = Path(args.out or ROOT / "runs" / ("serve-bench-quick" if args.quick else "serve-bench")).resolve()
    out.mkdir(parents=True, exist_ok=True)
    shutil.rmtree(out / "work", ignore_errors=True)  # servers' logs, metrics and storage of an earlier run
    (out / "requests.jsonl").unlink(missing_ok=True)
    log_file = open(out / "serve_bench.log", "a")

    def log(msg: str) -> None:
        line = f"{time.strftime('%H:%M:%S')} {msg}"
        print(line, flush=True)
        log_file.write(line + "\n")
        log_file.flush()

    workloads = [load_workload(t, mode, args) for t in traces]
    for w in workloads:
        log(f"{w['name']}: {w['what']}: {len(w['prompts'])} requests, {w['sessions']} conversations, "
            f"{w['prompt_tokens']} prompt tokens, {w['unique_pages']} distinct pages of {w['page_size']} token(s)")
    spec = dataclasses.replace(MODEL, heads=args.kv_heads, kv_heads=args.kv_heads, head_dim=args.head_dim)
    try:
        all_sizes = [sizes_for(w, args.max_new_tokens, spec, args.device_tokens) for w in workloads]
    except ValueError as e:
        print(e, file=sys.stderr)
        return 2
    model = str(build(out / "model", spec))
    for name, why in skipped.items():
        log(f"[{name}] skipped: {why}")

    doc: Dict[str, Any] = {
        "quick": bool(args.quick), "rates": rates, "runs_per_point": runs, "skipped": skipped, "traces": {},
        "model": {"what": f"tiny Llama, {spec.layers} layers, hidden {spec.hidden}, {spec.heads} query / "
                          f"{spec.kv_heads} KV heads x head_dim {spec.head_dim}, fp32: "
                          f"{kv_bytes_per_token(spec) >> 10} KiB of KV per token",
                  "kv_token_bytes": kv_bytes_per_token(spec)},
    }
    for w, sizes in zip(workloads, all_sizes):
        t = doc["traces"][w["name"]] = {
            "what": w["what"], "requests": len(w["prompts"]), "sessions": w["sessions"],
            "prompt_tokens": w["prompt_tokens"], "unique_pages": w["unique_pages"],
            "think_time_scale": w["think_time_scale"], "rates": rates,
            "sizes": {"page_size": sizes.page_size, "page_bytes": sizes.page_size * sizes.kv_token_bytes,
                      "ssd_file_bytes": sizes.ssd_file_bytes,
                      "device_tokens": sizes.device_tokens, "hicache_ratio": sizes.hicache_ratio,
                      "host_bytes": sizes.host_bytes, "ssd_bytes": sizes.ssd_bytes,
                      "prefetch_threshold_tokens": sizes.prefetch_threshold, "max_new_tokens": args.max_new_tokens},
            "systems": {}, "probe": {}, "start_s": {}, "failed": {}}
        for name in systems:
            if name in skipped:
                continue
            try:
                r = bench_system(name, sizes, model, w, rates, runs, out, log)
            except (ServerError, RuntimeError, OSError) as e:
                why = f"failed in the server: {type(e).__name__}: {str(e).strip()[:1500]}"
                t["failed"][name] = why
                skipped.setdefault(name, f"{w['name']}: {why}")
                log(f"[{name}] {w['name']}: {why}")
                continue
            t["systems"][name] = {"per_rate": r["points"]}
            t["probe"][name] = r["probe"]
            t["start_s"][name] = r["start_s"]
    first = doc["traces"][workloads[0]["name"]]  # the top level mirrors the first trace (WEKA)
    doc.update({"trace": workloads[0]["name"], "systems": first["systems"], "probe": first["probe"],
                "sizes": first["sizes"], "wall_s": time.monotonic() - t_start})
    if not args.no_figures:
        doc["figures"] = figures(doc, out)
    text = json.dumps(doc, indent=1)
    (out / "serve_bench.json").write_text(text)
    if args.json:  # anywhere: its folder made (out/ holds the same JSON as serve_bench.json)
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(text)
    md = summary_md(doc)
    (out / "summary.md").write_text(md)
    print(md)
    log(f"done in {doc['wall_s']:.0f} s: {out / 'serve_bench.json'}")
    failed = {f"{tr}: {name}" for tr, t in doc["traces"].items() for name in t["failed"]}
    if failed:  # a system whose server failed is a failed bench, not a skipped one
        log(f"failed: {', '.join(sorted(failed))}")
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
