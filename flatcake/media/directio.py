"""Direct-I/O helpers shared by the SSD pool, FC-CIO, the benchmarks and the replay (paper §3.3).

* :func:`probe_direct_io` — does a directory's filesystem take 4 KiB-aligned O_DIRECT? The SSD
  pool runs it once at start-up and hands the answer to FC-CIO.
* :func:`dio_alignment` — the alignment zero-copy restores' iovecs need on the device holding a
  directory (4096, or 512 on a device without an NVMe-style virtual boundary).
* :func:`drop_page_cache` — evict a file from the page cache, so a benchmark reads the device.
* :func:`aligned_host_buffer` — a page-aligned host buffer (numpy and torch views) for O_DIRECT
  and GDS-compatible transfers; :class:`AlignedBuffer` — a reusable, growable one for writes.
"""

from __future__ import annotations

import mmap
import os
import threading
from typing import Callable, Optional

import numpy as np
import torch

from flatcake.common.align import ALIGN, align_up


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


def _dio_roundtrip(directory: str, name: str, read: Callable[[int, np.ndarray], bool]) -> bool:
    """Write one 4 KiB block of ``"F"`` with O_DIRECT into a scratch file in ``directory``, then
    return ``read(fd, buf)`` (the caller's O_DIRECT read check; ``buf`` the page-aligned 4 KiB
    buffer); False where the file does not open or any step raises OSError. The file is removed."""
    path = os.path.join(directory, f".fc-{name}-probe-{os.getpid()}-{threading.get_ident()}")
    buf = aligned_host_buffer(ALIGN)[1]
    try:
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_DIRECT, 0o600)
    except (OSError, AttributeError):
        return False
    try:
        buf[:] = ord("F")
        os.pwritev(fd, [buf], 0)
        return read(fd, buf)
    except OSError:
        return False
    finally:
        os.close(fd)
        try:
            os.unlink(path)
        except OSError:
            pass


def probe_direct_io(directory: str) -> bool:
    """True if ``directory``'s filesystem accepts 4 KiB-aligned O_DIRECT reads and writes."""
    if not hasattr(os, "O_DIRECT"):
        return False
    return _dio_roundtrip(directory, "odirect", lambda fd, buf: os.preadv(fd, [buf], 0) == ALIGN)


def _queue_int(queue: str, name: str) -> Optional[int]:
    try:
        with open(os.path.join(queue, name)) as f:
            return int(f.read().strip())
    except (OSError, ValueError):
        return None


def _dio_reads_at(directory: str, a: int) -> bool:
    """Whether an O_DIRECT read of ``a`` bytes at file offset ``a`` into memory ``a`` bytes past a
    page boundary works in ``directory`` (the filesystem may need more than its device)."""
    def read(fd: int, buf: np.ndarray) -> bool:
        os.lseek(fd, a, os.SEEK_SET)
        return os.readv(fd, [memoryview(buf)[a: 2 * a]]) == a

    return _dio_roundtrip(directory, "dioalign", read)


