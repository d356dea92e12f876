"""FlatCake's C loops report their state, and a broken build environment costs no start-up time
(issues 23 item 17, 24 item 8): every loop is in one registry (native / fallback and why / off /
pending); ``$CC`` with arguments is split like a shell; an unusable ``$TMPDIR`` is named and
the next directory used; a compiler that hangs is run once per process, killed after its
timeout, and nobody waits for it longer than ``WAIT_S``. Tests that change the process-wide
compiler state (a hung compiler) run in a subprocess."""

from __future__ import annotations

import json
import logging
import os
import shutil
import subprocess
import sys
import textwrap
import threading

import pytest

from flatcake import native_loop
from flatcake.native_loop import NativeLoop, compile_shim

HAS_CC = shutil.which("cc") is not None or shutil.which("gcc") is not None
needs_cc = pytest.mark.skipif(not HAS_CC, reason="no C compiler")
GCC = shutil.which("gcc") or shutil.which("cc")
SOURCE = "int fc_answer(void) { return 42; }\n"
#: the loops every start-up reports, in order
LOOPS = ["restore", "plan", "zero_copy", "gather", "write", "xxh3", "fcds"]
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def answer(lib) -> int:
    return lib.fc_answer()


# ---------------------------------------------------------------- the registry
def test_every_c_loop_is_in_the_registry_with_its_state_and_reason():
    for loop in native_loop.loops().values():
        loop.wait_built()
    rep = native_loop.report()
    assert list(rep) == LOOPS
    assert all(set(r) == {"state", "reason"} and r["state"] in native_loop.STATES for r in rep.values())
    if HAS_CC and os.environ.get("FLATCAKE_ZERO_COPY") != "1":
        assert {n: r["state"] for n, r in rep.items()} == {**dict.fromkeys(LOOPS, "native"), "zero_copy": "off"}
        assert rep["zero_copy"]["reason"].startswith("FLATCAKE_ZERO_COPY not 1 (off by default")


def test_a_loop_forced_off_in_the_process_reports_fallback(monkeypatch):
    from flatcake import native_write

    monkeypatch.setitem(native_write.LOOP.state, "fn", None)
    assert native_loop.report()["write"] == {"state": "fallback",
                                             "reason": "turned off in this process (its LOOP.state)"}


def test_a_fallback_is_logged_at_warning_with_its_reason(caplog):
    loop = NativeLoop(lambda: (None, "no compiler here"), "FC_TEST_NATIVE", "the Python loop")
    with caplog.at_level(logging.WARNING, logger="flatcake.native_loop"):
        assert loop.fn() is None
    assert loop.report() == ("fallback", "no compiler here")
    assert [r.getMessage() for r in caplog.records] == [
        "flatcake: C loop 'FC_TEST_NATIVE' not in use, the Python loop (no compiler here)"]


def test_a_loop_turned_off_by_its_variable_reports_off(monkeypatch):
    monkeypatch.setenv("FC_TEST_NATIVE", "0")
    loop = NativeLoop(lambda: ((lambda: 1), ""), "FC_TEST_NATIVE", "the Python loop")
    assert loop.fn() is None and loop.report() == ("off", "FC_TEST_NATIVE=0")


def test_a_caller_waits_for_a_slow_build_at_most_wait_s_and_the_loop_is_used_once_ready(monkeypatch, caplog):
    """The build blocks on an event: the caller's wait ends by WAIT_S (the fallback runs), the
    state says pending, and the same loop is used once the build ends."""
    monkeypatch.setattr(native_loop, "WAIT_S", 0.2)
    release, entered = threading.Event(), threading.Event()

    def build():
        entered.set()
        assert release.wait(60)
        return (lambda: 7), ""

    loop = NativeLoop(build, "FC_TEST_NATIVE", "the Python loop")
    assert loop.fn() is None and entered.is_set()
    assert loop.report()[0] == "pending"
    release.set()
    with caplog.at_level(logging.INFO, logger="flatcake.native_loop"):
        assert loop.wait_built(60)() == 7
    assert loop.fn()() == 7 and loop.report() == ("native", "")
    assert any("ready after" in r.getMessage() for r in caplog.records)


