"""``flatcake-sglang --direct``: FlatCake as SGLang's direct L3 linker. The exact argv, read back by
SGLang 0.5.23's own parser and linker-config validation; HiCache flags refused at start-up, named."""

from __future__ import annotations

import argparse
import json

import pytest

from flatcake.adapter.launch_direct import FLATCAKE_LINKER, rewrite_direct
from flatcake.adapter.launcher import main

BASE = ["--model-path", "some/model", "--page-size", "16"]
LINKER_FLAGS = ["--enable-unified-cache-external-linker", "--unified-cache-external-linker-backend", "dynamic",
                "--unified-cache-external-linker-config"]


@pytest.fixture(scope="module")
def sglang_parser() -> argparse.ArgumentParser:
    from sglang.srt.server_args import ServerArgs

    parser = argparse.ArgumentParser()
    ServerArgs.add_cli_args(parser)
    return parser


def sglang_linker_config(value: dict):
    """SGLang's own frontend validation (``unified_cache/linker_config.py``)."""
    from sglang.srt.mem_cache.unified_cache.linker_config import UnifiedCacheLinkerConfig

    return UnifiedCacheLinkerConfig.from_dict(value)


def dry_run(capsys, *args: str) -> list:
    assert main(["--dry-run", "--direct", *args]) == 0, capsys.readouterr().err
    return json.loads(capsys.readouterr().out)


def test_direct_appends_the_three_linker_flags_with_flatcakes_config(capsys, sglang_parser, tmp_path):
    user = {"linker_extra_config": {"ssd.path": str(tmp_path / "pool"), "ssd.file_bytes": 64 << 20}}
    argv = dry_run(capsys, *BASE, "--unified-cache-external-linker-config", json.dumps(user))
    expected = {"linker": "FlatCakeLinker", "linker_module_path": "flatcake.linker",
                "linker_extra_config": {"ssd.path": str(tmp_path / "pool"), "ssd.file_bytes": 64 << 20}}
    assert argv == BASE + LINKER_FLAGS + [json.dumps(expected, sort_keys=True)]

    ns = sglang_parser.parse_args(argv)
    assert ns.enable_unified_cache_external_linker is True
    assert ns.unified_cache_external_linker_backend == "dynamic"
    assert ns.unified_cache_external_linker_config == expected
    assert ns.enable_hierarchical_cache is False and ns.hicache_storage_backend is None
    config = sglang_linker_config(ns.unified_cache_external_linker_config)
    assert (config.linker, config.linker_module_path) == ("FlatCakeLinker", "flatcake.linker")
    assert config.linker_extra_config == expected["linker_extra_config"]


def test_direct_without_settings_names_only_the_class(capsys, sglang_parser):
    argv = dry_run(capsys, *BASE)
    assert argv[:4] == BASE and argv[4:8] == LINKER_FLAGS
    assert json.loads(argv[8]) == {**FLATCAKE_LINKER, "linker_extra_config": {}}
    assert sglang_linker_config(sglang_parser.parse_args(argv).unified_cache_external_linker_config).linker == \
        "FlatCakeLinker"


def test_flatcake_config_file_becomes_an_absolute_path_in_linker_extra_config(capsys, tmp_path, monkeypatch):
    (tmp_path / "fc.yaml").write_text("ssd:\n  file_bytes: 67108864\n")
    monkeypatch.chdir(tmp_path)
    argv = dry_run(capsys, "--flatcake-config", "fc.yaml", *BASE)
    assert "--flatcake-config" not in argv
    assert json.loads(argv[-1])["linker_extra_config"] == {"flatcake_config": str(tmp_path / "fc.yaml")}


def test_user_linker_flags_are_replaced_and_the_rest_keeps_its_order():
    argv = rewrite_direct(["--model-path", "m", "--enable-unified-cache-external-linker",
                           "--unified-cache-external-linker-backend=dynamic", "--page-size", "32", "--", "x"])
    assert argv[:4] == ["--model-path", "m", "--page-size", "32"]
    assert argv[4:8] == LINKER_FLAGS
    assert argv[9:] == ["--", "x"]


def test_the_linker_is_a_concrete_unified_cache_linker_sglang_can_build():
    """What SGLang's ``linker_factory.create_unified_cache_linker`` checks before constructing it."""
    import importlib
    import inspect

    from flatcake.replay.sglang_cpu import ensure_importable

    ensure_importable()  # SGLang's memory pools import torchvision names (FlatCake's stand-in)
    from sglang.srt.mem_cache.unified_cache.unified_cache_linker import UnifiedCacheLinker

    cls = getattr(importlib.import_module(FLATCAKE_LINKER["linker_module_path"]), FLATCAKE_LINKER["linker"])
    assert issubclass(cls, UnifiedCacheLinker)
    assert not inspect.isabstract(cls), sorted(cls.__abstractmethods__)


