#!/usr/bin/env python3
"""FC-MAS benchmark (paper §3.2, docs/performance.md): TTFT under load with SGLang's FIFO
prefetch I/O (``fcfs``), with a FIFO of as many I/O threads as FC-MAS has (``fifo-N``) and with
FC-MAS lanes (``mas``), same mix, same run.

The three schedulers:

* ``fcfs``   — SGLang 0.5.23's prefetch I/O: one thread, strictly in submission order;
* ``fifo-N`` — the control: ``N`` = FC-MAS's thread count (its DRAM lane + ``--ssd-restores``
  SSD-lane threads; ``fifo-2`` by default), taking operations in submission order, up to ``N``
  at once (:class:`flatcake.mas.lanes.FifoLanes` with N workers). It separates what the lanes and HRRN order do from what the
  extra thread does: a DRAM-ready prefetch can run beside one restore here too, but not beside
  ``N`` of them;
* ``mas``    — FC-MAS: a DRAM lane and ``--ssd-restores`` SSD restores picked by HRRN.

The mix, built from the shipped real traces:

* agent sessions — the first ``--agents`` WEKA Claude Code conversations: turn 1 cut to its
  first ``--agent-context`` tokens is replayed in the warm-up, so that context is written; the
  measured request is turn 2 cut to the same context plus 1,024 new tokens (agent scope: SSD, ``placement.l_agent_tokens`` is
  set to 4096 here);
* short requests — from the Mooncake conversation trace: its first ``--short-pool`` requests
  grouped by their first ``--short-blocks`` 512-token blocks (a conversation's earlier turns, or
  one shared prompt: the trace's own reuse); the groups that more than one request starts with
  are shared prompts, each written once in the warm-up (two hit queries first: DRAM), and the
  measured short requests are the first ``--short`` requests of those groups, in trace order, cut
  to the group's blocks plus a 64-token tail. Many distinct shared prompts (hundreds of pages,
  more than the HBM prefix cache holds, less than DRAM) — so with the HBM prefix cache on, a
  short request's prefix is often evicted from HBM and restored from DRAM, as in a server whose
  tenants' prompts outnumber what HBM keeps. DRAM is sized to hold them all (``--dram-mib``,
  default: their bytes + 25%, at least 256 MiB).

Warm-up runs one request at a time (:class:`flatcake.replay.engine.Engine`); the measured phase
runs the concurrent serving model (:mod:`flatcake.replay.serving`): short requests arrive as a
Poisson stream at ``--qps`` (seeded), the agent turns evenly spread over the same window. The
HBM prefix cache is on (``--hbm-pages``, default 512 pages = 32 Ki tokens, as the replay's
configs), empty when the measured phase starts, so a prefix one measured request computed is
reused from HBM by the next, as in a server (``--hbm-pages 0``: every prefix from L3, the
setting of the first measurements). The warm-up runs with no HBM cache (it only has to write the
contexts). Each scheduler gets a fresh store and the same warm-up; ``--repeats`` runs of each
(fixed before the run, the order rotating), every run printed and kept, medians reported.

    python scripts/bench_mas.py --json runs/bench/mas.json

``--json FILE`` writes ``{"mix": {..., "hbm_pages"}, "io_threads": {scheduler: n}, "fifo_n":
"fifo-N", "systems": {"fcfs": {...}, "fifo-N": {...}, "mas": {...}}, "ttft_p99_ratio",
"ttft_mean_ratio", "ttft_p99_ratio_vs_fifo_n", "ttft_mean_ratio_vs_fifo_n",
"dram_lane_wait_p99_s": {...}, "runs": [...]}`` (ratios are mas / fcfs and mas / fifo-N of the
medians). Storage files go to a temporary directory under ``--dir`` that is removed at the end.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import random
import statistics
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench_common import add_common_args, temp_system, write_json  # noqa: E402
from flatcake.config import read_yaml  # noqa: E402
from flatcake.replay.engine import Engine, EngineConfig, ModelProfile  # noqa: E402
from flatcake.replay.keys import PageKeyer  # noqa: E402
from flatcake.replay.serving import ServingConfig, serve  # noqa: E402
from flatcake.replay.traces import load_trace  # noqa: E402

TRACES = ROOT.parent / "shared" / "traces"
WEKA = TRACES / "weka_kv_cache_tester" / "kv_cache_tester_traces_710.tar.xz"
MOONCAKE = TRACES / "mooncake" / "conversation_trace.jsonl"
NEW_TURN_TOKENS = 1024  # tokens an agent's measured turn adds to its context


def mas_threads(ssd_restores: int) -> int:
    """FC-MAS's I/O threads: the DRAM lane and one per concurrent SSD restore."""
    return 1 + ssd_restores


