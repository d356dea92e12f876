"""FC-MAS: medium-aware request scheduling (paper §3.2; design README §2).

A request whose cached prefix lies entirely in DRAM can be prefilled now; one with any page on
SSD must first be restored, and a big restore must not hold up small ones or DRAM-only requests.
The scheduler keeps two queues:

* **DRAM-Ready**: requests that can be dispatched now, FIFO by *arrival time*. A request whose
  every cached page has GVA < 2**60 enters here on arrival.
* **SSD-Preparing**: requests with at least one page on SSD (classified by the slowest medium,
  ``max(gva) >= 2**60``). When a restore slot is free the request with the highest HRRN
  priority ``1 + wait_s / kv_bytes`` starts restoring: small restores go first, and since a
  waiting request's priority grows linearly with its wait, a big one cannot starve.

Lifecycle of one request::

    DRAM only: submit ──▶ DRAM-Ready ──pop_ready──▶ dispatch (prefill)
    SSD:       submit ──▶ SSD-Preparing ──start_restores──▶ restoring
                      ──finish_restore──▶ DRAM-Ready at its ORIGINAL arrival_s ──pop_ready──▶ dispatch

The scheduler only decides; the caller performs the restores (FC-CIO) and the prefill. It
reads time from an injected clock (seconds, any monotonic origin), so tests are deterministic.

Thread safety: every public method takes ``self._lock``; methods suffixed ``_locked`` expect
the caller to hold it. Restores typically finish on an I/O thread while the engine thread
submits and pops.
"""

from __future__ import annotations

import enum
import heapq
import itertools
import threading
import time
from dataclasses import dataclass
from typing import Callable, Iterable, Optional

# The DRAM/SSD boundary of the 64-bit GVA (medium field [63:60]; 0 = DRAM, 1 = SSD):
# every address >= 1 << 60 is on SSD (or a slower medium), so max(gva) decides.
from flatcake.gva.address import SSD_BOUNDARY, needs_ssd

__all__ = [
    "SSD_BOUNDARY",
    "Dispatch",
    "MasRequest",
    "MediumAwareScheduler",
    "QueueKind",
    "RestoreStart",
    "hrrn_priority",
]


class QueueKind(str, enum.Enum):
    """Which FC-MAS queue a request entered on submit."""

    DRAM_READY = "dram_ready"
    SSD_PREPARING = "ssd_preparing"


@dataclass(frozen=True)
class MasRequest:
    """One request as FC-MAS sees it.

    Attributes:
        request_id: caller's identifier; unique among requests the scheduler holds.
        arrival_s: arrival time on the scheduler's clock (seconds).
        max_gva: the largest GVA among the request's cached pages; ``None`` if no page is cached
            (nothing to restore, so DRAM-Ready).
        kv_bytes: bytes to restore from SSD (the HRRN denominator); 0 for a DRAM-only request.
    """

    request_id: str
    arrival_s: float
    max_gva: Optional[int]
    kv_bytes: int = 0

    @classmethod
    def from_gvas(cls, request_id: str, arrival_s: float, gvas: Iterable[int], kv_bytes: int = 0) -> "MasRequest":
        """Build from the GVAs of the cached pages (only their maximum is kept)."""
        return cls(request_id, arrival_s, max(gvas, default=None), kv_bytes)

    @property
    def needs_ssd(self) -> bool:
        """True if the slowest page is on SSD: ``max_gva >= 2**60``."""
        return self.max_gva is not None and needs_ssd([self.max_gva])


@dataclass(frozen=True)
class RestoreStart:
    """Decision: start the SSD restore of ``request`` now.

    Attributes:
        request: the chosen request.
        started_s: clock time of the decision (seconds).
        wait_s: time it waited in SSD-Preparing, ``started_s - arrival_s``.
        priority: its HRRN priority at the decision, ``1 + wait_s / kv_bytes`` (1/… per byte).
    """

    request: MasRequest
    started_s: float
    wait_s: float
    priority: float


@dataclass(frozen=True)
class Dispatch:
    """Decision: prefill ``request`` now (its KV is in DRAM or already restored).

    Attributes:
        request: the dispatched request.
        dispatched_s: clock time of the decision (seconds).
        wait_s: ``dispatched_s - arrival_s`` (includes any restore time).
        restored: True if it came through SSD-Preparing.
    """

    request: MasRequest
    dispatched_s: float
    wait_s: float
    restored: bool


def hrrn_priority(wait_s: float, kv_bytes: int) -> float:
    """Highest-response-ratio-next priority over bytes: ``1 + wait_s / kv_bytes`` (paper §3.2).

    Raises:
        ValueError: ``kv_bytes <= 0``.
    """
    if kv_bytes <= 0:
        raise ValueError(f"kv_bytes must be > 0, got {kv_bytes}")
    return 1.0 + wait_s / kv_bytes


