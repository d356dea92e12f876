"""``flatcake-replay --nodes N --router {affinity,round-robin}``: replay a trace on N FlatCake
nodes (issue 12; docs/replay.md "Several nodes").

Each node is a full FlatCake — own DRAM, own SSD pool directory, own host pool and HBM prefix
cache (:mod:`flatcake.replay.node_agent`) — in its own process and network namespace of a
:class:`~flatcake.cluster.netns.LocalCluster` (etcd in the hub namespace). The router here sends
the trace's requests in arrival order, one at a time, to one node each:

* ``affinity``: every request of a conversation to node ``xxh64(conversation) mod N`` (a hash,
  not least-loaded: the same conversation always lands on the same node, across runs too;
  :func:`conversations` says what a conversation is in each trace format).
* ``round-robin``: request ``i`` (arrival order) to node ``i mod N``.

The same trace is replayed twice in one command, on fresh nodes each time: ``cluster`` (the nodes
share the index: ``cluster.etcd`` = the hub's etcd, ``cluster.advertise`` = the node's address)
and ``isolated`` (the same nodes without a cluster section). Outputs in ``--out``:
``summary.json``, ``summary.md`` (:mod:`flatcake.replay.cluster_report`), ``requests.csv`` and
each node's log (``<mode>/node<i>.log``); the nodes' storage directories are removed after each
mode unless ``--keep-data``.
"""

from __future__ import annotations

import argparse
import csv
import json
import os
import select
import shutil
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, Optional

import xxhash

from flatcake.replay.budget import DiskBudgetError, footprint, margin_bytes
from flatcake.replay.engine import EngineConfig, ModelProfile, RequestOutcome
from flatcake.replay.traces import TraceRequest

ROUTERS = ("affinity", "round-robin")
MODES = ("cluster", "isolated")
#: port of each node's data plane (its SSD server; every node has its own namespace)
DATAPLANE_PORT = 5601
#: seconds the driver waits for one reply of a node (a guard against a hung node, not a measurement)
REPLY_LIMIT_S = 600.0
#: seconds a node waits for another node's new pages to reach its view (:func:`wait_visible`)
VISIBLE_TIMEOUT_S = 2.0


def unavailable_reason() -> Optional[str]:
    """Why this machine cannot run the multi-node replay (root, iproute2, an etcd binary, the
    Mooncake Transfer Engine and its libibverbs1), or None when it can."""
    from flatcake.cluster.netns import unavailable_reason as netns_reason

    reason = netns_reason()
    if reason:
        return reason
    from flatcake.cluster.transfer import te_unavailable_reason

    return te_unavailable_reason()


def check_request(args: argparse.Namespace, profile: ModelProfile) -> None:
    """Refuse what ``--nodes`` does not run.

    Raises:
        ValueError: ``--router`` without ``--nodes``, ``--nodes`` < 1, ``--qps`` / ``--scheduler`` /
            ``--ssd-restores``, a hybrid model profile, or ``--systems`` naming anything but flatcake.
    """
    if args.nodes is None:
        raise ValueError("--router applies to the multi-node replay: add --nodes N")
    if not 1 <= args.nodes <= 32:
        raise ValueError(f"--nodes: 1..32 (got {args.nodes})")
    if args.qps is not None or args.scheduler is not None or args.ssd_restores is not None:
        raise ValueError("--nodes replays one request at a time; the serving model (--qps, --scheduler, "
                         "--ssd-restores) does not run on several nodes")
    if profile.hybrid:
        raise ValueError("--nodes does not run a hybrid model profile (model.pools) yet; use a dense profile")
    if args.systems is not None and [s.strip() for s in args.systems.split(",") if s.strip()] != ["flatcake"]:
        raise ValueError("--nodes replays FlatCake nodes only: drop --systems or pass --systems flatcake")


def conversations(reqs: list[TraceRequest]) -> list[str]:
    """The conversation of every request: the WEKA conversation id; a Mooncake trace has no
    session ids, so there it is the first block after the prefix every request of the trace
    shares (its system prompt): a later turn repeats its conversation's earlier blocks, so all
    turns of one conversation share that block."""
    mc = [r.block_ids for r in reqs if not r.namespace.startswith("weka:")]
    shared = len(os.path.commonprefix(mc)) if mc else 0
    return [r.session if r.namespace.startswith("weka:") or not r.block_ids
            else f"{r.namespace}/{r.block_ids[min(shared, len(r.block_ids) - 1)]}" for r in reqs]


def route(reqs: list[TraceRequest], nodes: int, router: str) -> list[int]:
    """Node index (0..nodes-1) of every request, in arrival order (see the module docstring).

    Raises:
        ValueError: unknown router.
    """
    if router == "round-robin":
        return [i % nodes for i in range(len(reqs))]
    if router == "affinity":
        return [xxhash.xxh64_intdigest(c.encode()) % nodes for c in conversations(reqs)]
    raise ValueError(f"--router: {router!r} (one of {', '.join(ROUTERS)})")


