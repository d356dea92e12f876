"""Host-pool doubles that reproduce SGLang 0.5.23's ``MHATokenToKVPoolHost`` and
``MLATokenToKVPoolHost`` byte layouts without their CUDA/transformers import chain.

The shapes, ``get_page_buffer_meta``, ``get_data_page``, ``set_from_flat_data_page`` and
``get_dummy_flat_data_page`` follow ``sglang/srt/mem_cache/pool_host/mha.py`` and ``mla.py``
line for line (layouts ``layer_first``, ``page_first``, ``page_first_direct``). The real pools
cannot be imported on a CPU-only machine (see ``docs/design.md``); the replay engine model and
the tests use these. Their KV buffers are anonymous ``mmap`` s, page-aligned and zero-filled, as
SGLang's default ``HostTensorAllocator`` (``alloc_mmap``) allocates the real pools' buffers.
"""

from __future__ import annotations

import math
import mmap

import numpy as np
import torch

from flatcake.common.layout import SUPPORTED_LAYOUTS

_LAYOUTS = SUPPORTED_LAYOUTS  # the layouts SGLang 0.5.23 pairs with an L3 backend that FlatCake reads


def alloc_mmap(dims: tuple, dtype: torch.dtype) -> torch.Tensor:
    """A zero-filled CPU tensor of ``dims`` and ``dtype`` in an anonymous mapping (address
    ≡ 0 mod the OS page size), as SGLang 0.5.23's ``alloc_mmap`` (the tensor keeps it mapped)."""
    nbytes = math.prod(dims) * torch.empty([], dtype=dtype).element_size()
    if nbytes == 0:
        return torch.zeros(dims, dtype=dtype)
    arr = np.frombuffer(mmap.mmap(-1, nbytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS), dtype=np.uint8)
    return torch.from_numpy(arr).view(dtype).reshape(dims)


class _HostPoolBase:
    def __init__(self, size: int, page_size: int, layer_num: int, dtype: torch.dtype, layout: str):
        if layout not in _LAYOUTS:
            raise ValueError(f"Unsupported layout: {layout}")
        if size % page_size:
            raise ValueError("size must be a multiple of page_size")
        self.size = size
        self.page_size = page_size
        self.page_num = size // page_size
        self.layer_num = layer_num
        self.dtype = dtype
        self.layout = layout
        self.device = "cpu"
        self.pin_memory = False
        self.kv_buffer = self.init_kv_buffer()

    def init_kv_buffer(self) -> torch.Tensor:  # pragma: no cover - abstract
        raise NotImplementedError


