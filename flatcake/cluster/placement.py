"""Write-time placement on another node's medium (paper §3.1, "capacity coordinator"; issue 12;
``docs/cluster.md``, "Write-time placement on another node").

When a put cannot place a round locally — the local policy (DRAM full -> SSD overflow, then
whole-scope reclaim of unpinned scopes) left no space for it, ``Backup`` asks :attr:`overflow
<flatcake.store.backup.Backup.overflow>` — the writer may place the round on another node::

    RemotePlacer.place(keys, src_pages, layout, parent)        SGLang's backup thread, no store lock
      keys all in the cluster view already?  -> True, nothing shipped
      targets: every node's published capacity (one etcd range read), not this node, with a
               data-plane descriptor that serves requests, most free bytes of the medium first
      reserve(target, SSD, bytes) by compare-and-swap   (CapacityCoordinator; None -> next target)
               (this node publishes its own capacity first, so other writers see it full)
      ship: gather the pages into the registered outbox, checksum them (xxh3-64 per chunk),
            ``store`` request to the target's owner server (flatcake.cluster.guest), which pulls
            them with the Transfer Engine, checks, stores them in its own PageStore and answers
            per page; rounds larger than the outbox go as several requests chained by parent key
      release the reservation (also on any failure); a target that answered but stored none of
               the round (its space went since it published) -> the next target; a target
               silent for remote_timeout_s -> the placement fails
    -> pages placed (all or 0: a round is placed whole or the put fails)

The medium reserved is SSD: a local placement fails only for SSD space (a round Table 2 sends to
DRAM falls back to SSD when DRAM is full). The target's own Table 2 places the round (a new
scope there: one-shot -> SSD, unless the session's earlier rounds are already its tail).

Bounded: one placement at a time per node (a second waits up to ``cluster.remote_timeout_s``);
each request's answer is awaited ``cluster.remote_timeout_s``; etcd calls
``cluster.timeout_s``. Never raises (a fault is a failed placement, counted, logged once).
"""

from __future__ import annotations

import base64
import json
import logging
import os
import threading
import time
from typing import Optional

from flatcake.common.align import align_up
from flatcake.cluster.etcd import EtcdSession
from flatcake.cluster.guest import STORE_VERB, STORED_VERB, GuestStore, geometry_message, pack_pages
from flatcake.cluster.peers import PeerDirectory
from flatcake.cluster.transfer import RegisteredBuffer
from flatcake.gva.address import MEDIUM_SSD
from flatcake.store.write_path import round_extent_bytes

log = logging.getLogger(__name__)


