"""SSD medium (GVA medium 1): a pool of preallocated files and an extent allocator.

Lifecycle of SSD space::

    open pool (mkdir, probe O_DIRECT, writer lock, stale pools within capacity)
      -> allocate extent (best fit, 4 KiB granularity; a file is created + fallocated on first use)
      -> append rounds  ->  free extent (whole scope reclaimed)

* Files: ``{drive}/fc-{namespace digest}-{NNNNN}.pool``, ``ssd.file_bytes`` each, at most
  ``ssd.max_files`` in all; ``{drive}`` is ``ssd.path``, or with several drives (``ssd.path`` a
  list) ``ssd.path[NNNNN mod n_drives]`` (:mod:`flatcake.media.drives`). The namespace digest in the name keeps TP ranks and models that share a
  directory apart. A file is never renamed by FlatCake, and truncated only at start-up when
  ``ssd.file_bytes`` was lowered (before any reader opens it), so readers may cache fds. A file
  found removed or truncated behind the backend is unlinked and recreated as a new inode
  (:meth:`SsdFilePool.reset_file_locked`): a reader's cached fd of the old one never sees new data.
  What else FlatCake keeps under ``ssd.path``, and how it stays within the capacity:
  :mod:`flatcake.media.pool_dir`.
* Extents are 4 KiB-aligned ranges placed best-fit (the smallest free range that holds them,
  lowest address first), so the pool fills densely whatever the session size; an extent grows
  in place while the range after it is free (:meth:`SsdFilePool.try_extend_locked`), else the
  session continues in a new extent.
* SSD GVA offset = ``file_index * file_bytes + offset_in_file`` (whatever drive the file is on).
* With several drives a scope's extents go round-robin over them (``allocate_locked(after=)``)
  and an extent never grows in place (each round opens an extent on the next drive).
* Every write buffer, offset and length is 4 KiB aligned (O_DIRECT and GDS). Whether the
  filesystem takes O_DIRECT is probed here, once, at start-up (one log line if it does not).
* Faults: a file that cannot be created (``ENOSPC``, ...) is logged once per errno and its
  creation is retried only once the filesystem has room for it again; a file that refuses
  writes (``EIO``, ``EROFS``, ``EPERM``) is taken out of service; a file removed or truncated
  behind the backend is reset (:mod:`flatcake.media.pool_faults`).

Thread safety: allocation methods must be called with the store's writer lock held (suffix
``_locked``); :meth:`write` is safe from any thread (positional I/O on a shared fd).
"""

from __future__ import annotations

import errno
import logging
import os
import threading
from dataclasses import dataclass
from typing import Optional

from flatcake.common.align import align_up
from flatcake.config import SsdConfig
from flatcake.common.errorlog import ErrorLog
from flatcake.media import pool_dir
from flatcake.media.errors import PoolFileGone, ShortWrite, SsdStartupError, StaleGeneration
from flatcake.media.drives import Drive, drive_of, drives_used, files_on, misplaced
from flatcake.media.pool_dir import check_pool_dir, ensure_pool_dir
from flatcake.media.pool_faults import PoolFileFaults
from flatcake.media.directio import probe_direct_io
from flatcake.media.extent import namespace_digest
from flatcake.media.freelist import FreeRanges

log = logging.getLogger("flatcake.ssd")

#: errnos with which a pool file refuses writes for good: it is taken out of service
REFUSED_ERRNOS = frozenset({errno.EIO, errno.EROFS, errno.EPERM, errno.EACCES})


@dataclass(frozen=True, slots=True)
class Extent:
    """A contiguous, 4 KiB-aligned byte range ``[offset, offset + nbytes)`` of pool file ``file_index``."""

    file_index: int
    offset: int
    nbytes: int

    @property
    def end(self) -> int:
        return self.offset + self.nbytes


