"""One :class:`~flatcake.store.page_store.PageStore` per rank, whichever SGLang door opened it.

FlatCake reaches SGLang through two doors: the HiCache L3 backend
(:class:`flatcake.adapter.storage.FlatCakeStorage`, pages through SGLang's host pool) and the
direct linker (:class:`flatcake.linker.FlatCakeLinker`, pages straight to the device pools). They
are two doors into one house: when both exist in one process for the same rank they use the same
store (pool files, journal, placement, checksums), never two stores over one ``ssd.path``.

Lifecycle::

    publish(store)            the door that opened the store offers it (it stays its owner)
    borrow(paths, geometry)   the other door takes it, or None: it opens its own and publishes it
    withdraw(store)           the owner, before it closes the store

A store is found by its resolved ``ssd.path`` list (placeholders filled for the rank) and its
page geometry. Borrowers never close a borrowed store; the owner closes it when its door closes.
"""

from __future__ import annotations

import threading
from typing import Optional, Sequence

from flatcake.common.layout import PageGeometry

_lock = threading.Lock()
_stores: dict = {}


def _key(paths: Sequence[str], geometry: PageGeometry) -> tuple:
    return tuple(paths), geometry


def publish(store) -> None:
    """Offer ``store`` (an open :class:`~flatcake.store.page_store.PageStore`) to the other door of this
    rank. A store already published under the same ``ssd.path`` and geometry is replaced."""
    with _lock:
        _stores[_key(store.cfg.ssd.paths, store.geometry)] = store


def withdraw(store) -> None:
    """Take ``store`` back (its owner is about to close it); a no-op when it is not published."""
    with _lock:
        key = _key(store.cfg.ssd.paths, store.geometry)
        if _stores.get(key) is store:
            del _stores[key]


def borrow(paths: Sequence[str], geometry: PageGeometry) -> Optional[object]:
    """The open store published for ``paths`` (the rank's resolved ``ssd.path`` list) and
    ``geometry``, or None. The borrower must not close it."""
    with _lock:
        store = _stores.get(_key(paths, geometry))
    return None if store is None or store.closed else store
