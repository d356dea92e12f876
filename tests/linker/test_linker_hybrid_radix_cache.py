"""``FlatCakeLinker`` driven by SGLang 0.5.23's own ``UnifiedRadixCache`` and
``UnifiedCacheLinkerWrapper`` with hybrid tree components, CPU pools:

- FULL + SWA (``SWAKVPool``, ``SWATokenToKVPoolAllocator``): the wrapper builds the KV and SWA
  transfers, offloads the inserted node, looks the tail up, allocates the SWA window's slots and
  maps them (``set_full_to_swa_mapping``); the attention pool waits per layer on the linker's counter.
- FULL + MAMBA (``HybridLinearKVPool``, ``HybridReqToTokenPool``): the node's state offloaded with
  its KV, restored into the state slot the tree gives the request."""

from __future__ import annotations

from array import array
from types import SimpleNamespace

import pytest
from hybrid_kit import Model, same
from linker_kit import PAGE
from sglang.srt.mem_cache.base_prefix_cache import InitLoadBackParams, InsertParams, MatchPrefixParams
from sglang.srt.mem_cache.cache_init_params import CacheInitParams
from sglang.srt.mem_cache.hicache_storage import PoolHitPolicy, PoolName
from sglang.srt.mem_cache.memory_pool import ReqToTokenPool
from sglang.srt.mem_cache.radix_cache import RadixKey
from sglang.srt.mem_cache.unified_cache.component_type import ComponentType
from sglang.srt.mem_cache.unified_radix_cache import UnifiedRadixCache
from sglang.srt.mem_cache.utils import get_storage_hash_str

WINDOW = 2 * PAGE  # sliding_window_size (tokens)


@pytest.fixture
def tree(ssd_dir, monkeypatch):
    """``(cache, linker, model, calls)``: a FULL + SWA UnifiedRadixCache with the linker attached as
    ``mem_cache/registry.py:200-219`` attaches it; ``calls`` records every lookup and load."""
    import sglang.srt.mem_cache.unified_radix_cache as urc

    monkeypatch.setattr(urc, "get_disagg", lambda: SimpleNamespace(disaggregation_mode="null"))
    m = Model("swa", ssd_dir)
    lk = m.linker()
    calls = []
    for name in ("lookup", "load"):
        real = getattr(lk, name)

        def spy(rid, transfers, _real=real, _name=name):
            out = _real(rid, transfers)
            calls.append((_name, [(t.name, len(t.keys), t.hit_policy) for t in transfers], out))
            return out

        monkeypatch.setattr(lk, name, spy)
    r2t = ReqToTokenPool(size=8, max_context_len=256, device="cpu", enable_memory_saver=False)
    params = CacheInitParams(disable=False, req_to_token_pool=r2t, token_to_kv_pool_allocator=m.alloc, page_size=PAGE,
                             tree_components=(ComponentType.FULL, ComponentType.SWA), sliding_window_size=WINDOW)
    cache = UnifiedRadixCache(params)
    cache.init_cache_linker(lk)
    m.kv.register_layer_transfer_counter(cache.linker.layer_done_counter)
    yield cache, lk, m, calls
    cache.linker.close()


def key(tokens) -> RadixKey:
    return RadixKey(array("q", tokens))


def test_the_tree_offloads_kv_and_swa_and_restores_both_bit_exact_after_a_reset(tree):
    cache, lk, m, calls = tree
    assert cache.linker._skip_swa is False  # the linker stores SWA pages: the wrapper sends SWA transfers
    tokens = list(range(1000, 1000 + 5 * PAGE))
    full = m.full_alloc.alloc(len(tokens))  # a prefill's slots: FULL, and SWA mapped from them
    swa = m.swa_alloc.alloc(len(tokens))
    m.alloc.set_full_to_swa_mapping(full, swa)
    m.fill_kv(m.full, full, seed=1)
    m.fill_kv(m.swa, swa, seed=2)
    cache.insert(InsertParams(key=key(tokens), value=full, session_id="chat"))
    assert lk.flush_writes(30)
    cache.check_hicache_events()
    st = lk.linker_stats()
    assert (st["offload_pages"], st["offload_failures"]) == (5, 0)
    want_full, want_swa = m.kv_rows(m.full, full), m.kv_rows(m.swa, swa[-WINDOW:])

    cache.reset()
    req = SimpleNamespace(rid="r1", last_node=None, kv=None, swa_branching_seqlen=None, session=None)
    got = cache.match_prefix(MatchPrefixParams(key=key(tokens + [7]), req=req))
    assert (got.device_prefix_len, got.host_hit_length, got.swa_host_hit_length) == (0, 5 * PAGE, WINDOW)
    assert calls[0] == ("lookup", [(PoolName.KV, 5, PoolHitPolicy.ALL_PAGES),
                                   (PoolName.SWA, 2, PoolHitPolicy.TRAILING_PAGES)], [1, 2, 3, 4, 5])
    req.last_node = got.last_device_node
    n, _ = cache.init_load_back(InitLoadBackParams(best_match_node=got.best_match_node,
                                                   host_hit_length=got.host_hit_length, req=req))
    assert n == 5 * PAGE
    assert calls[1] == ("load", [(PoolName.KV, 5, PoolHitPolicy.ALL_PAGES),
                                 (PoolName.SWA, 2, PoolHitPolicy.TRAILING_PAGES)], True)
    dst = cache.linker.private_load_indices["r1"]
    index = cache.ready_to_load_host_cache()
    assert index >= 0
    m.kv.layer_transfer_counter.set_consumer(index)
    for layer in range(4):  # SWAKVPool waits per model layer (swa 0, 2; full 1, 3)
        m.kv.get_key_buffer(layer)
        assert m.kv.layer_transfer_counter.futures[index][layer].done()
    assert cache.finish_external_linker_loads([req]) == []
    assert same(m.kv_rows(m.full, dst), want_full) == [True, True]
    dst_swa = m.alloc.translate_loc_from_full_to_swa(dst[-WINDOW:])  # the window's slots, as the tree maps them
    assert same(m.kv_rows(m.swa, dst_swa), want_swa) == [True, True]


