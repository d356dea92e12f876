"""On-SSD format: self-describing extents of layer-major rounds (paper §3.3, FC-CIO write side).

A session scope owns one or more *extents*: contiguous byte ranges inside a preallocated pool
file, each starting on an ``EXTENT_GRID`` (256 KiB) boundary (so a restarted process can find
every extent by probing grid points, one 4 KiB read each). Inside an extent::

    [extent header 4 KiB] [round 0] [round 1] ...
    round = [round header 4 KiB] [data: chunks layer-major, padded to 4 KiB] [record, padded to 4 KiB]

* data: chunk(page p, layer l) at ``data_offset + (l * n_pages + p) * chunk_bytes``; so one
  layer of a round is one contiguous range.
* record (written *after* its data, in file order): namespace digest, page count, layers,
  chunk bytes, the page keys, and the xxh3-64 of every chunk; its own xxh3-64 last. A round
  whose record does not validate (torn write) is not part of the extent.

All integers little-endian. Every header ends with the xxh3-64 of its preceding bytes.
Restart recovery (a later issue) walks: extent header -> round header -> record -> next round.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass
from typing import Sequence

import numpy as np
import xxhash

from flatcake.align import ALIGN, align_up

BLOCK = ALIGN  # bytes: every header, record and round starts and ends on a 4 KiB block
EXTENT_GRID = 256 << 10  # bytes: extents start on 256 KiB boundaries
EXTENT_MAGIC = b"FCEXTNT1"
ROUND_MAGIC = b"FCROUND1"
RECORD_MAGIC = b"FCRECRD1"
FORMAT_VERSION = 1

_EXT = struct.Struct("<8sIIQQQ16sI")  # magic, version, node, scope_id, extent_seq, reserved_bytes, ns digest, ns len
_RND = struct.Struct("<8sIIIIQQQQ")  # magic, version, seq, n_pages, layers, chunk_bytes, data_bytes, record_bytes, scope_id
_REC = struct.Struct("<8s16sIIQQ")  # magic, ns digest, n_pages, layers, chunk_bytes, keys_bytes


def namespace_digest(namespace: str) -> bytes:
    """16-byte digest naming a namespace in every header and record."""
    return xxhash.xxh3_128_digest(namespace.encode())


def _seal(body: bytes) -> bytes:
    return body + struct.pack("<Q", xxhash.xxh3_64_intdigest(body))


def _check(buf: bytes) -> bytes | None:
    body, crc = buf[:-8], struct.unpack("<Q", buf[-8:])[0]
    return body if xxhash.xxh3_64_intdigest(body) == crc else None


def pack_extent_header(namespace: str, node: int, scope_id: int, extent_seq: int, reserved_bytes: int) -> bytes:
    """The 4 KiB block that opens an extent."""
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
    magic, ver, node, sid, seq, res, dig, nlen = _EXT.unpack_from(block)
    end = _EXT.size + nlen
    if _check(bytes(block[: end + 8])) is None:
        return None
    return ExtentHeader(node, sid, seq, res, bytes(block[_EXT.size : end]).decode())


@dataclass(frozen=True)
class RoundLayout:
    """Byte layout of one round, relative to the round's start (its header)."""

    n_pages: int
    layers: int
    chunk_bytes: int
    data_bytes: int  # padded to BLOCK
    record_bytes: int  # padded to BLOCK

    @property
    def record_offset(self) -> int:
        return BLOCK + self.data_bytes

    @property
    def total_bytes(self) -> int:
        return BLOCK + self.data_bytes + self.record_bytes

    def chunk_offset(self, page: int, layer: int) -> int:
        """Offset of chunk (page, layer) from the round's start."""
        return BLOCK + (layer * self.n_pages + page) * self.chunk_bytes


def record_size(keys: Sequence[str], layers: int) -> int:
    """Unpadded bytes of a round's record."""
    kb = sum(2 + len(k.encode()) for k in keys)
    return _REC.size + kb + 8 * layers * len(keys) + 8


def round_layout(keys: Sequence[str], layers: int, chunk_bytes: int) -> RoundLayout:
    """Layout of a round holding ``keys`` (one page each)."""
    return RoundLayout(
        len(keys), layers, chunk_bytes, align_up(len(keys) * layers * chunk_bytes), align_up(record_size(keys, layers))
    )


def pack_round_header(lay: RoundLayout, seq: int, scope_id: int) -> bytes:
    """The 4 KiB block that opens a round."""
    body = _RND.pack(ROUND_MAGIC, FORMAT_VERSION, seq, lay.n_pages, lay.layers, lay.chunk_bytes, lay.data_bytes, lay.record_bytes, scope_id)
    return _seal(body).ljust(BLOCK, b"\0")


def unpack_round_header(block: bytes) -> tuple[RoundLayout, int, int] | None:
    """Parse a round header: ``(layout, seq, scope_id)`` or ``None``."""
    if block[:8] != ROUND_MAGIC or _check(bytes(block[: _RND.size + 8])) is None:
        return None
    _, _, seq, n, layers, cb, db, rb, sid = _RND.unpack_from(block)
    return RoundLayout(n, layers, cb, db, rb), seq, sid


def pack_record(namespace: str, keys: Sequence[str], layers: int, chunk_bytes: int, checksums: np.ndarray) -> bytes:
    """The record written after a round's data.

    Args:
        checksums: uint64 ``[layers, n_pages]``, xxh3-64 of every chunk.
    """
    kparts = []
    for k in keys:
        kb = k.encode()
        kparts.append(struct.pack("<H", len(kb)) + kb)
    kbytes = b"".join(kparts)
    body = _REC.pack(RECORD_MAGIC, namespace_digest(namespace), len(keys), layers, chunk_bytes, len(kbytes)) + kbytes
    body += np.ascontiguousarray(checksums, dtype="<u8").tobytes()
    return _seal(body)


@dataclass(frozen=True)
class RoundRecord:
    """Decoded record: digest, keys, chunk size and checksums ``[layers, n_pages]``."""

    ns_digest: bytes
    keys: tuple[str, ...]
    layers: int
    chunk_bytes: int
    checksums: np.ndarray


def unpack_record(buf: bytes) -> RoundRecord | None:
    """Parse and validate a record; ``None`` if torn or foreign."""
    if buf[:8] != RECORD_MAGIC:
        return None
    _, dig, n, layers, cb, kb = _REC.unpack_from(buf)
    end = _REC.size + kb + 8 * layers * n
    if end + 8 > len(buf) or _check(bytes(buf[: end + 8])) is None:
        return None
    keys, o = [], _REC.size
    for _ in range(n):
        (ln,) = struct.unpack_from("<H", buf, o)
        keys.append(bytes(buf[o + 2 : o + 2 + ln]).decode())
        o += 2 + ln
    sums = np.frombuffer(bytes(buf[o:end]), dtype="<u8").reshape(layers, n).copy()
    return RoundRecord(dig, tuple(keys), layers, cb, sums)
