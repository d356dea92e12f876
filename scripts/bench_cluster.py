#!/usr/bin/env python3
"""Cluster data-plane benchmark (issue 12; docs/cluster.md): two nodes in network namespaces
(flatcake.cluster.netns) and one etcd. Node A writes pages into its DRAM region and SSD pool file
and publishes them; node B finds them in its replicated index and reads them back:

* ``te_raw_gbps``: the Mooncake Transfer Engine's raw batch read of A's DRAM pages (one entry per
  page, no checksum, no copy out) — the ceiling;
* ``remote_dram_gbps``: the same pages through :class:`~flatcake.cluster.remote_dram.RemoteDramReader`
  (merged batch reads, xxh3 check of every chunk, copy out);
* ``remote_ssd_gbps``: as many SSD pages through the owner (:mod:`flatcake.cluster.remote_ssd`:
  zmq request, O_DIRECT into A's staging ring, pipelined Transfer Engine pulls, checksums);
* ``propagation_ms``: rounds of 128 page keys published on A one at a time, delay until applied
  in B's view (B's clock − A's queue time; one machine, one clock), p50/p99.

Raw, DRAM and SSD reads are interleaved over ``--repeats`` and medians reported, so they share
the machine's noise. Targets (reported, not asserted): remote DRAM ≥ 0.8× raw, remote SSD
≥ 0.6× raw, propagation p99 ≤ 50 ms.

The owner's disk limit is fio's sequential read (``scripts/fio_limit.py``: O_DIRECT, libaio,
queue depth 32, the best of 1, 4 and 16 MiB requests) of the SSD pages' bytes on ``--dir``'s file
system (where A's pool files are), measured before the interleaved reads and after them:
``fio_read`` holds both, and ``ratio_remote_ssd_to_fio`` is the median over the repeats of the
remote SSD GB/s over the nearer of the two (the first half of the repeats: before).

    sudo .venv/bin/python scripts/bench_cluster.py [--pages 128 --chunk-kib 64 --layers 4] [--json FILE]

Needs root, iproute2, an etcd binary and the Mooncake wheel (libibverbs1); exits 2 saying which is
missing. Leaves no namespace, process or file behind (pool files in a temporary directory under
``--dir``, removed).
"""

from __future__ import annotations

import argparse
import os
import shutil
import signal
import statistics
import sys
import tempfile
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from bench_common import cluster_refusal, fio_ratios, write_json  # noqa: E402
from fio_limit import fio_limit  # noqa: E402
from flatcake.config import ClusterConfig  # noqa: E402


def _pct(values, q):
    d = sorted(values)
    return d[min(len(d) - 1, int(q * len(d)))] if d else float("nan")


#: B's landing buffer unless a read needs more: cluster.landing_bytes's default (what a node gets)
LANDING_DEFAULT = ClusterConfig.model_fields["landing_bytes"].default


