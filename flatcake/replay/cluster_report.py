"""Summary of the multi-node replay (:mod:`flatcake.replay.cluster_replay`): ``summary.json`` and
``summary.md``, one column per mode (``cluster``, ``isolated``) and what the cluster-wide index
buys over isolated nodes on the same trace and routing.

Per mode (pages of the replayed prompts):

* ``delivered_hit_rate`` = (HBM hits + pages delivered from L3, local or remote) / prompt pages
  (as the single-node replay, :mod:`flatcake.replay.report`, whose fields are all kept).
* ``hit_pages``: ``hbm``; ``local_dram`` / ``local_ssd`` (the node's own media, from its store's
  counters); ``remote_dram`` / ``remote_ssd`` (read from another node, from the backend's
  ``cluster.remote_read_pages``; 0 with ``remote_reported: false`` where the backend has none);
  ``unattributed`` = L3-delivered pages − local − remote (0 when the counters add up).
* ``prefill_tokens``: prompt tokens not delivered from HBM or L3 (computed); ``prefill_s``: their
  modelled prefill seconds.

``gain``: ``hit_rate`` (cluster − isolated, fraction of prompt pages), ``hit_pages``,
``prefill_tokens_saved`` (isolated − cluster) and ``prefill_s_saved`` (modelled seconds).
"""

from __future__ import annotations

import os
import time
from collections import Counter
from typing import Any

from flatcake.replay.engine import ModelProfile, RequestOutcome, reusable_counts
from flatcake.replay.report import system_summary
from flatcake.replay.traces import ideal_hit_rate

SPLIT = ("hbm", "local_dram", "local_ssd", "remote_dram", "remote_ssd", "unattributed")


def _sum_counters(stats: list[dict]) -> dict[str, int]:
    total: Counter = Counter()
    for s in stats:
        total.update({k: int(v) for k, v in (s.get("counters") or {}).items()})
    return dict(total)


def mode_summary(run: dict, profile: ModelProfile, nodes: int) -> dict[str, Any]:
    """One mode's metrics (see the module docstring) from :func:`cluster_replay.run_mode`'s result."""
    P = profile.page_size
    replies = run["replies"]
    outcomes = [RequestOutcome(**r["outcome"]) for r in replies]
    errors = sum(int(s.get("errors", 0)) for s in run["stats"])
    s = system_summary(outcomes, _sum_counters(run["stats"]), P, profile.page_bytes,
                       sum(o.wall_s for o in outcomes), errors)
    split = dict.fromkeys(SPLIT, 0)
    for r, o in zip(replies, outcomes):
        split["hbm"] += o.hbm_pages
        for k in ("local_dram", "local_ssd", "remote_dram", "remote_ssd"):
            split[k] += int(r[k])
        split["unattributed"] += o.l3_pages - sum(int(r[k]) for k in SPLIT[1:5])
    per_node = []
    for i in range(nodes):
        mine = [o for r, o in zip(replies, outcomes) if r["node"] == i]
        pages = sum(o.pages for o in mine)
        per_node.append({"node": i, "requests": len(mine), "prompt_pages": pages,
                         "delivered_hit_rate": (sum(o.hbm_pages + o.l3_pages for o in mine) / pages) if pages else None})
    s.update({
        "hit_pages": split,
        "remote_reported": bool(replies) and all(r.get("remote_reported") for r in replies),
        "prefill_tokens": int(sum(max(0, o.prompt_tokens - (o.hbm_pages + o.l3_pages) * P) for o in outcomes)),
        "prefill_s": float(sum(o.prefill_s for o in outcomes)),
        "per_node": per_node,
        "cluster_stats": [st.get("cluster") for st in run["stats"]],
        "visibility_waits": run.get("visibility", {}),
        "disk_bytes_at_end": int(run["disk_bytes"]),
        "run_wall_s": float(run["wall_s"]),
    })
    return s


