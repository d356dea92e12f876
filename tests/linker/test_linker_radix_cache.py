"""``FlatCakeLinker`` driven by SGLang 0.5.23's own ``UnifiedRadixCache`` and
``UnifiedCacheLinkerWrapper`` (FULL tree component, CPU pools): the transfers, the session id and
the load-back are the tree's, not the test's."""

from __future__ import annotations

from array import array
from types import SimpleNamespace

import pytest
import torch
from linker_kit import LAYERS, PAGE, fill, make_linker, page_hashes, snapshot
from sglang.srt.mem_cache.base_prefix_cache import InitLoadBackParams, InsertParams, MatchPrefixParams
from sglang.srt.mem_cache.cache_init_params import CacheInitParams
from sglang.srt.mem_cache.memory_pool import ReqToTokenPool
from sglang.srt.mem_cache.radix_cache import RadixKey
from sglang.srt.mem_cache.unified_cache.component_type import ComponentType
from sglang.srt.mem_cache.unified_radix_cache import UnifiedRadixCache


@pytest.fixture
def tree(ssd_dir, monkeypatch):
    """``(cache, linker, kvcache, allocator)``: a UnifiedRadixCache with the linker attached as
    ``mem_cache/registry.py`` attaches it (no PD disaggregation published in this process)."""
    import sglang.srt.mem_cache.unified_radix_cache as urc

    monkeypatch.setattr(urc, "get_disagg", lambda: SimpleNamespace(disaggregation_mode="null"))
    lk, kv, alloc = make_linker(ssd_dir, "mha")
    r2t = ReqToTokenPool(size=8, max_context_len=256, device="cpu", enable_memory_saver=False)
    params = CacheInitParams(disable=False, req_to_token_pool=r2t, token_to_kv_pool_allocator=alloc,
                             page_size=PAGE, tree_components=(ComponentType.FULL,))
    cache = UnifiedRadixCache(params)
    cache.init_cache_linker(lk)
    kv.register_layer_transfer_counter(cache.linker.layer_done_counter)
    yield cache, lk, kv, alloc
    cache.linker.close()


def key(tokens) -> RadixKey:
    return RadixKey(array("q", tokens))


def computed(cache, kv, alloc, tokens, seed, session_id=None):
    """A request's prefill: KV of ``tokens`` computed into fresh slots and inserted into the tree."""
    slots = alloc.alloc(len(tokens))
    fill(kv, slots, seed)
    cache.insert(InsertParams(key=key(tokens), value=slots, session_id=session_id))
    return slots


def test_an_inserted_prefix_is_offloaded_with_its_session_and_restored_by_the_tree_after_a_reset(tree):
    cache, lk, kv, alloc = tree
    tokens = list(range(1000, 1000 + 3 * PAGE))
    slots = computed(cache, kv, alloc, tokens, seed=1, session_id="chat-1")
    assert lk.flush_writes(30)
    cache.check_hicache_events()  # the tree commits the completed offload
    assert lk.num_completed_offloads() == 0 and lk.linker_stats()["offload_pages"] == 3
    assert len(lk.sessions.prefix("chat-1")) == 3  # the wrapper passed the insert's session id
    want = snapshot(kv, slots)

    cache.reset()  # the device tree forgets; the store keeps the pages
    req = SimpleNamespace(rid="r1", last_node=None, kv=None, swa_branching_seqlen=None, session=None)
    m = cache.match_prefix(MatchPrefixParams(key=key(tokens + [7]), req=req))
    assert (m.device_prefix_len, m.host_hit_length) == (0, 3 * PAGE)
    req.last_node = m.last_device_node
    n, _ = cache.init_load_back(InitLoadBackParams(best_match_node=m.best_match_node,
                                                   host_hit_length=m.host_hit_length, req=req))
    assert n == 3 * PAGE
    dst = cache.linker.private_load_indices["r1"]
    index = cache.ready_to_load_host_cache()
    assert index >= 0
    kv.layer_transfer_counter.set_consumer(index)  # as the TP worker does for the batch's forward
    for layer in range(LAYERS):  # the attention backend reads each layer through the pool's wait hook
        kv.get_key_buffer(layer)
        assert kv.layer_transfer_counter.futures[index][layer].done()
    assert cache.finish_external_linker_loads([req]) == []
    got = snapshot(kv, dst)
    assert [all(torch.equal(x, y) for x, y in zip(a, b)) for a, b in zip(want, got)] == [True] * LAYERS


def test_a_sessions_inserts_share_one_scope_through_the_tree(tree):
    cache, lk, kv, alloc = tree
    turn1 = list(range(2 * PAGE))
    computed(cache, kv, alloc, turn1, seed=2, session_id="agent-7")
    other = list(range(500, 500 + 2 * PAGE))
    computed(cache, kv, alloc, other, seed=3, session_id="agent-8")
    turn2 = turn1 + list(range(900, 900 + 2 * PAGE))  # the session's next turn extends its prefix
    computed(cache, kv, alloc, turn2, seed=4, session_id="agent-7")
    assert lk.flush_writes(30)
    cache.check_hicache_events()
    assert lk.linker_stats()["offload_pages"] == 6  # turn 2 offloads only its new node
    scope = {name: {lk.store.page_info(k).scope_id for k in keys} for name, keys in {
        "turn1": page_hashes(turn1), "turn2": page_hashes(turn2)[2:], "other": page_hashes(other)}.items()}
    assert scope["turn1"] == scope["turn2"] and len(scope["turn1"]) == 1
    assert scope["other"] != scope["turn1"]
