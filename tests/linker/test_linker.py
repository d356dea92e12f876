"""``flatcake.FlatCakeLinker`` against SGLang 0.5.23's real ``UnifiedCacheLinker`` contract: built
by SGLang's ``linker_factory``, transfers built as the wrapper builds them, layers counted by the
real ``LayerWiseLoadCounter``, device pools SGLang's own MHA / MLA pools on CPU."""

from __future__ import annotations

import inspect

import pytest
import torch
from linker_kit import (LAYERS, PAGE, drain_offloads, fill, load_transfer, lookup_transfer, make_linker,
                        offload_transfer, page_hashes, snapshot)
from sglang.srt.mem_cache.unified_cache.component_type import ComponentType
from sglang.srt.mem_cache.unified_cache.unified_cache_linker import LayerWiseLoadCounter, UnifiedCacheLinker

from flatcake.config import ConfigError
from flatcake.gva.address import OFFSET_MASK
from flatcake.linker import FlatCakeLinker
from flatcake.linker.layer_loads import LinkerLoadError


@pytest.fixture
def linkers(ssd_dir):
    made = []

    def _make(kind="mha", extra=None, **kw):
        lk, kv, alloc = make_linker(ssd_dir, kind, extra, **kw)
        made.append(lk)
        return lk, kv, alloc

    yield _make
    for lk in made:
        lk.close()


def stored(linker, kvcache, alloc, tokens, seed, session_id=None, prior=None):
    """A node of ``tokens`` computed into fresh device slots (pattern ``seed``) and offloaded;
    returns ``(keys, slots)``."""
    keys = page_hashes(tokens, prior)
    slots = alloc.alloc(len(keys) * PAGE)
    fill(kvcache, slots, seed)
    assert linker.offload(offload_transfer(slots, keys), session_id=session_id)
    return keys, slots


def layers_equal(a, b) -> list[bool]:
    return [all(torch.equal(x, y) for x, y in zip(la, lb)) for la, lb in zip(a, b)]


def test_the_linker_implements_every_abstract_method_of_sglangs_abc():
    assert issubclass(FlatCakeLinker, UnifiedCacheLinker)
    assert not inspect.isabstract(FlatCakeLinker)
    abstract = {n for n, f in vars(UnifiedCacheLinker).items() if getattr(f, "__isabstractmethod__", False)}
    assert abstract == {"lookup", "load", "start_layer_wise_loading", "finish_layer_wise_loading",
                        "cancel_queued_load", "offload", "num_completed_offloads", "pop_completed_offload",
                        "reset", "close"}
    assert all(n in vars(FlatCakeLinker) for n in abstract)
    import flatcake

    assert flatcake.FlatCakeLinker is FlatCakeLinker


@pytest.mark.parametrize("kind,scatter", [("mha", "torch"), ("mla", "torch"), ("mha", "triton"), ("mla", "triton")])
def test_offloaded_pages_are_looked_up_and_loaded_into_other_device_slots_bit_exact(linkers, kind, scatter):
    """``triton``: the FC-CIO scatter kernel (run by Triton's interpreter here, TRITON_INTERPRET=1)."""
    lk, kv, alloc = linkers(kind, {"cio.scatter": scatter})
    assert lk.store.cio.scatter_impl == scatter
    assert isinstance(lk.layer_done_counter, LayerWiseLoadCounter)
    keys, slots = stored(lk, kv, alloc, list(range(5 * PAGE)), seed=7)
    assert drain_offloads(lk, 1) == [True]
    assert all(lk.store.medium_of(k) == "ssd" for k in keys)
    assert lk.lookup("r1", lookup_transfer(keys)) == [1, 2, 3, 4, 5]
    assert lk.lookup("r1", lookup_transfer(keys[:2] + page_hashes([9] * PAGE, keys[1]))) == [1, 2]
    assert lk.lookup("r0", lookup_transfer(page_hashes([1] * PAGE))) == []
    load = load_transfer(alloc, keys)
    dst = load[0].device_indices
    assert not torch.equal(dst, slots)
    assert lk.load("r1", load)
    index = lk.start_layer_wise_loading()
    assert index == 0
    assert lk.finish_layer_wise_loading(index)
    assert layers_equal(snapshot(kv, slots), snapshot(kv, dst)) == [True] * LAYERS
    st = lk.linker_stats()
    assert (st["loads"], st["load_pages"], st["load_batches"], st["offload_pages"]) == (1, 5, 1, 5)
    assert lk.store.stats.snapshot()["hit_pages_ssd"] == 5  # counted once per page, not per layer


