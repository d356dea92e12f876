"""Baselines without an L3 store on disk, called like the L3 systems (:mod:`flatcake.replay.systems`).

* ``recompute`` (:class:`RecomputeSystem`): SGLang with no host tier and no L3 — only its HBM
  prefix cache; every page beyond HBM is recomputed.
* ``dram-only`` (:class:`DramOnlySystem`): SGLang's host DRAM (L2) tier and no L3, given
  FlatCake's DRAM capacity (``dram.capacity_bytes``): an LRU of whole pages.
"""

from __future__ import annotations

import threading
import time
from collections import OrderedDict
from typing import Optional

import torch

from flatcake.replay.engine import ModelProfile
from flatcake.replay.systems import COUNTER_KEYS, L3System


class RecomputeSystem(L3System):
    """``recompute``: SGLang with no L3 (only its HBM prefix cache). The serving model runs no hit
    queries, reads or write-backs for it (``has_l3`` False); the one-request-at-a-time replay
    calls it like the others and gets 0 hits, and writes that store nothing and take no time."""

    name = "recompute"
    has_l3 = False

    def __init__(self, profile: ModelProfile, pool):
        super().__init__(profile, pool, None)

    def exists(self, keys, prefix_keys):
        self.last_call_s = 0.0
        return 0

    def get(self, keys, host_indices, prefix_keys):
        self.last_call_s = 0.0
        return 0, 0, 0

    def set(self, keys, host_indices, prefix_keys):
        self.last_call_s = 0.0
        return True

    def counters(self) -> dict[str, int]:
        return dict.fromkeys(COUNTER_KEYS, 0)


class DramOnlySystem(L3System):
    """``dram-only``: SGLang's host DRAM tier (``--hicache-host-memory-mode cache``) with no L3.

    Modelled as an LRU of whole pages holding ``capacity_bytes // page_bytes`` pages: a backup
    (write-through) copies a page's bytes in, evicting the least recently used pages beyond
    capacity; a hit query returns the leading run of pages held (and refreshes them); a read
    copies them into the host pages asked for. In SGLang an L2 hit is already in the host pool
    and is loaded to HBM without an L3 prefetch; here it goes through the same hit query and
    prefetch lanes as FlatCake's DRAM hits (one host copy a page), so the two DRAM tiers are
    compared on equal terms. No disk. Thread-safe.

    Subclasses (``tiered``) reuse the LRU: :meth:`_on_evict` sees each page it evicts, and
    :meth:`_where_locked` says where else a page may be.

    Args:
        capacity_bytes: DRAM bytes (FlatCake's ``dram.capacity_bytes`` in the replay).
    """

    name = "dram-only"

    def __init__(self, profile: ModelProfile, pool, capacity_bytes: int):
        super().__init__(profile, pool, None)
        self.capacity_pages = max(0, int(capacity_bytes) // profile.page_bytes)
        self._pages: "OrderedDict[str, torch.Tensor]" = OrderedDict()  # key -> flat page, LRU first
        self._lock = threading.Lock()
        self._c = dict.fromkeys(COUNTER_KEYS, 0)

    # ------------------------------------------------------------------ the LRU (under _lock)
    def _insert_locked(self, key: str, page: torch.Tensor) -> None:
        """Hold ``page`` as the most recently used; evict the least recently used pages beyond
        capacity, each through :meth:`_on_evict`."""
        self._pages[key] = page
        self._pages.move_to_end(key)
        while len(self._pages) > self.capacity_pages:
            old, evicted = self._pages.popitem(last=False)
            self._on_evict(old, evicted)

    def _on_evict(self, key: str, page: torch.Tensor) -> None:
        """Called under the lock for each page the LRU evicts, least recently used first:
        here it is dropped; ``tiered`` demotes it to SSD."""

    def _where_locked(self, key: str) -> Optional[str]:
        """``"dram"`` (and refreshed) when the LRU holds ``key``, else ``None``."""
        if key in self._pages:
            self._pages.move_to_end(key)
            return "dram"
        return None

    # ------------------------------------------------------------------ HiCache calls
    def exists(self, keys, prefix_keys):
        t0 = time.perf_counter()
        n = 0
        with self._lock:
            for k in keys:
                if self._where_locked(k) is None:
                    break
                n += 1
        self.last_call_s = time.perf_counter() - t0
        return n

    def get(self, keys, host_indices, prefix_keys):
        t0, P, count = time.perf_counter(), self.page_size, 0
        for i, k in enumerate(keys):
            with self._lock:
                page = self._pages.get(k)
                if page is not None:
                    self._pages.move_to_end(k)
            if page is None:
                break
            self.pool.set_from_flat_data_page(int(host_indices[i * P]), page)
            count += 1
        with self._lock:
            self._c["hit_pages_dram"] += count
        self.last_call_s = time.perf_counter() - t0
        return count, count, 0

    def set(self, keys, host_indices, prefix_keys):
        t0, P = time.perf_counter(), self.page_size
        for i, k in enumerate(keys):
            page = self.pool.get_data_page(int(host_indices[i * P]), flat=True).contiguous().clone()
            with self._lock:
                self._insert_locked(k, page)
                self._c["dram_write_bytes"] += self.profile.page_bytes
                self._c["logical_write_bytes"] += self.profile.page_bytes
        self.last_call_s = time.perf_counter() - t0
        return True

    def medium_summary(self, keys):
        from flatcake.store.page_store import MediumSummary

        n = len(keys)
        return MediumSummary(n, 0, 0, ("dram",) * n)

    def counters(self) -> dict[str, int]:
        with self._lock:
            return dict(self._c)


__all__ = ["DramOnlySystem", "RecomputeSystem"]