class MHAHostPoolDouble(_HostPoolBase):
    """``MHATokenToKVPoolHost`` double: ``kv_buffer`` dims as in SGLang (K at [0], V at [1])."""

    def __init__(self, size, page_size, layer_num, head_num, head_dim, dtype=torch.bfloat16, layout="page_first"):
        self.head_num = head_num
        self.head_dim = head_dim
        self.v_head_dim = head_dim
        super().__init__(size, page_size, layer_num, dtype, layout)
        self.k_buffer = self.kv_buffer[0]
        self.v_buffer = self.kv_buffer[1]

    def init_kv_buffer(self):
        if self.layout == "layer_first":
            dims = (2, self.layer_num, self.size, self.head_num, self.head_dim)
        elif self.layout == "page_first":
            dims = (2, self.size, self.layer_num, self.head_num, self.head_dim)
        else:
            dims = (2, self.page_num, self.layer_num, self.page_size, self.head_num, self.head_dim)
        return alloc_mmap(dims, self.dtype)

    def get_size_per_token(self):
        return (self.head_dim + self.v_head_dim) * self.head_num * self.layer_num * self.dtype.itemsize

    def get_ksize_per_token(self):
        """Bytes of K per token (half of :meth:`get_size_per_token`), as SGLang's MHA host pool."""
        return self.get_size_per_token() // 2

    def get_data_page(self, index, flat: bool = True):
        if self.layout == "layer_first":
            p = self.kv_buffer[:, :, index : index + self.page_size, :, :]
        elif self.layout == "page_first":
            p = self.kv_buffer[:, index : index + self.page_size, :, :, :]
        else:
            r = index // self.page_size
            p = self.kv_buffer[:, r : r + 1, :, :, :, :]
        return p.flatten() if flat else p

    def get_dummy_flat_data_page(self):
        return torch.zeros(
            (2, self.layer_num, self.page_size, self.head_num, self.head_dim), dtype=self.dtype
        ).flatten()

    def set_from_flat_data_page(self, index: int, data_page: torch.Tensor) -> None:
        if self.layout == "layer_first":
            self.kv_buffer[:, :, index : index + self.page_size, :, :] = data_page.reshape(
                2, self.layer_num, self.page_size, self.head_num, self.head_dim
            )
        elif self.layout == "page_first":
            self.kv_buffer[:, index : index + self.page_size, :, :, :] = data_page.reshape(
                2, self.page_size, self.layer_num, self.head_num, self.head_dim
            )
        else:
            r = index // self.page_size
            self.kv_buffer[:, r : r + 1, :, :, :, :] = data_page.reshape(
                2, 1, self.layer_num, self.page_size, self.head_num, self.head_dim
            )

    def get_page_buffer_meta(self, indices):
        assert len(indices) % self.page_size == 0
        ptrs = []
        base = self.kv_buffer.data_ptr()
        idx = indices.tolist()
        isz = self.dtype.itemsize
        v_offset = self.layer_num * self.size * self.head_num * self.head_dim * isz
        if self.layout == "layer_first":
            for i in range(0, len(idx), self.page_size):
                for layer in range(self.layer_num):
                    k = base + idx[i] * self.head_num * self.head_dim * isz + layer * self.size * self.head_num * self.head_dim * isz
                    ptrs += [k, k + v_offset]
            esz = isz * self.page_size * self.head_num * self.head_dim
        else:
            for i in range(0, len(idx), self.page_size):
                k = base + idx[i] * self.layer_num * self.head_num * self.head_dim * isz
                ptrs += [k, k + v_offset]
            esz = self.layer_num * isz * self.page_size * self.head_num * self.head_dim
        return ptrs, [esz] * len(ptrs)


