"""What FlatCake owns under ``ssd.path``, and the rule that keeps it within the configured capacity.

Every FlatCake pool in a directory is a set of files sharing one prefix
``fc-{16 hex digits}`` (:func:`pool_prefix`: a digest of the namespace — model, ranks, page
size, dtype, layout — and the process's pool identity, :mod:`flatcake.adapter.identity`):
``{prefix}-{NNNNN}.pool`` (the pool files), ``{prefix}.journal`` and ``{prefix}.lock`` (and, after a crash during journal compaction, ``{prefix}.journal.{pid}.tmp``,
which the pool's next writer deletes at start-up). A pool is *live* while a process holds the ``flock`` on its lock file; any
other pool is *stale* — left by a server that ran with another model, dtype, page size or TP
size, or by this namespace before a restart.

The capacity rule (``docs/durability.md``): the bytes of this pool's files plus those of every
stale pool stay at or below ``ssd.max_files × ssd.file_bytes``. A stale pool is kept while it
fits — so it is served again if its namespace comes back — and deleted whole, least recently
written first, when this pool needs its room (at start-up and before it creates a file). This
pool's own files beyond ``ssd.max_files`` (the setting was lowered) are deleted at start-up.
Pools that another live process holds are never touched and not counted (they have their own
capacity): the bound is per pool, i.e. per process, not per directory — N processes sharing one
directory may fill up to N times the capacity (stale pools included: each process counts
them against its own capacity). A stale pool is deleted only while holding its lock (:func:`remove_if_stale`).
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
from flatcake.media.extent import namespace_digest

log = logging.getLogger("flatcake.ssd")

#: tries, 50 ms apart, to take a pool's writer lock (another server's :func:`is_live` probe may
#: hold it shared for an instant)
LOCK_ATTEMPTS = 20

class PoolInUse(SsdStartupError):
    """Another process holds the pool's writer lock (:func:`take_writer_lock`); the adapter
    then tries the next pool slot (:mod:`flatcake.adapter.identity`)."""


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


def pool_prefix(namespace: str, instance: str) -> str:
    """The file prefix of the pool of ``namespace`` and ``instance`` (the pool identity,
    :mod:`flatcake.adapter.identity`): ``fc-`` and 16 hex digits of the xxh3-128 digest of
    ``namespace|instance`` (the name :class:`flatcake.media.ssd.SsdFilePool` gives its files)."""
    return "fc-" + namespace_digest(namespace + "|" + instance).hex()[:16]


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


def check_pool_dir(path: str) -> None:
    """Check, without creating anything, that ``path`` (an ``ssd.path`` directory) is a writable
    directory or could be created as one: the nearest existing ancestor must be a writable
    directory. Bad configuration fails at start-up naming ``ssd.path``; whether a missing drive
    directory is created is :class:`flatcake.media.ssd.SsdFilePool`'s decision (only for a new
    pool: a missing directory of an existing pool is a drive that is not mounted).

    Raises:
        SsdStartupError: ``path`` exists and is not a writable directory, or its nearest
            existing ancestor is not one.
    """
    probe = os.path.abspath(path)
    while not os.path.lexists(probe):
        parent = os.path.dirname(probe)
        if parent == probe:
            break
        probe = parent
    if not os.path.isdir(probe) or not os.access(probe, os.W_OK | os.X_OK):
        what = "not a writable directory" if probe == os.path.abspath(path) else f"cannot be created: {probe!r} is not a writable directory"
        raise SsdStartupError(f"ssd.path {path!r}: {what}")


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


def remove_if_stale(directory: str, pool: PoolFiles) -> int | None:
    """Delete every file of ``pool`` unless a process holds its lock: the exclusive ``flock``
    on ``{prefix}.lock`` is taken (without waiting) and held while the files go, the lock file
    last, so a process starting on this pool meanwhile either keeps it whole or finds it gone
    (:func:`take_writer_lock` checks the lock file it holds is still the one the name points at).

    Returns:
        Bytes freed, or None when the pool is live (its lock is held) and nothing was deleted.
    """
    path = os.path.join(directory, pool.prefix + ".lock")
    try:
        fd = os.open(path, os.O_RDONLY | getattr(os, "O_CLOEXEC", 0))
    except OSError:  # no lock file: no process can hold this pool
        return remove_pool(pool)
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            return None  # live
        lock_last = sorted(pool.paths, key=lambda p: p == path)
        return remove_pool(PoolFiles(pool.prefix, lock_last, pool.pool_indices, pool.tmp_paths, pool.nbytes, pool.mtime))
    finally:
        os.close(fd)


def make_room(directory: str, own_prefix: str, own_bytes: int, capacity_bytes: int) -> list[str]:
    """Delete stale pools, least recently written first, until this pool's ``own_bytes`` plus
    the stale pools' bytes fit in ``capacity_bytes``. Live pools (another process holds their
    lock: another server, DP replica or rank sharing the directory) are neither counted nor
    deleted, and this pool is kept; each deletion holds the pool's lock
    (:func:`remove_if_stale`), so a pool that comes alive meanwhile is skipped.

    Returns:
        The prefixes deleted (each logged once).
    """
    stale = [p for pre, p in scan(directory).items() if pre != own_prefix and not is_live(directory, pre)]
    total = own_bytes + sum(p.nbytes for p in stale)
    removed = []
    for p in sorted(stale, key=lambda p: p.mtime):
        if total <= capacity_bytes:
            break
        freed = remove_if_stale(directory, p)
        if freed is None:
            total -= p.nbytes  # it came alive: another process's capacity, not ours to count
            continue
        total -= freed
        removed.append(p.prefix)
        log.warning("flatcake: removed stale pool %s under %s (%d bytes) to stay within the SSD capacity",
                    p.prefix, directory, p.nbytes)
    return removed


def take_writer_lock(directory: str, prefix: str, attempts: int = LOCK_ATTEMPTS) -> int:
    """Take the exclusive ``flock`` on ``{prefix}.lock`` (one writer per pool: a second process
    with the same pool identity would overwrite this one's extents) and write this process id
    into it. Retries for ``attempts × 50 ms`` while someone holds it (a liveness probe holds it
    shared for an instant). A lock file that another process deleted while this one waited
    (:func:`remove_if_stale`) is opened afresh. Returns the lock file's fd (closing it releases).

    Raises:
        PoolInUse: another process holds the pool (names ``ssd.path`` and its pid).
        SsdStartupError: the lock file cannot be created.
    """
    path = os.path.join(directory, prefix + ".lock")
    for attempt in range(attempts):
        try:
            fd = os.open(path, os.O_RDWR | os.O_CREAT | getattr(os, "O_CLOEXEC", 0), 0o644)
        except OSError as e:
            raise SsdStartupError(f"ssd.path {directory!r}: cannot create {prefix}.lock: [errno {e.errno}] {e.strerror}") from None
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            holder = os.pread(fd, 64, 0).decode(errors="replace").split(" ")[0].strip() or "?"
            os.close(fd)
            if attempt + 1 < attempts:
                time.sleep(0.05)
                continue
            raise PoolInUse(
                f"ssd.path {directory!r}: pool {prefix} is in use by another FlatCake process "
                f"(pid {holder}) with the same pool identity; give each server its own ssd.pool_id or ssd.path"
            ) from None
        if _same_file(fd, path):
            os.ftruncate(fd, 0)
            os.pwrite(fd, str(os.getpid()).encode(), 0)
            return fd
        os.close(fd)  # deleted as stale between open and flock: take the new one
    raise PoolInUse(f"ssd.path {directory!r}: pool {prefix}: its lock file keeps being replaced")


def _same_file(fd: int, path: str) -> bool:
    """True when ``fd`` is the file ``path`` names now."""
    try:
        a, b = os.fstat(fd), os.stat(path)
    except OSError:
        return False
    return (a.st_dev, a.st_ino) == (b.st_dev, b.st_ino)


def write_lock_tag(directory: str, prefix: str, tag: str) -> None:
    """Record ``tag`` (the writer's process group, :func:`flatcake.adapter.identity.group_key`)
    after the pid in the held lock file ``{prefix}.lock``, so the MLA follower ranks of the same
    server find this pool among the slots (:func:`read_lock_tag`). Best effort: an ``OSError``
    is left to the caller."""
    fd = os.open(os.path.join(directory, prefix + ".lock"), os.O_WRONLY | getattr(os, "O_CLOEXEC", 0))
    try:
        data = f"{os.getpid()} {tag}".encode()
        os.pwrite(fd, data, 0)
        os.ftruncate(fd, len(data))
    finally:
        os.close(fd)


def read_lock_tag(directory: str, prefix: str) -> str | None:
    """The tag :func:`write_lock_tag` recorded in ``{prefix}.lock``, or None (no lock file,
    no tag yet, unreadable)."""
    try:
        with open(os.path.join(directory, prefix + ".lock"), "rb") as f:
            parts = f.read(4096).decode(errors="replace").split(" ", 1)
    except OSError:
        return None
    return parts[1] if len(parts) == 2 and parts[1] else None


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
        try:  # read the disk, not a cached copy: the probe of a drive that failed reads
            os.posix_fadvise(fd, 0, 4096, os.POSIX_FADV_DONTNEED)
        except OSError:
            pass
        block = os.pread(fd, 4096, 0)
        if os.pwrite(fd, block, 0) != len(block):
            raise ShortWrite(errno.EIO, "short write", path)
        os.fsync(fd)
    finally:
        os.close(fd)
