"""Build FlatCake's C loops (``csrc/``) into one extension module, ``flatcake._native``.

Everything else about the package is in ``pyproject.toml``; this file only declares the
extension, which setuptools compiles at ``pip install`` / ``pip wheel`` (and ``pip install -e
.`` builds it in place, beside ``flatcake/__init__.py``). A C compiler is needed then, none at
run time: :mod:`flatcake.native.loops` loads the built object with :mod:`ctypes` by the module's
``__file__`` and binds each loop's functions by name.

Flags: ``-O3`` for every loop (the device checksum's under the old run-time compile, the others
had ``-O2``; CPython's ``CFLAGS`` carry ``-O3`` already), ``-pthread`` (the restores' threads)
and hidden visibility (only the ``fc_*`` entry points and ``PyInit__native`` are exported).
``-march=native`` (the old device checksum's) is not used, as a wheel must run on other
machines of the architecture: that loop picks its AVX2 / AVX-512 variant when the extension
loads instead (``csrc/fcds.c``). ``FC_SOURCE_HASH`` records the
sources the object was built from (:func:`source_hash`), so that a checkout whose C changed
since reports its loops as stale rather than running old code. The extension is ``optional``:
where it cannot be compiled (no compiler) the install goes on without it, and the loops fall
back, reported.
"""

from __future__ import annotations

import hashlib
from pathlib import Path

from setuptools import Extension, setup

HERE = Path(__file__).resolve().parent
CSRC = "csrc"
#: the loops' sources (csrc/tests/ holds the C test programs, not part of the extension)
SOURCES = ["module.c", "plan.c", "restore.c", "zero_copy.c", "gather.c", "write.c", "xxh3.c", "fcds.c",
           "pagewise_read.c"]


def source_hash(csrc: Path) -> str:
    """sha256 (hex) over the names and bytes of ``csrc``'s ``*.c`` and ``*.h`` files, sorted by
    name; the same function as :func:`flatcake.native.loops.source_hash`."""
    h = hashlib.sha256()
    for p in sorted(list(csrc.glob("*.c")) + list(csrc.glob("*.h")), key=lambda p: p.name):
        h.update(p.name.encode() + b"\0" + p.read_bytes() + b"\0")
    return h.hexdigest()


setup(ext_modules=[Extension(
    "flatcake._native",
    sources=[f"{CSRC}/{s}" for s in SOURCES],
    depends=[f"{CSRC}/{h}" for h in ("fc_common.h", "fc_api.h", "fc_copy.h", "fc_plan.h")],
    include_dirs=[CSRC],
    define_macros=[("FC_SOURCE_HASH", f'"{source_hash(HERE / CSRC)}"')],
    extra_compile_args=["-O3", "-pthread", "-fvisibility=hidden", "-std=gnu11"],
    extra_link_args=["-pthread"],
    # a machine without a C compiler still installs FlatCake: every loop then runs its Python /
    # numpy fallback, reported (python -m flatcake.native exits 1; a start-up WARNING names each)
    optional=True,
)])
