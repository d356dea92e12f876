"""Import SGLang 0.5.23's real cache controller on the CPU.

It needs the ``sglang-controller`` extra (``make venv`` installs it without dependency trees) and
torchvision, whose PyPI wheels do not load beside the CPU torch 2.13.0: when ``import
torchvision`` fails, :func:`flatcake.replay.sglang_cpu.ensure_importable` stands in a names-only
package (the storage threads never call it). Tests that need the controller take the
``controller_module`` fixture, which skips with the import error when the extra is missing.
"""

from __future__ import annotations

import importlib

import pytest

from flatcake.replay.sglang_cpu import ensure_importable


@pytest.fixture(scope="session")
def controller_module():
    """``sglang.srt.mem_cache.hybrid_cache.hybrid_cache_controller`` (0.5.23), or a skip naming
    what is missing."""
    ensure_importable()
    try:
        return importlib.import_module("sglang.srt.mem_cache.hybrid_cache.hybrid_cache_controller")
    except Exception as e:  # noqa: BLE001
        pytest.skip(f"SGLang's cache controller does not import here ({type(e).__name__}: {e}); "
                    "install the sglang-controller extra (make venv)")