def test_a_build_that_raises_is_a_fallback_with_the_exception():
    def build():
        raise OSError(5, "Input/output error")

    loop = NativeLoop(build, "FC_TEST_NATIVE", "the Python loop")
    assert loop.fn() is None
    assert loop.report() == ("fallback", "building raised OSError: [Errno 5] Input/output error")


# ---------------------------------------------------------------- the compiler command
@needs_cc
@pytest.mark.parametrize("cc", [f"{GCC} -pipe", f"env {GCC}", f"'{GCC}' -O1"])
def test_cc_with_arguments_is_split_like_a_shell(monkeypatch, cc):
    monkeypatch.setenv("CC", cc)
    lib, why = compile_shim(SOURCE, "cc_args")
    assert why == "" and answer(lib) == 42


@pytest.mark.parametrize("cc, why", [("'gcc -pipe", "CC=\"'gcc -pipe\" cannot be split into words"),
                                      ("fc-no-such-cc -O2", "CC='fc-no-such-cc -O2': fc-no-such-cc not found")])
def test_a_cc_that_cannot_run_is_a_fallback_naming_it(monkeypatch, cc, why):
    monkeypatch.setenv("CC", cc)
    lib, got = compile_shim(SOURCE, "cc_bad")
    assert lib is None and got.startswith(why)


@needs_cc
def test_a_compile_error_is_the_compilers_message():
    lib, why = compile_shim("this is not C;", "cc_error")
    assert lib is None and " failed: " in why and "error" in why


# ---------------------------------------------------------------- the build directory
@needs_cc
def test_an_unusable_tmpdir_is_named_and_the_next_directory_used(monkeypatch, tmp_path):
    missing, afile = tmp_path / "missing", tmp_path / "afile"
    afile.write_text("")
    for bad, err in ((missing, "No such file or directory"), (afile, "Not a directory")):
        monkeypatch.setenv("TMPDIR", str(bad))
        lib, note = compile_shim(SOURCE, "tmpdir")
        assert answer(lib) == 42
        assert note == f"built in /tmp, not in {bad} ({err})"


@needs_cc
def test_no_usable_build_directory_is_a_fallback_naming_each(monkeypatch, tmp_path):
    missing, afile = tmp_path / "missing", tmp_path / "afile"
    afile.write_text("")
    monkeypatch.setattr(native_loop, "build_dirs", lambda: [str(missing), str(afile)])
    lib, why = compile_shim(SOURCE, "nodir")
    assert lib is None
    assert why == (f"no directory could hold the compiler's files: {missing} (No such file or directory), "
                   f"{afile} (Not a directory)")


@needs_cc
def test_the_compilers_files_are_removed(monkeypatch, tmp_path):
    monkeypatch.setenv("TMPDIR", str(tmp_path))
    lib, why = compile_shim(SOURCE, "cleanup")
    assert answer(lib) == 42 and why == "" and os.listdir(tmp_path) == []


# ---------------------------------------------------------------- a hung compiler (own processes)
HUNG_CC = """#!/bin/sh
echo $$ >> {count}
exec sleep 3600
"""

PROBE = textwrap.dedent("""
    import json, os, sys, threading
    from flatcake import native_loop
    native_loop.WAIT_S = float(sys.argv[1])
    native_loop.warm_up_all()
    ended = native_loop.wait_all()  # what a start-up waits for
    first = native_loop.report()
    if sys.argv[2] == "wait":
        for loop in native_loop.loops().values():
            loop.wait_built()
    else:  # exit while the compiler runs: once it has written its PID
        while not (os.path.exists(sys.argv[3]) and open(sys.argv[3]).read().strip()):
            threading.Event().wait(0.01)
    print(json.dumps({"ended": ended, "first": first, "last": native_loop.report()}))
""")


