"""scripts/soak.py end to end, briefly: its JSON has every field, the invariants hold, the injected
I/O faults reach the C loops of the shipped paths, and a bad worker exit or a missing worker
report fails the run."""

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from flatcake.native import loops as native_loop

ROOT = Path(__file__).resolve().parents[1]


def load_soak():
    spec = importlib.util.spec_from_file_location("soak_script", ROOT / "scripts" / "soak.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_a_short_soak_with_a_restart_verifies_every_byte_and_stays_within_bounds(tmp_path):
    out = tmp_path / "soak.json"
    # --fault-rate 0.05: enough injected reads that the C restore sees some even on a busy machine
    proc = subprocess.run([sys.executable, str(ROOT / "scripts" / "soak.py"), "--seconds", "6", "--restarts", "2",
                           "--threads", "2", "--fault-rate", "0.05", "--dir", str(tmp_path), "--json", str(out)],
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    r = json.loads(out.read_text())
    assert set(r) >= {"seconds", "ops", "gets", "puts", "faults_injected", "restarts", "verify_failures",
                      "exceptions_escaped", "pages_served_after_restart", "max_open_fds", "max_bytes_on_disk",
                      "capacity_bytes", "workers_reporting", "faults_in_c_loops", "faults_by_caller",
                      "fault_injection", "worker_exit_codes", "failures"}
    assert (r["verify_failures"], r["exceptions_escaped"], r["restarts"], r["failures"]) == (0, 0, 2, [])
    assert r["workers_reporting"] == 3 and r["worker_exit_codes"] == [-9, -9, 0]
    assert r["puts"] > 0 and r["gets"] > 0 and r["pages_served_after_restart"] > 0
    assert 0 < r["max_bytes_on_disk"] <= r["capacity_bytes"] and r["max_open_fds"] < 100
    if r["fault_injection"].startswith("off"):
        pytest.skip(f"no I/O faults injected in the worker: {r['fault_injection']}")
    # the injected read faults reached the shipped read path: the C restore's own pread calls
    ext = os.path.basename(native_loop.extension_path())  # pread: in the extension, only the C restore calls it
    assert r["faults_by_caller"].get(ext, {}).get("pread/eio", 0) > 0
    assert r["faults_in_c_loops"] > 0 and r["faults_injected"] >= r["faults_in_c_loops"] + r["outside_faults"]
    assert [p.name for p in tmp_path.iterdir()] == ["soak.json"]  # no storage files left behind


FAKE_WORKER = """
import json, sys
run_dir, inc = sys.argv[1], sys.argv[2]
report, final, rc = {report!r}, {final!r}, {rc!r}
if report:
    open(f"{{run_dir}}/worker-{{inc}}.json", "w").write(json.dumps({{"ops": 1, "final": final}}))
print("ready", flush=True)
sys.exit(rc)
"""


@pytest.mark.parametrize("report, final, rc, reason", [
    (True, True, 3, "worker 0 (the last) exited with 3"),
    (False, False, 0, "no report from worker 0"),
    (True, False, 0, "worker 0 (the last) wrote no final report"),
])
def test_a_bad_last_worker_exit_or_a_missing_report_fails_the_soak(tmp_path, monkeypatch, capsys, report, final, rc,
                                                                   reason):
    soak = load_soak()
    code = FAKE_WORKER.format(report=report, final=final, rc=rc)
    monkeypatch.setattr(soak, "worker_command", lambda run_dir, inc, seconds, args:
                        [sys.executable, "-c", code, str(run_dir), str(inc)])
    out = tmp_path / "soak.json"
    assert soak.main(["--seconds", "1", "--restarts", "0", "--dir", str(tmp_path), "--json", str(out)]) == 1
    r = json.loads(out.read_text())
    assert reason in r["failures"] and reason in capsys.readouterr().err
    assert [p.name for p in tmp_path.iterdir()] == ["soak.json"]
