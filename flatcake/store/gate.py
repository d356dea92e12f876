"""The store's close gate: a running call finishes before resources go; a later call is refused."""

from __future__ import annotations

import threading


class OperationGate:
    """Counts operations in flight so ``close()`` can wait for them; after close every new
    operation is refused (a miss / failed put), never an exception."""

    def __init__(self):
        self._cv = threading.Condition()
        self._n = 0
        self.closed = False

    def enter(self) -> bool:
        with self._cv:
            if self.closed:
                return False
            self._n += 1
            return True

    def exit(self) -> None:
        with self._cv:
            self._n -= 1
            if self._n == 0:
                self._cv.notify_all()

    def close(self, timeout_s: float) -> bool:
        """Refuse new operations; wait up to ``timeout_s`` seconds for running ones."""
        with self._cv:
            self.closed = True
            return self._cv.wait_for(lambda: self._n == 0, timeout_s)

