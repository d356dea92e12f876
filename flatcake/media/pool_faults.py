"""Fault states of the SSD pool's files (paper §3.1: a page read back is the page written, or a
miss): file generations, a file reset after it was removed or truncated behind the backend, a
file taken out of service when it refuses writes and put back when it takes them again, and the
pool's health, per drive and in all (:mod:`flatcake.media.drives`: with several drives, a
drive whose files refuse writes or whose directory is gone goes out of service as a whole).

Lifecycle of a pool file::

    in service --(removed/truncated behind the backend)--> reset: unlinked, new generation,
                                                          recreated as a new inode on next use
    in service --(EIO/EROFS/EPERM/EACCES on a write)----> out of service: new generation,
                                                          no extents, not in the capacity
    out of service --(every OUT_OF_SERVICE_RETRY_S: first block rewritten unchanged)--> in
                                                          service, empty, new generation
    a drive (several drives) --(its files refuse writes, or its directory is gone)--> all of its
                                                          files out of service (the directory is
                                                          never recreated: its mount point may be
                                                          on another filesystem); each comes back
                                                          as above once the directory is there

:class:`PoolFileFaults` is a mixin of :class:`flatcake.media.ssd.SsdFilePool` (it uses the pool's
fds, free lists and generation table); methods suffixed ``_locked`` expect the store's writer lock.
"""

from __future__ import annotations

import logging
import os
import time

from flatcake.media import pool_dir
from flatcake.media.drives import drive_state
from flatcake.media.errors import SsdStartupError

log = logging.getLogger("flatcake.ssd")

#: seconds before a pool file taken out of service is tried again (a non-destructive rewrite of
#: its first block); it comes back empty (its scopes were dropped)
OUT_OF_SERVICE_RETRY_S = 60.0
#: failed reads (EIO, short read, checksum mismatch) of one drive within
#: :data:`READ_FAILURE_WINDOW_S` that take it out of service (:meth:`PoolFileFaults.note_read_failure_locked`)
READ_FAILURES_OUT = 3
READ_FAILURE_WINDOW_S = 60.0


