"""Real SGLang 0.5.23 servers (CPU engine, HiCache, FlatCake as L3) on model families other than
dense MHA: MLA (DeepSeek-V2 style) on one rank and over TP 2, a sliding-window hybrid (Mellum:
SGLang's ``SWAKVPool``, FlatCake's v2 interface), and the hybrids that cannot run here
(Mamba / linear attention) with their exact blockers. ``make e2e`` (``FLATCAKE_E2E=all``).

Each server: a tiny local model (:mod:`flatcake.testing.tiny_model`), a 300-token prompt backed
up, ``POST /flush_cache`` (device and host tiers dropped; L3 keeps its pages), the same prompt
again: ``meta_info.cached_tokens_details.storage`` must be every full page (288 tokens) and,
where SGLang's CPU attention is right for the model, the greedy tokens those of ``transformers``
(:func:`flatcake.testing.reference.greedy`).
"""

from __future__ import annotations

import re
import time

import pytest
from e2e_kit import backup_flush_again, full_page_tokens, wait_metric

from flatcake.testing.reference import greedy
from flatcake.testing.server import CpuServer, ServerSpec, flatcake_storage, metric_values
from flatcake.testing.tiny_model import TinyModelSpec, build, kv_bytes_per_token, prompt_ids

PAGE = 16
PROMPT = 300
STORED = full_page_tokens(PROMPT, PAGE)  # 288 tokens: 18 pages

MLA = TinyModelSpec(kind="deepseek_v2")  # 2 layers, one 576-wide latent per token and layer
SWA = TinyModelSpec(kind="mellum")  # layer 0 sliding (window 64), layer 1 full attention

#: TP 2 on the CPU engine: one core per rank (SGLang otherwise wants a NUMA node per rank:
#: utils/numa_utils.py init_threads_binding); gloo is the CPU engine's own backend
TP2_ENV = {"SGLANG_CPU_OMP_THREADS_BIND": "0|1"}

SWA_TOKENS_BLOCKER = (
    "SGLang 0.5.23's torch_native attention backend (the CPU engine's only one without sgl-kernel) reads a "
    "sliding-window layer's KV from SWAKVPool with full-pool indices: layers/attention/torch_native_backend.py:139-141 "
    "(extend) and :240-242 (decode) index get_key_buffer(layer_id) - for an SWA layer the SWA pool's buffer "
    "(mem_cache/swa_memory_pool.py:206-212) - with req_to_token rows; only the writes are translated "
    "(init_forward_metadata, :50-59, translate_loc_from_full_to_swa). intel_amx_backend.py translates the reads "
    "(_swa_kv_indices, :167) but needs sgl-kernel's CPU ops. Measured on the tiny Mellum: a request with nothing "
    "cached gives 5 of 16 greedy tokens equal to transformers' before diverging; with --disable-hybrid-swa-memory "
    "(no SWAKVPool, sliding window as a mask) all 16 match and are served from FlatCake through v1 - but then no "
    "v2 call is made. Token equality of the SWA-pool path cannot be checked on this engine."
)

MAMBA_BLOCKER = (
    "SGLang 0.5.23's CPU engine builds no Mamba / linear-attention backend without sgl-kernel: attn_backend_wrapper "
    "(layers/attention/attention_registry.py:410) imports layers/attention/linear/kda_backend.py, whose line 39 runs "
    "`from sgl_kernel.mamba import causal_conv1d_update_cpu` on CPU -> ModuleNotFoundError: No module named "
    "'sgl_kernel.mamba'; 'sgl_kernel' is not a package (measured with tiny Qwen3-Next (GDN) and Nemotron-H (Mamba2) "
    "models, with the flags the CPU platform requires first: --mamba-radix-cache-strategy no_buffer "
    "(arg_groups/mamba_hook.py:102-121: extra_buffer needs CUDA/MUSA/NPU/HIP/XPU), --page-size 1 and "
    "--disable-overlap-schedule (mamba_hook.py:157-158)). Behind it the missing pieces are the models' compute, not "
    "transfers, so no honest shim: linear/gdn_backend.py:184-188 (sgl_kernel.mamba causal_conv1d_fn_cpu / "
    "causal_conv1d_update_cpu, torch.ops.sgl_kernel.fused_gdn_gating_cpu), linear/kernels/gdn_triton.py:28 "
    "(chunk_gated_delta_rule_cpu), mamba/mamba.py:43-75 (causal_conv1d_fn bound only on CUDA/NPU/XPU; called at "
    ":588). sgl-kernel's PyPI wheels are CUDA-only."
)


@pytest.fixture(scope="module")
def tiny_mla(tmp_path_factory) -> str:
    return str(build(tmp_path_factory.mktemp("tiny-mla"), MLA))


@pytest.fixture(scope="module")
def tiny_swa(tmp_path_factory) -> str:
    return str(build(tmp_path_factory.mktemp("tiny-swa"), SWA))


def model_server(model: str, tmp_path, **kw) -> ServerSpec:
    """A server spec on ``model`` with a small FlatCake pool under ``tmp_path``."""
    return ServerSpec(model_path=model, page_size=PAGE, storage=flatcake_storage(tmp_path / "pool"), **kw)


def per_rank(server: CpuServer, name: str, **labels: str) -> dict:
    """``{tp_rank: value}`` of FlatCake metric ``name`` over its samples with ``labels`` (summed
    over the other labels)."""
    out: dict = {}
    for got, value in metric_values(server.metrics(), name):
        if all(got.get(k) == x for k, x in labels.items()):
            out[int(got["tp_rank"])] = out.get(int(got["tp_rank"]), 0.0) + value
    return out