def node_keys(fc_keys: dict, i: int, cluster, mode: str) -> dict:
    """FlatCake keys of node ``i``: the run's, ``node_id = i + 1``, and in ``cluster`` mode the
    cluster section (the hub's etcd, this node's address); ``isolated``: no cluster section."""
    keys = {k: v for k, v in fc_keys.items() if not k.startswith("cluster.")}
    keys["node_id"] = i + 1
    if mode == "cluster":
        keys.update({k: v for k, v in fc_keys.items() if k.startswith("cluster.")})
        keys["cluster.etcd"] = [cluster.etcd_endpoint]
        keys["cluster.advertise"] = f"{cluster.node_address(i)}:{DATAPLANE_PORT}"
    return keys


def check_disk(nodes: int, unique_bytes: int, fc_keys: dict, out: Path) -> None:
    """Refuse a run whose ``nodes`` nodes (alive together; one mode at a time) would not fit on
    ``out``'s file system (each node: :func:`~flatcake.replay.budget.footprint`).

    Raises:
        DiskBudgetError: the estimate exceeds the free space minus the margin.
    """
    need = nodes * footprint("flatcake", unique_bytes, fc_keys, {})
    probe = Path(out)
    while not probe.exists() and probe != probe.parent:
        probe = probe.parent
    free = shutil.disk_usage(probe).free
    if need > free - margin_bytes(free):
        raise DiskBudgetError(
            f"disk budget: {nodes} nodes would keep up to {need / 1e9:.1f} GB on the file system of {probe}, "
            f"but only {free / 1e9:.1f} GB are free (margin {margin_bytes(free) / 1e9:.1f} GB). Replay fewer "
            "requests (--max-requests), fewer nodes, lower ssd.max_files, or pass --ignore-disk-budget.")


class NodeClient:
    """The driver's end of one replay node (:mod:`flatcake.replay.node_agent`) in node ``i``'s
    namespace; its stderr goes to ``log``. Stopped by the cluster's close."""

    def __init__(self, cluster, i: int, log: Path):
        self.i, self.log = i, log
        with open(log, "ab") as err:
            self.proc = cluster.spawn(i, [sys.executable, "-m", "flatcake.replay.node_agent"],
                                      stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=err, text=True, bufsize=1)

    def send(self, cmd: str, **kw) -> None:
        """Send one command (read its reply with :meth:`reply`)."""
        self.proc.stdin.write(json.dumps({"cmd": cmd, **kw}) + "\n")
        self.proc.stdin.flush()

    def reply(self, cmd: str = "?") -> dict:
        """The next reply.

        Raises:
            RuntimeError: not ok, the node exited, or no reply within :data:`REPLY_LIMIT_S`
                (the message carries the tail of the node's log).
        """
        ready, _, _ = select.select([self.proc.stdout], [], [], REPLY_LIMIT_S)
        line = self.proc.stdout.readline() if ready else ""
        out = json.loads(line) if line else None
        if out is None or not out.get("ok"):
            why = out.get("error") if out else f"no reply (status {self.proc.poll()})"
            tail = self.log.read_text(errors="replace")[-1500:] if self.log.exists() else ""
            raise RuntimeError(f"replay node {self.i} {cmd}: {why}\n{tail}")
        return out

    def must(self, cmd: str, **kw) -> dict:
        """:meth:`send` then :meth:`reply`."""
        self.send(cmd, **kw)
        return self.reply(cmd)


def wait_visible(clients: list, node: int, keys: list, outcome: dict, waits: dict) -> None:
    """Cluster mode: wait (up to :data:`VISIBLE_TIMEOUT_S` each) until the pages request's node
    ``node`` wrote are in every other node's view. A trace's next request comes seconds later,
    far longer than the index takes to propagate (docs/cluster.md: p99 ~14–35 ms); served one
    after another with no gap, the next request would otherwise race the watch. Adds to
    ``waits``: ``waits``, ``waited_s`` (the longest of each wait), ``timeouts``."""
    first = outcome["hbm_pages"] + outcome["dram_pages"] + outcome["ssd_pages"]
    written = keys[first: first + outcome["written_pages"]]
    others = [c for c in clients if c.i != node]
    if not written or not others:
        return
    for c in others:
        c.send("visible", keys=written, timeout_s=VISIBLE_TIMEOUT_S)
    got = [c.reply("visible") for c in others]
    waits["waits"] += 1
    waits["waited_s"] += max(g["waited_s"] for g in got)
    waits["timeouts"] += sum(g["present"] < len(written) for g in got)


