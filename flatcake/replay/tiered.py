"""``tiered``: a Mooncake-style three-tier store (HBM → DRAM → SSD), the paper's baseline
(``../shared/design/README.md`` §1; rules in ``docs/baselines.md``), called like the other
systems (:mod:`flatcake.replay.systems`).

* **Writes enter DRAM** (an LRU of whole pages, FlatCake's ``dram.capacity_bytes``).
* **Eviction demotes**: pages evicted from DRAM go to a demotion queue that one background
  thread (Mooncake's eviction-driven offload) appends to SSD **in eviction order**, packed into
  fixed-size bucket files (``bucket_bytes``; Mooncake's default bucket is 256 MB). A page waiting
  in the queue is still served from memory.
* **SSD space is reclaimed a bucket at a time, FIFO** (oldest bucket first) once the SSD
  capacity (FlatCake's ``ssd.max_files × ssd.file_bytes``) would be exceeded: every page in the
  bucket is dropped, whichever session it belongs to.
* **An SSD hit is staged**: a read reserves host staging for all its SSD pages at once from a
  shared budget (``staging_bytes``), reads each page (one O_DIRECT ``preadv`` per page, where the
  file system allows; pages of one session lie wherever eviction put them), copies it into the
  host pool and **promotes** it back into DRAM (the SSD copy stays, as Mooncake keeps its disk
  replica). When the budget cannot cover the call's SSD pages the prefetch is **revoked** from
  the first SSD page on: those pages are not delivered (the engine recomputes them) and are
  counted in ``staging_revoked_pages``.

Thread-safe (the serving model calls it from several threads); :meth:`close` stops the demoter.
"""

from __future__ import annotations

import os
import threading
import time
from collections import OrderedDict
from pathlib import Path
from queue import SimpleQueue
from typing import Any, Mapping, Optional

import torch

from flatcake.align import align_up
from flatcake.media.directio import AlignedBuffer, probe_direct_io
from flatcake.replay.engine import ModelProfile
from flatcake.replay.systems import COUNTER_KEYS, L3System

DEFAULT_BUCKET_BYTES = 256 << 20  # Mooncake's BucketStorageBackend: 256 MB buckets
DEFAULT_STAGING_BYTES = 1 << 30  # host staging budget shared by concurrent SSD reads


