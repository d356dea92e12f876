"""Reads first, writes in the gaps: the SSD write queue (Tutti, design notes §3; ``docs/design.md``,
"Write queue").

Concurrent reads and writes on one NVMe drive cut its aggregate bandwidth sharply, and a
restore is on a request's critical path while a write-back is not. With
``ssd.write_backlog_bytes > 0`` an SSD round is not written by SGLang's backup thread: the
backup thread gathers the round into its own aligned buffer (header | layer-major data |
record, exactly the bytes that go to disk) and queues it; one writer thread writes queued
rounds, oldest first, whole, only while no restore read is in flight.

Lifecycle of a queued round::

    backup thread    place (SSD space reserved, scope pinned) -> gather into its own buffer
                     -> submit: its pages are hits from now on, served from the buffer
    writer thread    wait until no restore is in flight -> pwrite the round in chunks of
                     WRITE_CHUNK_BYTES, pausing between chunks while a restore is in flight
                     -> commit (journal ROUND entry, publish the SSD entries) | abort
                     -> the round leaves the queue (its pages are read from SSD from now on)

A read never waits for the queue: it only bumps a counter (:meth:`WriteQueue.reads_begin`).
A write already issued (one chunk at most) finishes; the next chunk waits for the gap.

Deferral is bounded (issue 24 item 1; Tutti's slack windows have a bound too): when the oldest
queued round has waited ``ssd.write_defer_max_s`` or the backlog holds more than
``ssd.write_urgent_fraction`` of ``ssd.write_backlog_bytes``, writes are *urgent*: the writer
stops waiting for reads and shares the disk with them until the backlog is back under the
fraction and no round is past its deadline. With restores that never stop, backups keep
succeeding at the rate the disk gives writes beside reads; each round's deferral (queued →
written) goes into :attr:`WriteQueue.deferral_s` (p50/p99/max in the stats).

The SSD index entry of a page is published only after its round is on disk (publish after
write); before that the page is served from :class:`QueuedPage` (GVA medium
:data:`MEDIUM_QUEUED`, never stored in the index nor on disk). A queued round pins its scope,
so the watermark reclaim skips the scope; a round that finds the pool full may evict a scope
pinned only by rounds waiting here (:meth:`WriteQueue.evict_scope`: they leave the queue
unwritten; issue 24 item 3). A scope dropped or cleared while its round waits is not written
(its pages stop being served at once).
"""

from __future__ import annotations

import collections
import threading
import time
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Callable, Optional, Sequence

import numpy as np
import torch

from flatcake.gva.address import encode_gva
from flatcake.gva.index import pin_entries
from flatcake.media.directio import AlignedBuffer

#: GVA medium code of a page served from the write queue's buffer (in-memory copy of a round not
#: yet on disk). Never published in the index, never journaled.
MEDIUM_QUEUED = 2

#: bytes of one write call the writer thread issues at most; a read that arrives during a
#: deferred round waits for one such chunk at most
WRITE_CHUNK_BYTES = 8 << 20

#: rounds whose deferral (submit → write start) the queue keeps for its percentiles
DEFERRAL_SAMPLES = 4096


#: the most of an SSD pool's capacity its write queue may hold queued (pinned, unwritten) at once:
#: the rest keeps accepting rounds while the queue waits (a backlog as large as a small pool would
#: pin most of it and make puts fail with "SSD pool full")
BACKLOG_POOL_SHARE = 0.25


class BacklogBudget:
    """One rank's write-backlog bound (``ssd.write_backlog_bytes``), shared by the write queues
    of every pool of that rank (the KV pool and each v2 extra pool: indexer, draft, compressed,
    SWA), so they hold that many bytes together, not each (issue 24 item 3).

    Attributes:
        limit: bytes of queued rounds all the rank's queues may hold together.
        used: bytes they hold now (rounds queued or being written).
    """

    def __init__(self, limit: int):
        if limit <= 0:
            raise ValueError("a backlog budget must be > 0 bytes")
        self.limit = limit
        self.used = 0
        self.cond = threading.Condition()

    def fits(self, nbytes: int) -> bool:
        """A round of ``nbytes`` fits now (or no queue of the rank holds anything). Unlocked read."""
        used = self.used
        return not used or used + nbytes <= self.limit

    def add(self, nbytes: int) -> None:
        with self.cond:
            self.used += nbytes

    def sub(self, nbytes: int) -> None:
        with self.cond:
            self.used -= nbytes
            self.cond.notify_all()


