"""Importing SGLang 0.5.23 modules beyond ``hicache_storage`` on a CPU-only machine.

SGLang's host-pool package (``sglang.srt.mem_cache.pool_host``), which its cache controller and its
``mooncake`` storage backend import, pulls in the model configs and through them the multimodal
processors, which import torchvision at module level. PyPI's torchvision wheels do not load beside
the CPU torch 2.13.0 this project pins. When ``import torchvision`` fails,
:func:`ensure_importable` puts ``stubs/torchvision`` (names only; nothing on the storage path calls
it) first on ``sys.path``. A machine with a working torchvision keeps it.

The other imports need the ``sglang-controller`` extra of ``pyproject.toml`` (``make venv``
installs it without dependency trees).
"""

from __future__ import annotations

import sys
from pathlib import Path

#: directory holding the torchvision stand-in package
STUBS = Path(__file__).resolve().parent / "stubs"


def ensure_importable() -> bool:
    """Make ``import torchvision`` succeed, with the stand-in when the real one does not load.

    Returns:
        True when the stand-in is in use, False when the real torchvision loaded.
    """
    try:
        import torchvision  # noqa: F401
        return str(STUBS) in str(getattr(sys.modules.get("torchvision"), "__file__", ""))
    except Exception:  # noqa: BLE001 - any failure to load (missing, or ABI-incompatible): stand in
        for name in [m for m in sys.modules if m == "torchvision" or m.startswith("torchvision.")]:
            del sys.modules[name]
        if str(STUBS) not in sys.path:
            sys.path.insert(0, str(STUBS))
        return True
