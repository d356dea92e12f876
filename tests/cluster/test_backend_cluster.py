"""The backend's cluster wiring across network namespaces: two FlatCakeStorage nodes (storage
agents, :mod:`flatcake.cluster.storage_agent`) on a real etcd; pages one node backs up are hit
queries and bit-exact reads on the other (skipped with the reason when the machine cannot make
namespaces, has no etcd, or the Mooncake wheel cannot load).

No timed assertions: every wait is bounded by a generous guard that turns a hang into a failure."""

from __future__ import annotations

import shutil
import tempfile

import pytest

pytest.importorskip("etcd3gw", reason="the cluster extra (etcd3gw) is not installed")
pytest.importorskip("zmq", reason="pyzmq is not installed")

from flatcake.cluster.agent import node_config  # noqa: E402
from flatcake.cluster.netns import LocalCluster, leftover_namespaces, unavailable_reason  # noqa: E402
from flatcake.cluster.storage_agent import StorageAgentClient  # noqa: E402
from flatcake.cluster.transfer import te_unavailable_reason  # noqa: E402

PLANE = {"cluster.staging_slot_bytes": 64 << 10, "cluster.landing_bytes": 1 << 20, "cluster.remote_timeout_s": 1.0}


SSD_DIRS: list[str] = []  # each node's ssd.path (the restart test reopens A's)


def _keys(tag, n):
    return [f"{tag}{i:03d}".ljust(64, "k") for i in range(n)]


def _cluster_stats(node) -> dict:
    return node.must("stats")["stats"]["cluster"]


@pytest.fixture(scope="module")
def pair():
    """(cluster, [A, B]): storage agents with node ids 1 and 2, in file order (the last test kills
    A); torn down with a check that no namespace, /dev/shm directory or pool file is left."""
    reason = unavailable_reason() or te_unavailable_reason()
    if reason:
        pytest.skip(reason)
    root = tempfile.mkdtemp(prefix="fc-backend-cluster-")
    SSD_DIRS.clear()
    cluster = LocalCluster(2).start()
    try:
        nodes = [StorageAgentClient(cluster, i) for i in range(2)]
        for i, n in enumerate(nodes):
            cfg = node_config(cluster.etcd_endpoint, i + 1, advertise=f"{cluster.node_address(i)}:5601", extra=PLANE)
            SSD_DIRS.append(f"{root}/n{i}")
            n.send("start", config=cfg, ssd_dir=SSD_DIRS[i])
        for n in nodes:
            out = n.reply()
            assert out["ok"] and out["cluster"], out
        yield cluster, nodes
    finally:
        cluster.close()
        shutil.rmtree(root, ignore_errors=True)
    assert leftover_namespaces(cluster.name) == []


def test_dram_and_ssd_scopes_backed_up_on_a_are_hits_and_bit_exact_reads_on_b(pair):
    _, (a, b) = pair
    dk, sk = _keys("dram", 8), _keys("ssd", 8)
    assert a.must("set", keys=dk, shared=True) == {"ok": [True] * 8, "media": ["dram"] * 8}
    assert a.must("set", keys=sk) == {"ok": [True] * 8, "media": ["ssd"] * 8}
    assert a.must("flush")["flushed"]
    assert b.must("wait", keys=dk + sk)["done"]
    hits0 = _cluster_stats(b)["remote_hit_pages"]
    assert b.must("exists", keys=dk + sk + _keys("none", 2))["n"] == 16
    hits1 = _cluster_stats(b)["remote_hit_pages"]
    assert {m: hits1[m] - hits0[m] for m in hits0} == {"dram": 8, "ssd": 8}

    got = b.must("get", keys=dk + sk)
    assert got["ok"] == [True] * 16 and got["equal"] == [True] * 16
    st = _cluster_stats(b)
    assert st["remote_read_pages"] == {"dram": 8, "ssd": 8}
    assert st["remote_miss_pages"]["mismatch"] == 0
    pub = _cluster_stats(a)
    assert pub["published_rounds"] == 2 and pub["published_pages"] == 16

    flat = b.must("get_flat", keys=sk[:3] + dk[:2])  # generic path (flat pages), any order of A's pages
    assert flat == {"ok": [True] * 5, "equal": [True] * 5}
    assert _cluster_stats(b)["remote_read_pages"] == {"dram": 10, "ssd": 11}


def test_a_local_run_on_b_is_continued_by_pages_of_a(pair):
    _, (a, b) = pair
    lk, rk = _keys("local", 3), _keys("remote", 5)
    assert a.must("set", keys=rk, prefix=lk)["ok"] == [True] * 5
    assert b.must("set", keys=lk)["ok"] == [True] * 3
    assert a.must("flush")["flushed"]
    assert b.must("wait", keys=rk)["done"]
    assert b.must("exists", keys=lk + rk)["n"] == 8
    before = b.must("stats")["stats"]
    got = b.must("get", keys=lk + rk + _keys("none", 2))
    assert got["ok"] == [True] * 8 + [False] * 2 and got["equal"][:8] == [True] * 8
    after = b.must("stats")["stats"]
    assert after["hit_pages_ssd"] + after["hit_pages_dram"] - before["hit_pages_ssd"] - before["hit_pages_dram"] == 3
    rr0, rr1 = before["cluster"]["remote_read_pages"], after["cluster"]["remote_read_pages"]
    assert rr1["ssd"] - rr0["ssd"] == 5 and rr1["dram"] == rr0["dram"]


