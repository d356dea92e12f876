"""Import SGLang 0.5.23's real cache controller on the CPU.

It needs the ``sglang-controller`` extra (``make venv`` installs it without dependency trees) and
torchvision, whose PyPI wheels do not load beside the CPU torch 2.13.0: when ``import
torchvision`` fails, ``stubs/torchvision`` (names only; the storage threads never call it) stands
in. Tests that need the controller take the ``controller_module`` fixture, which skips with the
import error when the extra is missing.
"""

from __future__ import annotations

import importlib
import sys
from pathlib import Path

import pytest

STUBS = Path(__file__).resolve().parent / "stubs"


def _torchvision_or_stub() -> None:
    try:
        import torchvision  # noqa: F401
    except Exception:  # noqa: BLE001 - any failure to load: use the stub
        for name in [m for m in sys.modules if m == "torchvision" or m.startswith("torchvision.")]:
            del sys.modules[name]
        sys.path.insert(0, str(STUBS))


@pytest.fixture(scope="session")
def controller_module():
    """``sglang.srt.mem_cache.hybrid_cache.hybrid_cache_controller`` (0.5.23), or a skip naming
    what is missing."""
    _torchvision_or_stub()
    try:
        return importlib.import_module("sglang.srt.mem_cache.hybrid_cache.hybrid_cache_controller")
    except Exception as e:  # noqa: BLE001
        pytest.skip(f"SGLang's cache controller does not import here ({type(e).__name__}: {e}); "
                    "install the sglang-controller extra (make venv)")
