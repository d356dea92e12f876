"""DRAM medium (GVA medium 0): one region allocated at start-up, cut into page slots.

The region is ``dram.capacity_bytes // page_bytes`` slots of one page each (a backend serves
one namespace, so every page has the same size). A page is stored page-major in its slot:
``[layers, chunk_bytes]`` (see :mod:`flatcake.common.layout`). DRAM GVA offset = ``slot * page_bytes``.

The region is pinned with ``cudaHostRegister`` when asked for (``dram.pin``: off by default; on;
auto = when CUDA is available), so H2D copies are DMA, and is plain memory otherwise. Slots are handed out and returned
under the store's writer lock (methods suffixed ``_locked``); reads need no lock because a slot
is never reused while a reader holds its scope (see :mod:`flatcake.gva.index`).
"""

from __future__ import annotations

import logging

import numpy as np
import torch
import xxhash

from flatcake.config import DramConfig

log = logging.getLogger("flatcake.dram")


def key_identity(key: str) -> int:
    """A page key's 64-bit identity (xxh3-64 of its UTF-8, never 0)."""
    return xxhash.xxh3_64_intdigest(key.encode()) or 1


class DramRegion:
    """Fixed DRAM region of page slots.

    Args:
        cfg: the ``dram`` config section.
        page_bytes: bytes of one page (all layers).

    Attributes:
        slots: uint8 tensor ``[n_slots, page_bytes]`` (``n_slots`` may be 0: DRAM disabled).
        identity: uint64 ``[n_slots]``: :func:`key_identity` of the page each slot holds, 0
            when it holds none. Set after a page's bytes are written, cleared when the slot is
            freed; a reader checks it against its key before copying (a slot that holds another
            page is a miss, never that page's bytes).

    Raises:
        RuntimeError: ``dram.pin: on`` without CUDA.
    """

    def __init__(self, cfg: DramConfig, page_bytes: int):
        self.cfg = cfg
        self.page_bytes = page_bytes
        self.n_slots = cfg.capacity_bytes // page_bytes if page_bytes else 0
        self.slots = torch.empty((self.n_slots, page_bytes), dtype=torch.uint8)
        self.pinned = False
        want_pin = cfg.pin == "on" or (cfg.pin == "auto" and torch.cuda.is_available())
        if want_pin and self.n_slots:
            if not torch.cuda.is_available():
                raise RuntimeError("dram.pin: on needs CUDA (no CUDA device is available)")
            rc = torch.cuda.cudart().cudaHostRegister(self.slots.data_ptr(), self.slots.numel(), 0)
            self.pinned = int(rc) == 0
            if not self.pinned:
                log.warning("cudaHostRegister of the DRAM region failed (rc=%s); using pageable memory", rc)
        self._free = list(range(self.n_slots - 1, -1, -1))  # pop() hands out low slots first
        self.identity = np.zeros(self.n_slots, dtype=np.uint64)

    def region_address(self) -> int:
        """Address of slot 0's first byte in this process (the region is one contiguous
        ``[n_slots * page_bytes]`` allocation; a DRAM GVA offset is relative to it). The cluster
        data plane registers ``[region_address(), + region_bytes())`` with the Transfer Engine."""
        return int(self.slots.data_ptr())

    def region_bytes(self) -> int:
        """Size of the region in bytes (``n_slots * page_bytes``; 0 when DRAM is disabled)."""
        return self.n_slots * self.page_bytes

    @property
    def free_slots(self) -> int:
        return len(self._free)

    def used_fraction(self) -> float:
        """Slots in use over slots (1.0 when the region is empty by configuration)."""
        return 1.0 if not self.n_slots else 1 - len(self._free) / self.n_slots

    def allocate_locked(self, n: int) -> list[int] | None:
        """``n`` free slot numbers, or ``None`` if fewer are free."""
        if n > len(self._free):
            return None
        return [self._free.pop() for _ in range(n)]

    def free_locked(self, slots: list[int]) -> None:
        """Return slots (whole-scope reclaim, or a write that failed); their identity is cleared."""
        if slots:
            self.identity[np.asarray(slots, dtype=np.int64)] = 0
        self._free.extend(slots)

    def set_identity(self, slots: list[int], keys: list[str]) -> None:
        """Record which page each slot now holds (after its bytes are written)."""
        self.identity[np.asarray(slots, dtype=np.int64)] = [key_identity(k) for k in keys]

    def holds(self, slots: list[int], keys: list[str]) -> np.ndarray:
        """bool ``[len(slots)]``: slot ``slots[i]`` holds the page of ``keys[i]``."""
        want = np.fromiter((key_identity(k) for k in keys), dtype=np.uint64, count=len(keys))
        return self.identity[np.asarray(slots, dtype=np.int64)] == want

    def state(self) -> dict:
        """``{"state": "healthy" | "disabled", "used_bytes", "capacity_bytes"}`` (bytes)."""
        used = self.n_slots - len(self._free)
        return {"state": "healthy" if self.n_slots else "disabled", "used_bytes": used * self.page_bytes,
                "capacity_bytes": self.n_slots * self.page_bytes}

    def close(self) -> None:
        if self.pinned:
            torch.cuda.cudart().cudaHostUnregister(self.slots.data_ptr())
            self.pinned = False
