"""FlatCake's C loops: compiled once per process in the background, each with a fallback and a
state that is reported (issue 23 item 17, issue 24 item 8).

The hot loops of the data path (paper §3.3) run in small C shims called through :mod:`ctypes`
without the GIL: the one-call restore and its plan (:mod:`flatcake.cio.native_restore`), the
zero-copy restore (:mod:`flatcake.cio.native_zero_copy`), the round gather
(:mod:`flatcake.cio.native_gather`), the write queue's piece writer
(:mod:`flatcake.native_write`), the xxh3-64 of each chunk (:mod:`flatcake.cio.xxh3_bulk`) and
the device checksum's host side (:mod:`flatcake.kernels.fcds_native`). Each has a Python / numpy
fallback that gives the same bits, several times slower (writes at about 0.5 GB/s).

Lifecycle of a loop::

    NativeLoop(build, env, note, name=...)     # registered under its name at import
      -> warm_up() / first fn()                # its build starts in a background (daemon) thread
      -> compile_shim(): $CC (split like a shell), one compiler run at a time in the process,
         at most FLATCAKE_CC_TIMEOUT_S each, files in $TMPDIR or the next usable directory,
         the library loaded and the files removed
      -> state: native | fallback (why) | off (its environment variable) | pending (compiling)
      -> fn(): the loop, or None (the caller runs its fallback)

Nobody waits long for a compiler: :meth:`NativeLoop.fn` waits for its build at most
:data:`WAIT_S` seconds, and not at all once the compiler run in progress has taken that long
(the fallback runs meanwhile, the loop is used from when it is ready). A compiler that times out
is killed and not run again in this process: the loops not built yet fall back at once, with the
reason; at exit a compiler still running is killed and its files removed (the build threads are
daemons). A fallback is logged at WARNING (once per loop) and shows in :func:`report`, which the
SGLang adapter puts in ``flatcake_stats()["native_loops"]``, its start-up line and the
``flatcake_native_loop_state`` metric (``docs/metrics.md``). ``python -m flatcake.native``
(:func:`main`) builds every loop and prints its state.
"""

from __future__ import annotations

import atexit
import ctypes
import importlib
import logging
import os
import shlex
import shutil
import signal
import tempfile
import threading
import time
from typing import Callable, Optional, Sequence

import numpy as np

log = logging.getLogger(__name__)

#: the states a loop reports: its C loop runs; its fallback runs (``reason`` says why); turned
#: off by its environment variable; not built yet (or compiling)
STATES = ("native", "fallback", "off", "pending")
#: seconds a caller waits for a build at most (start-up, the first put); not at all once the
#: compiler run in progress has taken this long
WAIT_S = 5.0
#: environment variable: seconds one compiler run may take before it is killed (and the compiler
#: is not run again in this process)
TIMEOUT_ENV = "FLATCAKE_CC_TIMEOUT_S"
#: its default (a compile takes 0.1-0.5 s on an idle machine)
DEFAULT_TIMEOUT_S = 20.0
#: the modules that define the registered loops (imported by :func:`loops`)
LOOP_MODULES = ("flatcake.cio.native_restore", "flatcake.cio.native_zero_copy", "flatcake.cio.native_gather",
                "flatcake.native_write", "flatcake.cio.xxh3_bulk", "flatcake.kernels.fcds_native")
#: the order in which the loops are listed
ORDER = ("restore", "plan", "zero_copy", "gather", "write", "xxh3", "fcds")

_compile_lock = threading.Lock()  # one compiler run at a time in the process
_hung = ""  # set when a compiler run timed out: the compiler is not run again
_running: dict = {}  # pid -> (build directory, time.monotonic() at start) of the compiler run in progress
_build_dirs: set = set()  # build directories in use (removed at exit if a build thread still holds one)
_running_lock = threading.Lock()  # guards _running, _build_dirs and _exiting
_exiting = False  # set at exit: no build directory is made and no compiler started any more
_REGISTRY: dict = {}  # name -> NativeLoop


def compile_timeout_s() -> float:
    """Seconds one compiler run may take (``FLATCAKE_CC_TIMEOUT_S``, default
    :data:`DEFAULT_TIMEOUT_S`; a value that is not a positive number is the default)."""
    try:
        t = float(os.environ.get(TIMEOUT_ENV, DEFAULT_TIMEOUT_S))
    except ValueError:
        return DEFAULT_TIMEOUT_S
    return t if t > 0 else DEFAULT_TIMEOUT_S


