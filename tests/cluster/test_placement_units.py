"""Write-time placement without a network: the store's overflow hook (a round no local space
holds is offered to it; its answer is the put's), the shipment format (``pack_pages`` /
``chunk_layout``), and the target's ``store`` handler (:class:`GuestStore`) with an in-process
stand-in for the Transfer Engine — verified pages stored as the target's own, bit-exact, a
corrupted page and everything after it refused. ``docs/cluster.md``, "Write-time placement"."""

from __future__ import annotations

import base64
import ctypes
import tempfile

import numpy as np
import pytest

from flatcake_testkit import fill_page, make_store, page_matches, put_pages

pytest.importorskip("zmq", reason="pyzmq is not installed")

from flatcake.cluster.guest import GuestStore, geometry_message, pack_pages  # noqa: E402
from flatcake.gva.address import node_of  # noqa: E402

FULL = {"ssd.file_bytes": 307200, "ssd.max_files": 1}  # two 64-page rounds of 3 layers, not three


class MemoryEndpoint:
    """In-process stand-in for a TransferEndpoint: registration is a no-op, a read a memmove."""

    address = "local:0"

    def __init__(self):
        self.reads = 0

    def register(self, addr, nbytes):
        pass

    def read(self, peer, local, remote, lengths):
        self.reads += 1
        for lo, re, n in zip(local, remote, lengths):
            ctypes.memmove(lo, re, n)
        return True


def _keys(tag, n):
    return [f"{tag}{i:03d}".ljust(64, "k") for i in range(n)]


def _fill_and_pin(store, pool, lay):
    """Put 64-page rounds, then 1-page rounds, pinning each (a reader in progress), until one
    fails for lack of space."""
    held, i = [], 0
    for size in (64, 1):
        while True:
            keys = _keys(f"fill{i}-", size)
            ok = put_pages(store, pool, lay, keys, range(size))
            assert store.flush_writes()  # written and published: pinnable
            held += store.scopes.pin_leading_run(keys)
            i += 1
            if not all(ok):
                break
    return held


def test_a_round_without_local_space_goes_to_the_overflow_and_its_answer_is_the_puts():
    with tempfile.TemporaryDirectory() as d:
        store, pool, lay = make_store(d, **FULL)
        try:
            assert store.backup.overflow is None  # a store without a cluster never tries
            held = _fill_and_pin(store, pool, lay)
            fails = store.snapshot_stats()["put_failures"]
            asked = []

            def overflow(keys, src_pages, layout, parent):
                asked.append((list(keys), list(src_pages), parent))
                return len(keys)

            store.backup.overflow = overflow
            keys = _keys("over", 8)
            assert put_pages(store, pool, lay, keys, range(8, 16), prefix=["p0", "p1"]) == [True] * 8
            assert asked == [(keys, list(range(8, 16)), "p1")]
            assert store.snapshot_stats()["put_failures"] == fails
            assert store.medium_of(keys[0]) is None  # not stored here

            store.backup.overflow = lambda *a: 0  # the placement failed
            assert put_pages(store, pool, lay, _keys("fail", 4), range(4)) == [False] * 4

            def broken(*a):
                raise RuntimeError("placement bug")

            store.backup.overflow = broken  # never raises into the caller
            assert put_pages(store, pool, lay, _keys("boom", 4), range(4)) == [False] * 4
            assert store.snapshot_stats()["put_failures"] == fails + 2

            store.scopes.unpin(held)
            store.backup.overflow = None
            assert put_pages(store, pool, lay, _keys("room", 4), range(4)) == [True] * 4  # reclaim works again
        finally:
            store.close()


def _shipment(store_w, pool_w, lay_w, keys):
    """Pack ``keys`` (host pages 0..n-1 of the writer's pool) into an outbox; the request body."""
    g = lay_w.geometry
    for i, k in enumerate(keys):
        fill_page(pool_w, i * pool_w.page_size, k)
    outbox = np.zeros(len(keys) * g.page_bytes, dtype=np.uint8)
    sums = pack_pages(lay_w, list(range(len(keys))), g, outbox)
    body = {"id": 7, "te": "w:1", "addr": int(outbox.ctypes.data), "keys": keys, "prefix": [],
            "geometry": geometry_message(g), "sums": base64.b64encode(sums.astype("<u8").tobytes()).decode()}
    return outbox, body


