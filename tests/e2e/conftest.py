"""Fixtures for the real-server tests: a tiny local model, and servers that always stop.

``make test`` runs the quick real-server tests (one server started through ``flatcake-sglang``,
then a restart on its pool); ``make e2e`` (``FLATCAKE_E2E=all``) also runs the tests marked
``e2e_full``. Every server runs on 127.0.0.1 with its own port, ``PROMETHEUS_MULTIPROC_DIR``, log
and small pool under the test's ``tmp_path``, and its process group is killed at the end.
"""

from __future__ import annotations

import importlib.util
import os

import pytest

from flatcake.testing.server import CpuServer
from flatcake.testing.tiny_model import TinyModelSpec, build

#: what the server imports beyond the backend's venv (the ``server`` extra of pyproject.toml)
SERVER_MODULES = ("fastapi", "uvicorn", "uvloop", "openai", "xgrammar", "setproctitle", "partial_json_parser")


def _missing_server_modules() -> list:
    return [m for m in SERVER_MODULES if importlib.util.find_spec(m) is None]


def pytest_collection_modifyitems(config, items):
    full = os.environ.get("FLATCAKE_E2E", "") == "all"
    missing = _missing_server_modules()
    for item in items:
        if "e2e" not in item.nodeid.split("::")[0]:
            continue
        if missing:
            item.add_marker(pytest.mark.skip(reason=f"SGLang server packages missing ({', '.join(missing)}): "
                                                    "install the server extra (make venv)"))
        elif item.get_closest_marker("e2e_full") and not full:
            item.add_marker(pytest.mark.skip(reason="full real-server scenario: make e2e (FLATCAKE_E2E=all)"))


@pytest.fixture(scope="session")
def tiny_llama(tmp_path_factory) -> str:
    """A tiny Llama (MHA, 4 KV heads × head_dim 128, fp32: 8 KiB of KV per token) and tokenizer."""
    return str(build(tmp_path_factory.mktemp("tiny-llama"), TinyModelSpec(kind="llama")))


@pytest.fixture
def servers():
    """``servers(spec, workdir, name)`` -> a started, ready :class:`CpuServer`; every one is
    stopped (process group killed) at the end of the test."""
    made = []

    def _start(spec, workdir, name="server"):
        server = CpuServer(spec, workdir, name)
        made.append(server)
        return server.start().wait_ready()

    yield _start
    for server in made:
        server.stop()
