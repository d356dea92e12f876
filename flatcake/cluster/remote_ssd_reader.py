"""The reader's side of owner-served remote SSD reads (protocol: :mod:`flatcake.cluster.remote_ssd`).

Lifecycle of one read::

    pages (from the cluster view, medium SSD, one owner)
      -> one ``read`` request with every chunk's SSD GVA range  (pyzmq DEALER -> owner's ROUTER)
      -> per ``ready`` piece: Transfer Engine pull of the owner's staging slot into a window of our
         registered landing buffer (several pulls in flight), ``release`` the slot, start the pulls
         of ``ready`` answers already queued, then check the piece's chunks against their records'
         xxh3-64 and copy the matching ones into their pages (one GIL-free call, :func:`copy_verified`)
      -> hit (every chunk arrived and matched) or miss per page (never other bytes)

An owner silent for ``timeout_s`` (killed, cut off, overloaded) ends the read: every page not
yet arrived is a miss; the socket is dropped so a late answer can never be mistaken for a new one.
Nothing here raises into the caller.
"""

from __future__ import annotations

import collections
import json
import logging
import os
import threading
import time
from typing import Optional, Sequence

import numpy as np

from flatcake.cio.xxh3_bulk import xxh3_copy
from flatcake.cluster.records import RemotePage
from flatcake.cluster.transfer import DataPlaneDescriptor, LandingPool, RemoteReadResult, TransferEndpoint
from flatcake.gva.address import MEDIUM_SSD, OFFSET_MASK, medium_of

log = logging.getLogger(__name__)

#: bytes per Transfer Engine entry when pulling a staging slot (a larger slot is pulled as several
#: entries). 4 MiB: with 1 MiB entries the pulls of a 32 MiB read took 85-128 ms, with 4 MiB
#: entries 32-51 ms (bench_cluster.py, 2 x 4 MiB slots, 2026-12-01; docs/cluster.md)
PULL_ENTRY_BYTES = 4 << 20


def pull_entries(local: int, remote: int, nbytes: int) -> tuple[list, list, list]:
    """``(local, remote, lengths)`` Transfer Engine entries of at most :data:`PULL_ENTRY_BYTES`
    covering ``nbytes`` bytes from ``remote`` to ``local`` (addresses in bytes): how a staging
    slot is pulled here and how a placed round is pulled by its target (:mod:`flatcake.cluster.guest`)."""
    offs = range(0, nbytes, PULL_ENTRY_BYTES)
    return [local + o for o in offs], [remote + o for o in offs], [min(PULL_ENTRY_BYTES, nbytes - o) for o in offs]


