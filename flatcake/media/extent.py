"""On-SSD format: self-describing extents of layer-major rounds (paper §3.3, FC-CIO write side).

A session scope owns one or more *extents*: contiguous, 4 KiB-aligned byte ranges inside a
preallocated pool file. Inside an extent::

    [extent header 4 KiB] [round 0] [round 1] ...
    round = [round header 4 KiB] [data: chunks layer-major, padded to 4 KiB] [record, padded to 4 KiB]

* data: chunk(page p, layer l) at ``BLOCK + (l * n_pages + p) * chunk_bytes`` from the round's
  start; so one layer of a round is one contiguous range.
* record: namespace digest, the round's identity (scope id, sequence number, nonce), page
  count, layers, chunk bytes, the page keys, and the xxh3-64 of every chunk; its own xxh3-64
  last. It is written *after* the header and data, by a second write (see
  ``docs/durability.md``): a round whose record does not validate (torn write) does not exist.

Every round carries a random 64-bit *nonce*, in its header and in its record. A reader accepts
a round only when header and record agree on scope id, sequence number and nonce, so bytes left
from an earlier round or extent at the same offset (space is reused after reclaim) can never
pass for this round. The pool journal (:mod:`flatcake.gva.journal`) records where each round
lives, so a restart finds them without scanning the files (:mod:`flatcake.gva.rebuild`).

All integers little-endian. Every header and record ends with the xxh3-64 of its preceding bytes.
"""

from __future__ import annotations

import os
import struct
from dataclasses import dataclass
from typing import Sequence

import numpy as np
import xxhash

from flatcake.align import ALIGN, align_up

BLOCK = ALIGN  # bytes: every header, record and round starts and ends on a 4 KiB block
EXTENT_MAGIC = b"FCEXTNT2"
ROUND_MAGIC = b"FCROUND2"
RECORD_MAGIC = b"FCRECRD2"
FORMAT_VERSION = 2

_EXT = struct.Struct("<8sIIQQQ16sI")  # magic, version, node, scope_id, extent_seq, reserved_bytes, ns digest, ns len
_RND = struct.Struct("<8sIIIIQQQQQ")  # magic, version, seq, n_pages, layers, chunk_bytes, data_bytes, record_bytes, scope_id, nonce
_REC = struct.Struct("<8s16sIIQQQQ")  # magic, ns digest, n_pages, layers, chunk_bytes, keys_bytes, scope_id, nonce + seq below
_REC_SEQ = struct.Struct("<I")


def new_nonce() -> int:
    """A random non-zero 64-bit round nonce."""
    return int.from_bytes(os.urandom(8), "little") or 1


def namespace_digest(namespace: str) -> bytes:
    """16-byte digest naming a namespace in every header and record."""
    return xxhash.xxh3_128_digest(namespace.encode())


def _seal(body: bytes) -> bytes:
    return body + struct.pack("<Q", xxhash.xxh3_64_intdigest(body))


def _check(buf: bytes) -> bytes | None:
    body, crc = buf[:-8], struct.unpack("<Q", buf[-8:])[0]
    return body if xxhash.xxh3_64_intdigest(body) == crc else None


def pack_extent_header(namespace: str, node: int, scope_id: int, extent_seq: int, reserved_bytes: int) -> bytes:
    """The 4 KiB block that opens an extent (for people and tools reading a pool file; the
    restart finds rounds through the pool journal)."""
    ns = namespace.encode()
    body = _EXT.pack(EXTENT_MAGIC, FORMAT_VERSION, node, scope_id, extent_seq, reserved_bytes, namespace_digest(namespace), len(ns)) + ns
    out = _seal(body)
    if len(out) > BLOCK:
        raise ValueError(f"namespace too long for the extent header ({len(ns)} bytes)")
    return out.ljust(BLOCK, b"\0")


@dataclass(frozen=True)
class ExtentHeader:
    """Decoded extent header."""

    node: int
    scope_id: int
    extent_seq: int
    reserved_bytes: int
    namespace: str


def unpack_extent_header(block: bytes) -> ExtentHeader | None:
    """Parse an extent header block; ``None`` if it is not a valid one."""
    if block[:8] != EXTENT_MAGIC:
        return None
    _, _, node, sid, seq, res, _, nlen = _EXT.unpack_from(block)
    end = _EXT.size + nlen
    if end + 8 > len(block) or _check(bytes(block[: end + 8])) is None:
        return None
    return ExtentHeader(node, sid, seq, res, bytes(block[_EXT.size : end]).decode())


@dataclass(frozen=True)
class RoundLayout:
    """Byte layout of one round, relative to the round's start (its header).

    Attributes:
        n_pages: pages in the round.
        layers: chunks per page.
        chunk_bytes: bytes per (page, layer) chunk.
        data_bytes: bytes of the data section (padded to 4 KiB).
        record_bytes: bytes of the record section (padded to 4 KiB).
    """

    n_pages: int
    layers: int
    chunk_bytes: int
    data_bytes: int
    record_bytes: int

    @property
    def record_offset(self) -> int:
        """Offset of the record from the round's start (bytes)."""
        return BLOCK + self.data_bytes

    @property
    def total_bytes(self) -> int:
        """Bytes of the whole round: header, data and record."""
        return BLOCK + self.data_bytes + self.record_bytes

    def chunk_offset(self, page: int, layer: int) -> int:
        """Offset of chunk (page, layer) from the round's start (bytes)."""
        return BLOCK + (layer * self.n_pages + page) * self.chunk_bytes


