"""Pool journal: where every published SSD round lives, for restarts and for follower ranks.

The store that writes a pool appends one fixed-size entry per event to ``{pool prefix}.journal``:

* ``ROUND``  (scope id, pool file, round offset, extent offset, where the record lies in the
  round and its size, sequence number, nonce, reuse class) — appended *after* the round's header, data and record are written and
  *before* the round is published, so every page SGLang was told is stored has its entry;
* ``RETIRE`` (scope id) — appended before the store frees a scope's space.

Two readers use it:

* **restart** (:mod:`flatcake.gva.rebuild`): a store opening a pool replays the journal, reads
  each live round's header and record (nothing else) and publishes the pages again; then it
  writes a compacted journal (the live rounds only) and renames it into place;
* **MLA follower ranks** (:mod:`flatcake.gva.mirror`): for MLA models SGLang backs up KV only on
  the storage-writer rank (``tp_rank == 0``), yet every rank answers hit queries and SGLang takes
  the *minimum* hit count, so the other ranks tail the writer's journal and mirror its rounds.

The journal stays bounded by the live rounds: once it holds more than ``2 × live rounds +``
:data:`COMPACT_MIN_ENTRIES` entries, the writer rewrites it with the live rounds
(:meth:`JournalWriter.rewrite`, a new inode renamed into place). A follower that sees a new
inode (or the file shrink) drops what it mirrored and replays the new journal from the start.

Entries are 64 bytes and end with an xxh3-64 of the first 56, so a torn tail is ignored (a
reader waits for it to complete; a restart drops it). Appends are buffered ``O_APPEND``
writes: they survive a process crash (kill -9), not necessarily a power loss
(``docs/durability.md``).
"""

from __future__ import annotations

import errno
import logging
import os
import socket
import struct
import threading
import time
from dataclasses import dataclass
from typing import Callable, Iterable, Optional

import xxhash

from flatcake.media import pool_dir

log = logging.getLogger("flatcake")

#: kind, file_index, scope_id, round_offset, extent_offset, nonce, record blocks from the round's
#: start, record blocks, seq, reuse (a block is 4 KiB)
_ENTRY = struct.Struct("<IIQQQQIIII")
_BLOCK = 4096
ENTRY_BYTES = _ENTRY.size + 8
ROUND = 1
RETIRE = 2

#: dead entries tolerated beyond the live ones before the journal is compacted (64 B each)
COMPACT_MIN_ENTRIES = 1024

#: seconds after a follower rank starts before it checks, once, that its writer's pool is
#: visible (long enough for a writer to open its pool and replay a large journal)
FOLLOWER_GRACE_S = 60.0


@dataclass(frozen=True, slots=True)
class JournalEntry:
    """One journal event.

    Attributes:
        kind: :data:`ROUND` or :data:`RETIRE`.
        scope_id: the writer's scope id.
        file_index: ``ROUND``: pool file of the round.
        round_offset: ``ROUND``: byte offset of the round header in that file.
        extent_offset: ``ROUND``: byte offset of the extent (its header block) holding the round.
        nonce: ``ROUND``: the round's nonce (also in its header and record).
        record_offset: ``ROUND``: bytes from the round's start to its record (multiple of 4 KiB).
        record_bytes: ``ROUND``: bytes of the record (multiple of 4 KiB).
        seq: ``ROUND``: the round's sequence number in its scope.
        reuse: ``ROUND``: the scope's reuse class (index into ``ReuseScope``).
    """

    kind: int
    scope_id: int
    file_index: int = 0
    round_offset: int = 0
    extent_offset: int = 0
    nonce: int = 0
    record_offset: int = 0
    record_bytes: int = 0
    seq: int = 0
    reuse: int = 0

    @property
    def round_bytes(self) -> int:
        """Bytes of the whole round (header, data, record)."""
        return self.record_offset + self.record_bytes


