"""A backend's membership in the cluster: what :class:`~flatcake.adapter.storage.FlatCakeStorage`
starts when ``cluster.etcd`` is set (``docs/cluster.md``, "Backend wiring"; issue 12).

Lifecycle::

    ClusterMember(cfg, store, namespace).start()
        ClusterNode (registration, lease, index, coordinator; free bytes from the store)
        DataPlane on the store's DRAM region and SSD pool (serves this node's pages)
        publish listener -> every round the store publishes  \\  one worker thread, in order:
        retire listener  -> every scope the store frees       /  publish_round / retire_scope
    hit query:  extend_run(keys, n)        the local run continued by the cluster view (memory)
    read:       fill(keys, out, layout, ids) the view's pages after the local run, read remotely,
                                          verified, scattered into the layout's page slots
    close()     stop the worker, the data plane, the node (its lease revoked: records vanish)

The cluster keys live under ``cluster.prefix`` + ``/ns-<16 hex>`` (xxh64 of the store's namespace:
model, ranks, page size, dtype, layout), so only stores of the same namespace share pages, and a
``node_id`` needs to be unique per namespace.

Nothing here is imported unless ``cluster.etcd`` is set.
"""

from __future__ import annotations

import logging
import queue
import threading
from typing import Optional, Sequence

import numpy as np
import torch
import xxhash

from flatcake.cio.pagecopy import scatter_pages
from flatcake.cluster.coordinator import Capacity
from flatcake.cluster.dataplane import DataPlane
from flatcake.cluster.node import ClusterNode
from flatcake.cluster.placement import start_placement, stop_placement
from flatcake.cluster.remote_dram import dram_round_checksums
from flatcake.config import ConfigError, FlatCakeConfig
from flatcake.gva.address import MEDIUM_DRAM, MEDIUM_NAMES, OFFSET_MASK, medium_of

log = logging.getLogger(__name__)

MAX_RECORD_PAGES = 128  # pages per record of pages held before the member started (SGLang's batch)

MISS_CAUSES = ("mismatch", "unverifiable", "failed", "timeout", "unknown_owner", "not_in_view", "suspended",
               "after_miss", "error")


def namespace_prefix(prefix: str, namespace: str) -> str:
    """``prefix/ns-<xxh64 of namespace, 16 hex>``: the etcd prefix of one namespace's cluster."""
    return f"{prefix.rstrip('/')}/ns-{xxhash.xxh64_intdigest(namespace.encode()):016x}"


