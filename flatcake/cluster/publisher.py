"""Publishing a node's rounds and retired scopes to etcd, off the write path.

Lifecycle::

    publish_round / retire_scope (the caller: enqueue, no I/O)
      -> publisher thread: batch queued operations into one transaction (at most ``max_ops``
         operations and ``max_bytes`` bytes; a retire of a scope with a round in the same batch
         starts the next batch: etcd refuses a transaction that touches a key twice)
      -> commit under the node's current lease; on failure (etcd down) keep the batch and retry
      -> republish_all(): the store may not hold this node's records as they are (its lease was
         lost, the store restarted empty or from an older snapshot, the view's revision was
         compacted): a sync reads P/rounds/<node>/ once, then deletes the records this node no
         longer holds and puts the live ones missing, different or on another lease

Nothing is dropped while etcd is away: queued operations wait (up to ``max_queued`` of them;
beyond that the oldest rounds are dropped and counted — their pages are simply not visible to
other nodes, a miss, never wrong data). Retires are never dropped.
"""

from __future__ import annotations

import collections
import logging
import threading
from typing import Callable, Optional

from flatcake.cluster.etcd import EtcdSession, EtcdUnavailable, op_delete, op_delete_prefix, op_put
from flatcake.cluster.records import RoundRecord, node_rounds_prefix, round_key, scope_prefix

log = logging.getLogger(__name__)


