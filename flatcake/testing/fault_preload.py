"""I/O faults where the shipped paths run: the LD_PRELOAD interposer of ``faultpreload/fault_preload.c``
(tests and ``scripts/soak.py``; docs/durability.md, "Soak").

FlatCake's default read and write paths are C loops called through :mod:`ctypes` (the one-call
restore's ``pread``, the zero-copy restore's ``preadv``, the write queue's ``pwrite``), so faults
injected by patching ``os.preadv`` / ``os.pwritev`` never reach them. The interposer replaces
libc's positioned I/O calls in a process started with it (every spelling a caller may bind:
:data:`SYMBOLS`) and injects EIO, short reads, ENOSPC and EROFS on the files it targets, counting
each fault by symbol, kind and *calling object*, so a report shows which loop saw it.

Lifecycle::

    build(directory)                 compile the interposer with the system C compiler (once)
    environment(lib, ...)            the child's environment: LD_PRELOAD and the FC_FAULT_* settings
    (child) Interposer.attach()      control from inside: arm, rate and kinds, ENOSPC window,
                                     a file refusing writes, report() -> [InjectedFault]

A process with the interposer drops ``LD_PRELOAD`` from its environment at load, so what it
starts runs without it.
"""

from __future__ import annotations

import ctypes
import os
import shutil
import subprocess
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

#: the C source
SOURCE = Path(__file__).resolve().parent / "faultpreload" / "fault_preload.c"
#: libc calls the interposer replaces: the plain names (FlatCake's C loops, built without
#: ``_FILE_OFFSET_BITS``), the large-file and ``v2`` names (CPython's ``os`` module) and the rest
#: of each alias family
SYMBOLS = ("pread", "pread64", "preadv", "preadv64", "preadv2", "preadv64v2", "pwrite", "pwrite64", "pwritev",
           "pwritev64", "pwritev2", "pwritev64v2", "posix_fallocate", "posix_fallocate64")
#: random fault kinds (``FC_FAULT_KINDS``); ``erofs`` comes from :meth:`Interposer.refuse` only
KINDS = ("eio", "short", "enospc")
#: the calling object of FlatCake's C loops: the extension ``flatcake._native``
#: (``_native.cpython-*.so``, :mod:`flatcake.native.loops`); within it the symbol tells the loop
#: (``pread``: the C restore, ``preadv``: the zero-copy restore, ``pwrite``: the piece writer)
C_LOOP_PREFIX = "_native."


def build(directory: str | os.PathLike) -> tuple[Optional[str], str]:
    """Compile the interposer into ``directory/libfcfault.so``.

    Returns:
        ``(path, "")``, or ``(None, why)`` when there is no C compiler (``$CC``, ``cc``, ``gcc``)
        or it failed.
    """
    cc = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")
    if not cc:
        return None, "no C compiler (cc) on PATH"
    out = os.path.join(os.fspath(directory), "libfcfault.so")
    try:
        proc = subprocess.run([cc, "-O2", "-shared", "-fPIC", "-o", out, str(SOURCE), "-ldl", "-pthread"],
                              capture_output=True, text=True, timeout=120)
    except (OSError, subprocess.SubprocessError) as e:
        return None, f"compiling the fault interposer failed ({e})"
    if proc.returncode != 0:
        return None, f"{cc} failed: {proc.stderr.strip()[:300]}"
    return out, ""


def environment(lib: str, *, path_prefix: str = "", suffix: str = "", rate: float = 0.0, seed: int = 0,
                kinds: tuple = ("eio", "short"), armed: bool = False, base: Optional[dict] = None) -> dict:
    """The environment of a child process that runs with the interposer.

    Args:
        lib: :func:`build`'s path.
        path_prefix, suffix: only files whose path starts / ends so get faults (``ssd.path``,
            ``".pool"``).
        rate: probability per call of each random fault kind in ``kinds`` (:data:`KINDS`).
        seed: seed of the draws.
        armed: inject from the start (else the child calls :meth:`Interposer.arm`).
        base: the environment to extend (default ``os.environ``).
    """
    unknown = set(kinds) - set(KINDS)
    if unknown:
        raise ValueError(f"unknown fault kinds {sorted(unknown)} (known: {', '.join(KINDS)})")
    env = dict(os.environ if base is None else base)
    env["LD_PRELOAD"] = " ".join(p for p in (lib, env.get("LD_PRELOAD", "")) if p)
    env.update(FC_FAULT_PATH=path_prefix, FC_FAULT_SUFFIX=suffix, FC_FAULT_RATE=repr(float(rate)),
               FC_FAULT_SEED=str(int(seed)), FC_FAULT_KINDS=",".join(kinds), FC_FAULT_ARMED="1" if armed else "0")
    return env