class RemotePlacer:
    """Places rounds this node cannot hold on other nodes (see the module docstring).

    Args:
        cfg: the node's ``cluster`` section (namespace prefix applied): ``etcd``, ``prefix``,
            ``timeout_s``, ``remote_timeout_s``, ``landing_bytes`` (the outbox's bytes).
        node_id: this node's id (never a target).
        coordinator: the node's :class:`~flatcake.cluster.coordinator.CapacityCoordinator`.
        index: the node's :class:`~flatcake.cluster.index.ClusterIndex` (the view).
        endpoint: the node's :class:`~flatcake.cluster.transfer.TransferEndpoint`.
        geometry: the store's :class:`~flatcake.common.layout.PageGeometry`.
        guest: this node's :class:`~flatcake.cluster.guest.GuestStore` (a guest round's put is
            never placed further).
    """

    def __init__(self, cfg, node_id: int, coordinator, index, endpoint, geometry, guest: GuestStore):
        import zmq

        self._zmq = zmq
        self.cfg, self.node_id, self.coordinator, self.index = cfg, node_id, coordinator, index
        self.endpoint, self.geometry, self.guest = endpoint, geometry, guest
        self.timeout_s = cfg.remote_timeout_s
        self.peers = PeerDirectory(EtcdSession(cfg.etcd, cfg.timeout_s), cfg.prefix)
        self._outbox: Optional[RegisteredBuffer] = None  # registered on the first placement
        self._lock = threading.Lock()  # one placement at a time (one outbox, one socket per target)
        self._socks: dict[str, object] = {}
        self._next_id = int.from_bytes(os.urandom(4), "little") << 16
        self._logged: set[str] = set()
        self.last_error = ""  # why the last shipment was short (logs)
        self._count_lock = threading.Lock()  # place() runs on any of SGLang's threads
        self.counters = {"no_space_rounds": 0, "remote_placed_pages": 0, "remote_placed_rounds": 0,
                         "remote_place_failures": 0, "remote_known_pages": 0,
                         "reservations": {"made": 0, "failed": 0}}

    # ------------------------------------------------------------------------------ entry point
    def place(self, keys: list, src_pages: list, layout, parent: Optional[str]) -> int:
        """Place one round (pages ``src_pages`` of ``layout``, keys ``keys``, after ``parent``) on
        another node. Returns ``len(keys)`` when every page is stored there (or already held by
        other nodes per the view), else 0 (counted in ``remote_place_failures``). Never raises."""
        if self.guest.storing():  # a guest round that does not fit here: no placement chains
            return 0
        n = len(keys)
        self._bump("no_space_rounds")
        try:
            if all(p is not None for p in self.index.lookup(keys)):
                self._bump("remote_known_pages", n)
                return n
            if not self._lock.acquire(timeout=self.timeout_s):
                return self._failed("another placement held the outbox for remote_timeout_s")
            try:
                done = self._place(keys, src_pages, layout, parent)
            finally:
                self._lock.release()
        except Exception as e:  # noqa: BLE001 - a failed placement is a failed put
            return self._failed(f"{type(e).__name__}: {e}")
        if done < n:
            return self._failed(self.last_error)
        self._bump("remote_placed_pages", n)
        self._bump("remote_placed_rounds")
        return n

    def _bump(self, key: str, k: int = 1, sub: Optional[str] = None) -> None:
        with self._count_lock:
            if sub is None:
                self.counters[key] += k
            else:
                self.counters[key][sub] += k

    def _failed(self, why: str) -> int:
        self._bump("remote_place_failures")
        kind = why.split(":")[0]
        if kind not in self._logged:
            self._logged.add(kind)
            log.warning("flatcake cluster: a round without local space could not be placed on another node "
                        "(%s); the put fails", why)
        return 0

    def need_bytes(self, n: int) -> int:
        """Bytes a target's SSD needs for a round of ``n`` pages shipped in outbox-sized parts:
        each part one round (header, layer-major data, record) in an extent of its own."""
        per = self.pages_per_shipment()
        return sum(round_extent_bytes(min(per, n - a), self.geometry) for a in range(0, n, per))

    def pages_per_shipment(self) -> int:
        """Pages one ``store`` request carries at most (the outbox's bytes / page bytes, >= 0)."""
        return self.cfg.landing_bytes // self.geometry.page_bytes

    def _place(self, keys, src_pages, layout, parent) -> int:
        if layout.device.type != "cpu":
            raise ValueError(f"pages on {layout.device}: placement ships from host memory only")
        if self.pages_per_shipment() < 1:
            raise ValueError(f"a {self.geometry.page_bytes}-byte page does not fit cluster.landing_bytes")
        try:
            self.coordinator.publish()  # this node's space as it is now: other writers skip it
        except Exception as e:  # noqa: BLE001 - the periodic publication catches up
            log.debug("capacity publication before a placement failed: %s", e)
        need, refused = self.need_bytes(len(keys)), []
        caps = [cap for cap in self.coordinator.capacities()
                if cap.node != self.node_id and cap.free_bytes(MEDIUM_SSD) >= need]
        for cap in sorted(caps, key=lambda x: -x.free_bytes(MEDIUM_SSD)):
            desc = self.peers.get(cap.node)
            if desc is None or not desc.ssd_rpc:
                continue
            res = self.coordinator.reserve(cap.node, MEDIUM_SSD, need)
            if res is None:  # another writer reserved that space first
                self._bump("reservations", sub="failed")
                continue
            self._bump("reservations", sub="made")
            try:
                done = self._ship(desc, keys, src_pages, layout, parent)
            finally:
                try:
                    self.coordinator.release(res)
                except Exception as e:  # noqa: BLE001 - it ends with our lease otherwise
                    log.warning("flatcake cluster: releasing a reservation on node %d failed (%s)", cap.node, e)
            if done:
                return done
            refused.append(self.last_error)  # it took none (its space went since it published): next
        raise LookupError(f"no node with a data plane took {need} SSD bytes" + (f" ({'; '.join(refused)})" if refused else ""))

    # ------------------------------------------------------------------------------ shipping
    def _ship(self, desc, keys, src_pages, layout, parent) -> int:
        """Send the round in outbox-sized parts; returns the pages the target stored (a leading run)."""
        g, per, done = self.geometry, self.pages_per_shipment(), 0
        if self._outbox is None:
            self._outbox = RegisteredBuffer(self.endpoint, align_up(per * g.page_bytes))
        for a in range(0, len(keys), per):
            part, src = keys[a: a + per], src_pages[a: a + per]
            m = len(part)
            sums = pack_pages(layout, src, g, self._outbox.array)
            self._next_id += 1
            body = {"id": self._next_id, "te": self.endpoint.address, "addr": self._outbox.addr, "keys": part,
                    "prefix": [parent] if parent else [], "geometry": geometry_message(g),
                    "sums": base64.b64encode(sums.astype("<u8").tobytes()).decode()}
            ok, why = self._request(desc.ssd_rpc, body)
            h = next((i for i, x in enumerate(ok) if not x), m)
            done += h
            if h < m:
                self.last_error = f"node {desc.node} stored {done} of {len(keys)} pages: {why or 'its put failed'}"
                return done
            parent = part[-1]
        return done

    def _request(self, url: str, body: dict) -> tuple[list, str]:
        """Send one ``store`` request; the per-page answer and the target's error text ('' if
        none). Raises TimeoutError after ``remote_timeout_s`` of silence (the socket is dropped:
        a late answer is never taken for a later request), RuntimeError on an ``error`` answer."""
        sock = self._socks.get(url)
        if sock is None:
            sock = self._socks[url] = self._zmq.Context.instance().socket(self._zmq.DEALER)
            sock.setsockopt(self._zmq.LINGER, 0)
            sock.connect(url)
        sock.send_multipart([STORE_VERB.encode(), json.dumps(body).encode()])
        deadline = time.monotonic() + self.timeout_s
        while True:
            left = deadline - time.monotonic()
            if left <= 0 or not sock.poll(max(1, int(left * 1000))):
                self._socks.pop(url).close(0)
                raise TimeoutError(f"no answer from {url} within {self.timeout_s} s")
            verb, raw = sock.recv_multipart()
            msg = json.loads(raw)
            if msg.get("id") != body["id"]:
                continue
            if verb.decode() != STORED_VERB:
                raise RuntimeError(f"{url} answered {verb.decode()}: {msg.get('error')}")
            ok = [bool(x) for x in msg.get("ok", [])]
            return ok + [False] * (len(body["keys"]) - len(ok)), str(msg.get("error") or "")

    def stats(self) -> dict:
        """Cumulative counters: ``no_space_rounds`` (rounds the local policy could not place),
        ``remote_placed_pages`` / ``remote_placed_rounds``, ``remote_place_failures`` (rounds),
        ``remote_known_pages`` (pages other nodes held already), ``reservations``
        ``{"made", "failed"}``, and this node's guest counters (:class:`GuestStore`)."""
        with self._count_lock:
            out = {k: (dict(v) if isinstance(v, dict) else v) for k, v in self.counters.items()}
        out.update(self.guest.counters)
        return out

    def close(self) -> None:
        """Close the sockets (the outbox is unregistered with the endpoint). Never raises."""
        with self._lock:
            for s in self._socks.values():
                s.close(0)
            self._socks.clear()


