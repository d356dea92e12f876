"""The ``mooncake`` system: SGLang's MooncakeStore on the real Mooncake Store (CPU wheel), run by
the replay inside its own network namespace. The end-to-end tests need the wheel, libibverbs1,
root and iproute2 (``make venv`` and CI provide them) and skip naming what is missing."""

from __future__ import annotations

import json
import os
import subprocess

import pytest
import yaml

from flatcake.replay import mooncake
from flatcake.replay.cli import main

from replay_fixtures import mooncake_path  # noqa: F401

PAGE = 64  # tokens per page of the profiles below


def _config(tmp_path, head_dim: int, kv_heads: int = 1, replay: dict | None = None) -> str:
    # a 9 MiB DRAM budget, 8 MiB of it FlatCake's write backlog (equal capacity, docs/baselines.md)
    cfg = {"dram": {"capacity_bytes": 9 << 20}, "ssd": {"file_bytes": 4 << 20, "max_files": 32,
                                                        "write_backlog_bytes": 8 << 20},
           "model": {"name": "tiny/mha", "attention": "mha", "layers": 2, "kv_heads": kv_heads, "head_dim": head_dim,
                     "page_size": PAGE, "params": 1e6, "q_heads": 2, "q_head_dim": 32},
           "replay": {"hbm_pages": 0, "prefetch_threshold_tokens": 0, **(replay or {})}}
    path = tmp_path / "mc.yaml"
    path.write_text(yaml.safe_dump(cfg))
    return str(path)


def _leftovers() -> tuple[list, list]:
    """This process's replay namespace if still there, and ``mooncake_master`` processes outside
    every named namespace (an orphan of a deleted one); another replay running on the machine
    keeps its own namespace and master and is not counted."""
    mine = f"fc-replay-{os.getpid()}"
    ns = [line.split()[0] for line in subprocess.run(["ip", "netns", "list"], capture_output=True,
                                                     text=True).stdout.splitlines() if line.split()[:1] == [mine]]
    masters = []
    for pid in subprocess.run(["pgrep", "-f", "mooncake_master"], capture_output=True, text=True).stdout.split():
        where = subprocess.run(["ip", "netns", "identify", pid], capture_output=True, text=True).stdout.strip()
        if where in ("", mine):
            masters.append(pid)
    return ns, masters


needs_mooncake = pytest.mark.skipif(mooncake.unavailable_reason() is not None,
                                    reason=f"mooncake system unavailable: {mooncake.unavailable_reason()}")


def test_without_root_the_reason_says_so(monkeypatch):
    if mooncake.unavailable_reason() is not None and "wheel" in mooncake.unavailable_reason():
        pytest.skip(mooncake.unavailable_reason())
    monkeypatch.delenv(mooncake.NETNS_ENV, raising=False)
    monkeypatch.setattr(mooncake.os, "geteuid", lambda: 1000)
    assert "needs root" in mooncake.unavailable_reason()


def test_an_unavailable_mooncake_is_skipped_with_its_reason(tmp_path, mooncake_path, monkeypatch, capsys):
    monkeypatch.setattr(mooncake, "unavailable_reason", lambda: "no namespaces on this machine")
    out = tmp_path / "o"
    rc = main(["--trace", str(mooncake_path), "--config", _config(tmp_path, 32), "--systems", "flatcake,mooncake",
               "--out", str(out), "--no-progress"])
    assert rc == 0
    s = json.loads((out / "summary.json").read_text())
    assert list(s["systems"]) == ["flatcake"]
    assert s["skipped_systems"] == {"mooncake": "no namespaces on this machine"}
    assert "system mooncake skipped: no namespaces on this machine" in (out / "summary.md").read_text()
    assert "skipping system mooncake: no namespaces on this machine" in capsys.readouterr().err


def test_the_store_outside_a_namespace_is_refused(tmp_path, monkeypatch):
    monkeypatch.delenv(mooncake.NETNS_ENV, raising=False)
    with pytest.raises(RuntimeError, match="network namespace"):
        mooncake.MooncakeSystem(None, None, tmp_path, 1 << 20, 1 << 20)


