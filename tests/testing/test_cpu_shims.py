"""The CPU shims (:mod:`flatcake.testing.cpu_shims`): the L1 <-> L2 copies bound into SGLang 0.5.23's
real ``MHATokenToKVPoolHost`` move every byte to the right slot (checked token by token against
the host pool's buffers), the ``sgl_kernel`` stand-in imports only the names it
knows (so SGLang's ``except ImportError`` fallbacks still run), and ``install()`` binds the copies
only where SGLang bound nothing."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch

from flatcake.replay.sglang_cpu import ensure_importable
from flatcake.testing import cpu_shims

LAYERS, HEADS, DIM, TOKENS, PAGE = 3, 2, 8, 64, 4


def real_mha_host_pool(layout: str):
    """SGLang's real host pool over CPU device buffers (random K/V), as the server builds it."""
    ensure_importable()
    from sglang.srt.mem_cache.device_pool_info import KVBufferLayout, KVBuffers, MHABufferInfo
    from sglang.srt.mem_cache.pool_host.mha import MHATokenToKVPoolHost

    g = torch.Generator().manual_seed(7)
    k = tuple(torch.randn(TOKENS, HEADS, DIM, generator=g) for _ in range(LAYERS))
    v = tuple(torch.randn(TOKENS, HEADS, DIM, generator=g) for _ in range(LAYERS))
    ptrs = [torch.tensor([t.data_ptr() for t in x], dtype=torch.uint64) for x in (k, v)]
    info = MHABufferInfo(buffers=KVBuffers(k=k, v=v, k_data_ptrs=ptrs[0], v_data_ptrs=ptrs[1], layout=KVBufferLayout.NHD),
                         page_size=PAGE, head_num=HEADS, head_dim=DIM, v_head_dim=DIM, dtype=torch.float32,
                         device=torch.device("cpu"))
    pool = MHATokenToKVPoolHost(info, 2.0, 0, PAGE, layout, pin_memory=False, device="cpu",
                                device_capacity_tokens=TOKENS, start_layer=0, end_layer=LAYERS)
    return pool, k, v


@pytest.fixture
def bound_copies(monkeypatch):
    """The shim's copies bound in SGLang's ``pool_host.mha`` for this test only (install() would
    bind them for the whole process)."""
    ensure_importable()
    import sglang.srt.mem_cache.pool_host.mha as mha

    for name, fn in cpu_shims.DIRECT_COPIES.items():
        monkeypatch.setattr(mha, name, fn, raising=False)


@pytest.mark.parametrize("layout", ["layer_first", "page_first_direct"])
def test_direct_copies_back_up_and_load_every_token_into_its_slot(bound_copies, layout):
    pool, k, v = real_mha_host_pool(layout)
    device_pages, host_pages = [3, 0, 9], [5, 1, 2]  # out of order on both sides
    dev = torch.tensor([p * PAGE + i for p in device_pages for i in range(PAGE)])
    host = torch.tensor([p * PAGE + i for p in host_pages for i in range(PAGE)])

    pool.backup_from_device_all_layer(None, host, dev, "direct")
    for hp, dp in zip(host_pages, device_pages):
        for layer in range(LAYERS):
            for t in range(PAGE):
                want_k, want_v = k[layer][dp * PAGE + t], v[layer][dp * PAGE + t]
                if layout == "page_first_direct":
                    assert torch.equal(pool.k_buffer[hp, layer, t], want_k) and torch.equal(pool.v_buffer[hp, layer, t], want_v)
                else:
                    assert torch.equal(pool.k_buffer[layer, hp * PAGE + t], want_k)
                    assert torch.equal(pool.v_buffer[layer, hp * PAGE + t], want_v)

    saved = [(x.clone(), y.clone()) for x, y in zip(k, v)]
    for x, y in zip(k, v):
        x.zero_()
        y.zero_()
    target = torch.tensor([p * PAGE + i for p in [7, 8, 4] for i in range(PAGE)])
    for layer in range(LAYERS):
        pool.load_to_device_per_layer(None, host, target, layer, "direct")
    for layer in range(LAYERS):
        assert torch.equal(k[layer][target], saved[layer][0][dev]) and torch.equal(v[layer][target], saved[layer][1][dev])
        untouched = torch.ones(TOKENS, dtype=torch.bool)
        untouched[target] = False
        assert not k[layer][untouched].any() and not v[layer][untouched].any()


