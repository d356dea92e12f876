"""Running FlatCake inside a real SGLang 0.5.23 server on a CPU-only machine.

* :mod:`flatcake.testing.cpu_shims` — the six stand-ins for CUDA-only pieces outside HiCache;
* :mod:`flatcake.testing.serve_cpu` — ``python -m flatcake.testing.serve_cpu <sglang args>``;
* :mod:`flatcake.testing.tiny_model` — tiny local models and tokenizers (no downloads);
* :mod:`flatcake.testing.server` — start / stop a server and talk to it (the e2e tests' harness).

See ``docs/real-server.md``.
"""
