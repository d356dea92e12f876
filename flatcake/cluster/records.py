"""Record format and key layout of the cluster index in etcd (docs/cluster.md).

Key layout under the cluster prefix ``P`` (``cluster.prefix``, default ``/flatcake``); node ids
are 4 decimal digits, scope ids 16 hex digits, round sequence numbers 8 hex digits, so a range
read returns one node's rounds of one scope in write order::

    P/nodes/<node>                               registration (JSON), on the node's lease
    P/rounds/<node>/<scope>/<seq>                one published round (RoundRecord), on the node's lease
    P/capacity/<node>                            free DRAM/SSD bytes (JSON), on the node's lease
    P/reservations/<target>/<medium>/<node>-<id> bytes reserved on <target>'s medium, on the reserver's lease
    P/reserve-guard/<target>/<medium>            compare-and-swap guard of those reservations (no lease)

Retiring a scope deletes ``P/rounds/<node>/<scope>/`` (one delete-range): the delete events remove
its pages from every other node's view, as the lease expiry of a dead node does.

A :class:`RoundRecord` is compact JSON: ``{"v": 1, "node", "scope", "seq", "medium", "stride",
"t", "keys": [...], "gvas": [...], "layers", "sums"}`` where ``sums`` is the base64 of the
little-endian uint64 ``[pages, layers]`` xxh3-64 chunk checksums, or null (DRAM rounds carry none
today), and ``t`` the publisher's wall clock (seconds since the epoch; propagation delay).
"""

from __future__ import annotations

import base64
import json
import time
from dataclasses import dataclass
from typing import Optional, Sequence

import numpy as np

from flatcake.gva.address import MEDIUM_MASK, MEDIUM_SHIFT, NODE_MASK, NODE_SHIFT

RECORD_VERSION = 1


class RecordError(ValueError):
    """A record in etcd that cannot be decoded or contradicts itself (it is skipped)."""


def node_key(prefix: str, node: int) -> str:
    """``P/nodes/<node>``: the registration key held on the node's lease."""
    return f"{prefix}/nodes/{node:04d}"


def rounds_prefix(prefix: str) -> str:
    """``P/rounds/``: every published round of every node."""
    return f"{prefix}/rounds/"


def node_rounds_prefix(prefix: str, node: int) -> str:
    """``P/rounds/<node>/``: one node's published rounds."""
    return f"{prefix}/rounds/{node:04d}/"


def scope_prefix(prefix: str, node: int, scope_id: int) -> str:
    """``P/rounds/<node>/<scope>/``: the rounds of one scope (deleted as one when it retires)."""
    return f"{prefix}/rounds/{node:04d}/{scope_id:016x}/"


def round_key(prefix: str, node: int, scope_id: int, seq: int) -> str:
    """``P/rounds/<node>/<scope>/<seq>``: one round."""
    return f"{scope_prefix(prefix, node, scope_id)}{seq:08x}"


def node_of_round_key(prefix: str, key: str) -> Optional[int]:
    """The node id in a round key, or None when ``key`` is not one."""
    head = rounds_prefix(prefix)
    if not key.startswith(head):
        return None
    part = key[len(head):].split("/", 1)[0]
    return int(part) if part.isdigit() else None


def capacity_key(prefix: str, node: int) -> str:
    """``P/capacity/<node>``: the node's free bytes per medium."""
    return f"{prefix}/capacity/{node:04d}"


def reservations_prefix(prefix: str, target: int, medium: int) -> str:
    """``P/reservations/<target>/<medium>/``: every live reservation of one node's medium."""
    return f"{prefix}/reservations/{target:04d}/{medium}/"


def guard_key(prefix: str, target: int, medium: int) -> str:
    """``P/reserve-guard/<target>/<medium>``: bumped by every successful reservation (CAS)."""
    return f"{prefix}/reserve-guard/{target:04d}/{medium}"


def prefix_end(prefix: str) -> str:
    """The etcd ``range_end`` covering every key that starts with ``prefix``."""
    b = bytearray(prefix.encode())
    b[-1] += 1
    return b.decode()