class SsdFilePool(PoolFileFaults):
    """The node's SSD address space: up to ``max_files`` preallocated files of ``file_bytes``,
    spread over the drives of ``ssd.path`` (file ``i`` on drive ``i mod n_drives``).

    Args:
        cfg: the ``ssd`` config section (``cfg.paths``: one directory per drive).
        namespace: the backend namespace (names the files).
        instance: extra name component (attention-DP replica).
        follower: open another process's pool read-only (MLA follower ranks): no lock, no files
            created, no allocation.
        errors: the store's error-once log (file creation and write faults).

    Attributes:
        drives: one :class:`~flatcake.media.drives.Drive` per ``ssd.path`` directory, in order.
        capacity_bytes: bytes of the files in service (``max_files × file_bytes`` minus files
            taken out of service); watermarks are fractions of it.
        used_bytes: bytes allocated to extents.
        direct_io: whether the filesystem took O_DIRECT at the start-up probe.

    Raises:
        SsdStartupError: a drive's directory cannot be created, is not a writable directory,
            the pool is in use by another process, or the first file of a drive cannot be
            created (the message names that ``ssd.path`` directory and the errno). Nothing stays
            open after the error.
    """

    def __init__(self, cfg: SsdConfig, namespace: str, instance: str = "", follower: bool = False,
                 errors: Optional[ErrorLog] = None):
        self.cfg, self.file_bytes, self.max_files = cfg, cfg.file_bytes, cfg.max_files
        self.configured_capacity_bytes = cfg.file_bytes * cfg.max_files
        self.follower = follower
        self.errors = errors if errors is not None else ErrorLog(log)
        self.prefix = "fc-" + namespace_digest(namespace + "|" + instance).hex()[:16]
        paths = drives_used(cfg.paths or (cfg.path,), self.max_files, self.prefix)
        self.drives = [Drive(d, p) for d, p in enumerate(paths)]
        self.n_drives = len(self.drives)
        self._fds: dict[int, int] = {}
        self._fd_lock = threading.Lock()
        self._free: dict[int, FreeRanges] = {}  # files in service that exist
        self.out_of_service: set[int] = set()
        self._out_of_service_at: dict[int, float] = {}  # file index -> time.monotonic() of the last refusal
        self.used_bytes = 0
        self._lock_fds: list[int] = []
        self._generation: dict[int, int] = {}  # file index -> times it was reset or taken out of service
        self._writes = 0  # writes in flight (an fd they use is closed only once they are done)
        self._retired_fds: list[int] = []
        self._next_drive = 0  # drive of the next new scope's first extent (round-robin)
        self._forget_listeners: list = []  # fn(file_index): readers' cached fds of a file to drop
        self.removed_stale_pools: list[str] = []
        #: drives whose directory was missing at start-up for an existing pool (not mounted):
        #: out of service, never created (issue 24 item 5)
        self.missing_at_start: list[int] = self._missing_drives() if not follower else []
        for drive in self.drives:  # every drive, naming the one that fails
            if follower or drive.index in self.missing_at_start:
                check_pool_dir(drive.path)  # a follower creates nothing
            else:
                ensure_pool_dir(drive.path)
        present = [d.path for d in self.drives if os.path.isdir(d.path)]
        self.direct_io = self._probe(cfg, present) if present else cfg.direct_io != "off"
        if follower:  # reads the writer's files; creates and locks nothing
            return
        try:
            self._take_writer_lock()
            self._open_existing()
            for d in range(self.n_drives):  # fail now, not at the first write: the first file of each drive
                if d not in self._free and d not in self.missing_at_start:
                    self._make_room(self.file_bytes, d)
                    self._open_file(d, create=True)
        except BaseException:
            self.close()
            raise

    def _missing_drives(self) -> list[int]:
        """The drives whose directory is missing while another drive holds this pool's files (an
        existing pool: a drive that did not come back after a reboot, or is not mounted). Each is
        out of service with a WARNING, as a drive whose directory goes away at run time, and is
        never created: creating it would fill whatever file system lies beneath the mount point,
        which the operator did not configure. It comes back once its directory is there again
        (:meth:`Drive.may_create`). A new pool (no drive holds any of its files) creates every
        directory; with one drive a missing directory is a new pool (nothing else tells them apart).

        Raises:
            SsdStartupError: the first drive (which holds the pool journal) is the missing one.
        """
        present = {d.index for d in self.drives if os.path.isdir(d.path)}
        if len(present) == self.n_drives or not any(self.prefix in pool_dir.scan(self.drives[i].path) for i in present):
            return []
        missing = sorted(set(range(self.n_drives)) - present)
        if 0 in missing:
            raise SsdStartupError(
                f"ssd.path {self.drives[0].path!r}: missing, and it is the first drive, which holds the journal of "
                f"pool {self.prefix} whose files are on {', '.join(self.drives[i].path for i in sorted(present))}: "
                "mount it (FlatCake does not create a drive directory of an existing pool)")
        for i in missing:
            self.drives[i].block_creation()  # may_create() then waits for the directory
            log.warning("flatcake: ssd.path %r is missing at start-up while the other drives hold pool %s (a drive "
                        "not mounted?): out of service until it is back; FlatCake does not create it",
                        self.drives[i].path, self.prefix)
        return missing

    @staticmethod
    def _probe(cfg: SsdConfig, paths: list[str]) -> bool:
        """Whether every drive takes O_DIRECT (one answer for the pool: the readers open every
        file the same way); ``ssd.direct_io: on`` fails naming the first drive that refuses."""
        if cfg.direct_io == "off":
            return False
        refused = [p for p in paths if not probe_direct_io(p)]
        if refused:
            if cfg.direct_io == "on":
                raise SsdStartupError(f"ssd.path {refused[0]!r}: filesystem refuses O_DIRECT (ssd.direct_io: on)")
            log.warning("ssd.path %s refuses O_DIRECT; using buffered I/O", ", ".join(refused))
        return not refused

    def _take_writer_lock(self) -> None:
        """One writer per pool (:func:`flatcake.media.pool_dir.take_writer_lock`), on every drive:
        another process with the same pool identity must not write any of them, and another pool
        sharing a drive sees this one live there (never deleted as stale). Taken in path order, so
        two processes listing the drives in different orders cannot each hold half."""
        for drive in sorted(self.drives, key=lambda d: d.path):
            if drive.index in self.missing_at_start:
                continue  # not mounted: nothing of this pool can be written there
            self._lock_fds.append(pool_dir.take_writer_lock(drive.path, self.prefix))

    def _open_existing(self) -> None:
        """Open this pool's files left by an earlier run (all of their space free until the
        rebuild takes what it recovers); delete its files beyond ``max_files``, files found on
        another drive than the one the drive list gives them, and journals off the first drive
        (the drive list changed: their bytes are never served)."""
        for drive in self.drives:
            mine = pool_dir.scan(drive.path).get(self.prefix)
            if mine is None:
                continue
            stale = list(mine.tmp_paths)  # a compaction a crash left unfinished
            if drive.index:
                stale += [p for p in mine.paths if p.endswith(".journal")]
            for path in stale:
                self._unlink(path, "remove stale journal file")
            for i in sorted(mine.pool_indices):
                path = os.path.join(drive.path, f"{self.prefix}-{i:05d}.pool")
                if i >= self.max_files or misplaced(i, drive.index, self.n_drives):
                    if self._unlink(path, "remove pool file"):
                        log.warning("flatcake: removed pool file %s (%s)", path, "beyond ssd.max_files=%d" % self.max_files
                                    if i >= self.max_files else "the ssd.path drive list changed")
                    continue
                try:
                    if os.stat(path).st_size > self.file_bytes:  # ssd.file_bytes was lowered
                        os.truncate(path, self.file_bytes)  # rounds past the new end are dropped
                    self._open_file(i, create=False)
                except (OSError, SsdStartupError) as e:
                    log.warning("flatcake: pool file %s unusable (%s); it will be recreated", path, e)

    def _unlink(self, path: str, what: str) -> bool:
        try:
            os.unlink(path)
            return True
        except OSError as e:
            self.errors(what, e)
            return False

    @property
    def journal_path(self) -> str:
        """The pool journal (:mod:`flatcake.gva.journal`), on the first drive."""
        return os.path.join(self.drives[0].path, self.prefix + ".journal")

    @property
    def capacity_bytes(self) -> int:
        """Bytes of the pool's files in service."""
        return (self.max_files - len(self.out_of_service)) * self.file_bytes

    # ------------------------------------------------------------------ files and drives
    def path_of(self, file_index: int) -> str:
        """Path of pool file ``file_index`` (on drive ``file_index mod n_drives``)."""
        return os.path.join(self.drives[drive_of(file_index, self.n_drives)].path, f"{self.prefix}-{file_index:05d}.pool")

    def drive_of(self, file_index: int) -> int:
        """Index into ``ssd.path`` of the drive holding pool file ``file_index``."""
        return drive_of(file_index, self.n_drives)

    def drive_files(self, drive: int) -> range:
        """The pool file indices drive ``drive`` holds (``drive, drive + n_drives, ...``)."""
        return files_on(drive, self.n_drives, self.max_files)

    def drive_lost(self, file_index: int) -> bool:
        """True when, with several drives, the directory of ``file_index``'s drive is gone (a
        drive that fell off or was unmounted): the drive goes out of service as a whole."""
        return self.n_drives > 1 and not os.path.isdir(self.drives[self.drive_of(file_index)].path)

    def own_bytes(self, drive: Optional[int] = None) -> int:
        """Bytes this pool's files (and journal) take on disk: on drive ``drive``, or on all."""
        total = 0
        for d in self.drives if drive is None else [self.drives[drive]]:
            mine = pool_dir.scan(d.path).get(self.prefix)
            total += mine.nbytes if mine else 0
        return total

    def _make_room(self, extra_bytes: int, drive: int) -> None:
        """Delete stale pools on drive ``drive`` until this pool's bytes there, ``extra_bytes``
        more, fit its share of the capacity (its files × ``file_bytes``)."""
        d = self.drives[drive]
        self.removed_stale_pools += pool_dir.make_room(d.path, self.prefix, self.own_bytes(drive) + extra_bytes,
                                                       len(self.drive_files(drive)) * self.file_bytes)

    def _open_file(self, i: int, create: bool) -> int:
        """Open (and with ``create``, create and fallocate) pool file ``i``.

        Raises:
            SsdStartupError: it cannot be opened or created; nothing stays open, and a file
                this call created is removed again (its blocks go back to the filesystem).
        """
        with self._fd_lock:
            fd = self._fds.get(i)
            if fd is not None:
                return fd
            path = self.path_of(i)
            existed = os.path.exists(path)
            if not existed and not create:
                raise SsdStartupError(f"ssd.path {os.path.dirname(path)!r}: pool file {path} does not exist")
            flags = os.O_RDWR | os.O_CREAT | getattr(os, "O_CLOEXEC", 0) | (os.O_DIRECT if self.direct_io else 0)
            fd = -1
            try:
                fd = os.open(path, flags, 0o600)
                if self.cfg.preallocate:
                    os.posix_fallocate(fd, 0, self.file_bytes)
                elif os.fstat(fd).st_size < self.file_bytes:
                    os.ftruncate(fd, self.file_bytes)
            except OSError as e:
                if fd >= 0:
                    os.close(fd)
                if not existed:
                    try:
                        os.unlink(path)
                    except OSError:
                        pass
                raise SsdStartupError(
                    f"ssd.path {os.path.dirname(path)!r}: cannot create pool file {path}: [errno {e.errno}] {e.strerror}"
                ) from e
            self._fds[i] = fd
            if i not in self._free:
                self._free[i] = FreeRanges(self.file_bytes)
            return fd

    def _creatable(self, drive: int) -> Optional[int]:
        """The lowest-numbered pool file of ``drive`` not created and not out of service, if
        the drive may create one now (:meth:`Drive.may_create`); else None."""
        if not self.drives[drive].may_create(self.file_bytes):
            return None
        return next((i for i in self.drive_files(drive) if i not in self._free and i not in self.out_of_service), None)

    def _can_create_any(self) -> bool:
        return any(self._creatable(d) is not None for d in range(self.n_drives))

    def _create_on_locked(self, drive: int) -> Optional[int]:
        """Create the lowest-numbered missing pool file of ``drive``; its index, or None (logged
        once per errno; the drive then waits for room before the next try)."""
        i = self._creatable(drive)
        if i is None:
            return None
        try:
            self._make_room(self.file_bytes, drive)
            self._open_file(i, create=True)
        except SsdStartupError as e:
            self.drives[drive].block_creation()
            self.errors("create pool file", e.__cause__ if isinstance(e.__cause__, OSError) else e)
            return None
        self.drives[drive].create_blocked_at = 0.0
        return i

    # ------------------------------------------------------------------ allocation (writer lock held)
    def allocate_locked(self, nbytes: int, after: Optional[int] = None) -> Extent | None:
        """A new extent of ``nbytes`` (rounded up to 4 KiB): best fit over a drive's files in
        service, else in a newly created file of that drive; ``None`` if nothing holds it (the
        caller reclaims and retries).

        Args:
            after: the pool file of the scope's last extent, or None for a new scope. Drives
                are tried in order from the one after ``after``'s drive (a new scope: from the
                drive after the last new scope's), so a scope's extents go round-robin over the
                drives. With one drive: best fit over all files, else a new file.
        """
        n = align_up(nbytes)
        if self.out_of_service:
            self._retry_out_of_service_locked()
        if after is not None:
            start = self.drive_of(after) + 1
        else:
            start, self._next_drive = self._next_drive, self._next_drive + 1
        for k in range(self.n_drives):
            d = (start + k) % self.n_drives
            best = None  # (len, file, start)
            for f in self.drive_files(d):
                fr = self._free.get(f)
                fit = fr.best_fit(n) if fr is not None else None
                if fit is not None and (best is None or (fit[1], f, fit[0]) < best):
                    best = (fit[1], f, fit[0])
            if best is None and n <= self.file_bytes:
                f = self._create_on_locked(d)
                if f is not None:
                    best = (self.file_bytes, f, 0)
            if best is not None:
                _, f, off = best
                self._free[f].take(off, n)
                self.used_bytes += n
                return Extent(f, off, n)
        return None

    def largest_free_range(self) -> int:
        """Bytes of the largest free range over the files in service (a file this pool may
        still create counts as one free range of ``file_bytes``)."""
        best = max((fr.largest() for fr in self._free.values()), default=0)
        if best < self.file_bytes and self._can_create_any():
            best = self.file_bytes
        return best

    def fits_after_freeing_locked(self, nbytes: int, freeable: list[Extent]) -> bool:
        """Whether an extent of ``nbytes`` could be allocated once the ``freeable`` extents are
        freed (admission before eviction): a free range, or one a new file would give."""
        n = align_up(nbytes)
        if n <= self.file_bytes and self._can_create_any():
            return True
        by_file: dict[int, list[tuple[int, int]]] = {}
        for e in freeable:
            if e.file_index in self._free:
                by_file.setdefault(e.file_index, []).append((e.offset, e.nbytes))
        return any(fr.fits_with(n, by_file.get(f, ())) for f, fr in self._free.items())

    def take_locked(self, file_index: int, offset: int, nbytes: int) -> bool:
        """Mark ``[offset, offset + nbytes)`` of a file in service used (restart rebuild);
        False, changing nothing, when any of it is already used or the file is not in service."""
        fr = self._free.get(file_index)
        if fr is None or not fr.take(offset, nbytes):
            return False
        self.used_bytes += nbytes
        return True

    def try_extend_locked(self, ext: Extent, nbytes: int) -> Extent | None:
        """Grow ``ext`` in place by ``nbytes`` (4 KiB aligned) if the range after it is free.
        Never with several drives: the scope's next round opens an extent on the next drive."""
        n = align_up(nbytes)
        fr = self._free.get(ext.file_index) if self.n_drives == 1 else None
        if fr is not None and fr.free_at(ext.end) >= n:
            fr.take(ext.end, n)
            self.used_bytes += n
            return Extent(ext.file_index, ext.offset, ext.nbytes + n)
        return None

    def free_locked(self, ext: Extent) -> None:
        """Return an extent's bytes to the pool (whole-scope reclaim). A file out of service
        keeps no free list: its bytes are simply no longer counted."""
        fr = self._free.get(ext.file_index)
        if fr is not None:
            fr.give(ext.offset, ext.nbytes)
            self.used_bytes -= ext.nbytes

    def free_ranges(self, file_index: int) -> list[tuple[int, int]]:
        """Free ``(offset, nbytes)`` ranges of pool file ``file_index`` in offset order (empty for
        a file not created yet). A snapshot; take the writer lock for a consistent one."""
        fr = self._free.get(file_index)
        return list(zip(fr.starts, fr.lens)) if fr is not None else []

    def used_fraction(self) -> float:
        """Allocated bytes over the capacity in service (1.0 when no file is in service)."""
        cap = self.capacity_bytes
        return self.used_bytes / cap if cap else 1.0

    # ------------------------------------------------------------------ I/O
    def write(self, file_index: int, offset: int, buf, generation: Optional[int] = None, pwrite=None) -> None:
        """Write all of ``buf`` (4 KiB-aligned address and length) at ``offset``.

        Args:
            generation: the file generation the space was reserved under; the write is
                refused when the file was reset since (its range may be someone else's now).
            pwrite: ``(fd, memoryview, offset) -> bytes written`` for ``os.pwritev`` (:mod:`flatcake.store.native_write`).

        Raises:
            PoolFileGone: the file was unlinked or truncated behind the backend.
            StaleGeneration: the file was reset since ``generation``.
            ShortWrite: the write stopped short (errno ``EIO``).
            OSError: the write failed.
        """
        with self._fd_lock:
            self._writes += 1
        try:
            if file_index in self.out_of_service:
                raise OSError(errno.EIO, "pool file is out of service", self.path_of(file_index))
            fd = self._fds.get(file_index)
            if generation is not None and generation != self.generation_of(file_index):
                raise StaleGeneration(errno.ESTALE, "pool file was reset after the space was reserved", self.path_of(file_index))
            if fd is None:  # created by another path, or removed behind the backend and reset
                fd = self._reopen(file_index)
            st = os.fstat(fd)
            if st.st_nlink == 0 or st.st_size < self.file_bytes:  # unlinked, or truncated: earlier rounds are gone
                raise PoolFileGone(errno.ENOENT, "pool file was removed or truncated behind the backend", self.path_of(file_index))
            mv = memoryview(buf)
            done = 0
            while done < len(mv):
                n = os.pwritev(fd, [mv[done:]], offset + done) if pwrite is None else pwrite(fd, mv[done:], offset + done)
                if n <= 0:
                    raise ShortWrite(errno.EIO, "short write", self.path_of(file_index))
                done += n
        finally:
            with self._fd_lock:
                self._writes -= 1
                if not self._writes and self._retired_fds:
                    fds, self._retired_fds = self._retired_fds, []
                    for fd in fds:
                        os.close(fd)

    def _reopen(self, file_index: int) -> int:
        try:
            return self._open_file(file_index, create=True)
        except SsdStartupError as e:
            raise (e.__cause__ if isinstance(e.__cause__, OSError) else OSError(errno.EIO, str(e))) from None

    def read_at(self, file_index: int, offset: int, nbytes: int) -> bytes:
        """Buffered read of ``nbytes`` at ``offset`` (metadata: round headers and records).

        Raises:
            OSError: the file is missing or unreadable.
        """
        fd = os.open(self.path_of(file_index), os.O_RDONLY | getattr(os, "O_CLOEXEC", 0))
        try:
            return os.pread(fd, nbytes, offset)
        finally:
            os.close(fd)

    def open_fds(self) -> int:
        """File descriptors this pool holds open (pool files, retired ones and the lock)."""
        return len(self._fds) + len(self._retired_fds) + len(self._lock_fds)

    def _close_fd(self, file_index: int) -> None:
        """Retire the fd of ``file_index``: closed now if no write is in flight, else when the
        last one ends (a write holding the number must not reach another file that reuses it)."""
        with self._fd_lock:
            fd = self._fds.pop(file_index, None)
            if fd is None:
                return
            if self._writes:
                self._retired_fds.append(fd)
                return
        try:
            os.close(fd)
        except OSError:
            pass

    def close(self) -> None:
        """Close every fd and release the writer locks (files stay on disk). Idempotent."""
        with self._fd_lock:
            for fd in list(self._fds.values()) + self._retired_fds:
                try:
                    os.close(fd)
                except OSError:
                    pass
            self._fds.clear()
            self._retired_fds.clear()
            for fd in self._lock_fds:
                os.close(fd)
            self._lock_fds.clear()
