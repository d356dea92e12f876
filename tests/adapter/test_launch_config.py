"""``flatcake-sglang`` with SGLang's ``--config`` YAML: the backend keys in the file are rewritten
like the flags (others untouched) and the result is what SGLang 0.5.23's own parser and config
merger read; the launcher warns when hierarchical cache is off or prefix keys are not passed."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import pytest
import yaml

from flatcake.adapter import launcher
from flatcake.adapter.launcher import main
from flatcake.config import FLATCAKE_EXTRA

REPO = Path(__file__).resolve().parents[2]
EXTRA = "--hicache-storage-backend-extra-config"
OTHERS = {  # keys the launcher must leave exactly as they were
    "model-path": "Qwen/Qwen2.5-7B-Instruct",
    "page-size": 64,
    "enable-hierarchical-cache": True,
    "hicache-ratio": 2.5,
    "hicache-mem-layout": "page_first_direct",
    "tp-size": 2,
    "cuda-graph-bs-decode": [1, 2, 4, 8],
    "log-level": "warning",
}


@pytest.fixture(scope="module")
def sglang_parser() -> argparse.ArgumentParser:
    from sglang.srt.server_args import ServerArgs

    parser = argparse.ArgumentParser()
    ServerArgs.add_cli_args(parser)
    return parser


@pytest.fixture(autouse=True)
def own_tempdir(tmp_path, monkeypatch):
    """Rewritten YAML files go to this test's directory."""
    d = tmp_path / "tmp"
    d.mkdir()
    monkeypatch.setattr("tempfile.tempdir", str(d))
    return d


def sglang_reads(parser: argparse.ArgumentParser, argv: list[str]) -> argparse.Namespace:
    """What SGLang's prepare_server_args parses: its ConfigArgumentMerger, then its parser."""
    from sglang.srt.utils.server_args_config_parser import ConfigArgumentMerger

    return parser.parse_args(ConfigArgumentMerger(parser).merge_config_with_args(argv))


def write_yaml(path: Path, data: dict) -> str:
    path.write_text(yaml.safe_dump(data, sort_keys=False))
    return str(path)


def dry_run(capsys, *args: str) -> tuple[list[str], str, int]:
    rc = main(["--dry-run", *args])
    out, err = capsys.readouterr()
    return (json.loads(out) if rc == 0 else []), err, rc


def config_of(argv: list[str]) -> tuple[str, dict]:
    path = argv[argv.index("--config") + 1]
    return path, yaml.safe_load(Path(path).read_text())


def test_backend_keys_in_the_config_file_are_rewritten_and_the_rest_untouched(sglang_parser, tmp_path, capsys,
                                                                             monkeypatch):
    monkeypatch.chdir(REPO)
    user_extra = {"ssd.path": "/nvme/flatcake", "dram.capacity_bytes": 64 << 30, "prefetch_threshold": 128}
    data = {**OTHERS, "hicache-storage-backend": "flatcake", "hicache-storage-backend-extra-config": user_extra,
            "flatcake-config": "configs/default.yaml"}
    cfg = write_yaml(tmp_path / "server.yaml", data)
    argv, err, rc = dry_run(capsys, "--config", cfg)
    assert rc == 0, err
    path, written = config_of(argv)
    assert path != cfg and Path(cfg).read_text() == yaml.safe_dump(data, sort_keys=False)  # original kept
    merged = {**user_extra, **FLATCAKE_EXTRA, "flatcake_config": str(REPO / "configs" / "default.yaml")}
    assert written == {**OTHERS, "hicache-storage-backend": "dynamic", "hicache-storage-backend-extra-config": merged}
    assert list(written) == [k for k in data if k != "flatcake-config"]  # order kept
    ns = sglang_reads(sglang_parser, argv)
    assert ns.hicache_storage_backend == "dynamic"
    assert json.loads(ns.hicache_storage_backend_extra_config) == merged
    assert (ns.model_path, ns.page_size, ns.tp_size, ns.hicache_ratio) == ("Qwen/Qwen2.5-7B-Instruct", 64, 2, 2.5)
    assert ns.cuda_graph_bs_decode == [1, 2, 4, 8] and ns.hicache_mem_layout == "page_first_direct"
    assert ns.hicache_host_memory_mode == "buffer_only"  # FlatCake's serving default, as with the flags
    assert f"--config rewritten into {path}" in err
    assert "flatcake-sglang: warning" not in err


