"""The data plane's transport: Mooncake Transfer Engine endpoints, registered buffers, the
per-node data-plane descriptor in etcd, and the checksum check every remote read ends with
(paper §3.1: GVA node routing; issue 12).

Lifecycle of a node's data plane::

    TransferEndpoint(host)          one Transfer Engine, P2PHANDSHAKE (no Mooncake master), tcp
      -> register(addr, nbytes)     the owner's DRAM region / SSD staging ring, the reader's landing
      -> read(peer, ...)            batch reads of a peer's registered memory into ours
      -> publish_descriptor(...)    P/dataplane/<node> on the node's lease: where the others find
                                    its Transfer Engine, DRAM region and SSD server
      -> close()

Every Transfer Engine listener binds ``0.0.0.0`` whatever ``host`` says
(/work/shared/design/scale-out-facts.md): run nodes in their own network namespaces.

The Mooncake wheel (``mooncake-transfer-engine-non-cuda``) loads ``libibverbs.so.1`` at import
without declaring it (``scripts/setup_ibverbs.sh`` installs Debian's ``libibverbs1``);
:func:`te_unavailable_reason` says what is missing.
"""

from __future__ import annotations

import json
import math
import os
import threading
import time
from dataclasses import asdict, dataclass
from typing import Optional, Sequence

import numpy as np

from flatcake.cio.pagecopy import checksums_at
from flatcake.media.directio import aligned_host_buffer

#: key of a node's data-plane descriptor under the cluster prefix
DATAPLANE_DIR = "dataplane"


def te_unavailable_reason() -> Optional[str]:
    """Why the Mooncake Transfer Engine cannot be used here, or None when it can."""
    try:
        from mooncake.engine import TransferEngine  # noqa: F401
    except ImportError as e:
        if "libibverbs" in str(e):
            return ("the Mooncake wheel needs libibverbs.so.1 (Debian package libibverbs1; "
                    "scripts/setup_ibverbs.sh installs it)")
        return f"the Mooncake Transfer Engine is not importable (pip install the mooncake extra): {e}"
    except OSError as e:
        return f"the Mooncake Transfer Engine failed to load: {e}"
    return None


class TransferError(RuntimeError):
    """The Transfer Engine could not be initialised or a registration failed."""


