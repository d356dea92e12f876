"""Fixed staging windows for FC-CIO (paper §3.3): O(1) staging memory, waits instead of revoking.

Lifecycle::

    StagingPool(windows, buffer_bytes, device)   # allocate (and register) once at start-up
      └─ acquire() -> StagingWindow               # blocks while every window is busy
           buffers[0], buffers[1]                 # double buffer: read into one, scatter the other
         release(window)                          # back to the pool, wakes one waiter
    close()                                       # deregister (GPU) and free

A window is two staging buffers of ``buffer_bytes`` each. On CPU they live in page-aligned
anonymous memory (``mmap``), so O_DIRECT reads can land in them; on GPU they live in HBM, are
4 KiB aligned by over-allocating and slicing, and are registered with cuFile through kvikio
(``kvikio.memory_register``; a no-op in compatibility mode).

The pool never grows: a restore that finds all windows busy waits on a condition variable, so
staging memory is ``2 × windows × buffer_bytes`` whatever the context length or concurrency.
"""

from __future__ import annotations

import logging
import mmap
import threading
from dataclasses import dataclass, field
from typing import Optional

import numpy as np
import torch

from flatcake.common.align import ALIGN, align_up
from flatcake.media.directio import aligned_host_buffer

log = logging.getLogger(__name__)


@dataclass
class StagingBuffer:
    """One staging buffer.

    Attributes:
        tensor: uint8 ``[nbytes]`` tensor on the staging device, address 4 KiB aligned.
        array: uint8 numpy view of the same memory (host buffers only; ``None`` on GPU).
        nbytes: size in bytes.
    """

    tensor: torch.Tensor
    array: Optional[np.ndarray]
    nbytes: int
    _keep: object = None  # owner of the memory (mmap or the over-allocated device tensor)

    def host_view(self, offset: int, nbytes: int):
        """Writable memoryview/array of ``[offset, offset+nbytes)`` for a POSIX read.

        Raises:
            RuntimeError: the buffer lives in device memory.
        """
        if self.array is None:
            raise RuntimeError("device staging buffer has no host view")
        return self.array[offset : offset + nbytes]


@dataclass
class StagingWindow:
    """Two staging buffers used alternately by one restore (double buffering).

    Attributes:
        index: window number in the pool.
        buffers: the two :class:`StagingBuffer` s.
        events: on GPU, one CUDA event per buffer recorded after its scatter; a buffer is refilled
            only after its event completed. ``None`` on CPU, where the scatter is synchronous.
    """

    index: int
    buffers: tuple[StagingBuffer, StagingBuffer]
    events: Optional[list] = field(default=None)


class StagingPool:
    """``windows`` double-buffered staging windows, allocated once.

    Args:
        windows: number of windows (concurrent restores served without waiting).
        buffer_bytes: bytes per buffer (multiple of 4096); each window holds two.
        device: ``"cpu"`` (page-aligned host memory) or ``"cuda[:N]"`` (HBM, cuFile-registered).

    Raises:
        ValueError: bad sizes, or a CUDA device requested where CUDA is unavailable.
    """

    def __init__(self, windows: int, buffer_bytes: int, device: str = "cpu"):
        if windows < 1:
            raise ValueError(f"windows must be >= 1, got {windows}")
        if buffer_bytes <= 0 or buffer_bytes % ALIGN:
            raise ValueError(f"buffer_bytes must be a positive multiple of {ALIGN}, got {buffer_bytes}")
        self.device = torch.device(device)
        self.buffer_bytes = buffer_bytes
        self._registered: list[torch.Tensor] = []
        self._windows: list[StagingWindow] = []
        if self.device.type == "cuda" and not torch.cuda.is_available():
            raise ValueError(f"staging device {device} requested but CUDA is not available")
        for w in range(windows):
            bufs = tuple(self._alloc() for _ in range(2))
            events = None
            if self.device.type == "cuda":
                events = [torch.cuda.Event(), torch.cuda.Event()]
                for ev in events:  # recorded once so the first wait returns at once
                    ev.record(torch.cuda.current_stream(self.device))
            self._windows.append(StagingWindow(w, bufs, events))  # type: ignore[arg-type]
        self._free = list(range(windows))
        self._cv = threading.Condition()
        self._closed = False
        self.waits = 0  # acquisitions that had to wait for a window (diagnostic)

    @property
    def windows(self) -> tuple[StagingWindow, ...]:
        """Every window of the pool, busy or not (their buffers' memory, for inspection)."""
        return tuple(self._windows)

    @property
    def total_bytes(self) -> int:
        """Staging memory held by the pool, in bytes (``2 × windows × buffer_bytes``)."""
        return 2 * len(self._windows) * self.buffer_bytes

    def _alloc(self) -> StagingBuffer:
        n = self.buffer_bytes
        if self.device.type == "cpu":
            t, arr, m = aligned_host_buffer(n, huge=True)
            return StagingBuffer(t, arr, n, m)
        raw = torch.empty(n + ALIGN, dtype=torch.uint8, device=self.device)
        skip = align_up(raw.data_ptr()) - raw.data_ptr()
        t = raw[skip : skip + n]
        try:  # register with cuFile (GDS); compat mode makes this a no-op
            import kvikio

            kvikio.memory_register(t)
            self._registered.append(t)
        except Exception as e:  # noqa: BLE001 - registration is an optimisation only
            log.info("cuFile buffer registration unavailable (%s); continuing unregistered", e)
        return StagingBuffer(t, None, n, raw)

    def acquire(self, timeout: Optional[float] = None) -> StagingWindow:
        """Take a free window, waiting while all are busy (never fails for lack of staging).

        Args:
            timeout: seconds to wait at most; ``None`` waits indefinitely.

        Raises:
            TimeoutError: ``timeout`` elapsed (only when a timeout is given).
            RuntimeError: the pool was closed.
        """
        with self._cv:
            if not self._free:
                self.waits += 1
            ok = self._cv.wait_for(lambda: self._free or self._closed, timeout=timeout)
            if self._closed:
                raise RuntimeError("staging pool is closed")
            if not ok:
                raise TimeoutError("no staging window became free")
            return self._windows[self._free.pop()]

    def release(self, window: StagingWindow) -> None:
        """Return ``window`` to the pool and wake one waiter."""
        with self._cv:
            self._free.append(window.index)
            self._cv.notify()

    def close(self) -> None:
        """Deregister device buffers and drop the windows; waiters get ``RuntimeError``."""
        with self._cv:
            self._closed = True
            self._cv.notify_all()
        if self._registered:
            try:
                import kvikio

                for t in self._registered:
                    kvikio.memory_deregister(t)
            except Exception:  # noqa: BLE001
                pass
            self._registered.clear()
