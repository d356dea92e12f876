"""bench_write_floor at a tiny size (issue 24 item 1): the ``--json`` schema, every page put
stored in both modes, every round of the ``readers`` mode written because the deferral bound made
it urgent (a restore is always queued), and nothing left behind. No timed assertions: rates are
only checked for sign, deferrals against the bound's lower side (no round is written before it)."""

from __future__ import annotations

import importlib
import json
import sys
from pathlib import Path

SCRIPTS = Path(__file__).resolve().parents[2] / "scripts"
sys.path.insert(0, str(SCRIPTS))

bench_write_floor = importlib.import_module("bench_write_floor")

MODE_KEYS = {"write_bytes", "pages_put", "pages_stored", "drained", "write_s", "write_gb_per_s", "drain_gb_per_s",
             "restore_gb_per_s_during_write", "restore_gb_per_s_alone", "restore_failures", "rounds", "deferral_p50_s",
             "deferral_p99_s", "deferral_max_s", "write_urgent_rounds", "put_failures", "write_backlog_full_failures",
             "write_backlog_dropped_rounds", "ssd_write_bytes", "backlog_limit_bytes", "write_defer_max_s",
             "write_urgent_fraction"}


def test_floor_json_both_modes_every_page_stored_and_urgent_rounds_beside_the_restores(tmp_path):
    out = tmp_path / "out.json"
    assert bench_write_floor.main(["--write-mib", "2", "--read-mib", "1", "--read-alone-s", "0.1", "--repeats", "2",
                                   "--dir", str(tmp_path), "--json", str(out)]) == 0
    res = json.loads(out.read_text())
    assert set(res) == {"config", "runs", "modes", "floor_ratio", "drain_floor_ratio"}
    assert res["config"]["repeats"] == 2 and len(res["runs"]) == 2
    ratios = sorted(r["floor_ratio"] for r in res["runs"])
    assert res["floor_ratio"] == sum(ratios) / 2  # the median of two
    assert res["modes"] == min(res["runs"], key=lambda r: r["floor_ratio"])["modes"]  # the lower middle run
    for run in res["runs"]:
        assert run["floor_ratio"] == run["modes"]["readers"]["write_gb_per_s"] / run["modes"]["no_readers"]["write_gb_per_s"]
    assert set(res["modes"]) == {"no_readers", "readers"}
    for name, m in res["modes"].items():
        assert set(m) == MODE_KEYS
        assert m["pages_stored"] == m["pages_put"] == 4 and m["drained"] and m["put_failures"] == 0
        assert m["write_bytes"] == 4 * 524288 and m["ssd_write_bytes"] > m["write_bytes"]  # + headers and records
        assert m["write_gb_per_s"] > 0 and m["rounds"] >= 1 and m["restore_failures"] == 0
    r = res["modes"]["readers"]
    assert r["write_urgent_rounds"] == r["rounds"] and r["restore_gb_per_s_during_write"] > 0
    assert r["deferral_p50_s"] >= r["write_defer_max_s"] == 1.0  # held until the bound, then written
    assert res["modes"]["no_readers"]["write_urgent_rounds"] == 0
    assert sorted(str(p.relative_to(tmp_path)) for p in tmp_path.rglob("*") if p.suffix != ".json") == []