class TransferEndpoint:
    """One Mooncake Transfer Engine in ``P2PHANDSHAKE`` metadata mode over ``tcp``.

    Args:
        host: this node's address as the other nodes reach it (an IP of its namespace).
        timeout_s: how long a batch may stall before it fails (seconds). The engine reads it from
            ``MC_TRANSFER_TIMEOUT`` when it is created (whole seconds, at least 5; plus 1 ns per
            byte of the batch), so this sets that variable unless it is already set: an owner cut
            off mid-read (no reset, no progress) costs a reader at most about this long. An owner
            that is gone (connection refused) fails at once.

    Attributes:
        address: ``host:rpc_port``, the name the other nodes read this node's memory by.

    Raises:
        TransferError: the engine did not initialise (message with its status).
        ImportError: the Mooncake wheel is missing or cannot load (see :func:`te_unavailable_reason`).
    """

    def __init__(self, host: str, timeout_s: float = 5.0):
        os.environ.setdefault("GLOG_minloglevel", "2")  # the engine logs every handshake at INFO
        os.environ.setdefault("MC_TRANSFER_TIMEOUT", str(max(5, math.ceil(timeout_s))))
        from mooncake.engine import TransferEngine

        self._te = TransferEngine()
        rc = self._te.initialize(host, "P2PHANDSHAKE", "tcp", "")
        if rc != 0:
            raise TransferError(f"Transfer Engine initialize({host!r}, P2PHANDSHAKE, tcp) returned {rc}")
        self.address = f"{host}:{self._te.get_rpc_port()}"
        self._registered: list[int] = []
        self._lock = threading.Lock()
        self.reads = 0
        self.read_failures = 0

    def register(self, addr: int, nbytes: int) -> None:
        """Register ``nbytes`` bytes at ``addr`` (host memory that outlives the endpoint's use of it).

        Raises:
            TransferError: the engine refused it.
        """
        rc = self._te.register_memory(int(addr), int(nbytes))
        if rc != 0:
            raise TransferError(f"Transfer Engine register_memory({addr:#x}, {nbytes}) returned {rc}")
        with self._lock:
            self._registered.append(int(addr))

    def read(self, peer: str, local: Sequence[int], remote: Sequence[int], lengths: Sequence[int]) -> bool:
        """One batch read of ``lengths[i]`` bytes from ``remote[i]`` in ``peer``'s registered memory to
        ``local[i]`` in ours (registered). Returns True when every entry arrived; False when the
        batch failed (peer gone, range outside its registrations); never raises."""
        if not local:
            return True
        try:
            rc = self._te.batch_transfer_sync_read(peer, list(local), list(remote), list(lengths))
        except Exception:  # a binding error is a failed read, like a status
            rc = -1
        self.reads += 1
        if rc != 0:
            self.read_failures += 1
        return rc == 0

    def submit(self, peer: str, local: Sequence[int], remote: Sequence[int], lengths: Sequence[int]) -> int:
        """Start a batch read (as :meth:`read`) and return at once. Returns its batch id, 0 when it
        could not start (peer unreachable); finish it with :meth:`wait`. Never raises."""
        try:
            bid = int(self._te.batch_transfer_async_read(peer, list(local), list(remote), list(lengths)))
        except Exception:
            bid = 0
        self.reads += 1
        if not bid:
            self.read_failures += 1
        return bid

    def wait(self, batch_id: int) -> bool:
        """Block until batch ``batch_id`` (from :meth:`submit`) is done; True when every entry
        arrived. ``batch_id`` 0 (not started) is False. Never raises."""
        if not batch_id:
            return False
        try:
            rc = self._te.get_batch_transfer_status([batch_id])
        except Exception:
            rc = -1
        if rc != 0:
            self.read_failures += 1
        return rc == 0

    def close(self) -> None:
        """Unregister every buffer registered here (the engine itself lives until the process ends)."""
        with self._lock:
            addrs, self._registered = self._registered, []
        for a in addrs:
            try:
                self._te.unregister_memory(a)
            except Exception:
                pass


class RegisteredBuffer:
    """A page-aligned host buffer registered with a :class:`TransferEndpoint`.

    Args:
        endpoint: the engine to register with.
        nbytes: size in bytes (a positive multiple of 4096).

    The buffer is made once and kept (staging ring, landing buffer, outbox), so it asks for
    transparent huge pages and is faulted in at start-up, like FC-CIO's staging windows
    (:func:`~flatcake.media.directio.aligned_host_buffer`, ``huge=True``; ``FLATCAKE_HUGEPAGES=0``:
    ordinary pages): the owner's O_DIRECT reads and both engines' socket copies walk 2 MiB pages.

    Attributes:
        array: uint8 ``[nbytes]`` numpy view; ``addr``: its address.

    Raises:
        ValueError: ``nbytes`` not a positive multiple of 4096.
        TransferError: the registration failed.
    """

    def __init__(self, endpoint: TransferEndpoint, nbytes: int):
        _t, self.array, self._mapping = aligned_host_buffer(nbytes, huge=True)
        self.nbytes = nbytes
        self.addr = int(self.array.ctypes.data)
        endpoint.register(self.addr, nbytes)


