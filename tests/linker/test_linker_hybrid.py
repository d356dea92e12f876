"""``FlatCakeLinker`` with SWA and MAMBA tree components, over SGLang 0.5.23's real hybrid device
pools on CPU (``SWAKVPool``, ``HybridLinearKVPool``, ``HybridReqToTokenPool`` / ``MambaPool``),
built by SGLang's ``linker_factory``; the transfers are built as the tree components build them
(``components/full.py:478-516``, ``components/swa.py:1239-1287``, ``components/mamba.py:729-759``).

The store holds three nodes of one request: A (pages 0-2), B (pages 3-4), C (pages 5-7). B's
SWA KV was tombstoned before its offload (the SWA component then builds no transfer), and each
node carries its Mamba state at its end. With a window of 2 pages the restorable lengths are
sparse: SWA ``[1, 2, 3, 7, 8]``, MAMBA ``[3, 5, 8]``, both ``[3, 8]``.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from hybrid_kit import COMPONENTS, FULL, LAYERS, SLOTS, SWA, Model, same
from linker_kit import PAGE, drain_offloads, page_hashes
from sglang.srt.mem_cache.allocator.paged import PagedTokenToKVPoolAllocator
from sglang.srt.mem_cache.cache_init_params import CacheInitParams
from sglang.srt.mem_cache.hicache_storage import PoolHitPolicy, PoolName, PoolTransfer
from sglang.srt.mem_cache.memory_pool import MHATokenToKVPool
from sglang.srt.mem_cache.unified_cache.component_type import ComponentType
from sglang.srt.mem_cache.unified_cache.linker_factory import create_unified_cache_linker
from sglang.srt.mem_cache.unified_cache.unified_cache_linker import UnifiedCacheLinkerWrapper

from flatcake.linker.hybrid_pools import UnsupportedComponentError

WINDOW_PAGES = 2  # ceil(sliding_window_size / page_size): the SWA lookup / load transfer's keys
NODES = ((0, 3), (3, 5), (5, 8))  # pages [start, end) of nodes A, B, C
SWA_TOMBSTONED = {1}  # node B

# -------------------------------------------------------------------- transfers as the components build them
def kv_t(keys, slots=None):
    """Every page of the node / tail (``full.py:484-516``)."""
    return PoolTransfer(name=PoolName.KV, keys=list(keys),
                        device_indices=None if slots is None else slots.to(torch.int64))


def swa_t(keys, slots=None):
    """Lookup / load: the tail's last ``WINDOW_PAGES`` keys (``swa.py:1268-1276``); offload: the
    node's keys whose SWA slots are held (``swa.py:1248-1262``)."""
    return PoolTransfer(name=PoolName.SWA, keys=list(keys), hit_policy=PoolHitPolicy.TRAILING_PAGES,
                        device_indices=None if slots is None else slots.to(torch.int64))


def mamba_t(last_key, slot=None):
    """One state, keyed by the last page of the node / tail (``mamba.py:735-759``)."""
    return PoolTransfer(name=PoolName.MAMBA, keys=[last_key], hit_policy=PoolHitPolicy.TRAILING_PAGES,
                        device_indices=slot)


def offload_nodes(m: Model, lk, keys):
    """Compute and offload nodes A, B, C; returns what each component's source held per node."""
    src = []
    for i, (a, b) in enumerate(NODES):
        node_keys = keys[a:b]
        full = m.full_alloc.alloc((b - a) * PAGE)
        m.fill_kv(m.full, full, seed=10 + i)
        ts, held = [kv_t(node_keys, full)], {"full": m.kv_rows(m.full, full)}
        if m.swa is not None and i not in SWA_TOMBSTONED:
            swa = m.swa_alloc.alloc((b - a) * PAGE)
            m.fill_kv(m.swa, swa, seed=20 + i)
            ts.append(swa_t(node_keys, swa))
            held["swa"] = swa
        if m.r2t is not None:
            slot = m.r2t.mamba_allocator.alloc(1)
            m.fill_mamba(slot, seed=30 + i)
            ts.append(mamba_t(node_keys[-1], slot))
            held["mamba"] = m.mamba_rows(slot)
        assert lk.offload(ts, session_id="s1")
        src.append(held)
    assert drain_offloads(lk, len(NODES)) == [True] * len(NODES)
    return src


def lookup_ts(m: Model, tail):
    ts = [kv_t(tail)]
    if m.swa is not None:
        ts.append(swa_t(tail[-WINDOW_PAGES:]))
    if m.r2t is not None:
        ts.append(mamba_t(tail[-1]))
    return ts


