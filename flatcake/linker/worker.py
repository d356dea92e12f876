"""A serial worker thread: the linker's load batches and offloads each run on one, in order.

Lifecycle::

    submit(job) ... (the thread runs run(job), one job after another)
    join()      wait until every job submitted so far finished (reset)
    close()     finish the queued jobs, then stop the thread
"""

from __future__ import annotations

import logging
import queue
import threading
from typing import Callable

log = logging.getLogger("flatcake.linker")


class SerialWorker:
    """Runs jobs one after another on a daemon thread.

    Args:
        run: ``run(job)``; should not raise.
        on_crash: ``on_crash(job, error)`` when ``run`` raised anyway (logged with its traceback):
            the job's waiters must still be told (a failed layer, a failed offload).
        name: the thread's name.
    """

    def __init__(self, run: Callable[[object], None], on_crash: Callable[[object, BaseException], None], name: str):
        self._run, self._on_crash, self.name = run, on_crash, name
        self._q: queue.Queue = queue.Queue()
        self._thread = threading.Thread(target=self._work, daemon=True, name=name)
        self._thread.start()

    def submit(self, job) -> None:
        """Queue ``job`` behind the jobs already queued."""
        self._q.put(job)

    def join(self) -> None:
        """Wait until every job submitted so far finished."""
        self._q.join()

    def close(self) -> None:
        """Finish the queued jobs, then stop the thread (idempotent)."""
        if self._thread.is_alive():
            self._q.put(None)
            self._thread.join()

    def _work(self) -> None:
        while True:
            job = self._q.get()
            try:
                if job is None:
                    return
                try:
                    self._run(job)
                except BaseException as e:  # noqa: BLE001 - a waiter must never be left waiting
                    log.exception("flatcake linker: %s job failed", self.name)
                    try:
                        self._on_crash(job, e)
                    except BaseException:  # noqa: BLE001
                        log.exception("flatcake linker: %s crash handler failed", self.name)
            finally:
                self._q.task_done()
