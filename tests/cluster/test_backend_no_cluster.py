"""A FlatCake without a ``cluster`` section never imports :mod:`flatcake.cluster` and behaves as a
single node (issue 12: the cluster is optional). Runs in a fresh interpreter so that no other
test's imports count; needs no namespace, etcd or Mooncake."""

from __future__ import annotations

import json
import subprocess
import sys


BODY = r"""
import json, shutil, sys, tempfile
from flatcake.adapter.host_pool import MHAHostPoolDouble
from flatcake.adapter.storage import FlatCakeStorage
from flatcake.config import FLATCAKE_EXTRA
from flatcake.replay.systems import storage_config
import torch

d = tempfile.mkdtemp(prefix="fc-nocluster-")
try:
    pool = MHAHostPoolDouble(size=64, page_size=4, layer_num=3, head_num=2, head_dim=16, dtype=torch.bfloat16)
    be = FlatCakeStorage(storage_config({**FLATCAKE_EXTRA, "ssd.path": d, "ssd.file_bytes": 8 << 20,
                                         "ssd.max_files": 2, "dram.capacity_bytes": 0}))
    be.register_mem_pool_host(pool)
    keys = [f"nc{i:03d}".ljust(64, "k") for i in range(4)]
    g = torch.Generator().manual_seed(7)
    raw = torch.randint(0, 256, (pool.kv_buffer.numel() * 2,), dtype=torch.uint8, generator=g)
    want = raw.view(torch.bfloat16).view(pool.kv_buffer.shape)
    pool.kv_buffer.copy_(want)
    idx = torch.arange(16, dtype=torch.int64)
    ok_set = be.batch_set_v1(keys, idx)
    be.store.flush_writes()
    pool.kv_buffer.zero_()
    n = be.batch_exists(keys + ["absent".ljust(64, "k")])
    ok_get = be.batch_get_v1(keys, idx)
    same = bool(torch.equal(pool.kv_buffer[:, :16].view(torch.uint8), want[:, :16].view(torch.uint8)))
    stats = be.flatcake_stats()
    be.close()
    print(json.dumps({"set": ok_set, "exists": n, "get": ok_get, "same": same, "cluster_stats": "cluster" in stats,
                      "member": be.cluster is not None,
                      "imported": sorted(m for m in sys.modules if m.startswith("flatcake.cluster"))}))
finally:
    shutil.rmtree(d, ignore_errors=True)
"""


def test_a_config_without_cluster_never_imports_flatcake_cluster_and_serves_locally():
    out = subprocess.run([sys.executable, "-c", BODY], capture_output=True, text=True, timeout=300, check=True)
    got = json.loads(out.stdout.strip().splitlines()[-1])
    assert got == {"set": [True] * 4, "exists": 4, "get": [True] * 4, "same": True, "cluster_stats": False,
                   "member": False, "imported": []}
