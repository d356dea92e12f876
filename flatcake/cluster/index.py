"""The replicated key -> GVA index (paper §3.1, FC-GVA, across nodes): every node keeps the whole
cluster's index in memory, so a hit query stays local, lock-free and off the network.

Lifecycle of a round across nodes::

    node A: local publish (flatcake.gva.index)  ->  publish_round (queued)  ->  one etcd
            transaction per batch, on A's lease (flatcake.cluster.publisher)
    node B: watch event  ->  RemotePage in B's view  ->  get(key) finds it (flatcake.cluster.view)

After the store lost state (restarted empty, restored from an older snapshot) every view reads
the index again and every node republishes its records (docs/cluster.md, "The metadata store
lost state").

Lifecycle of a scope: A retires it -> ``retire_scope`` deletes its rounds in etcd -> the delete
events remove its pages from every view. A dies -> its lease expires -> etcd deletes its rounds
-> the same delete events.

The local index (:class:`flatcake.gva.index.GvaIndex`) stays the authority for a node's own
pages; :class:`ClusterIndex` holds only the other nodes' pages and how to publish one's own.
"""

from __future__ import annotations

from typing import Callable, Optional, Sequence

from flatcake.cluster.etcd import EtcdSession
from flatcake.cluster.publisher import RoundPublisher
from flatcake.cluster.records import RemotePage, RoundRecord
from flatcake.cluster.view import ClusterView


class ClusterIndex:
    """Publisher of this node's rounds plus the view of the others'.

    Args:
        endpoints: etcd ``http://host:port`` endpoints.
        prefix: cluster key prefix (``cluster.prefix``).
        node_id: this node's id (``node_id``, the GVA node field).
        lease: callable returning the node's current lease id (records are held on it).
        timeout_s: seconds per etcd call.
        idle_s: a silent watch is re-opened from its last revision after this many seconds.
        on_reread: called (on the view's thread, must not block) after the view read the whole
            index again (a compacted revision, a store that lost state); None = republish this
            node's records at once (:meth:`RoundPublisher.republish_all`).

    Raises:
        ValueError: an endpoint is not ``http(s)://host:port``.
    """

    def __init__(self, endpoints: Sequence[str], prefix: str, node_id: int, lease: Callable[[], int],
                 timeout_s: float = 2.0, idle_s: float = 5.0, on_reread: Optional[Callable[[], None]] = None):
        self.node_id = node_id
        # one session per thread that talks to etcd: the watch streams on its own
        self.publisher = RoundPublisher(EtcdSession(endpoints, timeout_s), prefix, node_id, lease)
        self.view = ClusterView(EtcdSession(endpoints, timeout_s), prefix, node_id, idle_s=idle_s,
                                on_reread=on_reread or self.publisher.republish_all)

    def start(self, bootstrap_timeout_s: float = 10.0) -> bool:
        """Start publishing and watching; returns whether the first bootstrap finished within
        ``bootstrap_timeout_s`` seconds (if not, it keeps trying in the background)."""
        self.publisher.start()
        return self.view.start(bootstrap_timeout_s)

    def close(self, flush_s: float = 0.0) -> None:
        """Stop both threads (after trying to commit what is queued for ``flush_s`` seconds)."""
        self.publisher.close(flush_s)
        self.view.close()

    # hit path: lock-free, never on the network ----------------------------------------------
    def get(self, key: str) -> Optional[RemotePage]:
        """Another node's page for ``key``, or None (one ``dict.get``)."""
        return self.view.get(key)

    def lookup(self, keys: Sequence[str]) -> list[Optional[RemotePage]]:
        """:meth:`get` for each key, in order."""
        get = self.view.get
        return [get(k) for k in keys]

    def prefix_hits(self, keys: Sequence[str]) -> int:
        """How many leading ``keys`` another node holds (SGLang's ``batch_exists`` shape)."""
        n = 0
        for k in keys:
            if not self.view.contains(k):
                break
            n += 1
        return n

    # write path: queued, never waits for etcd ---------------------------------------------------
    def publish_round(self, scope_id: int, seq: int, medium: int, keys: Sequence[str], gvas: Sequence[int],
                      layer_stride: int, checksums=None) -> RoundRecord:
        """Queue one round this node wrote (after its bytes are written and published locally).

        Args:
            scope_id, seq: the local scope and the round's sequence number in it.
            medium: 0 DRAM / 1 SSD.
            keys: page keys ``[pages]``; gvas: their GVAs ``[pages]`` (node field = this node).
            layer_stride: bytes between a page's layer chunks.
            checksums: uint64 ``[pages, layers]`` chunk checksums, or None.

        Returns:
            The record queued.

        Raises:
            RecordError: lengths, shapes or GVA fields disagree (nothing is queued).
        """
        record = RoundRecord.build(self.node_id, scope_id, seq, medium, keys, gvas, layer_stride, checksums)
        self.publisher.publish_round(record)
        return record

    def retire_scope(self, scope_id: int) -> None:
        """Queue the removal of every round of ``scope_id`` from the cluster."""
        self.publisher.retire_scope(scope_id)

    def flush(self, timeout_s: float) -> bool:
        """Wait until every queued round and retire is committed; False after ``timeout_s``."""
        return self.publisher.flush(timeout_s)

    def stats(self) -> dict:
        """Counters: ``remote_pages``, ``remote_records``, ``revision``, ``bootstraps``,
        ``store_resets`` (the metadata store was found to have lost state: docs/cluster.md),
        ``reconnects``, ``idle_reopens``, ``events_applied``, ``bad_records``, ``rounds_published``,
        ``scopes_retired``, ``transactions``, ``publish_failures``, ``dropped_rounds``,
        ``publish_pending``, ``republish_syncs``, ``stale_records_deleted``."""
        v, p = self.view, self.publisher
        return {"remote_pages": len(v), "remote_records": v.records(), "revision": v.revision,
                "bootstraps": v.bootstraps, "store_resets": v.store_resets, "reconnects": v.reconnects,
                "idle_reopens": v.idle_reopens, "events_applied": v.events_applied,
                "bad_records": v.bad_records, "rounds_published": p.rounds_published,
                "scopes_retired": p.scopes_retired, "transactions": p.transactions,
                "publish_failures": p.failures, "dropped_rounds": p.dropped_rounds, "publish_pending": p.pending(),
                "republish_syncs": p.syncs, "stale_records_deleted": p.stale_deleted}