def test_layers_complete_in_layer_order_on_sglangs_counter_and_the_forward_waits_per_layer(linkers):
    lk, kv, alloc = linkers("mha")
    keys_a, slots_a = stored(lk, kv, alloc, list(range(3 * PAGE)), seed=1)
    keys_b, slots_b = stored(lk, kv, alloc, list(range(100, 100 + 2 * PAGE)), seed=2)
    assert drain_offloads(lk, 2) == [True, True]
    counter = lk.layer_done_counter
    order = []
    real_complete = counter.complete

    def complete(index, layer):
        order.append((index, layer))
        real_complete(index, layer)

    counter.complete = complete
    la, lb = load_transfer(alloc, keys_a), load_transfer(alloc, keys_b)
    assert lk.load("a", la) and lk.load("b", lb)
    index = lk.start_layer_wise_loading()
    counter.set_consumer(index)
    for layer in range(LAYERS):  # as the attention backend does before each layer
        counter.wait_until(layer)
        assert counter.futures[index][layer].exception() is None
    assert lk.finish_layer_wise_loading(index)
    assert order == [(index, layer) for layer in range(LAYERS)]
    assert layers_equal(snapshot(kv, slots_a), snapshot(kv, la[0].device_indices)) == [True] * LAYERS
    assert layers_equal(snapshot(kv, slots_b), snapshot(kv, lb[0].device_indices)) == [True] * LAYERS
    assert lk.start_layer_wise_loading() == -1  # nothing queued: no batch
    assert lk.finish_layer_wise_loading(-1)


def test_a_cancelled_queued_load_is_never_read(linkers):
    lk, kv, alloc = linkers("mha")
    keys, slots = stored(lk, kv, alloc, list(range(2 * PAGE)), seed=3)
    assert drain_offloads(lk, 1) == [True]
    la, lb = load_transfer(alloc, keys), load_transfer(alloc, keys)
    for t in (la, lb):
        for bufs in (kv.k_buffer, kv.v_buffer):
            for b in bufs:
                b[t[0].device_indices] = 0
    assert lk.load("a", la) and lk.load("b", lb)
    assert not lk.load("b", lb)  # already queued: refused, not raised
    assert lk.cancel_queued_load("a")
    assert not lk.cancel_queued_load("a")
    index = lk.start_layer_wise_loading()
    assert lk.finish_layer_wise_loading(index)
    assert not lk.cancel_queued_load("b")  # started: no longer cancellable
    assert layers_equal(snapshot(kv, slots), snapshot(kv, lb[0].device_indices)) == [True] * LAYERS
    zero = [[torch.zeros_like(x) for x in layer] for layer in snapshot(kv, la[0].device_indices)]
    assert layers_equal(snapshot(kv, la[0].device_indices), zero) == [True] * LAYERS
    assert lk.linker_stats()["loads"] == 1


