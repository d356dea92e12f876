"""Restore lanes: the threads that run prefetch I/O in the order FC-MAS decides (paper §3.2).

Whoever drives them — the replay's concurrent serving model (:mod:`flatcake.replay.serving`)
and, inside SGLang, the controller plugin (:mod:`flatcake.adapter.plugin`) — hands each request's prefetch to a :class:`Lanes` object as a :class:`LaneOp` (what its cached
prefix needs: pages on DRAM, pages and bytes on SSD, and a callable that performs the reads) and
is told when it is done.

* :class:`FifoLanes` — SGLang 0.5.23's own behaviour: one I/O thread, operations strictly in
  submission order, so a DRAM-only prefetch waits behind every SSD restore queued before it.
* :class:`MediumAwareLanes` — FC-MAS: a DRAM lane (one thread; DRAM-only prefetches in arrival
  order, never behind a restore) and an SSD lane (``ssd_workers`` restores at once — the FC-CIO
  staging windows — picked by HRRN over bytes, ``1 + wait / kv_bytes``: small restores first,
  big ones never starve). A finished restore re-enters by its original arrival time: completions
  are announced through the same arrival-ordered DRAM-Ready queue as DRAM-only prefetches.

Lifecycle of an operation::

    submit(op) -> [DRAM lane: queue by arrival | SSD lane: HRRN pick when a restore slot frees]
               -> op.run() on a lane thread -> on_done(op), with submitted/started/finished times

``op.run()`` must not raise (the drivers catch their own errors); an exception that escapes
anyway is logged once and the operation still completes, so nothing waits forever.

Reads first (``docs/design.md``, "Write queue"): given ``pending_reads`` (e.g.
:meth:`flatcake.store.page_store.PageStore.reads_pending`), the lanes call ``pending_reads(+1)`` when an
operation that needs SSD is queued and ``pending_reads(-1)`` once its reads ended, so the SSD
write queue holds writes not yet started while a restore is queued, not only while it reads.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from dataclasses import dataclass, field
from typing import Callable, Optional

from flatcake.common.errorlog import ErrorLog
from flatcake.gva.address import SSD_BOUNDARY
from flatcake.mas.scheduler import MasRequest, MediumAwareScheduler

log = logging.getLogger("flatcake.mas")


@dataclass(eq=False)
class LaneOp:
    """One request's prefetch, as the lanes see it.

    Attributes:
        request_id: unique among operations in flight.
        arrival_s: the request's arrival time (seconds, ``time.monotonic`` origin).
        dram_pages: pages of its cached prefix on DRAM.
        ssd_pages: pages of its cached prefix on SSD.
        ssd_bytes: bytes to restore from SSD (the HRRN denominator).
        run: performs the reads; must not raise.
        on_done: called once with the operation when it completed (on a lane thread).
        submitted_s, started_s, finished_s: set by the lanes (``time.monotonic`` seconds).
        lane: ``"dram"`` or ``"ssd"`` (``"fifo"`` for :class:`FifoLanes`), set on submit.
    """

    request_id: str
    arrival_s: float
    dram_pages: int
    ssd_pages: int
    ssd_bytes: int
    run: Callable[[], None]
    on_done: Optional[Callable[["LaneOp"], None]] = None
    submitted_s: float = 0.0
    started_s: float = 0.0
    finished_s: float = 0.0
    lane: str = ""
    _done: threading.Event = field(default_factory=threading.Event, repr=False)
    _seq: int = field(default=-1, repr=False)

    @property
    def needs_ssd(self) -> bool:
        """True when some page of the prefix is on SSD."""
        return self.ssd_pages > 0

    def wait(self, timeout: Optional[float] = None) -> bool:
        """Block until the operation completed; False on timeout."""
        return self._done.wait(timeout)


class Lanes:
    """Interface: :meth:`submit` operations, :meth:`close` when done.

    Attributes:
        name: ``"fcfs"`` or ``"mas"``.
    """

    name = "base"

    def __init__(self, pending_reads: Optional[Callable[[int], None]] = None):
        self.errors = ErrorLog(log)  # each (what, exception kind) logged once, all counted
        self.pending_reads = pending_reads
        self._order_lock = threading.Lock()
        self._seq = 0
        self._unannounced: dict[int, None] = {}  # submission numbers not yet announced (insertion ordered)
        self._counts = {"dram": 0, "ssd": 0, "fifo": 0, "overtakes": 0, "overtaken": 0}

    def _note_submit(self, op: LaneOp) -> None:
        """Give ``op`` its submission number and count it on its lane."""
        with self._order_lock:
            op._seq = self._seq
            self._seq += 1
            self._unannounced[op._seq] = None
            self._counts[op.lane] += 1

    def _note_announce(self, op: LaneOp) -> None:
        """Count an announcement that passes operations submitted before ``op`` and not yet
        announced (what FC-MAS reorders; FIFO never does)."""
        with self._order_lock:
            self._unannounced.pop(op._seq, None)
            passed = sum(1 for seq in self._unannounced if seq < op._seq)
            if passed:
                self._counts["overtakes"] += 1
                self._counts["overtaken"] += passed

    def stats(self) -> dict:
        """What the lanes did so far: operations per lane (``dram``, ``ssd``; ``fifo`` for
        :class:`FifoLanes`), ``overtakes`` (announcements that passed an operation submitted
        earlier and still unannounced) and ``overtaken`` (how many they passed in all)."""
        with self._order_lock:
            return {"lanes": self.name, **self._counts}

    def _mark_pending(self, op: LaneOp, delta: int) -> None:
        """``pending_reads(delta)`` for an operation that needs SSD (an exception is logged once)."""
        if self.pending_reads is None or not op.needs_ssd:
            return
        try:
            self.pending_reads(delta)
        except Exception as e:  # noqa: BLE001 - a lane never dies
            self.errors("lanes pending reads", e)

    def submit(self, op: LaneOp) -> None:  # pragma: no cover - interface
        """Queue ``op``; returns at once."""
        raise NotImplementedError

    def close(self) -> None:  # pragma: no cover - interface
        """Finish what was submitted and stop the threads."""
        raise NotImplementedError

    def _execute(self, op: LaneOp) -> None:
        """Run ``op``; its pending-read mark (set at submit) ends once its reads ended."""
        op.started_s = time.monotonic()
        try:
            op.run()
        except Exception as e:  # noqa: BLE001 - a lane never dies and nothing waits forever
            self.errors("lanes prefetch", e)
        finally:
            self._mark_pending(op, -1)
        op.finished_s = time.monotonic()

    def _complete(self, op: LaneOp) -> None:
        """Announce ``op`` (``on_done``); an exception there is logged once, never ends a lane."""
        self._note_announce(op)
        try:
            if op.on_done is not None:
                op.on_done(op)
        except Exception as e:  # noqa: BLE001 - a lane never dies and nothing waits forever
            self.errors("lanes announcement", e)
        finally:
            op._done.set()


class FifoLanes(Lanes):
    """SGLang's prefetch-I/O thread: strict submission order (the FC-MAS ablation). With
    ``workers`` > 1 (the ``fifo-N`` control: FIFO with as many I/O threads as FC-MAS has),
    operations start in submission order, up to ``workers`` at once, each announced when its own
    reads end. ``lane`` is ``"fifo"`` either way.
    """

    def __init__(self, pending_reads: Optional[Callable[[int], None]] = None, workers: int = 1):
        super().__init__(pending_reads)
        if workers < 1:
            raise ValueError(f"workers must be >= 1 (got {workers})")
        self.name = "fcfs" if workers == 1 else f"fifo-{workers}"
        self.workers = workers  # I/O threads
        self._q: "queue.SimpleQueue[Optional[LaneOp]]" = queue.SimpleQueue()
        self._threads = [threading.Thread(target=self._work, name=f"fc-lane-fifo{i}", daemon=True)
                         for i in range(workers)]
        for t in self._threads:
            t.start()

    def submit(self, op: LaneOp) -> None:
        op.lane, op.submitted_s = "fifo", time.monotonic()
        self._note_submit(op)
        self._mark_pending(op, +1)
        self._q.put(op)

    def _work(self) -> None:
        while (op := self._q.get()) is not None:
            self._execute(op)
            self._complete(op)

    def close(self) -> None:
        for _ in self._threads:
            self._q.put(None)
        for t in self._threads:
            t.join()


class MediumAwareLanes(Lanes):
    """FC-MAS lanes over :class:`~flatcake.mas.scheduler.MediumAwareScheduler` (see the module
    docstring).

    Args:
        ssd_workers: SSD restores at once (``cio.windows``); at least 1.
        clock: the scheduler's clock (seconds); the arrival times given must use it.
        pending_reads: ``pending_reads(+1 / -1)`` around each SSD-lane operation, from its
            submit to the end of its reads (see the module docstring), or None.
    """

    name = "mas"

    def __init__(self, ssd_workers: int = 1, clock: Callable[[], float] = time.monotonic,
                 pending_reads: Optional[Callable[[int], None]] = None):
        super().__init__(pending_reads)
        self.scheduler = MediumAwareScheduler(ssd_workers, clock)
        self._ops: dict[str, LaneOp] = {}
        self._cv = threading.Condition()
        self._closed = False
        self._pending = 0  # submitted, not yet completed
        self._threads = [threading.Thread(target=self._dram_work, name="fc-lane-dram", daemon=True)]
        self._threads += [threading.Thread(target=self._ssd_work, name=f"fc-lane-ssd{i}", daemon=True)
                          for i in range(ssd_workers)]
        for t in self._threads:
            t.start()

    def submit(self, op: LaneOp) -> None:
        op.submitted_s = time.monotonic()
        op.lane = "ssd" if op.needs_ssd else "dram"
        max_gva = SSD_BOUNDARY if op.needs_ssd else 0
        with self._cv:  # the scheduler first: if it refuses the operation, nothing is left half-queued
            self.scheduler.submit(MasRequest(op.request_id, op.arrival_s, max_gva, max(1, op.ssd_bytes)))
            self._note_submit(op)
            self._ops[op.request_id] = op
            self._pending += 1
            self._mark_pending(op, +1)  # before a lane thread can run it (and end the mark)
            self._cv.notify_all()

    def _next_locked(self, take):
        """``take()``'s first non-None answer, waiting on the condition between tries; None once
        the lanes are closed and nothing is pending (the thread exits). ``_cv`` held."""
        while True:
            got = take()
            if got is not None:
                return got
            if self._closed and not self._pending:
                return None
            self._cv.wait(0.5)

    def _dram_work(self) -> None:
        """DRAM-Ready in arrival order: run a DRAM-only prefetch, or announce a finished restore."""
        while True:
            with self._cv:
                d = self._next_locked(self.scheduler.pop_ready)
                if d is None:
                    return
                op = self._ops.pop(d.request.request_id)
            try:
                if not d.restored:
                    self._execute(op)
                self._complete(op)
            finally:
                with self._cv:
                    self._pending -= 1
                    self._cv.notify_all()

    def _ssd_work(self) -> None:
        """Take the best waiting restore when a slot is free, run it, let it re-enter ready."""
        while True:
            with self._cv:
                start = self._next_locked(self.scheduler.start_restore)
                if start is None:
                    return
                op = self._ops[start.request.request_id]
            self._execute(op)
            with self._cv:
                self.scheduler.finish_restore(op.request_id)
                self._cv.notify_all()

    def close(self) -> None:
        with self._cv:
            self._closed = True
            self._cv.notify_all()
        for t in self._threads:
            t.join()


def make_lanes(name: str, ssd_workers: int = 1, pending_reads: Optional[Callable[[int], None]] = None) -> Lanes:
    """``"fcfs"`` -> :class:`FifoLanes` (one thread, SGLang's); ``"fifo-N"`` -> :class:`FifoLanes`
    with N threads; ``"mas"`` -> :class:`MediumAwareLanes`; all given ``pending_reads`` (see the
    module docstring).

    Raises:
        ValueError: another name, or N < 1.
    """
    if name == "fcfs":
        return FifoLanes(pending_reads)
    if name.startswith("fifo-") and name[5:].isdigit():
        return FifoLanes(pending_reads, workers=int(name[5:]))
    if name == "mas":
        return MediumAwareLanes(ssd_workers, pending_reads=pending_reads)
    raise ValueError(f"scheduler must be 'fcfs', 'fifo-N' or 'mas', got {name!r}")


__all__ = ["FifoLanes", "LaneOp", "Lanes", "MediumAwareLanes", "make_lanes"]
