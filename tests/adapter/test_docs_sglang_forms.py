"""The ways docs/configuration.md shows to start FlatCake without the launcher — ``sglang serve``
flags, ``sglang serve --config`` YAML, ``sglang.Engine(...)`` — read by SGLang 0.5.23's own
parser, config merger, extra-config parser and dynamic backend factory, give a FlatCake backend
with prefix keys on."""

from __future__ import annotations

import argparse
import json
import re
import shlex
from pathlib import Path

import pytest
import yaml

from flatcake.config import FLATCAKE_EXTRA, config_from_extra

DOC = (Path(__file__).resolve().parents[2] / "docs" / "configuration.md").read_text()


def block_after(marker: str, lang: str) -> str:
    """The first fenced ``lang`` block after ``marker`` in the doc."""
    rest = DOC[DOC.index(marker):]
    m = re.search(rf"```{lang}\n(.*?)```", rest, re.S)
    assert m, marker
    return m.group(1)


@pytest.fixture(scope="module")
def sglang_parser() -> argparse.ArgumentParser:
    from sglang.srt.server_args import ServerArgs

    parser = argparse.ArgumentParser()
    ServerArgs.add_cli_args(parser)
    return parser


def assert_flatcake_backend(extra_json: str, ssd_dir: str) -> None:
    """SGLang's extra-config parser keeps prefix keys on, and its dynamic factory builds
    FlatCakeStorage from the rest."""
    from sglang.srt.mem_cache.storage.backend_factory import StorageBackendFactory

    from flatcake.adapter.storage import FlatCakeStorage
    from flatcake_testkit import storage_config

    # as HybridCacheController.parse_storage_backend_extra_config (hybrid_cache_controller.py
    # 403-411; that module needs torchvision to import): SGLang pops its own keys, the rest
    # reaches the backend
    extra = json.loads(extra_json)
    for key in ("prefetch_threshold", "prefetch_timeout_base", "prefetch_timeout_per_ki_token"):
        extra.pop(key, None)
    assert extra.pop("hicache_storage_pass_prefix_keys", False) is True
    config_from_extra(extra)
    extra["ssd.path"] = ssd_dir  # the doc's /nvme path does not exist here
    be = StorageBackendFactory.create_backend("dynamic", storage_config(extra), None)
    assert isinstance(be, FlatCakeStorage)
    be.close()


def test_sglang_serve_flags(sglang_parser, ssd_dir):
    cmd = block_after("### From `sglang serve`", "").replace("\\\n", " ")
    argv = shlex.split(cmd)
    assert argv[:2] == ["sglang", "serve"]
    ns = sglang_parser.parse_args(argv[2:])
    assert (ns.hicache_storage_backend, ns.enable_hierarchical_cache, ns.hicache_host_memory_mode) == (
        "dynamic", True, "buffer_only")
    assert json.loads(ns.hicache_storage_backend_extra_config).items() >= FLATCAKE_EXTRA.items()
    assert_flatcake_backend(ns.hicache_storage_backend_extra_config, ssd_dir)


def test_sglang_serve_config_file(sglang_parser, ssd_dir, tmp_path):
    from sglang.srt.utils.server_args_config_parser import ConfigArgumentMerger

    cfg = tmp_path / "server.yaml"
    cfg.write_text(block_after("or the same in a `--config` file", "yaml"))
    argv = ConfigArgumentMerger(sglang_parser).merge_config_with_args(["--config", str(cfg)])
    ns = sglang_parser.parse_args(argv)
    assert (ns.hicache_storage_backend, ns.enable_hierarchical_cache, ns.page_size) == ("dynamic", True, 64)
    assert json.loads(ns.hicache_storage_backend_extra_config)["dram.capacity_bytes"] == 16 << 30
    assert_flatcake_backend(ns.hicache_storage_backend_extra_config, ssd_dir)


def test_engine_keywords(monkeypatch, ssd_dir):
    from sglang.srt.server_args import ServerArgs

    import sglang

    seen = {}
    monkeypatch.setattr(sglang, "Engine", lambda **kw: seen.update(kw))
    exec(block_after("### From the Python API", "python"), {})
    args = ServerArgs(**seen)  # SGLang's own record of Engine's keywords (unresolved)
    assert args.hicache_storage_backend == "dynamic" and args.enable_hierarchical_cache is True
    assert args.hicache_host_memory_mode == "buffer_only" and seen["log_level"] == "info"
    assert_flatcake_backend(args.hicache_storage_backend_extra_config, ssd_dir)