@pytest.mark.parametrize("args, named", [
    (["--enable-hierarchical-cache"], ["--enable-hierarchical-cache"]),
    (["--hicache-storage-backend", "file"], ["--hicache-storage-backend"]),
    (["--hicache-storage-backend=flatcake"], ["--hicache-storage-backend"]),
    (["--enable-hierarchical-cache", "--hicache-storage-backend", "flatcake"],
     ["--enable-hierarchical-cache", "--hicache-storage-backend"]),
])
def test_direct_refuses_hicache_flags_naming_them(args, named, capsys):
    assert main(["--dry-run", "--direct", *BASE, *args]) == 2
    captured = capsys.readouterr()
    assert captured.out == ""
    assert "error: --direct links FlatCake to SGLang's radix cache with no host tier; remove " \
           f"{' and '.join(named)} (HiCache)" in captured.err


def test_direct_refuses_hicache_keys_in_sglangs_config_yaml(capsys, tmp_path):
    cfg = tmp_path / "server.yaml"
    cfg.write_text("enable-hierarchical-cache: true\nhicache-storage-backend: file\n")
    assert main(["--dry-run", "--direct", *BASE, "--config", str(cfg)]) == 2
    assert "remove --enable-hierarchical-cache and --hicache-storage-backend (HiCache)" in capsys.readouterr().err


@pytest.mark.parametrize("args, needle", [
    (["--unified-cache-external-linker-backend", "mooncake"],
     "--unified-cache-external-linker-backend mooncake: --direct uses SGLang's 'dynamic' linker backend"),
    (["--unified-cache-external-linker-config", '{"linker": "MooncakeDirectLinker"}'],
     "linker='MooncakeDirectLinker' conflicts with --direct"),
    (["--unified-cache-external-linker-config", '{"linker_extra": {}}'], "unknown fields ['linker_extra']"),
    (["--unified-cache-external-linker-config", '{"linker_extra_config": {"ssd.bogus": 1}}'], "ssd.bogus"),
    (["--unified-cache-external-linker-config", "{not json"], "--unified-cache-external-linker-config: inline JSON"),
    (["--no-buffer-only"], "--no-buffer-only is a HiCache option"),
])
def test_bad_direct_arguments_exit_2_naming_the_field(args, needle, capsys):
    assert main(["--dry-run", "--direct", *BASE, *args]) == 2
    assert needle in capsys.readouterr().err


def test_direct_turns_the_hicache_plugin_off(monkeypatch):
    import os

    import flatcake.adapter.launcher as launcher

    ran = {}
    monkeypatch.setattr(launcher.runpy, "run_module", lambda name, **kw: ran.update(argv=list(launcher.sys.argv)))
    monkeypatch.delenv("FLATCAKE_PLUGIN", raising=False)
    monkeypatch.setattr(launcher.sys, "argv", list(launcher.sys.argv))  # main() replaces sys.argv: restored after
    assert main(["--direct", *BASE]) == 0
    assert os.environ["FLATCAKE_PLUGIN"] == "off"
    assert ran["argv"][1:5] == BASE and ran["argv"][5:9] == LINKER_FLAGS
    monkeypatch.delenv("FLATCAKE_PLUGIN")


def test_missing_flatcake_config_file_exits_2(tmp_path, capsys):
    assert main(["--dry-run", "--direct", *BASE, "--flatcake-config", str(tmp_path / "nope.yaml")]) == 2
    assert "nope.yaml" in capsys.readouterr().err


def test_dry_run_subprocess_prints_the_argv_sglangs_parser_reads(sglang_parser, tmp_path):
    import os
    import subprocess
    import sys
    from pathlib import Path

    repo = Path(__file__).resolve().parents[2]
    env = dict(os.environ, PYTHONPATH=str(repo) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    user = json.dumps({"linker_extra_config": {"ssd": {"path": str(tmp_path)}}})
    proc = subprocess.run([sys.executable, "-m", "flatcake.adapter.launcher", "--dry-run", "--direct", *BASE,
                           "--unified-cache-external-linker-config", user],
                          capture_output=True, text=True, cwd=repo, env=env, timeout=120)
    assert proc.returncode == 0, proc.stderr
    argv = json.loads(proc.stdout)
    ns = sglang_parser.parse_args(argv)
    assert ns.unified_cache_external_linker_config == {**FLATCAKE_LINKER,
                                                       "linker_extra_config": {"ssd": {"path": str(tmp_path)}}}
    assert "flatcake-sglang: direct L3 linker (FlatCakeLinker); environment FLATCAKE_PLUGIN=off" in proc.stderr