class RoundPublisher:
    """Background publisher of one node's index records.

    Args:
        session: a dedicated :class:`EtcdSession`.
        prefix: the cluster key prefix.
        node_id: this node's id (the GVA node field).
        lease: callable returning the node's current lease id.
        max_ops: operations per transaction (etcd's ``--max-txn-ops`` defaults to 128).
        max_bytes: bytes of values per transaction (etcd refuses requests over 1.5 MiB).
        max_queued: operations waiting at most (rounds beyond it are dropped, counted).
        retry_s: seconds between attempts while etcd does not answer.
    """

    def __init__(self, session: EtcdSession, prefix: str, node_id: int, lease: Callable[[], int],
                 max_ops: int = 64, max_bytes: int = 1 << 20, max_queued: int = 100_000, retry_s: float = 0.1):
        self.session = session
        self.prefix = prefix
        self.node_id = node_id
        self.lease = lease
        self.max_ops, self.max_bytes, self.max_queued, self.retry_s = max_ops, max_bytes, max_queued, retry_s
        # ("put", key, value) | ("delete", key) | ("retire", scope_id) | ("sync",)
        self._queue: collections.deque = collections.deque()
        self._live: dict[int, dict[str, bytes]] = {}  # scope id -> record key -> value (for republish)
        self._cv = threading.Condition()
        self._inflight = 0
        self._stop = False
        self._thread: Optional[threading.Thread] = None
        self.rounds_published = 0
        self.scopes_retired = 0
        self.transactions = 0
        self.failures = 0
        self.dropped_rounds = 0
        self.syncs = 0  # republish_all() syncs done
        self.stale_deleted = 0  # records found in the store that this node no longer holds, deleted
        self._logged: set[str] = set()

    def _log_once(self, kind: str, msg: str, *args) -> None:
        if kind not in self._logged:
            self._logged.add(kind)
            log.warning(msg, *args)

    # callers (no I/O) --------------------------------------------------------------------------
    def publish_round(self, record: RoundRecord) -> None:
        """Queue one round for publication (returns at once)."""
        key = round_key(self.prefix, self.node_id, record.scope_id, record.seq)
        value = record.encode()
        if len(value) > self.max_bytes:  # etcd would refuse it (requests over 1.5 MiB): a miss elsewhere
            self.dropped_rounds += 1
            self._log_once("size", "cluster publisher: a %d-byte round record is over %d bytes; not published "
                           "(its pages stay local)", len(value), self.max_bytes)
            return
        with self._cv:
            self._live.setdefault(record.scope_id, {})[key] = value
            self._queue.append(("put", key, value))
            self._trim_locked()
            self._cv.notify()

    def retire_scope(self, scope_id: int) -> None:
        """Queue the deletion of every round of ``scope_id`` (returns at once)."""
        with self._cv:
            self._live.pop(scope_id, None)
            self._queue.append(("retire", scope_id))
            self._cv.notify()

    def republish_all(self) -> None:
        """Make this node's records in the store exactly the live ones (returns at once; the
        publisher thread reads ``P/rounds/<node>/`` once, then queues, ahead of what came later,
        a delete of every record there that is not live — a retired scope, a round an older
        snapshot brought back — and a put of every live record missing, different or on another
        lease than the current one). Call it when the store may have lost or changed them: the
        lease was lost, the store restarted empty or from an older snapshot."""
        with self._cv:
            self._queue.append(("sync",))
            self._cv.notify()

    def flush(self, timeout_s: float) -> bool:
        """Wait until everything queued so far is committed; False after ``timeout_s`` seconds."""
        with self._cv:
            return self._cv.wait_for(lambda: not self._queue and not self._inflight, timeout_s)

    def pending(self) -> int:
        """Operations queued or in flight."""
        with self._cv:
            return len(self._queue) + self._inflight

    def _trim_locked(self) -> None:
        while len(self._queue) > self.max_queued:
            for i, op in enumerate(self._queue):
                if op[0] == "put":
                    del self._queue[i]
                    self.dropped_rounds += 1
                    break
            else:
                return

    # the thread -------------------------------------------------------------------------------
    def start(self) -> None:
        """Start the publisher thread."""
        self._thread = threading.Thread(target=self._run, name="flatcake-cluster-publisher", daemon=True)
        self._thread.start()

    def close(self, flush_s: float = 0.0) -> None:
        """Stop the thread after trying to commit what is queued for up to ``flush_s`` seconds."""
        if flush_s > 0:
            self.flush(flush_s)
        with self._cv:
            self._stop = True
            self._cv.notify_all()
        if self._thread is not None:
            self._thread.join(timeout=self.session.timeout_s + 1)

    def _take_batch_locked(self) -> list[tuple]:
        """The next transaction's operations: a sync alone, else puts, deletes and retires that
        never touch one key twice (etcd refuses such a transaction: a key put twice, a key put
        or deleted and its scope retired in the same one)."""
        if self._queue and self._queue[0][0] == "sync":
            return [self._queue.popleft()]
        batch: list[tuple] = []
        nbytes, keys, scopes_touched, scopes_retired = 0, set(), set(), set()
        while self._queue and len(batch) < self.max_ops:
            op = self._queue[0]
            if op[0] == "sync":
                break
            if op[0] == "retire":
                scope = f"{op[1]:016x}"
                if scope in scopes_touched or scope in scopes_retired:
                    break
                scopes_retired.add(scope)
            else:  # a put or a delete of one record
                scope = op[1].rsplit("/", 2)[-2]
                if op[1] in keys or scope in scopes_retired:
                    break
                if op[0] == "put":
                    if batch and nbytes + len(op[2]) > self.max_bytes:
                        break
                    nbytes += len(op[2])
                keys.add(op[1])
                scopes_touched.add(scope)
            batch.append(self._queue.popleft())
        return batch

    def _ops(self, batch: list[tuple]) -> list[dict]:
        lease = self.lease()
        return [op_put(op[1], op[2], lease) if op[0] == "put" else op_delete(op[1]) if op[0] == "delete"
                else op_delete_prefix(scope_prefix(self.prefix, self.node_id, op[1])) for op in batch]

    def _run(self) -> None:
        while True:
            with self._cv:
                self._cv.wait_for(lambda: self._queue or self._stop)
                if self._stop:
                    return
                batch = self._take_batch_locked()
                self._inflight = len(batch)
            ok = self._sync() if batch[0][0] == "sync" else self._commit(batch)
            with self._cv:
                self._inflight = 0
                if not ok:
                    self._queue.extendleft(reversed(batch))
                self._cv.notify_all()
                if not ok and not self._stop:
                    self._cv.wait(self.retry_s)

    def _sync(self) -> bool:
        """The sync of :meth:`republish_all`: read this node's records in the store, queue at the
        front what makes them the live ones. True when done, False to retry (etcd away)."""
        try:
            _header, kvs = self.session.range_prefix(node_rounds_prefix(self.prefix, self.node_id))
            stored = {key: (value, int(kv.get("lease", 0) or 0)) for key, value, kv in kvs}
        except EtcdUnavailable as e:
            self.failures += 1
            self._log_once("unavailable", "cluster publisher: etcd unreachable (%s); rounds wait and are retried", e)
            return False
        except Exception as e:  # refused: put every live record (what stale ones remain expire with their lease)
            self.failures += 1
            self._log_once("sync", "cluster publisher: cannot read this node's records (%s: %s); putting every "
                           "live record again", type(e).__name__, e)
            stored = {}
        lease = self.lease()
        with self._cv:  # the live set and the queue as of now: later operations stay behind these
            live = {key: value for recs in self._live.values() for key, value in recs.items()}
            ops = [("delete", key) for key in stored if key not in live]
            ops += [("put", key, value) for key, value in live.items() if stored.get(key) != (value, lease)]
            self._queue.extendleft(reversed(ops))
            self._trim_locked()
        self.syncs += 1
        if ops:
            log.info("cluster publisher: node %d sync: %d records in the store, %d live; %d deleted, %d put",
                     self.node_id, len(stored), len(live), sum(op[0] == "delete" for op in ops),
                     sum(op[0] == "put" for op in ops))
        return True

    def _commit(self, batch: list[tuple]) -> bool:
        """One transaction; True when committed or given up on (refused for another reason than
        a missing lease: its rounds are dropped and counted), False to retry the batch."""
        try:
            self.session.txn(self._ops(batch))
        except EtcdUnavailable as e:
            self.failures += 1
            self._log_once("unavailable", "cluster publisher: etcd unreachable (%s); rounds wait and are retried", e)
            return False
        except Exception as e:
            self.failures += 1
            if "lease not found" in str(e):  # the node re-leases and republishes; retry on the new lease
                self._log_once("lease", "cluster publisher: lease gone (%s); retrying on the next lease", e)
                return False
            self._log_once("refused", "cluster publisher: transaction refused (%s: %s); its rounds are dropped",
                           type(e).__name__, e)
            self.dropped_rounds += sum(op[0] == "put" for op in batch)
            return True
        self.transactions += 1
        for op in batch:
            if op[0] == "put":
                self.rounds_published += 1
            elif op[0] == "delete":
                self.stale_deleted += 1
            else:
                self.scopes_retired += 1
        return True