def compiler() -> tuple[list, str]:
    """The C compiler's command: ``$CC`` split as a shell would (``ccache gcc``, ``gcc -pipe``),
    else ``cc`` or ``gcc`` on ``PATH``; ``([], why)`` when there is none."""
    raw = os.environ.get("CC", "")
    if raw.strip():
        try:
            argv = shlex.split(raw)
        except ValueError as e:
            return [], f"CC={raw!r} cannot be split into words ({e})"
        if shutil.which(argv[0]) is None:
            return [], f"CC={raw!r}: {argv[0]} not found"
        return argv, ""
    cc = shutil.which("cc") or shutil.which("gcc")
    return ([cc], "") if cc else ([], "no C compiler: CC unset and neither cc nor gcc on PATH")


def build_dirs() -> list:
    """Directories for the compiler's files, tried in turn: ``$TMPDIR``, ``/tmp``, ``/var/tmp``,
    ``/dev/shm`` (one that cannot be written, is full or cannot map the library is named in the
    reason, and the next is tried)."""
    out: list = []
    for d in (os.environ.get("TMPDIR"), "/tmp", "/var/tmp", "/dev/shm"):
        if d and d not in out:
            out.append(d)
    return out


def compile_shim(source: str, name: str, flag_sets: Sequence[Sequence[str]] = (("-O2",),)):
    """Compile C ``source`` into a shared library and load it.

    One compiler run at a time in the process, each at most :func:`compile_timeout_s` seconds;
    after a run timed out the compiler is not run again in this process.

    Args:
        source: C source text.
        name: short name for the temporary files (``flatcake-{name}-*``) and the reasons.
        flag_sets: compiler flag lists tried in order (the first that compiles wins).

    Returns:
        ``(ctypes.CDLL, note)``: ``note`` is ``""``, or says in which directory it was built when
        ``$TMPDIR`` could not be used; or ``(None, why)``: no compiler, every compilation failed,
        the compiler timed out (now or earlier in this process), or no directory could hold the
        files. The temporary directory is removed in every case.
    """
    argv, why = compiler()
    if not argv:
        return None, why
    with _compile_lock:
        if _hung:
            return None, f"not tried: {_hung}"
        refused = []
        for d in build_dirs():
            lib, why, dir_ok = _compile_in(d, argv, source, name, flag_sets)
            if lib is not None:
                return lib, (f"built in {d}, not in " + ", ".join(refused)) if refused else ""
            if dir_ok:
                return None, why
            refused.append(f"{d} ({why})")
        return None, "no directory could hold the compiler's files: " + ", ".join(refused)


_SPACE_ERRORS = ("No space left", "Disk quota exceeded", "Read-only file system", "Cannot create temporary file")


def _compile_in(d: str, argv: list, source: str, name: str, flag_sets) -> tuple:
    """One try in directory ``d``: ``(lib, "", True)``, ``(None, why, True)`` (the compiler's
    verdict: stop) or ``(None, why, False)`` (the directory could not be used: try the next)."""
    with _running_lock:  # registered at once: the exit removes it if this thread is still at work then
        if _exiting:
            return None, "not built: the process is exiting", True
        try:
            tmp = tempfile.mkdtemp(prefix=f"flatcake-{name}-", dir=d)
        except OSError as e:
            return None, f"{e.strerror or e}", False
        _build_dirs.add(tmp)
    try:
        src, so = os.path.join(tmp, f"{name}.c"), os.path.join(tmp, f"libfc{name}.so")
        try:
            with open(src, "w") as f:
                f.write(source)
        except OSError as e:
            return None, f"{e.strerror or e}", False
        cc = " ".join(argv)
        rc, err = 1, "no flags"
        for flags in flag_sets:
            # the compiler's own temporary files go to this directory too (TMPDIR)
            rc, err = _run([*argv, *flags, "-shared", "-fPIC", "-o", so, src], dict(os.environ, TMPDIR=tmp), tmp,
                           name, cc)
            if rc is None or rc == 0:
                break
        if rc is None:
            return None, err, True
        if rc != 0:
            if any(s in err for s in _SPACE_ERRORS):
                return None, f"{cc} could not write its files ({_space_line(err)})", False
            return None, f"{cc} failed: {err.strip()[:200]}", True
        try:
            return ctypes.CDLL(so), "", True  # mapped: the file can go
        except OSError as e:  # e.g. /dev/shm mounted noexec
            return None, f"loading the library failed ({e})", False
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
        with _running_lock:
            _build_dirs.discard(tmp)


def _space_line(err: str) -> str:
    """The compiler's first line that names the space or permission problem."""
    return next((x.strip()[:200] for x in err.splitlines() if any(s in x for s in _SPACE_ERRORS)), "")