def _start(cluster, root, args):
    from flatcake.cluster.agent import node_config
    from flatcake.cluster.dataplane_agent import DataPlaneClient

    page = args.layers * args.chunk_kib * 1024
    nodes = [DataPlaneClient(cluster, i) for i in range(2)]
    plane = {"cluster.staging_slots": args.slots, "cluster.staging_slot_bytes": args.slot_mib << 20,
             "cluster.landing_bytes": -(-max(args.slot_mib << 20, args.pages * page, LANDING_DEFAULT) // 8192) * 8192,
             "cluster.remote_timeout_s": 5.0}
    for i, n in enumerate(nodes):
        cfg = node_config(cluster.etcd_endpoint, i + 1, ttl_s=5, advertise=f"{cluster.node_address(i)}:5601", extra=plane)
        n.send("start", config=cfg, layers=args.layers, chunk_bytes=args.chunk_kib * 1024, dram_pages=args.pages,
               ssd_dir=str(root), file_bytes=max(64 << 20, 2 * args.pages * page))
    for n in nodes:
        n.reply()  # raises with the agent's error when it failed
    return nodes


def _bandwidths(a, b, args) -> dict:
    """Write the pages on A, then interleave raw / DRAM / SSD reads on B. Returns GB/s medians
    and, under ``"runs"``, every repeat's figures."""
    dram = [f"bench-dram-{i:05d}".ljust(64, "d") for i in range(args.pages)]
    ssd = [f"bench-ssd-{i:05d}".ljust(64, "s") for i in range(args.pages)]
    per_round = 128
    for lo in range(0, args.pages, per_round):
        a.must("write_dram", scope=1, seq=lo // per_round, keys=dram[lo: lo + per_round], seed=1)
        a.must("write_ssd", scope=2, seq=lo // per_round, keys=ssd[lo: lo + per_round], seed=2)
    if not b.must("wait", keys=dram + ssd, timeout_s=30.0)["done"]:
        raise RuntimeError("A's pages did not reach B's index within 30 s")
    hd = b.must("resolve", keys=dram)["handle"]
    hs = b.must("resolve", keys=ssd)["handle"]
    runs = {"raw": [], "dram": [], "ssd": []}
    for rep in range(args.repeats + 1):  # the first round warms up (handshakes, first touch)
        raw = b.must("raw_read", handle=hd)
        rd = b.must("read", handle=hd)
        rs = b.must("read", handle=hs)
        if not raw["ok"] or not all(rd["hit"]) or not all(rs["hit"]):
            raise RuntimeError(f"a read missed: raw {raw['ok']}, DRAM {rd['misses']}, SSD {rs['misses']}")
        if rep:
            for k, r in (("raw", raw), ("dram", rd), ("ssd", rs)):
                runs[k].append(r["bytes"] / r["elapsed_s"] / 1e9)
    sa, sb = a.must("stats"), b.must("stats")
    n = args.repeats + 1
    print(f"  remote SSD per read (mean of {n}): owner disk {sa['read_s'] / n * 1e3:.1f} ms, reader waiting "
          f"{sb['ssd_wait_s'] / n * 1e3:.1f} ms, pulling {sb['ssd_pull_s'] / n * 1e3:.1f} ms, checking and copying "
          f"{sb['ssd_copy_s'] / n * 1e3:.1f} ms", file=sys.stderr)
    return {**{k: statistics.median(v) for k, v in runs.items()}, "runs": runs}


def _propagation(a, b, rounds: int) -> list:
    """Publish ``rounds`` rounds on A one at a time (each waited for on B). Returns delays in ms."""
    before = len(b.must("stats")["propagation_s"])
    for seq in range(rounds):
        keys = a.must("publish_meta", scope=9, seq=seq)["keys"]
        if not b.must("wait", keys=keys, timeout_s=30.0)["done"]:
            raise RuntimeError("a round did not reach B within 30 s")
    return [d * 1e3 for d in b.must("stats")["propagation_s"][before:]]


def run(args) -> dict:
    """Run the benchmark; returns the ``--json`` object."""
    from flatcake.cluster import netns

    root = tempfile.mkdtemp(prefix="fc-bench-cluster-", dir=args.dir)
    ssd_bytes = args.pages * args.layers * args.chunk_kib * 1024
    try:
        with netns.LocalCluster(2) as cluster:
            a, b = _start(cluster, root, args)
            fio_before = fio_limit(root, ssd_bytes, "read")
            bw = _bandwidths(a, b, args)
            fio_after = fio_limit(root, ssd_bytes, "read")
            delays = _propagation(a, b, args.rounds)
    finally:
        shutil.rmtree(root, ignore_errors=True)
    to_fio = fio_ratios(bw["runs"]["ssd"], fio_before, fio_after)
    return {"te_raw_gbps": round(bw["raw"], 4), "remote_dram_gbps": round(bw["dram"], 4),
            "remote_ssd_gbps": round(bw["ssd"], 4),
            "ratio_remote_dram_to_raw": round(bw["dram"] / bw["raw"], 3),
            "ratio_remote_ssd_to_raw": round(bw["ssd"] / bw["raw"], 3),
            "ratio_remote_ssd_to_fio": None if to_fio is None else round(to_fio, 3),
            "fio_read": {"before": fio_before, "after": fio_after},
            "propagation_ms": {"p50": round(statistics.median(delays), 2), "p99": round(_pct(delays, 0.99), 2)}}


def main(argv=None) -> int:
    """Parse arguments, run, print the summary; returns the exit status (2: cannot run here)."""
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--pages", type=int, default=128, help="pages per read (default 128: SGLang's batch)")
    ap.add_argument("--layers", type=int, default=4, help="chunks per page (default 4)")
    ap.add_argument("--chunk-kib", type=int, default=64, help="KiB per chunk (default 64: 256 KiB pages)")
    dflt = {k: f.default for k, f in ClusterConfig.model_fields.items()}
    ap.add_argument("--slot-mib", type=int, default=dflt["staging_slot_bytes"] >> 20,
                    help="MiB per staging slot of A's ring (default: cluster.staging_slot_bytes's default)")
    ap.add_argument("--slots", type=int, default=dflt["staging_slots"],
                    help="staging slots of A's ring (default: cluster.staging_slots's default; at least 2)")
    ap.add_argument("--repeats", type=int, default=5, help="interleaved runs of each read (medians)")
    ap.add_argument("--rounds", type=int, default=50, help="rounds published one at a time for propagation")
    ap.add_argument("--dir", default=tempfile.gettempdir(), help="where the temporary SSD pool files go")
    ap.add_argument("--json", help="write the results here")
    args = ap.parse_args(argv)
    refused = cluster_refusal("bench_cluster")
    if refused is not None:
        return refused
    def _on_signal(signum, frame):  # SIGTERM tears the cluster down as Ctrl-C does
        raise KeyboardInterrupt

    previous = signal.signal(signal.SIGTERM, _on_signal)
    t0 = time.time()
    try:
        out = run(args)
    finally:
        signal.signal(signal.SIGTERM, previous)
    page_kib = args.layers * args.chunk_kib
    print(f"{args.pages} pages x {page_kib} KiB, {args.repeats} repeats, {time.time() - t0:.1f} s:")
    print(f"  Transfer Engine raw read  {out['te_raw_gbps']:.3f} GB/s")
    print(f"  remote DRAM               {out['remote_dram_gbps']:.3f} GB/s  ({out['ratio_remote_dram_to_raw']:.2f}x raw; target >= 0.8)")
    print(f"  remote SSD                {out['remote_ssd_gbps']:.3f} GB/s  ({out['ratio_remote_ssd_to_raw']:.2f}x raw; target >= 0.6)")
    fio = [f for f in out["fio_read"].values() if "best_gb_per_s" in f]
    r = out["ratio_remote_ssd_to_fio"]
    figures = ", ".join(f"{f['best_gb_per_s']:.3f}" for f in fio) + " GB/s (before, after)" if fio else "no figure"
    print(f"  owner's disk (fio read)   {figures}" + (f"  (remote SSD {r:.2f}x fio)" if r else ""))
    print(f"  propagation A->B          p50 {out['propagation_ms']['p50']} ms, p99 {out['propagation_ms']['p99']} ms "
          f"({args.rounds} rounds of 128 pages; target p99 <= 50 ms)")
    write_json(args.json, out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