class ClusterMember:
    """One store's node in the cluster: index publication, hit extension, remote reads.

    Args:
        cfg: the store's configuration (``node_id``, ``cluster``, ``ssd.file_bytes``).
        store: the :class:`~flatcake.store.page_store.PageStore` (role ``single`` or ``writer``).
        namespace: the store's namespace (selects the etcd prefix, module docstring).

    Raises:
        ConfigError: ``cluster.etcd`` empty or ``cluster.advertise`` unset (the data plane needs it).
    """

    def __init__(self, cfg: FlatCakeConfig, store, namespace: str):
        if not cfg.cluster.enabled:
            raise ConfigError("cluster.etcd: no endpoint; a store without a cluster needs no ClusterMember")
        self.cluster_cfg = cfg.cluster.model_copy(update={"prefix": namespace_prefix(cfg.cluster.prefix, namespace)})
        self.store, self.node_id, self.geometry = store, cfg.node_id, store.geometry
        self.node = ClusterNode(self.cluster_cfg, cfg.node_id, self._capacity)
        dram = store.dram if store.dram.n_slots else None
        self.plane = DataPlane(self.cluster_cfg, cfg.node_id, self.node.lease_id, region=dram,
                               ssd=(store.ssd.path_of, cfg.ssd.file_bytes))
        self._jobs: "queue.SimpleQueue" = queue.SimpleQueue()
        self._seq: dict[int, int] = {}  # scope id -> next round number published
        self._read_lock = threading.Lock()  # one remote read at a time (one landing buffer)
        #: where remote reads copy verified pages before they are scattered into the host pool:
        #: kept and grown under _read_lock (a new array per read would page-fault every byte)
        self._pages_out = np.empty((0, self.geometry.page_bytes), dtype=np.uint8)
        self._count_lock = threading.Lock()  # counters are bumped from SGLang's threads
        self._worker: Optional[threading.Thread] = None
        self._closed = False
        self.placement = None  # RemotePlacer: rounds without local space go to other nodes (placement.py)
        self.counters = {"remote_hit_pages": {"dram": 0, "ssd": 0}, "remote_read_pages": {"dram": 0, "ssd": 0},
                         "remote_miss_pages": dict.fromkeys(MISS_CAUSES, 0), "published_rounds": 0,
                         "published_pages": 0, "unpublished_rounds": 0, "retired_scopes": 0, "remote_reads": 0}

    # lifecycle ------------------------------------------------------------------------------------
    def start(self) -> "ClusterMember":
        """Join the cluster, start serving, hook the store's listeners.

        Raises:
            ConfigError: ``node_id`` registered by a live node of this namespace.
            EtcdUnavailable: no etcd endpoint answered.
            ImportError, TransferError, zmq.ZMQError: the data plane could not start
                (:meth:`DataPlane.start <flatcake.cluster.dataplane.DataPlane.start>`).
            Whatever was started is stopped before the error propagates.
        """
        try:
            self.node.start()
            self.plane.start()
            self.placement = start_placement(self)
        except BaseException:
            self.close()
            raise
        self._worker = threading.Thread(target=self._work, name="flatcake-cluster-publish", daemon=True)
        self._worker.start()
        with self.store.scopes.lock:  # nothing is published or freed between the two
            self.store.add_publish_listener(self._on_publish)
            self.store.add_retire_listener(self._on_retire, with_scope=True)
            self._publish_existing_locked()
        return self

    def _publish_existing_locked(self) -> None:
        """Queue the pages the store already holds (a warm restart's rebuilt SSD scopes) as
        records of at most 128 pages of one layer stride each. Writer lock held."""
        index, pb = self.store.index, self.geometry.page_bytes
        for scope in list(index.scopes.values()):
            pairs = [(k, index.get(k)) for k in scope.keys]
            pairs = [(k, e) for k, e in pairs if e is not None and e.scope is scope]
            keys, entries = [k for k, _ in pairs], [e for _, e in pairs]
            a = 0
            while a < len(entries):
                b = a + 1
                while b < len(entries) and b - a < MAX_RECORD_PAGES and entries[b].layer_stride == entries[a].layer_stride:
                    b += 1
                slots = [(e.gva & OFFSET_MASK) // pb for e in entries[a:b]] if scope.medium == MEDIUM_DRAM else None
                self._jobs.put(("round", scope, scope.medium, keys[a:b], entries[a:b], slots))
                a = b

    def close(self) -> None:
        """Stop publishing (what is queued is committed for up to 1 s), serving and the node
        (the lease is revoked: this node's records leave every view). Idempotent; never raises."""
        if self._closed:
            return
        self._closed = True
        self._jobs.put(None)
        if self._worker is not None:
            self._worker.join(timeout=5.0)
        stop_placement(self, self.placement)
        for part in (self.plane, self.node):
            try:
                part.close()
            except Exception as e:  # noqa: BLE001 - best effort at shutdown
                log.warning("flatcake cluster close: %s: %s", type(part).__name__, e)

    def _capacity(self) -> Capacity:
        s, d = self.store.ssd, self.store.dram
        return Capacity(self.node_id, d.free_slots * d.page_bytes, max(0, s.capacity_bytes - s.used_bytes),
                        d.region_bytes(), s.capacity_bytes)

    # publication (listeners under the store's writer lock: queue only) ----------------------------
    def _on_publish(self, plc, entries) -> None:
        if not self._closed:
            self._jobs.put(("round", plc.scope, plc.medium, list(plc.keys), list(entries), plc.slots))

    def _on_retire(self, keys, scope_id: int) -> None:
        if not self._closed:
            self._jobs.put(("retire", scope_id))

    def _work(self) -> None:
        """Worker: publish rounds (DRAM rounds checksummed here) and retires, in store order."""
        while True:
            job = self._jobs.get()
            if job is None:
                return
            try:
                if job[0] == "call":
                    job[1]()
                elif job[0] == "retire":
                    self._seq.pop(job[1], None)
                    self.node.index.retire_scope(job[1])
                    self.counters["retired_scopes"] += 1
                else:
                    self._publish(*job[1:])
            except Exception as e:  # noqa: BLE001 - publication is best effort: pages stay local
                self.store.errors("cluster publish", e)

    def _publish(self, scope, medium: int, keys: list, entries: list, slots) -> None:
        """Publish one round. A DRAM round is hashed first; if its scope was freed or dropped by
        the time the hash ends, its slots may hold other bytes: nothing is published (its retire
        follows in the queue). Checked after hashing, so the checksums are of the round's bytes."""
        layers = self.geometry.layers
        if medium == MEDIUM_DRAM:
            sums = dram_round_checksums(self.store.dram, slots, layers)
        elif all(e.checksums is not None and len(e.checksums) >= layers for e in entries):
            sums = np.stack([np.asarray(e.checksums[:layers], dtype=np.uint64) for e in entries])
        else:
            sums = None
        if sums is None or scope.retired or scope.doomed:
            self.counters["unpublished_rounds"] += 1
            return
        seq = self._seq.get(scope.scope_id, 0)
        self._seq[scope.scope_id] = seq + 1
        self.node.index.publish_round(scope.scope_id, seq, medium, keys, [e.gva for e in entries],
                                      entries[0].layer_stride, sums)
        self.counters["published_rounds"] += 1
        self.counters["published_pages"] += len(keys)

    def flush(self, timeout_s: float = 10.0) -> bool:
        """Wait until every round and retire queued so far is committed to etcd (tests, tools);
        False after ``timeout_s`` seconds."""
        done = threading.Event()
        self._jobs.put(("call", done.set))
        return done.wait(timeout_s) and self.node.index.flush(timeout_s)

    # hit query and reads --------------------------------------------------------------------------
    def _run(self, keys: Sequence[str]) -> list:
        """The leading run of ``keys`` other nodes hold (``RemotePage`` each; memory only)."""
        out = []
        for p in self.node.index.lookup(keys):
            if p is None:
                break
            out.append(p)
        return out

    def extend_run(self, keys: Sequence[str], n: int) -> int:
        """``n`` (the local leading run of ``keys``) continued by the pages other nodes hold:
        a pure in-memory lookup of the view, never the network. Never raises."""
        try:
            if n >= len(keys) or self._closed:
                return n
            pages = self._run(keys[n:])
            with self._count_lock:
                for p in pages:
                    self.counters["remote_hit_pages"][MEDIUM_NAMES[medium_of(p.gva)]] += 1
            return n + len(pages)
        except Exception as e:  # noqa: BLE001
            self.store.errors("cluster hit query", e)
            return n

    def fill(self, keys: Sequence[str], out: list, layout, page_ids) -> int:
        """After a local read ``out`` (per-page bools, a leading run of True), read the next
        pages other nodes hold into pages ``page_ids[i]`` of ``layout`` and set their ``out[i]``;
        only verified bytes (a checksum mismatch is a miss) and only a leading run. Returns the
        pages delivered. Never raises (every fault is a miss, counted by cause)."""
        try:
            n = next((i for i, ok in enumerate(out) if not ok), len(out))
            if n >= len(keys) or self._closed:
                return 0
            pages = self._run(keys[n:])
            if not pages:
                return 0
            g = self.geometry
            with self._read_lock:
                if len(self._pages_out) < len(pages):
                    self._pages_out = np.empty((len(pages), g.page_bytes), dtype=np.uint8)
                res = self.plane.read(pages, g.layers, g.chunk_bytes, self._pages_out)
                h = int(np.argmin(res.hit)) if not res.hit.all() else len(pages)
                if h:
                    self._scatter(res.data[:h], layout, [int(page_ids[n + i]) for i in range(h)])
                    out[n: n + h] = [True] * h
            self._count_read(pages, res, h)
            return h
        except Exception as e:  # noqa: BLE001
            with self._count_lock:
                self.counters["remote_miss_pages"]["error"] += 1
            self.store.errors("cluster read", e)
            return 0

    def _scatter(self, data: np.ndarray, layout, ids: list) -> None:
        """Pages ``data`` (uint8 ``[h, layers * chunk_bytes]``, layer order) into page slots ``ids``."""
        g = self.geometry
        rows = torch.from_numpy(data).view(len(ids), g.layers, g.chunk_bytes)
        if rows.device != layout.device:
            rows = rows.to(layout.device)
        dst = torch.tensor(ids, dtype=torch.long)
        for layer in range(g.layers):
            scatter_pages(layout, rows[:, layer], dst, layer)

    def _count_read(self, pages, res, h: int) -> None:
        with self._count_lock:
            self._count_read_locked(pages, res, h)

    def _count_read_locked(self, pages, res, h: int) -> None:
        c = self.counters
        c["remote_reads"] += 1
        for p in pages[:h]:
            c["remote_read_pages"][MEDIUM_NAMES[medium_of(p.gva)]] += 1
        misses = c["remote_miss_pages"]
        for cause, k in res.misses.items():
            misses[cause] = misses.get(cause, 0) + int(k)
        misses["after_miss"] += int(res.hit[h:].sum())  # read intact, but after the run's first miss

    def stats(self) -> dict:
        """``flatcake_stats()["cluster"]``: cumulative ``remote_hit_pages`` / ``remote_read_pages``
        ``{"dram", "ssd"}`` (pages), ``remote_miss_pages`` by cause, ``published_rounds``,
        ``published_pages``, ``unpublished_rounds``, ``retired_scopes``, ``remote_reads``, plus
        the node's (:meth:`ClusterNode.stats <flatcake.cluster.node.ClusterNode.stats>`), the
        write-time placement's (:meth:`RemotePlacer.stats <flatcake.cluster.placement.RemotePlacer.stats>`)
        and ``node_id``, ``prefix``."""
        with self._count_lock:
            out = {k: (dict(v) if isinstance(v, dict) else v) for k, v in self.counters.items()}
        try:
            out.update(self.node.stats())
        except Exception as e:  # noqa: BLE001
            out["node_stats_error"] = str(e)
        if self.placement is not None:
            out.update(self.placement.stats())
        out.update(node_id=self.node_id, prefix=self.cluster_cfg.prefix)
        return out
