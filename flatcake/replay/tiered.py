"""``tiered``: a Mooncake-style three-tier store (HBM → DRAM → SSD), the paper's baseline
(``../shared/design/README.md`` §1; rules and sources in ``docs/baselines.md``), called like the
other systems (:mod:`flatcake.replay.systems`).

* **Writes enter DRAM** (an LRU of whole pages, FlatCake's ``dram.capacity_bytes``).
* **Eviction demotes**: pages evicted from DRAM go to a demotion queue that one background
  thread (Mooncake's eviction-driven offload) appends to SSD **in eviction order**, packed into
  fixed-size bucket files (``bucket_bytes``; Mooncake's default bucket is 256 MB). A page waiting
  in the queue is still served from memory. The demoter takes what is queued, up to ``io_depth``
  pages and never past the end of the bucket being filled, and writes that batch with one
  ``pwrite`` per page, all of them in flight at once on the writer pool (below); the pages are
  published on SSD when the whole batch has landed.
* **SSD space is reclaimed a bucket at a time, FIFO** (oldest bucket first) once the SSD
  capacity (FlatCake's ``ssd.max_files × ssd.file_bytes``) would be exceeded: every page in the
  bucket is dropped, whichever session it belongs to.
* **An SSD hit is staged**: a read reserves host staging for all its SSD pages at once from a
  shared budget (``staging_bytes``). When the budget cannot cover them the prefetch is
  **revoked** from the first SSD page on: those pages are not delivered (the engine recomputes
  them) and are counted in ``staging_revoked_pages``. Otherwise every SSD page of the call is
  read at once on the reader pool (one O_DIRECT ``preadv`` per page, where the file system
  allows; pages of one session lie wherever eviction put them), then the pages are copied into
  the host pool in key order and **promoted** back into DRAM (the SSD copy stays, as Mooncake
  keeps its disk replica).

A read call decides where each of its pages is served from under the lock when it starts, in
key order, exactly as delivering them one at a time would (an SSD page is promoted at its turn,
and a page that promotion evicts is found at its own turn where eviction left it), then reads
all its SSD pages at once. A bucket it reads from is kept open until its reads end (Mooncake's
``BucketReadGuard``), even if the bucket is reclaimed meanwhile.

**I/O pools** (Mooncake reads a batch with io_uring at queue depth 32; here threads do it, since
``os.preadv``/``os.pwrite`` release the GIL): a reader pool and a writer pool, each of
``io_depth`` threads (``replay.tiered_extra.io_depth``, default 32), started with the system.
Each thread owns one aligned staging buffer of one record, allocated and faulted in at start-up,
outside every timed call, and issues one I/O at a time, so at most ``io_depth`` reads (and,
separately, ``io_depth`` writes) are in flight; concurrent read calls share the reader pool.
:meth:`TieredSystem.counters` reports the most reads and writes seen in flight at once
(``ssd_read_qd_max``, ``ssd_write_qd_max``, measured around each system call).

Files: the bucket being filled stays open for writing (O_DIRECT where allowed) until it is full
or reclaimed; each live bucket read from keeps one read descriptor, closed when the bucket is
reclaimed (by its last reader, if a read is in flight) or on :meth:`TieredSystem.close`. The
staging *budget* above is the modelled Mooncake limit, not the pools' buffers.

Thread-safe (the serving model calls it from several threads); :meth:`TieredSystem.close`
stops the demoter and the pools.
"""

from __future__ import annotations

import math
import os
import threading
import time
from pathlib import Path
from queue import Empty, SimpleQueue
from typing import Any, Callable, Mapping, Optional, Sequence

import torch

from flatcake.common.align import ALIGN, align_up
from flatcake.media.directio import aligned_host_buffer, probe_direct_io
from flatcake.replay.baselines import DramOnlySystem
from flatcake.replay.engine import ModelProfile

DEFAULT_BUCKET_BYTES = 256 << 20  # Mooncake's BucketStorageBackend: 256 MB buckets
DEFAULT_STAGING_BYTES = 1 << 30  # host staging budget shared by concurrent SSD reads
DEFAULT_IO_DEPTH = 32  # Mooncake's SharedUringRing::QUEUE_DEPTH (mooncake-store/src/uring_file.cpp)
MAX_IO_DEPTH = 256  # threads per pool at most (FlatCake's cio.io_workers has the same bound)

#: the LRU's value for a page being promoted: a read planned it from SSD, its bytes not yet there
_READING: Any = object()