def test_a_read_fault_fails_that_layer_and_the_later_ones_and_finish_reports_it_without_raising(linkers):
    lk, kv, alloc = linkers("mha")
    keys, slots = stored(lk, kv, alloc, list(range(3 * PAGE)), seed=4)
    assert drain_offloads(lk, 1) == [True]
    store = lk.store
    e = store.index.get(keys[1])
    path = store.ssd.path_of((e.gva & OFFSET_MASK) // store.ssd.file_bytes)
    with open(path, "r+b") as f:  # flip one byte of page 1, layer 1: its checksum no longer matches
        f.seek((e.gva & OFFSET_MASK) % store.ssd.file_bytes + 1 * e.layer_stride + 5)
        b = f.read(1)
        f.seek(-1, 1)
        f.write(bytes([b[0] ^ 0xFF]))
    load = load_transfer(alloc, keys)
    assert lk.load("r", load)
    counter = lk.layer_done_counter
    index = lk.start_layer_wise_loading()
    counter.set_consumer(index)
    for layer in range(LAYERS):
        counter.wait_until(layer)  # never raises into the forward
    futures = counter.futures[index]
    assert futures[0].exception() is None
    assert all(isinstance(futures[l].exception(), LinkerLoadError) for l in (1, 2))
    assert "layer 1 did not land" in str(futures[1].exception())
    assert lk.finish_layer_wise_loading(index) is False
    assert layers_equal(snapshot(kv, slots), snapshot(kv, load[0].device_indices))[0]
    assert lk.linker_stats()["load_failures"] == 1
    assert store.errors.count_of("verify", "checksum") == 1
    assert lk.lookup("r", lookup_transfer(keys)) == []  # the failed round (all 3 pages) is a miss from now on


def test_offloads_with_a_session_id_join_that_sessions_scope_and_two_interleaved_sessions_stay_apart(linkers):
    lk, kv, alloc = linkers("mha")
    a1, _ = stored(lk, kv, alloc, list(range(2 * PAGE)), seed=10, session_id="session-a")
    b1, _ = stored(lk, kv, alloc, list(range(50, 50 + 2 * PAGE)), seed=11, session_id="session-b")
    a2, _ = stored(lk, kv, alloc, list(range(200, 200 + 2 * PAGE)), seed=12, session_id="session-a")
    b2, _ = stored(lk, kv, alloc, list(range(300, 300 + 2 * PAGE)), seed=13, session_id="session-b")
    assert drain_offloads(lk, 4) == [True] * 4
    info = {name: [lk.store.page_info(k) for k in keys] for name, keys in
            {"a1": a1, "a2": a2, "b1": b1, "b2": b2}.items()}
    scope = {name: {i.scope_id for i in infos} for name, infos in info.items()}
    assert scope["a1"] == scope["a2"] and scope["b1"] == scope["b2"]
    assert len(scope["a1"]) == 1 and scope["a1"] != scope["b1"]
    assert all(i.medium == "ssd" for infos in info.values() for i in infos)
    # a session's second round goes on at its scope's tail: after its first round, in its file
    assert info["a2"][0].file_index == info["a1"][-1].file_index
    assert info["a2"][0].gva > info["a1"][-1].gva
    tail = lk.sessions.prefix("session-a")
    assert (len(tail), tail[-1]) == (len(a1 + a2), a2[-1])  # the session's context and its scope's tail


def test_offloads_without_a_session_id_are_placed_by_their_own_key_chain(linkers):
    lk, kv, alloc = linkers("mha")
    a1, _ = stored(lk, kv, alloc, list(range(2 * PAGE)), seed=20)
    b1, _ = stored(lk, kv, alloc, list(range(50, 50 + 2 * PAGE)), seed=21)
    a2, _ = stored(lk, kv, alloc, list(range(200, 200 + 2 * PAGE)), seed=22)
    assert drain_offloads(lk, 3) == [True] * 3
    scope = {name: {lk.store.page_info(k).scope_id for k in keys} for name, keys in
             {"a1": a1, "b1": b1, "a2": a2}.items()}
    assert all(len(s) == 1 for s in scope.values())  # one offload's pages: one chain, one scope
    assert len(set.union(*scope.values())) == 3  # no session id: no parent across offloads
    assert len(lk.sessions) == 0


def test_completed_offloads_are_counted_and_popped_in_order(linkers):
    lk, kv, alloc = linkers("mha")
    stored(lk, kv, alloc, list(range(PAGE)), seed=30)
    bad_slots = alloc.alloc(PAGE)
    assert lk.offload(offload_transfer(bad_slots, [""]))  # an unusable key: queued, then fails
    stored(lk, kv, alloc, list(range(10, 10 + PAGE)), seed=31)
    assert not lk.offload(offload_transfer(bad_slots[:2], page_hashes([5] * PAGE)))  # not whole pages
    assert lk.flush_writes(30)
    assert lk.num_completed_offloads() == 3
    assert [lk.pop_completed_offload() for _ in range(3)] == [True, False, True]
    assert lk.num_completed_offloads() == 0
    assert lk.pop_completed_offload() is False
    st = lk.linker_stats()
    assert (st["offloads"], st["offload_failures"], st["offload_pages"]) == (3, 1, 2)


def test_reset_quiesces_and_forgets_and_close_releases_the_store(linkers):
    lk, kv, alloc = linkers("mha")
    keys, _ = stored(lk, kv, alloc, list(range(2 * PAGE)), seed=40, session_id="s")
    assert lk.load("r", load_transfer(alloc, page_hashes([1] * PAGE)))
    lk.reset()
    assert lk.num_completed_offloads() == 0 and len(lk.sessions) == 0
    assert lk.start_layer_wise_loading() == -1  # the queued load was dropped
    assert lk.layer_done_counter.producer_index == -1
    assert lk.lookup("r", lookup_transfer(keys)) == [1, 2]  # stored pages stay stored
    lk.close()
    lk.close()  # idempotent
    assert lk.store.closed
    assert lk.lookup("r", lookup_transfer(keys)) == []  # after close: misses, never a raise
    assert lk.offload(offload_transfer(alloc.alloc(PAGE), page_hashes([2] * PAGE))) is False
    assert lk.load("x", load_transfer(alloc, keys)) is False
    assert lk.start_layer_wise_loading() == -1
    assert lk.num_completed_offloads() == 0


def test_bad_configuration_fails_at_construction_naming_the_field(ssd_dir):
    with pytest.raises(ConfigError, match="ssd.bogus"):
        make_linker(ssd_dir, "mha", {"ssd.bogus": 1})
    with pytest.raises(ConfigError, match="cio.gap_bytes"):
        make_linker(ssd_dir, "mha", {"cio.gap_bytes": -1})


def test_a_swa_component_over_a_plain_kv_pool_is_refused_at_construction(ssd_dir):
    from types import SimpleNamespace

    from sglang.srt.mem_cache.unified_cache.linker_factory import create_unified_cache_linker

    lk, _, alloc = make_linker(ssd_dir, "mha")
    lk.close()
    params = SimpleNamespace(page_size=PAGE, token_to_kv_pool_allocator=alloc)
    config = {"linker": "FlatCakeLinker", "linker_module_path": "flatcake.linker",
              "linker_extra_config": {"ssd.path": ssd_dir}}
    with pytest.raises(ValueError, match="component SWA needs SGLang's SWAKVPool"):  # test_linker_hybrid.py: SWA
        create_unified_cache_linker(SimpleNamespace(model_path="m"), params, backend="dynamic", config=config,
                                    components={ComponentType.FULL, ComponentType.SWA})


def test_an_offload_reads_the_device_pages_only_after_its_record_offload_ready_events(linkers):
    lk, kv, alloc = linkers("mha")
    seen = []

    class Gate:  # stands for a device event: the forward still writing the pages until it fires
        def synchronize(self):
            seen.append(("synchronize", lk.store.exists(keys[0])))

    lk.record_offload_ready = lambda: [Gate()]
    keys = page_hashes(list(range(2 * PAGE)))
    slots = alloc.alloc(2 * PAGE)
    fill(kv, slots, 50)
    assert lk.offload(offload_transfer(slots, keys), session_id="s")
    assert drain_offloads(lk, 1) == [True]
    assert seen == [("synchronize", False)]  # waited before anything of it was stored
    assert lk.store.exists(keys[0])


def test_two_requests_loading_the_same_pages_in_one_batch_both_land(linkers):
    lk, kv, alloc = linkers("mla")
    keys, slots = stored(lk, kv, alloc, list(range(2 * PAGE)), seed=60)
    assert drain_offloads(lk, 1) == [True]
    la, lb = load_transfer(alloc, keys), load_transfer(alloc, keys)
    assert lk.load("a", la) and lk.load("b", lb)
    index = lk.start_layer_wise_loading()
    assert lk.finish_layer_wise_loading(index)
    for t in (la, lb):
        assert layers_equal(snapshot(kv, slots), snapshot(kv, t[0].device_indices)) == [True] * LAYERS
    assert lk.linker_stats()["load_pages"] == 4
    assert lk.lookup("c", lookup_transfer(keys)) == [1, 2]  # every pin was given back: still served


def test_a_load_of_pages_gone_since_the_lookup_fails_every_layer_and_writes_nothing(linkers):
    lk, kv, alloc = linkers("mha")
    keys, _ = stored(lk, kv, alloc, list(range(2 * PAGE)), seed=70)
    assert drain_offloads(lk, 1) == [True]
    assert lk.lookup("r", lookup_transfer(keys)) == [1, 2]
    lk.store.clear()  # reclaimed between SGLang's lookup and its load
    load = load_transfer(alloc, keys)
    before = snapshot(kv, load[0].device_indices)
    assert lk.load("r", load)
    index = lk.start_layer_wise_loading()
    futures = list(lk.layer_done_counter.futures[index])
    assert lk.finish_layer_wise_loading(index) is False
    assert all(isinstance(f.exception(), LinkerLoadError) for f in futures)
    assert "layer 0 did not land (0 of 2 pages" in str(futures[0].exception())
    assert layers_equal(before, snapshot(kv, load[0].device_indices)) == [True] * LAYERS


def test_a_sessions_offloads_carry_its_context_length_into_table_2(linkers):
    lk, kv, alloc = linkers("mha", {"placement.l_agent_tokens": 3 * PAGE, "dram.capacity_bytes": 1 << 20})
    a1, _ = stored(lk, kv, alloc, list(range(2 * PAGE)), seed=80, session_id="agent")
    assert drain_offloads(lk, 1) == [True]
    assert lk.store.page_info(a1[0]).reuse == "one_shot"  # 8 tokens of context: turn 1, short
    assert lk.store.drop_keys(a1) == 1  # the session's scope reclaimed: its next round opens a new one
    a2, _ = stored(lk, kv, alloc, list(range(100, 100 + 2 * PAGE)), seed=81, session_id="agent")
    b, _ = stored(lk, kv, alloc, list(range(200, 200 + 2 * PAGE)), seed=82)
    assert drain_offloads(lk, 2) == [True, True]
    assert lk.store.page_info(a2[0]).reuse == "agent_session"  # 16 tokens of session context >= L_agent
    assert lk.store.page_info(b[0]).reuse == "one_shot"  # no session: the offload's own 8 tokens


def test_dram_pages_and_ssd_pages_of_one_batch_both_land_layer_by_layer(linkers):
    lk, kv, alloc = linkers("mha", {"dram.capacity_bytes": 1 << 20})
    shared = page_hashes(list(range(2 * PAGE)))
    for rid, tail in (("a", 1), ("b", 2)):  # two requests ask for the shared prompt before it is stored
        assert lk.lookup(rid, lookup_transfer(shared + page_hashes([tail] * PAGE, shared[-1]))) == []
    slots_d = alloc.alloc(2 * PAGE)
    fill(kv, slots_d, 90)
    assert lk.offload(offload_transfer(slots_d, shared))
    own, slots_s = stored(lk, kv, alloc, list(range(700, 700 + 2 * PAGE)), seed=91)
    assert drain_offloads(lk, 2) == [True, True]
    assert [lk.store.medium_of(k) for k in shared + own] == ["dram", "dram", "ssd", "ssd"]
    ld, ls = load_transfer(alloc, shared), load_transfer(alloc, own)
    assert lk.load("d", ld) and lk.load("s", ls)
    index = lk.start_layer_wise_loading()
    assert lk.finish_layer_wise_loading(index)
    assert layers_equal(snapshot(kv, slots_d), snapshot(kv, ld[0].device_indices)) == [True] * LAYERS
    assert layers_equal(snapshot(kv, slots_s), snapshot(kv, ls[0].device_indices)) == [True] * LAYERS
    st = lk.store.stats.snapshot()
    assert (st["hit_pages_dram"], st["hit_pages_ssd"]) == (2, 2)


def test_the_forward_runs_layer_0_while_later_layers_are_still_being_read(linkers):
    import threading

    lk, kv, alloc = linkers("mha")
    keys, slots = stored(lk, kv, alloc, list(range(2 * PAGE)), seed=100)
    assert drain_offloads(lk, 1) == [True]
    reader = lk.store.reader
    real_read, layer1_may_start = reader.read, threading.Event()

    def read(keys, entries, layout, page_ids, layers=None):
        if layers is not None and list(layers) == [1]:
            assert layer1_may_start.wait(30)  # held until the forward has computed on layer 0
        return real_read(keys, entries, layout, page_ids, layers)

    reader.read = read
    load = load_transfer(alloc, keys)
    assert lk.load("r", load)
    counter = lk.layer_done_counter
    index = lk.start_layer_wise_loading()
    counter.set_consumer(index)
    counter.wait_until(0)  # layer 0 landed: the forward computes on it ...
    assert not counter.futures[index][1].done()  # ... while layer 1 is still to be read
    assert layers_equal(snapshot(kv, slots), snapshot(kv, load[0].device_indices))[0]
    layer1_may_start.set()
    assert lk.finish_layer_wise_loading(index)
    assert layers_equal(snapshot(kv, slots), snapshot(kv, load[0].device_indices)) == [True] * LAYERS


def test_ssd_path_placeholders_are_filled_for_the_rank_as_the_hicache_door_fills_them(ssd_dir):
    lk, _, _ = make_linker(ssd_dir, "mha", {"ssd.path": ssd_dir + "/rank{tp_rank}-pp{pp_rank}"})
    try:
        assert list(lk.cfg.ssd.paths) == [ssd_dir + "/rank0-pp0"]
        assert lk.store.ssd.path_of(0).startswith(ssd_dir + "/rank0-pp0/")
    finally:
        lk.close()