def copy_verified(land: np.ndarray, starts: np.ndarray, rows_at: np.ndarray, want: np.ndarray,
                  state: np.ndarray, rows: np.ndarray) -> None:
    """Check chunks of a landing buffer against their checksums and copy the matching ones out.

    Args:
        land: uint8 landing buffer; starts: int64 ``[k]`` byte offsets of the chunks in ``land``.
        rows_at: int64 ``[k]`` each chunk's row of ``rows`` (global chunk index, page * layers + layer).
        want: uint64 ``[rows]`` expected xxh3-64 per row; state: int8 ``[rows]``, set to 1 (copied)
            or -1 (mismatch, not copied) for each chunk.
        rows: C-contiguous uint8 ``[rows, chunk_bytes]``, the destination.

    One GIL-free C call hashes each chunk and, where it matches, copies it while it is still in
    cache (:func:`flatcake.cio.xxh3_bulk.xxh3_copy`, the same bits as
    ``xxhash.xxh3_64_intdigest``). Raises ValueError for an offset outside ``land``, or ``rows``
    not a contiguous 2-D uint8 array, and IndexError for a row outside ``rows`` (a caller's bug).
    """
    if rows.ndim != 2 or not rows.flags.c_contiguous:
        raise ValueError("copy_verified: rows must be C-contiguous [rows, chunk_bytes]")
    cb = rows.shape[1]
    rows_at = np.asarray(rows_at, dtype=np.int64)
    state[rows_at] = xxh3_copy(land, starts, cb, want[rows_at], rows.reshape(-1), rows_at * cb)


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
        self.pool = LandingPool(endpoint, landing_bytes)
        self.landing = self.pool.current
        self.timeout_s = timeout_s
        self._ctx = zmq.Context.instance()
        self._socks: dict[str, object] = {}
        self._lock = threading.Lock()
        self._next_id = int.from_bytes(os.urandom(4), "little") << 16
        self.timeouts = 0
        self.wait_s = 0.0  # seconds waiting for the owner's answers
        self.pull_s = 0.0  # seconds in Transfer Engine pulls of staging slots
        self.copy_s = 0.0  # seconds checking and copying pulled pieces out

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
             chunk_bytes: int, out: Optional[np.ndarray] = None) -> RemoteReadResult:
        """Read ``pages`` (all owned by ``desc.node``, medium SSD) bit-exact or as misses.

        Args:
            desc: the owner's descriptor (None or no ``ssd_rpc``: every page a miss).
            pages: ``[n]`` from the cluster view; layers, chunk_bytes: the page geometry.
            out: optional uint8 ``[>= n, layers * chunk_bytes]`` the pages are copied into.

        Returns:
            :class:`RemoteReadResult`, ``data`` ``[n, layers * chunk_bytes]``, ``hit`` ``[n]``.

        Raises:
            ValueError: ``out`` has the wrong shape (a caller's bug, not an I/O fault).
        """
        res = RemoteReadResult.empty(len(pages), layers * chunk_bytes, out)
        if desc is None or not desc.ssd_rpc:
            res.misses["unknown_owner"] = len(pages)
            return res
        ok = [medium_of(p.gva) == MEDIUM_SSD and p.node == desc.node for p in pages]
        res.misses["failed"] += len(pages) - sum(ok)
        # a page without checksums could not be verified: it is a miss, never requested
        valid = [i for i, p in enumerate(pages) if ok[i] and p.checksums is not None and len(p.checksums) == layers]
        res.misses["unverifiable"] += sum(ok) - len(valid)
        ranges = [((pages[i].gva & OFFSET_MASK) + l * pages[i].layer_stride, chunk_bytes)
                  for i in valid for l in range(layers)]
        want = np.zeros(len(pages) * layers, dtype=np.uint64)
        for i in valid:
            want[i * layers: (i + 1) * layers] = pages[i].checksums
        state = np.zeros(len(pages) * layers, dtype=np.int8)  # per chunk: 0 missing, 1 verified, -1 mismatch
        with self._lock:
            self.landing = self.pool.get()  # None while every landing buffer is quarantined: misses
            outcome = self._exchange(desc, ranges, valid, layers, chunk_bytes, res, (want, state)) \
                if self.landing is not None else "failed"
        per_page = state.reshape(len(pages), layers) if len(pages) else state.reshape(0, layers)
        res.hit[:] = (per_page == 1).all(axis=1) if layers else False
        for i in valid:
            if res.hit[i]:
                continue
            if (per_page[i] == -1).any():
                res.misses["mismatch"] += 1
            else:
                res.misses["timeout" if outcome == "timeout" else "failed"] += 1
        return res

    def _exchange(self, desc: DataPlaneDescriptor, ranges: list, valid: list, layers: int, chunk_bytes: int,
                  res: RemoteReadResult, check: tuple) -> str:
        """Run one request; fills ``res.data`` and ``check[1]`` (per global chunk ``i * layers + l``:
        1 arrived and matching ``check[0]``'s checksum, -1 arrived and not). Returns ``"done"``,
        ``"timeout"`` or ``"refused"``."""
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
        slot_bytes = int(msg[1].get("slot_bytes", 0))
        if not 0 < slot_bytes <= self.landing.nbytes:
            log.warning("remote SSD read: node %d's %d-byte staging slots exceed the %d-byte landing buffer",
                        desc.node, slot_bytes, self.landing.nbytes)
            return "refused"
        # request range j -> global chunk index (page i, layer l) -> byte offset in res.data
        dest = np.asarray([valid[j // layers] * layers + j % layers for j in range(len(ranges))], dtype=np.int64)
        copy = (res.data.reshape(-1), dest, chunk_bytes, *check)
        return self._pump(desc, sock, rid, int(msg[1]["pieces"]), slot_bytes, copy)

    def _pump(self, desc: DataPlaneDescriptor, sock, rid: int, pieces: int, slot_bytes: int, copy: tuple) -> str:
        """Pull every ``ready`` piece into a free landing window, several pulls in flight at once;
        each finished pull releases the owner's slot, starts the pulls of answers already here,
        and then its chunks are checked and copied out (while those pulls travel)."""
        free = list(range(self.landing.nbytes // slot_bytes))
        inflight: collections.deque = collections.deque()
        left = [pieces]
        while left[0] or inflight:
            # take every answer already here; block for one only when no pull is in flight
            if not self._take_ready(desc, sock, rid, slot_bytes, free, inflight, left, block=not inflight):
                return self._silent(desc, inflight)
            if inflight:
                bid, w, body = inflight.popleft()
                t0 = time.perf_counter()
                ok = self.endpoint.wait(bid)
                self.pull_s += time.perf_counter() - t0
                if not ok:  # owner gone or cut off: stop here, the rest are misses
                    return self._pull_failed(desc, inflight)
                sock.send_multipart([b"release", json.dumps({"id": rid, "slot": body["slot"]}).encode()])
                heard = self._take_ready(desc, sock, rid, slot_bytes, free, inflight, left, False)
                t0 = time.perf_counter()
                self._copy_out(w * slot_bytes, body["chunks"], *copy)
                self.copy_s += time.perf_counter() - t0
                free.append(w)
                if not heard:
                    return self._silent(desc, inflight)
        return "done"

    def _silent(self, desc: DataPlaneDescriptor, inflight) -> str:
        """The owner stayed silent: wait for our pulls in flight (the landing windows must be ours
        again; a pull that failed may still land: quarantine the buffer) and time out."""
        if not all([self.endpoint.wait(bid) for bid, _w, _b in inflight]):
            self.pool.retire()
        return self._timed_out(desc)

    def _take_ready(self, desc, sock, rid: int, slot_bytes: int, free: list, inflight, left: list, block: bool) -> bool:
        """Start a pull for each ``ready`` answer already here (the first one waited for when
        ``block``), into free landing windows. Returns False when the owner stayed silent for
        ``timeout_s``."""
        while left[0] and free and (block or sock.poll(0)):
            block = False
            t0 = time.perf_counter()
            msg = self._recv(sock, rid)
            self.wait_s += time.perf_counter() - t0
            if msg is None:
                return False
            left[0] -= 1
            if msg[0] != "ready":
                continue  # "failed": the owner's disk refused that piece, its chunks stay missing
            w = free.pop(0)
            inflight.append((self._submit_pull(desc.te, w * slot_bytes, msg[1]), w, msg[1]))
        return True

    def _pull_failed(self, desc: DataPlaneDescriptor, inflight) -> str:
        """A pull failed: wait out the others, drop the socket (the owner drops the request when its
        slots are not released) and quarantine the landing buffer (the engine may still write into it)."""
        for bid, _w, _b in inflight:
            self.endpoint.wait(bid)
        self._drop(desc.ssd_rpc)
        self.pool.retire()
        log.info("remote SSD read: a pull from node %d failed; landing buffer quarantined", desc.node)
        return "failed"

    def _submit_pull(self, peer: str, offset: int, body: dict) -> int:
        """Start pulling a ``ready`` slot into the landing buffer at ``offset``, as entries of at
        most :data:`PULL_ENTRY_BYTES` (the engine moves several at once). Returns the batch id."""
        return self.endpoint.submit(peer, *pull_entries(self.landing.addr + offset, int(body["addr"]), int(body["used"])))

    def _copy_out(self, base: int, chunks: list, flat: np.ndarray, dest: np.ndarray, chunk_bytes: int,
                  want: np.ndarray, state: np.ndarray) -> None:
        """Check each chunk of a pulled piece against its checksum (while other pulls are in flight)
        and copy the ones that match into their page."""
        if not chunks:
            return
        jc = np.asarray(chunks, dtype=np.int64).reshape(-1, 2)
        copy_verified(self.landing.array, base + jc[:, 1], dest[jc[:, 0]], want, state, flat.reshape(-1, chunk_bytes))

    def _timed_out(self, desc: DataPlaneDescriptor) -> str:
        self.timeouts += 1
        self._drop(desc.ssd_rpc)
        log.info("remote SSD read: node %d silent for %.1f s; its unread pages are misses", desc.node, self.timeout_s)
        return "timeout"
