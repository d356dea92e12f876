"""The data plane across network namespaces: node B reads node A's DRAM and SSD pages through the
Mooncake Transfer Engine, found through the replicated index on a real etcd (skipped with the
reason when the machine cannot make namespaces, has no etcd, or the Mooncake wheel cannot load).

No timed assertions: every wait is bounded by a generous guard that turns a hang into a failure."""

from __future__ import annotations

import base64
import os
import time

import pytest

pytest.importorskip("etcd3gw", reason="the cluster extra (etcd3gw) is not installed")
pytest.importorskip("zmq", reason="pyzmq is not installed")

from flatcake.cluster.agent import node_config  # noqa: E402
from flatcake.cluster.dataplane_agent import DataPlaneClient, page_data  # noqa: E402
from flatcake.cluster.netns import LocalCluster, leftover_namespaces, unavailable_reason  # noqa: E402
from flatcake.cluster.transfer import te_unavailable_reason  # noqa: E402

LAYERS, CHUNK = 4, 4096
PAGE = LAYERS * CHUNK
SLOT = 64 << 10  # 4 pages' chunks of one layer per staging slot: a 16-page SSD read is 8+ pieces


def _skip_reason():
    return unavailable_reason() or te_unavailable_reason()


def _start(cluster, root, ttl_s=10):
    """Two data-plane nodes (node ids 1 and 2) in their namespaces, both started."""
    nodes = [DataPlaneClient(cluster, i) for i in range(2)]
    plane = {"cluster.staging_slot_bytes": SLOT, "cluster.landing_bytes": 1 << 20, "cluster.remote_timeout_s": 1.0}
    for i, n in enumerate(nodes):
        cfg = node_config(cluster.etcd_endpoint, i + 1, ttl_s=ttl_s, advertise=f"{cluster.node_address(i)}:5601",
                          extra=plane)
        n.send("start", config=cfg, layers=LAYERS, chunk_bytes=CHUNK, dram_pages=64, ssd_dir=str(root))
    for n in nodes:
        out = n.reply()
        assert out["ok"], out
    return nodes


def _keys(tag, n):
    return [f"{tag}{i:03d}".ljust(64, "p") for i in range(n)]


def _data(reply, i):
    return base64.b64decode(reply["data"][i])


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    """(cluster, [A, B]) shared by the tests of this module, in file order (one cluster start; the
    last test kills A); torn down with a check that no namespace or /dev/shm directory is left."""
    reason = _skip_reason()
    if reason:
        pytest.skip(reason)
    root = tmp_path_factory.mktemp("dp")
    cluster = LocalCluster(2).start()
    try:
        yield cluster, _start(cluster, root)
    finally:
        cluster.close()
    assert leftover_namespaces(cluster.name) == []
    assert not os.path.exists(cluster.data_root)


def test_pages_in_a_dram_read_bit_exact_from_b_through_the_transfer_engine(pair):
    cluster, (a, b) = pair
    keys = _keys("dram", 24)
    a.must("write_dram", scope=1, seq=0, keys=keys[:16], seed=11)
    a.must("write_dram", scope=1, seq=1, keys=keys[16:], seed=11)
    assert b.must("wait", keys=keys)["done"]
    got = b.must("read", keys=keys, data=True)
    assert got["hit"] == [True] * 24
    assert got["bytes"] == 24 * PAGE
    assert [_data(got, i) for i in range(24)] == [page_data(11, k, PAGE).tobytes() for k in keys]
    assert got["misses"]["mismatch"] == got["misses"]["failed"] == 0


def test_pages_in_a_ssd_read_bit_exact_from_b_through_the_owner_and_the_transfer_engine(pair):
    cluster, (a, b) = pair
    keys = _keys("ssd", 20)
    a.must("write_ssd", scope=2, seq=0, keys=keys[:12], seed=12)  # layer-major rounds of 12 and 8 pages
    a.must("write_ssd", scope=2, seq=1, keys=keys[12:], seed=12)
    assert b.must("wait", keys=keys)["done"]
    before = a.must("stats")["pieces_served"]
    got = b.must("read", keys=keys[::-1], data=True)  # any order: the owner sorts and merges
    assert got["hit"] == [True] * 20
    assert [_data(got, i) for i in range(20)] == [page_data(12, k, PAGE).tobytes() for k in keys[::-1]]
    # 20 pages x 4 layers x 4 KiB = 320 KiB, contiguous in the file: 5 full 64 KiB slots
    assert a.must("stats")["pieces_served"] - before == 5


def test_a_page_overwritten_on_a_after_b_looked_it_up_is_a_miss_never_the_new_bytes(pair):
    cluster, (a, b) = pair
    keys = _keys("reuse", 8)
    a.must("write_dram", scope=3, seq=0, keys=keys, seed=21)
    assert b.must("wait", keys=keys)["done"]
    handle = b.must("resolve", keys=keys)["handle"]  # B holds the records (GVAs, checksums)
    a.must("overwrite_dram", keys=keys[2:5], seed=22)  # the slots reclaimed and reused under B
    got = b.must("read", handle=handle, data=True)
    assert got["hit"] == [True, True, False, False, False, True, True, True]
    assert got["misses"]["mismatch"] == 3
    assert [got["data"][i] for i in (2, 3, 4)] == [None, None, None]
    assert [_data(got, i) for i in (0, 1, 5, 6, 7)] == [page_data(21, keys[i], PAGE).tobytes() for i in (0, 1, 5, 6, 7)]


