"""The in-memory view of the other nodes' pages: bootstrap + watch (paper §3.1, FC-GVA, across nodes).

Lifecycle::

    bootstrap (paginated range read at revision R; build a new map; swap it in)
      -> watch from R + 1 (check each response's header; apply puts and deletes; remember the
         last revision applied)
      -> stream lost (etcd restarted, unreachable, idle): back off, resume from last revision + 1
      -> that revision compacted: bootstrap again (a new map swapped in whole), then on_reread()
      -> a header from a store that went back in time or changed identity (revision below the
         last seen, raft term below the last seen, another cluster id; another member id only
         raises the question): confirmed by one linearizable read, then a store reset: one
         WARNING, ``store_resets`` + 1, bootstrap again (pages the store no longer lists leave
         the view), watch from the new R + 1, on_reread() (the node republishes its records)

Readers never lock and never touch the network: :meth:`ClusterView.get` is one ``dict.get`` on
the current map (atomic under the GIL). Only the watcher thread writes, so there is one writer:
it inserts a round's pages after decoding the whole record, deletes a record's pages only where
the map still points at that record, and a bootstrap builds a complete new map before one
reference assignment publishes it. A reader therefore sees each page either before or after an
event, never a half-built record. :class:`~flatcake.cluster.records.RemotePage` is immutable.

A page key written by two nodes maps to the record applied last; when that record goes, the key is
a miss in the view even if the other node still holds it (documented limitation, docs/cluster.md).
"""

from __future__ import annotations

import collections
import logging
import threading
import time
from typing import Callable, Optional

from flatcake.cluster.etcd import EtcdSession, EtcdUnavailable, StoreHeader, WatchCompacted, WatchIdle, unb64
from flatcake.cluster.records import RecordError, RemotePage, RoundRecord, node_of_round_key, pages_of, rounds_prefix

log = logging.getLogger(__name__)

#: propagation delays kept for :meth:`ClusterView.propagation_s` (most recent)
DELAY_SAMPLES = 10000


def lost_state(seen: StoreHeader, seen_revision: int, now: StoreHeader) -> Optional[str]:
    """What says the store answering with header ``now`` lost the state of the one seen before
    (``seen``, whose revision this view had reached ``seen_revision``), or None. A healthy store
    only moves forward: its cluster id stays, its revision and raft term never decrease. A store
    restarted empty or restored from an older snapshot keeps the cluster id when it is started
    with the same ``--initial-cluster`` and token, so the revision is what usually tells.

    Returns:
        ``"cluster id A -> B"``, ``"revision A -> B"`` or ``"raft term A -> B"`` (the first that
        applies), or None.
    """
    if now.cluster_id != seen.cluster_id:
        return f"cluster id {seen.cluster_id} -> {now.cluster_id}"
    if now.revision < seen_revision:
        return f"revision {seen_revision} -> {now.revision}"
    if now.raft_term < seen.raft_term:
        return f"raft term {seen.raft_term} -> {now.raft_term}"
    return None


