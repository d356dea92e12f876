"""On-SSD format: self-describing extents of layer-major rounds (paper §3.3, FC-CIO write side).

A session scope owns one or more *extents*: contiguous, 4 KiB-aligned byte ranges inside a
preallocated pool file. Inside an extent::

    [extent header 4 KiB] [round 0] [round 1] ...
    round = [round header 4 KiB] [data: chunks layer-major, padded to 4 KiB] [record, padded to 4 KiB]

* data: chunk(page p, layer l) at ``BLOCK + (l * n_pages + p) * chunk_bytes`` from the round's
  start; so one layer of a round is one contiguous range.
* record: namespace digest, the round's identity (scope id, sequence number, nonce), page
  count, layers, chunk bytes, the page keys, the xxh3-64 of every chunk and (record version 3,
  magic ``FCRECRD3``) the device checksum of every chunk
  (:mod:`flatcake.kernels.device_checksum`, verified in HBM by a GPU restore); its own xxh3-64
  last. A version-2 record (``FCRECRD2``, no device checksums) is still read: its chunks are
  verified with xxh3 (on a GPU restore, after a host copy of those chunks). It is written *after* the header and data, by a second write (see
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
from typing import Optional, Sequence

import numpy as np
import xxhash

from flatcake.common.align import ALIGN, align_up

BLOCK = ALIGN  # bytes: every header, record and round starts and ends on a 4 KiB block
EXTENT_MAGIC = b"FCEXTNT2"
ROUND_MAGIC = b"FCROUND2"
RECORD_MAGIC_V2 = b"FCRECRD2"  #: record without device checksums (older pools; still read)
RECORD_MAGIC = b"FCRECRD3"  #: record with xxh3-64 and device checksums per chunk
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


def record_size(keys: Sequence[str], layers: int, device_sums: bool = True) -> int:
    """Unpadded bytes of a round's record (version 3 with ``device_sums``, else version 2)."""
    kb = sum(2 + len(k.encode()) for k in keys)
    return _REC.size + _REC_SEQ.size + kb + (16 if device_sums else 8) * layers * len(keys) + 8


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
                scope_id: int, seq: int, nonce: int, devsums: Optional[np.ndarray] = None) -> bytes:
    """The record written after a round's data.

    Args:
        namespace: the backend namespace (its digest is stored).
        keys: the round's page keys, in page order.
        layers, chunk_bytes: the round's geometry.
        checksums: uint64 ``[layers, n_pages]``, xxh3-64 of every chunk.
        scope_id, seq, nonce: the round's identity, as in its header.
        devsums: uint64 ``[layers, n_pages]`` device checksums of every chunk
            (:func:`flatcake.kernels.fcds_native.fcds_host_chunks`): a version-3 record; ``None``
            writes a version-2 record (xxh3 only).

    Returns:
        The record's bytes (unpadded; at most :func:`record_size`).
    """
    kparts = []
    for k in keys:
        kb = k.encode()
        kparts.append(struct.pack("<H", len(kb)) + kb)
    kbytes = b"".join(kparts)
    magic = RECORD_MAGIC if devsums is not None else RECORD_MAGIC_V2
    body = _REC.pack(magic, namespace_digest(namespace), len(keys), layers, chunk_bytes, len(kbytes),
                     scope_id, nonce) + _REC_SEQ.pack(seq) + kbytes
    body += np.ascontiguousarray(checksums, dtype="<u8").tobytes()
    if devsums is not None:
        body += np.ascontiguousarray(devsums, dtype="<u8").tobytes()
    return _seal(body)


@dataclass(frozen=True)
class RoundRecord:
    """Decoded record: digest, identity, keys, chunk size, xxh3-64 ``checksums`` and (version 3)
    device checksums ``devsums`` (uint64 ``[layers, n_pages]`` each; ``devsums`` is ``None`` for a
    version-2 record)."""

    ns_digest: bytes
    keys: tuple[str, ...]
    layers: int
    chunk_bytes: int
    checksums: np.ndarray
    scope_id: int = 0
    seq: int = 0
    nonce: int = 0
    devsums: Optional[np.ndarray] = None

    def page_checksums(self, p: int) -> np.ndarray:
        """Page ``p``'s checksums as a :class:`~flatcake.gva.index.PageEntry` carries them: uint64
        ``[2 * layers]`` (xxh3-64 of each layer's chunk, then its device checksum), or
        ``[layers]`` (xxh3 only) for a version-2 record."""
        if self.devsums is None:
            return self.checksums[:, p].copy()
        return np.concatenate((self.checksums[:, p], self.devsums[:, p]))

    def matches(self, header: RoundHeader) -> bool:
        """True when this record belongs to the round that ``header`` opens (same identity and geometry)."""
        lay = header.layout
        return ((self.scope_id, self.seq, self.nonce) == (header.scope_id, header.seq, header.nonce)
                and (len(self.keys), self.layers, self.chunk_bytes) == (lay.n_pages, lay.layers, lay.chunk_bytes))


def unpack_record(buf: bytes) -> RoundRecord | None:
    """Parse and validate a record; ``None`` if torn or not a record."""
    magic = bytes(buf[:8])
    if magic not in (RECORD_MAGIC, RECORD_MAGIC_V2) or len(buf) < _REC.size + _REC_SEQ.size:
        return None
    per_chunk = 16 if magic == RECORD_MAGIC else 8
    _, dig, n, layers, cb, kb, sid, nonce = _REC.unpack_from(buf)
    (seq,) = _REC_SEQ.unpack_from(buf, _REC.size)
    o = _REC.size + _REC_SEQ.size
    end = o + kb + per_chunk * layers * n
    if end + 8 > len(buf) or _check(bytes(buf[: end + 8])) is None:
        return None
    keys = []
    for _ in range(n):
        (ln,) = struct.unpack_from("<H", buf, o)
        keys.append(bytes(buf[o + 2 : o + 2 + ln]).decode())
        o += 2 + ln
    sums = np.frombuffer(bytes(buf[o:end]), dtype="<u8").reshape(-1, layers, n)
    dev = sums[1].astype(np.uint64) if per_chunk == 16 else None
    return RoundRecord(dig, tuple(keys), layers, cb, sums[0].astype(np.uint64), sid, seq, nonce, dev)