#: ``replay.tiered_extra`` keys and defaults: bucket and staging budget (bytes), I/O depth (I/Os
#: in flight per pool = threads per pool)
EXTRA_DEFAULTS: dict[str, int] = {"bucket_bytes": DEFAULT_BUCKET_BYTES, "staging_bytes": DEFAULT_STAGING_BYTES,
                                  "io_depth": DEFAULT_IO_DEPTH}


def check_extra(extra: Optional[Mapping[str, Any]]) -> dict[str, int]:
    """``replay.tiered_extra`` merged over :data:`EXTRA_DEFAULTS`, validated.

    Raises:
        ValueError: not a mapping, an unknown key, a value that is not a positive whole number
            (a boolean, a string, NaN or a fraction included), or an ``io_depth`` above
            :data:`MAX_IO_DEPTH` (the message names the key).
    """
    if extra is None:
        extra = {}
    if not isinstance(extra, Mapping):
        raise ValueError(f"replay.tiered_extra: must be a mapping (got {extra!r})")
    unknown = sorted(set(extra) - set(EXTRA_DEFAULTS))
    if unknown:
        raise ValueError(f"replay.tiered_extra: unknown key(s) {unknown} (known: {', '.join(EXTRA_DEFAULTS)})")
    out: dict[str, int] = {}
    for k, v in {**EXTRA_DEFAULTS, **dict(extra)}.items():
        if (isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v) or v <= 0
                or v != int(v)):
            raise ValueError(f"replay.tiered_extra.{k}: must be a positive whole number (got {v!r})")
        out[k] = int(v)
    if out["io_depth"] > MAX_IO_DEPTH:
        raise ValueError(f"replay.tiered_extra.io_depth: at most {MAX_IO_DEPTH} (got {out['io_depth']})")
    return out


class _ReadFd:
    """One bucket's read descriptor, shared by the reading threads (fields under the owner's lock)."""

    __slots__ = ("fd", "users", "live")

    def __init__(self, fd: int):
        self.fd, self.users, self.live = fd, 0, True


class _Gauge:
    """I/Os in flight now and the most seen at once; a context manager around each system call."""

    def __init__(self):
        self._lock = threading.Lock()
        self.now = 0
        self.max = 0

    def __enter__(self) -> None:
        with self._lock:
            self.now += 1
            self.max = max(self.max, self.now)

    def __exit__(self, *exc) -> None:
        with self._lock:
            self.now -= 1


class _Staging:
    """One I/O thread's aligned buffer of one record: ``view`` for the system call, ``tensor``
    (uint8) for copies. Faulted in when made, so no timed call pays for its first touch."""

    __slots__ = ("tensor", "view", "_mm")

    def __init__(self, nbytes: int):
        self.tensor, arr, self._mm = aligned_host_buffer(nbytes)
        arr[::ALIGN] = 0  # fault every page in now
        self.view = memoryview(self._mm)[:nbytes]


class _Batch:
    """The results of one :meth:`_IoPool.run` call, filled in by the pool's threads."""

    __slots__ = ("results", "error", "_left", "_lock", "_done")

    def __init__(self, n: int):
        self.results: list[Any] = [None] * n
        self.error: Optional[BaseException] = None
        self._left = n
        self._lock = threading.Lock()
        self._done = threading.Event()

    def finish(self, i: int, result: Any = None, error: Optional[BaseException] = None) -> None:
        with self._lock:
            self.results[i] = result
            if error is not None and self.error is None:
                self.error = error
            self._left -= 1
            if self._left == 0:
                self._done.set()

    def wait(self) -> list[Any]:
        self._done.wait()
        if self.error is not None:
            raise self.error
        return self.results