def run_mode(mode: str, ctx: dict, progress: bool) -> dict[str, Any]:
    """Replay every request on fresh nodes in ``mode`` (``cluster`` | ``isolated``).

    Returns:
        ``replies`` (each request's ``run`` reply plus its ``node``), ``stats`` (each node's
        ``stats`` reply), ``wall_s``, ``disk_bytes`` (the nodes' storage at the end).
    """
    from tqdm import tqdm

    from flatcake.cluster.netns import LocalCluster
    from flatcake.replay.cli import _disk_bytes

    out = Path(ctx["out"]) / mode
    shutil.rmtree(out, ignore_errors=True)
    out.mkdir(parents=True)
    t0 = time.perf_counter()
    cluster = LocalCluster(ctx["nodes"]).start()
    try:
        clients = [NodeClient(cluster, i, out / f"node{i}.log") for i in range(ctx["nodes"])]
        for i, c in enumerate(clients):  # the nodes start in parallel
            c.send("start", flatcake=node_keys(ctx["fc_keys"], i, cluster, mode), profile=ctx["profile"],
                   engine=ctx["engine"], host_pool_pages=ctx["host_pool_pages"], out=str(out / f"node{i}"))
        for c in clients:
            c.reply("start")
        replies, waits = [], {"waits": 0, "waited_s": 0.0, "timeouts": 0}
        bar = tqdm(total=len(ctx["keys"]), desc=mode, unit="req", disable=not progress, file=sys.stderr)
        for ks, tokens, node in zip(ctx["keys"], ctx["tokens"], ctx["route"]):
            replies.append({**clients[node].must("run", keys=ks, prompt_tokens=tokens), "node": node})
            if mode == "cluster":
                wait_visible(clients, node, ks, replies[-1]["outcome"], waits)
            bar.update(1)
        bar.close()
        stats = [c.must("stats") for c in clients]
        for c in clients:
            c.must("close")
    finally:
        cluster.close()
        disk = sum(_disk_bytes(out / f"node{i}" / "flatcake-ssd") for i in range(ctx["nodes"]))
        if not ctx["keep_data"]:
            for i in range(ctx["nodes"]):
                shutil.rmtree(out / f"node{i}", ignore_errors=True)
    return {"replies": replies, "stats": stats, "wall_s": time.perf_counter() - t0, "disk_bytes": disk,
            "visibility": waits}


def write_requests_csv(path: Path, runs: dict) -> None:
    """One row per request and mode: node, pages, the hit split, verify failures, TTFT (seconds)."""
    with path.open("w", newline="") as f:
        w = csv.writer(f)
        w.writerow(["request", "mode", "node", "pages", "prompt_tokens", "hbm_pages", "local_dram_pages",
                    "local_ssd_pages", "remote_dram_pages", "remote_ssd_pages", "computed_pages", "written_pages",
                    "verify_failures", "ttft_s"])
        for mode, run in runs.items():
            for i, r in enumerate(run["replies"]):
                o = r["outcome"]
                ttft = RequestOutcome(**o).ttft_s  # the engine's own definition
                w.writerow([i, mode, r["node"], o["pages"], o["prompt_tokens"], o["hbm_pages"], r["local_dram"],
                            r["local_ssd"], r["remote_dram"], r["remote_ssd"], o["computed_pages"],
                            o["written_pages"], o["verify_failures"], f"{ttft:.6f}"])


def run_nodes(cfg, settings: dict, profile: ModelProfile, args: argparse.Namespace) -> int:
    """The ``--nodes`` replay from :func:`flatcake.replay.cli.main`: check, run both modes, write
    and print the summary. Returns the exit status: 0, 1 (verify failures, or a node failed:
    its log's tail on stderr), 2 (refused: a bad flag, or the machine cannot run it — one line
    on stderr says why)."""
    from flatcake.replay.cluster_report import cluster_markdown, cluster_summary
    from flatcake.replay.startup import load_requests, storage_keys
    from flatcake.replay.traces import TraceFormatError

    try:
        check_request(args, profile)
        router = args.router or "affinity"
        reason = unavailable_reason()
        if reason:
            raise ValueError(f"--nodes needs a local cluster, and this machine cannot run one: {reason}")
        reqs, keys = load_requests(settings, profile)
        fc_keys = storage_keys(cfg)
        unique = len({k for ks in keys for k in ks})
        if settings["disk_budget"]:
            check_disk(args.nodes, unique * profile.page_bytes, fc_keys, Path(settings["out"]))
    except (ValueError, TraceFormatError) as e:  # DiskBudgetError is a ValueError
        print(f"flatcake-replay: {e}", file=sys.stderr)
        return 2
    t0 = time.perf_counter()
    ecfg = EngineConfig.from_settings(settings)
    ctx = {"out": settings["out"], "nodes": args.nodes, "fc_keys": fc_keys, "profile": profile.as_dict(),
           "engine": dict(ecfg.__dict__), "host_pool_pages": settings["host_pool_pages"], "keys": keys,
           "tokens": [r.prompt_tokens for r in reqs], "route": route(reqs, args.nodes, router),
           "keep_data": settings["keep_data"]}
    try:
        runs = {mode: run_mode(mode, ctx, not args.no_progress) for mode in MODES}
    except RuntimeError as e:  # a node failed (its log tail is in the message); all is torn down
        print(f"flatcake-replay: {e}", file=sys.stderr)
        return 1
    summary = cluster_summary(runs, reqs, keys, profile, args.nodes, router, settings)
    out = Path(settings["out"])
    (out / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")
    (out / "summary.md").write_text(cluster_markdown(summary))
    write_requests_csv(out / "requests.csv", runs)
    print(cluster_markdown(summary))
    print(f"wrote {out / 'summary.json'} in {time.perf_counter() - t0:.1f} s")
    return 1 if any(m["verify_failures"] for m in summary["modes"].values()) else 0
