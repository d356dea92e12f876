"""Several NVMe drives without RAID under one SSD pool (``ssd.path`` given as a list).

The pool's GVA address space is unchanged by drives: SSD offset = ``file_index × file_bytes +
offset_in_file`` (:mod:`flatcake.gva.address`). Drives only decide *where a file lives*:

* pool file ``i`` lives on drive ``i mod n_drives`` (``ssd.path[i mod n]``), so files, and the
  capacity, are spread evenly; ``ssd.max_files`` is the total over all drives (drive ``d``
  holds files ``d, d + n, d + 2n, ...`` below ``max_files``);
* the first drive is special: the pool journal lives there only (the writer lock is taken on
  every drive, so that no other process with the same pool identity writes any of them);
* a session scope's extents go round-robin over the drives (the next extent on the drive after
  its last one; a new scope starts on the drive after the last new scope's), so one session's
  restore reads several drives at once (FC-CIO's reader threads take merged reads of different
  files concurrently);
* each drive's faults are its own: a drive whose files refuse writes, or whose directory is
  gone, is out of service as a whole (its pages become misses; the other drives keep serving
  and taking writes), and it comes back file by file once it takes writes again.

:class:`Drive` is one drive's bookkeeping; :func:`drives_used`, :func:`misplaced` and
:func:`drive_state` are the rules above, shared by :class:`flatcake.media.ssd.SsdFilePool`.
"""

from __future__ import annotations

import logging
import os
import time
from dataclasses import dataclass, field
from typing import Sequence

log = logging.getLogger("flatcake.ssd")

#: seconds between two checks of whether a full filesystem has room for a new pool file again
CREATE_RETRY_CHECK_S = 1.0


@dataclass
class Drive:
    """One drive (directory of ``ssd.path``) of the pool.

    Attributes:
        index: position in ``ssd.path`` (0: the first drive, which holds the journal).
        path: the directory.
        create_blocked_at: ``time.monotonic()`` of the last failed file creation on it (0: none).
        create_checked_at: ``time.monotonic()`` of the last check for room since then.
        read_failures: reads of its files that failed since start-up.
        recent_read_failures: ``time.monotonic()`` of its recent failed reads (the window of
            :data:`flatcake.media.pool_faults.READ_FAILURES_OUT`).
    """

    index: int
    path: str
    create_blocked_at: float = 0.0
    create_checked_at: float = 0.0
    read_failures: int = 0
    recent_read_failures: list = field(default_factory=list)

    def may_create(self, file_bytes: int) -> bool:
        """Whether to try creating a pool file of ``file_bytes`` on this drive now: always, unless
        the last creation failed and the filesystem still has no room for one (checked at most
        once per :data:`CREATE_RETRY_CHECK_S` seconds; a missing directory never has room)."""
        if not self.create_blocked_at:
            return True
        now = time.monotonic()
        if now - self.create_checked_at < CREATE_RETRY_CHECK_S:
            return False
        self.create_checked_at = now
        try:
            st = os.statvfs(self.path)
        except OSError:
            return False
        return os.path.isdir(self.path) and st.f_bavail * st.f_frsize >= file_bytes

    def block_creation(self) -> None:
        """A file creation failed on this drive: wait for room before the next try."""
        self.create_blocked_at = self.create_checked_at = time.monotonic()


def drives_used(paths: Sequence[str], max_files: int, prefix: str) -> list[str]:
    """The drive directories a pool of ``max_files`` files uses: all of ``paths``, or, when
    there are fewer files than drives (a pool derived with a small ``max_files``, such as a
    hybrid model's extra pool), the first ``max_files`` of them (a WARNING names
    ``ssd.max_files``) — a drive never holds no file."""
    if max_files >= len(paths):
        return list(paths)
    log.warning("flatcake: ssd.max_files=%d is below the %d drives of ssd.path; pool %s uses the first %d "
                "(ssd.max_files is the total over all drives)", max_files, len(paths), prefix, max_files)
    return list(paths[:max_files])


def drive_of(file_index: int, n_drives: int) -> int:
    """The drive (index into ``ssd.path``) that holds pool file ``file_index``."""
    return file_index % n_drives


def files_on(drive: int, n_drives: int, max_files: int) -> range:
    """The pool file indices drive ``drive`` holds: ``drive, drive + n, ...`` below ``max_files``."""
    return range(drive, max_files, n_drives)


def misplaced(file_index: int, drive: int, n_drives: int) -> bool:
    """True when pool file ``file_index`` was found on ``drive`` but belongs on another one (the
    drive list changed between runs: reordered, a drive added or removed). Such a file is never
    opened as file ``file_index`` (its bytes were written for another layout), and is deleted."""
    return drive_of(file_index, n_drives) != drive


def drive_state(files: range, out_of_service: set, blocked: bool, present: bool) -> str:
    """A drive's health: ``"disabled"`` (its directory is gone, or every file of it is out of
    service), ``"degraded"`` (some files out of service, or a file cannot be created for lack of
    space), else ``"healthy"``."""
    out = sum(1 for i in files if i in out_of_service)
    if not present or (files and out == len(files)):
        return "disabled"
    if out or blocked:
        return "degraded"
    return "healthy"


__all__ = ["CREATE_RETRY_CHECK_S", "Drive", "drives_used", "drive_of", "drive_state", "files_on", "misplaced"]
