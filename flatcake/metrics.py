"""FlatCake's own Prometheus metrics: hits by medium, restores, reclaim, health, capacity,
the C loops' states (``docs/metrics.md``).

SGLang's storage histograms (``sglang:prefetch_pgs`` ...) see only what ``get_stats()`` reports
per call. This module exports FlatCake's cumulative view of one
:class:`~flatcake.store.page_store.PageStore` under names prefixed ``flatcake_``.

Why plain ``Counter``/``Gauge`` objects, updated from :meth:`PageStore.snapshot_stats`, and not
a custom collector read at scrape time: with ``--enable-metrics`` SGLang runs
``prometheus_client`` in multiprocess mode. The scheduler process, where FlatCake lives, writes
its values into ``PROMETHEUS_MULTIPROC_DIR``; the HTTP server process serves ``/metrics`` from
those files. A collector registered in the scheduler process would never be scraped. So the
adapter refreshes these metrics from the store's counters when SGLang drains ``get_stats()``
(once per scheduler step, rate-limited to :data:`REFRESH_S`): nothing is added to the I/O
paths.

``prometheus_client`` is optional: without it :func:`make_exporter` logs once and returns
``None``; start-up never fails for it.
"""

from __future__ import annotations

import logging
import threading
from typing import Optional

from flatcake.native.loops import STATES as NATIVE_STATES

log = logging.getLogger("flatcake")

#: prefix of every FlatCake metric name
PREFIX = "flatcake_"
#: labels of every FlatCake metric (``pool``: the SSD pool's file prefix, unique per
#: namespace and instance; the ranks as SGLang labels its own storage metrics)
BASE_LABELS = ("pool", "tp_rank", "pp_rank", "dp_rank")
#: seconds between two refreshes from the store's counters at most (``get_stats`` cadence)
REFRESH_S = 1.0
#: the states a medium reports (``flatcake_medium_state``)
MEDIUM_STATES = ("healthy", "degraded", "disabled")
#: the states a C loop reports (``flatcake_native_loop_state``)
NATIVE_LOOP_STATES = NATIVE_STATES
#: the backend methods whose SGLang calls are counted (``flatcake_sglang_*``), each with the
#: ``what`` label of its answer (counted by ``flatcake.adapter.storage.CallCounters``)
SGLANG_METHODS = {"batch_exists": "present", "batch_get_v1": "delivered", "batch_set_v1": "stored",
                  "batch_get": "delivered", "batch_set": "stored", "exists": "present", "get": "delivered",
                  "set": "stored"}