@pytest.fixture
def mamba_tree(ssd_dir, monkeypatch):
    """``(cache, linker, model)``: a FULL + MAMBA UnifiedRadixCache (page size 1: ``MambaComponent``
    without the extra buffer needs it, ``components/mamba.py:74-80``). No server is published in
    this process, so the four launch settings the Mamba component and the tree core read are
    stated here with their defaults: ``mamba_max_states_per_path`` -1,
    ``enable_mamba_extra_buffer_lazy`` False, the Mamba chunk size and checkpoint grid 64."""
    import sglang.srt.mem_cache.rust_tree_core.adapter as rust_core
    import sglang.srt.mem_cache.unified_cache.components.mamba as mamba_component
    import sglang.srt.mem_cache.unified_radix_cache as urc

    launch = SimpleNamespace(mamba=SimpleNamespace(mamba_max_states_per_path=-1, enable_mamba_extra_buffer_lazy=False))
    monkeypatch.setattr(urc, "get_disagg", lambda: SimpleNamespace(disaggregation_mode="null"))
    for mod in (mamba_component, rust_core):
        monkeypatch.setattr(mod, "get_exec", lambda: launch)
        monkeypatch.setattr(mod, "mamba_cache_chunk_size", lambda: 64)
    monkeypatch.setattr(mamba_component, "mamba_checkpoint_grid", lambda page: 64)
    m = Model("mamba", ssd_dir, page=1)
    lk = m.linker()
    params = CacheInitParams(disable=False, req_to_token_pool=m.r2t, token_to_kv_pool_allocator=m.alloc, page_size=1,
                             tree_components=(ComponentType.FULL, ComponentType.MAMBA))
    cache = UnifiedRadixCache(params)
    cache.init_cache_linker(lk)
    m.kv.register_layer_transfer_counter(cache.linker.layer_done_counter)
    yield cache, lk, m
    cache.linker.close()


def test_the_tree_offloads_kv_and_the_mamba_state_and_restores_both_bit_exact_after_a_reset(mamba_tree):
    from sglang.srt.managers.schedule_batch import ReqKvInfo

    cache, lk, m = mamba_tree
    assert m.r2t.layer_transfer_counter is lk.layer_done_counter  # Mamba layers wait on the linker
    tokens = list(range(1000, 1012))
    full = m.full_alloc.alloc(len(tokens))
    m.fill_kv(m.full, full, seed=1)
    state = m.r2t.mamba_allocator.alloc(1)  # the request's state at the end of its prefill
    m.fill_mamba(state, seed=3)
    want_full, want_state = m.kv_rows(m.full, full), m.mamba_rows(state)
    cache.insert(InsertParams(key=key(tokens), value=full, mamba_value=state, session_id="chat"))
    assert lk.flush_writes(30)
    cache.check_hicache_events()
    st = lk.linker_stats()
    assert (st["offloads"], st["offload_pages"], st["offload_failures"]) == (1, 12, 0)
    hashes = get_storage_hash_str(tokens, None, page_size=1)  # the node's page keys
    assert [lk.store.exists(k) for k in hashes] == [True] * 12
    assert [lk._extra["mamba"].store.exists(k) for k in hashes] == [False] * 11 + [True]  # one state, at the end

    cache.reset()
    req = SimpleNamespace(rid="r1", last_node=None, kv=ReqKvInfo(), swa_branching_seqlen=None, session=None)
    got = cache.match_prefix(MatchPrefixParams(key=key(tokens + [7]), req=req))
    assert (got.device_prefix_len, got.host_hit_length, got.mamba_host_hit_length) == (0, 12, 1)
    req.last_node = got.last_device_node
    n, _ = cache.init_load_back(InitLoadBackParams(best_match_node=got.best_match_node,
                                                   host_hit_length=got.host_hit_length, req=req))
    assert n == 12
    dst = cache.linker.private_load_indices["r1"]
    index = cache.ready_to_load_host_cache()
    assert index >= 0
    m.kv.layer_transfer_counter.set_consumer(index)
    for layer in (1, 3):  # the full-attention layers wait through HybridLinearKVPool
        m.kv.get_key_buffer(layer)
    assert cache.finish_external_linker_loads([req]) == []
    assert same(m.kv_rows(m.full, dst), want_full) == [True, True]
    slot = req.kv.mamba_pool_idx.reshape(1)  # the state slot the tree gave the request (PREPARE)
    assert same(m.mamba_rows(slot), want_state) == [True, True]
