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

The DRAM tier is :class:`~flatcake.replay.baselines.DramOnlySystem`'s LRU, its evictions
demoted. Files: the bucket being filled stays open for writing (O_DIRECT where allowed) until it
is full or reclaimed; each live bucket read from keeps one read descriptor, closed when the
bucket is reclaimed (by its last reader, if a read is in flight) or on :meth:`close`. The page
staging memory is one reusable aligned buffer per thread; the staging *budget* above is the
modelled Mooncake limit, not this allocation.

Thread-safe (the serving model calls it from several threads); :meth:`close` stops the demoter.
"""

from __future__ import annotations

import os
import threading
import time
from pathlib import Path
from queue import SimpleQueue
from typing import Any, Mapping, Optional

import torch

from flatcake.align import align_up
from flatcake.media.directio import AlignedBuffer, probe_direct_io
from flatcake.replay.baselines import DramOnlySystem
from flatcake.replay.engine import ModelProfile

DEFAULT_BUCKET_BYTES = 256 << 20  # Mooncake's BucketStorageBackend: 256 MB buckets
DEFAULT_STAGING_BYTES = 1 << 30  # host staging budget shared by concurrent SSD reads


class _ReadFd:
    """One bucket's read descriptor, shared by the reading threads (fields under the owner's lock)."""

    __slots__ = ("fd", "users", "live")

    def __init__(self, fd: int):
        self.fd, self.users, self.live = fd, 0, True


class TieredSystem(DramOnlySystem):
    """See the module docstring.

    Args:
        root: directory for the bucket files (created; emptied by the harness).
        dram_bytes, ssd_bytes: capacities (bytes).
        extra: ``bucket_bytes`` and ``staging_bytes`` (bytes) overrides.

    Raises:
        OSError: a bucket file cannot be created, written or read.
    """

    name = "tiered"

    def __init__(self, profile: ModelProfile, pool, root: Path, dram_bytes: int, ssd_bytes: int,
                 extra: Optional[Mapping[str, Any]] = None):
        super().__init__(profile, pool, dram_bytes)
        extra = dict(extra or {})
        self.root = Path(root)
        self.root.mkdir(parents=True, exist_ok=True)
        self.record_bytes = align_up(profile.page_bytes)
        self.ssd_bytes = int(ssd_bytes)
        self.bucket_bytes = max(self.record_bytes, min(int(extra.get("bucket_bytes", DEFAULT_BUCKET_BYTES)),
                                                       self.ssd_bytes // 4 or self.record_bytes))
        self.staging_bytes = int(extra.get("staging_bytes", DEFAULT_STAGING_BYTES))
        self.direct = probe_direct_io(str(self.root))
        self._pending: dict[str, torch.Tensor] = {}  # evicted, not yet on SSD
        self._ssd: dict[str, tuple[int, int]] = {}  # key -> (bucket, offset)
        self._buckets: "dict[int, list[str]]" = {}  # bucket -> keys; insertion order = oldest first
        self._fill = self.bucket_bytes  # bytes used in the newest bucket (full: open a new one)
        self._next_bucket = 0
        self._staged = 0
        self._c["staging_revoked_pages"] = 0
        self._wfd: Optional[tuple[int, int]] = None  # (bucket, fd) being filled: the demoter's
        self._rfds: dict[int, _ReadFd] = {}  # live bucket -> its read descriptor
        self._tls = threading.local()  # per thread: a reusable aligned staging buffer
        self._q: "SimpleQueue[Optional[str]]" = SimpleQueue()
        self._demoter = threading.Thread(target=self._demote_loop, name="tiered-demoter", daemon=True)
        self._demoter.start()

    # ------------------------------------------------------------------ files
    def _path(self, bucket: int) -> str:
        return str(self.root / f"{bucket:08d}.bucket")

    def _flags(self) -> int:
        return os.O_DIRECT if self.direct else 0

    def _staging(self) -> memoryview:
        """This thread's aligned buffer, one record long (allocated once per thread)."""
        buf = getattr(self._tls, "buf", None)
        if buf is None:
            buf = self._tls.buf = AlignedBuffer()
        return buf.reserve(self.record_bytes)

    def _close_write_fd(self) -> None:
        if self._wfd is not None:
            os.close(self._wfd[1])
            self._wfd = None

    def _read_fd_locked(self, bucket: int) -> _ReadFd:
        """The bucket's shared read descriptor (opened on first use), with one more user."""
        ent = self._rfds.get(bucket)
        if ent is None:
            ent = self._rfds[bucket] = _ReadFd(os.open(self._path(bucket), os.O_RDONLY | self._flags()))
        ent.users += 1
        return ent

    def _release_fd_locked(self, ent: _ReadFd) -> None:
        ent.users -= 1
        if not ent.live and ent.users == 0:
            os.close(ent.fd)

    def _reclaim_locked(self, bucket: int) -> None:
        """Drop a bucket: its pages, its file, and its descriptors (a read descriptor still in
        use is closed by its last reader)."""
        for k in self._buckets.pop(bucket):
            if self._ssd.get(k, (None,))[0] == bucket:
                del self._ssd[k]
        if self._wfd is not None and self._wfd[0] == bucket:
            self._close_write_fd()  # (the demoter's own descriptor: it is the caller)
        ent = self._rfds.pop(bucket, None)
        if ent is not None:
            ent.live = False
            if ent.users == 0:
                os.close(ent.fd)
        try:
            os.unlink(self._path(bucket))
        except FileNotFoundError:
            pass

    # ------------------------------------------------------------------ tiers
    def _on_evict(self, key: str, page: torch.Tensor) -> None:
        if key not in self._ssd:  # promoted pages keep their disk replica
            self._pending[key] = page
            self._q.put(key)

    def _demote_loop(self) -> None:
        while (key := self._q.get()) is not None:
            with self._lock:
                page = self._pending.get(key)
            if page is None:
                continue
            view = self._staging()
            flat = page.reshape(-1).view(torch.uint8)
            torch.frombuffer(view, dtype=torch.uint8)[: flat.numel()].copy_(flat)
            with self._lock:
                bucket, off = self._place_locked(key)
            if self._wfd is None:
                fd = os.open(self._path(bucket), os.O_WRONLY | os.O_CREAT | self._flags(), 0o644)
                self._wfd = (bucket, fd)
            os.pwrite(self._wfd[1], view[: self.record_bytes], off)
            if off + 2 * self.record_bytes > self.bucket_bytes:
                self._close_write_fd()  # the bucket is full
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
                self._reclaim_locked(next(iter(self._buckets)))
            self._buckets[self._next_bucket] = []  # numbers never reused: a file is never rewritten
            self._next_bucket += 1
            self._fill = 0
        bucket = next(reversed(self._buckets))
        self._buckets[bucket].append(key)
        off = self._fill
        self._fill += self.record_bytes
        return bucket, off

    # ------------------------------------------------------------------ HiCache calls
    def _where_locked(self, key: str) -> Optional[str]:
        if key in self._pages:
            self._pages.move_to_end(key)
            return "dram"
        if key in self._pending:
            return "dram"
        return "ssd" if key in self._ssd else None

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

    def _read_page(self, loc: tuple[int, int], ent: _ReadFd) -> Optional[torch.Tensor]:
        """The page at ``loc`` (bucket, offset) through ``ent``, or ``None`` on a short read."""
        view = self._staging()
        if os.preadv(ent.fd, [view], loc[1]) < self.record_bytes:
            return None
        return torch.frombuffer(view, dtype=torch.uint8)[: self.profile.page_bytes].clone().view(self.pool.dtype)

    def _deliver(self, keys, host_indices, where, P) -> tuple[int, int]:
        count, ssd = 0, 0
        for i in range(len(where)):
            k, slot = keys[i], int(host_indices[i * P])
            with self._lock:
                page = self._pages.get(k) if k in self._pages else self._pending.get(k)
                loc = self._ssd.get(k) if page is None else None
                ent = self._read_fd_locked(loc[0]) if loc is not None else None
            if page is None and loc is None:
                break  # reclaimed since the query: a miss from here on
            if page is None:
                try:
                    page = self._read_page(loc, ent)
                finally:
                    with self._lock:
                        self._release_fd_locked(ent)
                if page is None:
                    break
                with self._lock:
                    self._c["ssd_read_bytes"] += self.record_bytes
                    self._c["ssd_read_ops"] += 1
                    self._c["logical_read_bytes_ssd"] += self.profile.page_bytes
                    self._insert_locked(k, page)  # promote
                ssd += 1
            self.pool.set_from_flat_data_page(slot, page)
            count += 1
        with self._lock:
            self._c["hit_pages_dram"] += count - ssd
            self._c["hit_pages_ssd"] += ssd
        return count, ssd

    def medium_summary(self, keys):
        from flatcake.store import MediumSummary

        with self._lock:
            media = tuple(self._where_locked(k) for k in keys)
        ssd = media.count("ssd")
        return MediumSummary(media.count("dram"), ssd, ssd * self.profile.page_bytes, media)

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
        """Stop the demoter (pages still queued are not written) and close every descriptor."""
        self._q.put(None)
        self._demoter.join(30)
        with self._lock:
            if not self._demoter.is_alive():
                self._close_write_fd()
            for ent in self._rfds.values():
                ent.live = False
                if ent.users == 0:
                    os.close(ent.fd)
            self._rfds.clear()


__all__ = ["DEFAULT_BUCKET_BYTES", "DEFAULT_STAGING_BYTES", "TieredSystem"]
