"""The cluster survives its metadata store losing state (issue 24, item 7): etcd restarted empty
(no persistent volume) or restored from an older snapshot, on the same endpoint, under nodes
that keep running. Every node is a process in its own network namespace, etcd a real one in the
hub (skipped with the reason when the machine cannot make namespaces or has no etcd).

Before the fix the views kept watching from a revision the new store had not reached: new rounds
never arrived and rounds the store no longer listed stayed. After it, every view sees the
revision (or cluster id, or raft term) go back, reads the index again and every node republishes
what it holds, so the views converge to what the nodes hold.

No timed assertions: waits are bounded by a generous deadline that turns a hang into a failure."""

from __future__ import annotations

import signal
import time

import pytest

pytest.importorskip("etcd3gw", reason="the cluster extra (etcd3gw) is not installed")

from flatcake.cluster.agent import node_config  # noqa: E402
from flatcake.gva.address import encode_gva  # noqa: E402

WAIT_S = 20.0  # deadline of a bounded wait: far above the expected delay, only to fail instead of hanging


def _round(node, scope, seq=0, pages=8, layers=2, medium=1):
    keys = [f"{node:02d}{scope:04d}{seq:04d}{i:04d}".ljust(64, "s") for i in range(pages)]
    gvas = [encode_gva(medium, node, ((scope * 100 + seq) * pages + i) * 8192) for i in range(pages)]
    sums = [[(node << 40) + (scope << 24) + (seq << 12) + i * layers + l for l in range(layers)] for i in range(pages)]
    return {"scope": scope, "seq": seq, "medium": medium, "keys": keys, "gvas": gvas, "stride": 8192 * pages,
            "checksums": sums}


def _keys(rounds):
    return [k for r in rounds for k in r["keys"]]


def _publish(agent, rnd):
    """Publish one round and wait until it is committed (one transaction: one store revision)."""
    agent.must("publish", **rnd)
    assert agent.must("flush", timeout_s=WAIT_S)["flushed"]
    return rnd


def _view_of(agent, rounds_by_node):
    """``agent``'s view of exactly these rounds (node, gva, scope, stride, checksums per page)."""
    got = agent.must("lookup", keys=_keys(r for rs in rounds_by_node.values() for r in rs))["pages"]
    return [None if p is None else (p["node"], p["gva"], p["scope"], p["stride"], p["checksums"]) for p in got]


def _expected(rounds_by_node):
    return [(node, g, r["scope"], r["stride"], s) for node, rs in rounds_by_node.items() for r in rs
            for g, s in zip(r["gvas"], r["checksums"])]


def _converges(agent, holds: dict, gone: list) -> None:
    """Wait until ``agent``'s view lists every page of ``holds`` (node -> rounds) and none of
    ``gone``; then check every field of every page."""
    assert agent.must("wait", keys=_keys(r for rs in holds.values() for r in rs), timeout_s=WAIT_S)["done"]
    if gone:
        assert agent.must("wait", keys=_keys(gone), present=False, timeout_s=WAIT_S)["done"]
    assert _view_of(agent, holds) == _expected(holds)
    st = agent.must("stats")["stats"]
    assert st["remote_pages"] == sum(len(r["keys"]) for rs in holds.values() for r in rs)
    assert st["remote_records"] == sum(len(rs) for rs in holds.values())


def _start(cluster, agent, node_id, **kw):
    return agent.must("start", config=node_config(cluster.etcd_endpoint, node_id,
                                                  advertise=f"{cluster.node_address(agent.i)}:7000", **kw))


def test_etcd_restarted_empty_new_rounds_reach_the_other_node_and_a_dead_node_s_rounds_leave(local_cluster, agents):
    c = local_cluster(3)
    a, b, dead = agents(c, [0, 1, 2])
    _start(c, a, 1)
    _start(c, b, 2)
    _start(c, dead, 3, ttl_s=60)  # its rounds outlive it in the old store: only the restart removes them
    # 30 revisions at least: the old store stays ahead of the new one for seconds (a margin for a
    # loaded machine: the new store's revision grows only by the nodes' capacity puts meanwhile)
    a_old = [_publish(a, _round(1, 1, seq)) for seq in range(30)]
    b_old = [_publish(b, _round(2, 2))]
    dead_old = [_publish(dead, _round(3, 3))]
    _converges(b, {1: a_old, 3: dead_old}, [])
    _converges(a, {2: b_old, 3: dead_old}, [])
    dead.proc.send_signal(signal.SIGKILL)  # no revoke: its rounds stay listed by the old store
    dead.proc.wait()

    c.restart_etcd_from(None)  # no persistent volume: the same endpoint and cluster id, revision 1
    a_new = [_publish(a, _round(1, 4))]
    b_new = [_publish(b, _round(2, 5))]

    _converges(b, {1: a_old + a_new}, dead_old)  # A republished its 30 rounds; 3's are not listed
    _converges(a, {2: b_old + b_new}, dead_old)
    for agent in (a, b):
        st = agent.must("stats")["stats"]
        assert st["store_resets"] == 1 and st["leases_lost"] == 1 and st["evicted"] is False
    assert a.must("stats")["stats"]["stale_records_deleted"] == 0  # an empty store holds nothing stale


