"""Remote reads land in every host-pool layout FlatCake supports (``layer_first``, ``page_first``,
``page_first_direct``; MHA and MLA): node B's backend restores node A's DRAM and SSD pages into its
own host pool bit-exact (skipped with the reason when the machine cannot make namespaces, has no
etcd, or the Mooncake wheel cannot load). One cluster; both backends restarted per layout."""

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

LAYOUTS = [("layer_first", False), ("page_first_direct", False), ("page_first", True), ("layer_first", True),
           ("page_first_direct", True)]


def _keys(tag, n):
    return [f"{tag}{i:03d}".ljust(64, "k") for i in range(n)]


@pytest.fixture(scope="module")
def nodes():
    """[A, B] storage agents (node ids 1, 2) in one local cluster; everything removed afterwards."""
    reason = unavailable_reason() or te_unavailable_reason()
    if reason:
        pytest.skip(reason)
    root = tempfile.mkdtemp(prefix="fc-backend-layouts-")
    cluster = LocalCluster(2).start()
    try:
        agents = [StorageAgentClient(cluster, i) for i in range(2)]
        yield cluster, agents, root
        for a in agents:
            a.must("close")
    finally:
        cluster.close()
        shutil.rmtree(root, ignore_errors=True)
    assert leftover_namespaces(cluster.name) == []


@pytest.mark.parametrize("layout,mla", LAYOUTS)
def test_pages_of_a_restore_bit_exact_into_b_host_pool(nodes, layout, mla):
    cluster, (a, b), root = nodes
    for i, n in enumerate((a, b)):
        cfg = node_config(cluster.etcd_endpoint, i + 1, advertise=f"{cluster.node_address(i)}:5601", extra=PLANE)
        out = n.must("start", config=cfg, ssd_dir=f"{root}/n{i}", layout=layout, mla=mla, layers=3, page_size=8)
        assert out["cluster"]
    tag = f"{layout[:6]}{int(mla)}"
    dk, sk = _keys(f"d{tag}", 5), _keys(f"s{tag}", 7)
    assert a.must("set", keys=dk, shared=True)["media"] == ["dram"] * 5
    assert a.must("set", keys=sk)["media"] == ["ssd"] * 7
    assert a.must("flush")["flushed"]
    assert b.must("wait", keys=sk + dk)["done"]
    got = b.must("get", keys=sk + dk)
    assert got == {"ok": [True] * 12, "equal": [True] * 12}
    assert b.must("stats")["stats"]["cluster"]["remote_read_pages"] == {"dram": 5, "ssd": 7}
