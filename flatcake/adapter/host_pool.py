"""Host-pool doubles that reproduce SGLang 0.5.23's ``MHATokenToKVPoolHost`` and
``MLATokenToKVPoolHost`` byte layouts without their CUDA/transformers import chain.

The shapes, ``get_page_buffer_meta``, ``get_data_page``, ``set_from_flat_data_page`` and
``get_dummy_flat_data_page`` follow ``sglang/srt/mem_cache/pool_host/mha.py`` and ``mla.py``
line for line (layouts ``layer_first``, ``page_first``, ``page_first_direct``). The real pools
cannot be imported on a CPU-only machine (see ``docs/design.md``); the replay engine model and
the tests use these.
"""

from __future__ import annotations

import torch

from flatcake.layout import SUPPORTED_LAYOUTS

_LAYOUTS = SUPPORTED_LAYOUTS  # the layouts SGLang 0.5.23 pairs with an L3 backend that FlatCake reads


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
        return torch.zeros(dims, dtype=self.dtype)

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
        return torch.zeros(dims, dtype=self.dtype)

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