def load(m: Model, lk, rid, tail):
    """Load ``tail`` (a restorable length) as ``load_back`` builds it; returns the destinations."""
    full = m.full_alloc.alloc(len(tail) * PAGE)
    ts, dst = [kv_t(tail, full)], {"full": full}
    if m.swa is not None:
        win = tail[-WINDOW_PAGES:]
        dst["swa"] = m.swa_alloc.alloc(len(win) * PAGE)
        ts.append(swa_t(win, dst["swa"]))
    if m.r2t is not None:
        dst["mamba"] = m.r2t.mamba_allocator.alloc(1)
        ts.append(mamba_t(tail[-1], dst["mamba"]))
    assert lk.load(rid, ts)
    index = lk.start_layer_wise_loading()
    assert lk.finish_layer_wise_loading(index)
    return dst


EXPECTED = {"swa": [1, 2, 3, 7, 8], "mamba": [3, 5, 8], "swa_mamba": [3, 8]}


@pytest.mark.parametrize("kind,scatter", [("swa", "torch"), ("mamba", "torch"), ("swa_mamba", "torch"),
                                          ("swa_mamba", "triton")])
def test_lookup_is_the_sparse_set_where_every_component_is_restorable_and_loads_are_bit_exact(ssd_dir, kind, scatter):
    """``triton``: FC-CIO's scatter kernel (Triton's interpreter here, TRITON_INTERPRET=1) into
    the KV, SWA and Mamba state views."""
    m = Model(kind, ssd_dir)
    lk = m.linker(scatter=scatter)
    try:
        assert lk.store.cio.scatter_impl == scatter and all(p.store.cio.scatter_impl == scatter for p in lk.extras)
        assert set(lk.pools) == {PoolName.KV} | {PoolName(n) for n in LAYERS[kind] if n != "full"}
        assert lk.num_layers == 4
        if m.r2t is not None:  # Mamba layers wait on the linker's counter through req_to_token_pool
            assert m.r2t.layer_transfer_counter is lk.layer_done_counter
        keys = page_hashes(list(range(8 * PAGE)))
        src = offload_nodes(m, lk, keys)
        assert lk.lookup("r", lookup_ts(m, keys)) == EXPECTED[kind]
        other = keys[:3] + page_hashes([7] * PAGE, keys[2])  # a request sharing node A only
        assert lk.lookup("r", lookup_ts(m, other)) == {"swa": [1, 2, 3], "mamba": [3], "swa_mamba": [3]}[kind]

        for rid, n in (("long", 8), ("short", 3)):  # the longest, and node A's boundary
            tail = keys[:n]
            dst = load(m, lk, rid, tail)
            node = next(i for i, (a, b) in enumerate(NODES) if b == n)
            want_full = [tuple(torch.cat([src[i]["full"][l][j] for i, (a, b) in enumerate(NODES) if a < n])
                               for j in (0, 1)) for l in range(len(m.full.k_buffer))]
            assert same(m.kv_rows(m.full, dst["full"]), want_full) == [True] * len(m.full.k_buffer)
            if m.swa is not None:  # the window: the last WINDOW_PAGES pages before the cut
                first = (n - WINDOW_PAGES) * PAGE
                owner = [i for i, (a, b) in enumerate(NODES) if a * PAGE <= first < b * PAGE][0]
                a0 = NODES[owner][0] * PAGE
                want = m.kv_rows(m.swa, src[owner]["swa"][first - a0:first - a0 + WINDOW_PAGES * PAGE])
                assert same(m.kv_rows(m.swa, dst["swa"]), want) == [True] * len(m.swa.k_buffer)
            if m.r2t is not None:  # the state of the node ending at the cut
                assert same(m.mamba_rows(dst["mamba"]), src[node]["mamba"]) == [True] * len(LAYERS[kind]["mamba"])
        st = lk.linker_stats()
        assert (st["load_pages"], st["load_failures"], st["offload_failures"]) == (11, 0, 0)
    finally:
        lk.close()


def test_a_cut_without_its_swa_window_fails_the_load_without_raising(ssd_dir):
    """A cut inside node B has no SWA window: the load of it lands no layer and reports False."""
    m = Model("swa", ssd_dir)
    lk = m.linker()
    try:
        keys = page_hashes(list(range(8 * PAGE)))
        offload_nodes(m, lk, keys)
        full = m.full_alloc.alloc(5 * PAGE)
        win = m.swa_alloc.alloc(WINDOW_PAGES * PAGE)
        assert lk.load("r", [kv_t(keys[:5], full), swa_t(keys[3:5], win)])
        index = lk.start_layer_wise_loading()
        assert lk.finish_layer_wise_loading(index) is False
        assert lk.linker_stats()["load_failures"] == 1
    finally:
        lk.close()


