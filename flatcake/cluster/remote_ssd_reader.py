"""The reader's side of owner-served remote SSD reads (protocol: :mod:`flatcake.cluster.remote_ssd`).

Lifecycle of one read::

    pages (from the cluster view, medium SSD, one owner)
      -> one ``read`` request with every chunk's SSD GVA range  (pyzmq DEALER -> owner's ROUTER)
      -> per ``ready`` piece: Transfer Engine pull of the owner's staging slot into our registered
         landing buffer, ``release`` the slot, copy the piece's chunks into their pages
      -> every page whose chunks all arrived is checked against its record's checksums
      -> hit or miss per page (never other bytes)

An owner silent for ``timeout_s`` (killed, cut off, overloaded) ends the read: every page not
yet arrived is a miss; the socket is dropped so a late answer can never be mistaken for a new one.
Nothing here raises into the caller.
"""

from __future__ import annotations

import json
import logging
import os
import threading
from typing import Optional, Sequence

import numpy as np

from flatcake.cluster.records import RemotePage
from flatcake.cluster.transfer import (DataPlaneDescriptor, RegisteredBuffer, RemoteReadResult, TransferEndpoint,
                                       verify_landed)
from flatcake.gva.address import MEDIUM_SSD, OFFSET_MASK, medium_of

log = logging.getLogger(__name__)


class RemoteSsdReader:
    """Reads other nodes' SSD pages through their :class:`~flatcake.cluster.remote_ssd.SsdOwnerServer`.

    Args:
        endpoint: this node's :class:`TransferEndpoint`.
        landing_bytes: registered landing buffer (>= the owners' staging slot size; multiple of 4096).
        timeout_s: the longest the reader waits for any one answer of the owner (seconds).

    Raises:
        TransferError: the landing buffer could not be registered.
    """

    def __init__(self, endpoint: TransferEndpoint, landing_bytes: int = 16 << 20, timeout_s: float = 2.0):
        import zmq

        self._zmq = zmq
        self.endpoint = endpoint
        self.landing = RegisteredBuffer(endpoint, landing_bytes)
        self.timeout_s = timeout_s
        self._ctx = zmq.Context.instance()
        self._socks: dict[str, object] = {}
        self._lock = threading.Lock()
        self._next_id = int.from_bytes(os.urandom(4), "little") << 16
        self.timeouts = 0

    def close(self) -> None:
        """Close the sockets to the owners."""
        with self._lock:
            for s in self._socks.values():
                s.close(0)
            self._socks.clear()

    def _sock(self, url: str):
        s = self._socks.get(url)
        if s is None:
            s = self._ctx.socket(self._zmq.DEALER)
            s.setsockopt(self._zmq.LINGER, 0)
            s.connect(url)
            self._socks[url] = s
        return s

    def _drop(self, url: str) -> None:
        s = self._socks.pop(url, None)
        if s is not None:
            s.close(0)

    def _recv(self, sock, rid: int) -> Optional[tuple[str, dict]]:
        """The next message of request ``rid``; None after ``timeout_s`` of silence."""
        while sock.poll(int(self.timeout_s * 1000)):
            verb, body = sock.recv_multipart()
            msg = json.loads(body)
            if msg.get("id") == rid:
                return verb.decode(), msg
        return None

    def read(self, desc: Optional[DataPlaneDescriptor], pages: Sequence[RemotePage], layers: int,
             chunk_bytes: int) -> RemoteReadResult:
        """Read ``pages`` (all owned by ``desc.node``, medium SSD) bit-exact or as misses.

        Args:
            desc: the owner's descriptor (None or no ``ssd_rpc``: every page a miss).
            pages: ``[n]`` from the cluster view; layers, chunk_bytes: the page geometry.

        Returns:
            :class:`RemoteReadResult`, ``data`` ``[n, layers * chunk_bytes]``, ``hit`` ``[n]``.
        """
        res = RemoteReadResult.empty(len(pages), layers * chunk_bytes)
        if desc is None or not desc.ssd_rpc:
            res.misses["unknown_owner"] = len(pages)
            return res
        valid = [i for i, p in enumerate(pages) if medium_of(p.gva) == MEDIUM_SSD and p.node == desc.node]
        res.misses["failed"] += len(pages) - len(valid)
        ranges = [((pages[i].gva & OFFSET_MASK) + l * pages[i].layer_stride, chunk_bytes)
                  for i in valid for l in range(layers)]
        arrived = np.zeros(len(pages) * layers, dtype=bool)
        with self._lock:
            outcome = self._exchange(desc, ranges, valid, layers, chunk_bytes, res, arrived)
        whole = arrived.reshape(len(pages), layers).all(axis=1) if len(pages) else arrived
        sums = [pages[i].checksums if whole[i] else None for i in range(len(pages))]
        good = verify_landed(res.data.reshape(-1), sums, layers, chunk_bytes)
        res.hit[:] = good
        for i in valid:
            if good[i]:
                continue
            if not whole[i]:
                res.misses["timeout" if outcome == "timeout" else "failed"] += 1
            elif pages[i].checksums is None:
                res.misses["unverifiable"] += 1
            else:
                res.misses["mismatch"] += 1
        return res

    def _exchange(self, desc: DataPlaneDescriptor, ranges: list, valid: list, layers: int, chunk_bytes: int,
                  res: RemoteReadResult, arrived: np.ndarray) -> str:
        """Run one request; fills ``res.data`` and ``arrived`` (per global chunk ``i * layers + l``).
        Returns ``"done"``, ``"timeout"`` or ``"refused"``."""
        if not ranges:
            return "done"
        self._next_id += 1
        rid = self._next_id
        sock = self._sock(desc.ssd_rpc)
        sock.send_multipart([b"read", json.dumps({"id": rid, "ranges": ranges}).encode()])
        msg = self._recv(sock, rid)
        if msg is None or msg[0] != "plan":
            return self._timed_out(desc)
        if msg[1].get("error"):
            log.warning("remote SSD read refused by node %d: %s", desc.node, msg[1]["error"])
            return "refused"
        flat = res.data.reshape(-1)
        # request range j -> global chunk index (page i, layer l) -> byte offset in res.data
        dest = np.asarray([valid[j // layers] * layers + j % layers for j in range(len(ranges))], dtype=np.int64)
        for _ in range(int(msg[1]["pieces"])):
            msg = self._recv(sock, rid)
            if msg is None:
                return self._timed_out(desc)
            verb, body = msg
            if verb != "ready":
                continue  # "failed": the owner's disk refused that piece, its chunks stay missing
            used = int(body["used"])
            pulled = used <= self.landing.nbytes and \
                self.endpoint.read(desc.te, [self.landing.addr], [int(body["addr"])], [used])
            sock.send_multipart([b"release", json.dumps({"id": rid, "slot": body["slot"]}).encode()])
            if not pulled:
                continue
            land = self.landing.array
            for j, so in body["chunks"]:
                g = int(dest[j])
                flat[g * chunk_bytes: (g + 1) * chunk_bytes] = land[so: so + chunk_bytes]
                arrived[g] = True
        return "done"

    def _timed_out(self, desc: DataPlaneDescriptor) -> str:
        self.timeouts += 1
        self._drop(desc.ssd_rpc)
        log.info("remote SSD read: node %d silent for %.1f s; its unread pages are misses", desc.node, self.timeout_s)
        return "timeout"
