"""Write-time placement, the target's side: another node ships a round its own media cannot
hold, and this node stores it in its own :class:`~flatcake.store.page_store.PageStore` as its own pages
(paper §3.1 "capacity coordinator"; ``docs/cluster.md``, "Write-time placement on another node").

Protocol (a verb on this node's existing owner server, :class:`~flatcake.cluster.remote_ssd.SsdOwnerServer`,
zmq multipart ``[verb, JSON]``; the writer's DEALER, this node's ROUTER)::

    writer -> target   store   {"id", "te", "addr", "keys", "prefix", "geometry": [layers, page_size,
                                [row bytes per plane]], "sums": base64 of uint64 [n, layers]}
    target -> writer   stored  {"id", "ok": [bool per page], "node", "error"?}

``addr`` is the writer's registered outbox in its Transfer Engine ``te``: page ``i``'s chunks
back to back (layer order) at ``addr + i * page_bytes``. The target pulls them into its own
registered inbox (a :class:`~flatcake.cluster.transfer.LandingPool` buffer: quarantined after a
failed pull), checks every chunk against ``sums`` (xxh3-64), stores the leading run that matches
with ``PageStore.put`` — its Table 2, scopes, reclamation and write queue apply; the GVAs carry
this node's id — and answers per page. Its publish listener then publishes the round to the
cluster index like any round of its own.

One request at a time (the server thread); a request delays the node's remote SSD reads while it
runs. A guest round whose put fails here is not placed further (no placement chains).
"""

from __future__ import annotations

import base64
import logging
import threading
from typing import Callable, Optional

import numpy as np
import torch

from flatcake.cio.pagecopy import gather_pages
from flatcake.cluster.remote_ssd_reader import pull_entries
from flatcake.cluster.transfer import LandingPool, TransferEndpoint, page_checksums, verify_landed
from flatcake.common.layout import KvPageLayout, PageGeometry

log = logging.getLogger(__name__)

STORE_VERB = "store"
STORED_VERB = "stored"


def geometry_message(g: PageGeometry) -> list:
    """``[layers, page_size, [row bytes per plane]]``: how a shipment names its page geometry."""
    return [g.layers, g.page_size, list(g.plane_row_bytes)]


def chunk_layout(g: PageGeometry, buf: np.ndarray, n: int) -> KvPageLayout:
    """A :class:`~flatcake.common.layout.KvPageLayout` of ``n`` pages over ``buf``: uint8
    ``[>= n * page_bytes]``, page ``i``'s chunks back to back in layer order at
    ``i * page_bytes`` (a remote read's ``data`` rows; the shipment format), each chunk's planes
    one after the other (:meth:`PageGeometry.plane_offsets`). No copy."""
    t = torch.from_numpy(buf[: n * g.page_bytes]).view(n, g.layers, g.chunk_bytes)
    offs, P = g.plane_offsets(), g.page_size

    def views(layer: int):
        return [t[:, layer, o: o + P * rb].view(n, P, rb) for o, rb in zip(offs, g.plane_row_bytes)]

    return KvPageLayout(g, views, n, torch.device("cpu"), "cluster-shipment")


def pack_pages(layout, src_pages, g: PageGeometry, out: np.ndarray) -> np.ndarray:
    """Gather pages ``src_pages`` of ``layout`` (CPU) into ``out`` in the shipment format and
    checksum them.

    Args:
        layout: the writer's :class:`~flatcake.common.layout.KvPageLayout` (host memory).
        src_pages: ``m`` page ids in ``layout``.
        g: the page geometry; out: uint8 ``[>= m * page_bytes]`` (the registered outbox).

    Returns:
        uint64 ``[m, layers]``: xxh3-64 of every chunk (what the ``store`` request carries).

    Raises:
        IndexError: a page id outside ``layout``.
    """
    m = len(src_pages)
    arr = out[: m * g.page_bytes]
    t = torch.from_numpy(arr).view(m, g.layers, g.chunk_bytes)
    ids = np.asarray(src_pages, dtype=np.int64)
    for layer in range(g.layers):
        gather_pages(layout, ids, layer, t[:, layer])
    return page_checksums(arr.reshape(m, g.page_bytes), g.layers, g.chunk_bytes)


