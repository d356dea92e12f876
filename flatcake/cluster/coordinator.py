"""Capacity coordinator (paper §3.1): per-node free DRAM/SSD bytes, and reservations of another
node's space by compare-and-swap. Off the read path: nothing here runs on a hit query.

Lifecycle::

    every node: publish its free bytes under its lease, every ``interval_s`` (a thread)
    a writer whose medium is full: reserve(target, medium, nbytes)
        snapshot (one read-only transaction): target's capacity record, the live reservations
            of that medium, the guard key's mod_revision
        free = published free - reserved by others; too little -> None
        commit (one transaction): if the guard's mod_revision is unchanged, bump the guard and
            put the reservation on the reserver's lease; else another reserver won: retry
    release(reservation) when the pages are written (the target's own free bytes then drop) or
    abandoned; a reserver that dies loses its reservations with its lease.

Two reservers that both saw the last free bytes commit against the same guard revision: etcd
applies one transaction first, the guard's revision moves, the second compare fails, and its
retry sees the first reservation — exactly one gets the space.
"""

from __future__ import annotations

import json
import logging
import secrets
import threading
import time
from dataclasses import dataclass
from typing import Callable, Optional

from flatcake.cluster.etcd import EtcdSession, b64, kvs_of, op_put, op_range
from flatcake.cluster.records import capacity_key, guard_key, reservations_prefix

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Capacity:
    """One node's space (bytes) as it published it.

    Attributes:
        node: node id.
        dram_free_bytes, ssd_free_bytes: free bytes per medium.
        dram_capacity_bytes, ssd_capacity_bytes: configured bytes per medium.
        published_s: the node's ``time.time()`` when it published.
    """

    node: int
    dram_free_bytes: int
    ssd_free_bytes: int
    dram_capacity_bytes: int = 0
    ssd_capacity_bytes: int = 0
    published_s: float = 0.0

    def free_bytes(self, medium: int) -> int:
        """Free bytes of ``medium`` (0 DRAM, 1 SSD)."""
        return self.dram_free_bytes if medium == 0 else self.ssd_free_bytes

    def encode(self) -> bytes:
        """JSON bytes (the etcd value)."""
        return json.dumps({"node": self.node, "dram_free": self.dram_free_bytes, "ssd_free": self.ssd_free_bytes,
                           "dram_cap": self.dram_capacity_bytes, "ssd_cap": self.ssd_capacity_bytes,
                           "t": self.published_s}).encode()

    @classmethod
    def decode(cls, raw: bytes) -> "Capacity":
        """Parse :meth:`encode`'s bytes (raises ValueError/KeyError on a bad record)."""
        d = json.loads(raw)
        return cls(int(d["node"]), int(d["dram_free"]), int(d["ssd_free"]), int(d["dram_cap"]),
                   int(d["ssd_cap"]), float(d["t"]))


@dataclass(frozen=True)
class Reservation:
    """Space reserved on another node's medium, held on the reserver's lease.

    Attributes:
        target: the node whose medium is reserved; medium: 0 DRAM / 1 SSD.
        nbytes: bytes reserved; key: the reservation's etcd key.
    """

    target: int
    medium: int
    nbytes: int
    key: str


