"""SGLang plugin: FC-MAS restore lanes inside SGLang 0.5.23's cache controller (paper §3.2).

Installed as the ``flatcake`` entry point of SGLang's ``sglang.srt.plugins`` group, so every
SGLang scheduler process on the machine runs :func:`register` from ``load_plugins()``
(``managers/scheduler.py`` 6323). It registers one hook through SGLang's own hook registry::

    AROUND sglang.srt.managers.cache_controller.HiCacheController.prefetch_io_aux_func

(``HybridCacheController``, which every 0.5.23 server uses, inherits that method.) SGLang starts
the method as its prefetch-I/O thread, which takes one ``PrefetchOperation`` at a time from
``controller.prefetch_buffer`` and runs ``controller._page_transfer(op)`` (128-page
``batch_get_v1`` calls, one progress ack per batch), then a final ``PrefetchAck(completed_req=True)``
— strictly FIFO, so a DRAM-only prefetch waits behind every SSD restore queued before it.

When the hook is active the same thread becomes a dispatcher: it takes each operation from
``prefetch_buffer`` in arrival order, asks the backend where the hit's pages are
(:meth:`FlatCakeStorage.medium_summary` over ``op.hash_value``) and hands the operation to
:class:`~flatcake.mas.lanes.MediumAwareLanes` — the class the replay's serving model drives. A
lane thread runs the controller's own ``_page_transfer(op)`` and the lanes announce completion
(the final ack) in FC-MAS order: DRAM-only prefetches in arrival order on the DRAM lane, SSD
restores ``cio.windows`` at a time by HRRN ``1 + wait / kv_bytes``, a finished restore re-entering
by its arrival time (``op.start_time``). The acks themselves, the timeout policy, host-pool
accounting and the scheduler's admission are SGLang's, unchanged: the consumer
(``unified_radix_cache.py`` 3210-3240) matches each ack to its operation, not to a position.

The hook falls through to SGLang's own loop (nothing changes) when:

* ``FLATCAKE_PLUGIN`` is ``0``/``off``/``false``/``no`` (``flatcake-sglang --no-flatcake-plugin``);
* the controller's storage backend is not FlatCake (another backend, or storage detached; a
  FlatCake wrapped by SGLang's test fault injector, ``SGLANG_TEST_HICACHE_BACKEND_RANDOM_*``, is
  FlatCake: its lanes run, and the injector still delays or fails each call it wraps);
* the backend's ``mas.scheduler`` is ``fcfs`` (the FC-MAS ablation);
* the controller reduces acks over more than one rank (its sync groups: attention-TP — the TP
  group without DP attention —, attention-CP and PP, each when larger than 1; with DP attention
  and attention-TP = 1 there is nothing to reduce and the lanes are used): SGLang
  all-reduces progress acks positionally (``cache_controller.py`` 1463-1487), so every rank must
  emit them in the same order, and a medium-aware order computed from per-rank indexes could
  differ between ranks and hang the all-reduce. FIFO is kept and said once at start-up.

Each decision is logged once per process at INFO (``flatcake.plugin``) when the prefetch-I/O
thread starts, naming what was hooked or why not. (With ``FLATCAKE_PLUGIN=off`` the plugin
registers nothing and logs nothing: SGLang loads plugins before it configures logging.)
Stopping (``reset``/detach): every operation the lanes hold is marked terminated, so a running
``_page_transfer`` stops after its current 128-page batch (SGLang's own check) and the thread
ends well inside SGLang's 10 s join; operations not yet started are dropped without an ack, as
SGLang leaves them in ``prefetch_buffer``.
"""

from __future__ import annotations

import itertools
import logging
import os
import queue
import threading
import time
from typing import Any, Callable, Optional

from flatcake.common.errorlog import ErrorLog
from flatcake.mas.lanes import LaneOp, MediumAwareLanes

log = logging.getLogger("flatcake.plugin")

#: The method the plugin wraps (SGLang 0.5.23).
HOOK_TARGET = "sglang.srt.managers.cache_controller.HiCacheController.prefetch_io_aux_func"
#: Environment switch: a false-like value turns the plugin off in every process.
ENV_SWITCH = "FLATCAKE_PLUGIN"
_OFF = ("0", "off", "false", "no")

_errors = ErrorLog(log)  # failures: each kind logged once, all counted (flatcake.common.errorlog)
_said: set[str] = set()
_said_lock = threading.Lock()
_ids = itertools.count()


