"""SSD medium (GVA medium 1): a pool of preallocated files and an extent allocator.

Lifecycle of SSD space::

    open pool (mkdir, probe O_DIRECT)  ->  allocate extent (file created + fallocated on first use)
      -> append rounds (one aligned pwrite each)  ->  free extent (whole scope reclaimed)

* Files: ``{ssd.path}/fc-{namespace digest}-{NNNNN}.pool``, ``ssd.file_bytes`` each, at most
  ``ssd.max_files``. The namespace digest in the name keeps TP ranks and models that share a
  directory apart. A file is never renamed or truncated by FlatCake, so readers may cache fds.
* Extents start on :data:`~flatcake.media.extent.EXTENT_GRID` boundaries. A new extent goes
  to the middle of the largest free range, so the extent before it and the new one can both
  grow in place (:meth:`SsdFilePool.try_extend`), keeping a session's rounds contiguous.
* SSD GVA offset = ``file_index * file_bytes + offset_in_file``.
* Every write buffer, offset and length is 4 KiB aligned (O_DIRECT and GDS). A filesystem
  that refuses O_DIRECT is detected at start-up and buffered I/O is used (one log line).

Thread safety: allocation methods must be called with the store's writer lock held (suffix
``_locked``); :meth:`write` is safe from any thread (positional I/O on a shared fd).
"""

from __future__ import annotations

import bisect
import errno
import logging
import mmap
import os
import threading
from dataclasses import dataclass

import numpy as np

from flatcake.config import SsdConfig
from flatcake.align import align_up
from flatcake.media.extent import BLOCK, EXTENT_GRID, namespace_digest

log = logging.getLogger("flatcake.ssd")


class PoolFileGone(OSError):
    """A pool file was unlinked or truncated behind the backend (e.g. by a tmp cleaner): writes
    to the open fd would land in an orphan inode, or next to a hole that reads back as zeros."""


class SsdStartupError(RuntimeError):
    """The SSD pool cannot be created or opened (bad ``ssd.path``, no space, permissions)."""


@dataclass(frozen=True, slots=True)
class Extent:
    """A contiguous, 4 KiB-aligned byte range ``[offset, offset + nbytes)`` of pool file ``file_index``."""

    file_index: int
    offset: int
    nbytes: int

    @property
    def end(self) -> int:
        return self.offset + self.nbytes


def drop_page_cache(path: str, sync: bool = True) -> bool:
    """Evict ``path`` from the OS page cache (after ``fdatasync`` when ``sync``), so the next
    read of it comes from the device. Used by benchmarks and the replay to measure cold reads.
    Returns False if the file cannot be opened."""
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return False
    try:
        if sync:
            os.fdatasync(fd)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        return True
    finally:
        os.close(fd)


def probe_direct_io(directory: str) -> bool:
    """True if ``directory``'s filesystem accepts 4 KiB-aligned O_DIRECT reads and writes."""
    if not hasattr(os, "O_DIRECT"):
        return False
    path = os.path.join(directory, f".fc-odirect-probe-{os.getpid()}-{threading.get_ident()}")
    buf = np.frombuffer(mmap.mmap(-1, BLOCK), dtype=np.uint8)  # page-aligned, writable
    try:
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_DIRECT, 0o600)
    except OSError:
        return False
    try:
        buf[:] = ord("F")
        os.pwritev(fd, [buf], 0)
        return os.preadv(fd, [buf], 0) == BLOCK
    except OSError:
        return False
    finally:
        os.close(fd)
        try:
            os.unlink(path)
        except OSError:
            pass


def ensure_pool_dir(path: str) -> None:
    """Create ``path`` (the ``ssd.path`` directory) if needed and check it is writable.

    Raises:
        SsdStartupError: it cannot be created or is not a writable directory (names ``ssd.path``
            and the errno).
    """
    try:
        os.makedirs(path, exist_ok=True)
    except OSError as e:
        raise SsdStartupError(f"ssd.path {path!r}: cannot create directory: [errno {e.errno}] {e.strerror}") from None
    if not os.path.isdir(path) or not os.access(path, os.W_OK | os.X_OK):
        raise SsdStartupError(f"ssd.path {path!r}: not a writable directory")


