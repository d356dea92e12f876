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
        reason = separate_scale_reason(pool)
        if reason:
            raise UnsupportedLayoutError(f"host pool {type(pool).__name__}: {reason}")
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


# ---------------------------------------------------------------- any host pool (v2 extra pools)
#: pool attributes that, when they hold a tensor outside the pool's page buffers, carry per-page
#: scales the page payload needs (e.g. ``MHATokenToKVPoolMXFP8Host.k_scale_host``)
_SCALE_HINT = "scale"


def pool_buffers(pool) -> list:
    """The pool's page buffers as SGLang's Mooncake backend registers them:
    ``get_hybrid_pool_buffer()``, else ``kv_buffer`` (a tensor or a list of tensors)."""
    get = getattr(pool, "get_hybrid_pool_buffer", None)
    bufs = get() if callable(get) else getattr(pool, "kv_buffer", None)
    if isinstance(bufs, torch.Tensor):
        bufs = [bufs]
    return [b for b in (bufs or []) if isinstance(b, torch.Tensor)]


def separate_scale_reason(pool) -> str:
    """Why ``pool``'s pages cannot be stored as its payload alone, or ``""``.

    A pool whose attribute named ``*scale*`` holds a non-empty tensor outside its page buffers
    (SGLang 0.5.23's ``MHATokenToKVPoolMXFP8Host``: UE8M0 ``k_scale_host`` / ``v_scale_host``
    next to the fp8 ``kv_buffer``) keeps bytes a page needs where no page view reaches them:
    storing the payload alone would restore KV with stale scales. Combined payload+scale rows in
    one page buffer (the DSA indexer's ``index_k_with_scale_buffer``) are fine, and so are scalar
    or per-layer scales (their first dimension is not the pool's slots or pages).
    """
    owned = {b.untyped_storage().data_ptr() for b in pool_buffers(pool)}
    ps = int(getattr(pool, "page_size", 0) or 0)
    size = int(getattr(pool, "size", 0) or 0)
    per_page = {size, size // ps} if ps else {size}  # a per-page tensor: one row per slot or page
    for name, value in list(vars(pool).items()):
        if _SCALE_HINT not in name.lower():
            continue
        ts = value if isinstance(value, (list, tuple)) else [value]
        for t in ts:
            if (isinstance(t, torch.Tensor) and t.dim() and t.numel() and int(t.shape[0]) in per_page
                    and t.untyped_storage().data_ptr() not in owned):
                return (f"pages carry separate scale tensors ({name}, {tuple(t.shape)} {t.dtype}) outside the page "
                        f"buffers; storing the payload alone would serve KV with wrong scales")
    return ""


def _flat_meta(meta) -> tuple[list[int], list[int]]:
    """``get_page_buffer_meta``'s (pointers, sizes), nested sequences flattened."""
    ptrs, sizes = meta
    fp, fs = [], []
    for p, s in zip(ptrs, sizes):
        if isinstance(p, (list, tuple)):
            fp += [int(x) for x in p]
            fs += [int(x) for x in s]
        else:
            fp.append(int(p))
            fs.append(int(s))
    return fp, fs


def _page_components(pool, page: int) -> tuple[list[int], list[int]]:
    """(pointers, sizes) of every byte range of host page ``page`` (token slots
    ``[page*page_size, (page+1)*page_size)``), in ``get_page_buffer_meta`` order."""
    ps = int(pool.page_size)
    return _flat_meta(pool.get_page_buffer_meta(torch.arange(page * ps, (page + 1) * ps, dtype=torch.int64)))


def _page_view_components(pool, page: int) -> tuple[list[int], list[int]]:
    """(pointers, sizes) of host page ``page`` from the view ``get_data_page(slot, flat=False)``
    returns (SGLang's flat-page path): its rows, consecutive rows merged into one range.

    Raises:
        ValueError: no ``get_data_page``, or it returns a copy (not a view into a page buffer)
            or a view whose last dimension is not contiguous.
    """
    get = getattr(pool, "get_data_page", None)
    if not callable(get):
        raise ValueError("no get_data_page")
    v = get(page * int(pool.page_size), flat=False)
    owned = {b.untyped_storage().data_ptr() for b in pool_buffers(pool)}
    if not isinstance(v, torch.Tensor) or not v.numel() or v.untyped_storage().data_ptr() not in owned:
        raise ValueError("a page is not a view into the pool's page buffers")
    if not v.dim() or v.stride(-1) != 1:
        raise ValueError("a page's rows are not contiguous")
    isz = v.element_size()
    offs = torch.zeros((), dtype=torch.int64)
    for n, st in zip(v.shape[:-1], v.stride()[:-1]):
        offs = offs.unsqueeze(-1) + torch.arange(n, dtype=torch.int64) * st
    row = int(v.shape[-1]) * isz
    ptrs, sizes = [], []
    for o in (offs.reshape(-1) * isz + v.data_ptr()).tolist():
        if ptrs and ptrs[-1] + sizes[-1] == o:
            sizes[-1] += row
        else:
            ptrs.append(o)
            sizes.append(row)
    return ptrs, sizes


def _period(sizes: list[int]) -> int:
    """Smallest ``k`` dividing ``len(sizes)`` with ``sizes[i] == sizes[i % k]`` (planes per layer)."""
    c = len(sizes)
    for k in range(1, c + 1):
        if c % k == 0 and all(sizes[i] == sizes[i % k] for i in range(c)):
            return k
    return c  # pragma: no cover - k = c always matches


def page_layout_from_meta(pool, name: str) -> KvPageLayout:
    """A :class:`KvPageLayout` over any SGLang host pool, from the byte ranges its
    ``get_page_buffer_meta`` names for one page (the ranges SGLang's Mooncake backend moves).

    Component ``c`` of page ``p`` is ``sizes[c]`` bytes at ``base_c + p * stride_c``; components
    group into ``layers`` of equal plane tuples (MHA ``layer_first``: (K, V) per layer; a DeepSeek-V4
    paged pool: one row per layer; Mamba: one layer of (temporal, conv_0, …)). Each plane view is
    uint8 ``[num_pages, page_size, row_bytes]`` (``page_size`` tokens when every size divides by
    it, else 1 row of the whole range).

    A pool without that meta in its layout (SGLang's DSA indexer and MiniMax pools in
    ``layer_first`` raise) is mapped from the rows of the view ``get_data_page(slot,
    flat=False)`` returns instead, the page its ``file`` backend stores.

    Raises:
        UnsupportedLayoutError: separate scale tensors (:func:`separate_scale_reason`); neither
            ``get_page_buffer_meta`` nor a ``get_data_page`` view into the page buffers (e.g.
            MXFP8; Mamba with slot side states, whose page is a copy); pages whose ranges are
            not at a fixed stride inside one page buffer. The message names ``name``.
    """
    def refuse(why: str):
        return UnsupportedLayoutError(f"host pool {name!r} ({type(pool).__name__}): {why}; FlatCake cannot store it")

    reason = separate_scale_reason(pool)
    if reason:
        raise refuse(reason)
    num_pages = int(getattr(pool, "size", 0)) // max(int(getattr(pool, "page_size", 0) or 0), 1)
    if num_pages < 1:
        raise refuse("no page-addressable buffers (size, page_size)")
    probes = sorted({0, 1, num_pages // 2, num_pages - 1} & set(range(num_pages)))
    try:
        metas = {p: _page_components(pool, p) for p in probes}
    except Exception as e:  # noqa: BLE001 - SGLang's own refusal (NotImplementedError, ValueError)
        try:  # pools without zero-copy meta in this layout (DSA indexer, MiniMax in layer_first)
            metas = {p: _page_view_components(pool, p) for p in probes}
        except Exception as e2:  # noqa: BLE001
            raise refuse(f"get_page_buffer_meta: {e}; get_data_page: {e2}") from None
    ptr0, sizes = metas[0]
    if not ptr0 or any(s <= 0 for s in sizes):
        raise refuse("empty page")
    stride = [metas[1][0][c] - ptr0[c] for c in range(len(ptr0))] if 1 in metas else [0] * len(ptr0)
    for p, (ptrs, sz) in metas.items():
        if sz != sizes or any(ptrs[c] != ptr0[c] + p * stride[c] for c in range(len(ptr0))):
            raise refuse("page byte ranges are not at a fixed stride")
    k = _period(sizes)
    ps = int(pool.page_size)
    rows = ps if all(s % ps == 0 for s in sizes[:k]) else 1
    views = [_component_view(pool, ptr0[c], stride[c], sizes[c], rows, num_pages, refuse) for c in range(len(ptr0))]
    geometry = PageGeometry(len(sizes) // k, rows, tuple(s // rows for s in sizes[:k]))
    return KvPageLayout(geometry, lambda layer: views[layer * k:(layer + 1) * k], num_pages,
                        torch.device(getattr(pool, "device", "cpu") or "cpu"), f"{name}-meta")


def _component_view(pool, ptr0: int, stride: int, size: int, rows: int, num_pages: int, refuse) -> torch.Tensor:
    """uint8 ``[num_pages, rows, size // rows]`` view of one page component inside the page
    buffer that holds all of it (``stride`` bytes between pages)."""
    end = ptr0 + (num_pages - 1) * stride + size
    for buf in pool_buffers(pool):
        st = buf.untyped_storage()
        base = st.data_ptr()
        if base <= ptr0 and end <= base + st.nbytes() and stride >= 0:
            flat = torch.empty(0, dtype=torch.uint8, device=buf.device).set_(st)
            return flat.as_strided((num_pages, rows, size // rows), (stride, size // rows, 1), ptr0 - base)
    raise refuse("a page's bytes lie outside its page buffers")
