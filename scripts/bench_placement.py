#!/usr/bin/env python3
"""Write-time placement benchmark (issue 12; docs/cluster.md, "Write-time placement on another
node"): two FlatCake backends (placement agents, flatcake.cluster.placement_agent) in network
namespaces on one etcd. Node A's SSD holds exactly one round and it is pinned, so each of A's
puts is placed on node B (reserve by CAS, outbox gather + xxh3, ``store`` request, B pulls with
the Transfer Engine, verifies and stores, capacity published, reservation released); node B's
own puts of rounds of the same size are the local baseline. Interleaved over ``--repeats``,
medians:

* ``local_put_ms``: B's ``batch_set_v1`` of one round (its SSD round queued for the disk);
* ``placed_put_ms``: A's ``batch_set_v1`` of one round placed on B (returns when B stored it);
* ``placed_mb_s``: round bytes / placed put time; ``ratio_placed_to_local``.

No ratio to fio (issue 23, item 6, asks one of every bench that reports a disk rate): both puts
return once the round is in B's write queue (``ssd.write_backlog_bytes``), before B's disk
write, so ``placed_mb_s`` is the network and queue path's rate, not the disk's.

    sudo .venv/bin/python scripts/bench_placement.py [--pages 128 --layers 8 --page-size 64] [--json FILE]

Needs root, iproute2, an etcd binary and the Mooncake wheel (libibverbs1); exits 2 saying which is
missing. Leaves no namespace, process or file behind.
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import sys
import tempfile

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from bench_common import cluster_refusal, write_json  # noqa: E402


def _start(cluster, root, args):
    from flatcake.cluster.agent import node_config
    from flatcake.cluster.placement_agent import PlacementAgentClient
    from flatcake.common.layout import PageGeometry
    from flatcake.store.write_path import round_extent_bytes

    g = PageGeometry(args.layers, args.page_size, (64, 64))  # the agent's pool: 2 heads x 16 dims, bf16
    extent = -(-round_extent_bytes(args.pages, g) // 4096) * 4096
    landing = -(-max(64 << 20, args.pages * g.page_bytes) // 8192) * 8192
    plane = {"cluster.landing_bytes": landing, "cluster.remote_timeout_s": 10.0}
    media = [{"dram.capacity_bytes": 0, "ssd.file_bytes": extent, "ssd.max_files": 1},
             {"dram.capacity_bytes": 0, "ssd.file_bytes": max(64 << 20, 2 * extent), "ssd.max_files": 8}]
    nodes = [PlacementAgentClient(cluster, i) for i in range(2)]
    for i, n in enumerate(nodes):
        cfg = node_config(cluster.etcd_endpoint, i + 1, ttl_s=5, advertise=f"{cluster.node_address(i)}:5601",
                          extra={**plane, **media[i]})
        n.send("start", config=cfg, ssd_dir=f"{root}/n{i}", pages=args.pages, page_size=args.page_size,
               layers=args.layers)
    for n in nodes:
        out = n.reply()
        if not out.get("ok"):
            raise RuntimeError(f"agent start: {out.get('error')}")
    return nodes, g.page_bytes


def run(args) -> dict:
    """Start the pair, fill A, time the interleaved puts; returns the ``--json`` fields."""
    from flatcake.cluster.netns import LocalCluster

    root = tempfile.mkdtemp(prefix="fc-bench-placement-", dir=args.dir)
    cluster = LocalCluster(2).start()
    try:
        (a, b), page_bytes = _start(cluster, root, args)
        filled = a.must("fill", tag="fill", pages=args.pages)
        if filled["pages"] != args.pages:
            raise RuntimeError(f"A's fill stored {filled['pages']} pages, expected {args.pages}")
        local, placed = [], []
        for r in range(args.repeats + 1):  # the first of each is a warm-up
            keys = [f"l{r:03d}-{i:04d}".ljust(64, "k") for i in range(args.pages)]
            got = b.must("timed_set", keys=keys)
            assert all(got["ok"]), "B's local put failed"
            b.must("flush")
            keys = [f"p{r:03d}-{i:04d}".ljust(64, "k") for i in range(args.pages)]
            put = a.must("timed_set", keys=keys)
            assert all(put["ok"]), "A's placed put failed"
            b.must("flush")
            if r:
                local.append(got["put_s"])
                placed.append(put["put_s"])
        st_a = a.must("stats")["stats"]["cluster"]
        st_b = b.must("stats")["stats"]["cluster"]
    finally:
        cluster.close()
        shutil.rmtree(root, ignore_errors=True)
    lm, pm = statistics.median(local), statistics.median(placed)
    nbytes = args.pages * page_bytes
    return {"round_bytes": nbytes, "local_put_ms": round(lm * 1e3, 2), "placed_put_ms": round(pm * 1e3, 2),
            "placed_mb_s": round(nbytes / pm / 1e6, 1), "ratio_placed_to_local": round(pm / lm, 2),
            "remote_placed_pages": st_a["remote_placed_pages"], "guest_pages_stored": st_b["guest_pages_stored"],
            "reservations": st_a["reservations"]}


def main(argv=None) -> int:
    """Parse arguments, run, print the summary; returns the exit status (2: cannot run here)."""
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--pages", type=int, default=128, help="pages per round (default 128: SGLang's batch)")
    ap.add_argument("--layers", type=int, default=8, help="layers per page (default 8)")
    ap.add_argument("--page-size", type=int, default=64, help="tokens per page (default 64: 8 KiB chunks)")
    ap.add_argument("--repeats", type=int, default=5, help="interleaved puts of each kind (medians)")
    ap.add_argument("--dir", default=tempfile.gettempdir(), help="where the temporary SSD pool files go")
    ap.add_argument("--json", help="write the results here")
    args = ap.parse_args(argv)
    refused = cluster_refusal("bench_placement")
    if refused is not None:
        return refused
    out = run(args)
    print(f"{args.pages} pages x {out['round_bytes'] // args.pages // 1024} KiB per round, {args.repeats} repeats:")
    print(f"  local put on B (queued)   {out['local_put_ms']} ms")
    print(f"  A's put placed on B       {out['placed_put_ms']} ms ({out['placed_mb_s']} MB/s; "
          f"{out['ratio_placed_to_local']}x the local put)")
    print(f"  placed pages {out['remote_placed_pages']}, stored by B {out['guest_pages_stored']}, "
          f"reservations {out['reservations']}")
    write_json(args.json, out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