def dio_alignment(directory: str, sysfs: str = "/sys", verify: bool = True) -> int:
    """The alignment (bytes) that zero-copy restores' iovecs (memory address and length) and
    file offsets need on the block device holding ``directory`` (paper §3.3, FC-CIO).

    Linux O_DIRECT only needs memory aligned to the device's DMA alignment and file offsets and
    lengths to its logical block size. But on a device with a virtual boundary (NVMe's PRP lists:
    ``queue/virt_boundary_mask`` = 4095) the block layer ends a request at every iovec that does
    not start and end on a 4 KiB boundary: 1 KiB iovecs would each become one request. So the
    answer is :data:`~flatcake.common.align.ALIGN` (4096) unless the device reports
    ``virt_boundary_mask`` 0; then ``max(logical_block_size, dma_alignment + 1, 512)``, and only
    if an O_DIRECT read at that alignment (offset, length, memory) works in ``directory``
    (``verify``; the filesystem may need more than its device).

    The device is ``os.stat(directory).st_dev`` in ``{sysfs}/dev/block/MAJ:MIN``: a partition
    reads its parent disk's ``queue``; device-mapper and loop devices their own (it reflects the
    stack). No block device there (tmpfs, overlay, NFS, btrfs's anonymous devices), a value that
    does not read, or anything above 4096: 4096. Never raises.

    Args:
        directory: a directory on the device (the SSD pool's).
        sysfs: where sysfs is mounted (tests pass a fake tree).
        verify: run the O_DIRECT read check before answering less than 4096.

    Returns:
        512, 1024, 2048 or 4096 (a power of two dividing 4096).
    """
    try:
        dev = os.stat(directory).st_dev
        node = os.path.realpath(os.path.join(sysfs, "dev", "block", f"{os.major(dev)}:{os.minor(dev)}"))
    except (OSError, ValueError):
        return ALIGN
    queue = os.path.join(node, "queue")
    if not os.path.isdir(queue) and os.path.exists(os.path.join(node, "partition")):
        queue = os.path.join(os.path.dirname(node), "queue")
    mask, lbs, dma = (_queue_int(queue, n) for n in ("virt_boundary_mask", "logical_block_size", "dma_alignment"))
    if mask != 0 or lbs is None or dma is None:
        return ALIGN
    a = max(512, lbs, dma + 1)
    if a >= ALIGN or ALIGN % a:
        return ALIGN
    if verify and not _dio_reads_at(directory, a):
        return ALIGN
    return a


def aligned_host_buffer(nbytes: int, huge: bool = False) -> tuple[torch.Tensor, np.ndarray, mmap.mmap]:
    """Page-aligned host buffer of ``nbytes`` bytes (anonymous ``mmap``, zero-filled).

    ``huge``: ask for transparent huge pages (``madvise(MADV_HUGEPAGE)``; where the kernel
    declines, or ``FLATCAKE_HUGEPAGES=0``, ordinary pages) and fault the buffer in now: each
    O_DIRECT read into it then pins a few 2 MiB folios instead of one 4 KiB page per 4 KiB
    (about a quarter less CPU per GB restored here; docs/performance.md, "Huge pages for
    staging"). For buffers made once and kept (FC-CIO's staging windows, the cluster's registered
    buffers): the first fault of a huge page may compact memory, a cost a buffer made per call
    would pay each time.

    Returns:
        ``(tensor, array, mapping)``: a uint8 CPU tensor ``[nbytes]`` and a uint8 numpy array
        ``[nbytes]`` sharing the mapping's memory (address ≡ 0 mod 4096); keep ``mapping``
        alive as long as either view is used.

    Raises:
        ValueError: ``nbytes`` not a positive multiple of 4096.
    """
    if nbytes <= 0 or nbytes % ALIGN:
        raise ValueError(f"staging buffer size must be a positive multiple of {ALIGN}, got {nbytes}")
    m = mmap.mmap(-1, nbytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    if huge and os.environ.get("FLATCAKE_HUGEPAGES", "1") != "0":
        try:
            m.madvise(mmap.MADV_HUGEPAGE)
        except (AttributeError, OSError):  # no THP on this kernel/platform: ordinary pages
            pass
    arr = np.frombuffer(m, dtype=np.uint8)
    if huge:
        arr[::ALIGN] = 0  # fault every page in now (huge ones where granted), not in the first restore
    t = torch.from_numpy(arr)
    if t.data_ptr() % ALIGN:
        raise RuntimeError("mmap returned a buffer that is not 4 KiB aligned")
    return t, arr, m


class AlignedBuffer:
    """A page-aligned, reusable host buffer (anonymous mmap), grown on demand."""

    def __init__(self, nbytes: int = 0):
        self._mm: mmap.mmap | None = None
        self.nbytes = 0
        if nbytes:
            self.reserve(nbytes)

    def reserve(self, nbytes: int) -> memoryview:
        """A writable view of at least ``nbytes`` (rounded to 4 KiB), reusing the mapping."""
        n = align_up(max(nbytes, ALIGN))
        if n > self.nbytes:
            self._mm = aligned_host_buffer(n)[2]  # the old mapping is freed once no view holds it
            self.nbytes = n
        return memoryview(self._mm)[:n]