class PoolFileFaults:
    """Generations, reset, out-of-service and health of :class:`~flatcake.media.ssd.SsdFilePool`'s files."""

    def generation_of(self, file_index: int) -> int:
        """How many times pool file ``file_index`` was reset or taken out of service. A page
        written under another generation is not in the file any more: a read of it is a miss
        and a write placed under it is refused (the bytes there belong to someone else now)."""
        return self._generation.get(file_index, 0)

    def reset_file_locked(self, file_index: int) -> None:
        """Forget pool file ``file_index`` (removed behind the backend): a new generation, its
        fd retired and all of it free; the damaged file (a truncated one still has its name) is
        unlinked, so that the next use recreates it (and ``ssd.path`` with it) as a new inode —
        never regrowing the truncated one under a reader's fd. The caller has already dropped
        every scope with an extent in it.

        Raises:
            OSError: ``ssd.path`` cannot be recreated (the file is still forgotten). With several
                drives a drive's directory is never recreated (a file of a drive whose directory
                is gone cannot be created until it is back).
        """
        self._generation[file_index] = self.generation_of(file_index) + 1
        self._close_fd(file_index)
        try:
            os.unlink(self.path_of(file_index))
        except FileNotFoundError:
            pass
        except OSError as e:
            self.errors("remove damaged pool file", e)
        fr = self._free.pop(file_index, None)
        if fr is not None:
            self.used_bytes -= self.file_bytes - fr.free_bytes
        if self.n_drives == 1:
            os.makedirs(self.drives[0].path, exist_ok=True)

    def take_out_of_service_locked(self, file_index: int) -> None:
        """Pool file ``file_index`` refuses writes (EIO, EROFS, EPERM): allocate nothing more in
        it and stop counting it in the capacity. The caller drops the scopes with extents in it."""
        self._out_of_service_at[file_index] = time.monotonic()
        if file_index in self.out_of_service:
            return
        self.out_of_service.add(file_index)
        self._generation[file_index] = self.generation_of(file_index) + 1
        fr = self._free.pop(file_index, None)
        if fr is not None:
            self.used_bytes -= self.file_bytes - fr.free_bytes
        self._close_fd(file_index)
        log.error("flatcake: pool file %s refuses writes; taken out of service (%d of %d files left)",
                  self.path_of(file_index), self.max_files - len(self.out_of_service), self.max_files)

    def add_forget_listener(self, fn) -> None:
        """Call ``fn(file_index)`` (the read path's ``forget_file``) whenever a pool file leaves
        or re-enters service with its drive: the readers' cached descriptors of it are dropped,
        so a file recreated as a new inode is never read through an old one."""
        self._forget_listeners.append(fn)

    def _tell_forget(self, file_index: int) -> None:
        for fn in self._forget_listeners:
            try:
                fn(file_index)
            except Exception as e:  # noqa: BLE001 - a reader's cache never breaks fault handling
                self.errors("forget file", e)

    def note_read_failure_locked(self, file_index: int) -> bool:
        """A read of pool file ``file_index`` failed: count it against its drive. Returns True when
        the drive has failed :data:`READ_FAILURES_OUT` reads within :data:`READ_FAILURE_WINDOW_S`
        seconds and is still in service (the caller takes it out, dropping only its pages:
        :func:`flatcake.gva.read_faults.take_failing_drive_out_locked`); the count starts again."""
        d = self.drives[self.drive_of(file_index)]
        now = time.monotonic()
        d.read_failures += 1
        d.recent_read_failures = [t for t in d.recent_read_failures if now - t < READ_FAILURE_WINDOW_S] + [now]
        if len(d.recent_read_failures) < READ_FAILURES_OUT:
            return False
        d.recent_read_failures = []
        return not all(i in self.out_of_service for i in self.drive_files(d.index))

    def take_drive_out_of_service_locked(self, drive: int, why: str) -> None:
        """Drive ``drive`` failed (``why``: its files refuse writes, or its directory is gone):
        every file of it goes out of service (none allocated, none in the capacity, their pages
        misses by generation). The caller drops the pages stored on it."""
        files = self.drive_files(drive)
        if all(i in self.out_of_service for i in files):
            return
        for i in files:
            self._out_of_service_at[i] = time.monotonic()
            if i not in self.out_of_service:
                self.out_of_service.add(i)
                self._generation[i] = self.generation_of(i) + 1
                fr = self._free.pop(i, None)
                if fr is not None:
                    self.used_bytes -= self.file_bytes - fr.free_bytes
                self._close_fd(i)
            self._tell_forget(i)
        lost = sum(1 for d in range(self.n_drives) if self.drive_health(d) == "disabled")
        log.error("flatcake: SSD drive %s (ssd.path[%d]) %s; taken out of service with its %d files "
                  "(%d of %d drives left)", self.drives[drive].path, drive, why, len(files), self.n_drives - lost,
                  self.n_drives)

    def _retry_out_of_service_locked(self) -> None:
        """Put back in service each file out of service for :data:`OUT_OF_SERVICE_RETRY_S` that
        takes a write again: its first 4 KiB block is read and written back unchanged (a
        non-destructive probe) and synced. It comes back empty, under a new generation (its
        scopes were dropped when it was taken out). A file that still refuses waits another
        period (logged once per errno)."""
        now = time.monotonic()
        refusing = set()  # drives with a file that still refuses: their missing files stay out too
        for i in sorted(self.out_of_service):  # a drive's created (lower) files are mostly probed first
            if now - self._out_of_service_at.get(i, now) < OUT_OF_SERVICE_RETRY_S:
                continue
            self._out_of_service_at[i] = now
            if not os.path.isdir(os.path.dirname(self.path_of(i))):  # its drive is gone: stays out
                continue
            exists = os.path.exists(self.path_of(i))  # if not (never created, or removed): created on demand
            if not exists and self.drive_of(i) in refusing:
                continue
            try:
                if exists:
                    pool_dir.rewrite_first_block(self.path_of(i), self.file_bytes)
            except OSError as e:
                refusing.add(self.drive_of(i))
                self.errors("pool file retry", e)
                continue
            self.out_of_service.discard(i)
            self._generation[i] = self.generation_of(i) + 1
            self._tell_forget(i)
            if not exists:
                continue
            try:
                self._open_file(i, create=False)
            except SsdStartupError as e:
                self.errors("pool file retry", e.__cause__ if isinstance(e.__cause__, OSError) else e)
                self.out_of_service.add(i)
                continue
            log.warning("flatcake: pool file %s takes writes again; back in service (empty)", self.path_of(i))

    def drive_health(self, drive: int) -> str:
        """Drive ``drive``'s state (:func:`flatcake.media.drives.drive_state`)."""
        d = self.drives[drive]
        return drive_state(self.drive_files(drive), self.out_of_service, bool(d.create_blocked_at),
                           os.path.isdir(d.path))

    def health(self) -> str:
        """``"healthy"``; ``"degraded"`` (files or drives out of service, or a file cannot be
        created for lack of space); ``"disabled"`` (every file is out of service)."""
        if len(self.out_of_service) >= self.max_files:
            return "disabled"
        if self.out_of_service or any(d.create_blocked_at for d in self.drives):
            return "degraded"
        return "healthy"

    def drive_states(self) -> list[dict]:
        """Per drive (``ssd.path`` order): ``drive`` (index), ``path``, ``state``
        (:meth:`drive_health`), ``files`` (pool files it may hold), ``files_out_of_service``,
        ``read_failures`` (failed reads since start-up), ``used_bytes`` (allocated to extents), ``capacity_bytes`` (files in service ×
        ``file_bytes``) and ``configured_capacity_bytes`` (files × ``file_bytes``)."""
        out = []
        for d in self.drives:
            files = self.drive_files(d.index)
            oos = [i for i in files if i in self.out_of_service]
            frs = [self._free.get(i) for i in files]  # no lock: a file may leave the dict meanwhile
            used = sum(self.file_bytes - fr.free_bytes for fr in frs if fr is not None)
            out.append({"drive": d.index, "path": d.path, "state": self.drive_health(d.index), "files": len(files),
                        "read_failures": d.read_failures,
                        "files_out_of_service": oos, "used_bytes": used,
                        "capacity_bytes": (len(files) - len(oos)) * self.file_bytes,
                        "configured_capacity_bytes": len(files) * self.file_bytes})
        return out

    def state(self) -> dict:
        """The pool's health for the stats: ``state`` (:meth:`health`), ``used_bytes``,
        ``capacity_bytes`` (in service), ``configured_capacity_bytes``, ``files_out_of_service``,
        ``stale_pools_removed`` (since start-up) and ``drives`` (:meth:`drive_states`)."""
        return {"state": self.health(), "used_bytes": self.used_bytes, "capacity_bytes": self.capacity_bytes,
                "configured_capacity_bytes": self.configured_capacity_bytes,
                "files_out_of_service": sorted(self.out_of_service),
                "stale_pools_removed": len(self.removed_stale_pools), "drives": self.drive_states()}