@needs_mooncake
def test_mooncake_serves_the_same_hits_as_flatcake_bit_exact_and_leaves_nothing(tmp_path, mooncake_path):
    out = tmp_path / "o"
    rc = main(["--trace", str(mooncake_path), "--config", _config(tmp_path, 32), "--systems", "flatcake,mooncake",
               "--out", str(out), "--no-progress"])
    assert rc == 0
    s = json.loads((out / "summary.json").read_text())
    fc, mc = s["systems"]["flatcake"], s["systems"]["mooncake"]
    # 16 KiB pages: everything fits the 16 MiB DRAM segment; every reuse is a Mooncake DRAM hit
    # (47 pages: r4, exactly 512 tokens, reuses 7 of its 8 pages, as SGLang matches prompt - 1 tokens)
    assert mc["hit_tokens"]["dram"] == sum(fc["hit_tokens"][m] for m in ("dram", "backlog", "ssd")) == 47 * PAGE
    assert mc["hit_tokens"]["ssd"] == 0 and mc["verify_failures"] == 0 and mc["backend_errors"] == 0
    assert mc["written_pages"] == fc["written_pages"] > 0 and mc["failed_write_pages"] == 0
    assert not (out / mooncake.STORAGE_DIR).exists() if hasattr(mooncake, "STORAGE_DIR") else True
    assert not (out / "mooncake-ssd").exists()
    assert _leftovers() == ([], [])


@needs_mooncake
def test_a_relative_out_dir_reaches_mooncakes_client_as_an_absolute_path(tmp_path, mooncake_path, monkeypatch):
    """``--out runs/x`` (as ``scripts/measure_all.sh`` passes it): Mooncake's client refuses a
    relative storage path ("Invalid FileStorage configuration") and the whole replay exited 2
    before the fix; now every system's directory is resolved under the working directory."""
    cfg = _config(tmp_path, 32)
    monkeypatch.chdir(tmp_path)
    rc = main(["--trace", str(mooncake_path), "--config", cfg, "--systems", "flatcake,mooncake",
               "--out", "rel/o", "--no-progress"])
    assert rc == 0
    s = json.loads((tmp_path / "rel" / "o" / "summary.json").read_text())
    fc, mc = s["systems"]["flatcake"], s["systems"]["mooncake"]
    assert mc["hit_tokens"]["dram"] == sum(fc["hit_tokens"][m] for m in ("dram", "backlog", "ssd")) == 47 * PAGE
    assert mc["written_pages"] == fc["written_pages"] > 0 and mc["verify_failures"] == 0
    assert not (tmp_path / "rel" / "o" / "mooncake-ssd").exists()
    assert _leftovers() == ([], [])


@needs_mooncake
def test_past_its_dram_segment_mooncake_offloads_and_reads_back_from_ssd(tmp_path, mooncake_path):
    # 512 KiB pages: the ~40 written pages (20 MiB) exceed the 16 MiB DRAM segment; 1 MiB buckets
    # (the default 256 MB bucket would wait for more pages); served at 1 req/s so the client's
    # 1 s offload heartbeat runs during the replay
    out = tmp_path / "o"
    cfg = _config(tmp_path, 128, kv_heads=8, replay={"mooncake_extra": {"bucket_bytes": 1 << 20}})
    rc = main(["--trace", str(mooncake_path), "--config", cfg, "--systems", "mooncake", "--qps", "1",
               "--out", str(out), "--no-progress"])
    assert rc == 0
    mc = json.loads((out / "summary.json").read_text())["runs"][0]
    assert mc["verify_failures"] == 0
    assert mc["counters"]["ssd_write_bytes"] > 0  # evicted pages went to bucket files
    assert mc["delivered_hit_rate"] > 0
    assert _leftovers() == ([], [])


@pytest.mark.parametrize("extra,msg", [({"lease_ms": 5}, "unknown key"), ({"lease_ttl_ms": -1}, "lease_ttl_ms"),
                                       ({"eviction_ratio": 2}, "eviction_ratio"),
                                       ({"eviction_policy": "mru"}, "eviction_policy"),
                                       ({"heartbeat_s": 0.5}, "whole number"), ({"lease_ttl_ms": 0.5}, "whole number"),
                                       ({"lease_ttl_ms": float("nan")}, "finite"),
                                       ({"eviction_high_watermark": float("inf")}, "finite"),
                                       ({"offload_on_evict": "yes"}, "offload_on_evict")])
