"""``python -m flatcake.testing.serve_cpu [--launcher] <sglang args>``: a real SGLang 0.5.23 server
on a CPU-only machine, with FlatCake's CPU shims (:mod:`flatcake.testing.cpu_shims`).

Runs ``sglang.launch_server`` (or, with ``--launcher`` first, FlatCake's ``flatcake-sglang``
launcher, so ``--hicache-storage-backend flatcake`` works) in this process after:

* ``SGLANG_USE_CPU_ENGINE=1`` (SGLang's CPU engine);
* ``FLATCAKE_CPU_SHIMS=1`` and :mod:`flatcake.testing.site` first on ``PYTHONPATH``, so the
  scheduler and detokenizer processes (``spawn``) apply the same shims at start-up;
* :func:`flatcake.testing.cpu_shims.install` here.

Arguments are SGLang's own, unchanged. The CPU engine needs ``--device cpu --attention-backend
torch_native`` and a ``--max-total-tokens`` (the CPU pool otherwise sizes itself from free RAM);
HiCache needs ``--hicache-io-backend direct`` with ``--hicache-mem-layout layer_first`` or
``page_first_direct`` (``kernel`` / ``page_first`` have no CPU implementation in 0.5.23).
:func:`cpu_server_args` gives those flags. Example::

    python -m flatcake.testing.serve_cpu --model-path /tmp/tiny --device cpu \\
        --attention-backend torch_native --disable-cuda-graph --dtype float32 --max-total-tokens 4096 \\
        --page-size 16 --enable-hierarchical-cache --hicache-io-backend direct \\
        --hicache-mem-layout page_first_direct --hicache-storage-backend dynamic \\
        --hicache-storage-backend-extra-config '{"backend_name": "flatcake", "module_path": "flatcake", ...}'

SGLang's direct L3 linker instead of HiCache: no HiCache flags, and either SGLang's three linker
flags naming ``FlatCakeLinker`` or ``--launcher --direct`` (``flatcake-sglang --direct``)::

    python -m flatcake.testing.serve_cpu --launcher --direct --model-path /tmp/tiny --device cpu \
        --attention-backend torch_native --disable-cuda-graph --dtype float32 --max-total-tokens 4096 \
        --page-size 16 --unified-cache-external-linker-config '{"linker_extra_config": {"ssd.path": ...}}'

On a machine with CUDA the shims do nothing and this is SGLang's (or the launcher's) own command.
"""

from __future__ import annotations

import os
import runpy
import sys
from pathlib import Path
from typing import Dict, List, Optional

#: the directory holding the ``sitecustomize`` that applies the shims in child processes
SITE_DIR = Path(__file__).resolve().parent / "site"


def cpu_server_env(base: Optional[Dict[str, str]] = None) -> Dict[str, str]:
    """``base`` (default: ``os.environ``) plus what a CPU server and its child processes need."""
    env = dict(os.environ if base is None else base)
    env["SGLANG_USE_CPU_ENGINE"] = "1"
    env["FLATCAKE_CPU_SHIMS"] = "1"
    parts = [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p and p != str(SITE_DIR)]
    env["PYTHONPATH"] = os.pathsep.join([str(SITE_DIR)] + parts)
    return env


def cpu_server_args(page_size: int = 16, layout: str = "page_first_direct", max_total_tokens: int = 4096) -> List[str]:
    """The SGLang flags a CPU server with HiCache needs (``../shared/design/sglang-cpu-server-facts.md``)."""
    return ["--device", "cpu", "--attention-backend", "torch_native", "--sampling-backend", "pytorch",
            "--disable-cuda-graph", "--dtype", "float32", "--max-total-tokens", str(max_total_tokens),
            "--page-size", str(page_size), "--hicache-io-backend", "direct", "--hicache-mem-layout", layout]


def main(argv: Optional[List[str]] = None) -> None:
    argv = list(sys.argv[1:] if argv is None else argv)
    launcher = bool(argv) and argv[0] == "--launcher"
    if launcher:
        argv = argv[1:]
    os.environ.update(cpu_server_env())
    if str(SITE_DIR) not in sys.path:
        sys.path.insert(0, str(SITE_DIR))
    from flatcake.testing.cpu_shims import install

    install()
    if launcher:
        from flatcake.adapter.launcher import main as launcher_main

        sys.exit(launcher_main(argv))
    sys.argv = ["sglang.launch_server"] + argv
    runpy.run_module("sglang.launch_server", run_name="__main__", alter_sys=True)


if __name__ == "__main__":
    main()