# counter name (without ``_total``) -> (help, [(snapshot key, extra label values)], extra label names)
_COUNTERS = {
    "hit_pages": ("Pages delivered by reads (hits served), per medium.",
                  [("hit_pages_dram", ("dram",)), ("hit_pages_ssd", ("ssd",))], ("medium",)),
    "pages_written": ("Pages stored by backups, per medium.",
                      [("pages_written_dram", ("dram",)), ("pages_written_ssd", ("ssd",))], ("medium",)),
    "restores": ("FC-CIO restores: read calls that needed SSD pages (paper section 3.3).", [("ssd_restores", ())], ()),
    "merged_reads": ("Merged SSD reads (contiguous ranges) planned by FC-CIO; a restore plans one or more.",
                     [("merged_reads", ())], ()),
    "restore_seconds": ("Seconds spent in FC-CIO restores (first read to last scatter).", [("ssd_read_s", ())], ()),
    "ssd_read_bytes": ("Bytes read from the SSD, over-read included.", [("ssd_read_bytes", ())], ()),
    "ssd_over_read_bytes": ("Bytes read from the SSD and thrown away (bridged holes, alignment).",
                            [("ssd_over_read_bytes", ())], ()),
    "ssd_read_ops": ("SSD read requests issued.", [("ssd_read_ops", ())], ()),
    "ssd_write_bytes": ("Bytes written to the SSD, headers and records included.", [("ssd_write_bytes", ())], ()),
    "ssd_write_ops": ("SSD pwrite calls.", [("ssd_write_ops", ())], ()),
    "dram_write_bytes": ("Bytes copied into DRAM slots.", [("dram_write_bytes", ())], ()),
    "put_failures": ("Backup rounds that failed to store (no space, I/O error).", [("put_failures", ())], ()),
    "get_failures": ("Reads that stopped early on a page that could not be read intact.",
                     [("get_failures", ())], ()),
    "reclaimed_scopes": ("Whole scopes freed (reclaim, clear, faults), per medium.",
                         [("reclaimed_scopes_dram", ("dram",)), ("reclaimed_scopes_ssd", ("ssd",))], ("medium",)),
    "reclaimed_bytes": ("Medium bytes the reclaimed scopes held.", [("reclaimed_bytes", ())], ()),
    "quarantined_scopes": ("Scopes that lost pages because a page of theirs failed to read intact.",
                           [("quarantined_scopes", ())], ()),
    "quarantined_pages": ("Pages unpublished after failed reads (the failed round and the rounds after it).",
                          [("quarantined_pages", ())], ()),
    "io_errors": ("I/O errors logged (each counted, logged once per errno).", [("io_errors", ())], ()),
    "checksum_failures": ("Chunks whose checksum or DRAM identity did not match on read.",
                          [("checksum_failures", ())], ()),
    "write_deferred_seconds": ("Seconds the SSD write queue held writes back while restores were in flight.",
                               [("write_deferred_s", ())], ()),
    "write_backlog_dropped_pages": ("One-shot pages not stored because the write backlog and DRAM were full.",
                                    [("write_backlog_dropped_pages", ())], ()),
    "deferred_write_failures": ("Queued SSD rounds whose write failed after the put returned.",
                                [("deferred_write_failures", ())], ()),
    "write_backlog_evicted_rounds": ("Queued SSD rounds never written because a round that found the pool full "
                                     "evicted their scope (pinned only by rounds waiting in the queue).",
                                     [("write_backlog_evicted_rounds", ())], ()),
    "cluster_store_resets": ("Times the cluster's metadata store (etcd) was seen to lose state (revision gone "
                             "back, another cluster id, a lower raft term) and the index was read again.",
                             [("cluster_store_resets", ())], ()),
    "mas_prefetches": ("Prefetches the FC-MAS plugin's lanes ran, per lane (dram: DRAM-ready, ssd: restores).",
                       [("mas_prefetches_dram", ("dram",)), ("mas_prefetches_ssd", ("ssd",))], ("lane",)),
    "mas_overtakes": ("Prefetches the FC-MAS lanes completed ahead of one submitted earlier and still unfinished.",
                      [("mas_overtakes", ())], ()),
    "sglang_calls": ("Calls SGLang made into the backend, per method.",
                     [(f"sglang_calls_{m}", (m,)) for m in SGLANG_METHODS], ("method",)),
    "sglang_call_pages": ("Pages in SGLang's calls, per method: asked (keys passed in) and the answer "
                          "(present: batch_exists' leading run; delivered: read into the host pool; "
                          "stored: reported stored).",
                          [(f"sglang_pages_{m}_{w}", (m, w)) for m, a in SGLANG_METHODS.items() for w in ("asked", a)],
                          ("method", "what")),
}
#: snapshot keys of the counters the adapter keeps itself (they survive a store re-open)
_ADAPTER_KEYS = frozenset(k for name in ("sglang_calls", "sglang_call_pages") for k, _ in _COUNTERS[name][1])

