"""FlatCake: an SGLang HiCache L3 storage backend that places each KV page at write time on
DRAM or SSD (FC-GVA), reads SSD pages with coalesced direct I/O (FC-CIO) and schedules
restores by medium (FC-MAS). See ``docs/design.md``.

``flatcake.FlatCakeStorage`` is the SGLang ``HiCacheStorage`` subclass and
``flatcake.FlatCakeLinker`` the direct L3 ``UnifiedCacheLinker`` (``docs/linker.md``); both are
imported lazily so the core can be used without SGLang installed.
"""

__version__ = "0.1.0"

__all__ = ["FlatCakeLinker", "FlatCakeStorage", "__version__"]


def __getattr__(name):
    if name == "FlatCakeStorage":
        from flatcake.adapter.storage import FlatCakeStorage

        return FlatCakeStorage
    if name == "FlatCakeLinker":
        from flatcake.linker import FlatCakeLinker

        return FlatCakeLinker
    raise AttributeError(name)