@pytest.mark.e2e_full
def test_mla_model_is_served_from_flatcake_with_the_reference_tokens(tiny_mla, tmp_path, servers):
    ids = prompt_ids(PROMPT, seed=1)
    expected = greedy(tiny_mla, ids, 16)
    server = servers(model_server(tiny_mla, tmp_path), tmp_path, "mla")
    # FlatCake stores MLA pages: one latent (kv_lora_rank 512 + rope 64) per token and layer, not K and V
    log = server.log_text()
    assert re.search(r"per-rank capacity \(tp 0/1 [^)]*, single\)", log), log[-3000:]
    assert f"page {kv_bytes_per_token(MLA) * PAGE} bytes" in log  # 73728

    again = backup_flush_again(server, ids, expected, PAGE)  # the restored latents are the bytes the prefill wrote
    assert again.storage_tokens == STORED


@pytest.mark.e2e_full
def test_mla_tp2_ranks_report_the_same_hits_right_after_a_backup(tiny_mla, tmp_path, servers):
    """MLA over TP 2 (CPU engine, gloo), FlatCake's default config (write queue configured): rank 0
    writes, rank 1 follows its pool through the journal. SGLang takes the MIN of the ranks' hit
    counts, so right after the backup both ranks must report the whole prefix
    (``tests/adapter/test_storage_ranks_write_queue.py`` pins the writer side: no queue)."""
    ids = prompt_ids(PROMPT, seed=1)
    expected = greedy(tiny_mla, ids, 16)
    spec = model_server(tiny_mla, tmp_path, extra_args=["--tp-size", "2", "--enable-metrics-for-all-schedulers"],
                        env=TP2_ENV)
    server = servers(spec, tmp_path, "mla-tp2")
    log = server.log_text()
    assert re.search(r"per-rank capacity \(tp 0/2 [^)]*, writer\)", log), log[-3000:]
    assert re.search(r"per-rank capacity \(tp 1/2 [^)]*, follower\)", log), log[-3000:]
    assert "SSD write queue off" in log  # the writer writes its rounds in the put

    first = server.generate(ids)
    assert first.output_ids == expected
    # no waiting for FlatCake: SGLang defers the flush until its backup is done, and the next hit
    # query follows at once
    server.flush()
    again = server.generate(ids)
    assert again.storage_tokens == STORED, again.meta
    assert again.device_tokens == 0 and again.host_tokens == 0
    assert again.output_ids == expected

    # what each rank's batch_exists answered (FlatCake's per-rank counters of SGLang's calls; each
    # rank refreshes them on its own scheduler tick, at most once a second)
    deadline = time.monotonic() + 60
    while True:
        calls = per_rank(server, "flatcake_sglang_calls_total", method="batch_exists")
        present = per_rank(server, "flatcake_sglang_call_pages_total", method="batch_exists", what="present")
        asked = per_rank(server, "flatcake_sglang_call_pages_total", method="batch_exists", what="asked")
        if len(calls) == 2 and calls[0] == calls[1] and present.get(0, 0) >= STORED // PAGE:
            break
        assert time.monotonic() < deadline, (calls, asked, present)
        time.sleep(0.5)
    assert asked[0] == asked[1], (calls, asked, present)
    assert present[0] == present[1] >= STORED // PAGE, (calls, asked, present)
    # both ranks read the pages (the follower from the writer's pool files)
    delivered = per_rank(server, "flatcake_sglang_call_pages_total", method="batch_get_v1", what="delivered")
    assert delivered.get(0) == delivered.get(1) == STORED // PAGE, delivered


@pytest.mark.e2e_full
def test_swa_model_backs_up_and_restores_its_sliding_window_pool_through_flatcake_v2(tiny_swa, tmp_path, servers):
    """Mellum (layer 0 sliding window 64, layer 1 full): SGLang builds an ``SWAKVPool`` and HiCache
    hands FlatCake the SWA pool through the v2 interface (``batch_set_v2`` before each KV backup,
    ``batch_exists_v2`` with the SWA pool's trailing-pages hit policy, ``batch_get_v2``). The
    storage hit is every full page only if the v2 hit query found the SWA pool's trailing pages
    too. The tokens are not compared: see :data:`SWA_TOKENS_BLOCKER`."""
    ids = prompt_ids(PROMPT, seed=1)
    server = servers(model_server(tiny_swa, tmp_path), tmp_path, "swa")
    log = server.log_text()
    assert "hybrid_swa=True" in log and "SWAKVPool" in log
    assert "flatcake: extra pool swa:" in log  # FlatCake opened a store for the SWA pool (v2)

    first = server.generate(ids)
    assert first.storage_tokens == 0
    wait_metric(server, "flatcake_pages_indexed", STORED // PAGE)  # KV pages; the SWA pool's are stored first
    server.flush()
    again = server.generate(ids)
    assert again.storage_tokens == STORED, again.meta
    assert again.device_tokens == 0 and again.host_tokens == 0
    assert len(again.output_ids) == 16


@pytest.mark.e2e_full
def test_swa_model_tokens_after_a_flatcake_restore_match_the_reference():
    pytest.skip(SWA_TOKENS_BLOCKER)


@pytest.mark.e2e_full
def test_mamba_or_linear_attention_model_with_hicache_and_flatcake():
    pytest.skip(MAMBA_BLOCKER)
