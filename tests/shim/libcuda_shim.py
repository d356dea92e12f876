"""Build and load the TEST-ONLY fake ``libcuda.so.1`` (``fake_libcuda.c``) for kvikio tests.

The shim is compiled with gcc into a temporary directory and is only ever put on the
``LD_LIBRARY_PATH`` of a test subprocess (:func:`shim_env`); the test process itself and the
package never see it. :func:`skip_reason` says why the shim cannot or must not be used here.
"""

from __future__ import annotations

import ctypes.util
import os
import shutil
import subprocess
from pathlib import Path
from typing import Optional

SOURCE = Path(__file__).resolve().parent / "fake_libcuda.c"


def real_libcuda_present() -> bool:
    """True when a real CUDA driver library is visible (then the shim must not be used)."""
    try:
        ctypes.CDLL("libcuda.so.1")
        return True
    except OSError:
        return ctypes.util.find_library("cuda") is not None


def skip_reason() -> Optional[str]:
    """``None`` when the shim can be built and used; else the reason to skip."""
    if shutil.which("gcc") is None:
        return "gcc not found: cannot build the fake libcuda shim"
    if real_libcuda_present():
        return "a real libcuda.so.1 is present: the fake driver shim must not be used"
    try:
        import kvikio  # noqa: F401
    except Exception as e:  # noqa: BLE001
        return f"kvikio not importable: {e}"
    return None


def build_shim(out_dir: str | os.PathLike) -> Path:
    """Compile ``fake_libcuda.c`` into ``out_dir/libcuda.so.1``; returns the directory.

    Raises:
        subprocess.CalledProcessError: gcc failed.
    """
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    subprocess.run(
        ["gcc", "-shared", "-fPIC", "-Wl,-soname,libcuda.so.1", "-o", str(out / "libcuda.so.1"), str(SOURCE)],
        check=True,
        capture_output=True,
    )
    return out


def shim_env(shim_dir: str | os.PathLike, base: Optional[dict] = None) -> dict:
    """Environment for a subprocess that loads the shim: LD_LIBRARY_PATH first, compat mode ON."""
    env = dict(os.environ if base is None else base)
    env["LD_LIBRARY_PATH"] = str(shim_dir) + (":" + env["LD_LIBRARY_PATH"] if env.get("LD_LIBRARY_PATH") else "")
    env["KVIKIO_COMPAT_MODE"] = "ON"
    return env
