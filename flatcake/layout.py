"""Page geometry and byte views of KV buffers (host pool or device paged KV).

FlatCake stores a KV *page* (``page_size`` tokens) as ``layers`` *chunks*, one per layer.
A chunk is the page's bytes for one layer, planes back to back::

    chunk(page, layer) = plane_0 rows [page_size, row_bytes_0] ‖ plane_1 rows [page_size, row_bytes_1] ‖ …

MHA has two planes (K then V, ``row_bytes = head_num * head_dim * itemsize`` each); MLA has
one (``row_bytes = kv_cache_dim * itemsize``). On SSD a round of pages is written
layer-major (paper §3.3): chunk(p0,l0) chunk(p1,l0) … chunk(p0,l1) …, so restoring one layer
of a prefix is one contiguous byte range.

:class:`KvPageLayout` exposes, for any supported buffer, per-layer uint8 views of shape
``[num_pages, page_size, row_bytes]`` (strided; no copy), which the scatter kernel
(``flatcake.kernels.scatter``) writes into and :meth:`KvPageLayout.gather_chunks` reads from.

Supported host-pool layouts (SGLang 0.5.23 ``pool_host/mha.py`` and ``mla.py``):

=================== ===================================================== ==========================
layout              MHA ``kv_buffer`` dims                                MLA ``kv_buffer`` dims
=================== ===================================================== ==========================
layer_first         (2, layers, size, heads, head_dim)                    (layers, size, 1, dim)
page_first          (2, size, layers, heads, head_dim)                    (size, layers, 1, dim)
page_first_direct   (2, page_num, layers, page_size, heads, head_dim)     (page_num, layers, page_size, 1, dim)
=================== ===================================================== ==========================
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Sequence

import torch

SUPPORTED_LAYOUTS = ("layer_first", "page_first", "page_first_direct")


class UnsupportedLayoutError(ValueError):
    """The host pool's layout (or pool type) is not one FlatCake can address."""


@dataclass(frozen=True)
class PageGeometry:
    """Shape of one stored page.

    Attributes:
        layers: number of layers (chunks per page).
        page_size: tokens per page.
        plane_row_bytes: bytes per token per layer for each plane (MHA: (K, V); MLA: (KV,)).
    """

    layers: int
    page_size: int
    plane_row_bytes: tuple[int, ...]

    @property
    def chunk_bytes(self) -> int:
        """Bytes of one (page, layer) chunk."""
        return self.page_size * sum(self.plane_row_bytes)

    @property
    def page_bytes(self) -> int:
        """Bytes of one whole page (all layers)."""
        return self.layers * self.chunk_bytes

    def plane_offsets(self) -> tuple[int, ...]:
        """Byte offset of each plane inside a chunk."""
        offs, o = [], 0
        for rb in self.plane_row_bytes:
            offs.append(o)
            o += self.page_size * rb
        return tuple(offs)


def _u8(t: torch.Tensor) -> torch.Tensor:
    """Reinterpret a tensor's last dim as bytes (no copy)."""
    return t.view(torch.uint8)