def _run(cmd: list, env: dict, tmp: str, name: str, cc: str) -> tuple:
    """Run the compiler: ``(returncode, stderr)``, or ``(None, why)`` when it timed out (its whole
    session killed; the compiler is not run again in this process).

    Started with ``posix_spawnp`` in a session of its own, its stdin and stdout on ``/dev/null``
    and its stderr in a file of ``tmp``, all opened in the child: this process holds no
    descriptor for it, even for a moment (tests count descriptors while builds run)."""
    global _hung
    timeout = compile_timeout_s()
    err_path = os.path.join(tmp, "cc.err")
    actions = [(os.POSIX_SPAWN_OPEN, 0, os.devnull, os.O_RDONLY, 0),
               (os.POSIX_SPAWN_OPEN, 1, os.devnull, os.O_WRONLY, 0),
               (os.POSIX_SPAWN_OPEN, 2, err_path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)]
    with _running_lock:
        if _exiting:
            return None, "not run: the process is exiting"
        try:
            pid = os.posix_spawnp(cmd[0], cmd, env, file_actions=actions, setsid=True)
        except OSError as e:
            return 1, f"running {cmd[0]} failed ({e.strerror or e})"
        _running[pid] = (tmp, time.monotonic())
    try:
        rc = _wait_child(pid, time.monotonic() + timeout)
        if rc is None:
            _kill(pid)
            _reap(pid)
            _hung = (f"{cc} timed out after {timeout:g} s compiling '{name}' ({TIMEOUT_ENV}); "
                     "the compiler is not run again in this process")
            return None, _hung
    finally:
        with _running_lock:
            _running.pop(pid, None)
    try:
        with open(err_path, "rb") as f:
            return rc, f.read(64 << 10).decode(errors="replace")
    except OSError as e:
        return rc, f"(its messages could not be read: {e.strerror or e})"


def _wait_child(pid: int, until: float) -> Optional[int]:
    """The child's exit code (a signal ``-N``), or None once ``time.monotonic()`` passed
    ``until``; polled every 10 ms (a compile takes 0.1-0.5 s)."""
    while True:
        try:
            done, status = os.waitpid(pid, os.WNOHANG)
        except ChildProcessError:  # reaped by someone else (SIGCHLD ignored): loading the library decides
            return 0
        if done:
            return os.waitstatus_to_exitcode(status)
        if time.monotonic() >= until:
            return None
        time.sleep(0.01)


def _reap(pid: int) -> None:
    try:
        os.waitpid(pid, 0)
    except ChildProcessError:
        pass


def _kill(pid: int) -> None:
    """SIGKILL the compiler's session (it leads its own process group), or the compiler alone."""
    try:
        os.killpg(pid, signal.SIGKILL)
    except OSError:
        try:
            os.kill(pid, signal.SIGKILL)
        except OSError:
            pass


def compiler_busy_s() -> float:
    """Seconds the compiler run in progress has taken (0 when none runs)."""
    now = time.monotonic()
    return max((now - t0 for _, t0 in list(_running.values())), default=0.0)


@atexit.register
def _abort_compiles() -> None:
    """At exit a compiler still running (a build thread is a daemon) is killed and its files go;
    none starts after this."""
    global _exiting
    with _running_lock:
        _exiting = True
        running, dirs = list(_running), list(_build_dirs)
    for pid in running:
        _kill(pid)
    for tmp in dirs:
        shutil.rmtree(tmp, ignore_errors=True)


def _wait(done: threading.Event, until: float) -> bool:
    """Wait for ``done`` until ``until`` (``time.monotonic()``), or until the compiler run in
    progress has taken :data:`WAIT_S` seconds; True when ``done`` is set."""
    while not done.is_set():
        now = time.monotonic()
        if now >= until or compiler_busy_s() >= WAIT_S:
            return False
        done.wait(min(0.05, until - now))
    return True