def test_copy_all_layer_kv_cache_cpu_moves_rows_with_memmove_semantics():
    a = torch.arange(10 * 4, dtype=torch.float32).reshape(10, 4)
    b = torch.arange(10 * 2, dtype=torch.int64).reshape(10, 2) + 1000
    want_a, want_b = a.clone(), b.clone()
    src, tgt = torch.tensor([1, 2, 3]), torch.tensor([2, 3, 7])  # overlapping: 2 and 3 are read before written
    want_a[tgt] = want_a[src].clone()
    want_b[tgt] = want_b[src].clone()
    ptrs = torch.tensor([a.data_ptr(), b.data_ptr()], dtype=torch.uint64)
    strides = torch.tensor([a.stride(0) * 4, b.stride(0) * 8], dtype=torch.int64)
    cpu_shims.copy_all_layer_kv_cache_cpu(ptrs, strides, tgt, src)
    assert torch.equal(a, want_a) and torch.equal(b, want_b)


def test_assign_req_to_token_pool_cpu_fills_each_request_from_the_slot_list():
    req_to_token = torch.full((4, 12), -1, dtype=torch.int32)
    cpu_shims.assign_req_to_token_pool_cpu(torch.tensor([2, 0]), req_to_token, torch.tensor([3, 0]),
                                           torch.tensor([6, 2]), torch.tensor([40, 41, 42, 50, 51]), 12)
    assert req_to_token[2, 3:6].tolist() == [40, 41, 42] and req_to_token[0, 0:2].tolist() == [50, 51]
    assert (req_to_token[1] == -1).all() and (req_to_token[2, :3] == -1).all() and (req_to_token[2, 6:] == -1).all()


_INSTALLED_PROBE = r"""
import importlib, sys, torch
from flatcake.testing import cpu_shims
assert cpu_shims.install() is True and cpu_shims.install() is True  # idempotent
import sgl_kernel
assert sgl_kernel.__flatcake_stand_in__
from sgl_kernel import copy_all_layer_kv_cache_cpu, verify_tree_greedy_cpu
assert copy_all_layer_kv_cache_cpu is cpu_shims.copy_all_layer_kv_cache_cpu
try:
    verify_tree_greedy_cpu()
except NotImplementedError as e:
    assert "sgl_kernel.verify_tree_greedy_cpu" in str(e)
else:
    raise SystemExit("an import-only name ran")
for missing in ("from sgl_kernel import fused_add_rmsnorm", "import sgl_kernel.kvcacheio", "from sgl_kernel.scalar_type import scalar_types"):
    try:
        exec(missing)
    except ImportError:
        pass
    else:
        raise SystemExit(missing + " imported")
from sglang.srt.layers.quantization.utils import scalar_types   # SGLang's own except-ImportError fallback
import sglang.srt.mem_cache.pool_host.mha as mha
import sglang.srt.mem_cache.pool_host.base as base
assert mha.transfer_kv_direct is cpu_shims.transfer_kv_direct
assert mha.transfer_kv_per_layer_direct_pf_lf is cpu_shims.transfer_kv_per_layer_direct_pf_lf
assert base.HostKVCache.__init__.__wrapped__ is not None
import sglang.srt.mem_cache.pool_host.mla as mla
assert mla.transfer_kv_all_layer_direct_lf_pf is cpu_shims.transfer_kv_all_layer_direct_lf_pf
import sglang.srt.models.deepseek_common.attention_backend_handler as handler
assert "torch_native" in handler.AttentionBackendRegistry._handlers
s = torch.cpu.Stream(); s.synchronize(); assert s.query() is True
print("probe ok")
"""


def test_install_binds_only_what_sglang_left_unbound_and_keeps_import_error_fallbacks():
    """In a fresh process: the stand-in's names, SGLang's own fallback for a name it lacks, the
    copies bound in ``pool_host/mha.py`` and ``mla.py``, unpinned host pools, the CPU stream's
    no-ops and the ``torch_native`` MLA handler."""
    out = subprocess.run([sys.executable, "-c", _INSTALLED_PROBE], capture_output=True, text=True, timeout=300,
                         env={**__import__("os").environ, "SGLANG_USE_CPU_ENGINE": "1"})
    assert out.returncode == 0 and "probe ok" in out.stdout, out.stderr[-3000:]