def test_slots_rewritten_on_a_while_b_reads_them_give_the_published_bytes_or_misses_never_others(pair):
    cluster, (a, b) = pair
    keys = _keys("churn", 8)
    a.must("write_dram", scope=8, seq=0, keys=keys, seed=51)
    assert b.must("wait", keys=keys)["done"]
    handle = b.must("resolve", keys=keys)["handle"]
    a.must("churn_dram", keys=keys, seed=51, other_seed=52, seconds=2.0)
    want = [page_data(51, k, PAGE).tobytes() for k in keys]
    hits = mismatches = 0
    for _ in range(30):
        got = b.must("read", handle=handle, data=True)
        for i, h in enumerate(got["hit"]):
            if h:
                assert _data(got, i) == want[i]  # whole and the published version, never torn or new
        hits += sum(got["hit"])
        mismatches += got["misses"]["mismatch"]
        assert sum(got["hit"]) + got["misses"]["mismatch"] == 8
    print(f"\n30 reads of 8 pages under rewrites: {hits} hits (published bytes), {mismatches} mismatches (misses)")
    assert mismatches > 0  # the rewrites did land under the reads


def test_a_cut_off_gives_b_misses_within_the_timeouts_and_reads_resume_after_the_link_heals(pair):
    cluster, (a, b) = pair
    dram, ssd = _keys("cutd", 8), _keys("cuts", 8)
    a.must("write_dram", scope=6, seq=0, keys=dram, seed=41)
    a.must("write_ssd", scope=7, seq=0, keys=ssd, seed=42)
    assert b.must("wait", keys=dram + ssd)["done"]
    hd, hs = b.must("resolve", keys=dram)["handle"], b.must("resolve", keys=ssd)["handle"]
    assert all(b.must("read", handle=hd)["hit"]) and all(b.must("read", handle=hs)["hit"])
    cluster.set_link(0, False)  # no reset: packets to A vanish (A's 10 s lease outlives the reads)
    try:
        # bounded by the SSD reader's timeout_s (1 s) and the engine's transfer timeout (5 s)
        cut_ssd = b.must("read", handle=hs, limit_s=60)
        cut_dram = b.must("read", handle=hd, limit_s=60)
    finally:
        cluster.set_link(0, True)
    assert cut_ssd["hit"] == [False] * 8 and cut_ssd["misses"]["timeout"] == 8
    assert cut_dram["hit"] == [False] * 8 and cut_dram["misses"]["failed"] == 8
    # healed: A renews its lease (or, if it expired, registers again and republishes); B reads again
    guard = time.monotonic() + 60
    while True:
        got = b.must("read", keys=dram + ssd, data=True)
        if all(got["hit"]) or time.monotonic() > guard:
            break
        time.sleep(0.2)
    assert got["hit"] == [True] * 16
    assert [_data(got, i) for i in range(16)] == \
        [page_data(41, k, PAGE).tobytes() for k in dram] + [page_data(42, k, PAGE).tobytes() for k in ssd]


def test_a_killed_mid_read_gives_b_misses_for_the_unread_pages_and_nothing_raises(pair):
    # the last test of the module: it kills the pair's node A
    cluster, (a, b) = pair
    rounds = [_keys(f"r{r}x", 4) for r in range(6)]  # 6 rounds of 4 pages: one 64 KiB piece each
    for r, keys in enumerate(rounds):
        a.must("write_ssd", scope=4, seq=r, keys=keys, seed=31)
    dram = _keys("kd", 8)
    a.must("write_dram", scope=5, seq=0, keys=dram, seed=32)
    every = [k for keys in rounds for k in keys]
    assert b.must("wait", keys=every + dram)["done"]
    hd = b.must("resolve", keys=dram)["handle"]
    a.must("set_piece_delay", seconds=0.5)  # a slow disk: the kill lands mid-read
    served = a.must("stats")["pieces_served"]
    b.send("read", keys=every, data=True)
    # piece 2 is read only after B pulled piece 0 and released its slot: round 0 is in B's hands
    guard = time.monotonic() + 60
    while a.must("stats")["pieces_served"] < served + 3 and time.monotonic() < guard:
        time.sleep(0.02)
    a.proc.kill()
    a.proc.wait()
    got = b.reply()
    assert got["ok"], got
    hits = got["hit"]
    assert hits[:4] == [True] * 4 and not all(hits)
    # B was waiting for A's next piece (timeout) or, rarely, pulling one (failed transfer)
    assert got["misses"]["timeout"] + got["misses"]["failed"] == hits.count(False)
    assert [_data(got, i) for i in range(24) if hits[i]] == \
        [page_data(31, k, PAGE).tobytes() for i, k in enumerate(every) if hits[i]]
    # A's DRAM pages, resolved before the kill: the transfer is refused at once (failed); or A is
    # already suspended (a pull of the SSD read above failed); or its descriptor lookup, redone
    # after that read's timeout, did not answer in time (unknown_owner): misses in every case
    late = b.must("read", handle=hd)
    assert late["hit"] == [False] * 8
    m = late["misses"]
    assert m["failed"] + m.get("suspended", 0) + m["unknown_owner"] == 8, f"{m} after {got['misses']}"