class NativeLoop:
    """A C loop built in the background on first use, thread-safe, with its state reported.

    Args:
        build: ``() -> (callable or None, why)``: compiles and binds the loop (typically with
            :func:`compile_shim`); the callable must keep its library referenced. ``why`` is the
            reason for ``None``, or a note on a loop that was built (e.g. where).
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
        self._started_at: Optional[float] = None
        self._gave_up = False  # a caller stopped waiting: log when it is ready after all
        self._lock = threading.Lock()
        self._done = threading.Event()
        if name:
            _REGISTRY[name] = self

    def enabled(self) -> tuple[bool, str]:
        """``(on, why off)`` from the environment variable."""
        if self.default_on:
            return os.environ.get(self.env, "1") != "0", f"{self.env}=0"
        return os.environ.get(self.env, "0") == "1", f"{self.env} not 1 (off by default; {self.env}=1 turns it on)"

    def start(self) -> None:
        """Start the build in a background thread (once); a loop turned off is decided here."""
        with self._lock:
            if self._started_at is not None:
                return
            self._started_at = time.monotonic()
            on, why = self.enabled()
            if not on:
                self._finish(None, "off", why)
                return
        threading.Thread(target=self._build_now, name=f"fc-native-{self.name}", daemon=True).start()

    def warm_up(self, thread_name: str = "") -> None:
        """Start building this loop and every registered one (:func:`warm_up_all`) in the
        background, so that the first round or restore finds them ready. ``thread_name`` is
        unused (kept for callers)."""
        self.start()
        warm_up_all()

    def _build_now(self) -> None:
        try:
            fn, why = self.build()
        except Exception as e:  # noqa: BLE001 - a build that raises is a fallback with its reason
            fn, why = None, f"building raised {type(e).__name__}: {e}"
        self._finish(fn, "native" if fn is not None else "fallback", why)

    def _finish(self, fn, state: str, why: str) -> None:
        self._outcome = (fn, state, why)
        try:
            self._log(state, why)
        finally:
            # setdefault: a value set meanwhile (a test forcing the fallback) wins
            self.state.setdefault("fn", fn)
            self._done.set()

    def _log(self, state: str, why: str) -> None:
        took = time.monotonic() - (self._started_at or time.monotonic())
        if _exiting:  # a build cut short by the exit: nothing to tell
            return
        if state == "fallback":
            log.warning("flatcake: C loop '%s' not in use, %s (%s)", self.name, self.fallback_note, why)
        elif state == "off":
            log.info("flatcake: C loop '%s' off, %s (%s)", self.name, self.fallback_note, why)
        elif self._gave_up:
            log.info("flatcake: C loop '%s' ready after %.1f s (its fallback ran until now)%s", self.name, took,
                     f"; {why}" if why else "")
        elif why:
            log.info("flatcake: C loop '%s': %s", self.name, why)

    def fn(self) -> Optional[Callable]:
        """The loop, or ``None`` when the fallback runs (now: a build in progress is waited for
        at most :data:`WAIT_S` seconds, not at all once the compiler run in progress has taken
        that long). Starts the build on the first call."""
        if "fn" in self.state:
            return self.state["fn"]
        self.start()
        if not _wait(self._done, time.monotonic() + WAIT_S):
            self._gave_up = True
            return None
        return self.state.setdefault("fn", self._outcome[0])

    def wait_built(self, timeout: Optional[float] = None) -> Optional[Callable]:
        """Build (if not started) and wait for the outcome, however long the compiler takes
        (each run is bounded by :func:`compile_timeout_s`), or ``timeout`` seconds; then
        :meth:`fn`'s answer. For the build of another loop and for checks, not for hot paths."""
        self.start()
        self._done.wait(timeout)
        if "fn" in self.state or not self._done.is_set():
            return self.state.get("fn")
        return self.state.setdefault("fn", self._outcome[0])

    def report(self) -> tuple[str, str]:
        """``(state, reason)``: one of :data:`STATES`, and why it is not native (or a note)."""
        out = self._outcome
        if "fn" in self.state and (out is None or self.state["fn"] is not out[0]):
            if self.state["fn"] is None:
                return "fallback", "turned off in this process (its LOOP.state)"
            return "native", "set in this process (its LOOP.state)"
        if out is not None:
            return out[1], out[2]
        if self._started_at is None:
            return "pending", "not built yet"
        busy = compiler_busy_s()
        return "pending", (f"compiling: the compiler has run {busy:.1f} s" if busy else "waiting for the compiler")


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
    """Start building every registered loop in the background (one compiler run at a time)."""
    for loop in loops().values():
        loop.start()


def wait_all() -> bool:
    """Wait for every loop's build (started here if needed) at most :data:`WAIT_S` seconds in
    all, and not at all once the compiler run in progress has taken that long (start-up, before
    its line); True when every build has ended."""
    until = time.monotonic() + WAIT_S
    ok = True
    for loop in loops().values():
        loop.start()
        if not _wait(loop._done, until):
            loop._gave_up = True
            ok = False
    return ok


def main(argv: Optional[Sequence[str]] = None) -> int:
    """``python -m flatcake.native [--json]``: build every C loop now (waiting for the compiler,
    each run bounded by ``FLATCAKE_CC_TIMEOUT_S``) and print each one's state and reason.

    Returns:
        0 when no loop fell back (a loop turned off by its environment variable counts as
        fine), else 1.
    """
    import argparse
    import json
    import sys

    p = argparse.ArgumentParser(prog="python -m flatcake.native",
                                description="Build FlatCake's C loops and print each one's state.")
    p.add_argument("--json", action="store_true", help="print the report as JSON")
    args = p.parse_args(argv)
    logging.basicConfig(level=logging.ERROR)
    for loop in loops().values():
        loop.wait_built()
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


if __name__ == "__main__":  # python -m flatcake.native_loop: the registry of the imported module
    from flatcake.native_loop import main as _main

    raise SystemExit(_main())
