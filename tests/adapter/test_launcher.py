"""``flatcake-sglang``: the literal ``--hicache-storage-backend flatcake`` becomes SGLang's
``dynamic`` backend with a merged extra config that SGLang's own parser accepts; bad FlatCake
settings fail before SGLang starts (exit 2, field named); other backends pass through."""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from flatcake.adapter import launcher
from flatcake.adapter.launcher import main, rewrite_argv
from flatcake.config import FLATCAKE_EXTRA

REPO = Path(__file__).resolve().parents[2]
BASE = ["--model-path", "some/model", "--page-size", "64", "--enable-hierarchical-cache"]
FC = ["--hicache-storage-backend", "flatcake"]
EXTRA = "--hicache-storage-backend-extra-config"


@pytest.fixture(scope="module")
def sglang_parser() -> argparse.ArgumentParser:
    """SGLang 0.5.23's real CLI parser (``ServerArgs.add_cli_args``)."""
    from sglang.srt.server_args import ServerArgs

    parser = argparse.ArgumentParser()
    ServerArgs.add_cli_args(parser)
    return parser


def parse(parser: argparse.ArgumentParser, argv: list[str]) -> tuple[argparse.Namespace, dict]:
    ns = parser.parse_args(argv)
    return ns, json.loads(ns.hicache_storage_backend_extra_config)


def run_cli(*args: str, cwd: Path = REPO) -> subprocess.CompletedProcess:
    env = dict(os.environ)
    env["PYTHONPATH"] = str(REPO) + os.pathsep + env.get("PYTHONPATH", "")
    return subprocess.run(
        [sys.executable, "-m", "flatcake.adapter.launcher", *args],
        capture_output=True, text=True, cwd=cwd, env=env, timeout=120,
    )


# ---- rewriting, checked with SGLang's parser ----------------------------------------------------


def test_flatcake_becomes_dynamic_with_exact_extra_config(sglang_parser):
    argv = rewrite_argv(BASE + ["--hicache-storage-backend", "flatcake"])
    ns, extra = parse(sglang_parser, argv)
    assert ns.hicache_storage_backend == "dynamic"
    assert extra == {
        "backend_name": "flatcake",
        "module_path": "flatcake",
        "class_name": "FlatCakeStorage",
        "interface_v1": 1,
        "hicache_storage_pass_prefix_keys": True,
    }
    assert ns.model_path == "some/model"
    assert ns.page_size == 64
    assert ns.enable_hierarchical_cache is True


def test_other_arguments_keep_their_order_and_backend_takes_its_place():
    argv = rewrite_argv(["--model-path", "m", "--hicache-storage-backend", "flatcake", "--page-size", "64"])
    assert argv[:4] == ["--model-path", "m", "--hicache-storage-backend", "dynamic"]
    assert argv[4] == "--hicache-storage-backend-extra-config"
    assert argv[6:] == ["--page-size", "64"]


def test_user_inline_json_is_merged(sglang_parser):
    user = {"ssd.path": "/nvme/fc", "cio": {"gap_bytes": 4096}, "prefetch_threshold": 128}
    argv = rewrite_argv(
        BASE + [EXTRA, json.dumps(user), "--hicache-storage-backend", "flatcake"]
    )
    ns, extra = parse(sglang_parser, argv)
    assert ns.hicache_storage_backend == "dynamic"
    assert extra == {**user, **FLATCAKE_EXTRA}
    assert argv.count("--hicache-storage-backend-extra-config") == 1


def test_flatcake_config_becomes_an_absolute_path(sglang_parser, tmp_path, monkeypatch):
    (tmp_path / "my.yaml").write_text("ssd:\n  max_files: 8\n")
    monkeypatch.chdir(tmp_path)
    argv = rewrite_argv(BASE + ["--hicache-storage-backend", "flatcake", "--flatcake-config", "my.yaml"])
    assert "--flatcake-config" not in argv  # launcher-only flag never reaches SGLang
    ns, extra = parse(sglang_parser, argv)
    assert extra["flatcake_config"] == str(tmp_path / "my.yaml")
    assert os.path.isabs(extra["flatcake_config"])


def test_equals_forms(sglang_parser, tmp_path):
    cfg = tmp_path / "fc.yaml"
    cfg.write_text("node_id: 5\n")
    argv = rewrite_argv(
        BASE
        + [
            "--hicache-storage-backend=flatcake",
            f"--flatcake-config={cfg}",
            '--hicache-storage-backend-extra-config={"ssd.path": "/x=y"}',
        ]
    )
    ns, extra = parse(sglang_parser, argv)
    assert ns.hicache_storage_backend == "dynamic"
    assert extra == {**FLATCAKE_EXTRA, "ssd.path": "/x=y", "flatcake_config": str(cfg)}


