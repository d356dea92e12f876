"""scripts/bench_mixed_io.py at a tiny size: arguments, the exact ``--json`` schema the issue
fixes, the summary arithmetic, and that a run removes every file it wrote. No timed assertions:
throughput values are only checked to be positive."""

from __future__ import annotations

import importlib
import json
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "scripts"))
bench = importlib.import_module("bench_mixed_io")


def test_arguments_defaults_and_refusals():
    a = bench.parse_args([])
    assert (a.profile, a.page_size, a.read_sessions, a.read_tokens, a.write_tokens, a.restores, a.passes) == (
        "llama3.2-1b", 16, 2, 4096, 2048, 6, 2)
    for argv in (["--restores", "0"], ["--read-tokens", "100"], ["--profile", "gpt-5"]):
        with pytest.raises(SystemExit) as e:
            bench.parse_args(argv)
        assert e.value.code == 2


def test_summary_is_medians_per_policy_and_the_read_speedup():
    runs = [{"policy": p, "read_gbps": r, "write_gbps": w, "restore_wall_s": t}
            for p, r, w, t in (("on", 2.0, 1.0, 1.0), ("off", 1.0, 2.0, 2.0), ("off", 3.0, 4.0, 4.0), ("on", 4.0, 3.0, 3.0))]
    assert bench.summarize(runs) == {"read_gbps": {"on": 3.0, "off": 2.0}, "write_gbps": {"on": 2.0, "off": 3.0},
                                     "restore_wall_s": {"on": 2.0, "off": 3.0}, "read_speedup": 1.5}


def test_a_tiny_run_writes_the_json_schema_and_leaves_no_files(tmp_path):
    pools = tmp_path / "pools"
    pools.mkdir()
    out = tmp_path / "mixed.json"
    bench.main(["--read-tokens", "32", "--write-tokens", "16", "--read-sessions", "1", "--restores", "1",
                "--passes", "1", "--gap-ms", "0", "--no-raw", "--dir", str(pools), "--json", str(out)])
    got = json.loads(out.read_text())
    assert set(got) == {"read_gbps", "write_gbps", "restore_wall_s", "read_speedup"}
    for k in ("read_gbps", "write_gbps", "restore_wall_s"):
        assert set(got[k]) == {"on", "off"} and all(v > 0 for v in got[k].values())
    assert got["read_speedup"] == pytest.approx(got["read_gbps"]["on"] / got["read_gbps"]["off"])
    assert list(pools.iterdir()) == []