def schedulers(ssd_restores: int) -> tuple:
    """``("fcfs", "fifo-N", "mas")`` with N = :func:`mas_threads`."""
    return ("fcfs", f"fifo-{mas_threads(ssd_restores)}", "mas")


def build_mix(args):
    """``(agents_warm, prompts, measured)`` lists of TraceRequest: the agents' turn-1 contexts and
    the shared prompts the warm-up writes, and the measured requests with their arrival times."""
    conv = load_trace(args.weka, sessions=args.agents)
    by_ns: dict[str, list] = {}
    for r in conv:
        by_ns.setdefault(r.namespace, []).append(r)
    agents_warm, agents = [], []
    for rs in by_ns.values():  # turns 1 and 2, cut to the context budget: turn 2 extends turn 1
        if len(rs) < 2:
            continue
        nb = args.agent_context // rs[0].block_tokens
        a, b = rs[0], rs[1]
        agents_warm.append(dataclasses.replace(a, block_ids=a.block_ids[:nb], prompt_tokens=nb * a.block_tokens))
        mb = nb + NEW_TURN_TOKENS // b.block_tokens
        agents.append(dataclasses.replace(b, block_ids=b.block_ids[:mb], prompt_tokens=mb * b.block_tokens,
                                          output_tokens=min(b.output_tokens, 64)))
    groups: dict[tuple, list] = {}
    for r in load_trace(args.mooncake, max_requests=args.short_pool):
        if len(r.block_ids) >= args.short_blocks:
            groups.setdefault(tuple(r.block_ids[:args.short_blocks]), []).append(r)
    reused = [g for g, rs in groups.items() if len(rs) > 1]
    order = sorted((r.arrival_s, i, g) for g in reused for i, r in enumerate(groups[g]))
    shorts, used = [], {}
    for _, i, g in order[: args.short]:
        r = groups[g][i]
        shorts.append(dataclasses.replace(r, block_ids=g, prompt_tokens=len(g) * r.block_tokens + 64,
                                          output_tokens=min(r.output_tokens, 64)))
        used.setdefault(g, shorts[-1])
    prompts = [dataclasses.replace(r, prompt_tokens=len(r.block_ids) * r.block_tokens) for r in used.values()]
    rng = random.Random(args.seed)
    t, times = 0.0, []
    for _ in shorts:
        t += rng.expovariate(args.qps)
        times.append(t)
    window = times[-1] if times else 1.0
    measured = [dataclasses.replace(r, arrival_s=at) for r, at in zip(shorts, times)]
    measured += [dataclasses.replace(r, arrival_s=(i + 0.5) * window / max(1, len(agents)))
                 for i, r in enumerate(agents)]
    measured.sort(key=lambda r: r.arrival_s)
    return agents_warm, prompts, measured


def dram_bytes(args, profile, prompts) -> int:
    """DRAM capacity of the run, bytes: ``--dram-mib``, or the shared prompts' bytes + 25% (at
    least 256 MiB), so every shared prompt stays on DRAM."""
    if args.dram_mib:
        return args.dram_mib << 20
    need = sum(r.prompt_tokens for r in prompts) * profile.bytes_per_token
    return max(256 << 20, int(need * 1.25))