# gauge name -> (help, extra label names)
_GAUGES = {
    "used_bytes": ("Bytes in use, per medium.", ("medium",)),
    "capacity_bytes": ("Capacity in service, per medium (bytes).", ("medium",)),
    "medium_state": ("1 for the medium's current state (healthy, degraded, disabled), 0 for the others.",
                     ("medium", "state")),
    "ssd_files_out_of_service": ("SSD pool files taken out of service (refused writes).", ()),
    "ssd_drive_used_bytes": ("SSD bytes allocated to extents, per drive (ssd.path entry).", ("drive", "path")),
    "ssd_drive_capacity_bytes": ("SSD capacity in service, per drive (its files in service x file bytes).",
                                 ("drive", "path")),
    "ssd_drive_state": ("1 for the drive's current state (healthy, degraded, disabled), 0 for the others.",
                        ("drive", "path", "state")),
    "pages_indexed": ("Pages the store currently serves.", ()),
    "scopes": ("Scopes the store currently holds.", ()),
    "write_backlog_pages": ("Pages waiting in the SSD write queue (served from memory).", ()),
    "write_backlog_bytes": ("Bytes of SSD rounds waiting in the write queue.", ()),
    "write_deferral_p99_seconds": ("p99 of the last 4096 queued rounds' deferral (submit to write start), seconds.", ()),
    "write_deferral_max_seconds": ("Largest deferral of the last 4096 queued rounds, seconds.", ()),
    "write_urgent_rounds": ("Queued rounds written beside restores because the deferral bound made them urgent.", ()),
    "ssd_drive_read_failures": ("Failed reads of the drive's files since start-up.", ("drive", "path")),
    "ssd_write_bytes_per_hour": ("SSD bytes written per hour since the store opened.", ()),
    "ssd_dwpd": ("Projected SSD drive writes per day at the current write rate, for the configured capacity.", ()),
    "native_loop_state": ("1 for the C loop's current state (native, fallback, off), 0 for the others.",
                          ("loop", "state")),
}

_families: dict = {}  # id(registry) -> (registry, {name: metric}): one set of families per registry
_families_lock = threading.Lock()
_missing_logged = False


def _families_for(registry, prom) -> dict:
    """The FlatCake metric families of ``registry`` (``None``: the default registry), created
    once (creating a name twice in one registry raises in ``prometheus_client``)."""
    reg = registry if registry is not None else prom.REGISTRY
    with _families_lock:
        got = _families.get(id(reg))
        if got is not None and got[0] is reg:
            return got[1]
        fams = {}
        for name, (doc, _, extra) in _COUNTERS.items():
            fams[name] = prom.Counter(PREFIX + name, doc, BASE_LABELS + extra, registry=reg)
        for name, (doc, extra) in _GAUGES.items():
            fams[name] = prom.Gauge(PREFIX + name, doc, BASE_LABELS + extra, registry=reg,
                                    multiprocess_mode="mostrecent")
        _families[id(reg)] = (reg, fams)
        return fams