def test_bad_mooncake_settings_exit_2_naming_the_key(tmp_path, mooncake_path, capsys, extra, msg):
    cfg = _config(tmp_path, 32, replay={"mooncake_extra": extra})
    assert main(["--trace", str(mooncake_path), "--config", cfg, "--systems", "mooncake", "--out", str(tmp_path / "o"),
                 "--no-progress"]) == 2
    err = capsys.readouterr().err
    assert "replay.mooncake_extra" in err and msg in err
    assert not (tmp_path / "o").exists()


def test_a_bad_flag_exits_2_before_any_namespace_is_made(tmp_path, mooncake_path, monkeypatch, capsys):
    def no_namespace(argv):
        raise AssertionError("the namespace was made before the flags were checked")

    monkeypatch.setattr(mooncake, "run_in_namespace", no_namespace)
    rc = main(["--trace", str(mooncake_path), "--config", _config(tmp_path, 32), "--systems", "mooncake",
               "--qps", "0", "--out", str(tmp_path / "o"), "--no-progress"])
    assert rc == 2 and "--qps" in capsys.readouterr().err
    assert not (tmp_path / "o").exists()


@needs_mooncake
def test_sigterm_during_the_replay_removes_the_namespace_and_the_master(tmp_path, mooncake_path):
    import signal
    import sys
    import time

    out = tmp_path / "o"
    cmd = [sys.executable, "-m", "flatcake.replay.cli", "--trace", str(mooncake_path), "--config",
           _config(tmp_path, 32), "--systems", "mooncake", "--qps", "0.2", "--out", str(out), "--no-progress"]
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    name = f"fc-replay-{proc.pid}"
    try:
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:  # wait until the replay runs: its master listens in the namespace
            pids = subprocess.run(["ip", "netns", "pids", name], capture_output=True, text=True).stdout.split()
            if any("mooncake_master" in open(f"/proc/{p}/cmdline").read() for p in pids if os.path.exists(f"/proc/{p}")):
                break
            time.sleep(0.2)
        else:
            pytest.fail("the replay's master never started")
        time.sleep(1.0)  # inside the serving loop (one request every 5 s)
        proc.send_signal(signal.SIGTERM)
        proc.wait(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
    listed = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout.split()
    assert name not in listed
    masters = subprocess.run(["pgrep", "-f", "mooncake_master"], capture_output=True, text=True).stdout.split()
    orphans = [p for p in masters
               if subprocess.run(["ip", "netns", "identify", p], capture_output=True, text=True).stdout.strip() == ""]
    assert orphans == []
    assert not (out / "mooncake-ssd").exists() or not any((out / "mooncake-ssd").rglob("*.bucket"))


def test_a_replay_without_root_runs_the_others_and_says_why_mooncake_was_skipped(tmp_path, mooncake_path,
                                                                                 monkeypatch, capsys):
    # the interpreter here lives under /root (0700), so a real non-root run is not possible in this
    # image: the effective uid is what the replay checks, set to a user's
    if mooncake.unavailable_reason() is not None and "wheel" in mooncake.unavailable_reason():
        pytest.skip(mooncake.unavailable_reason())
    monkeypatch.delenv(mooncake.NETNS_ENV, raising=False)
    monkeypatch.setattr(mooncake.os, "geteuid", lambda: 1000)
    out = tmp_path / "o"
    rc = main(["--trace", str(mooncake_path), "--config", _config(tmp_path, 32), "--systems", "flatcake,mooncake",
               "--out", str(out), "--no-progress"])
    assert rc == 0
    s = json.loads((out / "summary.json").read_text())
    assert list(s["systems"]) == ["flatcake"] and s["systems"]["flatcake"]["written_pages"] > 0
    assert "needs root" in s["skipped_systems"]["mooncake"]
    assert "skipping system mooncake: creating the network namespace" in capsys.readouterr().err
    assert _leftovers() == ([], [])
