"""Layer-wise loads of the direct linker: queued loads → one batch → layers in order (paper §3.2, §3.3).

Lifecycle of one batch (SGLang 0.5.23's ``UnifiedCacheLinker`` contract)::

    load(rid, transfers)          queue the request's pages and device slots        (scheduler thread)
    start_layer_wise_loading()    take the queued loads as one batch, order them by
                                  FC-MAS (DRAM-ready first, SSD by HRRN), hand the
                                  batch to the load thread; the counter index back  (scheduler thread)
      load thread:                pin the batch's pages once, then per layer:
                                  FC-CIO read of that layer (sorted, merged reads
                                  into the staging window, scatter into the device
                                  pool) -> layer_done_counter.complete(i, layer)
                                  a fault: fail(i, err) for that layer and the later ones
    forward                       wait_until(layer) per layer: layer 0 computes while
                                  later layers load
    finish_layer_wise_loading(i)  wait for the batch; True when every layer landed  (scheduler thread)

The batch is one read: every page of every request in it must land for a layer to complete
(SGLang aborts every request of a failed batch), so the FC-MAS order decides the order of the
pinned run, not who waits: DRAM-ready requests first (FIFO by queue time), then the requests
with pages on SSD by HRRN priority ``1 + wait_s / kv_bytes`` (small restores first; a big one
cannot starve since its priority grows with its wait).
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field
from typing import Callable, Optional, Sequence

from flatcake.mas.scheduler import hrrn_priority


class LinkerLoadError(RuntimeError):
    """A layer of a linker load batch did not land (a miss, an I/O fault, a checksum mismatch)."""


@dataclass(frozen=True)
class QueuedLoad:
    """One request's load, queued by ``load()`` until the next ``start_layer_wise_loading()``.

    Attributes:
        rid: SGLang's request id.
        keys: page keys (tail-relative: page 0 is the request's first page not on the device).
        page_ids: device page numbers, one per key.
        queued_s: ``time.monotonic()`` when it was queued (seconds; HRRN's wait).
        extras: ``(pool name, keys, device page ids)`` per SWA / Mamba transfer (hybrid models).
    """

    rid: str
    keys: tuple
    page_ids: tuple
    queued_s: float
    extras: tuple = ()


@dataclass
class LoadBatch:
    """The loads one ``start_layer_wise_loading()`` started, in FC-MAS order.

    Attributes:
        counter_index: the ``layer_done_counter`` producer index.
        loads: the requests' loads, in read order.
        ready: an event recorded when the batch started; the device slots are written after it.
        done: set when the load thread finished the batch (landed or failed).
        landed_layers: layers completed, in order (the load thread appends).
    """

    counter_index: int
    loads: list
    ready: object = None
    done: threading.Event = field(default_factory=threading.Event)
    landed_layers: list = field(default_factory=list)

    @property
    def keys(self) -> list:
        """Every page key of the batch, in read order."""
        return [k for ld in self.loads for k in ld.keys]

    @property
    def page_ids(self) -> list:
        """Every destination device page of the batch, in read order."""
        return [p for ld in self.loads for p in ld.page_ids]

    def pool_pages(self, name: str) -> tuple[list, list]:
        """``(keys, device page ids)`` of extra pool ``name`` (``"swa"``, ``"mamba"``) over the
        batch, in read order."""
        keys, ids = [], []
        for ld in self.loads:
            for pool, k, p in ld.extras:
                if pool == name:
                    keys.extend(k)
                    ids.extend(p)
        return keys, ids


def mas_order(loads: Sequence[QueuedLoad], ssd_bytes_of: Callable[[Sequence[str]], int],
              now_s: float) -> list[QueuedLoad]:
    """FC-MAS order of a batch's loads (paper §3.2).

    Args:
        loads: the queued loads.
        ssd_bytes_of: bytes a restore of those keys reads from SSD (0: every page in memory);
            :meth:`flatcake.store.page_store.PageStore.medium_summary`'s ``ssd_bytes``.
        now_s: ``time.monotonic()`` now (seconds).

    Returns:
        DRAM-ready loads first, FIFO by ``queued_s``; then loads with SSD pages by descending
        HRRN priority ``1 + wait_s / ssd_bytes`` (ties: FIFO).
    """
    dram, ssd = [], []
    for ld in loads:
        b = ssd_bytes_of(ld.keys)
        (ssd if b > 0 else dram).append((ld, b))
    dram.sort(key=lambda x: x[0].queued_s)
    ssd.sort(key=lambda x: (-hrrn_priority(max(0.0, now_s - x[0].queued_s), x[1]), x[0].queued_s))
    return [ld for ld, _ in dram] + [ld for ld, _ in ssd]


def monotonic() -> float:
    """The clock of queue times (seconds; tests may replace it)."""
    return time.monotonic()


def layer_groups(num_layers: int) -> list[range]:
    """The layer groups a batch is read in: one layer each, in order (``range(l, l + 1)``)."""
    return [range(layer, layer + 1) for layer in range(num_layers)]


def first_unlanded(batch: LoadBatch, num_layers: int) -> Optional[int]:
    """The first layer of ``batch`` that did not land, or None when all did."""
    n = len(batch.landed_layers)
    return None if n >= num_layers else n
