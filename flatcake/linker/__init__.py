"""FlatCake's direct L3 door: SGLang 0.5.23's ``UnifiedCacheLinker`` over the rank's page store
(``docs/linker.md``). Selected with ``"linker_module_path": "flatcake.linker"``.

``FlatCakeLinker`` is imported lazily (it subclasses SGLang's ABC), so the linker's SGLang-free
parts — ``device_kv`` (device pools as page views), ``layer_loads`` — import without SGLang
(``scripts/linker_restore.py`` on a GPU machine)."""

__all__ = ["FlatCakeLinker"]


def __getattr__(name):
    if name == "FlatCakeLinker":
        from flatcake.linker.linker import FlatCakeLinker

        return FlatCakeLinker
    raise AttributeError(name)
