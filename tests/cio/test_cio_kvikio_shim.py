"""The kvikio engine end to end on CPU, through the TEST-ONLY fake libcuda shim (tests/shim).

kvikio needs ``libcuda.so.1`` for any transfer, even into host memory; the shim answers
"not initialised", which kvikio reads as "host memory". It is loaded only into a subprocess
(via LD_LIBRARY_PATH), never into the test process or the package.
"""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent / "shim"))
import libcuda_shim as loader  # noqa: E402

SCRIPT = r"""
import json, os, sys, logging
import torch
from cio_util import LAYERS, extent_chunks, kv_bytes, make_pool, path_fn, reference, subset, write_extent
from flatcake.cio import RestoreEngine
from flatcake.config import CioConfig

d = sys.argv[1]
N = 16
out = {}
pool, lay = make_pool("mha", "page_first", pages=2 * N)
cb = lay.geometry.chunk_bytes
data = write_extent(os.path.join(d, "f0"), N, LAYERS, cb, seed=31, base=300)
chunks = extent_chunks(data, 0, N, LAYERS, cb, base=300, pages=[2 * i for i in range(N)])
# page 3 of layer 1 comes from a missing file
chunks.file_index[(chunks.tag == 3) & (chunks.layer == 1)] = 5
eng = RestoreEngine(CioConfig(engine="kvikio", io_workers=2, staging_bytes=32768), path_fn(d), direct_io=True, chunk_bytes=cb,
                    max_pages_per_restore=N)
out["engine"] = eng.engine_name
rep = eng.restore(chunks, lay)
out["failed"] = sorted(rep.failed_tags)
out["merged_reads"] = rep.merged_reads
out["equal"] = bool(torch.equal(kv_bytes(pool), reference("mha", "page_first", 2 * N, data, subset(chunks, chunks.file_index == 0))))
# truncate behind the engine: layer 2 is cut after 5 pages and a bit
os.truncate(os.path.join(d, "f0"), 300 + (2 * N + 5) * cb + 7)
pool2, lay2 = make_pool("mha", "page_first", pages=2 * N)
ok = subset(chunks, chunks.file_index == 0)
rep2 = eng.restore(ok, lay2)
out["failed_truncated"] = sorted(rep2.failed_tags)
exp2 = reference("mha", "page_first", 2 * N, data, subset(ok, (ok.layer < 2) | (ok.tag < 5)))
out["equal_truncated"] = bool(torch.equal(kv_bytes(pool2), exp2))
eng.close()
print("RESULT " + json.dumps(out))
"""


def test_kvikio_engine_restores_through_the_fake_driver_shim(tmp_path):
    reason = loader.skip_reason()
    if reason:
        pytest.skip(reason)
    shim = loader.build_shim(tmp_path / "shim")
    data_dir = tmp_path / "data"
    data_dir.mkdir()
    env = loader.shim_env(shim)
    env["PYTHONPATH"] = os.pathsep.join([str(HERE), env.get("PYTHONPATH", "")])
    proc = subprocess.run([sys.executable, "-c", SCRIPT, str(data_dir)], env=env, capture_output=True,
                          text=True, timeout=120, cwd=tmp_path)
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")]
    assert proc.returncode == 0 and lines, proc.stderr[-3000:]
    res = json.loads(lines[-1][len("RESULT "):])
    assert res["engine"] == "kvikio"
    assert res["failed"] == [3] and res["equal"] is True
    assert res["merged_reads"] == 2  # file 0: one coalesced read; file 5: one
    assert res["failed_truncated"] == list(range(5, 16)) and res["equal_truncated"] is True


def test_shim_is_not_visible_to_the_test_process():
    from flatcake.cio.kvikio_engine import real_cuda_driver

    # the shim's cuInit answers CUDA_ERROR_NO_DEVICE, so even a leaked shim is never "real"
    assert "fake" in loader.SOURCE.read_text()
    if loader.real_libcuda_present():
        pytest.skip("a real driver is present")
    assert real_cuda_driver() is False
