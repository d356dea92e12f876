"""FlatCake's C loops tested as C (issue 25): each ``csrc/tests/test_*.c`` program is compiled
with the loops' sources under ``-fsanitize=address,undefined`` and run; it feeds its loop edge
inputs (nothing, one byte, odd sizes, misaligned buffers, far file offsets, short files, bad
descriptors) and checks every output byte and status against a reference computed in the
program. A sanitizer report, a failed check or a leak fails the test with the program's output.

Skipped only where no C compiler exists (``$CC``, ``cc``, ``gcc``); ``make test`` runs it.
"""

from __future__ import annotations

import os
import shlex
import shutil
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
CSRC = ROOT / "csrc"
#: the loops' sources linked into each test program (``module.c`` needs Python.h: the extension only)
LOOP_SOURCES = ["plan.c", "restore.c", "zero_copy.c", "gather.c", "write.c", "xxh3.c", "fcds.c", "pagewise_read.c"]
#: one test program per loop source
PROGRAMS = {"plan.c": "test_plan", "restore.c": "test_restore", "zero_copy.c": "test_zero_copy",
            "gather.c": "test_gather", "write.c": "test_write", "xxh3.c": "test_xxh3", "fcds.c": "test_fcds",
            "pagewise_read.c": "test_pagewise"}
SANITIZE = ["-std=gnu11", "-O1", "-g", "-fno-omit-frame-pointer", "-fsanitize=address,undefined",
            "-fno-sanitize-recover=all", "-pthread", "-Wall"]
#: the extension's own flags (setup.py): the build that ships, with the device checksum's
#: variant picked at load
SHIPPED = ["-std=gnu11", "-O3", "-pthread", "-fvisibility=hidden", "-Wall"]


def _cc() -> list:
    raw = os.environ.get("CC", "").strip()
    if raw:
        argv = shlex.split(raw)
        return argv if shutil.which(argv[0]) else []
    cc = shutil.which("cc") or shutil.which("gcc")
    return [cc] if cc else []


CC = _cc()
pytestmark = pytest.mark.skipif(not CC, reason="no C compiler (CC, cc, gcc): the C tests need one")


def _cc_run(cmd: list) -> None:
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, f"{' '.join(cmd)}\n{proc.stderr[-4000:]}"


@pytest.fixture(scope="module")
def objects(tmp_path_factory):
    """``flags -> [object files]``: the loop sources compiled once per flag set for this module."""
    built: dict = {}

    def get(flags: list) -> list:
        key = tuple(flags)
        if key not in built:
            d = tmp_path_factory.mktemp("fc-c-objects")
            built[key] = [d / (Path(s).stem + ".o") for s in LOOP_SOURCES]
            for src, obj in zip(LOOP_SOURCES, built[key]):
                _cc_run([*CC, *flags, f"-I{CSRC}", "-c", str(CSRC / src), "-o", str(obj)])
        return built[key]

    yield get
    for objs in built.values():
        for o in objs:
            o.unlink(missing_ok=True)


def _compile(out_dir: Path, flags: list, program: str, objs: list) -> Path:
    exe = out_dir / program
    _cc_run([*CC, *flags, f"-I{CSRC}", str(CSRC / "tests" / f"{program}.c"), *map(str, objs), "-o", str(exe)])
    return exe


def _run(exe: Path, tmp: Path) -> subprocess.CompletedProcess:
    env = {**os.environ, "TMPDIR": str(tmp), "ASAN_OPTIONS": "detect_leaks=1:halt_on_error=1",
           "UBSAN_OPTIONS": "print_stacktrace=1:halt_on_error=1"}
    env.pop("LD_PRELOAD", None)
    return subprocess.run([str(exe)], capture_output=True, text=True, timeout=300, env=env)


def test_every_loop_source_has_a_test_program():
    assert sorted(p.name for p in CSRC.glob("*.c")) == sorted(LOOP_SOURCES + ["module.c"])
    assert sorted(p.stem for p in (CSRC / "tests").glob("test_*.c")) == sorted(PROGRAMS.values())


@pytest.mark.parametrize("program", sorted(PROGRAMS.values()))
def test_the_loop_passes_its_c_test_under_address_and_undefined_sanitizers(program, tmp_path, objects):
    exe = _compile(tmp_path, SANITIZE, program, objects(SANITIZE))
    proc = _run(exe, tmp_path)
    assert proc.returncode == 0, proc.stdout + proc.stderr[-6000:]
    assert proc.stdout.strip() == f"{program}: ok" and "runtime error" not in proc.stderr
    exe.unlink()
    assert list(tmp_path.iterdir()) == []  # the programs' temporary files are gone


@pytest.mark.parametrize("program", ["test_fcds", "test_gather", "test_restore"])
def test_the_shipped_build_passes_the_same_checks(program, tmp_path, objects):
    """The extension's flags (-O3, the device checksum's AVX2 / AVX-512 variant chosen at load):
    the same checks, the same bits."""
    exe = _compile(tmp_path, SHIPPED, program, objects(SHIPPED))
    proc = _run(exe, tmp_path)
    assert proc.returncode == 0 and proc.stdout.strip() == f"{program}: ok", proc.stdout + proc.stderr[-4000:]
    exe.unlink()