class MLAHostPoolDouble(_HostPoolBase):
    """``MLATokenToKVPoolHost`` double (``kv_cache_dim = kv_lora_rank + qk_rope_head_dim``)."""

    def __init__(self, size, page_size, layer_num, kv_cache_dim, dtype=torch.bfloat16, layout="page_first"):
        self.kv_cache_dim = kv_cache_dim
        super().__init__(size, page_size, layer_num, dtype, layout)

    def init_kv_buffer(self):
        if self.layout == "layer_first":
            dims = (self.layer_num, self.size, 1, self.kv_cache_dim)
        elif self.layout == "page_first":
            dims = (self.size, self.layer_num, 1, self.kv_cache_dim)
        else:
            dims = (self.page_num, self.layer_num, self.page_size, 1, self.kv_cache_dim)
        return alloc_mmap(dims, self.dtype)

    def get_size_per_token(self):
        return self.kv_cache_dim * self.dtype.itemsize * self.layer_num

    def get_ksize_per_token(self):
        """Bytes per token (MLA has one latent buffer), as SGLang's MLA host pool."""
        return self.get_size_per_token()

    def get_data_page(self, index, flat: bool = True):
        if self.layout == "layer_first":
            p = self.kv_buffer[:, index : index + self.page_size, :, :]
        elif self.layout == "page_first":
            p = self.kv_buffer[index : index + self.page_size, :, :, :]
        else:
            r = index // self.page_size
            p = self.kv_buffer[r : r + 1, :, :, :, :]
        return p.flatten() if flat else p

    def get_dummy_flat_data_page(self):
        return torch.zeros((self.layer_num, self.page_size, 1, self.kv_cache_dim), dtype=self.dtype).flatten()

    def set_from_flat_data_page(self, index: int, data_page: torch.Tensor) -> None:
        if self.layout == "layer_first":
            self.kv_buffer[:, index : index + self.page_size, :, :] = data_page.reshape(
                self.layer_num, self.page_size, 1, self.kv_cache_dim
            )
        elif self.layout == "page_first":
            self.kv_buffer[index : index + self.page_size, :, :, :] = data_page.reshape(
                self.page_size, self.layer_num, 1, self.kv_cache_dim
            )
        else:
            r = index // self.page_size
            self.kv_buffer[r : r + 1, :, :, :, :] = data_page.reshape(
                1, self.layer_num, self.page_size, 1, self.kv_cache_dim
            )

    def get_page_buffer_meta(self, indices):
        assert len(indices) % self.page_size == 0
        ptrs = []
        base = self.kv_buffer.data_ptr()
        idx = indices.tolist()[:: self.page_size]
        isz = self.dtype.itemsize
        if self.layout == "layer_first":
            for i in idx:
                for layer in range(self.layer_num):
                    ptrs.append(base + i * self.kv_cache_dim * isz + layer * self.size * self.kv_cache_dim * isz)
            esz = isz * self.page_size * self.kv_cache_dim
        else:
            for i in idx:
                ptrs.append(base + i * self.layer_num * self.kv_cache_dim * isz)
            esz = self.layer_num * isz * self.page_size * self.kv_cache_dim
        return ptrs, [esz] * len(ptrs)


# ---------------------------------------------------------------- v2 extra pools (hybrid models)
def _pages(indices, page_size: int) -> list:
    """First token slot of each page in ``indices`` (int64 token slots)."""
    return indices.tolist()[::page_size]


class MambaHostPoolDouble:
    """``MambaPoolHost`` double (``pool_host/mamba.py``, page_first): one slot per request
    (``page_size`` 1), ``temporal_buffer`` ``[size, layers, *temporal_shape]`` and one
    ``conv_buffer[i]`` ``[size, layers, *conv_shape_i]``; ``get_page_buffer_meta`` yields the
    temporal range then each conv range of a slot, as SGLang's does."""

    def __init__(self, size, layer_num, temporal_shape=(2, 4, 4), conv_shapes=((6, 3),),
                 temporal_dtype=torch.float32, conv_dtype=torch.bfloat16, layout="page_first"):
        self.size, self.page_size, self.layout, self.device = size, 1, layout, "cpu"
        self.num_mamba_layers = self.layer_num = layer_num
        self.temporal_dtype, self.conv_dtype = temporal_dtype, conv_dtype
        self.temporal_buffer = torch.zeros((size, layer_num, *temporal_shape), dtype=temporal_dtype)
        self.conv_buffer = [torch.zeros((size, layer_num, *s), dtype=conv_dtype) for s in conv_shapes]

    def get_hybrid_pool_buffer(self):
        return [self.temporal_buffer, *self.conv_buffer]

    def _page_tensors(self, index):
        return [self.temporal_buffer[index], *(c[index] for c in self.conv_buffer)]

    def get_data_page(self, index, flat: bool = True):
        return torch.cat([t.reshape(-1).view(torch.uint8) for t in self._page_tensors(int(index))])

    def set_from_flat_data_page(self, index: int, data_page: torch.Tensor) -> None:
        b, o = data_page.view(torch.uint8).reshape(-1), 0
        for t in self._page_tensors(int(index)):
            n = t.numel() * t.element_size()
            t.copy_(b[o:o + n].clone().view(t.dtype).reshape(t.shape))
            o += n

    def get_page_buffer_meta(self, indices):
        ptrs, sizes = [], []
        for i in _pages(indices, 1):
            for t in self._page_tensors(i):
                ptrs.append(t.data_ptr())
                sizes.append(t.numel() * t.element_size())
        return ptrs, sizes