def test_at_file_json(sglang_parser, tmp_path):
    f = tmp_path / "extra.json"
    f.write_text(json.dumps({"cio.io_workers": 8, "prefetch_timeout_base": 2}))
    argv = rewrite_argv(BASE + FC + [EXTRA, f"@{f}"])
    ns, extra = parse(sglang_parser, argv)
    assert extra == {**FLATCAKE_EXTRA, "cio.io_workers": 8, "prefetch_timeout_base": 2}


def test_at_file_yaml_with_equals_form(sglang_parser, tmp_path):
    f = tmp_path / "extra.yaml"
    f.write_text("ssd:\n  path: /nvme/y\nnode_id: 3\n")
    argv = rewrite_argv(BASE + FC + [f"{EXTRA}=@{f}"])
    ns, extra = parse(sglang_parser, argv)
    assert extra == {**FLATCAKE_EXTRA, "ssd": {"path": "/nvme/y"}, "node_id": 3}


def test_user_repeating_a_launcher_key_with_the_same_value_is_fine():
    argv = rewrite_argv(
        ["--hicache-storage-backend", "flatcake", "--hicache-storage-backend-extra-config", '{"interface_v1": 1}']
    )
    assert json.loads(argv[3]) == FLATCAKE_EXTRA


def test_last_backend_flag_wins_like_argparse(sglang_parser):
    argv = rewrite_argv(BASE + ["--hicache-storage-backend", "file", "--hicache-storage-backend", "flatcake"])
    ns, extra = parse(sglang_parser, argv)
    assert ns.hicache_storage_backend == "dynamic" and extra == FLATCAKE_EXTRA
    assert argv.count("--hicache-storage-backend") == 1


# ---- other backends pass through ---------------------------------------------------------------


@pytest.mark.parametrize(
    "args",
    [
        ["--hicache-storage-backend", "file", EXTRA, '{"bogus": 1}'],
        ["--hicache-storage-backend=mooncake", EXTRA + "=@/does/not/exist.json"],
        ["--hicache-storage-backend", "dynamic", EXTRA, '{"backend_name": "x"}'],
        ["--hicache-storage-backend", "file", EXTRA],  # SGLang reports the missing value
        ["--hicache-storage-backend"],
        [],
    ],
)
def test_non_flatcake_backend_is_left_alone(args):
    assert rewrite_argv(BASE + args) == BASE + args


def test_non_flatcake_backend_dry_run_prints_argv_unchanged(capsys):
    args = BASE + ["--hicache-storage-backend", "file"]
    assert main(["--dry-run", *args]) == 0
    assert json.loads(capsys.readouterr().out) == args


# ---- errors: exit 2, field named, before SGLang runs ---------------------------------------------


@pytest.fixture
def no_sglang(monkeypatch):
    calls = []
    monkeypatch.setattr(launcher.runpy, "run_module", lambda *a, **k: calls.append((a, k)))
    return calls


def test_bad_key_exits_2_naming_the_field(capsys, no_sglang):
    rc = main(BASE + FC + [EXTRA, '{"ssd.bogus": 1}'])
    err = capsys.readouterr().err
    assert rc == 2
    assert "ssd.bogus: unknown key" in err
    assert no_sglang == []


def test_bad_value_exits_2_naming_the_field(capsys, no_sglang):
    rc = main(BASE + ["--hicache-storage-backend=flatcake", EXTRA + '={"ssd.file_bytes": 4097}'])
    err = capsys.readouterr().err
    assert rc == 2
    assert "ssd.file_bytes" in err and "multiple of 4096" in err
    assert no_sglang == []


def test_bad_key_in_flatcake_config_file_exits_2(tmp_path, capsys, no_sglang):
    cfg = tmp_path / "bad.yaml"
    cfg.write_text("cio:\n  engine: spdk\n")
    rc = main(BASE + FC + ["--flatcake-config", str(cfg)])
    assert rc == 2
    assert "cio.engine" in capsys.readouterr().err
    assert no_sglang == []


def test_missing_flatcake_config_file_exits_2(tmp_path, capsys):
    rc = main(["--dry-run", *FC, "--flatcake-config", str(tmp_path / "nope.yaml")])
    assert rc == 2
    assert "flatcake_config: file not found" in capsys.readouterr().err