def one_run(args, profile, scheduler: str, mix, base: Path) -> dict:
    agents_warm, prompts, measured = mix
    keyer = PageKeyer(profile.page_size)
    fc = {"dram.capacity_bytes": dram_bytes(args, profile, prompts), "ssd.file_bytes": 256 << 20,
          "ssd.max_files": args.max_files, "placement.l_agent_tokens": 4096, "cio.windows": args.ssd_restores}
    with temp_system("flatcake", profile, args.host_pool_pages, base, fc, f"mas-{scheduler}-") as system:
        warm_engine = Engine(system, profile, EngineConfig(hbm_pages=0, host_pool_pages=args.host_pool_pages))
        for r in prompts:  # two requests ask for each shared prompt before it is written: DRAM
            system.exists(keyer.keys(r), [])
            system.exists(keyer.keys(r), [])
        for r in agents_warm + prompts:
            warm_engine.run(keyer.keys(r), r.prompt_tokens)
        native = (len(measured) - 1) / (measured[-1].arrival_s - measured[0].arrival_s)
        ecfg = EngineConfig(hbm_pages=args.hbm_pages, host_pool_pages=args.host_pool_pages)
        keys = [keyer.keys(r) for r in measured]
        scfg = ServingConfig(qps=native, scheduler=scheduler, ssd_restores=args.ssd_restores)  # fifo-N: FifoLanes
        return serve(system, profile, ecfg, scfg, measured, keys)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--weka", default=str(WEKA))
    ap.add_argument("--mooncake", default=str(MOONCAKE))
    ap.add_argument("--agents", type=int, default=16, help="WEKA conversations (default 16)")
    ap.add_argument("--agent-context", type=int, default=8192, help="agent context tokens written in the warm-up (default 8192)")
    ap.add_argument("--short", type=int, default=200, help="short requests (default 200)")
    ap.add_argument("--short-pool", type=int, default=3000,
                    help="Mooncake trace requests the shared prompts are drawn from (default 3000)")
    ap.add_argument("--short-blocks", type=int, default=2,
                    help="512-token blocks of a shared prompt, the blocks its requests start with (default 2)")
    ap.add_argument("--dram-mib", type=int, default=0,
                    help="DRAM capacity, MiB (default 0: the shared prompts' bytes + 25%%, at least 256)")
    ap.add_argument("--qps", type=float, default=40.0, help="short-request arrival rate (default 40/s)")
    ap.add_argument("--ssd-restores", type=int, default=1, help="concurrent SSD restores, cio.windows (default 1)")
    ap.add_argument("--max-files", type=int, default=16, help="256 MiB pool files (default 16: 4 GiB, so nothing is evicted)")
    ap.add_argument("--hbm-pages", type=int, default=512,
                    help="HBM prefix cache of the measured phase, pages (default 512 = 32 Ki tokens; 0: off)")
    add_common_args(ap, ROOT, 5, "scheduler")
    args = ap.parse_args(argv)
    if args.hbm_pages < 0 or args.ssd_restores < 1 or args.repeats < 1 or args.short_blocks < 1 or args.dram_mib < 0:
        ap.error("--hbm-pages and --dram-mib must be >= 0, --ssd-restores, --short-blocks and --repeats >= 1")
    profile = ModelProfile.from_dict(read_yaml(Path(args.profile))["model"])
    mix = build_mix(args)
    agents_warm, prompts, measured = mix
    names = schedulers(args.ssd_restores)
    threads = {names[0]: 1, names[1]: mas_threads(args.ssd_restores), names[2]: mas_threads(args.ssd_restores)}
    print(f"{args.repeats} runs of {', '.join(names)} (I/O threads {threads}); HBM prefix cache "
          f"{args.hbm_pages} pages; {len(prompts)} shared prompts "
          f"({sum(r.prompt_tokens for r in prompts) // profile.page_size} pages), {len(measured)} measured "
          f"requests; DRAM {dram_bytes(args, profile, prompts) >> 20} MiB", flush=True)
    runs = []
    for rep in range(args.repeats):
        for sched in names[rep % len(names):] + names[: rep % len(names)]:
            s = one_run(args, profile, sched, mix, Path(args.dir))
            runs.append({"scheduler": sched, "repeat": rep, **s})
            wait = s["dram_lane_wait_p99_s"]
            print(f"[{rep + 1}/{args.repeats}] {sched}: TTFT p99 {s['ttft_s']['p99']:.3f} s, mean "
                  f"{s['ttft_s']['mean']:.3f} s, hit rate {s['delivered_hit_rate']:.3f} (HBM "
                  f"{s['hit_tokens']['hbm']} / DRAM {s['hit_tokens']['dram']} / SSD {s['hit_tokens']['ssd']} tokens), "
                  f"DRAM-lane wait p99 {'-' if wait is None else f'{wait:.3f} s'}, verify failures "
                  f"{s['verify_failures']}", flush=True)

    def med(name, *path):  # over the runs with a value (a statistic over no requests is None)
        vals = []
        for r in runs:
            if r["scheduler"] == name:
                for k in path:
                    r = r[k]
                vals.append(r)
        vals = [v for v in vals if v is not None]
        return statistics.median(vals) if vals else None

    systems = {}
    for sched in names:
        systems[sched] = {"io_threads": threads[sched],
                          "ttft_s": {k: med(sched, "ttft_s", k) for k in ("mean", "p50", "p99")},
                          "hit_tokens": {k: med(sched, "hit_tokens", k) for k in ("hbm", "dram", "ssd")},
                          "delivered_hit_rate": med(sched, "delivered_hit_rate"),
                          "dram_lane_wait_p99_s": med(sched, "dram_lane_wait_p99_s"),
                          "ssd_prefetch_s": {k: med(sched, "ssd_prefetch_s", k) for k in ("mean", "p99")},
                          "queue_s_p99": med(sched, "queue_s", "p99"),
                          "tokens_per_s": med(sched, "tokens_per_s"),
                          "verify_failures": sum(r["verify_failures"] for r in runs if r["scheduler"] == sched)}
    fifo_n = names[1]
    out = {
        "mix": {"agents": sum(1 for r in measured if r.namespace.startswith("weka")),
                "short": sum(1 for r in measured if not r.namespace.startswith("weka")), "qps_short": args.qps,
                "shared_prompts": len(prompts), "shared_prompt_pages": sum(r.prompt_tokens // profile.page_size for r in prompts),
                "dram_bytes": dram_bytes(args, profile, prompts),
                "ssd_restores": args.ssd_restores, "hbm_pages": args.hbm_pages, "repeats": args.repeats,
                "profile": profile.name},
        "io_threads": threads,
        "fifo_n": fifo_n,
        "systems": systems,
        "ttft_p99_ratio": systems["mas"]["ttft_s"]["p99"] / systems["fcfs"]["ttft_s"]["p99"],
        "ttft_mean_ratio": systems["mas"]["ttft_s"]["mean"] / systems["fcfs"]["ttft_s"]["mean"],
        "ttft_p99_ratio_vs_fifo_n": systems["mas"]["ttft_s"]["p99"] / systems[fifo_n]["ttft_s"]["p99"],
        "ttft_mean_ratio_vs_fifo_n": systems["mas"]["ttft_s"]["mean"] / systems[fifo_n]["ttft_s"]["mean"],
        "dram_lane_wait_p99_s": {k: systems[k]["dram_lane_wait_p99_s"] for k in systems},
        "runs": runs,
    }
    print(json.dumps({k: v for k, v in out.items() if k != "runs"}, indent=2))
    write_json(args.json, out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
