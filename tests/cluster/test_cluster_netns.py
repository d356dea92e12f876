"""The cluster index and coordinator on a real etcd, with every node a process in its own network
namespace (skipped with the reason when the machine cannot make namespaces or has no etcd).

No timed assertions: waits are bounded (a generous deadline turns a hang into a failure) and
the measured delays are printed, not asserted."""

from __future__ import annotations

import signal
import statistics
import time

import pytest

pytest.importorskip("etcd3gw", reason="the cluster extra (etcd3gw) is not installed")

from flatcake.cluster.agent import node_config  # noqa: E402
from flatcake.gva.address import encode_gva  # noqa: E402

WAIT_S = 20.0  # deadline of a bounded wait: far above the expected delay, only to fail instead of hanging


def _round(node, scope, seq, pages=128, layers=4, medium=1):
    keys = [f"{node:02d}{scope:04d}{seq:04d}{i:04d}".ljust(64, "a") for i in range(pages)]
    gvas = [encode_gva(medium, node, ((scope * 100 + seq) * pages + i) * 8192) for i in range(pages)]
    sums = [[(node << 40) + (scope << 24) + (seq << 12) + i * layers + l for l in range(layers)] for i in range(pages)]
    return {"scope": scope, "seq": seq, "medium": medium, "keys": keys, "gvas": gvas, "stride": 8192 * pages,
            "checksums": sums}


def _print_delays(what, delays):
    d = sorted(delays)
    p50, p99 = statistics.median(d), d[min(len(d) - 1, int(0.99 * len(d)))]
    print(f"\npropagation A->B, {what} ({len(d)} rounds of 128 pages x 4 layers): "
          f"p50 {p50 * 1e3:.1f} ms, p99 {p99 * 1e3:.1f} ms")


def _publish(agent, rnd):
    agent.must("publish", **rnd)
    return rnd


def _assert_view_has(agent, rounds, node):
    keys = [k for r in rounds for k in r["keys"]]
    got = agent.must("lookup", keys=keys)["pages"]
    want = [(node, g, r["scope"], r["stride"], s) for r in rounds for g, s in zip(r["gvas"], r["checksums"])]
    assert [(p["node"], p["gva"], p["scope"], p["stride"], p["checksums"]) for p in got] == want


def _start(cluster, agent, node_id, **kw):
    return agent.must("start", config=node_config(cluster.etcd_endpoint, node_id, advertise=f"{cluster.node_address(agent.i)}:7000", **kw))


def test_rounds_written_on_a_appear_on_b_with_their_gvas_and_checksums(local_cluster, agents):
    c = local_cluster(2)
    a, b = agents(c, [0, 1])
    _start(c, a, 1)
    _start(c, b, 2)
    rounds = []
    for seq in range(20):  # one at a time: the delay of a round that does not queue behind others
        rounds.append(_publish(a, _round(1, 1, seq)))
        assert b.must("wait", keys=rounds[-1]["keys"], timeout_s=WAIT_S)["done"]
    _print_delays("one round at a time", b.must("stats")["propagation_s"])
    rounds += [_publish(a, _round(1, 2, seq)) for seq in range(20)]  # a burst: batched, queued
    assert b.must("wait", keys=[k for r in rounds for k in r["keys"]], timeout_s=WAIT_S)["done"]
    _assert_view_has(b, rounds, node=1)
    assert a.must("lookup", keys=rounds[0]["keys"][:1])["pages"] == [None]  # own pages: the local index's
    delays = b.must("stats")["propagation_s"]
    assert len(delays) == len(rounds)
    _print_delays("a burst of 20", delays[20:])
    a.must("retire", scope=1)
    assert b.must("wait", keys=[k for r in rounds[:20] for k in r["keys"]], present=False, timeout_s=WAIT_S)["done"]
    _assert_view_has(b, rounds[20:], node=1)
    st = b.must("stats")["stats"]
    assert st["remote_pages"] == 20 * 128 and st["remote_records"] == 20