class LandingPool:
    """A reader's landing buffer, replaced after a failed transfer without unbounded growth.

    After a failed or timed-out batch the engine may still write into the buffer it targeted, so
    that buffer is quarantined: kept mapped and registered, not reused for ``quarantine_s``
    seconds (the engine's TCP sessions give up after 30 s without progress). The replacement is
    the oldest buffer whose quarantine is over, else a new one while fewer than ``max_quarantined``
    are quarantined, else none: reads are misses until a quarantine ends (a flapping owner costs at
    most ``(1 + max_quarantined) * nbytes`` of memory, never a reused buffer still in flight).

    Args:
        endpoint: the engine to register with (anything with ``register(addr, nbytes)``).
        nbytes: bytes per buffer (multiple of 4096).
        quarantine_s, max_quarantined: see above.
        clock: monotonic seconds, for tests.
    """

    def __init__(self, endpoint, nbytes: int, quarantine_s: float = 60.0, max_quarantined: int = 8,
                 clock=time.monotonic):
        self.endpoint, self.nbytes = endpoint, nbytes
        self.quarantine_s, self.max_quarantined, self.clock = quarantine_s, max_quarantined, clock
        self.current: Optional[RegisteredBuffer] = RegisteredBuffer(endpoint, nbytes)
        self._quarantine: list[tuple[float, RegisteredBuffer]] = []
        self.retirements = 0

    def get(self) -> Optional[RegisteredBuffer]:
        """The buffer to land in, or None while every buffer is quarantined (a miss)."""
        if self.current is None:
            self.current = self._replacement()
        return self.current

    def retire(self) -> None:
        """Quarantine the current buffer (a transfer into it failed) and pick a replacement."""
        if self.current is not None:
            self._quarantine.append((self.clock(), self.current))
            self.retirements += 1
        self.current = None
        self.current = self._replacement()

    def quarantined(self) -> int:
        """Buffers in quarantine now."""
        return len(self._quarantine)

    def _replacement(self) -> Optional[RegisteredBuffer]:
        if self._quarantine and self.clock() - self._quarantine[0][0] >= self.quarantine_s:
            return self._quarantine.pop(0)[1]
        if len(self._quarantine) < self.max_quarantined:
            return RegisteredBuffer(self.endpoint, self.nbytes)
        return None


@dataclass(frozen=True)
class DataPlaneDescriptor:
    """Where another node finds this node's data plane (``P/dataplane/<node>``, on its lease).

    Attributes:
        node: node id.
        te: Transfer Engine address ``host:rpc_port``.
        dram_addr: address of the DRAM region in the owner's process (0: no DRAM exported).
        dram_bytes: size of the region in bytes (a DRAM GVA offset must stay below it).
        ssd_rpc: zmq endpoint ``tcp://host:port`` of the owner-served SSD reads ('' = none).
    """

    node: int
    te: str
    dram_addr: int = 0
    dram_bytes: int = 0
    ssd_rpc: str = ""

    def encode(self) -> bytes:
        """Compact JSON bytes (the etcd value)."""
        return json.dumps(asdict(self), separators=(",", ":")).encode()

    @classmethod
    def decode(cls, raw: bytes) -> "DataPlaneDescriptor":
        """Parse :meth:`encode`'s bytes. Raises ValueError when they are not a descriptor."""
        try:
            d = json.loads(raw)
            return cls(int(d["node"]), str(d["te"]), int(d["dram_addr"]), int(d["dram_bytes"]), str(d["ssd_rpc"]))
        except (ValueError, KeyError, TypeError) as e:
            raise ValueError(f"undecodable data-plane descriptor: {e}") from None


def descriptor_key(prefix: str, node: int) -> str:
    """``P/dataplane/<node>`` (node id in 4 decimal digits, as the other keys)."""
    return f"{prefix}/{DATAPLANE_DIR}/{node:04d}"


def publish_descriptor(session, prefix: str, desc: DataPlaneDescriptor, lease: int) -> None:
    """Put ``desc`` under :func:`descriptor_key` on ``lease`` (it vanishes with the node).

    Raises:
        EtcdUnavailable: no etcd endpoint answered.
    """
    session.put(descriptor_key(prefix, desc.node), desc.encode(), lease)


