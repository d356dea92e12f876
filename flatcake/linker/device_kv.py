"""The device KV pool as the direct linker sees it: page views and transfer indices.

SGLang's ``UnifiedRadixCache`` hands the linker device token slots (``PoolTransfer.device_indices``,
int64, ``len(keys) * page_size`` slots, page ``i`` at ``device_indices[i * page_size]``). The
linker reads and writes FlatCake pages straight into the device pool through a
:class:`~flatcake.common.layout.KvPageLayout` over its per-layer buffers, the same byte format the
HiCache door stores (``chunk(page, layer)`` = K rows ‖ V rows, or the MLA latent rows), so a page
is one page whichever door wrote it.

Supported pools (SGLang 0.5.23 ``memory_pool.py``): the FULL pool, and the ``swa_kv_pool`` of an
``SWAKVPool`` (Mamba state rows: :mod:`flatcake.linker.hybrid_pools`):

=================== ============================================ ===============================
pool                buffers                                      planes per layer
=================== ============================================ ===============================
MHATokenToKVPool    ``k_buffer[l]``, ``v_buffer[l]``:            2 (K, V)
                    ``[slots, heads, head_dim]``
MLATokenToKVPool    ``kv_buffer[l]``: ``[slots, 1, kv_cache_dim]`` 1 (latent + rope)
=================== ============================================ ===============================
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import numpy as np
import torch

from flatcake.common.layout import KvPageLayout, UnsupportedLayoutError


@dataclass(frozen=True)
class DeviceKv:
    """One device KV pool, paged.

    Attributes:
        pool: the SGLang device pool (``MHATokenToKVPool`` / ``MLATokenToKVPool``).
        layout: per-layer uint8 page views of its buffers (``[pages, page_size, row_bytes]``).
        is_mla: one latent plane per layer (MLA) rather than K and V.
        dtype: the pool's dtype (in the namespace: pages of another dtype are never read).
    """

    pool: object
    layout: KvPageLayout
    is_mla: bool
    dtype: torch.dtype

    @property
    def num_layers(self) -> int:
        """Layers of the pool (this rank's pipeline stage): chunks per page."""
        return self.layout.geometry.layers


def device_kv_of(pool, page_size: int) -> DeviceKv:
    """Page views over SGLang's device KV ``pool``.

    Args:
        pool: ``token_to_kv_pool_allocator.get_kvcache()``: an ``MHATokenToKVPool`` (``k_buffer`` /
            ``v_buffer`` lists) or an ``MLATokenToKVPool`` (``kv_buffer`` list), on any device.
        page_size: tokens per page (the tree's page size).

    Raises:
        UnsupportedLayoutError: another pool type (hybrid SWA / Mamba, DSA, DeepSeek-V4), separate
            scale buffers (fp8 with scales), or buffers whose slot count is not whole pages; the
            message names the pool.
    """
    name = type(pool).__name__
    if getattr(pool, "k_scale_buffer", None) is not None or getattr(pool, "native_k_scale_buffer", None) is not None:
        raise UnsupportedLayoutError(f"device pool {name}: separate KV scale buffers are not supported by the "
                                     "FlatCake linker")
    k, v = getattr(pool, "k_buffer", None), getattr(pool, "v_buffer", None)
    if isinstance(k, (list, tuple)) and isinstance(v, (list, tuple)) and k and len(k) == len(v):
        layers_k, layers_v, is_mla = list(k), list(v), False
    else:
        kv = getattr(pool, "kv_buffer", None)
        if not (isinstance(kv, (list, tuple)) and kv and all(isinstance(t, torch.Tensor) for t in kv)
                and hasattr(pool, "kv_cache_dim")):
            raise UnsupportedLayoutError(f"device pool {name}: the FlatCake linker supports MHATokenToKVPool and "
                                         "MLATokenToKVPool (FULL attention) only")
        layers_k, layers_v, is_mla = list(kv), None, True
    slots = int(layers_k[0].shape[0])
    if slots % page_size:
        raise UnsupportedLayoutError(f"device pool {name}: {slots} slots are not whole pages of {page_size}")
    layout = KvPageLayout.from_device_kv(layers_k, layers_v, page_size)
    return DeviceKv(pool, layout, is_mla, getattr(pool, "dtype", layers_k[0].dtype))


def page_ids_of(device_indices: torch.Tensor, n_pages: int, page_size: int) -> Optional[list[int]]:
    """Device page numbers of a transfer, or None when ``device_indices`` is not exactly
    ``n_pages`` whole page-aligned pages of ``page_size`` consecutive slots.

    Args:
        device_indices: int token slots ``[n_pages * page_size]`` (any device).
        n_pages: pages the transfer names (``len(keys)``).
        page_size: tokens per page.

    Returns:
        ``[device_indices[i * page_size] // page_size for i in range(n_pages)]``.
    """
    if device_indices is None:
        return None
    slots = device_indices.detach().to("cpu", torch.int64).reshape(-1).numpy()
    if slots.shape[0] != n_pages * page_size:
        return None
    starts = slots[::page_size]
    if (starts % page_size).any() or not (slots.reshape(n_pages, page_size)
                                          == starts[:, None] + np.arange(page_size)).all():
        return None
    return (starts // page_size).tolist()
