"""The store: one rank's KV pages, composed from the paper's mechanisms and the media.

:class:`~flatcake.store.page_store.PageStore` is the facade SGLang's adapters (``flatcake.adapter``,
``flatcake.linker``) and the replay call; beneath it the write path (``backup``, ``write_path``,
``write_queue``, ``deferred_round``, ``native_write``) places and writes rounds once (FC-GVA,
paper §3.1), the read path (``read_path``) restores them through FC-CIO (§3.3), ``stats`` and
``gate`` are its counters and close gate.
"""

from flatcake.store.page_store import PageStore

__all__ = ["PageStore"]