class _FreeRanges:
    """Free byte ranges of one file: sorted starts + lengths, coalesced on free."""

    def __init__(self, nbytes: int):
        self.starts = [0]
        self.lens = [nbytes]

    def largest(self) -> tuple[int, int] | None:
        if not self.lens:
            return None
        i = max(range(len(self.lens)), key=self.lens.__getitem__)
        return self.starts[i], self.lens[i]

    def take(self, start: int, n: int) -> None:
        i = bisect.bisect_right(self.starts, start) - 1
        s, ln = self.starts[i], self.lens[i]
        assert s <= start and start + n <= s + ln, "taking a range that is not free"
        del self.starts[i], self.lens[i]
        if start + n < s + ln:
            self.starts.insert(i, start + n)
            self.lens.insert(i, s + ln - start - n)
        if start > s:
            self.starts.insert(i, s)
            self.lens.insert(i, start - s)

    def free_at(self, start: int) -> int:
        """Length of the free range beginning exactly at ``start`` (0 if none)."""
        i = bisect.bisect_left(self.starts, start)
        return self.lens[i] if i < len(self.starts) and self.starts[i] == start else 0

    def give(self, start: int, n: int) -> None:
        i = bisect.bisect_left(self.starts, start)
        self.starts.insert(i, start)
        self.lens.insert(i, n)
        if i + 1 < len(self.starts) and start + n == self.starts[i + 1]:  # merge right
            self.lens[i] += self.lens.pop(i + 1)
            self.starts.pop(i + 1)
        if i > 0 and self.starts[i - 1] + self.lens[i - 1] == start:  # merge left
            self.lens[i - 1] += self.lens.pop(i)
            self.starts.pop(i)


