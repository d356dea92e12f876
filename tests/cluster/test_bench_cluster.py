"""``scripts/bench_cluster.py`` at tiny sizes in network namespaces: the ``--json`` object has
exactly the issue's keys, ratios agree with the bandwidths, and nothing is left behind (skipped with
the reason when the machine cannot make namespaces, has no etcd, or the Mooncake wheel cannot
load). No timed assertions: bandwidths and delays are only checked to be positive."""

from __future__ import annotations

import importlib
import json
import os
import sys
from pathlib import Path

import pytest

pytest.importorskip("etcd3gw", reason="the cluster extra (etcd3gw) is not installed")
pytest.importorskip("zmq", reason="pyzmq is not installed")

from flatcake.cluster import netns  # noqa: E402
from flatcake.cluster.netns import unavailable_reason  # noqa: E402
from flatcake.cluster.transfer import te_unavailable_reason  # noqa: E402
from flatcake_testkit import record_local_clusters  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "scripts"))
bench_cluster = importlib.import_module("bench_cluster")


def test_bench_cluster_writes_the_issue_json_and_leaves_nothing(tmp_path, monkeypatch):
    reason = unavailable_reason() or te_unavailable_reason()
    if reason:
        pytest.skip(reason)
    made = record_local_clusters(monkeypatch)
    out = tmp_path / "cluster.json"
    rc = bench_cluster.main(["--pages", "8", "--chunk-kib", "16", "--slot-mib", "1", "--repeats", "1",
                             "--rounds", "3", "--dir", str(tmp_path), "--json", str(out)])
    assert rc == 0
    got = json.loads(out.read_text())
    assert sorted(got) == sorted(["te_raw_gbps", "remote_dram_gbps", "remote_ssd_gbps", "ratio_remote_dram_to_raw",
                                  "ratio_remote_ssd_to_raw", "propagation_ms", "fio_read", "ratio_remote_ssd_to_fio"])
    assert sorted(got["fio_read"]) == ["after", "before"]  # fio's read on the owner's file system around the reads
    fio = [f["best_gb_per_s"] for f in got["fio_read"].values() if "best_gb_per_s" in f]
    if fio:  # fio installed (make fio): the ratio is the remote SSD read over fio's
        assert got["ratio_remote_ssd_to_fio"] > 0
    assert sorted(got["propagation_ms"]) == ["p50", "p99"]
    assert got["te_raw_gbps"] > 0 and got["remote_dram_gbps"] > 0 and got["remote_ssd_gbps"] > 0
    assert got["ratio_remote_dram_to_raw"] == pytest.approx(got["remote_dram_gbps"] / got["te_raw_gbps"], rel=0.05)
    assert got["ratio_remote_ssd_to_raw"] == pytest.approx(got["remote_ssd_gbps"] / got["te_raw_gbps"], rel=0.05)
    assert 0 < got["propagation_ms"]["p50"] <= got["propagation_ms"]["p99"]
    assert os.listdir(tmp_path) == ["cluster.json"]  # the pool files' directory is gone
    assert len(made) == 1
    assert netns.leftover_namespaces(made[0].name) == [] and not made[0].data_root.exists()
