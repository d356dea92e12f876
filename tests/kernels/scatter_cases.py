"""Scatter cases shared by the kernel tests: every layout, torch vs Triton, bit for bit.

Run as a script (``TRITON_INTERPRET=1 python scatter_cases.py``) it prints one JSON line with
every case's result; the tests use that when the interpreter was not enabled before Triton was
first imported in the test process.
"""

from __future__ import annotations

import json
import os

import torch

from flatcake.adapter.host_pool import MHAHostPoolDouble, MLAHostPoolDouble
from flatcake.kernels.scatter import scatter_chunks
from flatcake.common.layout import KvPageLayout

PAGES, PAGE, LAYERS = 6, 4, 3

# (kind, layout, dtype, pattern): "aligned" chunks back to back into scattered pages, "odd" at
# 1-byte shifts (byte-wide copies), "run" back to back into consecutive pages
CASES = [
    (kind, layout, "bfloat16", pat)
    for kind in ("mha", "mla")
    for layout in ("layer_first", "page_first", "page_first_direct")
    for pat in ("aligned", "odd")
] + [
    ("mha", "page_first", "float32", "aligned"),
    ("mha", "page_first", "bfloat16", "run"),
    ("mla", "page_first_direct", "bfloat16", "run"),
    ("device_mha", "device", "bfloat16", "run"),
    ("mla", "layer_first", "float16", "odd"),
    ("device_mha", "device", "bfloat16", "aligned"),
    ("device_mha", "device", "bfloat16", "odd"),
    ("device_mla", "device", "float16", "aligned"),
]


def case_id(case) -> str:
    return "-".join(case)


def _make(kind: str, layout: str, dtype: torch.dtype):
    if kind == "mha":
        pool = MHAHostPoolDouble(PAGES * PAGE, PAGE, LAYERS, 2, 8, dtype=dtype, layout=layout)
        return pool.kv_buffer, KvPageLayout.from_host_pool(pool)
    if kind == "mla":
        pool = MLAHostPoolDouble(PAGES * PAGE, PAGE, LAYERS, 20, dtype=dtype, layout=layout)
        return pool.kv_buffer, KvPageLayout.from_host_pool(pool)
    if kind == "device_mha":
        ks = [torch.zeros(PAGES * PAGE, 2, 8, dtype=dtype) for _ in range(LAYERS)]
        vs = [torch.zeros(PAGES * PAGE, 2, 8, dtype=dtype) for _ in range(LAYERS)]
        return ks + vs, KvPageLayout.from_device_kv(ks, vs, PAGE)
    ks = [torch.zeros(PAGES * PAGE, 1, 20, dtype=dtype) for _ in range(LAYERS)]
    return ks, KvPageLayout.from_device_kv(ks, None, PAGE)


def _bytes(buf) -> torch.Tensor:
    if isinstance(buf, list):
        return torch.cat([t.reshape(-1).view(torch.uint8) for t in buf])
    return buf.view(torch.uint8).reshape(-1).clone()


def run_case(case) -> dict:
    """Scatter 7 chunks with every implementation and a per-chunk loop; compare bytes."""
    kind, layout, dtype_name, pat = case
    dtype = getattr(torch, dtype_name)
    if pat == "run":  # consecutive chunks into consecutive pages (the layer-major fast path)
        pages = torch.tensor([1, 2, 3, 4, 1, 2, 3], dtype=torch.int64)
        layers = torch.tensor([0, 0, 0, 0, 2, 2, 2], dtype=torch.int64)
    else:
        pages = torch.tensor([5, 0, 3, 1, 4, 2, 0], dtype=torch.int64)
        layers = torch.tensor([0, 1, 2, 0, 1, 2, 2], dtype=torch.int64)
    results = {}
    for impl in ("torch", "triton", "reference", "loop"):
        buf, lay = _make(kind, layout if kind in ("mha", "mla") else "", dtype)
        cb = lay.geometry.chunk_bytes
        n = int(pages.numel())
        shift = 1 if pat == "odd" else 0
        offs = torch.tensor([i * (cb + shift) + 3 * shift for i in range(n)], dtype=torch.int64)
        g = torch.Generator().manual_seed(7)
        staging = torch.randint(0, 256, (n * (cb + 1) + 8,), dtype=torch.uint8, generator=g)
        if impl == "loop":
            for i in range(n):
                o = int(offs[i])
                lay.scatter_chunks(staging[o : o + cb].view(1, -1), pages[i : i + 1], int(layers[i]))
        else:
            scatter_chunks(staging, offs, lay, pages, layers, impl=impl)
        results[impl] = _bytes(buf)
        results["cb"] = cb
    t, tr, ref = results["torch"], results["triton"], results["reference"]
    return {
        "triton_eq_reference": bool(torch.equal(tr, ref)),
        "torch_eq_reference": bool(torch.equal(t, ref)),
        "reference_eq_loop": bool(torch.equal(ref, results["loop"])),
        "written": int((ref != 0).sum()),  # random bytes are nonzero with p = 255/256
        "chunk_bytes": int(results["cb"]),
        "bytes_total": int(ref.numel()),
    }


def run_all() -> dict:
    return {case_id(c): run_case(c) for c in CASES}


if __name__ == "__main__":
    assert os.environ.get("TRITON_INTERPRET") == "1", "set TRITON_INTERPRET=1"
    print("RESULT " + json.dumps(run_all()))