@dataclass(eq=False)
class QueuedRound:
    """One SSD round waiting in the queue.

    Attributes:
        plc: its :class:`~flatcake.gva.placement.Placement` (SSD space reserved, scope pinned).
        parent: the key before its first page (``None`` at the root), for the commit.
        prepared: the round's bytes (:class:`~flatcake.store.write_path.PreparedRound`).
        enqueued_s: ``time.monotonic()`` when it was queued.
        nbytes: bytes the round writes (header, data and record).
        readers: reads copying from its buffer now (:meth:`WriteQueue.pin_leading_run`).
        done: it left the queue; its buffer goes back for reuse once ``readers`` is 0.
    """

    plc: object
    parent: Optional[str]
    prepared: object
    enqueued_s: float = 0.0
    readers: int = 0
    done: bool = False

    def acquire(self) -> bool:
        """A reader starts copying from the buffer; False once the round left the queue (the
        buffer may be reused: read the page from its medium instead). Call under the queue's lock."""
        if self.done:
            return False
        self.readers += 1
        return True

    @property
    def keys(self) -> list:
        """The round's page keys, in order."""
        return self.plc.keys

    def __post_init__(self):
        self.nbytes = self.prepared.layout.total_bytes  # bytes the round writes (header, data, record)

    @property
    def alive(self) -> bool:
        """False once its scope was dropped, cleared or retired (the round is not written)."""
        s = self.plc.scope
        return not (s.doomed or s.retired)

    def chunks(self, layer: int, positions: Sequence[int]) -> torch.Tensor:
        """uint8 ``[len(positions), chunk_bytes]``: layer ``layer`` of the round's pages at
        ``positions``, copied from the queued buffer (bit-exact with what goes to disk)."""
        data = self.prepared.data()  # [layers, n, chunk_bytes]
        return torch.from_numpy(np.ascontiguousarray(data[layer, np.asarray(positions, dtype=np.int64)]))


@dataclass(frozen=True, slots=True)
class QueuedPage:
    """Index-entry stand-in for a page whose round waits in the queue (duck-types
    :class:`~flatcake.gva.index.PageEntry` for the read path: ``gva`` medium
    :data:`MEDIUM_QUEUED`, ``scope`` pinned by the reader like any entry)."""

    gva: int
    scope: object
    job: QueuedRound
    pos: int
    layer_stride: int = 0
    checksums: object = None
    verify: bool = False
    generation: int = 0