def test_swa_and_mamba_pages_are_dropped_with_the_kv_scope(ssd_dir):
    m = Model("swa_mamba", ssd_dir)
    lk = m.linker()
    try:
        keys = page_hashes(list(range(8 * PAGE)))
        offload_nodes(m, lk, keys)
        swa, mamba = lk._extra["swa"].store, lk._extra["mamba"].store
        assert [swa.exists(k) for k in keys] == [True] * 3 + [False] * 2 + [True] * 3
        assert [mamba.exists(k) for k in keys] == [False, False, True, False, True, False, False, True]
        lk.store.clear()  # the KV store frees every scope
        assert not any(swa.exists(k) or mamba.exists(k) for k in keys)
        assert lk.lookup("r", lookup_ts(m, keys)) == []
    finally:
        lk.close()


# -------------------------------------------------------------------- what SGLang itself cannot run
def test_a_component_sglangs_wrapper_refuses_is_refused_by_the_linker_too(ssd_dir):
    """C128 (NPU DeepSeek-V4's sidecar component): SGLang's wrapper refuses it
    (``unified_cache_linker.py:252-260``) after the linker is built; the linker refuses it first."""
    m = Model("swa", ssd_dir)
    with pytest.raises(UnsupportedComponentError, match="C128.*FULL, SWA and MAMBA only"):
        m.linker({FULL, SWA, ComponentType.C128})
    with pytest.raises(ValueError, match="supports only Full, SWA and Mamba tree components; unsupported: C128"):
        UnifiedCacheLinkerWrapper(SimpleNamespace(tree_components=(FULL, SWA, ComponentType.C128)), object())


def test_mamba_side_states_are_refused_as_sglangs_pool_assembler_refuses_them(ssd_dir, monkeypatch):
    """The MAMBA transfer names the state slot only: an int8 checkpoint pool (or short-conv /
    n-gram state) would not be restored. SGLang's ``_mamba_device_pool_entry`` refuses it
    (``linker_pool_assembler.py:501-510``)."""
    import sglang.srt.mem_cache.hybrid_cache.linker_pool_assembler as lpa

    m = Model("mamba", ssd_dir)
    m.r2t.mamba_ckpt_pool = object()
    monkeypatch.setattr(lpa, "get_memory", lambda: SimpleNamespace(enable_unified_memory=False))
    with pytest.raises(ValueError, match="does not support int8 Mamba checkpoints or Mamba side states"):
        lpa._mamba_device_pool_entry(m.r2t, 0)
    with pytest.raises(UnsupportedComponentError, match="component MAMBA with int8 Mamba checkpoints"):
        m.linker()


def test_swa_over_a_pool_sglang_has_no_swa_strategy_for_is_refused(ssd_dir):
    """SWA over a plain MHA pool: SGLang has no hybrid strategy for it (``_select_strategy``)."""
    from sglang.srt.mem_cache.hybrid_cache.hybrid_pool_assembler import _select_strategy

    kv = MHATokenToKVPool(size=SLOTS, page_size=PAGE, dtype=torch.bfloat16, head_num=2, head_dim=16, layer_num=2,
                          device="cpu", enable_memory_saver=False)
    with pytest.raises(AssertionError, match="No matching HiCache strategy"):
        _select_strategy(kv, {FULL, SWA})
    alloc = PagedTokenToKVPoolAllocator(SLOTS, PAGE, kv.dtype, "cpu", kv, need_sort=False)
    params = CacheInitParams(disable=False, req_to_token_pool=None, token_to_kv_pool_allocator=alloc, page_size=PAGE)
    config = {"linker": "FlatCakeLinker", "linker_module_path": "flatcake.linker",
              "linker_extra_config": {"ssd.path": ssd_dir}}
    with pytest.raises(UnsupportedComponentError, match="component SWA needs SGLang's SWAKVPool"):
        create_unified_cache_linker(SimpleNamespace(model_path="m"), params, backend="dynamic", config=config,
                                    components={FULL, SWA})


def test_sglangs_own_linkers_refuse_what_flatcake_restores(ssd_dir):
    """SGLang 0.5.23's Mooncake / Mori linkers build their pools with
    ``resolve_hybrid_device_pool_group``: FULL + SWA has no direct-linker strategy
    (``hybrid_pool_assembler.py:1872-1879``) and FULL + MAMBA needs an MLA full pool
    (``linker_pool_assembler.py:566-577``). The wrapper itself drives both."""
    from sglang.srt.mem_cache.hybrid_cache.linker_pool_assembler import resolve_hybrid_device_pool_group

    for kind, why in (("swa", "does not support the direct external linker: _SwaStrategy"),
                      ("mamba", "supports FULL \\+ MAMBA models only with a plain MLA pool")):
        m = Model(kind, ssd_dir)
        with pytest.raises(ValueError, match=why):
            resolve_hybrid_device_pool_group(kvcache=m.kv, page_size=PAGE, params=m.params,
                                             components=COMPONENTS[kind])
