"""Applies FlatCake's CPU shims (:mod:`flatcake.testing.cpu_shims`) at interpreter start-up in every
process that inherits ``FLATCAKE_CPU_SHIMS=1`` with this directory on ``PYTHONPATH``: the SGLang
scheduler and detokenizer processes are started with ``spawn`` and would otherwise import SGLang
without them. Set up by :mod:`flatcake.testing.serve_cpu`; does nothing when CUDA is present."""

import os

if os.environ.get("FLATCAKE_CPU_SHIMS") == "1":
    from flatcake.testing.cpu_shims import install

    install()
