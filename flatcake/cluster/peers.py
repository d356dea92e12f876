"""Where the other nodes' data planes are: the ``P/dataplane/<node>`` descriptors in etcd.

* Owner side, :class:`DescriptorKeeper`: keeps this node's descriptor on its *current* lease. A
  node that lost its lease (cut off longer than the TTL) gets a new one and republishes its
  rounds (:mod:`flatcake.cluster.node`); the keeper notices the new lease id and puts the
  descriptor again, so its pages are readable again, not just visible.
* Reader side, :class:`PeerDirectory`: descriptors looked up once and cached; a read that failed
  (owner gone, restarted with another Transfer Engine port or region) drops the cached one, and
  the next read looks it up again; a node found without a descriptor is not looked up again for
  ``retry_s`` seconds, so a dead owner does not turn every read into an etcd request. Lookups happen on the read path only after the
  hit query said "another node has it", never for a hit query itself.
"""

from __future__ import annotations

import logging
import threading
import time
from typing import Callable, Optional

from flatcake.cluster.transfer import DataPlaneDescriptor, descriptor_key, lookup_descriptor, publish_descriptor

log = logging.getLogger(__name__)

#: first back-off (seconds) after a failed transfer from a node; doubled per failure up to SUSPEND_MAX_S
SUSPEND_MIN_S = 2.0
SUSPEND_MAX_S = 60.0


class DescriptorKeeper:
    """Publishes ``desc`` on the node's lease now and again whenever the lease id changes or the
    key is gone (checked every ``interval_s`` seconds, on its own thread).

    Args:
        session: an :class:`~flatcake.cluster.etcd.EtcdSession` for this thread's use only.
        prefix: ``cluster.prefix``; desc: this node's descriptor.
        lease: callable returning the node's current lease id (``ClusterNode.lease_id``).
        interval_s: seconds between checks.
    """

    def __init__(self, session, prefix: str, desc: DataPlaneDescriptor, lease: Callable[[], int],
                 interval_s: float = 1.0):
        self.session, self.prefix, self.desc, self.lease = session, prefix, desc, lease
        self.interval_s = interval_s
        self._published_on = 0
        self.publications = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="flatcake-dataplane-desc", daemon=True)
        self._logged = False

    def start(self) -> "DescriptorKeeper":
        """Publish now (raises EtcdUnavailable when etcd does not answer) and keep it published."""
        self.check()
        self._thread.start()
        return self

    def close(self) -> None:
        """Stop checking (the key goes with the lease)."""
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(timeout=self.interval_s + 5)

    def check(self) -> None:
        """Publish the descriptor if the lease changed or its key is gone (the thread does this every
        ``interval_s``). Raises EtcdUnavailable when etcd does not answer."""
        lease = self.lease()
        if lease == self._published_on and self.session.get(descriptor_key(self.prefix, self.desc.node)) is not None:
            return
        publish_descriptor(self.session, self.prefix, self.desc, lease)
        self._published_on = lease
        self.publications += 1

    def _run(self) -> None:
        while not self._stop.wait(self.interval_s):
            try:
                self.check()
                self._logged = False
            except Exception as e:  # etcd away: retried next interval
                if not self._logged:
                    self._logged = True
                    log.warning("data-plane descriptor of node %d: cannot publish (%s: %s); retrying",
                                self.desc.node, type(e).__name__, e)


class PeerDirectory:
    """Cached data-plane descriptors of the other nodes.

    Args:
        session: an :class:`~flatcake.cluster.etcd.EtcdSession` (calls are serialised here).
        prefix: ``cluster.prefix``.
        retry_s: a node found absent (or whose lookup failed) is not looked up again sooner.
        clock: monotonic clock (seconds), for tests.
    """

    def __init__(self, session, prefix: str, retry_s: float = 1.0, clock: Callable[[], float] = time.monotonic):
        self.session, self.prefix, self.retry_s, self.clock = session, prefix, retry_s, clock
        self._cache: dict[int, DataPlaneDescriptor] = {}
        self._absent_until: dict[int, float] = {}
        self._suspended: dict[int, tuple[float, float]] = {}  # node -> (until, last back-off)
        self._lock = threading.Lock()
        self.lookups = 0

    def get(self, node: int) -> Optional[DataPlaneDescriptor]:
        """``node``'s descriptor: cached, else looked up in etcd (unless it was absent less than
        ``retry_s`` ago). None when it is unknown or etcd does not answer; never raises."""
        desc = self._cache.get(node)
        if desc is not None:
            return desc
        with self._lock:
            if self.clock() < self._absent_until.get(node, 0.0):
                return None
            self.lookups += 1
            try:
                desc = lookup_descriptor(self.session, self.prefix, node)
            except Exception as e:
                log.warning("data-plane descriptor of node %d: lookup failed (%s)", node, e)
                desc = None
            if desc is None:
                self._absent_until[node] = self.clock() + self.retry_s
            else:
                self._cache[node] = desc
            return desc

    def invalidate(self, node: int) -> None:
        """Forget ``node``'s descriptor (a read from it failed); the next :meth:`get` looks it up
        again (one etcd read per failed remote read at most: a dead owner's pages leave the view
        with its lease, and an absent descriptor is not looked up again for ``retry_s``)."""
        with self._lock:
            self._cache.pop(node, None)

    def replaced(self, node: int, used: Optional[DataPlaneDescriptor]) -> Optional[DataPlaneDescriptor]:
        """A transfer with descriptor ``used`` failed: look ``node``'s descriptor up now; if it
        changed (the owner restarted: a new engine, a new region), cache and return the new one
        (the read is retried with it, no back-off), else None. One etcd read; never raises."""
        if used is None:
            return None
        with self._lock:
            self.lookups += 1
            try:
                desc = lookup_descriptor(self.session, self.prefix, node)
            except Exception as e:
                log.warning("data-plane descriptor of node %d: lookup failed (%s)", node, e)
                return None
            if desc is None or desc == used:
                return None
            self._cache[node] = desc
            return desc

    def suspend(self, node: int) -> None:
        """A transfer from ``node`` failed: forget its descriptor and read nothing from it for a
        back-off of :data:`SUSPEND_MIN_S` seconds, doubled on each further failure up to
        :data:`SUSPEND_MAX_S` (reset by :meth:`succeeded`). Bounds how many landing buffers a dead
        or cut-off owner can put into quarantine while its records outlive it."""
        with self._lock:
            self._cache.pop(node, None)
            _until, last = self._suspended.get(node, (0.0, 0.0))
            backoff = min(SUSPEND_MAX_S, last * 2) if last else SUSPEND_MIN_S
            self._suspended[node] = (self.clock() + backoff, backoff)

    def suspended(self, node: int) -> bool:
        """True while reads from ``node`` are suspended (they are misses without a transfer)."""
        s = self._suspended.get(node)
        return s is not None and self.clock() < s[0]

    def succeeded(self, node: int) -> None:
        """A read from ``node`` went through: its next failure starts the back-off afresh."""
        if node in self._suspended:
            with self._lock:
                self._suspended.pop(node, None)