def test_a_prefix_whose_turns_alternate_between_nodes_is_one_hit_and_one_bit_exact_read(pair):
    """Round-robin routing: turn 1 stored on A, turn 2 on B, turn 3 on A. Each node's hit query
    and read cover all three turns, local runs from its store and the other's through the data plane."""
    _, (a, b) = pair
    t1, t2, t3 = _keys("alt1-", 4), _keys("alt2-", 4), _keys("alt3-", 4)
    assert a.must("set", keys=t1)["ok"] == [True] * 4
    assert b.must("set", keys=t2)["ok"] == [True] * 4
    assert a.must("set", keys=t3)["ok"] == [True] * 4
    assert a.must("flush")["flushed"] and b.must("flush")["flushed"]
    assert b.must("wait", keys=t1 + t3)["done"] and a.must("wait", keys=t2)["done"]
    prompt = t1 + t2 + t3 + _keys("alt4-", 2)
    for node, remote in ((b, 8), (a, 4)):
        assert node.must("exists", keys=prompt)["n"] == 12
        before = sum(_cluster_stats(node)["remote_read_pages"].values())
        got = node.must("get", keys=prompt[:12])
        assert got["ok"] == [True] * 12 and got["equal"] == [True] * 12
        assert sum(_cluster_stats(node)["remote_read_pages"].values()) - before == remote


def test_a_cleared_scope_on_a_disappears_from_b(pair):
    _, (a, b) = pair
    keys = _keys("gone", 4)
    assert a.must("set", keys=keys)["ok"] == [True] * 4
    assert a.must("flush")["flushed"]
    assert b.must("wait", keys=keys)["done"]
    retired0 = _cluster_stats(a)["retired_scopes"]
    a.must("clear")
    assert a.must("flush")["flushed"]
    assert _cluster_stats(a)["retired_scopes"] > retired0
    assert b.must("wait", keys=keys, n=0)["done"]
    assert b.must("exists", keys=keys)["n"] == 0
    assert b.must("get", keys=keys)["ok"] == [False] * 4


def test_a_restarted_publishes_the_ssd_pages_it_rebuilt_and_b_reads_them(pair):
    cluster, (a, b) = pair
    keys = _keys("warm", 6)
    assert a.must("set", keys=keys)["media"] == ["ssd"] * 6
    assert a.must("flush")["flushed"]
    assert b.must("wait", keys=keys)["done"]
    published = _cluster_stats(a)["published_pages"]
    cfg = node_config(cluster.etcd_endpoint, 1, advertise=f"{cluster.node_address(0)}:5601", extra=PLANE)
    assert a.must("start", config=cfg, ssd_dir=SSD_DIRS[0])["cluster"]  # old backend closed: lease revoked
    assert a.must("flush")["flushed"]
    st = _cluster_stats(a)
    assert st["published_pages"] >= 6 and st["published_pages"] < published + 6  # a new member: rebuilt pages only
    assert b.must("wait", keys=keys)["done"]
    # B still holds A's old data-plane descriptor: the failed transfer looks it up again, finds
    # A's new one and reads again with it (no back-off), so the first read hits
    got = b.must("get", keys=keys)
    assert got == {"ok": [True] * 6, "equal": [True] * 6}


def test_a_killed_while_b_reads_gives_misses_and_nothing_raises(pair):
    cluster, (a, b) = pair
    dk, sk = _keys("kdram", 6), _keys("kssd", 6)
    assert a.must("set", keys=dk, shared=True)["media"] == ["dram"] * 6
    assert a.must("set", keys=sk)["media"] == ["ssd"] * 6
    assert a.must("flush")["flushed"]
    assert b.must("wait", keys=dk + sk)["done"]
    a.proc.kill()
    a.proc.wait()
    misses0 = sum(_cluster_stats(b)["remote_miss_pages"].values())
    for keys in (dk, sk):
        got = b.must("get", keys=keys, limit_s=60.0)  # a reply, not an exception (guard only)
        assert got["ok"] == [False] * 6
    misses = _cluster_stats(b)["remote_miss_pages"]
    assert sum(misses.values()) - misses0 >= 2  # at least the first page of each read
    assert misses["error"] == 0
    assert b.must("wait", keys=dk + sk, n=0, timeout_s=30.0)["done"]  # A's lease expired
    assert b.must("get", keys=dk)["ok"] == [False] * 6