class WriteQueue:
    """Holds SSD rounds while restores are in flight; one writer thread drains them in the gaps.

    Args:
        backlog_bytes: bytes of queued rounds at most (``ssd.write_backlog_bytes``, > 0); a
            round larger than the bound is still taken when the queue is empty.
        complete: ``complete(job)`` writes and commits (or aborts) a round; runs on the writer
            thread, must not raise (anything it raises is logged once and the round is lost).
        drop: ``drop(job)`` aborts a round that will not be written (scope gone, close).
        stats: the store's :class:`~flatcake.store.stats.StoreStats` (``write_deferred_s``).
        errors: the store's error-once log.
        node: GVA node field of :class:`QueuedPage` addresses.
    """

    def __init__(self, backlog_bytes: int, complete: Callable, drop: Callable, stats, errors, node: int = 0,
                 defer_max_s: float = 1.0, urgent_fraction: float = 0.5, budget: Optional[BacklogBudget] = None):
        if backlog_bytes <= 0:
            raise ValueError("backlog_bytes must be > 0 (0 means: no queue, synchronous writes)")
        #: this queue's own bound (its pool's share: :data:`BACKLOG_POOL_SHARE`)
        self.backlog_limit = backlog_bytes
        #: the rank's bound, shared with its other pools' queues (a budget of its own when alone)
        self.budget = budget if budget is not None else BacklogBudget(backlog_bytes)
        self.urgent_fraction = urgent_fraction
        #: seconds the oldest round may wait for reads; backlog bytes past which writes stop waiting
        self.defer_max_s, self.urgent_bytes = defer_max_s, urgent_fraction * backlog_bytes
        #: seconds each round waited from submit to the start of its write (the last DEFERRAL_SAMPLES)
        self.deferral_s: collections.deque[float] = collections.deque(maxlen=DEFERRAL_SAMPLES)
        self.urgent_rounds = 0  # rounds whose write started while reads were in flight (urgent)
        self._complete, self._drop, self.stats, self.errors, self.node = complete, drop, stats, errors, node
        self._cond = threading.Condition()
        self._jobs: collections.deque[QueuedRound] = collections.deque()
        #: scope -> its rounds waiting in :attr:`_jobs` (each holds one pin on the scope)
        self._waiting: collections.Counter = collections.Counter()
        self.evicted_rounds = 0  # waiting rounds taken out by reclaim (:meth:`evict_scope`)
        self._pending: dict[str, tuple[QueuedRound, int]] = {}
        self._bytes = self._pages = self._readers = 0
        self._in_flight: Optional[QueuedRound] = None
        self._closing = self._stopped = False
        self._thread: Optional[threading.Thread] = None
        self._free: list[AlignedBuffer] = []  # buffers of finished rounds, for reuse
        self._free_bytes = 0
        #: True while the writer thread has a round to write and waits for restores to end
        self.writer_held = False
        #: int64 [1]: restores in flight, read without the GIL by the writer's C piece loop
        self.readers_now = np.zeros(1, dtype=np.int64)

    # ================================================================ reads
    def reads_begin(self) -> None:
        """A restore read starts (or waits for a staging window, or is queued in the FC-MAS SSD
        lane: :meth:`~flatcake.store.page_store.PageStore.reads_pending`): hold writes not yet issued
        (unless they are urgent)."""
        with self._cond:
            self._readers += 1
            self._publish_hold_locked()

    def reads_end(self) -> None:
        """A restore read ended; writes drain once no read is in flight."""
        with self._cond:
            self._readers -= 1
            self._publish_hold_locked()
            if not self._readers:
                self._cond.notify_all()

    def _urgent_locked(self, now: Optional[float] = None) -> bool:
        """Writes may not wait for reads now: the backlog is past ``urgent_fraction`` or the oldest
        round (the one being written included) has waited ``defer_max_s``."""
        if self._bytes > self.urgent_bytes or self.budget.used > self.urgent_fraction * self.budget.limit:
            return True
        oldest = self._in_flight if self._in_flight is not None else (self._jobs[0] if self._jobs else None)
        return oldest is not None and (now or time.monotonic()) - oldest.enqueued_s >= self.defer_max_s

    def _publish_hold_locked(self) -> None:
        """What the writer's C piece loop reads without the GIL (:attr:`readers_now`): the reads
        it must pause for — 0 while writes are urgent."""
        self.readers_now[0] = 0 if self._urgent_locked() else self._readers

    @contextmanager
    def reading(self):
        """``with queue.reading(): restore(...)``: :meth:`reads_begin` / :meth:`reads_end`."""
        self.reads_begin()
        try:
            yield
        finally:
            self.reads_end()

    @property
    def reads_in_flight(self) -> int:
        """Restore reads in flight or queued (pending) now."""
        return self._readers

    # ================================================================ lookups (lock-free)
    def contains(self, key: str) -> bool:
        """True while ``key``'s page waits in the queue and its scope is live."""
        got = self._pending.get(key)
        return got is not None and got[0].alive

    def lookup(self, key: str) -> Optional[QueuedPage]:
        """The :class:`QueuedPage` of ``key`` while its round waits (scope live), else ``None``."""
        got = self._pending.get(key)
        if got is None or not got[0].alive:
            return None
        job, pos = got
        return QueuedPage(encode_gva(MEDIUM_QUEUED, self.node, pos), job.plc.scope, job, pos)

    def pin_leading_run(self, keys: Sequence[str], index) -> list:
        """The leading run of stored ``keys``, each pinned (like
        :meth:`~flatcake.gva.scopes.ScopeTable.pin_leading_run`): a page waiting in the queue
        as a :class:`QueuedPage` (its round's buffer held until :meth:`release`), else its
        published index entry. The queue is asked first: a round leaves it only after its SSD
        entries are published, so a page moving to disk is never missed. Scopes are pinned once
        per run of one scope's pages (:func:`~flatcake.gva.index.pin_entries`), up to the first
        retired one. The caller unpins the scopes and then calls :meth:`release` with the same
        entries."""
        out = self._leading_entries(keys, index)
        n = pin_entries(out)
        if n < len(out):  # a scope retired since the lookup ends the run
            self.release(out[n:])
            del out[n:]
        return out

    def _leading_entries(self, keys: Sequence[str], index) -> list:
        """The leading run of stored ``keys``, not pinned: queued pages (their round's buffer
        held) first, else index entries. Nothing queued now (the common restore): the index
        alone, since a page that enters the queue later is published only after it leaves."""
        if not self._pending:
            return index.leading_entries(keys)
        out: list = []
        get = index.get
        for k in keys:
            e = self.lookup(k)
            if e is not None:
                with self._cond:
                    held = e.job.acquire()
                if not held:  # it left the queue since the lookup: published, or failed
                    e = None
            if e is None:
                e = get(k)
                if e is None:
                    break
            out.append(e)
        return out

    def release(self, entries: Sequence) -> None:
        """End the reads of :meth:`pin_leading_run`'s queued pages (other entries are
        ignored): a round that left the queue gives its buffer back once its last reader ends."""
        if not any(issubclass(t, QueuedPage) for t in set(map(type, entries))):  # (a type per entry, in C)
            return
        jobs = [e.job for e in entries if isinstance(e, QueuedPage)]
        with self._cond:
            for job in jobs:
                job.readers -= 1
                if job.done and not job.readers:
                    self._recycle_locked(job)

    def take_buffer(self) -> AlignedBuffer:
        """A buffer for the next round's bytes: one a finished round gave back, else a new one
        (a fresh 64 MiB mapping costs ~90 ms of page faults here; a reused one ~5 ms)."""
        with self._cond:
            if self._free:
                buf = self._free.pop()
                self._free_bytes -= buf.nbytes
                return buf
        return AlignedBuffer()

    def _recycle_locked(self, job: QueuedRound) -> None:
        """Keep ``job``'s buffer for a later round (up to the backlog bound in all)."""
        buf = getattr(job.prepared, "buf", None)
        job.prepared = None
        if isinstance(buf, AlignedBuffer) and not self._stopped and \
                self._free_bytes + buf.nbytes <= self.backlog_limit:
            self._free.append(buf)
            self._free_bytes += buf.nbytes

    # ================================================================ backup thread
    def has_room(self, nbytes: int) -> bool:
        """True when a round of ``nbytes`` fits under the backlog bound (or the queue, the round
        being written included, is empty)."""
        with self._cond:
            return not self._closing and self._own_room(nbytes) and self.budget.fits(nbytes)

    def _own_room(self, nbytes: int) -> bool:
        return not self._bytes or self._bytes + nbytes <= self.backlog_limit

    def wait_for_room(self, nbytes: int, timeout_s: float) -> bool:
        """Block until :meth:`has_room` (True) or ``timeout_s`` seconds passed / the queue
        closed (False)."""
        deadline = time.monotonic() + timeout_s
        with self.budget.cond:  # every queue of the rank notifies it when a round leaves
            while not self._closing and not (self._own_room(nbytes) and self.budget.fits(nbytes)):
                left = deadline - time.monotonic()
                if left <= 0:
                    return False
                self.budget.cond.wait(left)
            return not self._closing

    def submit(self, job: QueuedRound) -> bool:
        """Queue ``job``: its pages are served from its buffer from now on. False (nothing
        queued) once the queue is closing."""
        with self._cond:
            if self._closing:
                return False
            job.enqueued_s = time.monotonic()
            self._jobs.append(job)
            self._waiting[job.plc.scope] += 1
            for i, k in enumerate(job.keys):
                self._pending[k] = (job, i)
            self._bytes += job.nbytes
            self._pages += len(job.keys)
            self.budget.add(job.nbytes)
            self._publish_hold_locked()
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name="flatcake-writer", daemon=True)
                self._thread.start()
            self._cond.notify_all()
        return True

    # ================================================================ writer thread
    def pause_for_reads(self) -> None:
        """Called by the writer between two chunks of a round: wait while a restore is in
        flight and writes are not urgent (the time counts as deferred)."""
        with self._cond:
            self._hold_locked(lambda: self._readers and not self._closing and not self._urgent_locked())

    def _hold_locked(self, held: Callable[[], bool]) -> None:
        """Wait while ``held()``, waking at the oldest round's deadline at the latest (it may
        make writes urgent while reads continue)."""
        t0 = None
        while held():
            t0 = t0 or time.monotonic()
            self.writer_held = True
            oldest = self._in_flight if self._in_flight is not None else (self._jobs[0] if self._jobs else None)
            wait = None if oldest is None else max(0.001, oldest.enqueued_s + self.defer_max_s - time.monotonic())
            self._cond.wait(wait if wait is not None and wait < 3600.0 else 3600.0)
        self.writer_held = False
        self._publish_hold_locked()
        if t0 is not None:
            self.stats.add(write_deferred_s=time.monotonic() - t0)

    def _next_locked(self) -> Optional[QueuedRound]:
        while not self._stopped and not self._jobs:
            self._cond.wait()
        self._hold_locked(lambda: self._jobs and self._readers and not self._closing and not self._stopped
                          and not self._urgent_locked())
        if self._stopped or not self._jobs:
            return None
        job = self._jobs.popleft()
        self._unwait_locked(job)
        self._in_flight = job
        now = time.monotonic()
        self.deferral_s.append(now - job.enqueued_s)
        if self._readers:
            self.urgent_rounds += 1
        self._publish_hold_locked()
        return job

    def _run(self) -> None:
        while True:
            with self._cond:
                job = self._next_locked()
                if job is None and self._stopped:
                    return
            if job is None:
                continue
            try:
                (self._complete if job.alive else self._drop)(job)
            except Exception as e:  # noqa: BLE001 - the writer thread never dies
                self.errors("deferred write", e)
            finally:
                self._finish(job)

    def _finish(self, job: QueuedRound) -> None:
        """``job`` left the queue (written and published, failed, or dropped)."""
        with self._cond:
            for k in job.keys:
                if self._pending.get(k, (None,))[0] is job:
                    del self._pending[k]
            self._bytes -= job.nbytes
            self._pages -= len(job.keys)
            self.budget.sub(job.nbytes)
            if self._in_flight is job:
                self._in_flight = None
            job.done = True
            if not job.readers:
                self._recycle_locked(job)
            self._publish_hold_locked()
            self._cond.notify_all()

    def _unwait_locked(self, job: QueuedRound) -> None:
        """``job`` left :attr:`_jobs` (taken by the writer, discarded or evicted)."""
        scope = job.plc.scope
        left = self._waiting[scope] - 1
        if left > 0:
            self._waiting[scope] = left
        else:
            del self._waiting[scope]

    # ================================================================ reclaim (issue 24 item 3)
    def waiting_pins(self, scope) -> int:
        """Pins on ``scope`` held only by its rounds waiting in the queue (not the one being
        written): ``scope.refcount`` equal to this means nothing else holds the scope — no
        reader, no write in flight — and reclaim may free it with :meth:`evict_scope`.
        Lock-free read (the writer lock, held by reclaim, keeps it from growing)."""
        return self._waiting.get(scope, 0)

    def evict_scope(self, scope, free: Callable[[list], bool]) -> list:
        """Reclaim sees a queued round for what it is: not yet written, holding its scope's space
        pinned. Free ``scope`` when the only pins on it are its rounds waiting here: under the
        queue's lock (the writer cannot take them meanwhile) drop their pins and call
        ``free(rounds)`` (:meth:`~flatcake.gva.scopes.ScopeTable.free_scope_locked`: retire,
        unpublish, free the extents whole, tell the retire listeners the rounds' keys too; False
        when a reader or a write pinned it since the check); then take the rounds out of the queue
        unwritten. They were never journaled nor published on SSD, so their pages just stop being
        hits. A reader copying from a round's buffer pins the scope first, so no scope is evicted
        under a reader. When ``free`` fails the pins and the scope's recency are put back and
        nothing changes. Caller holds the scope table's writer lock (nothing else retires a
        scope meanwhile).

        Returns:
            The :class:`QueuedRound` s taken out of the queue (empty: the scope was not freed).
        """
        with self._cond:
            n = self._waiting.get(scope, 0)
            if not n or scope.retired or scope.refcount != n or self._stopped:
                return []
            jobs = [j for j in self._jobs if j.plc.scope is scope]
            used = scope.last_used_s
            scope.release(n)
            if not free(jobs):  # a reader pinned it since the check
                scope.try_acquire(n)  # (not retired: only the writer lock's holder retires)
                scope.last_used_s = used
                return []
            self._jobs = collections.deque(j for j in self._jobs if j.plc.scope is not scope)
            del self._waiting[scope]
            for job in jobs:
                self._finish(job)
            self.evicted_rounds += len(jobs)
        self.stats.add(write_backlog_evicted_rounds=len(jobs))
        return jobs

    # ================================================================ admin
    def flush(self, timeout_s: float = 30.0) -> bool:
        """Wait until every queued round left the queue (writes still yield to reads).
        True when empty, False after ``timeout_s`` seconds."""
        deadline = time.monotonic() + timeout_s
        with self._cond:
            while self._jobs or self._in_flight is not None:
                left = deadline - time.monotonic()
                if left <= 0:
                    return False
                self._cond.wait(left)
        return True

    def discard_dead(self) -> int:
        """Take the rounds whose scope was dropped or cleared out of the queue without writing
        them (:meth:`drop` each); returns how many."""
        with self._cond:
            dead = [j for j in self._jobs if not j.alive]
            if dead:
                self._jobs = collections.deque(j for j in self._jobs if j.alive)
                for job in dead:
                    self._unwait_locked(job)
        for job in dead:
            self._drop_one(job)
        return len(dead)

    def _drop_one(self, job: QueuedRound) -> None:
        try:
            self._drop(job)
        except Exception as e:  # noqa: BLE001
            self.errors("deferred write", e)
        finally:
            self._finish(job)

    def close(self, timeout_s: float = 10.0) -> int:
        """Drain: write what is queued (reads no longer hold writes) for up to ``timeout_s``
        seconds, then stop the writer thread and drop what is left (never written, never
        journaled: a restart does not find it). Returns the rounds dropped. Idempotent."""
        with self._cond:
            self._closing = True
            self._cond.notify_all()
        self.flush(timeout_s)
        with self._cond:
            self._stopped = True
            left = list(self._jobs)
            self._jobs.clear()
            self._waiting.clear()
            self._free.clear()
            self._free_bytes = 0
            self._cond.notify_all()
            thread = self._thread
        for job in left:
            self._drop_one(job)
        if thread is not None and thread is not threading.current_thread():
            thread.join(timeout=max(1.0, timeout_s))
        return len(left)

    def snapshot(self) -> dict:
        """Backlog now: ``write_backlog_pages``, ``write_backlog_bytes`` (queued rounds,
        the one being written included), ``write_backlog_limit_bytes`` (this pool's bound),
        ``write_backlog_rank_bytes`` / ``write_backlog_rank_limit_bytes`` (every pool of the rank
        together, :class:`BacklogBudget`), ``reads_in_flight``; and
        the deferral of the last :data:`DEFERRAL_SAMPLES` rounds (seconds from submit to the start
        of their write): ``write_deferral_p50_s``, ``write_deferral_p99_s``,
        ``write_deferral_max_s`` (0 before the first round), ``write_deferral_rounds`` (rounds
        measured) and ``write_urgent_rounds`` (rounds written while reads were in flight: the
        bound made them urgent)."""
        with self._cond:
            d = sorted(self.deferral_s)
            pct = (lambda q: d[min(len(d) - 1, int(q * len(d)))]) if d else (lambda q: 0.0)
            return {"write_backlog_pages": self._pages, "write_backlog_bytes": self._bytes,
                    "write_backlog_limit_bytes": self.backlog_limit, "reads_in_flight": self._readers,
                    "write_backlog_rank_bytes": self.budget.used, "write_backlog_rank_limit_bytes": self.budget.limit,
                    "write_deferral_p50_s": pct(0.5), "write_deferral_p99_s": pct(0.99),
                    "write_deferral_max_s": d[-1] if d else 0.0, "write_deferral_rounds": len(d),
                    "write_urgent_rounds": self.urgent_rounds}


__all__ = ["BACKLOG_POOL_SHARE", "BacklogBudget", "MEDIUM_QUEUED", "QueuedPage", "QueuedRound", "WRITE_CHUNK_BYTES", "WriteQueue"]
