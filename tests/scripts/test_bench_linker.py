"""The direct linker's load path as ``scripts/gpu_check.py`` section 8 and ``scripts/bench_linker.py``
measure it (``scripts/linker_restore.py``), at a tiny size on the CPU: bit-exact per layout, every
layer landed, the JSON schema, nothing left on disk. No timed assertions (times only positive and
ordered: layer 0 usable no later than the whole restore)."""

from __future__ import annotations

import importlib
import json
import os
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "scripts"))
restore = importlib.import_module("linker_restore")
bench = importlib.import_module("bench_linker")


@pytest.mark.parametrize("kind, page_bytes", [("mha", 16 * 2 * 2 * 16 * 2 * 3), ("mla", 16 * 1 * 24 * 2 * 3)])
def test_the_linker_load_lands_every_layer_bit_exact_into_a_stand_in_device_pool(kind, page_bytes, tmp_path):
    r = restore.measure(kind, str(tmp_path), device="cpu", pages=5, page_size=16, layers=3, heads=2,
                        head_dim=16 if kind == "mha" else 24)
    assert (r.kind, r.pages, r.page_size, r.layers) == (kind, 5, 16, 3)
    assert r.bytes == 5 * page_bytes  # MHA: K and V of 2 heads x 16 bf16 per token per layer; MLA: one 24-wide latent
    assert (r.stored_pages, r.landed_pages, r.bit_exact) == (5, 5, True)
    assert 0 < r.t_layer0_s <= r.t_total_s
    assert os.listdir(tmp_path) == []  # the pool directory is removed


def test_gpu_check_linker_section_in_the_dry_run_reports_both_layouts(tmp_path):
    gpu_check = importlib.import_module("gpu_check")
    out = gpu_check.linker_check("cpu", str(tmp_path), dry=True)
    assert out["ok"] is True and out["import"] == "flatcake.linker"
    for kind in ("mha", "mla"):
        assert (out[kind]["pages"], out[kind]["layers"], out[kind]["bit_exact"]) == (8, 4, True)


def test_bench_linker_writes_one_run_per_page_size_and_layout(tmp_path, capsys):
    out = tmp_path / "linker.json"
    assert bench.main(["--page-sizes", "16", "32", "--prefix-tokens", "64", "--layers", "2", "--heads", "2",
                       "--head-dim", "16", "--repeat", "1", "--workdir", str(tmp_path / "w"), "--out", str(out)]) == 0
    res = json.loads(out.read_text())
    assert json.loads(capsys.readouterr().out) == res
    assert [(r["page_size"], r["kind"], r["pages"]) for r in res["runs"]] == [
        (16, "mha", 4), (16, "mla", 4), (32, "mha", 2), (32, "mla", 2)]
    assert all(r["all_bit_exact"] and r["landed_pages"] == r["pages"] for r in res["runs"])
    assert all(r["repeats"] == [{k: r[k] for k in ("t_layer0_s", "t_total_s", "gb_per_s", "bit_exact")}]
               for r in res["runs"])  # one repeat: every run reported, and it is the median
    assert os.listdir(tmp_path / "w") == []