@dataclass(frozen=True)
class RoundRecord:
    """One round a node published: pages of one scope written together (paper §3.1, FC-GVA).

    Attributes:
        node: the owner's node id (0..4095); every GVA's node field equals it.
        scope_id: the owner's scope id.
        seq: round sequence number inside the scope (0, 1, ...).
        medium: 0 DRAM / 1 SSD; every GVA's medium field equals it.
        keys: page keys (SGLang's page hashes), ``[pages]``.
        gvas: 64-bit GVAs of each page's layer-0 chunk, ``[pages]``.
        layer_stride: bytes from layer ``l``'s chunk to layer ``l+1``'s.
        checksums: uint64 ``[pages, layers]`` xxh3-64 per chunk, or None (no checksums).
        published_s: the publisher's ``time.time()`` (seconds) when it queued the round.
    """

    node: int
    scope_id: int
    seq: int
    medium: int
    keys: tuple
    gvas: tuple
    layer_stride: int
    checksums: Optional[np.ndarray] = None
    published_s: float = 0.0

    def __post_init__(self):
        if len(self.keys) != len(self.gvas):
            raise RecordError(f"{len(self.keys)} keys but {len(self.gvas)} gvas")
        for g in self.gvas:
            if (g & NODE_MASK) >> NODE_SHIFT != self.node or (g & MEDIUM_MASK) >> MEDIUM_SHIFT != self.medium:
                raise RecordError(f"GVA {g:#x} is not on node {self.node} medium {self.medium}")
        if self.checksums is not None and (self.checksums.ndim != 2 or self.checksums.shape[0] != len(self.keys)):
            raise RecordError(f"checksums shape {self.checksums.shape} does not match {len(self.keys)} pages")

    @classmethod
    def build(cls, node: int, scope_id: int, seq: int, medium: int, keys: Sequence[str], gvas: Sequence[int],
              layer_stride: int, checksums=None) -> "RoundRecord":
        """A record stamped with the current wall clock; ``checksums`` may be any array-like of
        shape ``[pages, layers]`` (copied to uint64) or None.

        Raises:
            RecordError: lengths, shapes or GVA fields disagree.
        """
        sums = None if checksums is None else np.ascontiguousarray(checksums, dtype=np.uint64)
        return cls(node, scope_id, seq, medium, tuple(keys), tuple(int(g) for g in gvas), int(layer_stride),
                   sums, time.time())

    def encode(self) -> bytes:
        """Compact JSON bytes (the etcd value)."""
        sums = None
        if self.checksums is not None:
            sums = base64.b64encode(self.checksums.astype("<u8", copy=False).tobytes()).decode()
        layers = 0 if self.checksums is None else int(self.checksums.shape[1])
        return json.dumps({"v": RECORD_VERSION, "node": self.node, "scope": self.scope_id, "seq": self.seq,
                           "medium": self.medium, "stride": self.layer_stride, "t": self.published_s,
                           "keys": list(self.keys), "gvas": list(self.gvas), "layers": layers, "sums": sums},
                          separators=(",", ":")).encode()

    @classmethod
    def decode(cls, raw: bytes) -> "RoundRecord":
        """Parse :meth:`encode`'s bytes.

        Raises:
            RecordError: not JSON, another version, missing fields or inconsistent contents.
        """
        try:
            d = json.loads(raw)
            if d.get("v") != RECORD_VERSION:
                raise RecordError(f"record version {d.get('v')!r}, expected {RECORD_VERSION}")
            sums = None
            if d["sums"] is not None:
                flat = np.frombuffer(base64.b64decode(d["sums"]), dtype="<u8").astype(np.uint64)
                sums = flat.reshape(len(d["keys"]), int(d["layers"]))
            return cls(int(d["node"]), int(d["scope"]), int(d["seq"]), int(d["medium"]), tuple(d["keys"]),
                       tuple(int(g) for g in d["gvas"]), int(d["stride"]), sums, float(d["t"]))
        except RecordError:
            raise
        except (ValueError, KeyError, TypeError) as e:
            raise RecordError(f"undecodable round record: {e}") from None


@dataclass(frozen=True, slots=True)
class RemotePage:
    """One page of another node, as the cluster view holds it (immutable; readers take no lock).

    Attributes:
        node: the owner's node id.
        gva: 64-bit GVA of the page's layer-0 chunk (its node field is ``node``).
        scope_id: the owner's scope id.
        layer_stride: bytes between the page's layer chunks.
        checksums: uint64 ``[layers]`` xxh3-64 per chunk, or None.
        record_key: the etcd key of the round it came from.
    """

    node: int
    gva: int
    scope_id: int
    layer_stride: int
    checksums: Optional[np.ndarray]
    record_key: str


def pages_of(record: RoundRecord, record_key: str) -> list[tuple[str, RemotePage]]:
    """``(page key, RemotePage)`` for every page of ``record``, in round order."""
    sums = record.checksums
    return [(k, RemotePage(record.node, g, record.scope_id, record.layer_stride,
                           None if sums is None else sums[i], record_key))
            for i, (k, g) in enumerate(zip(record.keys, record.gvas))]
