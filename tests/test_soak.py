"""scripts/soak.py end to end, briefly: its JSON has every field and the invariants hold."""

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_a_short_soak_with_a_restart_verifies_every_byte_and_stays_within_bounds(tmp_path):
    out = tmp_path / "soak.json"
    proc = subprocess.run([sys.executable, str(ROOT / "scripts" / "soak.py"), "--seconds", "6", "--restarts", "2",
                           "--threads", "2", "--dir", str(tmp_path), "--json", str(out)],
                          capture_output=True, text=True, timeout=180)
    assert proc.returncode == 0, proc.stderr[-3000:]
    r = json.loads(out.read_text())
    assert set(r) >= {"seconds", "ops", "gets", "puts", "faults_injected", "restarts", "verify_failures",
                      "exceptions_escaped", "pages_served_after_restart", "max_open_fds", "max_bytes_on_disk",
                      "capacity_bytes"}
    assert (r["verify_failures"], r["exceptions_escaped"], r["restarts"]) == (0, 0, 2)
    assert r["puts"] > 0 and r["gets"] > 0 and r["pages_served_after_restart"] > 0
    assert 0 < r["max_bytes_on_disk"] <= r["capacity_bytes"] and r["max_open_fds"] < 100
    assert [p.name for p in tmp_path.iterdir()] == ["soak.json"]  # no storage files left behind