def run_probe(tmp_path, wait_s: float, timeout_s: float, wait: bool) -> tuple[dict, list]:
    """Run :data:`PROBE` in a fresh process with a ``CC`` that hangs; its JSON and the PIDs of
    the compiler runs (one line each)."""
    count = tmp_path / "runs"
    cc = tmp_path / "hung-cc"
    cc.write_text(HUNG_CC.format(count=count))
    cc.chmod(0o755)
    env = {**os.environ, "CC": f"{cc} -O2", native_loop.TIMEOUT_ENV: str(timeout_s), "FLATCAKE_ZERO_COPY": "0"}
    out = subprocess.run([sys.executable, "-c", PROBE, str(wait_s), "wait" if wait else "exit", str(count)],
                         env=env, cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr
    runs = count.read_text().split() if count.exists() else []
    return json.loads(out.stdout.strip().splitlines()[-1]), runs


def pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return not open(f"/proc/{pid}/stat").read().split()[2] == "Z"


def test_start_up_does_not_wait_for_a_hung_compiler_and_exit_kills_it(tmp_path):
    """Compiler timeout 600 s, WAIT_S 0.5 s: the start-up's wait ends with the loops pending (the
    compiler ran once; the other builds wait for it) and the process exits at once, killing it."""
    got, runs = run_probe(tmp_path, wait_s=0.5, timeout_s=600, wait=False)
    assert got["ended"] is False
    states = {n: r["state"] for n, r in got["first"].items()}
    assert states == {**dict.fromkeys(LOOPS, "pending"), "zero_copy": "off"}
    assert all(r["reason"].startswith(("compiling: the compiler has run ", "waiting for the compiler"))
               for n, r in got["first"].items() if n != "zero_copy")
    assert len(runs) == 1 and not pid_alive(int(runs[0]))


def test_a_hung_compiler_is_run_once_then_every_loop_falls_back_with_the_reason(tmp_path):
    got, runs = run_probe(tmp_path, wait_s=0.5, timeout_s=2, wait=True)
    last = got["last"]
    assert {n: r["state"] for n, r in last.items()} == {**dict.fromkeys(LOOPS, "fallback"), "zero_copy": "off"}
    compiled = ["restore", "write", "xxh3", "fcds"]
    timed_out = [n for n in compiled if last[n]["reason"].endswith(
        f"timed out after 2 s compiling '{n}' (FLATCAKE_CC_TIMEOUT_S); the compiler is not run again in this process")]
    assert len(timed_out) == 1 and last[timed_out[0]]["reason"].startswith(f"{tmp_path}/hung-cc -O2 timed out")
    for n in set(compiled) - set(timed_out):
        assert last[n]["reason"].startswith(f"not tried: {tmp_path}/hung-cc -O2 timed out after 2 s compiling")
    assert last["plan"]["reason"] == "in the restore's library, which is not in use"
    assert last["gather"]["reason"] == "needs the device checksum's C loop (fcds), which is not in use"
    assert len(runs) == 1 and not pid_alive(int(runs[0]))  # run once, and killed


# ---------------------------------------------------------------- python -m flatcake.native
@needs_cc
def test_python_m_flatcake_native_prints_each_loop_and_exits_0_when_none_fell_back():
    out = subprocess.run([sys.executable, "-m", "flatcake.native", "--json"], cwd=ROOT, capture_output=True,
                         text=True, timeout=600, env={**os.environ, "FLATCAKE_ZERO_COPY": "0"})
    assert out.returncode == 0, out.stderr
    rep = json.loads(out.stdout)
    assert list(rep) == LOOPS and rep["zero_copy"] == {"state": "off", "reason": "FLATCAKE_ZERO_COPY not 1 (off by "
                                                       "default; FLATCAKE_ZERO_COPY=1 turns it on)"}
    assert all(rep[n]["state"] == "native" for n in LOOPS if n != "zero_copy")


def test_python_m_flatcake_native_exits_1_naming_each_fallback():
    out = subprocess.run([sys.executable, "-m", "flatcake.native"], cwd=ROOT, capture_output=True, text=True,
                         timeout=600, env={**os.environ, "CC": "fc-no-such-cc", "FLATCAKE_ZERO_COPY": "0"})
    assert out.returncode == 1
    lines = out.stdout.splitlines()
    assert lines[0] == "restore    fallback  CC='fc-no-such-cc': fc-no-such-cc not found"
    assert lines[-1] == "6 fallback, 1 off (not native: restore, plan, gather, write, xxh3, fcds)"