class ClusterView:
    """Other nodes' published pages, key -> :class:`RemotePage`, kept current by a watcher thread.

    Args:
        session: a dedicated :class:`EtcdSession` (the watch streams on it).
        prefix: the cluster key prefix (``cluster.prefix``).
        own_node: this node's id; its own rounds are skipped (the local index has them).
        idle_s: a watch silent this long is re-opened from the last revision (seconds).
        retry_s: back-off between reconnect attempts (seconds; doubled up to 8x).
        on_reread: called on the watcher thread after every bootstrap but the first (a
            compacted revision, a store reset): the node republishes its own records there,
            since the store may have lost them. Must not block.
    """

    def __init__(self, session: EtcdSession, prefix: str, own_node: int, idle_s: float = 5.0, retry_s: float = 0.1,
                 on_reread: Optional[Callable[[], None]] = None):
        self.session = session
        self.prefix = prefix
        self.own_node = own_node
        self.idle_s = idle_s
        self.retry_s = retry_s
        self._map: dict[str, RemotePage] = {}
        self._records: dict[str, tuple[str, ...]] = {}  # record key -> its page keys (watcher only)
        self.revision = 0  # last store revision applied
        self.store: Optional[StoreHeader] = None  # the store as last seen (identity, raft term)
        self.on_reread = on_reread
        self.bootstraps = 0
        self.store_resets = 0
        self.reconnects = 0
        self.idle_reopens = 0
        self.events_applied = 0
        self.bad_records = 0
        self._delays: collections.deque = collections.deque(maxlen=DELAY_SAMPLES)
        self._stop = threading.Event()
        self._ready = threading.Event()
        self._reread_wanted = threading.Event()
        self._thread: Optional[threading.Thread] = None
        self._logged: set[str] = set()

    # readers (lock-free, never on the network) -------------------------------------------------
    def get(self, key: str) -> Optional[RemotePage]:
        """The other node's page for ``key``, or None. One ``dict.get``: no lock, no I/O."""
        return self._map.get(key)

    def contains(self, key: str) -> bool:
        """Lock-free membership test."""
        return key in self._map

    def __len__(self) -> int:
        return len(self._map)

    def records(self) -> int:
        """Round records in the view."""
        return len(self._records)

    def propagation_s(self) -> list[float]:
        """Put -> applied delays (seconds, publisher's wall clock to this node's) of the records
        received by the watch, most recent last (bootstrap reads are not counted)."""
        return list(self._delays)

    # lifecycle --------------------------------------------------------------------------------
    def start(self, timeout_s: float = 10.0) -> bool:
        """Start the watcher thread; waits up to ``timeout_s`` for the first bootstrap.
        Returns whether it completed (if not, the watcher keeps trying in the background)."""
        self._thread = threading.Thread(target=self._run, name="flatcake-cluster-view", daemon=True)
        self._thread.start()
        return self._ready.wait(timeout_s)

    def close(self) -> None:
        """Stop the watcher: its stream is cut, so it ends at once."""
        self._stop.set()
        self.session.abort_watch()
        if self._thread is not None:
            self._thread.join(timeout=self.idle_s + 1)

    # the watcher (the only writer) ------------------------------------------------------------
    def request_reread(self) -> None:
        """Have the watcher read the whole index again (the node's lease was lost: the store may
        have lost state without going back in revision). Returns at once; the re-read follows
        within ``idle_s`` seconds at the latest, then ``on_reread`` is called."""
        self._reread_wanted.set()
        self.session.abort_watch()

    def _run(self) -> None:
        need_bootstrap, delay, why = True, self.retry_s, None
        while not self._stop.is_set():
            try:
                if self._reread_wanted.is_set():
                    self._reread_wanted.clear()
                    need_bootstrap = True
                if need_bootstrap:
                    self._reread(why)
                    need_bootstrap, why = False, None
                    self._ready.set()
                for header, events in self.session.watch_prefix(rounds_prefix(self.prefix), self.revision + 1,
                                                                self.idle_s):
                    delay = self.retry_s
                    why = self._store_changed(header)
                    if why is not None:
                        need_bootstrap = True
                        break
                    if events:
                        self._apply(events)
                    if self._stop.is_set():
                        return
                if need_bootstrap:  # the store lost state: re-read at once, no back-off
                    continue
            except WatchIdle:
                self.idle_reopens += 1
                continue  # a quiet cluster: re-open from the same revision at once
            except WatchCompacted as e:
                self._log_once("compacted", f"cluster view: {e}; reading the whole index again")
                need_bootstrap = True
            except EtcdUnavailable as e:
                if self._stop.is_set():  # close() cut the stream
                    return
                if self._reread_wanted.is_set():  # request_reread() cut it: read again at once
                    continue
                self._log_once("unavailable", f"cluster view: etcd unreachable ({e}); serving the last view and retrying")
            except Exception as e:  # never let the watcher die: log once, retry
                self._log_once(type(e).__name__, f"cluster view: {type(e).__name__}: {e}")
            if self._stop.is_set():
                return
            self.reconnects += 1
            self._stop.wait(delay)
            delay = min(delay * 2, self.retry_s * 8)

    def _store_changed(self, h: StoreHeader) -> Optional[str]:
        """Why the watch must stop and the store be read again, or None: ``h`` (a watch
        response's header) says the store went back or changed identity (:func:`lost_state`) and
        a linearizable read confirms it (a lagging member of a multi-member cluster can answer a
        watch from behind; another member id alone is a failover, checked the same way).

        Raises:
            EtcdUnavailable: the confirming read got no answer (the watch is re-opened).
        """
        seen = self.store
        if seen is None:
            return None
        if lost_state(seen, self.revision, h) is None and h.member_id == seen.member_id:
            if h.raft_term > seen.raft_term:
                self.store = h  # a new term (a restart, an election): a later one must not go below it
            return None
        now = self.session.header()
        why = lost_state(seen, self.revision, now)
        if why is None:  # a failover or a lagging member: the same store, the same history
            self.store = now
        return why

    def _reread(self, why: Optional[str] = None) -> None:
        """Bootstrap; after the first, say whether the store lost state (``why``, from the watch,
        or what the read itself shows: one WARNING, counted in ``store_resets``) and call
        ``on_reread``."""
        first, seen, seen_rev = self.store is None, self.store, self.revision
        self._bootstrap()
        if first:
            return
        now = self.store
        why = why or lost_state(seen, seen_rev, now)
        if why is not None:
            self.store_resets += 1
            log.warning("cluster view: the metadata store lost state (%s; member %s -> %s): read the whole index "
                        "again at revision %d (%d pages of other nodes in %d records), watching from %d, "
                        "republishing this node's records", why, seen.member_id, now.member_id, now.revision,
                        len(self._map), len(self._records), now.revision + 1)
        if self.on_reread is not None:
            self.on_reread()

    def _log_once(self, kind: str, msg: str) -> None:
        if kind not in self._logged:
            self._logged.add(kind)
            log.warning(msg)

    def _bootstrap(self) -> None:
        header, kvs = self.session.range_prefix(rounds_prefix(self.prefix))
        new_map: dict[str, RemotePage] = {}
        new_records: dict[str, tuple[str, ...]] = {}
        for key, value, _kv in kvs:
            record = self._decode(key, value)
            if record is not None:
                pages = pages_of(record, key)
                new_map.update(pages)
                new_records[key] = tuple(k for k, _ in pages)
        self._records = new_records
        self._map = new_map  # one reference assignment: readers see the old or the new view
        self.revision = header.revision
        self.store = header
        self.bootstraps += 1

    def _decode(self, key: str, value: bytes) -> Optional[RoundRecord]:
        if node_of_round_key(self.prefix, key) in (None, self.own_node):
            return None
        try:
            return RoundRecord.decode(value)
        except RecordError as e:
            self.bad_records += 1
            self._log_once("record", f"cluster view: skipping {key}: {e}")
            return None

    def _apply(self, events: list[dict]) -> None:
        now = time.time()
        for ev in events:
            kv = ev["kv"]
            key = unb64(kv["key"]).decode()
            self.revision = max(self.revision, int(kv.get("mod_revision", 0)))
            self.events_applied += 1
            old = self._records.pop(key, ())
            record = None if ev.get("type") == "DELETE" else self._decode(key, unb64(kv.get("value", "")))
            keep: set[str] = set()
            if record is not None:  # a re-put of a record replaces its pages without a gap
                pages = pages_of(record, key)
                for k, page in pages:
                    self._map[k] = page
                self._records[key] = tuple(k for k, _ in pages)
                keep = set(self._records[key])
                self._delays.append(now - record.published_s)
            self._drop(key, [k for k in old if k not in keep])

    def _drop(self, record_key: str, keys) -> None:
        for k in keys:
            page = self._map.get(k)
            if page is not None and page.record_key == record_key:
                del self._map[k]