class GuestStore:
    """Serves ``store`` requests into ``store`` (see the module docstring).

    Args:
        store: this node's :class:`~flatcake.store.page_store.PageStore`.
        endpoint: this node's :class:`~flatcake.cluster.transfer.TransferEndpoint`.
        inbox_bytes: bytes of the registered inbox (``cluster.landing_bytes``): the largest
            shipment taken (a writer splits larger rounds).
        node_id: this node's id (answered, for the writer's logs).
        after_store: called (no arguments) after a shipment stored pages, before the answer:
            the node's capacity publication (``CapacityCoordinator.publish``), so the space the
            pages took shows before the writer releases its reservation. Errors are logged.

    Attributes:
        counters: ``guest_pages_stored``, ``guest_rounds`` (requests that stored pages),
            ``guest_failures`` (requests that stored none, any cause).
    """

    def __init__(self, store, endpoint: TransferEndpoint, inbox_bytes: int, node_id: int,
                 after_store: Optional[Callable[[], None]] = None):
        self.store, self.endpoint, self.inbox_bytes, self.node_id = store, endpoint, inbox_bytes, node_id
        self.after_store = after_store
        self._inbox: Optional[LandingPool] = None  # registered on the first shipment
        self._local = threading.local()
        self.counters = {"guest_pages_stored": 0, "guest_rounds": 0, "guest_failures": 0}

    def storing(self) -> bool:
        """True on the thread storing a guest round now (its put must not be placed elsewhere)."""
        return bool(getattr(self._local, "on", False))

    def handle(self, body: dict) -> tuple[str, dict]:
        """Answer one ``store`` request: ``("stored", {"id", "ok", "node"[, "error"]})``.
        Never raises for a bad request or an I/O fault (those are ``ok`` False with ``error``)."""
        rid, keys = body.get("id"), list(body.get("keys") or [])
        try:
            ok, why = self._store(body, keys)
        except Exception as e:  # noqa: BLE001 - a malformed shipment is a failed one
            ok, why = [False] * len(keys), f"{type(e).__name__}: {e}"
        out = {"id": rid, "ok": ok, "node": self.node_id}
        if why:
            out["error"] = why
        stored = sum(ok)
        self.counters["guest_pages_stored"] += stored
        self.counters["guest_rounds" if stored else "guest_failures"] += 1
        if stored and self.after_store is not None:
            try:
                self.after_store()
            except Exception as e:  # noqa: BLE001 - the periodic publication catches up
                log.warning("flatcake cluster: capacity after a guest round not published (%s)", e)
        return STORED_VERB, out

    def _store(self, body: dict, keys: list) -> tuple[list, str]:
        g, n = self.store.geometry, len(keys)
        fail = [False] * n
        if geometry_message(g) != body.get("geometry"):
            return fail, f"page geometry {body.get('geometry')} is not this store's {geometry_message(g)}"
        nbytes = n * g.page_bytes
        if not n or nbytes > self.inbox_bytes:
            return fail, f"{n} pages ({nbytes} bytes) do not fit the {self.inbox_bytes}-byte inbox"
        if self._inbox is None:
            self._inbox = LandingPool(self.endpoint, self.inbox_bytes)
        buf = self._inbox.get()
        if buf is None:
            return fail, "every inbox is quarantined after failed pulls"
        if not self.endpoint.read(str(body["te"]), *pull_entries(buf.addr, int(body["addr"]), nbytes)):
            self._inbox.retire()  # the engine may still write into it
            return fail, "Transfer Engine pull from the writer failed"
        landed = buf.array[:nbytes]
        sums = np.frombuffer(base64.b64decode(body["sums"]), dtype="<u8").reshape(n, g.layers)
        good = verify_landed(landed, list(sums), g.layers, g.chunk_bytes)
        h = int(np.argmin(good)) if not good.all() else n
        if h == 0:
            return fail, "checksum mismatch in the first page"
        self._local.on = True
        try:
            ok = self.store.put(keys[:h], chunk_layout(g, landed, h), list(range(h)), body.get("prefix") or None)
        finally:
            self._local.on = False
        return list(ok) + [False] * (n - h), ("" if h == n else f"checksum mismatch from page {h}")