@dataclass(frozen=True)
class InjectedFault:
    """Faults of one kind injected into one symbol called from one object.

    Attributes:
        symbol: the libc call (``pread``, ``pwrite64``, ...).
        kind: ``eio``, ``short``, ``enospc`` or ``erofs``.
        caller: file name of the object that called it (``_native.cpython-311-x86_64-linux-gnu.so``:
            FlatCake's C loops, :data:`C_LOOP_PREFIX`; ``libpython3.11.so.1.0``: ``os``).
        count: faults.
    """

    symbol: str
    kind: str
    caller: str
    count: int

    @property
    def in_c_loop(self) -> bool:
        """Seen by one of FlatCake's C loops (not by Python's ``os`` module)."""
        return self.caller.startswith(C_LOOP_PREFIX)


class Interposer:
    """Control of the interposer loaded in this process (:meth:`attach`)."""

    def __init__(self, lib: ctypes.CDLL):
        self._lib = lib
        lib.fc_fault_arm.argtypes, lib.fc_fault_arm.restype = [ctypes.c_int], ctypes.c_int
        lib.fc_fault_set_rate.argtypes, lib.fc_fault_set_rate.restype = [ctypes.c_double, ctypes.c_char_p], None
        lib.fc_fault_enospc_for_ms.argtypes, lib.fc_fault_enospc_for_ms.restype = [ctypes.c_int64], None
        lib.fc_fault_refuse.argtypes, lib.fc_fault_refuse.restype = [ctypes.c_char_p], None
        lib.fc_fault_report.argtypes, lib.fc_fault_report.restype = [ctypes.c_char_p, ctypes.c_int64], ctypes.c_int64

    @classmethod
    def attach(cls) -> Optional["Interposer"]:
        """The interposer of this process, or ``None`` when it was not started with it."""
        lib = ctypes.CDLL(None)
        return cls(lib) if hasattr(lib, "fc_fault_arm") else None

    def arm(self, on: bool = True) -> bool:
        """Start (stop) injecting; returns whether it was armed."""
        return bool(self._lib.fc_fault_arm(int(on)))

    def set_rate(self, rate: float, kinds: Optional[tuple] = None) -> None:
        """Random faults: probability per call of each kind, and the kinds (``None``: unchanged)."""
        self._lib.fc_fault_set_rate(float(rate), None if kinds is None else ",".join(kinds).encode())

    def enospc_for(self, seconds: float) -> None:
        """Writes and fallocates of targeted files fail with ENOSPC for ``seconds``."""
        self._lib.fc_fault_enospc_for_ms(int(seconds * 1000))

    def refuse(self, path: Optional[str]) -> None:
        """Writes to ``path`` fail with EROFS from now on (``None``: no file refuses)."""
        self._lib.fc_fault_refuse(path.encode() if path else None)

    def report(self) -> list[InjectedFault]:
        """Every fault injected so far, by symbol, kind and calling object."""
        n = self._lib.fc_fault_report(None, 0)
        buf = ctypes.create_string_buffer(int(n) + 1)
        self._lib.fc_fault_report(buf, n + 1)
        out = []
        for line in buf.value.decode(errors="replace").splitlines():
            symbol, kind, rest = line.split(" ", 2)  # "symbol kind caller count"
            caller, count = rest.rsplit(" ", 1)
            out.append(InjectedFault(symbol, kind, caller, int(count)))
        return out

    def total(self) -> int:
        """Faults injected so far."""
        return sum(f.count for f in self.report())


__all__ = ["C_LOOP_PREFIX", "InjectedFault", "Interposer", "KINDS", "SOURCE", "SYMBOLS", "build", "environment"]
