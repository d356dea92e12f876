"""A cluster member: registration, the node lease, the replicated index and the coordinator.

Lifecycle::

    ClusterNode(cfg).start()
        grant a lease (cluster.lease_ttl_s)
        register P/nodes/<node_id> on it, only if absent (a live node with the same node_id
            -> wait one TTL for it to expire, then ConfigError naming node_id)
        keepalive thread: renew every TTL/3; a lease found expired (etcd lost it, or we were
            cut off longer than the TTL) -> new lease, register again, republish every record,
            the view reads the index again
        the view read the index again (a compacted revision, a store that lost state) -> the
            keepalive thread wakes at once: renew (or re-lease as above), republish every record
        index (publisher + view) and coordinator start
    close(): stop the threads, revoke the lease (every record of this node vanishes at once);
        ``close(revoke=False)`` leaves them to expire with the lease (what a crash does)

The cluster node id is the top-level ``node_id`` — the GVA node field of every address this node
allocates — so a GVA read from another node's record names its owner directly.
"""

from __future__ import annotations

import json
import logging
import os
import socket
import threading
import time
from typing import Callable, Optional

from flatcake.cluster.coordinator import Capacity, CapacityCoordinator
from flatcake.cluster.etcd import EtcdSession, EtcdUnavailable
from flatcake.cluster.index import ClusterIndex
from flatcake.cluster.records import node_key
from flatcake.config import ClusterConfig, ConfigError

log = logging.getLogger(__name__)


