"""Write-time placement on another node's medium across network namespaces (placement agents,
:mod:`flatcake.cluster.placement_agent`, on a real etcd): a node whose own media are full (every
scope pinned, so its policy can reclaim nothing) places its next round on another node, which
owns the pages from then on; two full writers racing for a third node's last space: exactly one
placement; the target gone: a failed put, counted. Skipped with the reason when the machine
cannot make namespaces, has no etcd, or the Mooncake wheel cannot load.

No timed assertions: every wait is bounded by a generous guard that turns a hang into a failure."""

from __future__ import annotations

import shutil
import tempfile

import pytest

pytest.importorskip("etcd3gw", reason="the cluster extra (etcd3gw) is not installed")
pytest.importorskip("zmq", reason="pyzmq is not installed")

from flatcake.cluster.agent import node_config  # noqa: E402
from flatcake.cluster.netns import LocalCluster, leftover_namespaces, unavailable_reason  # noqa: E402
from flatcake.cluster.placement_agent import PlacementAgentClient  # noqa: E402
from flatcake.cluster.transfer import te_unavailable_reason  # noqa: E402

PLANE = {"cluster.staging_slot_bytes": 64 << 10, "cluster.landing_bytes": 1 << 20, "cluster.remote_timeout_s": 1.0}
#: a writer whose SSD holds two 64-page rounds (151552 bytes each, 4 KiB left) and no DRAM
SMALL = {"dram.capacity_bytes": 0, "ssd.file_bytes": 307200, "ssd.max_files": 1}
#: a target with room for one 100-page round (229376 bytes) but not two
ONE_ROUND = {"ssd.file_bytes": 290816, "ssd.max_files": 1}


def _keys(tag, n):
    return [f"{tag}{i:03d}".ljust(64, "k") for i in range(n)]


def _cl(node) -> dict:
    return node.must("stats")["stats"]["cluster"]


def _start(cluster, root, specs):
    """Placement agents on nodes ``i`` with FlatCake overrides ``extra`` (``specs``: [(i, extra)])."""
    nodes = []
    for i, extra in specs:
        n = PlacementAgentClient(cluster, i)
        cfg = node_config(cluster.etcd_endpoint, i + 1, advertise=f"{cluster.node_address(i)}:5601",
                          extra={**PLANE, **extra})
        n.send("start", config=cfg, ssd_dir=f"{root}/n{i}", pages=128)
        nodes.append(n)
    for n in nodes:
        out = n.reply()
        assert out["ok"] and out["cluster"], out
    return nodes


@pytest.fixture
def netns_cluster():
    """Factory ``make(n)`` -> (cluster, root dir); everything torn down and checked afterwards."""
    reason = unavailable_reason() or te_unavailable_reason()
    if reason:
        pytest.skip(reason)
    made = []
    root = tempfile.mkdtemp(prefix="fc-placement-")

    def make(n):
        c = LocalCluster(n).start()
        made.append(c)
        return c, root

    yield make
    for c in made:
        c.close()
    shutil.rmtree(root, ignore_errors=True)
    for c in made:
        assert leftover_namespaces(c.name) == []


def test_a_full_node_places_its_next_round_on_b_which_owns_and_serves_it(netns_cluster):
    cluster, root = netns_cluster(2)
    a, b = _start(cluster, root, [(0, SMALL), (1, {})])
    filled = a.must("fill", tag="fill-a")
    assert (filled["pages"], filled["rounds"]) == (128, 4)  # two 64-page rounds; then neither 64 nor 1 page fit
    assert _cl(a)["remote_placed_pages"] == 0

    keys = _keys("placed", 32)
    got = a.must("set", keys=keys)
    assert got == {"ok": [True] * 32, "media": [None] * 32}  # stored, but not on A
    st_a, st_b = _cl(a), _cl(b)
    assert st_a["remote_placed_pages"] == 32 and st_a["remote_placed_rounds"] == 1
    assert st_a["remote_place_failures"] == 0 and st_a["reservations"] == {"made": 1, "failed": 0}
    assert st_a["no_space_rounds"] == 1
    assert st_b["guest_pages_stored"] == 32 and st_b["guest_rounds"] == 1

    assert b.must("flush")["flushed"]
    assert a.must("wait", keys=keys)["done"]  # B's round reached A's view
    assert a.must("view", keys=keys)["nodes"] == [2] * 32  # GVA node field: B's node id
    assert b.must("exists", keys=keys)["n"] == 32  # B's own pages now
    assert b.must("view", keys=keys)["nodes"] == [None] * 32  # (not another node's)

    back = a.must("get", keys=keys)
    assert back == {"ok": [True] * 32, "equal": [True] * 32}  # bit-exact from B
    assert _cl(a)["remote_read_pages"]["ssd"] == 32

    again = a.must("set", keys=keys)  # held by B already: nothing shipped again
    assert again["ok"] == [True] * 32
    st = _cl(a)
    assert st["remote_known_pages"] == 32 and st["reservations"]["made"] == 1
    assert _cl(b)["guest_pages_stored"] == 32


def test_two_full_writers_racing_for_the_last_space_of_a_third_place_exactly_once(netns_cluster):
    cluster, root = netns_cluster(3)
    w1, w2, b = _start(cluster, root, [(0, SMALL), (1, SMALL), (2, ONE_ROUND)])
    for w in (w1, w2):
        assert w.must("fill", tag=f"fill{w.i}")["pages"] == 128
    k1, k2 = _keys("race-one", 100), _keys("race-two", 100)
    w1.send("set", keys=k1)
    w2.send("set", keys=k2)
    r1, r2 = w1.reply(), w2.reply()
    assert "error" not in r1 and "error" not in r2, (r1, r2)
    o1, o2 = r1["ok"], r2["ok"]  # per-page success of each put
    assert sorted([o1, o2]) == [[False] * 100, [True] * 100]
    s1, s2 = _cl(w1), _cl(w2)
    assert s1["remote_placed_rounds"] + s2["remote_placed_rounds"] == 1
    assert s1["remote_place_failures"] + s2["remote_place_failures"] == 1
    assert s1["remote_placed_pages"] + s2["remote_placed_pages"] == 100
    assert _cl(b)["guest_pages_stored"] == 100


def test_b_gone_fails_the_put_within_the_timeout_counted_nothing_raises(netns_cluster):
    cluster, root = netns_cluster(2)
    a, b = _start(cluster, root, [(0, SMALL), (1, {})])
    assert a.must("fill", tag="fill-a")["pages"] == 128
    b.proc.kill()
    b.proc.wait(timeout=30)
    keys = _keys("orphan", 16)
    got = a.must("set", keys=keys, limit_s=60)  # bounded: remote_timeout_s for the answer, etcd timeouts
    assert got["ok"] == [False] * 16
    st = a.must("stats")["stats"]
    assert st["cluster"]["remote_place_failures"] == 1 and st["cluster"]["remote_placed_pages"] == 0
    assert st["put_failures"] >= 2  # the fill's last round and this one
    assert a.must("exists", keys=keys)["n"] == 0
    assert a.must("set", keys=_keys("later", 4), limit_s=60)["ok"] == [False] * 4  # still answers
