"""The FC-CIO scatter kernel (paper §3.3): Triton (interpreter on CPU) bit-equal to torch.

The Triton interpreter must be enabled before Triton is first imported. The Makefile sets
``TRITON_INTERPRET=1`` for the whole run; when it is not set, the cases run in one subprocess
that sets it first.
"""

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from flatcake.kernels import scatter as sc

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
import scatter_cases  # noqa: E402


@pytest.fixture(scope="module")
def results():
    if sc.triton_available(torch.device("cpu")):
        return scatter_cases.run_all()
    if not sc.HAVE_TRITON:
        pytest.skip("triton is not installed")
    env = dict(os.environ, TRITON_INTERPRET="1")
    proc = subprocess.run([sys.executable, str(HERE / "scatter_cases.py")], env=env, capture_output=True,
                          text=True, timeout=300)
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")]
    assert proc.returncode == 0 and lines, proc.stderr[-3000:]
    return json.loads(lines[-1][len("RESULT "):])


@pytest.mark.parametrize("case", scatter_cases.CASES, ids=scatter_cases.case_id)
def test_torch_and_triton_scatter_are_bit_equal_to_the_reference(results, case):
    r = results[scatter_cases.case_id(case)]
    assert r["reference_eq_loop"] is True
    assert r["torch_eq_reference"] is True
    assert r["triton_eq_reference"] is True
    # 7 chunks written (two share page 0 on different layers); ~1/256 of random bytes are 0
    assert 7 * r["chunk_bytes"] * 0.95 < r["written"] <= 7 * r["chunk_bytes"] < r["bytes_total"]


def test_auto_dispatch_picks_triton_on_cuda_and_torch_on_cpu():
    assert sc.resolve_impl("auto", torch.device("cpu")) == "torch"
    assert sc.resolve_impl("auto", torch.device("cuda", 0)) == ("triton" if sc.HAVE_TRITON else "torch")
    assert sc.resolve_impl("torch", torch.device("cuda", 0)) == "torch"
    with pytest.raises(ValueError, match="unknown scatter impl"):
        sc.resolve_impl("cuda", torch.device("cpu"))


def test_triton_on_cpu_without_interpreter_is_a_clear_error(monkeypatch):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    staging = torch.zeros(64, dtype=torch.uint8)
    with pytest.raises(RuntimeError, match="TRITON_INTERPRET"):
        sc.scatter_chunks(staging, torch.tensor([0]), None, torch.tensor([0]), torch.tensor([0]), impl="triton")


def test_word_width_is_the_widest_dividing_every_offset():
    assert sc.word_width([64, 128, 4096]) == (8, torch.int64)
    assert sc.word_width([64, 12, 4096]) == (4, torch.int32)
    assert sc.word_width([64, 6]) == (2, torch.int16)
    assert sc.word_width([64, 3]) == (1, torch.uint8)
    assert sc.word_width([64], (np.array([8, 16, 4096], dtype=np.int64),)) == (8, torch.int64)
    assert sc.word_width([64], (np.array([8, 20], dtype=np.int64),)) == (4, torch.int32)
