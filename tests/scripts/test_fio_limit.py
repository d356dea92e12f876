"""``scripts/fio_limit.py``: the disk's limit measured by fio (issue 23, item 6) at a tiny size:
the command line it runs, the JSON it returns, and that it leaves no file behind. No timed
assertions: rates are only checked to be positive."""

from __future__ import annotations

import importlib
import os
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "scripts"))
fio_limit = importlib.import_module("fio_limit")

needs_fio = pytest.mark.skipif(fio_limit.fio_path() is None, reason="fio not installed (make fio)")


def test_command_is_odirect_libaio_qd32_whole_requests():
    cmd = fio_limit.fio_command("/x/f", "read", 4, 10 * fio_limit.MIB + 5)
    assert "--direct=1" in cmd and "--ioengine=libaio" in cmd and "--iodepth=32" in cmd
    assert "--bs=4M" in cmd and f"--size={8 * fio_limit.MIB}" in cmd and "--rw=read" in cmd
    w = fio_limit.fio_command("/x/f", "write", 16, 1)
    assert f"--size={16 * fio_limit.MIB}" in w and "--end_fsync=1" in w
    with pytest.raises(ValueError, match="rw must be"):
        fio_limit.fio_command("/x/f", "randread", 1, 1)


@needs_fio
@pytest.mark.parametrize("rw", ["read", "write"])
def test_limit_measures_every_request_size_and_removes_its_file(tmp_path, rw):
    out = fio_limit.fio_limit(str(tmp_path), 32 * fio_limit.MIB, rw, block_sizes_mib=(1, 4))
    assert "error" not in out, out
    assert sorted(out["by_bs_mib"]) == [1, 4] and all(v > 0 for v in out["by_bs_mib"].values())
    assert out["best_gb_per_s"] == max(out["by_bs_mib"].values())
    assert out["best_gb_per_s"] == out["by_bs_mib"][out["best_bs_mib"]]
    assert out["iodepth"] == 32 and out["rw"] == rw and len(out["commands"]) == 2
    assert os.listdir(tmp_path) == []
    assert fio_limit.ratio_to_fio(out["best_gb_per_s"] / 2, out) == pytest.approx(0.5)


def test_missing_fio_is_an_error_not_a_ratio(monkeypatch, tmp_path):
    monkeypatch.setattr(fio_limit, "fio_path", lambda: None)
    out = fio_limit.fio_limit(str(tmp_path), fio_limit.MIB)
    assert "fio not installed" in out["error"] and fio_limit.ratio_to_fio(1.0, out) is None
