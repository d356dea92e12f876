"""FlatCake's C loops: one extension built at install, each loop with a fallback and a state
that is reported (issue 23 item 17, issue 24 item 8, issue 25).

The hot loops of the data path (paper §3.3) are C functions called through :mod:`ctypes`
without the GIL: the one-call restore and its plan (:mod:`flatcake.cio.native_restore`), the
zero-copy restore (:mod:`flatcake.cio.native_zero_copy`), the round gather
(:mod:`flatcake.cio.native_gather`), the write queue's piece writer
(:mod:`flatcake.store.native_write`), the xxh3-64 of each chunk (:mod:`flatcake.cio.xxh3_bulk`) and
the device checksum's host side (:mod:`flatcake.kernels.fcds_native`). Their source is
``csrc/*.c`` (tested as C by ``csrc/tests/``, ``tests/native/``); ``pip install`` / ``pip
wheel`` compile it (``setup.py``) into one extension module, :data:`EXTENSION`, inside the
package. No compiler runs at run time: :func:`library` loads the built object with
:mod:`ctypes` by the module's ``__file__`` and each loop binds its functions by name
(:func:`entry`). Each loop has a Python / numpy fallback that gives the same bits, several
times slower (writes at about 0.5 GB/s).

Lifecycle of a loop::

    NativeLoop(build, env, note, name=...)    # registered under its name at import
      -> first fn() / report() / warm_up()     # build(): bind from the extension (microseconds)
      -> state: native | fallback (why) | off (its environment variable, or FLATCAKE_NATIVE=0)
      -> fn(): the loop, or None (the caller runs its fallback)

A loop falls back when the extension was not built (an ImportError: a source tree used
without ``pip install``, a build without a compiler), is stale (a source checkout whose
``csrc/`` changed since the build: rebuild with ``pip install --no-deps -e .``), lacks the
loop's function, or the xxhash extension does not export what the loop calls. A fallback is
logged at WARNING (once per loop) and shows in :func:`report`, which the SGLang adapter puts
in ``flatcake_stats()["native_loops"]``, its start-up line and the
``flatcake_native_loop_state`` metric (``docs/metrics.md``). ``python -m flatcake.native``
(:func:`main`) prints every loop's state.
"""

from __future__ import annotations

import ctypes
import hashlib
import importlib
import logging
import os
import threading
from pathlib import Path
from typing import Callable, Optional, Sequence

import numpy as np

log = logging.getLogger(__name__)

#: the states a loop reports: its C loop runs; its fallback runs (``reason`` says why); turned
#: off by its environment variable (or :data:`ALL_OFF_ENV`)
STATES = ("native", "fallback", "off")
#: the extension module that holds every C loop (``csrc/``, built by ``setup.py``)
EXTENSION = "flatcake._native"
#: environment variable: ``0`` turns every C loop off (each runs its fallback; for A/B runs and
#: tests of the fallbacks), like each loop's own variable
ALL_OFF_ENV = "FLATCAKE_NATIVE"
#: the C sources of a source checkout (absent in an installed wheel: no staleness check there)
CSRC = Path(__file__).resolve().parents[2] / "csrc"
#: the modules that define the registered loops (imported by :func:`loops`)
LOOP_MODULES = ("flatcake.cio.native_restore", "flatcake.cio.native_zero_copy", "flatcake.cio.native_gather",
                "flatcake.store.native_write", "flatcake.cio.xxh3_bulk", "flatcake.kernels.fcds_native")
#: the order in which the loops are listed
ORDER = ("restore", "plan", "zero_copy", "gather", "write", "xxh3", "fcds")

_REGISTRY: dict = {}  # name -> NativeLoop
_lib_lock = threading.Lock()
_lib: Optional[tuple] = None  # (ctypes.CDLL or None, why, path) once loaded


def source_hash(csrc: Path) -> str:
    """sha256 (hex) over the names and bytes of ``csrc``'s ``*.c`` and ``*.h`` files sorted by
    name: what ``setup.py`` compiles into the extension's ``SOURCE_HASH`` (the same function)."""
    h = hashlib.sha256()
    for p in sorted(list(csrc.glob("*.c")) + list(csrc.glob("*.h")), key=lambda p: p.name):
        h.update(p.name.encode() + b"\0" + p.read_bytes() + b"\0")
    return h.hexdigest()