def test_lookup_on_b_answers_from_memory_while_etcd_is_unreachable(local_cluster, agents):
    c = local_cluster(2)
    a, b = agents(c, [0, 1])
    _start(c, a, 1)
    _start(c, b, 2)
    before = _publish(a, _round(1, 1, 0))
    assert b.must("wait", keys=before["keys"], timeout_s=WAIT_S)["done"]
    c.set_link(1, up=False)  # B's connections to etcd now hang (no reset)
    t0 = time.perf_counter()
    _assert_view_has(b, [before], node=1)
    out = b.must("lookup", keys=before["keys"])
    print(f"\nlookup of 128 keys with etcd unreachable: {out['elapsed_s'] * 1e6:.0f} us in B, "
          f"{(time.perf_counter() - t0) * 1e3:.1f} ms round trip through the pipe")
    during = _publish(a, _round(1, 1, 1))  # written while B is cut off
    assert a.must("flush", timeout_s=WAIT_S)["flushed"]
    c.set_link(1, up=True)
    assert b.must("wait", keys=during["keys"], timeout_s=WAIT_S)["done"]  # resumed from its revision
    _assert_view_has(b, [before, during], node=1)


def test_a_killed_node_s_records_vanish_from_b_when_its_lease_expires(local_cluster, agents):
    c = local_cluster(3)
    a, b, a2 = agents(c, [0, 1, 2])
    _start(c, a, 1)
    _start(c, b, 2)
    rounds = [_publish(a, _round(1, 3, seq)) for seq in range(3)]
    assert b.must("wait", keys=[k for r in rounds for k in r["keys"]], timeout_s=WAIT_S)["done"]
    a.proc.send_signal(signal.SIGKILL)  # no revoke: the 2 s lease must expire
    a.proc.wait()
    out = b.must("wait", keys=[k for r in rounds for k in r["keys"]], present=False, timeout_s=WAIT_S)
    assert out["done"]
    print(f"\nA's records left B's view {out['elapsed_s']:.2f} s after A was killed (lease TTL 2 s)")
    assert b.must("stats")["stats"]["remote_pages"] == 0
    assert _start(c, a2, 1)["ok"]  # node_id 1 is free again once the lease is gone


def test_etcd_restart_b_keeps_its_view_reconnects_and_loses_no_record(local_cluster, agents):
    c = local_cluster(2)
    a, b = agents(c, [0, 1])
    _start(c, a, 1)
    _start(c, b, 2)
    before = [_publish(a, _round(1, 5, seq)) for seq in range(3)]
    assert b.must("wait", keys=[k for r in before for k in r["keys"]], timeout_s=WAIT_S)["done"]
    c.stop_etcd()
    _assert_view_has(b, before, node=1)  # served from memory while etcd is down
    down = [_publish(a, _round(1, 6, seq)) for seq in range(2)]  # queued by A's publisher
    c.start_etcd()
    after = [_publish(a, _round(1, 7, seq)) for seq in range(2)]
    every = before + down + after
    assert b.must("wait", keys=[k for r in every for k in r["keys"]], timeout_s=WAIT_S)["done"]
    _assert_view_has(b, every, node=1)
    st = b.must("stats")["stats"]
    assert st["reconnects"] >= 1 and st["bootstraps"] == 1  # resumed from its revision, not re-read
    a.must("retire", scope=6)  # deletes after the restart still reach B
    assert b.must("wait", keys=[k for r in down for k in r["keys"]], present=False, timeout_s=WAIT_S)["done"]
    _assert_view_has(b, before + after, node=1)


def test_b_reads_the_index_again_when_its_watch_revision_was_compacted(local_cluster, agents):
    c = local_cluster(2)
    a, b = agents(c, [0, 1])
    _start(c, a, 1)
    _start(c, b, 2)
    old = _publish(a, _round(1, 1, 0))
    assert b.must("wait", keys=old["keys"], timeout_s=WAIT_S)["done"]
    c.set_link(1, up=False)  # B's watch stream goes silent, then dead: B cannot see the restart
    c.stop_etcd()
    c.start_etcd()
    a.must("retire", scope=1)
    new = _publish(a, _round(1, 2, 0))
    assert a.must("flush", timeout_s=WAIT_S)["flushed"]
    a.must("compact")  # B's next revision is gone from etcd's history
    c.set_link(1, up=True)  # B's silent watch is re-opened (cluster.watch_idle_s), finds it compacted
    assert b.must("wait", keys=new["keys"], timeout_s=WAIT_S)["done"]
    assert b.must("wait", keys=old["keys"], present=False, timeout_s=WAIT_S)["done"]
    _assert_view_has(b, [new], node=1)
    assert b.must("stats")["stats"]["bootstraps"] == 2