class TieredSystem(L3System):
    """See the module docstring.

    Args:
        root: directory for the bucket files (created; emptied by the harness).
        dram_bytes, ssd_bytes: capacities (bytes).
        extra: ``bucket_bytes`` and ``staging_bytes`` (bytes) overrides.
    """

    name = "tiered"

    def __init__(self, profile: ModelProfile, pool, root: Path, dram_bytes: int, ssd_bytes: int,
                 extra: Optional[Mapping[str, Any]] = None):
        super().__init__(profile, pool, None)
        extra = dict(extra or {})
        self.root = Path(root)
        self.root.mkdir(parents=True, exist_ok=True)
        self.record_bytes = align_up(profile.page_bytes)
        self.dram_pages = max(0, int(dram_bytes) // profile.page_bytes)
        self.ssd_bytes = int(ssd_bytes)
        self.bucket_bytes = max(self.record_bytes, min(int(extra.get("bucket_bytes", DEFAULT_BUCKET_BYTES)),
                                                       self.ssd_bytes // 4 or self.record_bytes))
        self.staging_bytes = int(extra.get("staging_bytes", DEFAULT_STAGING_BYTES))
        self.direct = probe_direct_io(str(self.root))
        self._lock = threading.Lock()
        self._dram: "OrderedDict[str, torch.Tensor]" = OrderedDict()
        self._pending: dict[str, torch.Tensor] = {}  # evicted, not yet on SSD
        self._ssd: dict[str, tuple[int, int]] = {}  # key -> (bucket, offset)
        self._buckets: "OrderedDict[int, list[str]]" = OrderedDict()  # bucket -> keys, oldest first
        self._fill = self.bucket_bytes  # bytes used in the newest bucket (full: open a new one)
        self._staged = 0
        self._c = dict.fromkeys(COUNTER_KEYS, 0)
        self._c["staging_revoked_pages"] = 0
        self._q: "SimpleQueue[Optional[str]]" = SimpleQueue()
        self._demoter = threading.Thread(target=self._demote_loop, name="tiered-demoter", daemon=True)
        self._demoter.start()

    # ------------------------------------------------------------------ tiers
    def _path(self, bucket: int) -> str:
        return str(self.root / f"{bucket:08d}.bucket")

    def _insert_dram_locked(self, key: str, page: torch.Tensor) -> None:
        self._dram[key] = page
        self._dram.move_to_end(key)
        while len(self._dram) > self.dram_pages:
            old, t = self._dram.popitem(last=False)
            if old not in self._ssd:  # promoted pages keep their disk replica
                self._pending[old] = t
                self._q.put(old)

    def _demote_loop(self) -> None:
        buf = AlignedBuffer(self.record_bytes)
        while (key := self._q.get()) is not None:
            with self._lock:
                page = self._pending.get(key)
            if page is None:
                continue
            view = buf.reserve(self.record_bytes)
            torch.frombuffer(view, dtype=torch.uint8)[: page.numel()].copy_(page)
            with self._lock:
                bucket, off = self._place_locked(key)
            fd = os.open(self._path(bucket), os.O_WRONLY | os.O_CREAT | (os.O_DIRECT if self.direct else 0), 0o644)
            try:
                os.pwrite(fd, view, off)
            finally:
                os.close(fd)
            with self._lock:
                if self._pending.pop(key, None) is not None and bucket in self._buckets:
                    self._ssd[key] = (bucket, off)  # (its bucket reclaimed meanwhile: the page is gone)
                self._c["ssd_write_bytes"] += self.record_bytes
                self._c["ssd_write_ops"] += 1

    def _place_locked(self, key: str) -> tuple[int, int]:
        """Next record slot in the newest bucket; a new bucket when it is full, reclaiming the
        oldest buckets (FIFO) while the SSD capacity would be exceeded."""
        if self._fill + self.record_bytes > self.bucket_bytes:
            while self._buckets and (len(self._buckets) + 1) * self.bucket_bytes > self.ssd_bytes:
                old, keys = self._buckets.popitem(last=False)
                for k in keys:
                    if self._ssd.get(k, (None,))[0] == old:
                        del self._ssd[k]
                try:
                    os.unlink(self._path(old))
                except FileNotFoundError:
                    pass
            newest = next(reversed(self._buckets), -1) + 1
            self._buckets[newest] = []
            self._fill = 0
        bucket = next(reversed(self._buckets))
        self._buckets[bucket].append(key)
        off = self._fill
        self._fill += self.record_bytes
        return bucket, off

    # ------------------------------------------------------------------ HiCache calls
    def _where_locked(self, key: str) -> Optional[str]:
        if key in self._dram:
            self._dram.move_to_end(key)
            return "dram"
        if key in self._pending:
            return "dram"
        return "ssd" if key in self._ssd else None

    def exists(self, keys, prefix_keys):
        t0 = time.perf_counter()
        with self._lock:
            n = 0
            for k in keys:
                if self._where_locked(k) is None:
                    break
                n += 1
        self.last_call_s = time.perf_counter() - t0
        return n

    def get(self, keys, host_indices, prefix_keys):
        t0, P = time.perf_counter(), self.page_size
        with self._lock:
            where = []
            for k in keys:
                w = self._where_locked(k)
                if w is None:
                    break
                where.append(w)
            need = where.count("ssd") * self.record_bytes
            if need and self._staged + need > self.staging_bytes:  # staging exhausted: revoke
                cut = where.index("ssd")
                self._c["staging_revoked_pages"] += len(where) - cut
                where, need = where[:cut], 0
            self._staged += need
        try:
            count, ssd = self._deliver(keys, host_indices, where, P)
        finally:
            with self._lock:
                self._staged -= need
        self.last_call_s = time.perf_counter() - t0
        return count, count - ssd, ssd

    def _deliver(self, keys, host_indices, where, P) -> tuple[int, int]:
        buf, count, ssd = AlignedBuffer(), 0, 0
        for i, w in enumerate(where):
            k, slot = keys[i], int(host_indices[i * P])
            with self._lock:
                page = self._dram.get(k) if k in self._dram else self._pending.get(k)
                loc = self._ssd.get(k) if page is None else None
            if page is None and loc is None:
                break  # reclaimed since the query: a miss from here on
            if page is None:
                view = buf.reserve(self.record_bytes)
                fd = os.open(self._path(loc[0]), os.O_RDONLY | (os.O_DIRECT if self.direct else 0))
                try:
                    got = os.preadv(fd, [view], loc[1])
                finally:
                    os.close(fd)
                if got < self.record_bytes:
                    break
                page = torch.frombuffer(view, dtype=torch.uint8)[: self.profile.page_bytes].clone()
                with self._lock:
                    self._c["ssd_read_bytes"] += self.record_bytes
                    self._c["ssd_read_ops"] += 1
                    self._c["logical_read_bytes_ssd"] += self.profile.page_bytes
                    self._insert_dram_locked(k, page)  # promote
                ssd += 1
            self.pool.set_from_flat_data_page(slot, page.view(self.pool.dtype))
            count += 1
        with self._lock:
            self._c["hit_pages_dram"] += count - ssd
            self._c["hit_pages_ssd"] += ssd
        return count, ssd

    def set(self, keys, host_indices, prefix_keys):
        t0, P = time.perf_counter(), self.page_size
        for i, k in enumerate(keys):
            page = self.pool.get_data_page(int(host_indices[i * P]), flat=True).contiguous().view(torch.uint8).clone()
            with self._lock:
                self._insert_dram_locked(k, page)
                self._c["dram_write_bytes"] += self.profile.page_bytes
                self._c["logical_write_bytes"] += self.profile.page_bytes
        self.last_call_s = time.perf_counter() - t0
        return True

    def medium_summary(self, keys):
        from flatcake.store import MediumSummary

        with self._lock:
            media = tuple(self._where_locked(k) for k in keys)
        ssd = media.count("ssd")
        return MediumSummary(media.count("dram"), ssd, ssd * self.profile.page_bytes, media)

    def counters(self) -> dict[str, int]:
        with self._lock:
            return dict(self._c)

    def drain(self, timeout: float = 30.0) -> bool:
        """Wait until every evicted page is on SSD (or dropped); False on timeout (seconds)."""
        end = time.monotonic() + timeout
        while time.monotonic() < end:
            with self._lock:
                if not self._pending:
                    return True
            time.sleep(0.005)
        return False

    def close(self) -> None:
        self._q.put(None)
        self._demoter.join(30)


__all__ = ["DEFAULT_BUCKET_BYTES", "DEFAULT_STAGING_BYTES", "TieredSystem"]