def _say_once(key: str, msg: str, *args: Any) -> None:
    with _said_lock:
        if key in _said:
            return
        _said.add(key)
    log.info(msg, *args)


def forget_said() -> None:
    """Let each once-per-process decision line be logged again (tests start from a clean slate)."""
    with _said_lock:
        _said.clear()


def plugin_enabled() -> bool:
    """False when ``FLATCAKE_PLUGIN`` is set to 0/off/false/no (case-insensitive)."""
    return os.environ.get(ENV_SWITCH, "").strip().lower() not in _OFF


def register() -> None:
    """Entry point of the ``sglang.srt.plugins`` group: register the AROUND hook on
    :data:`HOOK_TARGET` with SGLang's ``HookRegistry``. Registering changes nothing by itself:
    the hook decides per controller at thread start (see the module docstring). Never raises
    into SGLang's plugin loader for a disabled plugin; an SGLang without the hook registry
    raises ImportError, which SGLang's loader logs."""
    if not plugin_enabled():
        return  # nothing registered, nothing logged (SGLang configures logging after plugins load)
    from sglang.srt.plugins.hook_registry import HookRegistry, HookType

    HookRegistry.register(HOOK_TARGET, prefetch_io_around, HookType.AROUND)


def flatcake_backend(controller: Any):
    """The controller's storage backend if it is a :class:`FlatCakeStorage`, else None. A
    FlatCake behind SGLang's test fault injector counts (``HiCacheStorageFailureInjector``, which
    ``StorageBackendFactory.create_backend`` wraps around any backend when
    ``SGLANG_TEST_HICACHE_BACKEND_RANDOM_FAILURE`` / ``_DELAY`` are set,
    ``mem_cache/hicache_storage.py`` 514-537): the lanes then run the controller's own
    ``_page_transfer``, whose ``batch_get_v1`` calls still go through the injector."""
    from flatcake.adapter.storage import FlatCakeStorage

    backend = unwrap_fault_injector(getattr(controller, "storage_backend", None))
    return backend if isinstance(backend, FlatCakeStorage) else None


def unwrap_fault_injector(backend: Any) -> Any:
    """The backend inside SGLang's ``HiCacheStorageFailureInjector`` (its ``_backend``), or
    ``backend`` itself when it is not one."""
    try:
        from sglang.srt.mem_cache.hicache_storage import HiCacheStorageFailureInjector
    except ImportError:  # an SGLang without the injector
        return backend
    if isinstance(backend, HiCacheStorageFailureInjector):
        return getattr(backend, "_backend", None)
    return backend


def ack_ranks(controller: Any) -> int:
    """Process groups the controller all-reduces prefetch hits and acks over (0 at TP = PP = CP
    = 1; SGLang only creates groups of more than one rank, ``cache_controller.py`` 404-429)."""
    groups = list(getattr(controller, "prefetch_completion_sync_groups", None) or [])
    groups += list(getattr(controller, "prefetch_hits_sync_groups", None) or [])
    return len(groups)


def prefetch_io_around(original, controller, *args, **kwargs):
    """The AROUND hook: run :class:`PrefetchLanes` for a single-rank FlatCake controller whose
    ``mas.scheduler`` is ``mas``; otherwise SGLang's own ``prefetch_io_aux_func``."""
    backend = flatcake_backend(controller)
    if backend is None:
        _say_once("other", "flatcake plugin: the L3 backend is %s, not FlatCake: nothing hooked, SGLang's "
                  "prefetch I/O runs as is", type(getattr(controller, "storage_backend", None)).__name__)
        return original(controller, *args, **kwargs)
    if ack_ranks(controller):
        _say_once("ranks", "flatcake plugin: prefetch acks are all-reduced over more than one rank "
                  "(attention-TP, attention-CP or PP > 1): keeping SGLang's FIFO prefetch I/O so every rank "
                  "acks in the same order; FC-MAS lanes are off for this server")
        return original(controller, *args, **kwargs)
    if backend.cfg.mas.scheduler != "mas":
        _say_once("fcfs", "flatcake plugin: mas.scheduler = fcfs: SGLang's FIFO prefetch I/O kept")
        return original(controller, *args, **kwargs)
    windows = backend.cfg.cio.windows
    _say_once("active", "flatcake plugin: FC-MAS lanes drive %s (DRAM lane + %d concurrent SSD "
              "restore(s) by HRRN); set %s=off to keep SGLang's FIFO", HOOK_TARGET, windows, ENV_SWITCH)
    return PrefetchLanes(controller, backend, windows).run()


