"""What FlatCake owns under ``ssd.path``, and the rule that keeps it within the configured capacity.

Every FlatCake pool in a directory is a set of files sharing one prefix
``fc-{16 hex digits}`` (a digest of namespace and instance: model, ranks, page size, dtype,
layout, DP rank): ``{prefix}-{NNNNN}.pool`` (the pool files), ``{prefix}.journal`` and
``{prefix}.lock`` (and, after a crash during journal compaction, ``{prefix}.journal.{pid}.tmp``,
which the pool's next writer deletes at start-up). A pool is *live* while a process holds the ``flock`` on its lock file; any
other pool is *stale* — left by a server that ran with another model, dtype, page size or TP
size, or by this namespace before a restart.

The capacity rule (``docs/durability.md``): the bytes of this pool's files plus those of every
stale pool stay at or below ``ssd.max_files × ssd.file_bytes``. A stale pool is kept while it
fits — so it is served again if its namespace comes back — and deleted whole, least recently
written first, when this pool needs its room (at start-up and before it creates a file). This
pool's own files beyond ``ssd.max_files`` (the setting was lowered) are deleted at start-up.
Pools that another live process holds are never touched (they have their own capacity).
"""

from __future__ import annotations

import errno
import fcntl
import logging
import os
import re
import time
from dataclasses import dataclass, field

from flatcake.media.errors import PoolFileGone, ShortWrite, SsdStartupError

log = logging.getLogger("flatcake.ssd")

#: tries, 50 ms apart, to take a pool's writer lock (another server's :func:`is_live` probe may
#: hold it shared for an instant)
LOCK_ATTEMPTS = 20

_NAME = re.compile(r"^(fc-[0-9a-f]{16})(?:-(\d{5})\.pool|\.journal|\.lock|(\.journal\.\d+\.tmp))$")


@dataclass
class PoolFiles:
    """The files of one pool prefix found in the directory.

    Attributes:
        prefix: ``fc-{16 hex}``.
        paths: every file of the pool (pool files, journal, lock, leftover journal tmp files).
        pool_indices: the indices of its ``.pool`` files.
        tmp_paths: journal compactions a crash left unfinished (``.journal.{pid}.tmp``).
        nbytes: bytes allocated on disk by all of them (``st_blocks * 512``).
        mtime: the newest modification time among them (seconds since the epoch).
    """

    prefix: str
    paths: list[str] = field(default_factory=list)
    pool_indices: list[int] = field(default_factory=list)
    tmp_paths: list[str] = field(default_factory=list)
    nbytes: int = 0
    mtime: float = 0.0


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


def scan(directory: str) -> dict[str, PoolFiles]:
    """Every FlatCake pool prefix in ``directory`` with its files (one ``listdir`` of the
    directory, which holds a few files per pool, never one per page)."""
    pools: dict[str, PoolFiles] = {}
    try:
        names = os.listdir(directory)
    except OSError:
        return pools
    for name in names:
        m = _NAME.match(name)
        if not m:
            continue
        path = os.path.join(directory, name)
        try:
            st = os.stat(path)
        except OSError:
            continue
        p = pools.setdefault(m.group(1), PoolFiles(m.group(1)))
        p.paths.append(path)
        p.nbytes += st.st_blocks * 512
        p.mtime = max(p.mtime, st.st_mtime)
        if m.group(2) is not None:
            p.pool_indices.append(int(m.group(2)))
        elif m.group(3) is not None:
            p.tmp_paths.append(path)
    return pools


def is_live(directory: str, prefix: str) -> bool:
    """True when a process holds ``{prefix}.lock`` (a running FlatCake writes that pool)."""
    path = os.path.join(directory, prefix + ".lock")
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return False
    try:
        fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
    except OSError:
        return True
    finally:
        os.close(fd)  # releases the shared lock we may have taken
    return False


def remove_pool(pool: PoolFiles) -> int:
    """Delete every file of ``pool``; returns the bytes freed."""
    freed = 0
    for path in pool.paths:
        try:
            freed += os.stat(path).st_blocks * 512
            os.unlink(path)
        except OSError:
            pass
    return freed


def make_room(directory: str, own_prefix: str, own_bytes: int, capacity_bytes: int) -> list[str]:
    """Delete stale pools, least recently written first, until this pool's ``own_bytes`` plus
    the stale pools' bytes fit in ``capacity_bytes``. Live pools and this pool are kept.

    Returns:
        The prefixes deleted (each logged once).
    """
    stale = [p for pre, p in scan(directory).items() if pre != own_prefix and not is_live(directory, pre)]
    total = own_bytes + sum(p.nbytes for p in stale)
    removed = []
    for p in sorted(stale, key=lambda p: p.mtime):
        if total <= capacity_bytes:
            break
        total -= remove_pool(p)
        removed.append(p.prefix)
        log.warning("flatcake: removed stale pool %s under %s (%d bytes) to stay within the SSD capacity",
                    p.prefix, directory, p.nbytes)
    return removed


def take_writer_lock(directory: str, prefix: str, attempts: int = LOCK_ATTEMPTS) -> int:
    """Take the exclusive ``flock`` on ``{prefix}.lock`` (one writer per pool: a second process
    with the same namespace and ``ssd.path`` would overwrite this one's extents) and write this
    process id into it. Retries for ``attempts × 50 ms`` while someone holds it (a liveness
    probe holds it shared for an instant). Returns the lock file's fd (closing it releases).

    Raises:
        SsdStartupError: another process holds the pool (names ``ssd.path`` and its pid).
    """
    path = os.path.join(directory, prefix + ".lock")
    fd = os.open(path, os.O_RDWR | os.O_CREAT | getattr(os, "O_CLOEXEC", 0), 0o644)
    for attempt in range(attempts):
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            break
        except OSError:
            if attempt + 1 < attempts:
                time.sleep(0.05)
    else:
        holder = os.pread(fd, 64, 0).decode(errors="replace").strip() or "?"
        os.close(fd)
        raise SsdStartupError(
            f"ssd.path {directory!r}: pool {prefix} is in use by another FlatCake process "
            f"(pid {holder}) with the same namespace; give each server its own ssd.path"
        ) from None
    os.ftruncate(fd, 0)
    os.pwrite(fd, str(os.getpid()).encode(), 0)
    return fd


def rewrite_first_block(path: str, file_bytes: int) -> None:
    """Probe whether a pool file taken out of service takes writes again, without changing
    it: read its first 4 KiB block, write the same bytes back, ``fsync``.

    Raises:
        PoolFileGone: the file is shorter than ``file_bytes`` (truncated).
        ShortWrite: the write stopped short.
        OSError: the file cannot be opened, read, written or synced (it still refuses).
    """
    fd = os.open(path, os.O_RDWR | getattr(os, "O_CLOEXEC", 0))
    try:
        if os.fstat(fd).st_size < file_bytes:
            raise PoolFileGone(errno.ENOENT, "pool file was truncated", path)
        block = os.pread(fd, 4096, 0)
        if os.pwrite(fd, block, 0) != len(block):
            raise ShortWrite(errno.EIO, "short write", path)
        os.fsync(fd)
    finally:
        os.close(fd)
