"""Owner-served remote SSD reads (GVA node ≠ own, medium SSD; paper §3.1 "remote SSD by NVMe-oF",
built here as a small request over pyzmq plus Transfer Engine pulls; issue 12).

Protocol (zmq multipart ``[verb, JSON]``; the reader's DEALER, the owner's ROUTER)::

    reader -> owner   read     {"id", "ranges": [[offset, bytes], ...]}   SSD GVA offsets, one per chunk
    owner  -> reader  plan     {"id", "pieces", "slot_bytes"}              how many pieces follow
    owner  -> reader  ready    {"id", "piece", "slot", "addr", "used", "chunks": [[j, slot_off], ...]}
    owner  -> reader  failed   {"id", "piece", "chunks": [j, ...]}         the disk refused that piece
    reader -> owner   release  {"id", "slot"}                              pulled: the slot is free again

The owner plans the ranges (:func:`plan_pieces`: sorted, each chunk widened to 4 KiB, adjacent and
overlapping ranges of one file merged, packed into pieces of at most one slot, the first and last
at most :data:`EDGE_BYTES`), reads each piece with
O_DIRECT ``preadv`` (buffered where the filesystem refuses O_DIRECT) into a free slot of a
Transfer-Engine-registered staging ring of at least two slots, and says ``ready``; the reader pulls
the slot with the Transfer Engine and releases it. With two slots the owner's disk read of piece
``k+1`` overlaps the reader's pull of piece ``k``.

The same socket serves other verbs registered with :meth:`SsdOwnerServer.add_handler` between read
requests: ``store`` (write-time placement on this node, :mod:`flatcake.cluster.guest`).

This is a simple sorted/merged pread, not FC-CIO's restore planner: that one plans a local restore
into a host pool (its destinations are page slots), here the destination is a staging slot.

Bounded waits: the owner drops a request whose reader has not released a slot within
``timeout_s`` (the reader is gone) and frees its slots; the reader turns every page not yet
arrived into a miss when the owner is silent for ``timeout_s`` (the owner is gone). Neither raises.
"""

from __future__ import annotations

import collections
import json
import logging
import os
import threading
import time
from dataclasses import dataclass, field
from typing import Callable, Optional, Sequence

from flatcake.common.align import ALIGN, align_down, align_up
from flatcake.cluster.transfer import RegisteredBuffer, TransferEndpoint
from flatcake.media.directio import probe_direct_io

log = logging.getLogger(__name__)

#: first and last piece of a request at most this many bytes (:func:`plan_pieces`' ``edge_bytes``):
#: the reader's first pull starts after a 4 MiB disk read, not a slot's. bench_cluster.py, 2 x 16 MiB
#: slots, 5 interleaved runs each (2026-12-01): 4 MiB 0.58-0.67x raw, 2 MiB 0.51-0.57x, none 0.46-0.61x
EDGE_BYTES = 4 << 20


@dataclass
class Piece:
    """One slot's worth of a request: file runs read back to back, and where each chunk landed.

    Attributes:
        runs: ``(file_index, file_offset, nbytes, slot_offset)``, all 4 KiB aligned.
        chunks: ``(j, slot_offset)``: request range ``j`` starts at ``slot_offset`` in the slot.
        used: bytes of the slot the runs fill.
    """

    runs: list = field(default_factory=list)
    chunks: list = field(default_factory=list)
    used: int = 0


def _spans(ranges: Sequence[Sequence[int]], file_bytes: int, slot_bytes: int) -> list[tuple[int, int, int, int, int]]:
    """The ranges in offset order as ``(j, file_index, in-file offset, aligned start, aligned end)``
    (bytes; 4 KiB alignment). Raises ValueError: a range crosses a file end or needs more than a slot."""
    spans = []
    for j in sorted(range(len(ranges)), key=lambda j: ranges[j][0]):
        off, n = int(ranges[j][0]), int(ranges[j][1])
        fi, fo = divmod(off, file_bytes)
        if fo + n > file_bytes:
            raise ValueError(f"range {off}+{n} crosses the end of pool file {fi}")
        a0, a1 = align_down(fo), align_up(fo + n)
        if a1 - a0 > slot_bytes:
            raise ValueError(f"a {n}-byte chunk needs more than one {slot_bytes}-byte staging slot")
        spans.append((j, fi, fo, a0, a1))
    return spans


