"""Helpers the real-server tests share: waiting for backups, reading metrics, the storage check."""

from __future__ import annotations

import time
from typing import List

from flatcake.replay.engine import reusable_pages
from flatcake.testing.server import CpuServer, Generation, metric_total


def metric_sum(server: CpuServer, name: str, **labels: str) -> float:
    """The sum of metric ``name`` over the samples whose labels include ``labels``."""
    return metric_total(server.metrics(), name, **labels)


def wait_metric(server: CpuServer, name: str, at_least: float, timeout_s: float = 60.0, **labels: str) -> float:
    """Poll ``/metrics`` until ``name`` (summed over the samples with ``labels``) reaches
    ``at_least``; returns the value.

    FlatCake's metrics refresh when SGLang's scheduler drains ``get_stats()`` (every step, idle
    included), at most once a second: a backup shows within about a second of its write.

    Raises:
        AssertionError: not reached within ``timeout_s`` (the message holds the last value).
    """
    deadline = time.monotonic() + timeout_s
    value = 0.0
    while time.monotonic() < deadline:
        value = metric_sum(server, name, **labels)
        if value >= at_least:
            return value
        time.sleep(0.5)
    raise AssertionError(f"{name} = {value} < {at_least} after {timeout_s} s\n{server.log_tail(20)}")


def full_page_tokens(prompt_tokens: int, page_size: int) -> int:
    """Tokens of the full pages SGLang can serve from a cache for a prompt of ``prompt_tokens``
    (it matches at most ``prompt_tokens - 1`` tokens, in whole pages)."""
    return reusable_pages(prompt_tokens // page_size, prompt_tokens, page_size) * page_size


def assert_from_storage(g: Generation, page: int, expected: List[int], what: str = "") -> None:
    """After a flush (or eviction from both tiers): every full page of the prompt from storage,
    nothing from device or host, and the reference tokens."""
    stored = full_page_tokens(g.prompt_tokens, page)
    assert (g.device_tokens, g.host_tokens, g.storage_tokens) == (0, 0, stored), f"{what}: {g.meta}"
    assert g.cached_tokens == stored, f"{what}: {g.meta}"
    assert g.output_ids == expected, f"{what}: tokens differ from the transformers reference"


def backup_flush_again(server: CpuServer, ids: List[int], expected: List[int], page: int) -> Generation:
    """The storage round trip: the prompt computed (reference tokens, nothing from storage), its
    full pages indexed by FlatCake, ``/flush_cache``, the prompt again: every full page from
    storage with the reference tokens (:func:`assert_from_storage`). Returns the second answer."""
    first = server.generate(ids)
    assert first.output_ids == expected
    assert first.storage_tokens == 0
    wait_metric(server, "flatcake_pages_indexed", full_page_tokens(len(ids), page) // page)
    server.flush()
    again = server.generate(ids)
    assert_from_storage(again, page, expected, "after /flush_cache")
    return again


def assert_from_linker(g: Generation, page: int, expected: List[int], what: str = "") -> None:
    """After a flush, with SGLang's direct L3 linker: every full page of the prompt restored by the
    linker, nothing from the device, and the reference tokens. SGLang 0.5.23 counts a linker hit
    as ``host`` in ``cached_tokens_details`` (the wrapper reports it as ``host_hit_length``:
    ``unified_cache_linker.py`` ``match``; ``schedule_batch.py`` ``split_cached_prefix_by_tier``)
    and reports no ``storage`` key (no HiCache storage backend: ``output_streamer.py``
    ``get_cached_tokens_details``)."""
    stored = full_page_tokens(g.prompt_tokens, page)
    assert (g.device_tokens, g.host_tokens, g.storage_tokens) == (0, stored, 0), f"{what}: {g.meta}"
    assert "storage" not in g.meta["cached_tokens_details"], f"{what}: {g.meta}"
    assert g.cached_tokens == stored, f"{what}: {g.meta}"
    assert g.output_ids == expected, f"{what}: tokens differ from the transformers reference"


def open_linker_offline(model_path: str, linker_extra: dict, page: int, heads: int = 4, head_dim: int = 128,
                        layers: int = 2):
    """A :class:`flatcake.FlatCakeLinker` in this process over the pool a stopped linker server
    wrote (same model path, page geometry and ``linker_extra_config``, so the same namespace):
    its store rebuilds the pool from the journal, as a restarted server would. Built through
    SGLang's ``create_unified_cache_linker`` over a real fp32 ``MHATokenToKVPool`` of the tiny
    Llama's KV geometry on CPU. The caller closes it."""
    from types import SimpleNamespace

    import torch

    from flatcake.replay.sglang_cpu import ensure_importable

    ensure_importable()
    from sglang.srt.mem_cache.allocator.paged import PagedTokenToKVPoolAllocator
    from sglang.srt.mem_cache.cache_init_params import CacheInitParams
    from sglang.srt.mem_cache.memory_pool import MHATokenToKVPool
    from sglang.srt.mem_cache.unified_cache.component_type import ComponentType
    from sglang.srt.mem_cache.unified_cache.linker_factory import create_unified_cache_linker

    slots = 8 * page
    kv = MHATokenToKVPool(size=slots, page_size=page, dtype=torch.float32, head_num=heads, head_dim=head_dim,
                          layer_num=layers, device="cpu", enable_memory_saver=False)
    alloc = PagedTokenToKVPoolAllocator(slots, page, kv.dtype, "cpu", kv, need_sort=False)
    params = CacheInitParams(disable=False, req_to_token_pool=None, token_to_kv_pool_allocator=alloc, page_size=page)
    config = {"linker": "FlatCakeLinker", "linker_module_path": "flatcake.linker",
              "linker_extra_config": dict(linker_extra)}
    return create_unified_cache_linker(SimpleNamespace(model_path=model_path), params, backend="dynamic",
                                       config=config, components={ComponentType.FULL})


def page_keys(token_ids: List[int], page: int) -> List[str]:
    """SGLang's storage keys of the whole pages of ``token_ids`` from the sequence head (the keys
    the direct linker is offloaded and looked up with: ``get_storage_hash_str``)."""
    from sglang.srt.mem_cache.utils import get_storage_hash_str

    whole = len(token_ids) // page * page
    return get_storage_hash_str(list(token_ids[:whole]), None, page_size=page)