@pytest.mark.parametrize(
    "args, needle",
    [
        (FC + [EXTRA, "{not json"], "not valid"),
        (FC + [EXTRA, "[1, 2]"], "must hold a mapping"),
        (FC + [EXTRA, "@/no/such.json"], "cannot read"),
        (FC + [EXTRA, "@x.ini"], "unsupported config file"),
        (FC + [EXTRA], "expected a value"),
        (FC + [EXTRA, '{"class_name": "Other"}'], "class_name='Other' conflicts"),
        (FC + [EXTRA, '{"interface_v1": 0}'], "interface_v1=0 conflicts"),
        (["--hicache-storage-backend", "file", "--flatcake-config", "x.yaml"], "--flatcake-config needs"),
        (["--flatcake-config", "x.yaml"], "--flatcake-config needs"),
    ],
)
def test_launcher_argument_errors_exit_2(args, needle, capsys, no_sglang):
    assert main(BASE + args) == 2
    err = capsys.readouterr().err
    assert err.startswith("flatcake-sglang: error: ")
    assert needle in err
    assert no_sglang == []


def test_conflicting_flatcake_config_sources_exit_2(tmp_path, capsys):
    a, b = tmp_path / "a.yaml", tmp_path / "b.yaml"
    a.write_text("{}\n")
    b.write_text("{}\n")
    rc = main(
        ["--dry-run", "--hicache-storage-backend", "flatcake", "--flatcake-config", str(a),
         "--hicache-storage-backend-extra-config", json.dumps({"flatcake_config": str(b)})]
    )
    assert rc == 2
    assert "conflicts with flatcake_config" in capsys.readouterr().err


# ---- launching ----------------------------------------------------------------------------------


def test_main_runs_sglang_launch_server_with_rewritten_argv(no_sglang, monkeypatch):
    seen = {}

    def fake_run_module(name, **kwargs):
        seen["argv"] = list(sys.argv)
        seen["name"], seen["kwargs"] = name, kwargs

    monkeypatch.setattr(launcher.runpy, "run_module", fake_run_module)
    monkeypatch.setattr(sys, "argv", ["flatcake-sglang"])
    monkeypatch.setenv("FLATCAKE_PLUGIN", "off")  # inherited; the launcher enables the plugin
    assert main(BASE + ["--hicache-storage-backend", "flatcake"]) == 0
    assert seen["name"] == "sglang.launch_server"
    assert seen["kwargs"]["run_name"] == "__main__"
    assert seen["argv"][1:] == rewrite_argv(BASE + FC) + ["--hicache-host-memory-mode", "buffer_only"]
    assert os.environ["FLATCAKE_PLUGIN"] == "on"


# ---- serving defaults: buffer_only host memory and the FC-MAS plugin --------------------------


@pytest.mark.parametrize("args, mode", [
    ([], "buffer_only"),
    (["--hicache-host-memory-mode", "cache"], "cache"),
    (["--hicache-host-memory-mode=cache"], "cache"),
    (["--no-buffer-only"], "cache"),  # SGLang's default
    (["--disaggregation-mode", "decode"], "cache"),  # SGLang refuses buffer_only on decode
    (["--disaggregation-mode", "prefill"], "buffer_only"),
    (["--hicache-host-memory-m", "cache"], "cache"),  # SGLang's parser takes unique prefixes
    (["--disaggregation-mo", "decode"], "cache"),
    (["--dcp-size", "2"], "cache"),  # no buffer_only with DCP and L3
    (["--enable-lmcache"], "cache"),  # not the unified radix tree
    (["--enable-flexkv"], "cache"),
    (["--radix-cache-backend", "x"], "cache"),
])
def test_host_memory_mode_default_is_buffer_only(args, mode, sglang_parser, capsys):
    assert main(["--dry-run", *BASE, *FC, *args]) == 0
    out, err = capsys.readouterr()
    ns = sglang_parser.parse_args(json.loads(out))
    assert ns.hicache_host_memory_mode == mode
    assert ("buffer_only (FlatCake's DRAM medium" in err) == (mode == "buffer_only")


