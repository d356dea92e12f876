"""The data-path benchmarks' plumbing at tiny sizes: argument parsing (sweep cells, defaults,
refusals), the ``--json`` schemas the issue fixes, the summary arithmetic, and that every run
removes its files. No timed assertions: throughput values are only checked to be positive."""

from __future__ import annotations

import importlib
import json
import sys
from pathlib import Path

import pytest

SCRIPTS = Path(__file__).resolve().parents[2] / "scripts"
sys.path.insert(0, str(SCRIPTS))

bench_restore = importlib.import_module("bench_restore")
bench_common = importlib.import_module("bench_common")


def test_restore_sweep_expands_profiles_page_sizes_and_layouts():
    a = bench_restore.parse_args(["--sweep"])
    assert a.profiles == ["llama3.2-1b", "deepseek-v2-lite"]
    assert a.page_sizes == [1, 16, 64, 256]
    assert a.layouts == ["layer_first", "page_first", "page_first_direct"]
    assert len(a.cells) == 24 and a.cells[0] == ("llama3.2-1b", 1, "layer_first")
    assert a.tokens == bench_restore.SWEEP_TOKENS
    one = bench_restore.parse_args([])
    assert one.cells == [("llama3.2-1b", None, "page_first")] and one.tokens == 32768
    lists = bench_restore.parse_args(["--page-size", "1,16", "--layout", "page_first", "--systems", "scattered"])
    assert lists.cells == [("llama3.2-1b", 1, "page_first"), ("llama3.2-1b", 16, "page_first")]
    assert lists.names == ["scattered", "flatcake", "sequential"] and lists.tokens == bench_restore.SWEEP_TOKENS


@pytest.mark.parametrize("argv", [["--page-size", "0"], ["--page-size", "x"], ["--profile", "gpt-5"],
                                  ["--layout", "page_first_kv_split"], ["--systems", "mooncake"],
                                  ["--tokens", "8", "--page-size", "16"]])
def test_restore_refuses_bad_arguments(argv):
    with pytest.raises(SystemExit) as e:
        bench_restore.parse_args(argv)
    assert e.value.code == 2


def test_table_row_meets_targets_only_when_all_three_hold():
    cell = {"profile": "p", "attention": "mha", "page_size": 16, "layout": "page_first", "page_bytes": 4096,
            "systems": {"flatcake": {"gb_per_s": 1.0}}, "ratio_to_sequential": {"flatcake": 0.5},
            "ratio_to_fio": {"flatcake": 0.9}, "fio_read": {"gb_per_s": 1.1},
            "ratio_to_best_pagewise": 1.1, "best_pagewise": "scattered",
            "cpu_s_per_gb": {"flatcake": 0.2, "scattered": 0.3}}
    row = bench_restore.table_row(cell)
    assert row["meets_targets"] is True and row["best_pagewise_cpu_s_per_gb"] == 0.3
    assert bench_restore.table_row({**cell, "cpu_s_per_gb": {"flatcake": 0.4, "scattered": 0.3}})["meets_targets"] is False
    assert bench_restore.table_row({**cell, "ratio_to_best_pagewise": 0.99})["meets_targets"] is False
    assert bench_restore.table_row({**cell, "ratio_to_fio": {"flatcake": 0.84}})["meets_targets"] is False
    passes = [{"scattered": {"gb_per_s": 1.0}, "scattered-layerwise": {"gb_per_s": 2.0}}]
    assert bench_restore.best_pagewise(passes[0]) == "scattered-layerwise"


def _left(tmp_path):
    return sorted(str(p.relative_to(tmp_path)) for p in tmp_path.rglob("*") if p.name != "out.json")


def test_restore_single_cell_json_keeps_its_fields_and_removes_its_files(tmp_path):
    out = tmp_path / "out.json"
    assert bench_restore.main(["--tokens", "64", "--page-size", "16", "--passes", "1", "--warmup", "0",
                               "--io-workers", "2", "--dir", str(tmp_path), "--json", str(out)]) == 0
    res = json.loads(out.read_text())
    assert set(bench_restore.SYSTEMS) == set(res["systems"])
    for name, s in res["systems"].items():
        assert set(s) == {"gb_per_s", "read_ops", "cpu_s", "wall_s"} and s["gb_per_s"] > 0, name
    assert (res["tokens"], res["bytes"], res["page_bytes"], res["layers"]) == (64, 4 * 524288, 524288, 16)
    assert res["ratio_to_sequential"]["sequential"] == 1.0
    best = res["best_pagewise"]
    p = res["passes"][0]
    assert best in bench_restore.PAGEWISE
    assert res["ratio_to_best_pagewise"] == pytest.approx(p["flatcake"]["gb_per_s"] / p[best]["gb_per_s"])
    assert res["speedup_vs_hicache_file"] > 0
    # 4 pages x 16 layers: one read per (layer, page) chunk for the layer-wise baseline
    assert (p["scattered"]["read_ops"], p["scattered-layerwise"]["read_ops"]) == (4, 64)
    assert _left(tmp_path) == []


def test_restore_sweep_runs_every_cell_mha_and_mla(tmp_path):
    out = tmp_path / "out.json"
    assert bench_restore.main(["--profile", "llama3.2-1b,deepseek-v2-lite", "--page-size", "1,16",
                               "--layout", "page_first_direct", "--tokens", "32", "--passes", "1", "--warmup", "0",
                               "--io-workers", "2", "--systems", "scattered,scattered-layerwise",
                               "--dir", str(tmp_path), "--json", str(out)]) == 0
    res = json.loads(out.read_text())
    cells = [(c["profile"], c["attention"], c["page_size"], c["layout"]) for c in res["cells"]]
    assert cells == [("llama3.2-1b", "mha", 1, "page_first_direct"), ("llama3.2-1b", "mha", 16, "page_first_direct"),
                     ("deepseek-v2-lite", "mla", 1, "page_first_direct"),
                     ("deepseek-v2-lite", "mla", 16, "page_first_direct")]
    assert [r["page_bytes"] for r in res["table"]] == [32768, 524288, 31104, 497664]
    assert all(r["ratio_to_best_pagewise"] > 0 for r in res["table"])
    assert _left(tmp_path) == []


# bench_write / bench_gil / bench_mas: tests/scripts/test_bench_write_gil_mas.py


def test_percentile_is_nearest_rank():
    vals = list(range(1, 101))
    assert bench_common.percentile(vals, 99) == 99.0
    assert bench_common.percentile(vals, 50) == 50.0
    assert bench_common.percentile([3.0], 99) == 3.0
    assert bench_common.percentile([], 99) == 0.0