def test_the_target_stores_verified_pages_as_its_own_and_refuses_a_corrupted_run():
    with tempfile.TemporaryDirectory() as dw, tempfile.TemporaryDirectory() as dt:
        w, pool_w, lay_w = make_store(dw)
        t, pool_t, lay_t = make_store(dt, node_id=5)
        published = []
        t.add_publish_listener(lambda plc, entries: published.extend(e.gva for e in entries))
        try:
            ep, after = MemoryEndpoint(), []
            guest = GuestStore(t, ep, 1 << 20, 5, after_store=lambda: after.append(1))
            keys = _keys("ship", 12)
            outbox, body = _shipment(w, pool_w, lay_w, keys)
            verb, out = guest.handle(body)
            assert (verb, out) == ("stored", {"id": 7, "ok": [True] * 12, "node": 5})
            assert after == [1] and guest.counters["guest_pages_stored"] == 12
            assert t.flush_writes()
            assert [node_of(g) for g in published] == [5] * 12  # the target owns them
            for i in range(12):
                fill_page(pool_t, i * pool_t.page_size, "zero")
            assert t.get(keys, lay_t, list(range(12))) == [True] * 12
            assert all(page_matches(pool_t, i * pool_t.page_size, k) for i, k in enumerate(keys))

            keys2 = _keys("torn", 6)
            outbox, body = _shipment(w, pool_w, lay_w, keys2)
            outbox[3 * lay_w.geometry.page_bytes + 100] ^= 0xFF  # page 3 changed after its checksum
            verb, out = guest.handle({**body, "id": 8})
            assert out["ok"] == [True] * 3 + [False] * 3 and "checksum mismatch from page 3" in out["error"]
            assert guest.counters == {"guest_pages_stored": 15, "guest_rounds": 2, "guest_failures": 0}

            verb, out = guest.handle({**body, "id": 9, "geometry": [1, 2, [3]]})
            assert out["ok"] == [False] * 6 and "geometry" in out["error"]
            verb, out = guest.handle({"id": 10, "keys": ["x"]})  # malformed: answered, never raised
            assert out["ok"] == [False] and out["error"]
            assert guest.counters["guest_failures"] == 2
        finally:
            w.close()
            t.close()


NO_CLUSTER = r"""
import json, shutil, sys, tempfile
import torch
from flatcake.adapter.host_pool import MHAHostPoolDouble
from flatcake.adapter.storage import FlatCakeStorage
from flatcake.config import FLATCAKE_EXTRA
from flatcake.replay.systems import storage_config

d = tempfile.mkdtemp(prefix="fc-noplace-")
try:
    pool = MHAHostPoolDouble(size=256, page_size=4, layer_num=3, head_num=2, head_dim=16, dtype=torch.bfloat16)
    be = FlatCakeStorage(storage_config({**FLATCAKE_EXTRA, "ssd.path": d, "ssd.file_bytes": 307200,
                                         "ssd.max_files": 1, "dram.capacity_bytes": 0}))
    be.register_mem_pool_host(pool)
    held, results = [], []
    for r, size in enumerate([64] * 6 + [1] * 4):  # fill, pinning every stored scope, past full
        keys = [f"r{r}-{i:03d}".ljust(64, "k") for i in range(size)]
        results.append(all(be.batch_set_v1(keys, torch.arange(size * 4, dtype=torch.int64))))
        be.store.flush_writes()
        held += be.store.scopes.pin_leading_run(keys)
    stats = be.flatcake_stats()
    out = {"results": results, "overflow": be.store.backup.overflow is not None, "cluster_stats": "cluster" in stats,
           "failures": stats["put_failures"],
           "imported": sorted(m for m in sys.modules if m.startswith("flatcake.cluster"))}
    be.store.scopes.unpin(held)
    be.close()
    print(json.dumps(out))
finally:
    shutil.rmtree(d, ignore_errors=True)
"""


def test_a_full_node_without_a_cluster_never_tries_to_place_elsewhere():
    import json
    import subprocess
    import sys

    out = subprocess.run([sys.executable, "-c", NO_CLUSTER], capture_output=True, text=True, timeout=300, check=True)
    got = json.loads(out.stdout.strip().splitlines()[-1])
    n_ok = got["results"].index(False)
    assert got["results"] == [True] * n_ok + [False] * (10 - n_ok) and n_ok >= 2
    assert got["failures"] == 10 - n_ok
    assert (got["overflow"], got["cluster_stats"], got["imported"]) == (False, False, [])
