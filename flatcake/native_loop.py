"""Per-chunk loops in C that run without the GIL: compiled once per process, with a fallback.

Two hot loops of the data path hash every chunk of a round (paper §3.3 integrity): the xxh3-64
of each chunk (:mod:`flatcake.cio.xxh3_bulk`) and the device checksum's host side
(:mod:`flatcake.kernels.fcds_native`). From Python each is one call per chunk holding the GIL
between calls; here each is one :mod:`ctypes` call over the whole buffer. The C source of a
loop is compiled with the system C compiler into a temporary directory on first use (or in a
background thread at start-up, :meth:`NativeLoop.warm_up`), loaded, and the files removed.
Where there is no compiler, or an environment variable turns it off, the caller's Python /
numpy fallback gives the same bits (logged once at INFO).
"""

from __future__ import annotations

import ctypes
import logging
import os
import shutil
import subprocess
import tempfile
import threading
from typing import Callable, Optional, Sequence

import numpy as np

log = logging.getLogger(__name__)


def compile_shim(source: str, name: str, flag_sets: Sequence[Sequence[str]] = (("-O2",),)):
    """Compile C ``source`` into a shared library and load it.

    Args:
        source: C source text.
        name: short name for the temporary files (``flatcake-{name}-*``).
        flag_sets: compiler flag lists tried in order (the first that compiles wins).

    Returns:
        ``(ctypes.CDLL, "")``, or ``(None, why)`` when no compiler is on PATH or every
        compilation failed. The temporary directory is removed in every case.
    """
    cc = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")
    if not cc:
        return None, "no C compiler (cc) on PATH"
    d = tempfile.mkdtemp(prefix=f"flatcake-{name}-")
    try:
        src, so = os.path.join(d, f"{name}.c"), os.path.join(d, f"libfc{name}.so")
        with open(src, "w") as f:
            f.write(source)
        proc = None
        for flags in flag_sets:
            proc = subprocess.run([cc, *flags, "-shared", "-fPIC", "-o", so, src], capture_output=True, text=True,
                                  timeout=60)
            if proc.returncode == 0:
                break
        if proc is None or proc.returncode != 0:
            return None, f"{cc} failed: {proc.stderr.strip()[:200] if proc else 'no flags'}"
        return ctypes.CDLL(so), ""  # mapped: the file can go
    except (OSError, subprocess.SubprocessError) as e:
        return None, f"compiling the shim failed ({e})"
    finally:
        shutil.rmtree(d, ignore_errors=True)


class NativeLoop:
    """A C loop built on first use, thread-safe, with a reason logged once when it is not.

    Args:
        build: ``() -> (callable or None, why)``: compiles and binds the loop (typically with
            :func:`compile_shim`); the callable must keep its library referenced.
        env: environment variable that disables the loop when set to ``"0"`` (with
            ``default_on=False``: that enables it when set to ``"1"``).
        fallback_note: what runs instead, for the INFO line.
        default_on: whether the loop is used when ``env`` is unset.

    Attributes:
        state: ``{"fn": callable or None}`` once built (tests set ``fn`` to ``None`` to force
            the fallback).
    """

    def __init__(self, build: Callable[[], tuple], env: str, fallback_note: str, default_on: bool = True):
        self.build, self.env, self.fallback_note = build, env, fallback_note
        self.default_on = default_on
        self.state: dict = {}
        self._lock = threading.Lock()

    def fn(self) -> Optional[Callable]:
        """The loop, or ``None`` when the fallback is in use (builds it on the first call)."""
        if "fn" not in self.state:
            with self._lock:
                if "fn" not in self.state:
                    on = os.environ.get(self.env, "1" if self.default_on else "0") != "0"
                    fn, why = self.build() if on else (None, f"{self.env}={os.environ.get(self.env, '0 (default)')}")
                    if fn is None:
                        log.info("%s (%s)", self.fallback_note, why)
                    # setdefault: a value set meanwhile (a test forcing the fallback while a
                    # warm-up thread compiled) wins
                    self.state.setdefault("fn", fn)
        return self.state["fn"]

    def warm_up(self, thread_name: str) -> None:
        """Build the loop in a background thread (start-up), so the first round does not wait
        for the compiler; not a daemon, so an exit waits for it and its temporary files go."""
        if "fn" not in self.state:
            threading.Thread(target=self.fn, name=thread_name, daemon=False).start()


def chunk_starts(host: np.ndarray, starts, chunk_bytes: int) -> np.ndarray:
    """``starts`` as a contiguous int64 array, checked to lie inside ``host``.

    Args:
        host: uint8 buffer (``[nbytes]``).
        starts: byte offsets of chunks of ``chunk_bytes`` bytes.

    Raises:
        ValueError: ``host`` not a 1-D uint8 array, ``chunk_bytes`` not positive, or a chunk
        outside ``host`` (checked before any byte is read).
    """
    if not isinstance(host, np.ndarray) or host.dtype != np.uint8 or host.ndim != 1:
        raise ValueError("chunk buffer must be a 1-D uint8 numpy array")
    if int(chunk_bytes) <= 0:
        raise ValueError(f"chunk_bytes must be positive, got {chunk_bytes}")
    st = np.ascontiguousarray(starts, dtype=np.int64).reshape(-1)
    if st.shape[0] and (int(st.min()) < 0 or int(st.max()) + chunk_bytes > host.shape[0]):
        raise ValueError(f"chunk offsets outside the {host.shape[0]}-byte buffer")
    return st