class MediumAwareScheduler:
    """Two-queue medium-aware scheduler (FC-MAS, paper §3.2).

    Args:
        max_concurrent_restores: SSD restores in flight at once (FC-CIO staging windows,
            ``cio.windows``); at least 1.
        clock: returns the current time in seconds; defaults to :func:`time.monotonic`.

    Raises:
        ValueError: ``max_concurrent_restores < 1``.

    Ordering rules:
        * DRAM-Ready pops the smallest ``(arrival_s, submit order)``; it never waits for a
          restore, since restored and DRAM-only requests share the queue only by arrival time.
        * SSD-Preparing picks the largest ``wait_s / kv_bytes`` (same order as the HRRN
          priority, without the ``1 +`` that would cost float precision); ties go to the
          earlier arrival, then submit order. Picking is a scan, O(waiting), because HRRN
          priorities change with time and a heap cannot hold them.
    """

    def __init__(self, max_concurrent_restores: int = 1, clock: Callable[[], float] = time.monotonic):
        if max_concurrent_restores < 1:
            raise ValueError(f"max_concurrent_restores must be >= 1, got {max_concurrent_restores}")
        self.max_concurrent_restores = max_concurrent_restores
        self._clock = clock
        self._lock = threading.Lock()
        self._seq = itertools.count()
        # DRAM-Ready heap entries: (arrival_s, seq, request, restored)
        self._ready: list[tuple[float, int, MasRequest, bool]] = []
        # SSD-Preparing: request_id -> (seq, request)
        self._preparing: dict[str, tuple[int, MasRequest]] = {}
        # Restoring: request_id -> (seq, request)
        self._restoring: dict[str, tuple[int, MasRequest]] = {}
        self._ids: set[str] = set()

    @classmethod
    def from_config(cls, cfg, clock: Callable[[], float] = time.monotonic) -> "MediumAwareScheduler":
        """Build from a :class:`flatcake.config.FlatCakeConfig`: one restore slot per ``cio.windows``."""
        return cls(cfg.cio.windows, clock)

    # ---- queries ----------------------------------------------------------------------------

    @property
    def ready_count(self) -> int:
        """Requests in DRAM-Ready."""
        with self._lock:
            return len(self._ready)

    @property
    def preparing_count(self) -> int:
        """Requests waiting in SSD-Preparing (not yet restoring)."""
        with self._lock:
            return len(self._preparing)

    @property
    def restoring_count(self) -> int:
        """SSD restores in flight."""
        with self._lock:
            return len(self._restoring)

    # ---- transitions ------------------------------------------------------------------------

    def submit(self, request: MasRequest) -> QueueKind:
        """Admit a request into DRAM-Ready or SSD-Preparing by its slowest medium.

        Returns:
            The queue it entered.

        Raises:
            ValueError: duplicate ``request_id``, or an SSD request with ``kv_bytes <= 0``.
        """
        with self._lock:
            if request.request_id in self._ids:
                raise ValueError(f"request {request.request_id!r} is already scheduled")
            seq = next(self._seq)
            if request.needs_ssd:
                if request.kv_bytes <= 0:
                    raise ValueError(
                        f"request {request.request_id!r} has a page on SSD but kv_bytes={request.kv_bytes}"
                    )
                self._preparing[request.request_id] = (seq, request)
                kind = QueueKind.SSD_PREPARING
            else:
                heapq.heappush(self._ready, (request.arrival_s, seq, request, False))
                kind = QueueKind.DRAM_READY
            self._ids.add(request.request_id)
            return kind

    def start_restores(self) -> list[RestoreStart]:
        """Fill free restore slots from SSD-Preparing, highest HRRN priority first.

        Returns:
            One :class:`RestoreStart` per restore to begin now, in choice order (possibly empty).
        """
        with self._lock:
            now = self._clock()
            out = []
            while self._preparing and len(self._restoring) < self.max_concurrent_restores:
                out.append(self._start_best_locked(now))
            return out

    def start_restore(self) -> Optional[RestoreStart]:
        """Fill one free restore slot (the highest HRRN priority), or ``None`` if no slot is
        free or nothing waits. For a pool of restore workers that each take one at a time."""
        with self._lock:
            if not self._preparing or len(self._restoring) >= self.max_concurrent_restores:
                return None
            return self._start_best_locked(self._clock())

    def finish_restore(self, request_id: str) -> None:
        """Mark a restore done: the request re-enters DRAM-Ready at its original arrival time.

        The freed slot is filled by the next :meth:`start_restores` call.

        Raises:
            KeyError: ``request_id`` is not restoring.
        """
        with self._lock:
            if request_id not in self._restoring:
                raise KeyError(f"request {request_id!r} is not restoring")
            seq, req = self._restoring.pop(request_id)
            heapq.heappush(self._ready, (req.arrival_s, seq, req, True))

    def pop_ready(self) -> Optional[Dispatch]:
        """Dispatch the DRAM-Ready request with the earliest arrival, or ``None`` if empty."""
        with self._lock:
            if not self._ready:
                return None
            arrival_s, _, req, restored = heapq.heappop(self._ready)
            self._ids.discard(req.request_id)
            now = self._clock()
            return Dispatch(req, now, now - arrival_s, restored)

    def cancel(self, request_id: str) -> bool:
        """Drop a request that has not started restoring or been dispatched.

        Returns:
            True if it was removed; False if unknown, restoring (finish it first) or dispatched.
        """
        with self._lock:
            if request_id in self._preparing:
                del self._preparing[request_id]
            else:
                idx = next((i for i, e in enumerate(self._ready) if e[2].request_id == request_id), None)
                if idx is None:
                    return False
                self._ready.pop(idx)
                heapq.heapify(self._ready)
            self._ids.discard(request_id)
            return True

    # ---- internals --------------------------------------------------------------------------

    def _start_best_locked(self, now: float) -> RestoreStart:
        def key(item: tuple[int, MasRequest]):
            seq, req = item
            # max ratio wins; on a tie the earlier arrival, then the earlier submit
            return (-(now - req.arrival_s) / req.kv_bytes, req.arrival_s, seq)

        seq, req = min(self._preparing.values(), key=key)
        del self._preparing[req.request_id]
        self._restoring[req.request_id] = (seq, req)
        wait_s = now - req.arrival_s
        return RestoreStart(req, now, wait_s, hrrn_priority(wait_s, req.kv_bytes))