def start_placement(member) -> RemotePlacer:
    """Wire write-time placement into a started :class:`~flatcake.cluster.member.ClusterMember`:
    the ``store`` verb on its owner server (this node takes other nodes' rounds) and the store's
    overflow (this node places rounds it cannot hold). Returns the placer (``stats``, ``close``).

    Raises:
        ValueError: the member's data plane serves no SSD (no owner server to take requests on).
    """
    plane, cfg = member.plane, member.cluster_cfg
    if plane.server is None:
        raise ValueError("write-time placement needs the data plane's owner server (an SSD pool)")
    guest = GuestStore(member.store, plane.endpoint, align_up(cfg.landing_bytes), member.node_id,
                       after_store=member.node.coordinator.publish)
    plane.server.add_handler(STORE_VERB, guest.handle)
    placer = RemotePlacer(cfg, member.node_id, member.node.coordinator, member.node.index, plane.endpoint,
                          member.store.geometry, guest)
    member.store.backup.overflow = placer.place
    return placer


def stop_placement(member, placer: Optional[RemotePlacer]) -> None:
    """Undo :func:`start_placement` on the store's side and close the placer; never raises."""
    if placer is None:
        return
    try:
        member.store.backup.overflow = None
        placer.close()
    except Exception as e:  # noqa: BLE001
        log.warning("flatcake cluster: closing placement: %s", e)
