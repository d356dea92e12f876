"""Stand-ins for the CUDA-only pieces outside HiCache that stop a real SGLang 0.5.23 server on a
CPU-only machine (``../shared/design/sglang-cpu-server-facts.md``).

With them, ``SGLANG_USE_CPU_ENGINE=1 python -m sglang.launch_server --device cpu
--attention-backend torch_native ...`` serves requests with HiCache and FlatCake as L3, so SGLang's
own scheduler, cache controller, prefetch/backup threads, prefetch policies, host pool and metrics
drive FlatCake in tests (``tests/e2e/``) and for anyone developing without a GPU.

:func:`install` acts only when CUDA is absent (``torch.cuda.is_available()`` is False), and each
shim acts only on a name SGLang left unbound or on a call that cannot run without CUDA:

=====  =====================================================  ======================================
#      what it replaces                                        why it does not change what is tested
=====  =====================================================  ======================================
1      ``sgl_kernel`` (PyPI's wheels are CUDA-only), imported   The CPU engine's model-side helpers.
       by the CPU engine's KV-cache and allocation helpers:    Two are called and get the real
       an import-only stand-in package. Every name imports;    semantics (a row memmove, a slot
       ``copy_all_layer_kv_cache_cpu`` and                     assignment); any other name raises
       ``assign_req_to_token_pool_cpu`` do what the C++ ops     ``NotImplementedError`` naming itself
       do (in torch); any other raises when called.            when called (none is on this path).
2      ``torchvision`` (PyPI's wheels do not load beside the   Names only, for the multimodal
       CPU torch 2.13.0): FlatCake's names-only stand-in.       processors; never called for text.
3      host pools built with ``pin_memory=True`` (the default:  Pinning only speeds DMA; the pool's
       ``torch.empty(pin_memory=True)`` / ``cudaHostRegister``  bytes, layout and every storage call
       need CUDA): ``pin_memory=False`` when CUDA is absent.    are unchanged.
4      ``transfer_kv_direct``, ``transfer_kv_per_layer_direct  These are the L1 <-> L2 copies
       _pf_lf``, ``transfer_kv_all_layer_direct_lf_pf``, which (device KV <-> host pool), not L3; the
       ``pool_host/mha.py`` and ``pool_host/mla.py`` (MLA: one  torch versions follow sgl-kernel's
       latent buffer) bind from sgl-kernel only on CUDA or HIP  reference (``test_kvcacheio.py``) and
       (XPU: its own wheel): torch-indexing versions, bound     are tested against it here (MHA; MLA
       only where SGLang bound nothing.                         through the server's reference tokens).
5      ``torch.cpu.Stream`` lacks ``synchronize`` / ``query``   CPU work is synchronous: there is
       (``l2_transfer.py``'s error path calls them).            nothing to wait for.
6      MLA models (DeepSeek-V2 style): SGLang registers no      The absorbed MLA path is SGLang's own
       ``torch_native`` handler in ``deepseek_common/attention  (it already takes it for every extend
       _backend_handler.py``; the ``triton`` fallback sends a   with a cached prefix, i.e. after every
       prefix-less prefill to the MHA path, whose K/V           L2/L3 restore, and for every decode),
       (``attn_mha``: qk 128 / v 64 wide) ``torch_native``      mathematically the same attention, and
       then reads back from the 576-wide latent pool            it writes the same latent (normed
       (``RuntimeError: Expected size for first two dimensions  ``kv_a`` + roped ``k_pe``) per token
       of batch2 tensor to be: [4, 128] but got: [4, 576]``).   into the KV pool, so the pages HiCache
       A ``torch_native`` handler that always picks the         backs up and restores are the bytes the
       absorbed MLA path (``_dispatch_mla_subtype``),           MHA prefill would write. Registered
       registered only if SGLang registered none.               only where SGLang left the name unbound.
=====  =====================================================  ======================================

None touches the HiCache controller, the radix cache, prefetch/backup logic or any storage call.

SGLang's direct L3 path (``--enable-unified-cache-external-linker``: ``UnifiedRadixCache`` with an
external linker such as :class:`flatcake.FlatCakeLinker`, no HiCache) needs no shim beyond these:
its device pools are CPU tensors and ``get_device_module()`` is ``torch.cpu``, whose ``Event``
records and synchronizes (``docs/real-server.md``, "The direct linker server").

Apply them before SGLang's modules import: :func:`install` puts an import hook in place that
patches each named module right after it loads (the scheduler and detokenizer processes, started
with ``spawn``, get the same hook through :mod:`flatcake.testing.sitecustomize` on ``PYTHONPATH``;
:mod:`flatcake.testing.serve_cpu` sets that up).
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import importlib.util
import logging
import sys
import threading
import types
from typing import Callable, Dict, List, Sequence

import torch

log = logging.getLogger("flatcake.testing")

#: the environment switch that :mod:`flatcake.testing.sitecustomize` reads in child processes
ENV_SWITCH = "FLATCAKE_CPU_SHIMS"

_installed = False
_lock = threading.Lock()


# ---------------------------------------------------------------------------------- shim 4: L1<->L2
def transfer_kv_direct(src_layers: Sequence[torch.Tensor], dst_layers: Sequence[torch.Tensor],
                       src_indices: torch.Tensor, dst_indices: torch.Tensor, page_size: int) -> None:
    """sgl-kernel ``transfer_kv_direct``: for each (src, dst) layer pair,
    ``dst[dst_indices] = src[src_indices]`` (token rows; ``page_size`` only groups the rows)."""
    src_idx = src_indices.to(torch.long)
    dst_idx = dst_indices.to(torch.long)
    for src, dst in zip(src_layers, dst_layers):
        dst[dst_idx] = src[src_idx].to(dst.device)


def transfer_kv_per_layer_direct_pf_lf(src_ptrs: Sequence[torch.Tensor], dst_ptrs: Sequence[torch.Tensor],
                                       src_indices: torch.Tensor, dst_indices: torch.Tensor,
                                       layer_id: int, page_size: int) -> None:
    """sgl-kernel ``transfer_kv_per_layer_direct_pf_lf``: host ``page_first_direct`` buffers
    ``[page, layer, page_size, ...]`` -> one device layer ``[token, ...]`` per buffer (K, V; or the
    MLA latent). Token ``i`` of a page is row ``i`` of that page's ``[layer_id]`` block."""
    src_pages = (src_indices[::page_size] // page_size).to(torch.long)
    dst_idx = dst_indices.to(torch.long)
    for src, dst in zip(src_ptrs, dst_ptrs):
        block = src[src_pages, layer_id]  # [pages, page_size, ...]
        dst[dst_idx] = block.reshape(dst_idx.numel(), *block.shape[2:]).to(dst.device)


def transfer_kv_all_layer_direct_lf_pf(src_ptrs: Sequence[torch.Tensor], dst_ptrs: Sequence[torch.Tensor],
                                       src_indices: torch.Tensor, dst_indices: torch.Tensor,
                                       page_size: int) -> None:
    """sgl-kernel ``transfer_kv_all_layer_direct_lf_pf``: device layers (all K layers, then all V
    layers; or the MLA latents) -> host ``page_first_direct`` buffers ``[page, layer, page_size, ...]``."""
    buffers = len(dst_ptrs)
    layers = len(src_ptrs) // buffers
    src_idx = src_indices.to(torch.long)
    dst_pages = (dst_indices[::page_size] // page_size).to(torch.long)
    for b, dst in enumerate(dst_ptrs):
        for layer in range(layers):
            rows = src_ptrs[b * layers + layer][src_idx]
            dst[dst_pages, layer] = rows.reshape(dst_pages.numel(), page_size, *rows.shape[1:]).to(dst.device)


#: shim 4: the direct-io copy of each name SGLang binds from sgl-kernel (``pool_host/mha.py``, ``mla.py``)
DIRECT_COPIES = {
    "transfer_kv_direct": transfer_kv_direct,
    "transfer_kv_per_layer_direct_pf_lf": transfer_kv_per_layer_direct_pf_lf,
    "transfer_kv_all_layer_direct_lf_pf": transfer_kv_all_layer_direct_lf_pf,
}


# ---------------------------------------------------------------------------------- shim 1: sgl_kernel
def copy_all_layer_kv_cache_cpu(data_ptrs: torch.Tensor, strides: torch.Tensor,
                                tgt_loc: torch.Tensor, src_loc: torch.Tensor) -> None:
    """sgl-kernel ``copy_all_layer_kv_cache_cpu``: in every buffer (base address
    ``data_ptrs[b]``, row stride ``strides[b]`` bytes) copy row ``src_loc[i]`` to row ``tgt_loc[i]``
    (memmove semantics: all sources are read before any target is written)."""
    import ctypes

    import numpy as np

    src = src_loc.to(torch.long).tolist()
    tgt = tgt_loc.to(torch.long).tolist()
    if not src:
        return
    for base, stride in zip(data_ptrs.tolist(), strides.tolist()):
        rows = max(max(src), max(tgt)) + 1
        view = np.ctypeslib.as_array((ctypes.c_uint8 * (rows * stride)).from_address(base)).reshape(rows, stride)
        view[tgt] = view[src].copy()


def assign_req_to_token_pool_cpu(req_pool_indices: torch.Tensor, req_to_token: torch.Tensor,
                                 start_offset: torch.Tensor, end_offset: torch.Tensor,
                                 out_cache_loc: torch.Tensor, pool_len: int) -> None:
    """sgl-kernel ``assign_req_to_token_pool_cpu``: request ``i`` gets the next
    ``end_offset[i] - start_offset[i]`` slots of ``out_cache_loc`` at
    ``req_to_token[req_pool_indices[i], start_offset[i]:end_offset[i]]``."""
    pos = 0
    for req, start, end in zip(req_pool_indices.tolist(), start_offset.tolist(), end_offset.tolist()):
        n = end - start
        req_to_token[req, start:end] = out_cache_loc[pos:pos + n].to(req_to_token.dtype)
        pos += n


_SGL_KERNEL_IMPL: Dict[str, Callable] = {
    "copy_all_layer_kv_cache_cpu": copy_all_layer_kv_cache_cpu,
    "assign_req_to_token_pool_cpu": assign_req_to_token_pool_cpu,
}


#: names the CPU engine imports from ``sgl_kernel`` on the paths a text model takes, with no CPU
#: use on them: they import and raise ``NotImplementedError`` (naming themselves) if ever called
#: (all speculative decoding, which these tests do not run)
_SGL_KERNEL_IMPORT_ONLY = frozenset({
    "assign_draft_cache_locs_contiguous_cpu", "assign_extend_cache_locs_cpu", "build_tree_kernel_efficient_cpu",
    "fill_accept_out_cache_loc_cpu", "fill_bonus_tokens_cpu", "rotate_input_ids_cpu", "verify_tree_greedy_cpu",
})


def _unavailable(qualname: str) -> Callable:
    def _raise(*args, **kwargs):
        raise NotImplementedError(f"{qualname} is a FlatCake CPU stand-in (flatcake.testing.cpu_shims): "
                                  "sgl-kernel is not installed on this CPU-only machine")
    _raise.__name__ = qualname.rsplit(".", 1)[-1]
    _raise.__qualname__ = qualname
    return _raise


class _StandInModule(types.ModuleType):
    """The ``sgl_kernel`` stand-in: the names in :data:`_SGL_KERNEL_IMPL` and
    :data:`_SGL_KERNEL_IMPORT_ONLY`, and nothing else, so SGLang's ``try: from sgl_kernel... except
    ImportError`` fallbacks (and ``hasattr`` probes) behave as on a machine without sgl-kernel."""

    def __getattr__(self, name: str):
        if name in _SGL_KERNEL_IMPL:
            value = _SGL_KERNEL_IMPL[name]
        elif name in _SGL_KERNEL_IMPORT_ONLY:
            value = _unavailable(f"sgl_kernel.{name}")
        else:
            raise AttributeError(f"module 'sgl_kernel' (FlatCake CPU stand-in) has no attribute {name!r}")
        setattr(self, name, value)
        return value


class _SglKernelFinder(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Imports ``sgl_kernel`` (not its sub-modules) as a :class:`_StandInModule`; consulted last, so a
    real sgl-kernel on ``sys.path`` always wins."""

    def find_spec(self, fullname, path=None, target=None):
        if fullname != "sgl_kernel":
            return None
        return importlib.machinery.ModuleSpec(fullname, self)

    def create_module(self, spec):
        module = _StandInModule(spec.name)
        module.__flatcake_stand_in__ = True
        return module

    def exec_module(self, module):
        return None


# ---------------------------------------------------------------------------------- post-import hooks
def _patch_mha(module) -> List[str]:
    """Shim 4: bind the direct-io copies where ``pool_host/mha.py`` (or ``pool_host/mla.py``: the same
    three names, one latent buffer instead of K and V) bound nothing."""
    bound = []
    for name, fn in DIRECT_COPIES.items():
        if not hasattr(module, name):
            setattr(module, name, fn)
            bound.append(name)
    return bound


def _unpinned_init(init: Callable) -> Callable:
    def __init__(self, *args, **kwargs):
        kwargs["pin_memory"] = False
        return init(self, *args, **kwargs)
    __init__.__wrapped__ = init
    return __init__


def _patch_host_base(module) -> List[str]:
    """Shim 3: every host pool (they all pass ``pin_memory`` to ``HostKVCache.__init__``) unpinned."""
    cls = module.HostKVCache
    if getattr(cls.__init__, "__wrapped__", None) is None:
        cls.__init__ = _unpinned_init(cls.__init__)
    return ["HostKVCache.__init__(pin_memory=False)"]


def _patch_mla_dispatch(module) -> List[str]:
    """Shim 6: a ``torch_native`` entry in DeepSeek's ``AttentionBackendRegistry`` (absorbed MLA
    always), only if SGLang registered none."""
    registry = module.AttentionBackendRegistry
    if "torch_native" in registry._handlers:
        return []
    dispatch = module._dispatch_mla_subtype

    def handle_attention_torch_native(attn, forward_batch):
        return dispatch(attn, forward_batch)

    registry.register("torch_native", handle_attention_torch_native)
    return ["AttentionBackendRegistry['torch_native'] -> absorbed MLA"]


def _patch_cpu_stream() -> List[str]:
    """Shim 5: no-op ``synchronize`` / ``query`` on ``torch.cpu.Stream``."""
    done = []
    stream = torch.cpu.Stream
    if not hasattr(stream, "synchronize"):
        stream.synchronize = lambda self: None
        done.append("torch.cpu.Stream.synchronize")
    if not hasattr(stream, "query"):
        stream.query = lambda self: True
        done.append("torch.cpu.Stream.query")
    return done


_POST_IMPORT: Dict[str, Callable] = {
    "sglang.srt.mem_cache.pool_host.mha": _patch_mha,
    "sglang.srt.mem_cache.pool_host.mla": _patch_mha,
    "sglang.srt.mem_cache.pool_host.base": _patch_host_base,
    "sglang.srt.models.deepseek_common.attention_backend_handler": _patch_mla_dispatch,
}


class _PostImportLoader(importlib.abc.Loader):
    def __init__(self, loader, patch: Callable):
        self._loader = loader
        self._patch = patch

    def create_module(self, spec):
        return self._loader.create_module(spec)

    def exec_module(self, module):
        self._loader.exec_module(module)
        applied = self._patch(module)
        log.debug("flatcake CPU shims on %s: %s", module.__name__, applied)


class _PostImportFinder(importlib.abc.MetaPathFinder):
    """Wraps the loader of each module named in :data:`_POST_IMPORT` so its patch runs right after
    the module body."""

    def find_spec(self, fullname, path=None, target=None):
        patch = _POST_IMPORT.get(fullname)
        if patch is None:
            return None
        for finder in sys.meta_path:
            if finder is self or isinstance(finder, (_PostImportFinder, _SglKernelFinder)):
                continue
            spec = getattr(finder, "find_spec", lambda *a: None)(fullname, path, target)
            if spec is not None and spec.loader is not None:
                spec.loader = _PostImportLoader(spec.loader, patch)
                return spec
        return None


def cuda_absent() -> bool:
    """True when this process has no CUDA device (the only case the shims act in)."""
    return not torch.cuda.is_available()


def install() -> bool:
    """Put the six shims in place in this process (idempotent).

    Returns:
        True when they are active; False when CUDA is available (nothing is changed).
    """
    global _installed
    if not cuda_absent():
        return False
    with _lock:
        if _installed:
            return True
        from flatcake.replay.sglang_cpu import ensure_importable

        ensure_importable()  # shim 2: torchvision
        if importlib.util.find_spec("sgl_kernel") is None:
            sys.meta_path.append(_SglKernelFinder())  # shim 1, consulted after every real finder
        sys.meta_path.insert(0, _PostImportFinder())
        for name, patch in _POST_IMPORT.items():  # a module imported before install()
            if name in sys.modules:
                patch(sys.modules[name])
        _patch_cpu_stream()
        _installed = True
    return True