class PrefetchLanes:
    """The prefetch-I/O thread under FC-MAS (see the module docstring). A restore queued in the
    SSD lane counts as a pending read of the backend's store (``PageStore.reads_pending``), so its
    SSD write queue holds writes not yet started (``docs/design.md``, "Write queue").

    Args:
        controller: SGLang's ``HiCacheController`` (0.5.23): reads ``prefetch_buffer``,
            ``storage_stop_event``, ``prefetch_sync_queue``, ``_page_transfer``.
        backend: its :class:`FlatCakeStorage`.
        ssd_restores: concurrent SSD restores (``cio.windows``); at least 1.
        ack: builds the final acknowledgement, ``ack(operation)``; default SGLang's
            ``PrefetchAck(rid=op.request_id, completed_req=True, operation=op)``.
    """

    def __init__(self, controller: Any, backend: Any, ssd_restores: int,
                 ack: Optional[Callable[[Any], Any]] = None):
        self.controller = controller
        self.backend = backend
        self.ack = ack or _sglang_final_ack
        store = getattr(backend, "store", None)  # queued SSD restores hold its write queue's writes
        self.lanes = MediumAwareLanes(ssd_restores, pending_reads=getattr(store, "reads_pending", None))
        backend.prefetch_lanes = self.lanes  # its stats reach flatcake_stats() and the flatcake_mas_* metrics
        self._held: dict[int, Any] = {}  # id -> operation queued or running on the lanes
        self._held_lock = threading.Lock()

    def run(self) -> None:
        """Dispatch until the controller's stop event is set, then stop the lanes (operations
        not started are dropped, the running ones finish). Never raises."""
        cc = self.controller
        try:
            while not cc.storage_stop_event.is_set():
                try:
                    operation = cc.prefetch_buffer.get(block=True, timeout=1)
                except queue.Empty:
                    continue
                if operation is None:
                    continue
                try:
                    self.submit(operation)
                except Exception as e:  # noqa: BLE001 - the thread must live: run it as SGLang would
                    with self._held_lock:
                        self._held.pop(id(operation), None)
                    _errors("plugin queue (running it in place, FIFO)", e)
                    self.run_in_place(operation)
        finally:
            with self._held_lock:
                held = list(self._held.values())
            for operation in held:  # stop after the current batch: SGLang joins this thread for 10 s
                terminate = getattr(operation, "mark_terminate", None)
                if terminate is not None:
                    terminate()
            self.lanes.close()

    def run_in_place(self, operation: Any) -> None:
        """SGLang's own loop body: ``_page_transfer(op)``, then the final ack whatever happened
        (an exception is logged once instead of ending the thread)."""
        try:
            self.controller._page_transfer(operation)
        except Exception as e:  # noqa: BLE001
            _errors("plugin prefetch transfer", e)
        finally:
            self.controller.prefetch_sync_queue.put(self.ack(operation))

    def submit(self, operation: Any) -> None:
        """Classify ``operation`` by the medium of its hit pages and queue it on a lane."""
        pages = [] if operation.is_terminated() else list(operation.hash_value or [])
        summary = self.backend.medium_summary(pages)
        started = [False]

        def run() -> None:
            if self.controller.storage_stop_event.is_set():
                return  # stopping: left undone and unacked, as SGLang leaves prefetch_buffer
            started[0] = True
            self.controller._page_transfer(operation)

        def done(_op: LaneOp) -> None:
            with self._held_lock:
                self._held.pop(id(operation), None)
            if started[0]:  # what SGLang's loop puts after _page_transfer returns or raises
                self.controller.prefetch_sync_queue.put(self.ack(operation))

        arrival = float(getattr(operation, "start_time", 0.0) or time.monotonic())
        with self._held_lock:
            self._held[id(operation)] = operation
        self.lanes.submit(LaneOp(f"{operation.request_id}#{next(_ids)}", arrival,
                                 summary.dram_pages, summary.ssd_pages, summary.ssd_bytes,
                                 run=run, on_done=done))


def _sglang_final_ack(operation: Any) -> Any:
    from sglang.srt.managers.cache_controller import PrefetchAck

    return PrefetchAck(rid=operation.request_id, completed_req=True, operation=operation)


__all__ = ["ENV_SWITCH", "HOOK_TARGET", "PrefetchLanes", "ack_ranks", "flatcake_backend", "forget_said",
           "plugin_enabled", "prefetch_io_around", "register", "unwrap_fault_injector"]
