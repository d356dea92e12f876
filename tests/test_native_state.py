"""FlatCake's C loops come from one extension built at install and report their state (issues
23 item 17, 24 item 8, 25): every loop is in one registry (native / fallback and why / off);
no compiler runs at run time (``python -m flatcake.native`` reports every loop native with no
compiler on ``PATH``); an extension not built, stale or missing a function is a fallback naming
the cause; ``FLATCAKE_NATIVE=0`` and each loop's variable turn loops off. Tests that need a
fresh process (the extension hidden from the import) run in a subprocess."""

from __future__ import annotations

import json
import logging
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from flatcake.native import loops as native_loop
from flatcake.native.loops import NativeLoop

#: the loops every start-up reports, in order
LOOPS = ["restore", "plan", "zero_copy", "gather", "write", "xxh3", "fcds"]
ROOT = Path(__file__).resolve().parents[1]
HAS_CC = bool(os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc"))
BUILT = native_loop.library()[0] is not None
#: where the extension must be in use: it is built, or a compiler exists to build it (then a
#: missing or stale build is a failure: rebuild with pip install --no-deps -e .)
needs_ext = pytest.mark.skipif(not BUILT and not HAS_CC, reason="extension not built and no C compiler to build it")
#: a child hides the extension from the import, as on an install that did not build it
HIDDEN = ("import sys; sys.modules['flatcake._native'] = None\n"
          "from flatcake.native.loops import main\n"
          "raise SystemExit(main(sys.argv[1:]))\n")


def run_native(*args: str, env: dict | None = None, code: str | None = None) -> subprocess.CompletedProcess:
    """``python -m flatcake.native ARGS`` (or ``code`` with ARGS) in a fresh process."""
    cmd = [sys.executable, "-c", code, *args] if code else [sys.executable, "-m", "flatcake.native", *args]
    return subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=300,
                          env=env if env is not None else {**os.environ, "FLATCAKE_ZERO_COPY": "0"})


# ---------------------------------------------------------------- the registry
@needs_ext
def test_every_c_loop_is_in_the_registry_and_native_from_the_built_extension():
    assert native_loop.library() == (native_loop.library()[0], "")
    rep = native_loop.report()
    assert list(rep) == LOOPS
    assert all(set(r) == {"state", "reason"} and r["state"] in native_loop.STATES for r in rep.values())
    if os.environ.get("FLATCAKE_ZERO_COPY") != "1" and os.environ.get("FLATCAKE_NATIVE") != "0":
        assert {n: r["state"] for n, r in rep.items()} == {**dict.fromkeys(LOOPS, "native"), "zero_copy": "off"}
        assert rep["zero_copy"]["reason"] == ("FLATCAKE_ZERO_COPY not 1 (off by default; FLATCAKE_ZERO_COPY=1 "
                                              "turns it on)")
    path = Path(native_loop.extension_path())
    assert path.parent == ROOT / "flatcake" or path.parent.name == "flatcake"  # inside the package
    assert path.name.startswith("_native.") and path.suffix == ".so"


@needs_ext
def test_the_extension_was_built_from_the_sources_in_csrc():
    import flatcake._native as ext

    assert len(ext.SOURCE_HASH) == 64 and ext.SOURCE_HASH == native_loop.source_hash(ROOT / "csrc")


def test_a_loop_forced_off_in_the_process_reports_fallback(monkeypatch):
    from flatcake.store import native_write

    monkeypatch.setitem(native_write.LOOP.state, "fn", None)
    assert native_loop.report()["write"] == {"state": "fallback",
                                             "reason": "turned off in this process (its LOOP.state)"}


def test_a_fallback_is_logged_at_warning_with_its_reason(caplog):
    loop = NativeLoop(lambda: (None, "no extension here"), "FC_TEST_NATIVE", "the Python loop")
    with caplog.at_level(logging.WARNING, logger="flatcake.native.loops"):
        assert loop.fn() is None
        assert loop.fn() is None and loop.report() == ("fallback", "no extension here")
    assert [r.getMessage() for r in caplog.records] == [  # once
        "flatcake: C loop 'FC_TEST_NATIVE' not in use, the Python loop (no extension here)"]


def test_a_loop_turned_off_by_its_variable_reports_off(monkeypatch):
    monkeypatch.setenv("FC_TEST_NATIVE", "0")
    loop = NativeLoop(lambda: ((lambda: 1), ""), "FC_TEST_NATIVE", "the Python loop")
    assert loop.fn() is None and loop.report() == ("off", "FC_TEST_NATIVE=0")


def test_flatcake_native_0_turns_every_loop_off(monkeypatch):
    monkeypatch.setenv("FLATCAKE_NATIVE", "0")
    loop = NativeLoop(lambda: ((lambda: 1), ""), "FC_TEST_NATIVE", "the Python loop")
    assert loop.fn() is None and loop.report() == ("off", "FLATCAKE_NATIVE=0")
    out = run_native("--json", env={**os.environ, "FLATCAKE_NATIVE": "0"})
    assert out.returncode == 0, out.stderr
    assert json.loads(out.stdout) == {n: {"state": "off", "reason": "FLATCAKE_NATIVE=0"} for n in LOOPS}