def test_flag_on_the_command_line_with_the_extra_config_in_the_file(sglang_parser, tmp_path, capsys):
    cfg = write_yaml(tmp_path / "s.yaml", {**OTHERS, EXTRA[2:]: {"ssd.path": "/nvme/a"}})
    argv, err, rc = dry_run(capsys, "--config", cfg, "--hicache-storage-backend", "flatcake")
    assert rc == 0, err
    merged = {"ssd.path": "/nvme/a", **FLATCAKE_EXTRA}
    assert config_of(argv)[1][EXTRA[2:]] == merged
    assert json.loads(argv[argv.index(EXTRA) + 1]) == merged  # the command line says the same
    ns = sglang_reads(sglang_parser, argv)
    assert ns.hicache_storage_backend == "dynamic" and json.loads(ns.hicache_storage_backend_extra_config) == merged


def test_extra_config_on_the_command_line_wins_over_the_file_as_in_sglang(sglang_parser, tmp_path, capsys):
    cfg = write_yaml(tmp_path / "s.yaml", {**OTHERS, "hicache-storage-backend": "flatcake",
                                           EXTRA[2:]: {"ssd.path": "/nvme/file"}})
    argv, err, rc = dry_run(capsys, "--config", cfg, EXTRA, '{"ssd.path": "/nvme/cli"}')
    assert rc == 0, err
    merged = {"ssd.path": "/nvme/cli", **FLATCAKE_EXTRA}
    assert config_of(argv)[1][EXTRA[2:]] == merged
    assert json.loads(sglang_reads(sglang_parser, argv).hicache_storage_backend_extra_config) == merged


def test_another_backend_on_the_command_line_wins_and_the_file_key_is_dropped(sglang_parser, tmp_path, capsys):
    cfg = write_yaml(tmp_path / "s.yaml", {**OTHERS, "hicache-storage-backend": "flatcake"})
    argv, err, rc = dry_run(capsys, "--config", cfg, "--hicache-storage-backend", "file")
    assert rc == 0, err
    assert config_of(argv)[1] == OTHERS
    assert sglang_reads(sglang_parser, argv).hicache_storage_backend == "file"


def test_a_config_file_without_flatcake_is_passed_as_it_is(tmp_path, capsys, own_tempdir):
    cfg = write_yaml(tmp_path / "s.yaml", {**OTHERS, "hicache-storage-backend": "file"})
    argv, err, rc = dry_run(capsys, "--config", cfg)
    assert rc == 0 and argv == ["--config", cfg]
    assert not list(own_tempdir.iterdir())


def test_bad_flatcake_key_in_the_config_file_exits_2_naming_the_field(tmp_path, capsys, own_tempdir):
    cfg = write_yaml(tmp_path / "s.yaml", {**OTHERS, "hicache-storage-backend": "flatcake",
                                           EXTRA[2:]: {"ssd.file_bytes": 1000}})
    _, err, rc = dry_run(capsys, "--config", cfg)
    assert rc == 2
    assert "ssd.file_bytes: Value error, must be a multiple of 4096" in err
    assert not list(own_tempdir.iterdir())


def test_flatcake_config_key_with_another_backend_exits_2(tmp_path, capsys):
    cfg = write_yaml(tmp_path / "s.yaml", {**OTHERS, "flatcake-config": "x.yaml"})
    _, err, rc = dry_run(capsys, "--config", cfg, "--hicache-storage-backend", "file")
    assert rc == 2 and "flatcake-config needs --hicache-storage-backend flatcake (got 'file')" in err


