"""Hold a store's write-queue writer inside the write of a round, for tests of what happens
while a round is being written (a drop that must wait for the writer to let go)."""

from __future__ import annotations

import threading


class HeldWriter:
    """From construction on, the next ``store.ssd.write`` (the writer thread writing a queued
    round: its placement holds the scope pinned) waits until :meth:`release`; ``entered`` is set
    once the writer is inside. Later writes go through at once.

    Args:
        store: a :class:`~flatcake.store.page_store.PageStore` with its write queue on (the default).
        monkeypatch: the test's ``monkeypatch`` (the patch is undone with the test).
    """

    def __init__(self, store, monkeypatch):
        self.entered, self._go = threading.Event(), threading.Event()
        real = store.ssd.write

        def write(*a, **kw):
            if not self.entered.is_set():
                self.entered.set()
                self._go.wait(120)  # (bounded: a failed test must not leave the writer parked)
            return real(*a, **kw)

        monkeypatch.setattr(store.ssd, "write", write)

    def release(self) -> None:
        """Let the writer write the held round (and everything after it)."""
        self._go.set()