def _load() -> tuple:
    """``(lib, "", path)``, or ``(None, why, path or "")``; see :func:`library`."""
    try:
        mod = importlib.import_module(EXTENSION)
    except ImportError as e:
        return None, (f"extension not built ({type(e).__name__}: {e}); it is compiled by pip install "
                      "(a C compiler is needed then, none at run time)"), ""
    path = getattr(mod, "__file__", "") or ""
    built = getattr(mod, "SOURCE_HASH", "")
    if CSRC.is_dir() and (CSRC.parent / "setup.py").is_file():
        try:
            now = source_hash(CSRC)
        except OSError as e:
            return None, f"cannot read {CSRC} to check the extension against it ({e.strerror or e})", path
        if built != now:
            return None, (f"extension is stale: {path} was built from other C sources than {CSRC} now "
                          "(rebuild: pip install --no-deps -e .)"), path
    try:
        return ctypes.CDLL(path), "", path
    except OSError as e:
        return None, f"loading {path} failed ({e})", path


def library() -> tuple[Optional[ctypes.CDLL], str]:
    """The extension's shared object, loaded once per process with :mod:`ctypes` (kept loaded).

    Returns:
        ``(lib, "")``, or ``(None, why)``: the extension was not built (``ImportError``), is
        stale (a source checkout's ``csrc/`` hashes differently from what it was built from),
        or could not be loaded.
    """
    global _lib
    with _lib_lock:
        if _lib is None:
            _lib = _load()
        return _lib[0], _lib[1]


def extension_path() -> str:
    """The extension's file (``""`` when it was not built); loads it (:func:`library`)."""
    library()
    return _lib[2] if _lib else ""


def entry(name: str, argtypes: Sequence, restype) -> tuple[Optional[Callable], str]:
    """The extension's C function ``name`` with its ctypes signature set.

    Args:
        name: an exported function of ``csrc/`` (``fc_*``).
        argtypes, restype: its ctypes argument and result types.

    Returns:
        ``(function, "")`` (a ctypes function: a call releases the GIL), or ``(None, why)``.
    """
    lib, why = library()
    if lib is None:
        return None, why
    try:
        fn = getattr(lib, name)
    except AttributeError:
        return None, f"{name} is not in {extension_path()} (built from older sources: pip install --no-deps -e .)"
    fn.argtypes, fn.restype = list(argtypes), restype
    return fn, ""


class NativeLoop:
    """A C loop bound from the extension on first use, thread-safe, with its state reported.

    Args:
        build: ``() -> (callable or None, why)``: binds the loop (typically with
            :func:`entry`). ``why`` is the reason for ``None``, or a note on a loop in use.
        env: environment variable that disables the loop when set to ``"0"`` (with
            ``default_on=False``: that enables it when set to ``"1"``).
        fallback_note: what runs instead, for the log.
        default_on: whether the loop is used when ``env`` is unset.
        name: the name it is registered and reported under (:func:`report`); ``""``: not
            registered.

    Attributes:
        state: ``{"fn": callable or None}`` once built (tests set ``fn`` to ``None`` to force
            the fallback, or to a callable).
    """

    def __init__(self, build: Callable[[], tuple], env: str, fallback_note: str, default_on: bool = True,
                 name: str = ""):
        self.build, self.env, self.fallback_note = build, env, fallback_note
        self.default_on = default_on
        self.name = name or env
        self.state: dict = {}
        self._outcome: Optional[tuple] = None  # (fn, state, reason) once built
        self._lock = threading.RLock()
        if name:
            _REGISTRY[name] = self

    def enabled(self) -> tuple[bool, str]:
        """``(on, why off)`` from :data:`ALL_OFF_ENV` and the loop's environment variable."""
        if os.environ.get(ALL_OFF_ENV, "1") == "0":
            return False, f"{ALL_OFF_ENV}=0"
        if self.default_on:
            return os.environ.get(self.env, "1") != "0", f"{self.env}=0"
        return os.environ.get(self.env, "0") == "1", f"{self.env} not 1 (off by default; {self.env}=1 turns it on)"

    def _built(self) -> tuple:
        """The outcome ``(fn, state, reason)``, building (binding) the loop on the first call."""
        with self._lock:
            if self._outcome is None:
                on, why = self.enabled()
                if not on:
                    fn, state = None, "off"
                else:
                    try:
                        fn, why = self.build()
                    except Exception as e:  # noqa: BLE001 - a build that raises is a fallback with its reason
                        fn, why = None, f"building raised {type(e).__name__}: {e}"
                    state = "native" if fn is not None else "fallback"
                self._outcome = (fn, state, why)
                self._log(state, why)
            return self._outcome

    def _log(self, state: str, why: str) -> None:
        if state == "fallback":
            log.warning("flatcake: C loop '%s' not in use, %s (%s)", self.name, self.fallback_note, why)
        elif state == "off":
            log.info("flatcake: C loop '%s' off, %s (%s)", self.name, self.fallback_note, why)
        elif why:
            log.info("flatcake: C loop '%s': %s", self.name, why)

    def start(self) -> None:
        """Build (bind) the loop now, once (kept for callers: there is nothing to wait for)."""
        self._built()

    def warm_up(self, thread_name: str = "") -> None:
        """Build this loop and every registered one (:func:`warm_up_all`); ``thread_name`` is
        unused (kept for callers)."""
        self.start()
        warm_up_all()

    def fn(self) -> Optional[Callable]:
        """The loop, or ``None`` when the fallback runs; builds it on the first call."""
        if "fn" in self.state:
            return self.state["fn"]
        return self.state.setdefault("fn", self._built()[0])

    def wait_built(self, timeout: Optional[float] = None) -> Optional[Callable]:
        """:meth:`fn` (kept for callers; ``timeout`` is unused: binding never waits)."""
        return self.fn()

    def report(self) -> tuple[str, str]:
        """``(state, reason)``: one of :data:`STATES`, and why it is not native (or a note);
        builds the loop if it was not yet."""
        out = self._built()
        if "fn" in self.state and self.state["fn"] is not out[0]:
            if self.state["fn"] is None:
                return "fallback", "turned off in this process (its LOOP.state)"
            return "native", "set in this process (its LOOP.state)"
        return out[1], out[2]