@pytest.mark.parametrize("yaml_text, mode", [
    ("disaggregation-mode: decode\n", "cache"),
    ("hicache-host-memory-mode: cache\n", "cache"),
    ("page-size: 64\n", "buffer_only"),
])
def test_sglangs_config_file_is_read_like_sglang_reads_it(yaml_text, mode, sglang_parser, tmp_path, capsys):
    from sglang.srt.utils.server_args_config_parser import ConfigArgumentMerger

    cfg = tmp_path / "server.yaml"
    cfg.write_text(yaml_text)
    assert main(["--dry-run", *BASE, *FC, "--config", str(cfg)]) == 0
    argv = json.loads(capsys.readouterr().out)
    ns = sglang_parser.parse_args(ConfigArgumentMerger(sglang_parser).merge_config_with_args(argv))
    assert ns.hicache_host_memory_mode == mode


@pytest.mark.parametrize("given, expected", [
    (None, None),
    ("flatcake", None),
    ("other_plugin", "other_plugin,flatcake"),
    ("a, b", "a,b,flatcake"),
])
def test_plugin_is_enabled_and_added_to_an_sglang_plugins_whitelist(given, expected):
    env = {} if given is None else {"SGLANG_PLUGINS": given}
    changes = launcher.plugin_environment(env, enabled=True)
    assert changes.get("FLATCAKE_PLUGIN") == "on"
    assert changes.get("SGLANG_PLUGINS") == expected


def test_no_flatcake_plugin_turns_it_off(monkeypatch, capsys):
    assert launcher.plugin_environment({"SGLANG_PLUGINS": "x"}, enabled=False) == {"FLATCAKE_PLUGIN": "off"}
    assert main(["--dry-run", "--no-flatcake-plugin", *BASE, *FC]) == 0
    assert "environment FLATCAKE_PLUGIN=off" in capsys.readouterr().err


def test_plugin_entry_point_is_installed():
    if not (Path(sys.executable).parent / "flatcake-sglang").exists():
        pytest.skip("FlatCake is not pip-installed in this environment")
    assert launcher.plugin_installed()


@pytest.mark.parametrize("flag", ["--no-buffer-only", "--no-flatcake-plugin"])
def test_flatcake_switches_need_the_flatcake_backend(flag, capsys):
    assert main(["--dry-run", flag, *BASE, "--hicache-storage-backend", "file"]) == 2
    assert "need --hicache-storage-backend flatcake" in capsys.readouterr().err
    assert main(["--dry-run", f"{flag}=1", *BASE, *FC]) == 2


def test_main_reads_sys_argv_by_default(monkeypatch, capsys):
    monkeypatch.setattr(sys, "argv", ["flatcake-sglang", "--dry-run", "--hicache-storage-backend", "flatcake"])
    assert main() == 0
    out = json.loads(capsys.readouterr().out)
    assert out[:2] == ["--hicache-storage-backend", "dynamic"]


# ---- the real command, in a subprocess ----------------------------------------------------------


def test_dry_run_subprocess_prints_json_array_sglang_accepts(sglang_parser, tmp_path):
    cfg = tmp_path / "fc.yaml"
    cfg.write_text("ssd:\n  path: /nvme/z\n")
    proc = run_cli("--dry-run", *BASE, "--hicache-storage-backend", "flatcake", "--flatcake-config", str(cfg))
    assert proc.returncode == 0, proc.stderr
    argv = json.loads(proc.stdout)
    assert isinstance(argv, list) and all(isinstance(a, str) for a in argv)
    ns, extra = parse(sglang_parser, argv)
    assert ns.hicache_storage_backend == "dynamic"
    assert extra == {**FLATCAKE_EXTRA, "flatcake_config": str(cfg)}


def test_subprocess_bad_key_exits_2_naming_field():
    proc = run_cli("--dry-run", "--hicache-storage-backend", "flatcake",
                   "--hicache-storage-backend-extra-config", '{"ssd": {"bogus": 1}}')
    assert proc.returncode == 2
    assert "ssd.bogus: unknown key" in proc.stderr
    assert proc.stdout == ""


def test_console_script_is_installed_and_works():
    script = Path(sys.executable).parent / "flatcake-sglang"
    if not script.exists():
        pytest.skip("flatcake-sglang console script not installed in this environment")
    proc = subprocess.run([str(script), "--dry-run", "--hicache-storage-backend", "flatcake"],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert json.loads(proc.stdout)[:2] == ["--hicache-storage-backend", "dynamic"]


def test_dry_run_with_a_value_is_refused_not_launched(capsys):
    assert main(["--dry-run=1", *BASE, *FC]) == 2
    assert "--dry-run takes no value" in capsys.readouterr().err