def record_size(keys: Sequence[str], layers: int) -> int:
    """Unpadded bytes of a round's record."""
    kb = sum(2 + len(k.encode()) for k in keys)
    return _REC.size + _REC_SEQ.size + kb + 8 * layers * len(keys) + 8


def round_layout(keys: Sequence[str], layers: int, chunk_bytes: int) -> RoundLayout:
    """Layout of a round holding ``keys`` (one page each)."""
    return RoundLayout(
        len(keys), layers, chunk_bytes, align_up(len(keys) * layers * chunk_bytes), align_up(record_size(keys, layers))
    )


@dataclass(frozen=True)
class RoundHeader:
    """Decoded round header: the round's layout and identity."""

    layout: RoundLayout
    seq: int
    scope_id: int
    nonce: int


def pack_round_header(lay: RoundLayout, seq: int, scope_id: int, nonce: int) -> bytes:
    """The 4 KiB block that opens a round."""
    body = _RND.pack(ROUND_MAGIC, FORMAT_VERSION, seq, lay.n_pages, lay.layers, lay.chunk_bytes, lay.data_bytes,
                     lay.record_bytes, scope_id, nonce)
    return _seal(body).ljust(BLOCK, b"\0")


def unpack_round_header(block: bytes) -> RoundHeader | None:
    """Parse a round header; ``None`` if it is not a valid one."""
    if block[:8] != ROUND_MAGIC or len(block) < _RND.size + 8 or _check(bytes(block[: _RND.size + 8])) is None:
        return None
    _, _, seq, n, layers, cb, db, rb, sid, nonce = _RND.unpack_from(block)
    return RoundHeader(RoundLayout(n, layers, cb, db, rb), seq, sid, nonce)


def pack_record(namespace: str, keys: Sequence[str], layers: int, chunk_bytes: int, checksums: np.ndarray,
                scope_id: int, seq: int, nonce: int) -> bytes:
    """The record written after a round's data.

    Args:
        namespace: the backend namespace (its digest is stored).
        keys: the round's page keys, in page order.
        layers, chunk_bytes: the round's geometry.
        checksums: uint64 ``[layers, n_pages]``, xxh3-64 of every chunk.
        scope_id, seq, nonce: the round's identity, as in its header.
    """
    kparts = []
    for k in keys:
        kb = k.encode()
        kparts.append(struct.pack("<H", len(kb)) + kb)
    kbytes = b"".join(kparts)
    body = _REC.pack(RECORD_MAGIC, namespace_digest(namespace), len(keys), layers, chunk_bytes, len(kbytes),
                     scope_id, nonce) + _REC_SEQ.pack(seq) + kbytes
    body += np.ascontiguousarray(checksums, dtype="<u8").tobytes()
    return _seal(body)


@dataclass(frozen=True)
class RoundRecord:
    """Decoded record: digest, identity, keys, chunk size and checksums ``[layers, n_pages]``."""

    ns_digest: bytes
    keys: tuple[str, ...]
    layers: int
    chunk_bytes: int
    checksums: np.ndarray
    scope_id: int = 0
    seq: int = 0
    nonce: int = 0

    def matches(self, header: RoundHeader) -> bool:
        """True when this record belongs to the round that ``header`` opens (same identity and geometry)."""
        lay = header.layout
        return ((self.scope_id, self.seq, self.nonce) == (header.scope_id, header.seq, header.nonce)
                and (len(self.keys), self.layers, self.chunk_bytes) == (lay.n_pages, lay.layers, lay.chunk_bytes))


def unpack_record(buf: bytes) -> RoundRecord | None:
    """Parse and validate a record; ``None`` if torn or not a record."""
    if buf[:8] != RECORD_MAGIC or len(buf) < _REC.size + _REC_SEQ.size:
        return None
    _, dig, n, layers, cb, kb, sid, nonce = _REC.unpack_from(buf)
    (seq,) = _REC_SEQ.unpack_from(buf, _REC.size)
    o = _REC.size + _REC_SEQ.size
    end = o + kb + 8 * layers * n
    if end + 8 > len(buf) or _check(bytes(buf[: end + 8])) is None:
        return None
    keys = []
    for _ in range(n):
        (ln,) = struct.unpack_from("<H", buf, o)
        keys.append(bytes(buf[o + 2 : o + 2 + ln]).decode())
        o += 2 + ln
    sums = np.frombuffer(bytes(buf[o:end]), dtype="<u8").reshape(layers, n).copy()
    return RoundRecord(dig, tuple(keys), layers, cb, sums, sid, seq, nonce)