def cluster_summary(runs: dict, reqs: list, keys: list, profile: ModelProfile, nodes: int, router: str,
                    settings: dict) -> dict[str, Any]:
    """The whole summary: trace, routing, each mode, and ``gain`` (cluster over isolated)."""
    from flatcake.replay.cluster_replay import conversations

    hits, total = ideal_hit_rate(keys, reusable_counts(reqs, keys, profile.page_size))
    modes = {m: mode_summary(run, profile, nodes) for m, run in runs.items()}
    c, i = modes["cluster"], modes["isolated"]
    node_of = [r["node"] for r in runs["cluster"]["replies"]]
    return {
        "date_utc": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
        "trace": os.path.normpath(str(settings["trace"])),
        "requests": len(reqs),
        "conversations": len(set(conversations(reqs))),
        "nodes": nodes,
        "router": router,
        "requests_per_node": [node_of.count(n) for n in range(nodes)],
        "prompt_pages": total,
        "unique_pages": len({k for ks in keys for k in ks}),
        "ideal_hit_rate": hits / total if total else None,
        "model": {**profile.as_dict(), "page_bytes": profile.page_bytes},
        "scale": settings.get("scale", 1),
        "modes": modes,
        "gain": {
            "hit_rate": (c["delivered_hit_rate"] or 0) - (i["delivered_hit_rate"] or 0),
            "hit_pages": sum(c["hit_pages"][k] for k in SPLIT[:5]) - sum(i["hit_pages"][k] for k in SPLIT[:5]),
            "prefill_tokens_saved": i["prefill_tokens"] - c["prefill_tokens"],
            "prefill_s_saved": i["prefill_s"] - c["prefill_s"],
        },
    }


def _pct(v) -> str:
    return "—" if v is None else f"{100 * v:.2f}%"


def cluster_markdown(summary: dict) -> str:
    """``summary.md``: the trace and routing, one column per mode, the gain."""
    modes = summary["modes"]
    names = list(modes)
    lines = [f"# Multi-node replay: {summary['nodes']} nodes, router {summary['router']}", "",
             f"trace `{summary['trace']}`: {summary['requests']} requests, {summary['conversations']} conversations, "
             f"{summary['prompt_pages']} prompt pages ({summary['unique_pages']} unique), ideal hit rate "
             f"{_pct(summary['ideal_hit_rate'])}; requests per node {summary['requests_per_node']}; "
             f"model {summary['model']['name']}, {summary['model']['page_bytes']} B pages; {summary['date_utc']}", "",
             "| | " + " | ".join(names) + " |", "|---|" + "---|" * len(names)]
    if summary.get("scale", 1) != 1:
        lines[4:4] = [f"--scale {summary['scale']}: timings (TTFT) are not meaningful; hit counts are.", ""]

    def row(label, fn):
        lines.append(f"| {label} | " + " | ".join(fn(modes[n]) for n in names) + " |")

    row("delivered hit rate", lambda m: _pct(m["delivered_hit_rate"]))
    for k in SPLIT:
        row(f"hit pages: {k.replace('_', ' ')}", lambda m, k=k: str(m["hit_pages"][k]))
    row("remote counters reported", lambda m: "yes" if m["remote_reported"] else "no (remote = 0)")
    row("prefill tokens (computed)", lambda m: str(m["prefill_tokens"]))
    row("prefill s (modelled)", lambda m: f"{m['prefill_s']:.2f}")
    row("TTFT mean / p99 s", lambda m: f"{m['ttft_s']['mean']:.3f} / {m['ttft_s']['p99']:.3f}")
    row("verify failures", lambda m: str(m["verify_failures"]))
    row("failed write pages", lambda m: str(m["failed_write_pages"]))
    row("backend errors", lambda m: str(m["backend_errors"]))
    row("hit rate per node", lambda m: ", ".join(_pct(p["delivered_hit_rate"]) for p in m["per_node"]))
    g = summary["gain"]
    lines += ["", f"Cluster over isolated: hit rate {100 * g['hit_rate']:+.2f} points ({g['hit_pages']:+d} pages), "
              f"{g['prefill_tokens_saved']:+d} prefill tokens saved ({g['prefill_s_saved']:+.2f} s modelled).", ""]
    return "\n".join(lines)