class _IoPool:
    """``depth`` threads, each with its own :class:`_Staging` of ``record_bytes``, running
    ``fn(staging, item)`` for the items of each :meth:`run`, one at a time per thread: at most
    ``depth`` of them at once (Mooncake's io_uring queue depth)."""

    def __init__(self, name: str, depth: int, record_bytes: int):
        self._q: "SimpleQueue[Optional[tuple]]" = SimpleQueue()
        self._threads = [threading.Thread(target=self._loop, args=(_Staging(record_bytes),),
                                          name=f"{name}{i}", daemon=True) for i in range(depth)]
        for t in self._threads:
            t.start()

    def _loop(self, staging: _Staging) -> None:
        while (task := self._q.get()) is not None:
            fn, item, batch, i = task
            try:
                batch.finish(i, fn(staging, item))
            except BaseException as e:  # handed to the caller of run()
                batch.finish(i, error=e)

    def run(self, fn: Callable[[_Staging, Any], Any], items: Sequence[Any]) -> list[Any]:
        """``[fn(staging, item) for item in items]``, the items spread over the pool's threads;
        returns when all are done. Raises the first exception one of them raised (after all
        ended)."""
        batch = _Batch(len(items))
        for i, item in enumerate(items):
            self._q.put((fn, item, batch, i))
        return batch.wait() if items else []

    def close(self) -> None:
        """Stop the threads once the queued work is done."""
        for _ in self._threads:
            self._q.put(None)
        for t in self._threads:
            t.join(30)


