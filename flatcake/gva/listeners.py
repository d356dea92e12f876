"""Callbacks the scope table calls when a round becomes visible or a scope is freed
(``docs/cluster.md``, "Backend wiring": how the cluster member learns what to publish and retire).

Both kinds are called under the writer lock (:attr:`flatcake.gva.scopes.ScopeTable.lock`), so
a listener must be quick (queue the work, never wait for I/O) and must not call back into the
store. A listener that raises is logged once (op named at construction) and never stops the
write or the reclaim that called it.
"""

from __future__ import annotations

from flatcake.common.errorlog import ErrorLog


class Listeners:
    """An ordered list of callables, all called with the same arguments.

    Args:
        errors: the store's error-once log.
        op: the op name a raising listener is logged under (``"retire listener"``, ...).
    """

    def __init__(self, errors: ErrorLog, op: str):
        self._fns: list = []
        self._errors, self._op = errors, op

    def append(self, fn) -> None:
        """Add ``fn`` (called after the ones already added)."""
        self._fns.append(fn)

    def __len__(self) -> int:
        return len(self._fns)

    def __call__(self, *args) -> None:
        """Call every listener with ``args``; exceptions are logged, never raised."""
        for fn in list(self._fns):
            try:
                fn(*args)
            except Exception as e:  # noqa: BLE001 - a listener never breaks the caller
                self._errors(self._op, e)