def lookup_descriptor(session, prefix: str, node: int) -> Optional[DataPlaneDescriptor]:
    """``node``'s descriptor from etcd, or None (not published, gone with its lease, undecodable).

    Raises:
        EtcdUnavailable: no etcd endpoint answered.
    """
    raw = session.get(descriptor_key(prefix, node))
    if raw is None:
        return None
    try:
        return DataPlaneDescriptor.decode(raw)
    except ValueError:
        return None


def page_checksums(pages: np.ndarray, layers: int, chunk_bytes: int) -> np.ndarray:
    """xxh3-64 (seed 0, the SSD extent format's) of every chunk of page-major pages.

    Args:
        pages: contiguous uint8 ``[n, layers * chunk_bytes]`` (DRAM slots' layout).
        layers, chunk_bytes: chunks per page and bytes per chunk.

    Returns:
        uint64 ``[n, layers]``: what a round record carries in ``sums``.
    """
    n = pages.shape[0]
    flat = np.ascontiguousarray(pages).reshape(-1)
    starts = range(0, n * layers * chunk_bytes, chunk_bytes)
    return checksums_at(flat, starts, chunk_bytes).reshape(n, layers)


def verify_landed(landing: np.ndarray, sums: Sequence[Optional[np.ndarray]], layers: int, chunk_bytes: int) -> np.ndarray:
    """Which landed pages match their record's checksums.

    Args:
        landing: uint8 ``[n * layers * chunk_bytes]``, page ``i``'s chunks back to back at
            ``i * layers * chunk_bytes``.
        sums: per page, uint64 ``[layers]`` from the round record, or None (unverifiable: a miss).

    Returns:
        bool ``[n]``: True where every chunk's xxh3-64 equals the record's.
    """
    ok = np.zeros(len(sums), dtype=bool)
    page_bytes = layers * chunk_bytes
    for i, want in enumerate(sums):
        if want is None or len(want) != layers:
            continue
        got = checksums_at(landing, range(i * page_bytes, (i + 1) * page_bytes, chunk_bytes), chunk_bytes)
        ok[i] = bool(np.array_equal(got, np.asarray(want, dtype=np.uint64)))
    return ok


@dataclass
class RemoteReadResult:
    """The outcome of reading pages from another node.

    Attributes:
        data: uint8 ``[n, layers * chunk_bytes]``: page ``i``'s chunks (layer order) where ``hit[i]``,
            undefined elsewhere.
        hit: bool ``[n]``: page ``i`` arrived and matched its record's checksums.
        misses: counts by cause: ``mismatch`` (bytes changed under the reader), ``unverifiable``
            (no checksum in the record), ``failed`` (transfer failed: owner gone, out of range),
            ``timeout`` (owner did not answer in time), ``unknown_owner`` (no descriptor).
    """

    data: np.ndarray
    hit: np.ndarray
    misses: dict

    @classmethod
    def empty(cls, n: int, page_bytes: int, out: Optional[np.ndarray] = None) -> "RemoteReadResult":
        """All-miss result for ``n`` pages of ``page_bytes`` bytes, its ``data`` in ``out`` (uint8
        ``[>= n, page_bytes]``, e.g. a preallocated staging area) or a new array.

        Raises:
            ValueError: ``out`` has the wrong dtype or shape."""
        if out is None:
            out = np.empty((n, page_bytes), dtype=np.uint8)
        elif out.dtype != np.uint8 or out.ndim != 2 or out.shape[0] < n or out.shape[1] != page_bytes:
            raise ValueError(f"out: uint8 [>= {n}, {page_bytes}] expected, got {out.dtype} {list(out.shape)}")
        return cls(out[:n], np.zeros(n, dtype=bool),
                   {"mismatch": 0, "unverifiable": 0, "failed": 0, "timeout": 0, "unknown_owner": 0})