def loops() -> dict:
    """Every registered loop by name, in :data:`ORDER` (imports :data:`LOOP_MODULES`)."""
    for m in LOOP_MODULES:
        importlib.import_module(m)
    rank = {n: i for i, n in enumerate(ORDER)}
    return {n: _REGISTRY[n] for n in sorted(_REGISTRY, key=lambda n: (rank.get(n, len(rank)), n))}


def report() -> dict:
    """``{name: {"state", "reason"}}`` of every loop (``flatcake_stats()["native_loops"]``)."""
    out = {}
    for name, loop in loops().items():
        state, reason = loop.report()
        out[name] = {"state": state, "reason": reason}
    return out


def warm_up_all() -> None:
    """Build (bind) every registered loop now (microseconds each: no compiler runs)."""
    for loop in loops().values():
        loop.start()


def wait_all() -> bool:
    """Build every registered loop now (the start-up, before its line); always True (kept for
    callers: nothing is waited for)."""
    warm_up_all()
    return True


def main(argv: Optional[Sequence[str]] = None) -> int:
    """``python -m flatcake.native [--json]``: print each C loop's state and reason, and (text)
    the extension they come from.

    Returns:
        0 when no loop fell back (a loop turned off by its environment variable counts as
        fine), else 1.
    """
    import argparse
    import json
    import sys

    p = argparse.ArgumentParser(prog="python -m flatcake.native",
                                description="Print the state of each of FlatCake's C loops (the extension "
                                            f"{EXTENSION}, built at install); exit 1 when one fell back.")
    p.add_argument("--json", action="store_true", help="print the report as JSON")
    args = p.parse_args(argv)
    logging.basicConfig(level=logging.ERROR)
    rep = report()
    bad = [n for n, r in rep.items() if r["state"] not in ("native", "off")]
    if args.json:
        json.dump(rep, sys.stdout, indent=1)
        print()
    else:
        for name, r in rep.items():
            print(f"{name:<10} {r['state']:<9} {r['reason']}".rstrip())
        counts = {s: sum(r["state"] == s for r in rep.values()) for s in STATES}
        print(", ".join(f"{n} {s}" for s, n in counts.items() if n) + (f" (not native: {', '.join(bad)})" if bad
                                                                         else ""))
        print(f"extension: {extension_path() or '(not built)'}")
    return 1 if bad else 0


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


if __name__ == "__main__":  # python -m flatcake.native.loops: the registry of the imported module
    from flatcake.native.loops import main as _main

    raise SystemExit(_main())