class CapacityCoordinator:
    """Publishes this node's free bytes and reserves other nodes' space.

    Args:
        session: a dedicated :class:`EtcdSession`.
        prefix: cluster key prefix; node_id: this node's id.
        lease: callable returning the node's current lease id.
        capacity: callable returning this node's :class:`Capacity` now (called by the thread).
        interval_s: seconds between publications.
    """

    def __init__(self, session: EtcdSession, prefix: str, node_id: int, lease: Callable[[], int],
                 capacity: Callable[[], Capacity], interval_s: float = 1.0):
        self.session, self.prefix, self.node_id = session, prefix, node_id
        self.lease, self.capacity, self.interval_s = lease, capacity, interval_s
        self.cas_retries = 0
        self._last: Optional[bytes] = None
        self._stop = threading.Event()
        self._thread: Optional[threading.Thread] = None
        self._lock = threading.Lock()  # the session is shared by the thread and reserve()

    # publishing -------------------------------------------------------------------------------
    def publish(self) -> None:
        """Publish this node's capacity now (raises EtcdUnavailable when etcd does not answer)."""
        c = self.capacity()
        value = Capacity(self.node_id, c.dram_free_bytes, c.ssd_free_bytes, c.dram_capacity_bytes,
                         c.ssd_capacity_bytes, time.time()).encode()
        with self._lock:
            self.session.put(capacity_key(self.prefix, self.node_id), value, self.lease())
        self._last = value

    def start(self) -> None:
        """Publish once, then every ``interval_s`` seconds in a thread (errors logged once)."""
        self._thread = threading.Thread(target=self._run, name="flatcake-cluster-capacity", daemon=True)
        self._thread.start()

    def close(self) -> None:
        """Stop the publishing thread."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=self.session.timeout_s + 1)

    def _run(self) -> None:
        logged = False
        while not self._stop.is_set():
            try:
                self.publish()
                logged = False
            except Exception as e:
                if not logged:
                    logged = True
                    log.warning("cluster capacity: cannot publish (%s: %s); retrying", type(e).__name__, e)
            self._stop.wait(self.interval_s)

    # reading ----------------------------------------------------------------------------------
    def capacity_of(self, node: int) -> Optional[Capacity]:
        """``node``'s last published capacity, or None (not published, or its lease expired)."""
        with self._lock:
            raw = self.session.get(capacity_key(self.prefix, node))
        return None if raw is None else Capacity.decode(raw)

    def capacities(self) -> list[Capacity]:
        """Every node's last published capacity (one range read of ``P/capacity/``), in node
        order; undecodable records are skipped. Raises EtcdUnavailable when etcd does not answer."""
        with self._lock:
            _rev, kvs = self.session.range_prefix(f"{self.prefix}/capacity/")
        out = []
        for _k, v, _kv in kvs:
            try:
                out.append(Capacity.decode(v))
            except (ValueError, KeyError, TypeError):
                continue
        return out

    def reserved_bytes(self, target: int, medium: int) -> int:
        """Bytes of ``target``'s medium reserved now, by every node."""
        with self._lock:
            out = self.session.call("kv/range", op_range(reservations_prefix(self.prefix, target, medium), True)["request_range"])
        return sum(int(json.loads(v)["nbytes"]) for _, v, _ in kvs_of(out))

    # reserving --------------------------------------------------------------------------------
    def reserve(self, target: int, medium: int, nbytes: int, attempts: int = 50) -> Optional[Reservation]:
        """Reserve ``nbytes`` of ``target``'s ``medium`` if its published free bytes minus the
        live reservations cover them; compare-and-swap on the guard key, retried on conflict.

        Returns:
            The :class:`Reservation`, or None: not enough free space (or no capacity published).

        Raises:
            EtcdUnavailable: etcd did not answer.
            RuntimeError: still conflicting after ``attempts`` tries.
        """
        if nbytes <= 0:
            raise ValueError(f"nbytes must be > 0 (got {nbytes})")
        key = f"{reservations_prefix(self.prefix, target, medium)}{self.node_id:04d}-{secrets.token_hex(6)}"
        value = json.dumps({"node": self.node_id, "nbytes": nbytes, "t": time.time()}).encode()
        gkey = guard_key(self.prefix, target, medium)
        for _ in range(attempts):
            with self._lock:
                snap = self.session.txn([op_range(capacity_key(self.prefix, target)),
                                         op_range(reservations_prefix(self.prefix, target, medium), True),
                                         op_range(gkey)])
                cap_kvs, res_kvs, g_kvs = (kvs_of(r["response_range"]) for r in snap["responses"])
                if not cap_kvs:
                    return None
                free = Capacity.decode(cap_kvs[0][1]).free_bytes(medium)
                free -= sum(int(json.loads(v)["nbytes"]) for _, v, _ in res_kvs)
                if free < nbytes:
                    return None
                guard_rev = int(g_kvs[0][2]["mod_revision"]) if g_kvs else 0
                out = self.session.txn(
                    [op_put(gkey, key.encode()), op_put(key, value, self.lease())],
                    compare=[{"key": b64(gkey), "target": "MOD", "result": "EQUAL", "mod_revision": str(guard_rev)}])
            if out.get("succeeded"):
                return Reservation(target, medium, nbytes, key)
            self.cas_retries += 1
        raise RuntimeError(f"reservation on node {target} medium {medium}: still contended after {attempts} tries")

    def release(self, reservation: Reservation) -> None:
        """Give a reservation back (its bytes count as free again at once)."""
        with self._lock:
            self.session.call("kv/deleterange", {"key": b64(reservation.key)})

