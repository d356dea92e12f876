#!/usr/bin/env python3
"""No-reuse check (docs/performance.md): with FlatCake enabled and a slice that has no reuse at
all, TTFT must not be worse than with no L3 — FlatCake's hit queries and write-backs must not
tax misses. ``flatcake`` and ``recompute`` (no L3) in the same run.

The slice: the Mooncake conversation trace's first ``--requests`` requests, prompts cut to
``--max-blocks`` 512-token blocks, each request given its own namespace so that no page key
repeats (every hit query misses; every prompt is written back). Served by the concurrent
serving model (:mod:`flatcake.replay.serving`) at ``--qps`` (Poisson, seeded), HBM prefix cache
off. ``--repeats`` runs of each system, in alternating order; medians reported.

    python scripts/bench_noreuse.py --json runs/bench/noreuse.json

``--json FILE`` writes ``{"systems": {"flatcake": {...}, "recompute": {...}},
"ttft_mean_ratio", "ttft_p50_ratio", "ttft_p99_ratio", "runs": [...]}`` (ratios: flatcake /
recompute of the medians; <= 1.0 means no tax). FlatCake's store lives in a temporary directory
under ``--dir`` (capacity ``--ssd-gib``, reclaimed as it fills), removed at the end.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import random
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench_common import add_common_args, median_of, temp_system, write_json  # noqa: E402
from flatcake.config import read_yaml  # noqa: E402
from flatcake.replay.engine import EngineConfig, ModelProfile  # noqa: E402
from flatcake.replay.keys import PageKeyer  # noqa: E402
from flatcake.replay.serving import ServingConfig, serve  # noqa: E402
from flatcake.replay.traces import load_trace  # noqa: E402

MOONCAKE = ROOT.parent / "shared" / "traces" / "mooncake" / "conversation_trace.jsonl"
FILE_BYTES = 256 << 20


def build_slice(args):
    """The requests, each in its own namespace (no key repeats), at Poisson arrival times."""
    rng = random.Random(args.seed)
    t, out = 0.0, []
    for i, r in enumerate(load_trace(args.mooncake, max_requests=args.requests)):
        b = min(args.max_blocks, len(r.block_ids))
        t += rng.expovariate(args.qps)
        ns = f"noreuse:{i}"
        out.append(dataclasses.replace(r, arrival_s=t, namespace=ns, session=ns, block_ids=r.block_ids[:b],
                                       prompt_tokens=b * r.block_tokens, output_tokens=min(r.output_tokens, 64)))
    return out


def one_run(args, profile, name: str, reqs, base: Path) -> dict:
    keyer = PageKeyer(profile.page_size)
    fc = {"ssd.file_bytes": FILE_BYTES, "ssd.max_files": max(1, (args.ssd_gib << 30) // FILE_BYTES)}
    with temp_system(name, profile, args.host_pool_pages, base, fc, f"noreuse-{name}-") as system:
        ecfg = EngineConfig(hbm_pages=0, host_pool_pages=args.host_pool_pages)
        return serve(system, profile, ecfg, ServingConfig(qps=args.qps), reqs, [keyer.keys(r) for r in reqs])


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--mooncake", default=str(MOONCAKE))
    ap.add_argument("--requests", type=int, default=150, help="requests in the slice (default 150)")
    ap.add_argument("--max-blocks", type=int, default=8, help="512-token blocks per prompt at most (default 8)")
    ap.add_argument("--qps", type=float, default=8.0, help="arrival rate (default 8/s)")
    ap.add_argument("--ssd-gib", type=int, default=2, help="FlatCake SSD capacity (default 2 GiB)")
    add_common_args(ap, ROOT, 3, "system")
    args = ap.parse_args(argv)
    profile = ModelProfile.from_dict(read_yaml(Path(args.profile))["model"])
    reqs = build_slice(args)
    runs = []
    for rep in range(args.repeats):
        for name in (("recompute", "flatcake") if rep % 2 == 0 else ("flatcake", "recompute")):
            s = one_run(args, profile, name, reqs, Path(args.dir))
            runs.append({"system": name, **s})
            c = s["counters"]
            print(f"[{rep + 1}/{args.repeats}] {name}: TTFT mean {s['ttft_s']['mean']:.3f} s, p50 "
                  f"{s['ttft_s']['p50']:.3f} s, p99 {s['ttft_s']['p99']:.3f} s, hit rate "
                  f"{s['delivered_hit_rate']:.3f}, bytes written {c.get('ssd_write_bytes', 0) / 1e9:.2f} GB", flush=True)

    def med(name, *path):
        return median_of(runs, "system", name, *path)

    systems = {n: {"ttft_s": {k: med(n, "ttft_s", k) for k in ("mean", "p50", "p99")},
                   "queue_s_p99": med(n, "queue_s", "p99"), "delivered_hit_rate": med(n, "delivered_hit_rate"),
                   "tokens_per_s": med(n, "tokens_per_s"), "ssd_write_bytes": med(n, "counters", "ssd_write_bytes")}
               for n in ("flatcake", "recompute")}
    ratio = {k: systems["flatcake"]["ttft_s"][k] / systems["recompute"]["ttft_s"][k] for k in ("mean", "p50", "p99")}
    out = {"slice": {"requests": len(reqs), "qps": args.qps, "max_blocks": args.max_blocks,
                     "repeats": args.repeats, "profile": profile.name},
           "systems": systems, **{f"ttft_{k}_ratio": v for k, v in ratio.items()}, "runs": runs}
    print(json.dumps({k: v for k, v in out.items() if k != "runs"}, indent=2))
    write_json(args.json, out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