def test_etcd_restored_from_an_older_snapshot_the_views_converge_to_what_the_nodes_hold(local_cluster, agents):
    c = local_cluster(2)
    a, b = agents(c, [0, 1])
    _start(c, a, 1)
    _start(c, b, 2)
    a_retired = [_publish(a, _round(1, 1))]
    a_kept = [_publish(a, _round(1, 2))]
    b_early = [_publish(b, _round(2, 3))]
    _converges(b, {1: a_retired + a_kept}, [])
    _converges(a, {2: b_early}, [])
    c.save_etcd_snapshot(c.data_root / "early.db")  # holds a_retired, a_kept, b_early

    a.must("retire", scope=1)
    a_late = [_publish(a, _round(1, 4, seq)) for seq in range(30)]  # the store runs 30+ revisions ahead
    b_late = [_publish(b, _round(2, 5))]
    _converges(b, {1: a_kept + a_late}, a_retired)
    _converges(a, {2: b_early + b_late}, [])

    c.restart_etcd_from(c.data_root / "early.db")  # back in time: a_retired listed again, the late rounds not
    a_new = [_publish(a, _round(1, 6))]

    # each view reads the store again and each node makes the store hold exactly its live rounds:
    # A deletes the retired round the snapshot brought back and puts its late ones again
    _converges(b, {1: a_kept + a_late + a_new}, a_retired)
    _converges(a, {2: b_early + b_late}, [])
    for agent in (a, b):
        st = agent.must("stats")["stats"]
        assert st["store_resets"] == 1 and st["leases_lost"] == 0  # the snapshot's leases live on
    assert a.must("stats")["stats"]["stale_records_deleted"] == 1  # a_retired, once
    assert b.must("stats")["stats"]["stale_records_deleted"] == 0


def _until(predicate, what: str) -> None:
    """Poll ``predicate`` (an observable state, no sleep as synchronisation) until true; fail
    naming ``what`` after the deadline."""
    end = time.monotonic() + WAIT_S
    while not predicate():
        assert time.monotonic() < end, f"{what}: not within {WAIT_S} s"
        time.sleep(0.02)


def test_a_node_that_re_leased_after_the_snapshot_takes_back_its_own_registration(local_cluster, agents):
    c = local_cluster(2)
    a, b = agents(c, [0, 1])
    _start(c, a, 1)
    _start(c, b, 2)
    a_kept = [_publish(a, _round(1, 1, seq)) for seq in range(30)]
    _converges(b, {1: a_kept}, [])
    c.save_etcd_snapshot(c.data_root / "early.db")  # A registered on its first lease
    c.set_link(0, up=False)  # A cannot renew: its lease expires, its rounds leave B's view
    assert b.must("wait", keys=_keys(a_kept), present=False, timeout_s=WAIT_S)["done"]
    c.set_link(0, up=True)
    _converges(b, {1: a_kept}, [])  # A re-leased, registered again and republished
    assert a.must("stats")["stats"]["leases_lost"] == 1
    a_late = [_publish(a, _round(1, 3, seq)) for seq in range(20)]  # on the second lease; 20+ revisions ahead
    _converges(b, {1: a_kept + a_late}, [])

    # the snapshot brings back A's first lease with A's registration on it, and knows nothing of
    # A's second lease: A re-leases again and finds node_id 1 registered by itself, not by another
    c.restart_etcd_from(c.data_root / "early.db")
    _until(lambda: a.must("stats")["stats"]["leases_lost"] == 2, "A's second lease found lost")
    a_new = [_publish(a, _round(1, 2))]
    _converges(b, {1: a_kept + a_late + a_new}, [])
    st = a.must("stats")["stats"]
    assert st["evicted"] is False and st["leases_lost"] == 2
    assert b.must("stats")["stats"]["store_resets"] == 1