class KvPageLayout:
    """Per-layer byte views of a paged KV buffer.

    Args:
        geometry: the page geometry.
        layer_views: ``layer_views(layer)`` returns one uint8 tensor per plane, each
            ``[num_pages, page_size, row_bytes]`` (strided views into the real buffer).
        num_pages: pages addressable in the buffer.
        device: the buffer's device (``cpu`` for a host pool, ``cuda:N`` for device KV).
        name: layout name, for messages and the namespace.
    """

    def __init__(
        self,
        geometry: PageGeometry,
        layer_views: Callable[[int], Sequence[torch.Tensor]],
        num_pages: int,
        device: torch.device,
        name: str,
    ):
        self.geometry = geometry
        self._layer_views = layer_views
        self.num_pages = num_pages
        self.device = torch.device(device)
        self.name = name
        self._cache: dict[int, tuple[torch.Tensor, ...]] = {}

    def layer_planes(self, layer: int) -> tuple[torch.Tensor, ...]:
        """uint8 views ``[num_pages, page_size, row_bytes_j]`` of every plane of ``layer``."""
        v = self._cache.get(layer)
        if v is None:
            v = tuple(self._layer_views(layer))
            self._cache[layer] = v
        return v

    # ---------------------------------------------------------------- constructors
    @classmethod
    def from_host_pool(cls, pool) -> "KvPageLayout":
        """Build from an SGLang host pool (``MHATokenToKVPoolHost`` / ``MLATokenToKVPoolHost``)
        or the test double with the same attributes (``kv_buffer``, ``layout``, ``page_size``,
        ``layer_num``, ``size``).

        Raises:
            UnsupportedLayoutError: layout not in :data:`SUPPORTED_LAYOUTS`, or a pool whose
                buffer is not one of the shapes above (e.g. ``page_first_kv_split``).
        """
        layout = getattr(pool, "layout", None)
        if layout not in SUPPORTED_LAYOUTS:
            raise UnsupportedLayoutError(
                f"host pool layout {layout!r} is not supported by FlatCake "
                f"(supported: {', '.join(SUPPORTED_LAYOUTS)})"
            )
        kv = getattr(pool, "kv_buffer", None)
        if not isinstance(kv, torch.Tensor):
            raise UnsupportedLayoutError(
                f"host pool {type(pool).__name__} has no single kv_buffer tensor (layout {layout!r})"
            )
        P, L = int(pool.page_size), int(pool.layer_num)
        is_mla = _is_mla_pool(pool, kv)
        if is_mla:
            planes = [kv]
        else:
            planes = [kv[0], kv[1]]
        views4 = []  # each [num_pages, layers, page_size, row_bytes]
        for t in planes:
            b = _u8(t)
            if layout == "layer_first":  # [L, size, ..., row]
                b = b.reshape(L, -1, P, b[0, 0].numel()).permute(1, 0, 2, 3)
            elif layout == "page_first":  # [size, L, ..., row]
                row = b[0, 0].numel()
                b = b.reshape(-1, P, L, row).permute(0, 2, 1, 3)
            else:  # page_first_direct: [page_num, L, P, ..., row]
                row = b[0, 0, 0].numel()
                b = b.reshape(b.shape[0], L, P, row)
            views4.append(b)
        geometry = PageGeometry(L, P, tuple(int(v.shape[-1]) for v in views4))
        num_pages = int(views4[0].shape[0])
        return cls(
            geometry,
            lambda layer: [v[:, layer] for v in views4],
            num_pages,
            kv.device,
            f"{'mla' if is_mla else 'mha'}-{layout}",
        )

    @classmethod
    def from_flat_pages(cls, flat: torch.Tensor, pool) -> "KvPageLayout":
        """View ``n`` flat data pages (SGLang's generic path: ``pool.get_data_page(i)`` /
        ``get_dummy_flat_data_page()`` format, stacked as ``[n, page_numel]`` in the pool's
        dtype) as a paged buffer of ``n`` pages with the pool's geometry.

        Raises:
            UnsupportedLayoutError: as :meth:`from_host_pool`.
        """
        ref = cls.from_host_pool(pool)
        g = ref.geometry
        L, P, layout, n = g.layers, g.page_size, pool.layout, int(flat.shape[0])
        b = _u8(flat.reshape(n, -1))
        is_mla = ref.name.startswith("mla")
        planes = [b.reshape(n, 1, -1)] if is_mla else [b.reshape(n, 2, -1)[:, 0], b.reshape(n, 2, -1)[:, 1]]
        views4 = []
        for t, rb in zip(planes, g.plane_row_bytes):
            t = t.reshape(n, -1)
            if layout == "page_first":  # page = [P, L, row]
                views4.append(t.reshape(n, P, L, rb).permute(0, 2, 1, 3))
            else:  # layer_first [L, P, row]; page_first_direct [1, L, P, row]
                views4.append(t.reshape(n, L, P, rb))
        return cls(g, lambda layer: [v[:, layer] for v in views4], n, flat.device, ref.name + "-flat")

    @classmethod
    def from_device_kv(
        cls,
        k_layers: Sequence[torch.Tensor],
        v_layers: Sequence[torch.Tensor] | None,
        page_size: int,
    ) -> "KvPageLayout":
        """Build from a device paged KV buffer as SGLang's ``MHATokenToKVPool`` keeps it: one
        tensor per layer ``[slots, heads, head_dim]`` for K and V (``v_layers=None`` for MLA's
        single ``[slots, 1, kv_cache_dim]`` buffer). ``slots`` must be a multiple of
        ``page_size``; page ``i`` covers slots ``[i*page_size, (i+1)*page_size)``."""
        planes_per_layer = [
            [k] + ([v_layers[i]] if v_layers is not None else []) for i, k in enumerate(k_layers)
        ]

        def views(layer: int):
            out = []
            for t in planes_per_layer[layer]:
                b = _u8(t).reshape(t.shape[0], -1)
                out.append(b.reshape(-1, page_size, b.shape[1]))
            return out

        first = views(0)
        geometry = PageGeometry(len(k_layers), page_size, tuple(int(v.shape[-1]) for v in first))
        return cls(geometry, views, int(first[0].shape[0]), k_layers[0].device, "device-paged")

    # ---------------------------------------------------------------- byte movement
    def gather_chunks(self, page_ids: torch.Tensor, layer: int, out: torch.Tensor) -> None:
        """Copy chunks of ``layer`` for ``page_ids`` into ``out``.

        Args:
            page_ids: int64 ``[n]`` page indices in this buffer (slot // page_size).
            layer: layer index.
            out: uint8 ``[n, chunk_bytes]`` (rows contiguous), on this layout's device.

        One strided copy per (page, plane): torch's advanced indexing on these strided views
        runs at ~0.1-0.2 GB/s on CPU, a per-page ``copy_`` at memory speed.
        """
        g = self.geometry
        ids = page_ids.tolist() if isinstance(page_ids, torch.Tensor) else list(page_ids)
        for t, off, rb in zip(self.layer_planes(layer), g.plane_offsets(), g.plane_row_bytes):
            dst = out[:, off : off + g.page_size * rb].view(-1, g.page_size, rb)
            for i, p in enumerate(ids):
                dst[i].copy_(t[p])

    def scatter_chunks(self, src: torch.Tensor, page_ids: torch.Tensor, layer: int) -> None:
        """Inverse of :meth:`gather_chunks`: ``src`` uint8 ``[n, chunk_bytes]`` into the slots."""
        g = self.geometry
        ids = page_ids.tolist() if isinstance(page_ids, torch.Tensor) else list(page_ids)
        for t, off, rb in zip(self.layer_planes(layer), g.plane_offsets(), g.plane_row_bytes):
            s = src[:, off : off + g.page_size * rb]
            for i, p in enumerate(ids):
                t[p].copy_(s[i].view(g.page_size, rb))


def _is_mla_pool(pool, kv: torch.Tensor) -> bool:
    """MLA pools keep one plane: kv_buffer has no leading K/V axis of size 2."""
    if hasattr(pool, "kv_cache_dim") and not hasattr(pool, "head_num"):
        return True
    layout = pool.layout
    expected_mha_dims = {"layer_first": 5, "page_first": 5, "page_first_direct": 6}[layout]
    return kv.dim() != expected_mha_dims