class ClusterNode:
    """This node's membership in the cluster.

    Args:
        cluster: the ``cluster`` section (``cluster.etcd`` must list an endpoint).
        node_id: the node's id (``node_id``, 0..4095).
        capacity: callable returning this node's free bytes (:class:`Capacity`); None
            publishes zeros (a node that offers no space to others).

    Raises:
        ConfigError: ``cluster.etcd`` is empty.
    """

    def __init__(self, cluster: ClusterConfig, node_id: int, capacity: Optional[Callable[[], Capacity]] = None):
        if not cluster.enabled:
            raise ConfigError("cluster.etcd: no endpoint; a node without a cluster needs no ClusterNode")
        self.cfg = cluster
        self.node_id = node_id
        self.session = EtcdSession(cluster.etcd, cluster.timeout_s)
        self._lease = 0
        self.lease_renewals = 0
        self.leases_lost = 0
        self.evicted = False  # our node_id was taken while our lease was lost: no longer publishing
        self._stop = threading.Event()
        self._wake = threading.Event()  # the view read the index again: check the lease, republish
        self._thread: Optional[threading.Thread] = None
        self.index = ClusterIndex(cluster.etcd, cluster.prefix, node_id, self.lease_id, cluster.timeout_s,
                                  cluster.watch_idle_s, on_reread=self._wake.set)
        cap = capacity or (lambda: Capacity(node_id, 0, 0))
        self.coordinator = CapacityCoordinator(EtcdSession(cluster.etcd, cluster.timeout_s), cluster.prefix,
                                               node_id, self.lease_id, cap, cluster.capacity_interval_s)

    def lease_id(self) -> int:
        """The node's current lease id (changes only after a lost lease)."""
        return self._lease

    def registration(self) -> bytes:
        """The value of ``P/nodes/<node_id>``: JSON with node, advertise, host, pid, started_s."""
        return json.dumps({"node": self.node_id, "advertise": self.cfg.advertise, "host": socket.gethostname(),
                           "pid": os.getpid(), "started_s": time.time()}).encode()

    def start(self, register_wait_s: Optional[float] = None) -> "ClusterNode":
        """Join the cluster (see the module docstring).

        Args:
            register_wait_s: how long a taken ``node_id`` may take to free up (a restarted node's
                old lease expiring); None = one lease TTL plus one second.

        Raises:
            ConfigError: ``node_id`` is registered by a live node (the message names it).
            EtcdUnavailable: no etcd endpoint answered.
        """
        try:
            self._lease = self.session.grant_lease(self.cfg.lease_ttl_s)
        except EtcdUnavailable as e:
            raise EtcdUnavailable(f"cluster.etcd: no endpoint of {self.cfg.etcd} answered at start-up ({e})") from None
        try:
            self._register(self.cfg.lease_ttl_s + 1.0 if register_wait_s is None else register_wait_s)
        except BaseException:
            self._revoke_quietly()
            raise
        self._thread = threading.Thread(target=self._keepalive, name="flatcake-cluster-lease", daemon=True)
        self._thread.start()
        self.index.start(bootstrap_timeout_s=10 * self.cfg.timeout_s)
        self.coordinator.start()
        return self

    def _register(self, wait_s: float) -> None:
        key = node_key(self.cfg.prefix, self.node_id)
        deadline = time.monotonic() + wait_s
        while True:
            created, holder = self.session.create(key, self.registration(), self._lease)
            if created:
                return
            if self._is_mine(holder):  # our own registration on a lease we lost (an older snapshot
                self.session.put(key, self.registration(), self._lease)  # brought it back): take it over
                return
            if time.monotonic() >= deadline:
                raise ConfigError(
                    f"node_id: {self.node_id} is already registered in the cluster at {self.cfg.etcd[0]} "
                    f"({key}: {holder.decode(errors='replace') if holder else '?'}); every node needs its own "
                    "node_id (the cluster node id, cluster.node_id, is the top-level node_id: the GVA node field)")
            time.sleep(min(0.2, max(0.0, deadline - time.monotonic())))

    def _is_mine(self, registration: Optional[bytes]) -> bool:
        """Whether ``registration`` (a ``P/nodes/<node_id>`` value) was written by this process."""
        try:
            d = json.loads(registration or b"")
        except ValueError:
            return False
        return (isinstance(d, dict) and d.get("node") == self.node_id and d.get("host") == socket.gethostname()
                and d.get("pid") == os.getpid())

    def _keepalive(self) -> None:
        period = self.cfg.lease_ttl_s / 3.0
        logged, republish = False, False
        while not self._stop.is_set():
            republish = self._wake.wait(period) or republish
            self._wake.clear()
            if self._stop.is_set():
                return
            try:
                ttl = self.session.keepalive(self._lease)
                if ttl > 0:
                    self.lease_renewals += 1
                    logged = False
                    if republish:  # the view read the index again: the store may have lost our records
                        self.index.publisher.republish_all()
                    republish = False
                    continue
                self._lease_lost()
                republish = False
            except Exception as e:  # EtcdUnavailable, a refused call, or our id taken meanwhile
                if not logged:
                    logged = True
                    log.warning("cluster node %d: lease renewal failed (%s: %s); retrying", self.node_id,
                                type(e).__name__, e)

    def _lease_lost(self) -> None:
        """The lease expired under us: every record of ours is gone from etcd. New lease,
        register again (failing only if another node took our id meanwhile), republish."""
        self.leases_lost += 1
        log.warning("cluster node %d: lease %x expired; registering again and republishing", self.node_id, self._lease)
        self._lease = self.session.grant_lease(self.cfg.lease_ttl_s)
        try:
            self._register(0.0)
        except ConfigError as e:  # another node took our id while we were away: stop publishing
            self.evicted = True
            log.error("cluster node %d: %s; this node stops publishing to the cluster", self.node_id, e)
            self.index.publisher.close()
            self.coordinator.close()
            self._revoke_quietly()
            self._stop.set()
            return
        self.index.publisher.republish_all()
        self.index.view.request_reread()  # the store may have lost state without going back in revision
        self.coordinator.publish()

    def _revoke_quietly(self) -> None:
        try:
            self.session.revoke(self._lease)
        except Exception as e:
            log.info("cluster node %d: lease revoke failed (%s); it expires by itself", self.node_id, e)

    def close(self, revoke: bool = True, flush_s: float = 1.0) -> None:
        """Leave the cluster: stop the threads (after trying to publish what is queued for
        ``flush_s`` seconds) and revoke the lease (``revoke=False``: let it expire)."""
        self._stop.set()
        self._wake.set()
        if self._thread is not None:
            self._thread.join(timeout=self.cfg.timeout_s + 1)
        self.coordinator.close()
        self.index.close(flush_s if revoke else 0.0)
        if revoke:
            self._revoke_quietly()

    def stats(self) -> dict:
        """:meth:`ClusterIndex.stats` plus ``lease_renewals``, ``leases_lost``, ``evicted``,
        ``cas_retries``."""
        return {**self.index.stats(), "lease_renewals": self.lease_renewals, "leases_lost": self.leases_lost,
                "evicted": self.evicted, "cas_retries": self.coordinator.cas_retries}