class DsaIndexerHostPoolDouble:
    """``DSAIndexerPoolHost`` double (``pool_host/dsa.py``): one fp8 payload+scale row of
    ``indexer_page_stride_size`` bytes per (page, layer) in ``index_k_with_scale_buffer``
    (payload and scales in the same buffer): ``[pages, layers, 1, stride]`` page_first,
    ``[layers, pages, stride]`` layer_first, where, as in SGLang, ``get_page_buffer_meta``
    raises ``ValueError`` and only the flat-page path (``get_data_page``) addresses a page."""

    def __init__(self, size, page_size, layer_num, indexer_page_stride_size=132, layout="page_first"):
        self.size, self.page_size, self.layer_num, self.layout, self.device = size, page_size, layer_num, layout, "cpu"
        self.indexer_page_stride_size = indexer_page_stride_size
        self.indexer_dtype = torch.uint8
        dims = ((layer_num, size // page_size, indexer_page_stride_size) if layout == "layer_first"
                else (size // page_size, layer_num, 1, indexer_page_stride_size))
        self.index_k_with_scale_buffer = torch.zeros(dims, dtype=torch.uint8)

    def get_hybrid_pool_buffer(self):
        return [self.index_k_with_scale_buffer]

    def get_data_page(self, index, flat: bool = True):
        i = int(index) // self.page_size
        b = self.index_k_with_scale_buffer
        p = b[:, i:i + 1, :] if self.layout == "layer_first" else b[i:i + 1]
        return p.flatten() if flat else p

    def set_from_flat_data_page(self, index: int, data_page: torch.Tensor) -> None:
        i = int(index) // self.page_size
        if self.layout == "layer_first":
            self.index_k_with_scale_buffer[:, i:i + 1, :] = data_page.reshape(self.layer_num, 1, -1)
        else:
            self.index_k_with_scale_buffer[i:i + 1] = data_page.reshape(1, self.layer_num, 1, -1)

    def get_page_buffer_meta(self, indices):
        if self.layout == "layer_first":
            raise ValueError(f"Unsupported layout: {self.layout}")
        stride = self.layer_num * self.indexer_page_stride_size
        base = self.index_k_with_scale_buffer.data_ptr()
        ptrs = [base + (i // self.page_size) * stride for i in _pages(indices, self.page_size)]
        return ptrs, [stride] * len(ptrs)


class MXFP8HostPoolDouble(MHAHostPoolDouble):
    """``MHATokenToKVPoolMXFP8Host`` double (``pool_host/mha_mxfp8.py``): an fp8 MHA payload in
    ``kv_buffer`` plus per-(page, layer) UE8M0 scale blocks in ``k_scale_host`` /
    ``v_scale_host`` ``[pages, layers, sf_bytes]`` outside it; flat pages and buffer meta raise
    ``NotImplementedError`` as SGLang's do. FlatCake must refuse it."""

    def __init__(self, size, page_size, layer_num, head_num, head_dim, sf_bytes=64, layout="page_first"):
        super().__init__(size, page_size, layer_num, head_num, head_dim, dtype=torch.float8_e4m3fn, layout=layout)
        self.k_scale_host = torch.zeros((size // page_size, layer_num, sf_bytes), dtype=torch.uint8)
        self.v_scale_host = torch.zeros((size // page_size, layer_num, sf_bytes), dtype=torch.uint8)

    def _unsupported(self):
        return NotImplementedError("MXFP8 KV host pool does not expose flat storage (L3) pages yet: "
                                   "a page's UE8M0 scales live outside kv_buffer.")

    def get_data_page(self, index, flat: bool = True):
        raise self._unsupported()

    def get_page_buffer_meta(self, indices):
        raise self._unsupported()