def test_two_nodes_reserving_the_last_free_ssd_space_of_a_third_exactly_one_wins(local_cluster, agents):
    c = local_cluster(3)
    a, b, t = agents(c, [0, 1, 2])
    for agent, node in ((a, 1), (b, 2), (t, 3)):
        _start(c, agent, node)
    t.must("capacity_set", dram_free=0, ssd_free=1000, ssd_cap=4096)
    winners = []
    for race in range(3):
        start_at = time.time() + 0.3
        for agent in (a, b):
            agent.send("reserve", target=3, medium=1, nbytes=800, start_at=start_at)
        replies = [a.reply(), b.reply()]
        assert all(r["ok"] for r in replies), replies
        won = [r for r in replies if r["reserved"]]
        assert len(won) == 1, f"race {race}: {replies}"
        assert t.must("reserved", target=3, medium=1)["bytes"] == 800
        assert a.must("reserve", target=3, medium=1, nbytes=201)["reserved"] is False  # 200 left
        assert a.must("reserve", target=3, medium=1, nbytes=200)["reserved"] is True
        holder = a if replies[0]["reserved"] else b
        winners.append(holder.i)
        holder.must("release", key=won[0]["key"])
        assert t.must("reserved", target=3, medium=1)["bytes"] == 200
        a.must("close")  # its lease goes: its 200-byte reservation with it
        assert t.must("reserved", target=3, medium=1)["bytes"] == 0
        _start(c, a, 1)
    print(f"\nCAS race winners over 3 races (node index): {winners}; "
          f"retries a/b: {a.must('stats')['stats']['cas_retries']}/{b.must('stats')['stats']['cas_retries']}")
    assert t.must("capacity_of", node=3)["capacity"] == {"dram_free": 0, "ssd_free": 1000}


def test_a_second_node_with_the_same_node_id_is_refused_naming_node_id(local_cluster, agents):
    c = local_cluster(2)
    a, dup = agents(c, [0, 1])
    _start(c, a, 4)
    out = dup.call("start", config=node_config(c.etcd_endpoint, 4), register_wait_s=0.5)
    assert out["ok"] is False
    assert out["error"].startswith("ConfigError: node_id: 4 is already registered")
    assert "cluster.node_id" in out["error"] and c.node_address(0) in out["error"]  # the holder's advertise
    assert _start(c, dup, 5)["ok"]  # the refused agent's lease was revoked; another id joins


def test_a_node_cut_off_past_its_lease_registers_again_and_republishes_its_rounds(local_cluster, agents):
    c = local_cluster(2)
    a, b = agents(c, [0, 1])
    _start(c, a, 1)
    _start(c, b, 2)
    live, gone = _publish(a, _round(1, 1, 0)), _publish(a, _round(1, 2, 0))
    a.must("retire", scope=2)
    keys = live["keys"]
    assert b.must("wait", keys=keys, timeout_s=WAIT_S)["done"]
    c.set_link(0, up=False)  # A cannot renew: etcd expires its 2 s lease and deletes its rounds
    assert b.must("wait", keys=keys, present=False, timeout_s=WAIT_S)["done"]
    c.set_link(0, up=True)
    assert b.must("wait", keys=keys, timeout_s=WAIT_S)["done"]  # A re-leased and republished
    _assert_view_has(b, [live], node=1)
    assert b.must("lookup", keys=gone["keys"][:1])["pages"] == [None]  # a retired scope stays retired
    st = a.must("stats")["stats"]
    assert st["leases_lost"] == 1 and st["evicted"] is False