class SsdFilePool:
    """The node's SSD address space: ``max_files`` preallocated files of ``file_bytes``.

    Args:
        cfg: the ``ssd`` config section.
        namespace: the backend namespace (names the files).

    Raises:
        SsdStartupError: ``ssd.path`` cannot be created, is not a writable directory, or a
            pool file cannot be created there (message names ``ssd.path`` and the errno).
    """

    def __init__(self, cfg: SsdConfig, namespace: str, instance: str = "", follower: bool = False):
        self.cfg = cfg
        self.file_bytes = cfg.file_bytes
        self.max_files = cfg.max_files
        self.capacity_bytes = cfg.file_bytes * cfg.max_files
        self.follower = follower
        self.prefix = "fc-" + namespace_digest(namespace + "|" + instance).hex()[:16]
        ensure_pool_dir(cfg.path)
        if cfg.direct_io == "off":
            self.direct_io = False
        else:
            self.direct_io = probe_direct_io(cfg.path)
            if not self.direct_io:
                if cfg.direct_io == "on":
                    raise SsdStartupError(f"ssd.path {cfg.path!r}: filesystem refuses O_DIRECT (ssd.direct_io: on)")
                log.warning("ssd.path %s refuses O_DIRECT; using buffered I/O", cfg.path)
        self._fds: dict[int, int] = {}
        self._fd_lock = threading.Lock()
        self._free: dict[int, _FreeRanges] = {}  # only files that exist
        self.used_bytes = 0
        self._lock_fd = -1
        if follower:  # reads the writer's files; creates and locks nothing
            return
        self._take_writer_lock()
        # Fail now, not at the first write: create the first pool file.
        self._open_file(0)

    def _take_writer_lock(self) -> None:
        """One writer per pool: a second process with the same namespace and ``ssd.path``
        would overwrite this one's extents."""
        import fcntl

        path = os.path.join(self.cfg.path, self.prefix + ".lock")
        fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            holder = os.pread(fd, 64, 0).decode(errors="replace").strip() or "?"
            os.close(fd)
            raise SsdStartupError(
                f"ssd.path {self.cfg.path!r}: pool {self.prefix} is in use by another FlatCake process "
                f"(pid {holder}) with the same namespace; give each server its own ssd.path"
            ) from None
        os.ftruncate(fd, 0)
        os.pwrite(fd, str(os.getpid()).encode(), 0)
        self._lock_fd = fd

    @property
    def journal_path(self) -> str:
        """The scope journal shared with follower ranks (:mod:`flatcake.gva.journal`)."""
        return os.path.join(self.cfg.path, self.prefix + ".journal")

    # ------------------------------------------------------------------ files
    def path_of(self, file_index: int) -> str:
        """Path of pool file ``file_index``."""
        return os.path.join(self.cfg.path, f"{self.prefix}-{file_index:05d}.pool")

    def _open_file(self, i: int) -> int:
        with self._fd_lock:
            fd = self._fds.get(i)
            if fd is not None:
                return fd
            flags = os.O_RDWR | os.O_CREAT | (os.O_DIRECT if self.direct_io else 0)
            try:
                fd = os.open(self.path_of(i), flags, 0o600)
                if self.cfg.preallocate:
                    os.posix_fallocate(fd, 0, self.file_bytes)
                elif os.fstat(fd).st_size < self.file_bytes:
                    os.ftruncate(fd, self.file_bytes)
            except OSError as e:
                raise SsdStartupError(
                    f"ssd.path {self.cfg.path!r}: cannot create pool file {self.path_of(i)}: [errno {e.errno}] {e.strerror}"
                ) from None
            self._fds[i] = fd
            if i not in self._free:
                self._free[i] = _FreeRanges(self.file_bytes)
            return fd

    # ------------------------------------------------------------------ allocation (writer lock held)
    def allocate_locked(self, nbytes: int) -> Extent | None:
        """A new extent of ``nbytes`` (rounded up to 4 KiB) on a grid boundary, or ``None`` if
        no file has room (the caller reclaims and retries). Opens a new file when needed."""
        n = align_up(nbytes)
        best = None  # (len, file, start)
        for f, fr in self._free.items():
            lg = fr.largest()
            if lg and (best is None or lg[1] > best[0]):
                best = (lg[1], f, lg[0])
        placed = self._place(best, n) if best else None
        if placed is None and len(self._free) < self.max_files:
            f = len(self._free)
            try:
                self._open_file(f)
            except SsdStartupError as e:
                log.error("%s", e)
                return None
            placed = self._place((self.file_bytes, f, 0), n)
        if placed is None:  # largest ranges too small on the grid: first fit anywhere
            for f, fr in self._free.items():
                for s, ln in zip(list(fr.starts), list(fr.lens)):
                    placed = self._place((ln, f, s), n)
                    if placed:
                        break
                if placed:
                    break
        if placed is None:
            return None
        f, start = placed
        self._free[f].take(start, n)
        self.used_bytes += n
        return Extent(f, start, n)

    def _place(self, rng, n: int):
        ln, f, s = rng
        first = align_up(s, EXTENT_GRID)
        if first + n > s + ln:
            return None
        mid = align_up(s + (ln - n) // 2, EXTENT_GRID)
        start = mid if mid + n <= s + ln and ln >= 2 * n + EXTENT_GRID else first
        return f, start

    def try_extend_locked(self, ext: Extent, nbytes: int) -> Extent | None:
        """Grow ``ext`` in place by ``nbytes`` (4 KiB aligned) if the range after it is free."""
        n = align_up(nbytes)
        fr = self._free[ext.file_index]
        if fr.free_at(ext.end) >= n:
            fr.take(ext.end, n)
            self.used_bytes += n
            return Extent(ext.file_index, ext.offset, ext.nbytes + n)
        return None

    def free_locked(self, ext: Extent) -> None:
        """Return an extent's bytes to the pool (whole-scope reclaim)."""
        self._free[ext.file_index].give(ext.offset, ext.nbytes)
        self.used_bytes -= ext.nbytes

    def reset_file_locked(self, file_index: int) -> None:
        """Forget pool file ``file_index`` (removed behind the backend): close its fd and mark
        all of it free; it is recreated (and ``ssd.path`` with it) on the next use. The caller
        has already dropped every scope with an extent in it."""
        with self._fd_lock:
            fd = self._fds.pop(file_index, None)
        if fd is not None:
            try:
                os.close(fd)
            except OSError:
                pass
        fr = self._free.get(file_index)
        if fr is not None:
            self.used_bytes -= self.file_bytes - sum(fr.lens)
            self._free[file_index] = _FreeRanges(self.file_bytes)
        os.makedirs(self.cfg.path, exist_ok=True)

    def free_ranges(self, file_index: int) -> list[tuple[int, int]]:
        """Free ``(offset, nbytes)`` ranges of pool file ``file_index`` in offset order (empty for
        a file not created yet). A snapshot; take the writer lock for a consistent one."""
        fr = self._free.get(file_index)
        return list(zip(fr.starts, fr.lens)) if fr is not None else []

    def used_fraction(self) -> float:
        """Allocated bytes over pool capacity."""
        return self.used_bytes / self.capacity_bytes

    # ------------------------------------------------------------------ I/O
    def write(self, file_index: int, offset: int, buf) -> None:
        """Write all of ``buf`` (4 KiB-aligned address and length) at ``offset``.

        Raises:
            OSError: the write failed or was short (errno ``EIO`` for short writes).
        """
        fd = self._open_file(file_index)
        st = os.fstat(fd)
        if st.st_nlink == 0 or st.st_size < self.file_bytes:  # unlinked, or truncated: earlier rounds are gone
            raise PoolFileGone(errno.ENOENT, "pool file was removed or truncated behind the backend", self.path_of(file_index))
        mv = memoryview(buf)
        done = 0
        while done < len(mv):
            n = os.pwritev(fd, [mv[done:]], offset + done)
            if n <= 0:
                raise OSError(errno.EIO, "short write", self.path_of(file_index))
            done += n

    def read(self, file_index: int, offset: int, buf) -> int:
        """Read into ``buf`` (aligned) at ``offset``; returns bytes read (short at EOF)."""
        fd = self._open_file(file_index)
        return os.preadv(fd, [buf], offset)

    def read_at(self, file_index: int, offset: int, nbytes: int) -> bytes:
        """Buffered read of ``nbytes`` at ``offset`` (metadata: round headers and records).

        Raises:
            OSError: the file is missing or unreadable.
        """
        fd = os.open(self.path_of(file_index), os.O_RDONLY)
        try:
            return os.pread(fd, nbytes, offset)
        finally:
            os.close(fd)

    def close(self) -> None:
        """Close every fd and release the writer lock (files stay on disk)."""
        with self._fd_lock:
            for fd in self._fds.values():
                try:
                    os.close(fd)
                except OSError:
                    pass
            self._fds.clear()
            if self._lock_fd >= 0:
                os.close(self._lock_fd)
                self._lock_fd = -1


class AlignedBuffer:
    """A page-aligned, reusable host buffer (anonymous mmap), grown on demand."""

    def __init__(self, nbytes: int = 0):
        self._mm: mmap.mmap | None = None
        self.nbytes = 0
        if nbytes:
            self.reserve(nbytes)

    def reserve(self, nbytes: int) -> memoryview:
        """A writable view of at least ``nbytes`` (rounded to 4 KiB), reusing the mapping."""
        n = align_up(max(nbytes, BLOCK))
        if n > self.nbytes:
            self._mm = mmap.mmap(-1, n)  # the old mapping is freed once no view holds it
            self.nbytes = n
        return memoryview(self._mm)[:n]