def test_the_rewritten_file_lives_while_sglang_starts_and_is_removed_after(tmp_path, monkeypatch):
    cfg = write_yaml(tmp_path / "s.yaml", {**OTHERS, "hicache-storage-backend": "flatcake"})
    seen = {}

    def fake_run_module(name, **kwargs):
        path = sys.argv[sys.argv.index("--config") + 1]
        seen["path"], seen["data"] = path, yaml.safe_load(Path(path).read_text())

    monkeypatch.setattr(launcher.runpy, "run_module", fake_run_module)
    monkeypatch.setattr(sys, "argv", ["flatcake-sglang"])
    monkeypatch.setenv("FLATCAKE_PLUGIN", "off")
    assert main(["--config", cfg]) == 0
    assert seen["data"]["hicache-storage-backend"] == "dynamic"
    assert not Path(seen["path"]).exists()


def test_an_unexpected_fault_after_the_rewrite_leaves_no_yaml_behind(tmp_path, monkeypatch, own_tempdir):
    cfg = write_yaml(tmp_path / "s.yaml", {**OTHERS, "hicache-storage-backend": "flatcake"})

    def boom(argv):
        raise RuntimeError("unexpected")

    monkeypatch.setattr(launcher, "with_buffer_only", boom)
    with pytest.raises(RuntimeError):
        main(["--config", cfg])
    assert list(own_tempdir.iterdir()) == []


def test_a_config_file_that_is_not_utf8_is_left_to_sglang(tmp_path, capsys, own_tempdir):
    cfg = tmp_path / "s.yaml"
    cfg.write_bytes(b"model-path: m\nhicache-storage-backend: file\n\xff\xfe: x\n")
    argv, err, rc = dry_run(capsys, "--config", str(cfg))
    assert rc == 0 and argv == ["--config", str(cfg)], err
    assert list(own_tempdir.iterdir()) == []


# ---- warnings -----------------------------------------------------------------------------------

NO_HICACHE = "--enable-hierarchical-cache is not set: SGLang ignores --hicache-storage-backend without it"
NO_PREFIX = "hicache_storage_pass_prefix_keys is not true in the extra config"
DYNAMIC = {k: v for k, v in FLATCAKE_EXTRA.items() if k != "hicache_storage_pass_prefix_keys"}


@pytest.mark.parametrize("args, warned", [
    (["--model-path", "m", "--page-size", "64", "--hicache-storage-backend", "flatcake"], [NO_HICACHE]),
    (["--model-path", "m", "--enable-hicache", "--hicache-storage-backend", "flatcake"], []),  # SGLang's alias
    (["--model-path", "m", "--enable-hierarchical-cache", "--hicache-storage-backend", "dynamic",
      EXTRA, json.dumps(DYNAMIC)], [NO_PREFIX]),
    (["--model-path", "m", "--hicache-storage-backend", "dynamic",
      EXTRA, json.dumps({**DYNAMIC, "hicache_storage_pass_prefix_keys": False})], [NO_PREFIX, NO_HICACHE]),
    (["--model-path", "m", "--enable-hierarchical-cache", "--hicache-storage-backend", "dynamic",
      EXTRA, json.dumps(FLATCAKE_EXTRA)], []),
    (["--model-path", "m", "--hicache-storage-backend", "file"], []),  # not FlatCake: not ours to judge
    (["--model-path", "m", "--hicache-storage-backend", "dynamic",
      EXTRA, json.dumps({"backend_name": "x", "module_path": "other", "class_name": "Other"})], []),
])
def test_warnings_for_hierarchical_cache_and_prefix_keys(args, warned, capsys):
    _, err, rc = dry_run(capsys, *args)
    assert rc == 0, err
    lines = [ln for ln in err.splitlines() if ln.startswith("flatcake-sglang: warning:")]
    assert len(lines) == len(warned), err
    for needle in warned:
        assert any(needle in ln for ln in lines), (needle, err)


def test_warnings_read_the_config_file_too(tmp_path, capsys):
    cfg = write_yaml(tmp_path / "s.yaml", {"model-path": "m", "hicache-storage-backend": "dynamic", EXTRA[2:]: DYNAMIC})
    _, err, rc = dry_run(capsys, "--config", cfg)
    assert rc == 0
    assert NO_PREFIX in err and NO_HICACHE in err
    cfg = write_yaml(tmp_path / "t.yaml", {"model-path": "m", "enable-hicache": True, "hicache-storage-backend": "flatcake"})
    _, err, rc = dry_run(capsys, "--config", cfg)
    assert rc == 0 and "flatcake-sglang: warning" not in err
