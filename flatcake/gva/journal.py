"""Scope journal: how TP ranks that do not write (MLA) learn the writer's published rounds.

For MLA models SGLang backs up KV only on the storage-writer rank (``tp_rank == 0``), yet
every rank answers hit queries and reads, and SGLang takes the *minimum* hit count across
ranks. So the other ranks must see the writer's pages. They share the writer's pool files
(same namespace, same ``ssd.path``); the writer appends one fixed-size entry per event to
``{pool prefix}.journal`` and the followers tail it:

* ``ROUND``  (scope id, file, round offset) — appended *after* the round's bytes and record are
  written, so a follower that sees the entry finds a complete, self-describing round (it reads
  the round header and record from the pool file; see :mod:`flatcake.media.extent`);
* ``RETIRE`` (scope id) — appended before the writer frees a scope's space.

A follower may read a round the writer has just reclaimed and reused before the RETIRE entry
arrives; followers therefore always verify chunk checksums, which turns such a read into a
miss, never other bytes. Entries are 32 bytes and end with an xxh3-64 of the first 24, so a
torn tail is ignored until it is complete. A starting writer renames a fresh journal into
place; a follower that sees a new inode (or the file shrink) drops what it mirrored and starts
over.
"""

from __future__ import annotations

import os
import struct
import threading
from dataclasses import dataclass

import xxhash

_ENTRY = struct.Struct("<IIQQ")  # kind, file_index, scope_id, round_offset
ENTRY_BYTES = _ENTRY.size + 8
ROUND = 1
RETIRE = 2


@dataclass(frozen=True, slots=True)
class JournalEntry:
    """One journal event: ``kind`` (:data:`ROUND` / :data:`RETIRE`), writer scope id, pool
    file and byte offset of the round header (``ROUND`` only)."""

    kind: int
    scope_id: int
    file_index: int = 0
    round_offset: int = 0


def _pack(e: JournalEntry) -> bytes:
    body = _ENTRY.pack(e.kind, e.file_index, e.scope_id, e.round_offset)
    return body + struct.pack("<Q", xxhash.xxh3_64_intdigest(body))


class JournalWriter:
    """Append side (the storage-writer rank). Thread-safe.

    Raises:
        OSError: the journal cannot be created (at start-up).
    """

    def __init__(self, path: str):
        self.path = path
        # A new inode, renamed into place: a follower still holding the previous writer's
        # journal open sees the inode change and starts over (an in-place truncate could be
        # refilled past the follower's read offset before it looks again).
        tmp = f"{path}.{os.getpid()}.tmp"
        self._fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_APPEND, 0o644)
        os.replace(tmp, path)
        self._lock = threading.Lock()

    def append(self, e: JournalEntry) -> None:
        """Append one entry (one ``write`` of 32 bytes on an ``O_APPEND`` fd).

        Raises:
            OSError: the write failed.
        """
        with self._lock:
            os.write(self._fd, _pack(e))

    def close(self) -> None:
        with self._lock:
            if self._fd >= 0:
                os.close(self._fd)
                self._fd = -1


class JournalReader:
    """Tail side (follower ranks): :meth:`poll` returns the complete entries appended since
    the last call. Not thread-safe; the store calls it under its writer lock."""

    def __init__(self, path: str):
        self.path = path
        self.offset = 0
        self._fd = -1
        self._ino = None

    def _open(self) -> bool:
        if self._fd >= 0:
            return True
        try:
            self._fd = os.open(self.path, os.O_RDONLY)
        except FileNotFoundError:
            return False
        self._ino = os.fstat(self._fd).st_ino
        return True

    def size(self) -> int:
        """Bytes in the journal now (0 if it does not exist yet)."""
        try:
            st = os.stat(self.path)
        except FileNotFoundError:
            return 0
        if self._ino is not None and st.st_ino != self._ino:  # recreated by a new writer
            return -1
        return st.st_size

    def poll(self) -> tuple[bool, list[JournalEntry]]:
        """``(restarted, entries)``: ``restarted`` is True when the journal was truncated or
        recreated since the last poll (the caller drops everything it mirrored first)."""
        size = self.size()
        restarted = False
        if size < 0 or size < self.offset:
            restarted = True
            if self._fd >= 0:
                os.close(self._fd)
            self._fd, self._ino, self.offset = -1, None, 0
            size = max(self.size(), 0)
        if size - self.offset < ENTRY_BYTES or not self._open():
            return restarted, []
        n = (size - self.offset) // ENTRY_BYTES
        buf = os.pread(self._fd, n * ENTRY_BYTES, self.offset)
        out = []
        for i in range(len(buf) // ENTRY_BYTES):
            raw = buf[i * ENTRY_BYTES : (i + 1) * ENTRY_BYTES]
            body, crc = raw[: _ENTRY.size], struct.unpack("<Q", raw[_ENTRY.size :])[0]
            if xxhash.xxh3_64_intdigest(body) != crc:
                break  # torn tail: wait for the rest
            kind, f, sid, off = _ENTRY.unpack(body)
            out.append(JournalEntry(kind, sid, f, off))
            self.offset += ENTRY_BYTES
        return restarted, out

    def close(self) -> None:
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1