def test_a_build_that_raises_is_a_fallback_with_the_exception():
    def build():
        raise OSError(5, "Input/output error")

    loop = NativeLoop(build, "FC_TEST_NATIVE", "the Python loop")
    assert loop.fn() is None
    assert loop.report() == ("fallback", "building raised OSError: [Errno 5] Input/output error")


def test_the_build_runs_once_and_wait_all_builds_every_loop():
    calls = []
    loop = NativeLoop(lambda: (calls.append(1) or (lambda: 7), ""), "FC_TEST_NATIVE", "the Python loop")
    assert loop.fn()() == 7 and loop.wait_built()() == 7 and loop.report() == ("native", "")
    assert calls == [1]
    assert native_loop.wait_all() is True
    assert all(loop._outcome is not None for loop in native_loop.loops().values())


# ---------------------------------------------------------------- the extension's failures
def test_an_extension_not_built_is_a_fallback_naming_the_import_error():
    out = run_native("--json", code=HIDDEN)
    assert out.returncode == 1
    rep = json.loads(out.stdout)
    assert list(rep) == LOOPS and rep["zero_copy"]["state"] == "off"
    why = ("extension not built (ModuleNotFoundError: import of flatcake._native halted; None in sys.modules); it is "
           "compiled by pip install (a C compiler is needed then, none at run time)")
    for n in ("restore", "write", "xxh3", "fcds"):
        assert rep[n] == {"state": "fallback", "reason": why}
    assert rep["plan"] == {"state": "fallback", "reason": "bound with the C restore, which is not in use"}
    assert rep["gather"] == {"state": "fallback",
                             "reason": "needs the device checksum's C loop (fcds), which is not in use"}


def test_python_m_flatcake_native_exits_1_naming_each_fallback():
    out = run_native(code=HIDDEN)
    assert out.returncode == 1
    lines = out.stdout.splitlines()
    assert lines[0].startswith("restore    fallback  extension not built (ModuleNotFoundError: import of "
                               "flatcake._native")
    assert lines[-2] == "6 fallback, 1 off (not native: restore, plan, gather, write, xxh3, fcds)"
    assert lines[-1] == "extension: (not built)"


@needs_ext
def test_a_stale_extension_is_a_fallback_naming_the_rebuild(monkeypatch, tmp_path):
    """A checkout whose C changed since the build: the old object is not run."""
    csrc = tmp_path / "csrc"
    shutil.copytree(ROOT / "csrc", csrc)
    (tmp_path / "setup.py").write_text("")
    (csrc / "write.c").write_text((csrc / "write.c").read_text() + "/* changed */\n")
    monkeypatch.setattr(native_loop, "CSRC", csrc)
    monkeypatch.setattr(native_loop, "_lib", None)
    lib, why = native_loop.library()
    assert lib is None
    assert why == (f"extension is stale: {native_loop.extension_path()} was built from other C sources than "
                   f"{csrc} now (rebuild: pip install --no-deps -e .)")
    loop = NativeLoop(lambda: native_loop.entry("fc_write_pieces", [], None), "FC_TEST_NATIVE", "the Python loop")
    assert loop.fn() is None and loop.report() == ("fallback", why)


@needs_ext
def test_a_function_missing_from_the_extension_is_named():
    fn, why = native_loop.entry("fc_no_such_loop", [], None)
    assert fn is None
    assert why == (f"fc_no_such_loop is not in {native_loop.extension_path()} (built from older sources: "
                   "pip install --no-deps -e .)")


# ---------------------------------------------------------------- python -m flatcake.native
@needs_ext
def test_python_m_flatcake_native_prints_each_loop_and_exits_0_when_none_fell_back():
    out = run_native("--json")
    assert out.returncode == 0, out.stderr
    rep = json.loads(out.stdout)
    assert list(rep) == LOOPS and rep["zero_copy"] == {"state": "off", "reason": "FLATCAKE_ZERO_COPY not 1 (off by "
                                                       "default; FLATCAKE_ZERO_COPY=1 turns it on)"}
    assert all(rep[n] == {"state": "native", "reason": ""} for n in LOOPS if n != "zero_copy")


@needs_ext
def test_with_no_compiler_on_path_every_loop_is_native():
    """The run time needs no compiler: PATH is only the interpreter's directory (no cc, gcc, ld)
    and CC is unset; zero copy turned on, so all seven loops are native."""
    bindir = os.path.dirname(sys.executable)
    for tool in ("cc", "gcc", "clang", "ld", "as"):
        assert shutil.which(tool, path=bindir) is None
    env = {k: v for k, v in os.environ.items() if k not in ("CC", "LD_PRELOAD")}
    env.update(PATH=bindir, FLATCAKE_ZERO_COPY="1")
    out = run_native("--json", env=env)
    assert out.returncode == 0, out.stderr
    assert json.loads(out.stdout) == {n: {"state": "native", "reason": ""} for n in LOOPS}