class TieredSystem(DramOnlySystem):
    """See the module docstring.

    Args:
        root: directory for the bucket files (created; emptied by the harness).
        dram_bytes, ssd_bytes: capacities (bytes).
        extra: ``replay.tiered_extra`` (:func:`check_extra`): ``bucket_bytes`` and
            ``staging_bytes`` (bytes), ``io_depth`` (I/Os in flight per pool).

    Raises:
        ValueError: ``extra`` that :func:`check_extra` refuses (the message names the key).
        OSError: a bucket file cannot be created, written or read.
    """

    name = "tiered"

    def __init__(self, profile: ModelProfile, pool, root: Path, dram_bytes: int, ssd_bytes: int,
                 extra: Optional[Mapping[str, Any]] = None):
        opts = check_extra(extra)
        super().__init__(profile, pool, dram_bytes)
        self.root = Path(root)
        self.root.mkdir(parents=True, exist_ok=True)
        self.record_bytes = align_up(profile.page_bytes)
        self.ssd_bytes = int(ssd_bytes)
        self.bucket_bytes = max(self.record_bytes, min(opts["bucket_bytes"], self.ssd_bytes // 4 or self.record_bytes))
        self.staging_bytes = opts["staging_bytes"]
        self.io_depth = opts["io_depth"]
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
        self._evicted_reading: set[str] = set()  # placeholders evicted without a disk replica
        self._reads_in_flight, self._writes_in_flight = _Gauge(), _Gauge()
        self._readers = _IoPool("tiered-read", self.io_depth, self.record_bytes)
        self._writers = _IoPool("tiered-write", self.io_depth, self.record_bytes)
        self._q: "SimpleQueue[Optional[str]]" = SimpleQueue()
        self._demoter = threading.Thread(target=self._demote_loop, name="tiered-demoter", daemon=True)
        self._demoter.start()

    # ------------------------------------------------------------------ files
    def _path(self, bucket: int) -> str:
        return str(self.root / f"{bucket:08d}.bucket")

    def _flags(self) -> int:
        return os.O_DIRECT if self.direct else 0

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
            self._close_write_fd()  # (the demoter's own descriptor: it is the caller, no write in flight)
        ent = self._rfds.pop(bucket, None)
        if ent is not None:
            ent.live = False
            if ent.users == 0:
                os.close(ent.fd)
        try:
            os.unlink(self._path(bucket))
        except FileNotFoundError:
            pass

    # ------------------------------------------------------------------ the I/O (pool threads)
    def _read_record(self, st: _Staging, item: tuple[_ReadFd, int]) -> Optional[torch.Tensor]:
        """The page at offset ``item[1]`` of bucket descriptor ``item[0]`` (a new tensor: its
        DRAM copy once promoted), or ``None`` on a short read."""
        ent, off = item
        with self._reads_in_flight:
            n = os.preadv(ent.fd, [st.view], off)
        if n < self.record_bytes:
            return None
        return st.tensor[: self.profile.page_bytes].clone().view(self.pool.dtype)

    def _write_record(self, st: _Staging, item: tuple[torch.Tensor, int, int]) -> None:
        """Write page ``item[0]`` as one record at offset ``item[2]`` of descriptor ``item[1]``."""
        page, fd, off = item
        flat = page.reshape(-1).view(torch.uint8)
        st.tensor[: flat.numel()].copy_(flat)
        with self._writes_in_flight:
            n = os.pwrite(fd, st.view, off)
        if n != self.record_bytes:
            raise OSError(f"tiered: short write to bucket file ({n} of {self.record_bytes} bytes)")

    # ------------------------------------------------------------------ tiers
    def _on_evict(self, key: str, page: torch.Tensor) -> None:
        if page is _READING:  # a page being promoted: its read demotes the bytes if it has no disk replica now
            if key not in self._ssd:
                self._evicted_reading.add(key)
            return
        if key not in self._ssd:  # promoted pages keep their disk replica
            self._pending[key] = page
            self._q.put(key)

    def _demote_loop(self) -> None:
        """Write the queued pages in batches (:meth:`_demote_batch`) until :meth:`close`'s
        ``None``; pages queued before it are written first."""
        keys: list[str] = []
        stop = False
        while True:
            if not keys:
                if stop or (key := self._q.get()) is None:
                    return
                keys.append(key)
            while not stop and len(keys) < self.io_depth:  # whatever else is queued, up to a batch
                try:
                    key = self._q.get_nowait()
                except Empty:
                    break
                if key is None:
                    stop = True
                else:
                    keys.append(key)
            keys = self._demote_batch(keys)

    def _demote_batch(self, keys: list[str]) -> list[str]:
        """Place the still-pending pages of ``keys`` in the bucket being filled (a new one when
        it is full) and write them, all at once on the writer pool; publish them on SSD once all
        landed. Returns the keys left for the next batch: those past the bucket's end."""
        with self._lock:
            pages, seen = [], set()
            for k in keys:  # (a key queued twice, re-evicted while pending, is written once)
                page = self._pending.get(k)
                if page is not None and k not in seen:
                    seen.add(k)
                    pages.append((k, page))
            room = (self.bucket_bytes - self._fill) // self.record_bytes or self.bucket_bytes // self.record_bytes
            pages, rest = pages[:room], [k for k, _ in pages[room:]]
            locs = [self._place_locked(k) for k, _ in pages]
        if not pages:
            return rest
        bucket = locs[0][0]
        if self._wfd is None:
            fd = os.open(self._path(bucket), os.O_WRONLY | os.O_CREAT | self._flags(), 0o644)
            self._wfd = (bucket, fd)
        assert self._wfd[0] == bucket and all(b == bucket for b, _ in locs)
        self._writers.run(self._write_record, [(page, self._wfd[1], off) for (_, page), (_, off) in zip(pages, locs)])
        if locs[-1][1] + 2 * self.record_bytes > self.bucket_bytes:
            self._close_write_fd()  # the bucket is full
        with self._lock:
            for (k, _), loc in zip(pages, locs):
                if self._pending.pop(k, None) is not None and bucket in self._buckets:
                    self._ssd[k] = loc  # (its bucket reclaimed meanwhile: the page is gone)
            self._c["ssd_write_bytes"] += len(pages) * self.record_bytes
            self._c["ssd_write_ops"] += len(pages)
        return rest

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
    def _locate_locked(self, key: str) -> Optional[tuple[str, Any]]:
        """``("dram", page)`` (refreshed in the LRU, or waiting for demotion), ``("ssd", (bucket,
        offset))``, or ``None``. A page another read is promoting (:data:`_READING`) is not in
        DRAM yet: it is found on SSD."""
        page = self._pages.get(key)
        if page is not None and page is not _READING:
            self._pages.move_to_end(key)
            return "dram", page
        page = self._pending.get(key)
        if page is not None:
            return "dram", page
        loc = self._ssd.get(key)
        return ("ssd", loc) if loc is not None else None

    def _where_locked(self, key: str) -> Optional[str]:
        found = self._locate_locked(key)
        return found[0] if found is not None else None

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
            plan, reads = self._plan_locked(keys[: len(where)])
            self._staged += need
        try:
            count, ssd = self._deliver(keys, host_indices, plan, reads, P)
        finally:
            with self._lock:
                self._staged -= need
        self.last_call_s = time.perf_counter() - t0
        return count, count - ssd, ssd

    def _plan_locked(self, keys: Sequence[str]) -> tuple[list[tuple[str, Any]], list[tuple[_ReadFd, int]]]:
        """Where each of ``keys`` is served from, decided in key order as if the pages were
        delivered one at a time: an SSD page is promoted at its turn (a :data:`_READING`
        placeholder enters the LRU until its bytes arrive), and a page that promotion evicts is
        found at its own turn where that left it (waiting for demotion: in memory; with a disk
        replica: on SSD). Returns the plan (``("dram", page)`` or ``("ssd", (bucket, offset))``
        per page, up to the first page held nowhere) and its SSD reads (``(descriptor,
        offset)``, one more user on each descriptor)."""
        plan: list[tuple[str, Any]] = []
        reads: list[tuple[_ReadFd, int]] = []
        try:
            for k in keys:
                found = self._locate_locked(k)
                if found is None:
                    break
                if found[0] == "ssd":
                    reads.append((self._read_fd_locked(found[1][0]), found[1][1]))
                    self._insert_locked(k, _READING)
                plan.append(found)
        except OSError:  # a bucket file that cannot be opened: undo; the caller sees the error
            for ent, _ in reads:
                self._release_fd_locked(ent)
            self._unplace_locked(plan, keys)
            raise
        return plan, reads

    def _unplace_locked(self, plan: Sequence[tuple[str, Any]], keys: Sequence[str]) -> None:
        """Take the placeholders of ``plan``'s SSD pages (reads that delivered nothing) out of
        the LRU."""
        for (medium, _), k in zip(plan, keys):
            if medium == "ssd":
                self._evicted_reading.discard(k)
                if self._pages.get(k) is _READING:
                    del self._pages[k]

    def _deliver(self, keys, host_indices, plan, reads, P) -> tuple[int, int]:
        """Read ``reads`` (the SSD pages of ``plan``) at once on the reader pool, then deliver
        ``plan``'s pages in order up to the first short read; each SSD page delivered takes its
        placeholder's place in the LRU (promoted)."""
        try:
            got = self._readers.run(self._read_record, reads)
        except BaseException:
            with self._lock:
                self._unplace_locked(plan, keys)
            raise
        finally:
            with self._lock:
                for ent, _ in reads:
                    self._release_fd_locked(ent)
        it = iter(got)
        pages: list[torch.Tensor] = []
        promoted: list[tuple[str, torch.Tensor]] = []
        for i, (medium, x) in enumerate(plan):
            page = next(it) if medium == "ssd" else x
            if page is None:
                break  # a short read: a miss from here on
            if medium == "ssd":
                promoted.append((keys[i], page))
            pages.append(page)
        with self._lock:
            done = sum(1 for p in got if p is not None)  # what the disk did, delivered or not
            self._c["ssd_read_bytes"] += done * self.record_bytes
            self._c["ssd_read_ops"] += done
            self._c["logical_read_bytes_ssd"] += len(promoted) * self.profile.page_bytes
            for k, page in promoted:
                if self._pages.get(k) is _READING:
                    self._pages[k] = page  # (its place in the LRU kept)
                elif k in self._evicted_reading:  # evicted meanwhile, with its bucket gone
                    self._on_evict(k, page)
                self._evicted_reading.discard(k)
            self._unplace_locked(plan[len(pages):], keys[len(pages):])
            self._c["hit_pages_dram"] += len(pages) - len(promoted)
            self._c["hit_pages_ssd"] += len(promoted)
        for i, page in enumerate(pages):
            self.pool.set_from_flat_data_page(int(host_indices[i * P]), page)
        return len(pages), len(promoted)

    def medium_summary(self, keys):
        from flatcake.store.page_store import MediumSummary

        with self._lock:
            media = tuple(self._where_locked(k) for k in keys)
        ssd = media.count("ssd")
        return MediumSummary(media.count("dram"), ssd, ssd * self.profile.page_bytes, media)

    def counters(self) -> dict[str, int]:
        """:data:`~flatcake.replay.systems.COUNTER_KEYS`, ``staging_revoked_pages``, and the
        most reads and writes seen in flight at once (``ssd_read_qd_max``, ``ssd_write_qd_max``)."""
        c = super().counters()
        c["ssd_read_qd_max"] = self._reads_in_flight.max
        c["ssd_write_qd_max"] = self._writes_in_flight.max
        return c

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
        """Stop the demoter (after the pages queued so far), the I/O pools, and close every
        descriptor."""
        self._q.put(None)
        self._demoter.join(30)
        self._writers.close()
        self._readers.close()
        with self._lock:
            if not self._demoter.is_alive():
                self._close_write_fd()
            for ent in self._rfds.values():
                ent.live = False
                if ent.users == 0:
                    os.close(ent.fd)
            self._rfds.clear()


__all__ = ["DEFAULT_BUCKET_BYTES", "DEFAULT_IO_DEPTH", "DEFAULT_STAGING_BYTES", "EXTRA_DEFAULTS", "MAX_IO_DEPTH",
           "TieredSystem", "check_extra"]