def _pack(e: JournalEntry) -> bytes:
    body = _ENTRY.pack(e.kind, e.file_index, e.scope_id, e.round_offset, e.extent_offset, e.nonce,
                       e.record_offset // _BLOCK, e.record_bytes // _BLOCK, e.seq, e.reuse)
    return body + struct.pack("<Q", xxhash.xxh3_64_intdigest(body))


def parse_entries(buf: bytes, skip_corrupt: bool = False) -> list[JournalEntry]:
    """The complete entries of ``buf``: up to the first torn or corrupt one, or with
    ``skip_corrupt`` every entry whose checksum holds (a restart reads the whole journal: one
    flipped entry must not hide every round after it; the round it names, if any, is simply
    not recovered)."""
    out = []
    for i in range(len(buf) // ENTRY_BYTES):
        raw = buf[i * ENTRY_BYTES : (i + 1) * ENTRY_BYTES]
        body, crc = raw[: _ENTRY.size], struct.unpack("<Q", raw[_ENTRY.size :])[0]
        if xxhash.xxh3_64_intdigest(body) != crc:
            if skip_corrupt:
                continue
            break
        kind, f, sid, roff, eoff, nonce, rec_blocks, rec_len, seq, reuse = _ENTRY.unpack(body)
        out.append(JournalEntry(kind, sid, f, roff, eoff, nonce, rec_blocks * _BLOCK, rec_len * _BLOCK, seq, reuse))
    return out


def read_journal(path: str) -> list[JournalEntry]:
    """Every entry of the journal at ``path`` whose checksum holds ([] if it does not exist).

    Raises:
        OSError: the journal exists but cannot be read.
    """
    try:
        with open(path, "rb") as f:
            return parse_entries(f.read(), skip_corrupt=True)
    except FileNotFoundError:
        return []


class JournalWriter:
    """Append side (the store that writes the pool). Thread-safe.

    Args:
        path: the journal's path.
        entries: the entries the journal starts with (the live rounds found at start-up); the
            file is written as a new inode and renamed into place.

    Attributes:
        entries: entries in the journal file now.

    Raises:
        OSError: the journal cannot be written (at start-up).
    """

    def __init__(self, path: str, entries: Iterable[JournalEntry] = ()):
        self.path = path
        self._lock = threading.Lock()
        self._fd = -1
        self.entries = 0
        self.rewrite(entries)

    def rewrite(self, entries: Iterable[JournalEntry]) -> None:
        """Replace the journal with ``entries`` (compaction): write a new file, rename it into
        place, append to it from now on. A follower still holding the old inode sees the inode
        change and starts over (an in-place truncate could be refilled past its read offset).

        Raises:
            OSError: the new journal cannot be written (the old one stays in place and in use).
        """
        data = b"".join(_pack(e) for e in entries)
        tmp = f"{self.path}.{os.getpid()}.tmp"
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_APPEND, 0o644)
        try:
            done = 0
            while done < len(data):
                done += os.write(fd, data[done:])
            os.fsync(fd)  # the entries are on disk before the name points at them
            os.replace(tmp, self.path)
        except BaseException:
            os.close(fd)
            try:
                os.unlink(tmp)
            except OSError:
                pass
            raise
        with self._lock:
            old, self._fd = self._fd, fd
            self.entries = len(data) // ENTRY_BYTES
        if old >= 0:
            os.close(old)

    def append(self, e: JournalEntry) -> None:
        """Append one entry (one ``write`` of 64 bytes on an ``O_APPEND`` fd).

        Raises:
            OSError: the write failed or stopped short (``EIO``; the journal then holds a torn
                entry, and the caller rewrites it before the next append).
        """
        with self._lock:
            n = os.write(self._fd, _pack(e))
            if n != ENTRY_BYTES:
                raise OSError(errno.EIO, f"short journal write ({n} of {ENTRY_BYTES} bytes)", self.path)
            self.entries += 1

    def close(self) -> None:
        """Close the journal (it stays on disk for the next start)."""
        with self._lock:
            if self._fd >= 0:
                os.close(self._fd)
                self._fd = -1


class JournalReader:
    """Tail side (follower ranks): :meth:`poll` returns the complete entries appended since
    the last call. Not thread-safe; the follower calls it under its writer lock.

    Args:
        path: the writer's journal (``{pool prefix}.journal`` in the pool directory).
        grace_s: seconds before :meth:`check_writer` looks (None: :data:`FOLLOWER_GRACE_S`,
            read at check time).
        clock: monotonic clock in seconds (tests pass a fake one).

    Attributes:
        writer_missing: after the check, why the writer's pool is not visible (None: it is, or
            not checked yet).
    """

    def __init__(self, path: str, grace_s: Optional[float] = None, clock: Callable[[], float] = time.monotonic):
        self.path = path
        self.offset = 0
        self._fd = -1
        self._ino = None
        self.grace_s = grace_s
        self._clock = clock
        self._started = clock()
        self._checked = False
        self.writer_missing: Optional[str] = None

    def check_writer(self) -> None:
        """Once the grace period has passed, check once that the writer's pool is visible from
        here (its journal exists and a process holds its lock); if not, log one WARNING saying
        what is wrong and what to do. Never raises."""
        if self._checked:
            return
        grace = FOLLOWER_GRACE_S if self.grace_s is None else self.grace_s
        if self._clock() - self._started < grace:
            return
        self._checked = True
        try:
            self.writer_missing = writer_invisible(self.path)
        except Exception as e:  # noqa: BLE001 - a check, never a fault of the follower
            self.writer_missing = None
            log.debug("flatcake: follower writer check of %s failed: %s", self.path, e)
        if self.writer_missing:
            log.warning(
                "flatcake: MLA follower rank on host %s cannot see its writer rank's pool %s seconds after start: "
                "%s. This rank reports 0 L3 hits, and SGLang takes the minimum hit count over TP ranks, so the "
                "server gets no L3 hits. The writer's pool directory %s is not visible from this host (TP spread "
                "over hosts?): put ssd.path on storage every host of the TP group shares, or run TP within one host",
                socket.gethostname(), f"{grace:g}", self.writer_missing, os.path.dirname(self.path) or ".")

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
        """Bytes in the journal now (0 if it does not exist yet; -1 if it was replaced)."""
        try:
            st = os.stat(self.path)
        except FileNotFoundError:
            return 0
        if self._ino is not None and st.st_ino != self._ino:  # rewritten (compaction, writer restart)
            return -1
        return st.st_size

    def poll(self) -> tuple[bool, list[JournalEntry]]:
        """``(restarted, entries)``: ``restarted`` is True when the journal was rewritten or
        truncated since the last poll (the caller drops everything it mirrored first). Also
        runs :meth:`check_writer`."""
        self.check_writer()
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
        out = parse_entries(os.pread(self._fd, n * ENTRY_BYTES, self.offset))
        self.offset += len(out) * ENTRY_BYTES
        return restarted, out

    def close(self) -> None:
        """Close the journal."""
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1


def writer_invisible(journal_path: str) -> Optional[str]:
    """Why the pool whose journal is ``journal_path`` has no visible writer, or None when it
    has one: its journal exists and a process holds ``{prefix}.lock``
    (:func:`flatcake.media.pool_dir.is_live`)."""
    if not os.path.exists(journal_path):
        return f"its journal {journal_path} does not exist"
    directory, name = os.path.split(journal_path)
    prefix = name[: -len(".journal")] if name.endswith(".journal") else name
    if not pool_dir.is_live(directory or ".", prefix):
        return f"no running process holds its lock {prefix}.lock (the journal there is left from an earlier run)"
    return None
