"""One error-once logger for the whole backend.

SGLang calls the backend from its prefetch and backup threads, and an exception there disables
the L3 tier; a failing disk, meanwhile, fails the same way thousands of times. So an I/O fault
is turned into a miss or a failed put and reported here: every report is counted, and the
first report of each distinct ``(operation, reason)`` is logged once, with the errno name as
the reason when there is one (``EIO``, ``ENOSPC``, ``ENOENT``), so an operator sees each kind
of failure exactly once in the server log.
"""

from __future__ import annotations

import errno as errno_mod
import logging
import threading


def reason_of(err: BaseException) -> str:
    """Short reason for ``err``: its errno name (``"EIO"``), ``"EOF"`` for end-of-file errors,
    else the exception's type name."""
    code = getattr(err, "errno", None)
    if isinstance(code, int):
        return errno_mod.errorcode.get(code, str(code))
    return "EOF" if "EOF" in str(err) else type(err).__name__


class ErrorLog:
    """Counts errors; logs each distinct ``(operation, reason)`` once (thread-safe).

    Args:
        logger: where the first report of each kind goes (at WARNING).

    Attributes:
        count: reports so far (all of them, logged or not).
    """

    def __init__(self, logger: logging.Logger):
        self._log = logger
        self._counts: dict[tuple[str, str], int] = {}
        self._lock = threading.Lock()
        self.count = 0

    def report(self, op: str, reason: str, detail: str) -> None:
        """Count one failure of ``op`` (``"read"``, ``"put"``, ``"verify"``, ...) for ``reason``
        (an errno name or a short word such as ``"checksum"``); log it the first time this
        ``(op, reason)`` is seen, with ``detail`` (file, offset, key)."""
        with self._lock:
            self.count += 1
            key = (op, reason)
            seen = self._counts.get(key, 0)
            self._counts[key] = seen + 1
            if seen:
                return
        self._log.warning("flatcake %s failed (%s): %s; further errors of this kind are counted, not logged",
                          op, reason, detail)

    def count_of(self, op: str, reason: str) -> int:
        """Reports of ``(op, reason)`` so far (e.g. ``("verify", "checksum")``)."""
        with self._lock:
            return self._counts.get((op, reason), 0)

    def counts(self) -> dict[str, int]:
        """Every ``"op/reason"`` reported so far, with its count."""
        with self._lock:
            return {f"{op}/{reason}": n for (op, reason), n in self._counts.items()}

    def __call__(self, op: str, err: BaseException) -> None:
        """Report exception ``err`` raised by ``op`` (reason from :func:`reason_of`)."""
        self.report(op, reason_of(err), f"{type(err).__name__}: {err}")