def _piece_caps(spans: list, slot_bytes: int, edge_bytes: int) -> tuple[int, int]:
    """``(first, rest)`` piece caps in bytes: the first piece at most ``edge_bytes`` and the middle
    ones of equal size (<= a slot) so that what is left for the last one is about ``edge_bytes``;
    ``(slot_bytes, slot_bytes)`` when ``edge_bytes`` is 0 or the request is small."""
    total, end = 0, (-1, 0)  # bytes after merging; (file, end offset) of the last run
    for _j, fi, _fo, a0, a1 in spans:
        if end[0] == fi and a0 <= end[1]:  # merges with the last run: only what extends it
            total, end = total + max(0, a1 - end[1]), (fi, max(a1, end[1]))
        else:
            total, end = total + a1 - a0, (fi, a1)
    if not edge_bytes or total <= 2 * edge_bytes:
        return slot_bytes, slot_bytes
    middle = total - 2 * edge_bytes
    n = -(-middle // slot_bytes)
    return min(edge_bytes, slot_bytes), min(slot_bytes, align_up(-(-middle // n)))


def plan_pieces(ranges: Sequence[Sequence[int]], file_bytes: int, slot_bytes: int, edge_bytes: int = 0) -> list[Piece]:
    """Sort, align, merge and pack chunk ranges into pieces of at most one slot.

    Args:
        ranges: ``[(offset, nbytes), ...]`` SSD GVA offsets (``file_index * file_bytes + in-file``).
        file_bytes: bytes per pool file; slot_bytes: bytes per staging slot (multiple of 4096).
        edge_bytes: 0, or the first and last pieces' size (bytes, ~; multiple of 4096): the middle
            pieces are of equal size up to a slot. A small first piece lets the reader's first pull
            start after a short disk read, a small last one shortens the reader's last pull and check.

    Returns:
        Pieces in file-offset order; every range appears in exactly one piece.

    Raises:
        ValueError: a range crosses a file end, or needs more than one slot.
    """
    spans = _spans(ranges, file_bytes, slot_bytes)
    cap, rest = _piece_caps(spans, slot_bytes, edge_bytes)
    pieces: list[Piece] = []
    cur = Piece()
    for j, fi, fo, a0, a1 in spans:
        last = cur.runs[-1] if cur.runs else None
        if last and last[0] == fi and last[1] <= a0 <= last[1] + last[2]:  # extends the last run
            grow = max(0, a1 - (last[1] + last[2]))
            if cur.used + grow <= cap:
                cur.runs[-1] = (fi, last[1], last[2] + grow, last[3])
                cur.used += grow
                cur.chunks.append((j, last[3] + fo - last[1]))
                continue
        if cur.runs and cur.used + (a1 - a0) > cap:
            pieces.append(cur)
            cur, cap = Piece(), rest
        cur.runs.append((fi, a0, a1 - a0, cur.used))
        cur.chunks.append((j, cur.used + fo - a0))
        cur.used += a1 - a0
    if cur.runs:
        pieces.append(cur)
    return pieces


class _FileReader:
    """Cached read-only fds of the pool files, O_DIRECT where the directory takes it."""

    def __init__(self, path_of: Callable[[int], str]):
        self.path_of = path_of
        self._fds: dict[int, int] = {}
        self._direct: dict[str, bool] = {}

    def fd(self, file_index: int) -> int:
        """The read-only fd of pool file ``file_index`` (opened on first use). Raises OSError."""
        fd = self._fds.get(file_index)
        if fd is None:
            path = self.path_of(file_index)
            d = os.path.dirname(path) or "."
            if d not in self._direct:
                self._direct[d] = probe_direct_io(d)
            flags = os.O_RDONLY | (os.O_DIRECT if self._direct[d] else 0)
            fd = self._fds[file_index] = os.open(path, flags)
        return fd

    def read_piece(self, piece: Piece, slot: memoryview) -> None:
        """preadv every run of ``piece`` into ``slot``. Raises OSError (errno) on a failed or short read."""
        for fi, fo, n, so in piece.runs:
            got = os.preadv(self.fd(fi), [slot[so: so + n]], fo)
            if got < n:  # past the end of a file: the extent is gone
                raise OSError(5, f"short read of pool file {fi} at {fo}: {got} of {n} bytes")

    def close(self) -> None:
        """Close every cached fd."""
        for fd in self._fds.values():
            os.close(fd)
        self._fds.clear()


class SsdOwnerServer:
    """Serves this node's SSD extents to other nodes (see the module docstring).

    Args:
        endpoint: this node's :class:`TransferEndpoint` (the staging ring is registered with it).
        path_of: pool file index -> path (``SsdFilePool.path_of``).
        file_bytes: bytes per pool file (``ssd.file_bytes``).
        bind: zmq endpoint to bind, e.g. ``tcp://10.78.0.10:5601`` (``tcp://*:0`` picks a port).
        slots: staging slots (>= 2: the disk read of one overlaps the pull of another).
        slot_bytes: bytes per slot (multiple of 4096).
        timeout_s: a reader that has not released a slot for this long is dropped (seconds).

    Attributes:
        endpoint_url: the bound zmq endpoint (what goes into the node's descriptor).

    Raises:
        ValueError: fewer than 2 slots or an unaligned slot size.
        TransferError: the ring could not be registered.
        zmq.ZMQError: the address cannot be bound.
    """

    def __init__(self, endpoint: TransferEndpoint, path_of: Callable[[int], str], file_bytes: int, bind: str,
                 slots: int = 2, slot_bytes: int = 16 << 20, timeout_s: float = 2.0):
        import zmq

        if slots < 2 or slot_bytes <= 0 or slot_bytes % ALIGN:
            raise ValueError(f"staging ring: >= 2 slots of a multiple of {ALIGN} bytes (got {slots} x {slot_bytes})")
        self.file_bytes, self.slots, self.slot_bytes, self.timeout_s = file_bytes, slots, slot_bytes, timeout_s
        self.ring = RegisteredBuffer(endpoint, slots * slot_bytes)
        self._files = _FileReader(path_of)
        self._ctx = zmq.Context.instance()
        self._sock = self._ctx.socket(zmq.ROUTER)
        self._sock.setsockopt(zmq.LINGER, 0)
        self._sock.bind(bind)
        self.endpoint_url = self._sock.getsockopt_string(zmq.LAST_ENDPOINT)
        self._queue: collections.deque = collections.deque()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._serve, name="flatcake-remote-ssd", daemon=True)
        self.requests = 0
        self.pieces_served = 0
        self.dropped = 0
        self.read_errors = 0
        self.read_s = 0.0  # seconds spent reading pieces from the disk
        self.piece_delay_s = 0.0  # tests: a slow disk (seconds of sleep before each piece)
        self.edge_bytes = EDGE_BYTES  # first and last piece of a request (plan_pieces)
        self._logged: set[int] = set()
        self._handlers: dict[str, Callable[[dict], tuple[str, dict]]] = {}

    def add_handler(self, verb: str, fn: Callable[[dict], tuple[str, dict]]) -> None:
        """Serve another verb on this socket: ``fn(body)`` returns the reply ``(verb, body)``,
        sent to the requester. Runs on the server thread between read requests (it delays
        them while it runs); an exception is logged and answered ``error``. Used by write-time
        placement on this node (:mod:`flatcake.cluster.guest`: verb ``store``). Add handlers
        before the first request arrives."""
        if verb in ("read", "release"):
            raise ValueError(f"verb {verb!r} is the SSD read protocol's")
        self._handlers[verb] = fn

    def start(self) -> "SsdOwnerServer":
        """Start the server thread."""
        self._thread.start()
        return self

    def close(self) -> None:
        """Stop the server thread, close the socket and the files."""
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(timeout=2.0)
        self._sock.close(0)
        self._files.close()

    def _recv(self, timeout_s: float) -> Optional[tuple[bytes, str, dict]]:
        if not self._sock.poll(int(timeout_s * 1000)):
            return None
        ident, verb, body = self._sock.recv_multipart()
        return ident, verb.decode(), json.loads(body)

    def _send(self, ident: bytes, verb: str, body: dict) -> None:
        self._sock.send_multipart([ident, verb.encode(), json.dumps(body).encode()])

    def _serve(self) -> None:
        while not self._stop.is_set():
            msg = self._queue.popleft() if self._queue else self._recv(0.1)
            if msg is not None and msg[1] in self._handlers:
                self._handle(*msg)
                continue
            if msg is None or msg[1] != "read":
                continue  # a release of a request already dropped
            try:
                self._serve_one(msg[0], msg[2])
            except Exception as e:  # never let the server thread die: the request is dropped
                log.warning("remote SSD server: request dropped (%s: %s)", type(e).__name__, e)
                self.dropped += 1

    def _handle(self, ident: bytes, verb: str, body: dict) -> None:
        try:
            reply, out = self._handlers[verb](body)
        except Exception as e:  # never let the server thread die
            log.warning("remote SSD server: %s request failed (%s: %s)", verb, type(e).__name__, e)
            reply, out = "error", {"id": body.get("id"), "error": f"{type(e).__name__}: {e}"}
        self._send(ident, reply, out)

    def _serve_one(self, ident: bytes, req: dict) -> None:
        rid = req["id"]
        self.requests += 1
        try:
            pieces = plan_pieces(req["ranges"], self.file_bytes, self.slot_bytes, self.edge_bytes)
        except (ValueError, KeyError, TypeError) as e:
            self._send(ident, "plan", {"id": rid, "pieces": 0, "error": str(e)})
            return
        self._send(ident, "plan", {"id": rid, "pieces": len(pieces), "slot_bytes": self.slot_bytes})
        free = list(range(self.slots))
        for k, piece in enumerate(pieces):
            if not free and not self._wait_release(ident, rid, free):
                self.dropped += 1  # the reader is gone: its slots are ours again
                return
            slot = free.pop(0)
            if self.piece_delay_s:
                time.sleep(self.piece_delay_s)
            view = memoryview(self.ring.array)[slot * self.slot_bytes: (slot + 1) * self.slot_bytes]
            t0 = time.perf_counter()
            try:
                self._files.read_piece(piece, view)
            except OSError as e:
                self.read_errors += 1
                if e.errno not in self._logged:
                    self._logged.add(e.errno)
                    log.warning("remote SSD server: read failed (errno %s: %s); those pages are misses", e.errno, e)
                free.append(slot)
                self._send(ident, "failed", {"id": rid, "piece": k, "chunks": [j for j, _ in piece.chunks]})
                continue
            self.read_s += time.perf_counter() - t0
            self._send(ident, "ready", {"id": rid, "piece": k, "slot": slot, "used": piece.used,
                                        "addr": self.ring.addr + slot * self.slot_bytes, "chunks": piece.chunks})
            self.pieces_served += 1
        # the next request may only reuse slots this reader has pulled
        while len(free) < self.slots:
            if not self._wait_release(ident, rid, free):
                self.dropped += 1
                return

    def _wait_release(self, ident: bytes, rid: int, free: list) -> bool:
        """Wait for the current reader to release a slot, queueing other requests meanwhile.
        Returns False when it stayed silent for ``timeout_s``."""
        deadline = time.monotonic() + self.timeout_s
        while not self._stop.is_set():
            left = deadline - time.monotonic()
            if left <= 0:
                return False
            msg = self._recv(min(left, 0.1))
            if msg is None:
                continue
            if msg[1] == "read" or msg[1] in self._handlers:
                self._queue.append(msg)
            elif msg[1] == "release" and msg[0] == ident and msg[2].get("id") == rid:
                free.append(int(msg[2]["slot"]))
                return True
        return False
