"""The device pools of a hybrid model as the direct linker sees them: FULL, SWA and MAMBA components.

SGLang 0.5.23 builds ``UnifiedRadixCache`` with the tree components FULL, + SWA for a
sliding-window hybrid (``SWAKVPool``: gpt-oss, Gemma-style interleaved windows), + MAMBA for a
linear-attention hybrid (``HybridLinearKVPool`` and the Mamba state in
``HybridReqToTokenPool``: Qwen3-Next, Nemotron-H, Kimi-Linear), or all three (``SWAKVPool`` +
Mamba state), and hands the linker those components (``mem_cache/registry.py:165-169, 200-219``).
``UnifiedCacheLinkerWrapper`` then gives every call one :class:`PoolTransfer` per component
(``unified_cache_linker.py:307-314, 409-423, 501-510``):

========= ================================ ============================================= =================
component pool name / hit policy           keys and ``device_indices``                   device pool
========= ================================ ============================================= =================
FULL      ``kv`` / ``all_pages``           every page of the node (offload) or tail;     FULL attention
                                           token slots, ``len(keys) * page_size``       pool (MHA / MLA)
SWA       ``swa`` / ``trailing_pages``     offload: the node's pages still holding SWA   ``swa_kv_pool``
                                           KV; lookup / load: the last
                                           ``ceil(window / page_size)`` pages of the tail;
                                           SWA-pool token slots
MAMBA     ``mamba`` / ``trailing_pages``   ``[last key of the node / tail]``; one Mamba  ``mamba_pool``
                                           state slot (a row of every state tensor)      (one row a page)
========= ================================ ============================================= =================

(``components/full.py:478-516``, ``components/swa.py:1239-1287``, ``components/mamba.py:729-759``.)

The linker stores each extra pool in its own :class:`~flatcake.store.page_store.PageStore`, keyed by the
KV page hashes the transfer names, as the HiCache door's v2 interface stores SWA windows and
Mamba states (:mod:`flatcake.adapter.v2`: namespace = KV's + the pool name, capacity by
:func:`~flatcake.adapter.v2.capacity_weight`, the pool's pages dropped with each freed KV scope).

A transfer layer is a model layer of this pipeline stage (``layer_id - start_layer``, what the
pools' ``wait_until`` is called with): each maps to one layer of one pool, by SGLang's own
mappings (``hybrid_pool_assembler._swa_layer_mappings``, ``_stage_local_layer_mapping``).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional, Sequence

import torch
from sglang.srt.mem_cache.hicache_storage import PoolHitPolicy, PoolName, PoolTransfer
from sglang.srt.mem_cache.unified_cache.component_type import ComponentType

from flatcake.common.layout import KvPageLayout, PageGeometry
from flatcake.linker.device_kv import device_kv_of

#: tree components SGLang 0.5.23's ``UnifiedCacheLinkerWrapper`` drives (``_EXTERNAL_LINKER_SUPPORTED_COMPONENTS``)
LINKER_COMPONENTS = frozenset({ComponentType.FULL, ComponentType.SWA, ComponentType.MAMBA})


class UnsupportedComponentError(ValueError):
    """A tree component (or combination) the FlatCake linker cannot restore; the message names
    the component and the reason."""


@dataclass
class LinkerPool:
    """One extra device pool (SWA KV or Mamba state) stored by the linker.

    Attributes:
        name: SGLang's pool name (``"swa"``, ``"mamba"``).
        device_pool: the SGLang device pool (``swa_kv_pool`` / ``mamba_pool``): ``pools[name]``.
        layout: per-layer uint8 page views of its buffers.
        page_size: device slots per stored page (SWA: the tree's page size; Mamba: 1, a state row).
        layer_map: transfer layer -> this pool's layer.
        store: its page store (opened by the linker).
    """

    name: str
    device_pool: object
    layout: KvPageLayout
    page_size: int
    layer_map: dict
    store: Optional[object] = None


@dataclass(frozen=True)
class PoolPlan:
    """What the linker restores for a tree.

    Attributes:
        full_pool: the FULL attention device pool (``MHATokenToKVPool`` / ``MLATokenToKVPool``).
        full_layers: transfer layer -> FULL pool layer (``None``: identity, a plain model).
        extras: the SWA / Mamba pools.
        num_layers: transfer layers (``layer_done_counter``'s layers; ``None``: the FULL pool's).
        state_pool: the ``req_to_token_pool`` whose Mamba layers wait on the layer counter, or None.
    """

    full_pool: object
    full_layers: Optional[dict] = None
    extras: tuple = field(default_factory=tuple)
    num_layers: Optional[int] = None
    state_pool: Optional[object] = None


def _names(components) -> str:
    return ", ".join(sorted(getattr(c, "name", str(c)) for c in components))


def plan_pools(kvcache, params, components, page_size: int) -> PoolPlan:
    """The pools the linker stores for ``components`` over SGLang's device pools.

    Args:
        kvcache: ``token_to_kv_pool_allocator.get_kvcache()``.
        params: SGLang's ``CacheInitParams`` (``req_to_token_pool`` holds the Mamba state).
        components: the tree's components (``set(cache.components)``).
        page_size: tokens per page.

    Raises:
        UnsupportedComponentError: a component SGLang's wrapper does not drive (C128: refused by
            ``UnifiedCacheLinkerWrapper``, ``unified_cache_linker.py:252-260``), a tree without
            FULL, SWA over a pool that is not a plain ``SWAKVPool`` (DeepSeek-V4), MAMBA over a
            pool that is neither ``HybridLinearKVPool`` nor ``SWAKVPool``, Mamba side states
            (int8 checkpoints, short-conv, n-gram: not in the MAMBA transfer), the unified Mamba
            memory, DCP or draft KV pools with a hybrid tree. Each message names the component.
        flatcake.common.layout.UnsupportedLayoutError: a FULL / SWA pool other than MHA / MLA.
    """
    comps = frozenset(components or {ComponentType.FULL})
    other = comps - LINKER_COMPONENTS
    if other:
        raise UnsupportedComponentError(
            f"FlatCakeLinker: tree component {_names(other)} is not supported: SGLang 0.5.23's "
            "UnifiedCacheLinkerWrapper drives FULL, SWA and MAMBA only (unified_cache_linker.py:59-65, 252-260)")
    if ComponentType.FULL not in comps:
        raise UnsupportedComponentError(f"FlatCakeLinker: a tree of {_names(comps)} has no FULL component: "
                                        "the wrapper's loads are anchored on the FULL (kv) transfer")
    if comps == {ComponentType.FULL}:
        return PoolPlan(kvcache)
    _refuse_hybrid_extras(params, comps)
    extras: list[LinkerPool] = []
    from sglang.srt.mem_cache.hybrid_cache.hybrid_pool_assembler import (_stage_local_layer_mapping,
                                                                         _swa_layer_mappings)
    if ComponentType.SWA in comps:
        swa_kv = _swa_kv_pool(kvcache)
        full_layers, swa_layers = _swa_layer_mappings(kvcache)
        full_pool = kvcache.full_kv_pool
        swa = device_kv_of(swa_kv.swa_kv_pool, page_size)
        extras.append(LinkerPool(PoolName.SWA.value, swa.pool, swa.layout, page_size, swa_layers))
    else:
        from sglang.srt.mem_cache.memory_pool import HybridLinearKVPool

        if not isinstance(kvcache, HybridLinearKVPool):
            raise UnsupportedComponentError(
                f"FlatCakeLinker: component MAMBA needs SGLang's HybridLinearKVPool (or SWAKVPool with a Mamba "
                f"state pool); got {type(kvcache).__name__}")
        full_pool = kvcache.full_kv_pool
        full_layers = _stage_local_layer_mapping(kvcache.full_attention_layer_id_mapping, kvcache.start_layer)
    state_pool = None
    if ComponentType.MAMBA in comps:
        state_pool = params.req_to_token_pool
        extras.append(mamba_pool_of(state_pool, _stage_local_layer_mapping(state_pool.mamba_map,
                                                                           kvcache.start_layer)))
    num_layers = max(max(full_layers, default=-1), *(max(p.layer_map, default=-1) for p in extras)) + 1
    return PoolPlan(full_pool, dict(full_layers), tuple(extras), num_layers, state_pool)


def _swa_kv_pool(kvcache):
    """``kvcache`` when it is a plain ``SWAKVPool`` (not DeepSeek-V4's)."""
    from sglang.srt.mem_cache.swa_memory_pool import SWAKVPool

    try:
        from sglang.srt.mem_cache.deepseek_v4_memory_pool import DeepSeekV4TokenToKVPool
    except ImportError:  # pragma: no cover - every 0.5.23 wheel has it
        DeepSeekV4TokenToKVPool = ()
    if not isinstance(kvcache, SWAKVPool) or (DeepSeekV4TokenToKVPool and isinstance(kvcache, DeepSeekV4TokenToKVPool)):
        raise UnsupportedComponentError(
            f"FlatCakeLinker: component SWA needs SGLang's SWAKVPool (full_kv_pool + swa_kv_pool); got "
            f"{type(kvcache).__name__} (DeepSeek-V4's compressed pools are not supported by this linker)")
    return kvcache


def _refuse_hybrid_extras(params, comps) -> None:
    """Draft KV pools and DCP with a hybrid tree: their pages are not in the transfers this
    linker stores (SGLang's own assembler refuses them too: ``linker_pool_assembler.py:566-577``)."""
    drafts = tuple(getattr(params, "mtp_draft_device_pools", None) or ()) + tuple(
        getattr(params, "sidecar_draft_device_pools", None) or ())
    if drafts:
        raise UnsupportedComponentError(f"FlatCakeLinker: a {_names(comps)} tree with speculative draft KV pools is "
                                        "not supported (the draft pools' pages are not stored)")
    try:
        from sglang.srt.runtime_context import get_parallel

        dcp = int(getattr(get_parallel(), "attn_dcp_size", 1) or 1)
    except Exception:  # no server context (tools, tests): no DCP
        dcp = 1
    if dcp > 1:
        raise UnsupportedComponentError(f"FlatCakeLinker: a {_names(comps)} tree with decode context parallelism "
                                        f"(attn_dcp_size={dcp}) is not supported")


def mamba_pool_of(req_to_token_pool, layer_map: dict) -> LinkerPool:
    """The Mamba state of ``HybridReqToTokenPool`` as pages of one state row: per Mamba layer
    the planes ``temporal[layer]``, ``conv[i][layer]`` (empty states left out, as SGLang's
    ``_mamba_device_pool_entry`` does), row ``slot`` of each; page ``slot`` = state slot ``slot``.

    Raises:
        UnsupportedComponentError: int8 Mamba checkpoints or side states (short-conv, n-gram),
            the unified memory, or state rows that are not contiguous byte ranges (named).
    """
    if getattr(req_to_token_pool, "mamba_pool", None) is None:
        raise UnsupportedComponentError("FlatCakeLinker: component MAMBA needs a req_to_token_pool with a "
                                        f"mamba_pool; got {type(req_to_token_pool).__name__}")
    try:
        from sglang.srt.runtime_context import get_memory

        unified = bool(getattr(get_memory(), "enable_unified_memory", False))
    except Exception:  # no server context: no unified memory
        unified = False
    if unified:
        raise UnsupportedComponentError("FlatCakeLinker: component MAMBA with --enable-unified-memory is not "
                                        "supported (virtual Mamba ids; SGLang refuses it too)")
    side = [n for n, on in (("int8 Mamba checkpoints", getattr(req_to_token_pool, "mamba_ckpt_pool", None) is not None),
                            ("short-conv states", _enabled(req_to_token_pool, "short_conv_pool")),
                            ("n-gram states", _enabled(req_to_token_pool, "ngram_pool"))) if on]
    if side:
        raise UnsupportedComponentError(f"FlatCakeLinker: component MAMBA with {', '.join(side)} is not supported: "
                                        "the tree's MAMBA transfer names the state slot only, so those states "
                                        "would not be restored")
    pool = req_to_token_pool.mamba_pool
    cache = pool.mamba_cache
    states = [s for s in (cache.temporal, *cache.conv) if s.numel() > 0]
    layers = int(pool.num_mamba_layers)
    planes = [[_rows_u8(s[layer], f"mamba state {i} layer {layer}") for i, s in enumerate(states)]
              for layer in range(layers)]
    rows = min(int(p.shape[0]) for p in planes[0])
    geometry = PageGeometry(layers, 1, tuple(int(p.shape[-1]) for p in planes[0]))

    def views(layer: int):
        return [p[:rows] for p in planes[layer]]

    layout = KvPageLayout(geometry, views, rows, states[0].device, "device-mamba-rows")
    return LinkerPool(PoolName.MAMBA.value, pool, layout, 1, dict(layer_map))


def _enabled(owner, attr: str) -> bool:
    sub = getattr(owner, attr, None)
    return bool(sub is not None and getattr(sub, "enabled", False))


def _rows_u8(t: torch.Tensor, what: str) -> torch.Tensor:
    """``t`` (``[rows, ...]``) as uint8 ``[rows, 1, row_bytes]`` sharing its memory.

    Raises:
        UnsupportedComponentError: a row is not one contiguous byte range (no view possible).
    """
    if t.dim() < 1 or not t[0].is_contiguous():
        raise UnsupportedComponentError(f"FlatCakeLinker: {what}: a state row is not contiguous "
                                        f"(shape {tuple(t.shape)}, strides {t.stride()})")
    flat = t.reshape(t.shape[0], -1) if t.dim() != 2 else t
    if flat.data_ptr() != t.data_ptr() or flat.untyped_storage().data_ptr() != t.untyped_storage().data_ptr():
        raise UnsupportedComponentError(f"FlatCakeLinker: {what}: rows cannot be viewed as bytes")
    if flat.dim() == 2 and flat.shape[0] > 1 and flat.stride(1) != 1:
        raise UnsupportedComponentError(f"FlatCakeLinker: {what}: a state row is not contiguous")
    return flat.view(torch.uint8).unsqueeze(1)


def restorable_lengths(has, kv_keys: Sequence[str], transfer: PoolTransfer) -> set:
    """Prefix lengths (pages, 1..``len(kv_keys)``) ``transfer``'s pool can restore, with the
    semantics of SGLang's ``batch_exists_v2`` (``hicache_storage.py:981-1033``):
    ``trailing_pages``: the last ``len(transfer.keys)`` KV pages before the cut are stored in
    this pool (SWA: the window; Mamba: the one state keyed by the cut's last page);
    ``all_pages``: every page before the cut.

    Args:
        has: ``has(key) -> bool`` of the pool's store.
        kv_keys: the KV leading run (page keys, tail-relative).
        transfer: the pool's lookup transfer.
    """
    n = len(kv_keys)
    present = [has(k) for k in kv_keys]
    if PoolHitPolicy(transfer.hit_policy) == PoolHitPolicy.TRAILING_PAGES:
        window = max(1, len(transfer.keys) if transfer.keys else 1)
        return {m for m in range(1, n + 1) if all(present[max(0, m - window):m])}
    run = next((i for i, p in enumerate(present) if not p), n)
    return set(range(1, run + 1))