class FlatCakeMetrics:
    """FlatCake's metrics for one store, labelled ``labels`` (see :data:`BASE_LABELS`).

    Counters (``flatcake_*_total``) advance by the store's counter increments since the last
    :meth:`update`, so they stay monotonic when the adapter reopens its store (call
    :meth:`new_store` then). Gauges are set to the snapshot's current values.

    Args:
        labels: a value for each of :data:`BASE_LABELS` (missing ones are ``""``).
        registry: a ``prometheus_client.CollectorRegistry``; ``None`` is the default registry
            (the one SGLang's multiprocess ``/metrics`` reads through its files).

    Raises:
        ImportError: ``prometheus_client`` is not installed (use :func:`make_exporter`).
    """

    def __init__(self, labels: dict, registry=None):
        import prometheus_client as prom

        self.labels = tuple(str(labels.get(k, "")) for k in BASE_LABELS)
        self._fams = _families_for(registry, prom)
        self._last: dict = {}
        self._lock = threading.Lock()

    def new_store(self, labels: Optional[dict] = None) -> None:
        """The adapter opened a new store (its counters start at 0 again): count from there,
        under ``labels`` when given (a re-registered store may have another pool). The
        adapter's own counters (SGLang's calls) go on from where they were."""
        with self._lock:
            self._last = {k: v for k, v in self._last.items() if k in _ADAPTER_KEYS}
            if labels is not None:
                self.labels = tuple(str(labels.get(k, "")) for k in BASE_LABELS)

    def update(self, snap: dict) -> None:
        """Bring every metric to ``snap`` (:meth:`PageStore.snapshot_stats`, or the adapter's
        ``flatcake_stats()`` with its ``mas_lanes``). Never raises for a missing key (that metric
        is left as it was)."""
        cluster = snap.get("cluster")
        if isinstance(cluster, dict) and "store_resets" in cluster:
            snap = dict(snap, cluster_store_resets=cluster["store_resets"])
        lanes = snap.get("mas_lanes")
        if lanes:
            snap = dict(snap, mas_prefetches_dram=lanes.get("dram", 0), mas_prefetches_ssd=lanes.get("ssd", 0),
                        mas_overtakes=lanes.get("overtakes", 0))
        calls = snap.get("sglang_calls")
        if calls:
            flat = {}
            for m, c in calls.items():
                flat[f"sglang_calls_{m}"] = c.get("calls", 0)
                for what, v in c.items():
                    if what != "calls":
                        flat[f"sglang_pages_{m}_{what}"] = v
            snap = dict(snap, **flat)
        with self._lock:
            for name, (_, series, _) in _COUNTERS.items():
                for key, extra in series:
                    v = snap.get(key)
                    if v is None:
                        continue
                    delta = v - self._last.get(key, 0)
                    child = self._fams[name].labels(*self.labels, *extra)  # exported from 0 on
                    if delta > 0:
                        child.inc(delta)
                    self._last[key] = v
            self._update_gauges(snap)

    def _update_gauges(self, snap: dict) -> None:
        fams, lab = self._fams, self.labels
        for medium, st in (snap.get("media") or {}).items():
            fams["used_bytes"].labels(*lab, medium).set(st.get("used_bytes", 0))
            fams["capacity_bytes"].labels(*lab, medium).set(st.get("capacity_bytes", 0))
            for state in MEDIUM_STATES:
                fams["medium_state"].labels(*lab, medium, state).set(1 if st.get("state") == state else 0)
            if medium == "ssd":
                fams["ssd_files_out_of_service"].labels(*lab).set(len(st.get("files_out_of_service", ())))
                self._update_drives(st.get("drives", ()))
        for name in ("pages_indexed", "scopes", "write_backlog_pages", "write_backlog_bytes",
                     "ssd_write_bytes_per_hour", "ssd_dwpd", "write_urgent_rounds"):
            if name in snap:
                fams[name].labels(*lab).set(snap[name])
        for name, key in (("write_deferral_p99_seconds", "write_deferral_p99_s"),
                          ("write_deferral_max_seconds", "write_deferral_max_s")):
            if key in snap:
                fams[name].labels(*lab).set(snap[key])
        for loop, st in (snap.get("native_loops") or {}).items():
            for state in NATIVE_LOOP_STATES:
                fams["native_loop_state"].labels(*lab, loop, state).set(1 if st.get("state") == state else 0)


    def _update_drives(self, drives) -> None:
        """Per-drive SSD gauges (label ``drive``: index into ``ssd.path``; ``path``: its directory)."""
        fams, lab = self._fams, self.labels
        for d in drives:
            dl = (str(d.get("drive", "")), str(d.get("path", "")))
            fams["ssd_drive_used_bytes"].labels(*lab, *dl).set(d.get("used_bytes", 0))
            fams["ssd_drive_capacity_bytes"].labels(*lab, *dl).set(d.get("capacity_bytes", 0))
            fams["ssd_drive_read_failures"].labels(*lab, *dl).set(d.get("read_failures", 0))
            for state in MEDIUM_STATES:
                fams["ssd_drive_state"].labels(*lab, *dl, state).set(1 if d.get("state") == state else 0)


def make_exporter(labels: dict, registry=None) -> Optional[FlatCakeMetrics]:
    """A :class:`FlatCakeMetrics`, or ``None`` when ``prometheus_client`` is not importable or
    the metrics cannot be registered (logged once per process; never raises)."""
    global _missing_logged
    try:
        return FlatCakeMetrics(labels, registry)
    except Exception as e:  # ImportError, or a name clash with another exporter of the registry
        if not _missing_logged:
            _missing_logged = True
            log.warning("flatcake: own metrics (flatcake_*) not exported: %s: %s", type(e).__name__, e)
        return None


__all__ = ["BASE_LABELS", "FlatCakeMetrics", "MEDIUM_STATES", "NATIVE_LOOP_STATES", "PREFIX", "REFRESH_S",
           "SGLANG_METHODS", "make_exporter"]
