"""Engine model: what an SGLang scheduler does with one request's prefix, minus the GPU.

Lifecycle of one request (arrival order, one request at a time)::

    keys = page keys of the prompt (flatcake.replay.keys)
    usable = the keys SGLang may take from a cache: those of the first (prompt_tokens - 1) // P
             pages (:func:`reusable_pages`; it matches at most prompt - 1 tokens, so a prompt of
             exactly k pages reuses k - 1 and computes, then writes, the k-th again)
    1. HBM match      longest prefix of usable in the HBM prefix cache (LRU, page granularity)
    2. L3 hit query   batch_exists(rest of usable, prefix_keys=keys before it), once -> leading
                      run h (one call whatever its length, as SGLang's HybridCacheController;
                      skipped when the span or h is below prefetch_threshold tokens, as SGLang)
    3. L3 read        batch_get_v1 / generic batch_get in 128-page calls into host-pool pages,
                      stop at the first page not delivered (or, with prefetch_policy timeout,
                      SGLang's default, once the read time passed SGLang's deadline for the
                      span); EVERY delivered page is verified
    4. prefill        the rest of the pages are "computed": filled with their deterministic bytes
    5. L3 write       batch_set_v1 / generic batch_set of the computed pages in 128-page calls
    6. HBM insert     all pages of the prompt become most recent (prefix first); LRU eviction

Not modelled: the pages the output completes (SGLang inserts prompt + output into its radix
tree when a request finishes and writes those pages too, in a batch_set_v1 call of their own),
the request SGLang warms up with at start, and SGLang's ``prefix_keys`` of hit queries and reads,
which hold only the keys before the radix node the request's match ends in (the replay passes
every key before the call's first key, as SGLang's backups do; FlatCake's placement gives the
same answer either way: :meth:`flatcake.gva.scopes.ScopeTable.note_hit_query`);
``tests/e2e/test_server_vs_doubles.py``.

TTFT of a request = measured storage time of steps 2-3 (the calls only; byte verification is
excluded) + modelled HBM load of the L3-delivered bytes at ``pcie_gbps`` + modelled prefill compute
of the tokens not delivered from cache (:class:`ModelProfile`). Step 5 is SGLang's asynchronous
backup thread: its time is measured and reported (``write_s``) but not part of TTFT. There is no
queueing: requests are served one after another, so TTFT is a per-request service time.
"""

from __future__ import annotations

import time
from collections import OrderedDict
from dataclasses import dataclass, replace
from typing import Any, Mapping, Optional, Sequence

import numpy as np
import torch
import xxhash

from flatcake.adapter.host_pool import MHAHostPoolDouble, MLAHostPoolDouble
from flatcake.config import STORAGE_BATCH_PAGES


_DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32,
           "float8_e4m3fn": torch.float8_e4m3fn, "uint8": torch.uint8}


# --------------------------------------------------------------------------------- model profile
@dataclass(frozen=True)
class ModelProfile:
    """KV geometry and the prefill cost model of one served model.

    Attributes:
        name: model name (goes into the storage config's ``model_name``).
        attention: ``"mha"`` (K and V planes) or ``"mla"`` (one latent plane).
        layers: transformer layers.
        kv_heads: KV heads (MHA; per TP rank).
        head_dim: head dimension (MHA).
        kv_cache_dim: latent dimension per token per layer (MLA: kv_lora_rank + rope dim).
        dtype: KV dtype name (``bfloat16``, ``float8_e4m3fn``, ...).
        page_size: tokens per page.
        layout: host-pool layout (``page_first``, ``layer_first``, ``page_first_direct``).
        params: parameters counted in the dense matmul FLOPs (2 FLOPs per parameter per token).
        q_heads: attention (query) heads, for the attention FLOPs.
        q_head_dim: query/key head dimension used in the attention FLOPs.
        gpu_tflops: peak dense TFLOP/s of the modelled GPU.
        mfu: fraction of the peak prefill achieves.
        pcie_gbps: host -> HBM copy rate in GB/s (1e9 bytes/s) for L3-delivered pages.
        pools: ``model.pools``: the extra host pools of a hybrid profile
            (:class:`flatcake.replay.hybrid.PoolSpec`); empty for a dense (MHA/MLA) profile.
    """

    name: str
    attention: str
    layers: int
    page_size: int
    dtype: str = "bfloat16"
    kv_heads: int = 0
    head_dim: int = 0
    kv_cache_dim: int = 0
    layout: str = "page_first"
    params: float = 0.0
    q_heads: int = 0
    q_head_dim: int = 0
    gpu_tflops: float = 989.0
    mfu: float = 0.4
    pcie_gbps: float = 25.0
    pools: tuple = ()

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> "ModelProfile":
        """Build from a config ``model:`` section; unknown keys raise ``ValueError``."""
        known = set(cls.__dataclass_fields__)
        extra = set(d) - known - {"profile"}
        if extra:
            raise ValueError(f"model: unknown key(s) {sorted(extra)}")
        kw = {}
        if d.get("pools"):  # an empty list (a dumped dense profile) is dense
            from flatcake.replay.hybrid import parse_pools

            kw["pools"] = parse_pools(d["pools"])
        for k, v in d.items():
            if k not in known or k == "pools":
                continue
            typ = cls.__dataclass_fields__[k].type
            try:  # YAML reads "494e6" as a string; coerce to the field's type
                kw[k] = {"int": int, "float": float, "str": str}[typ](float(v) if typ == "int" else v)
            except (TypeError, ValueError):
                raise ValueError(f"model.{k}: expected {typ} (got {v!r})") from None
        prof = cls(**kw)
        if prof.attention not in ("mha", "mla"):
            raise ValueError(f"model.attention: must be 'mha' or 'mla' (got {prof.attention!r})")
        if prof.dtype not in _DTYPES:
            raise ValueError(f"model.dtype: unsupported {prof.dtype!r} (one of {sorted(_DTYPES)})")
        return prof

    @property
    def torch_dtype(self) -> torch.dtype:
        return _DTYPES[self.dtype]

    @property
    def hybrid(self) -> bool:
        """True when the profile lists extra host pools (run through SGLang's v2 interface)."""
        return bool(self.pools)

    @property
    def bytes_per_token(self) -> int:
        """KV bytes per token over all layers (hybrid: the all_pages pools' page bytes /
        ``page_size``, rounded down)."""
        if self.pools:
            return self.page_bytes // self.page_size
        isz = self.torch_dtype.itemsize
        if self.attention == "mha":
            return 2 * self.layers * self.kv_heads * self.head_dim * isz
        return self.layers * self.kv_cache_dim * isz

    @property
    def page_bytes(self) -> int:
        """Bytes of one page (all layers; hybrid: of every all_pages pool, the pages each
        prefix page needs; the trailing pools' window pages come on top per restore)."""
        if self.pools:
            return sum(p.page_bytes for p in self.pools if not p.trailing)
        return self.bytes_per_token * self.page_size

    @property
    def trailing_bytes(self) -> int:
        """Bytes of the trailing_pages pools' windows stored per request (hybrid; 0 for dense)."""
        return sum(p.page_bytes * p.window_pages for p in self.pools if p.trailing)

    def scaled(self, n: int) -> "ModelProfile":
        """The same model with ``page_bytes`` divided by ``n`` (``--scale N``): the head
        dimension (MHA) or latent dimension (MLA) of the KV divided by ``n``; layers, page
        size and the compute model unchanged, so tokens, pages and hit rates are as at full size.

        Raises:
            ValueError: ``n`` < 1, or ``n`` does not divide that dimension (names ``--scale``).
        """
        if n < 1:
            raise ValueError(f"--scale: must be at least 1 (got {n})")
        if self.pools:  # hybrid: each pool's item_bytes (the effective MLA fields are unused)
            return replace(self, pools=tuple(p.scaled(n) for p in self.pools),
                           name=f"{self.name} (1/{n} scale)" if n > 1 else self.name)
        field = "head_dim" if self.attention == "mha" else "kv_cache_dim"
        dim = getattr(self, field)
        if dim % n or dim // n < 1:
            raise ValueError(f"--scale: {n} must divide model.{field} ({dim})")
        return replace(self, **{field: dim // n}, name=f"{self.name} (1/{n} scale)" if n > 1 else self.name)

    def as_dict(self) -> dict:
        """The profile's fields for ``summary.json`` (``pools`` only for a hybrid profile, as
        a list of dicts with each pool's ``page_bytes``)."""
        d = dict(self.__dict__)
        pools = d.pop("pools")
        if pools:
            from flatcake.replay.hybrid import pools_as_dicts

            d["pools"] = pools_as_dicts(pools)
        return d

    def make_host_pool(self, pages: int):
        """A host-pool double of ``pages`` pages in this profile's layout."""
        size = pages * self.page_size
        if self.attention == "mha":
            return MHAHostPoolDouble(size, self.page_size, self.layers, self.kv_heads, self.head_dim,
                                     dtype=self.torch_dtype, layout=self.layout)
        return MLAHostPoolDouble(size, self.page_size, self.layers, self.kv_cache_dim,
                                 dtype=self.torch_dtype, layout=self.layout)

    def prefill_s(self, new_tokens: int, cached_tokens: int) -> float:
        """Modelled prefill compute in seconds for ``new_tokens`` after ``cached_tokens``.

        FLOPs = 2 * params * new + 4 * layers * q_heads * q_head_dim * new * (cached + new / 2)
        (dense matmuls, then QK^T and PV over the causal context), at ``gpu_tflops * mfu``.
        """
        if new_tokens <= 0:
            return 0.0
        dense = 2.0 * self.params * new_tokens
        attn = 4.0 * self.layers * self.q_heads * self.q_head_dim * new_tokens * (cached_tokens + new_tokens / 2)
        return (dense + attn) / (self.gpu_tflops * 1e12 * self.mfu)

    def load_s(self, nbytes: int) -> float:
        """Modelled host -> HBM copy time in seconds for ``nbytes`` bytes."""
        return nbytes / (self.pcie_gbps * 1e9)


# ------------------------------------------------------------------------------------ HBM cache
class HbmCache:
    """HBM prefix cache at page granularity with LRU eviction.

    Keys are chained, so "longest prefix match" is the leading run of keys present. On insert the
    request's keys are touched last-to-first, so a prefix page is always more recent than the
    pages after it and eviction takes a sequence's tail first (as a radix tree evicts leaves).

    Args:
        capacity_pages: pages HBM can hold (0 disables the cache).
    """

    def __init__(self, capacity_pages: int):
        self.capacity_pages = int(capacity_pages)
        self._lru: OrderedDict[str, None] = OrderedDict()
        self.evicted_pages = 0

    def __len__(self) -> int:
        return len(self._lru)

    def __contains__(self, key: str) -> bool:
        return key in self._lru

    def match_prefix(self, keys: Sequence[str]) -> int:
        """Number of leading ``keys`` held in HBM (no recency update)."""
        n = 0
        for k in keys:
            if k not in self._lru:
                break
            n += 1
        return n

    def insert(self, keys: Sequence[str]) -> None:
        """Make ``keys`` most recent (``keys[0]`` the most recent of all), then evict LRU pages
        down to capacity."""
        if self.capacity_pages <= 0:
            return
        lru = self._lru
        for k in reversed(keys):
            if k in lru:
                lru.move_to_end(k)
            else:
                lru[k] = None
        while len(lru) > self.capacity_pages:
            lru.popitem(last=False)
            self.evicted_pages += 1


# ------------------------------------------------------------------------------- host pages
class HostPages:
    """Free list of whole pages of a host pool; hands out SGLang-style token-slot indices.

    Args:
        pool: a host pool (``page_size``, ``size`` attributes).
    """

    def __init__(self, pool):
        self.pool = pool
        self.page_size = int(pool.page_size)
        self._free: list[int] = list(range(int(pool.size) // self.page_size - 1, -1, -1))
        self._offsets = torch.arange(self.page_size, dtype=torch.int64)

    @property
    def free_pages(self) -> int:
        return len(self._free)

    def alloc(self, pages: int) -> torch.Tensor:
        """Token slots of ``pages`` free pages: int64 CPU tensor, shape ``[pages * page_size]``,
        page ``i`` at ``[i*page_size, (i+1)*page_size)``, each page's slots contiguous and
        page-aligned."""
        if pages > len(self._free):
            raise MemoryError(f"host pool has {len(self._free)} free pages, {pages} requested")
        ids = [self._free.pop() for _ in range(pages)]
        starts = torch.tensor(ids, dtype=torch.int64) * self.page_size
        return (starts[:, None] + self._offsets[None, :]).reshape(-1)

    def free(self, host_indices: torch.Tensor) -> None:
        """Return the pages of ``host_indices`` (as from :meth:`alloc`) to the free list."""
        for s in host_indices[:: self.page_size].tolist():
            self._free.append(s // self.page_size)


# --------------------------------------------------------------------------------- page bytes
_MIX = 0x5851F42D4C957F2D  # odd 63-bit multiplier


class PageContent:
    """Deterministic page bytes from a page key, and their verification in a host pool.

    ``bytes(key) = int64 words w[i] = i * 0x5851F42D4C957F2D + xxh64(key)`` (wrapping), laid out
    in the order of the pool's data page (``get_data_page(idx)``). One vector add per page.

    Args:
        pool: the host pool whose pages are filled and checked.
    """

    def __init__(self, pool):
        self.pool = pool
        page = pool.get_data_page(0, flat=False)
        self._shape = tuple(page.shape)
        isz = page.element_size()
        self.page_bytes = page.numel() * isz
        if self.page_bytes % 8:
            raise ValueError("page bytes must be a multiple of 8")
        base = np.arange(self.page_bytes // 8, dtype=np.uint64) * np.uint64(_MIX)
        self._base = torch.from_numpy(base.view(np.int64))
        self._buf = torch.empty_like(self._base)  # reused: no allocation (page faults) per page
        # compare in the widest unit the page's last dimension allows
        row_bytes = self._shape[-1] * isz
        self._cmp_dtype = torch.int64 if row_bytes % 8 == 0 else torch.uint8
        self._cmp_shape = self._shape[:-1] + (row_bytes // self._cmp_dtype.itemsize,)

    def expected(self, key: str, out: Optional[torch.Tensor] = None) -> torch.Tensor:
        """The page's bytes as a flat int64 tensor of ``page_bytes / 8`` words (into ``out``)."""
        seed = xxhash.xxh64_intdigest(key.encode()) - (1 << 63)
        return torch.add(self._base, seed, out=out) if out is not None else self._base + seed

    def fill(self, host_slot: int, key: str) -> None:
        """Write ``key``'s bytes into the page starting at token slot ``host_slot``."""
        self.pool.set_from_flat_data_page(host_slot, self.expected(key, self._buf).view(self.pool.dtype))

    def verify(self, host_slot: int, key: str) -> bool:
        """True when the page at ``host_slot`` holds exactly ``key``'s bytes."""
        got = self.pool.get_data_page(host_slot, flat=False).view(self._cmp_dtype)
        want = self.expected(key, self._buf).view(self._cmp_dtype).view(self._cmp_shape)
        return torch.equal(got, want)


# -------------------------------------------------------------------------------- the engine
def reusable_pages(n_keys: int, prompt_tokens: int, page_size: int) -> int:
    """Pages of a prompt SGLang can take from a cache (HBM, host or L3): it matches at most
    ``prompt_tokens - 1`` tokens (the last prompt token is always computed: its logits give the
    first output token; ``Req._compute_max_prefix_len``), in whole pages, and at most the
    prompt's ``n_keys`` whole pages. A prompt of exactly k pages reuses k - 1."""
    return max(0, min(n_keys, (prompt_tokens - 1) // page_size))


def reusable_counts(reqs: Sequence[Any], keys: Sequence[Sequence[str]], page_size: int) -> list[int]:
    """:func:`reusable_pages` of every request (``reqs[i].prompt_tokens`` with ``keys[i]``), for
    :func:`flatcake.replay.traces.ideal_hit_rate`."""
    return [reusable_pages(len(ks), r.prompt_tokens, page_size) for r, ks in zip(reqs, keys)]


@dataclass
class RequestOutcome:
    """What one request got from each tier, and its timings (seconds, tokens, pages)."""

    pages: int
    prompt_tokens: int
    hbm_pages: int = 0
    l3_query_pages: int = 0  # leading run reported by batch_exists
    dram_pages: int = 0  # delivered from L3 DRAM
    ssd_pages: int = 0  # delivered from L3 SSD (placed there), backlog_pages included
    backlog_pages: int = 0  # of ssd_pages: served from FlatCake's SSD write backlog in memory
    computed_pages: int = 0
    written_pages: int = 0
    failed_write_pages: int = 0  # computed pages whose put was refused (that batch and the rest)
    verify_failures: int = 0
    query_s: float = 0.0
    read_s: float = 0.0
    write_s: float = 0.0
    load_s: float = 0.0  # modelled
    prefill_s: float = 0.0  # modelled
    wall_s: float = 0.0

    @property
    def l3_pages(self) -> int:
        return self.dram_pages + self.ssd_pages

    @property
    def ttft_s(self) -> float:
        return self.query_s + self.read_s + self.load_s + self.prefill_s


@dataclass
class EngineConfig:
    """Engine-model knobs (the ``replay:`` config section).

    Attributes:
        hbm_pages: HBM prefix-cache capacity in pages.
        host_pool_pages: host-pool pages (>= 2 x 128 needed; the pool is a bounce buffer here).
        prefetch_threshold_tokens: SGLang's ``prefetch_threshold`` (skip L3 below this).
        prefetch_policy: ``timeout`` (SGLang 0.5.23's default ``--hicache-storage-prefetch-policy``:
            a prefetch still reading when its deadline passes is cut, the rest recomputed) or
            ``wait_complete`` (every hit page is waited for).
        prefetch_timeout_base_s, prefetch_timeout_per_ki_token_s: SGLang's timeout formula, with
            SGLang 0.5.23's defaults (extra-config ``prefetch_timeout_base`` 1 s and
            ``prefetch_timeout_per_ki_token`` 0.25 s, ``HybridCacheController``).
    """

    hbm_pages: int = 512
    host_pool_pages: int = 512
    prefetch_threshold_tokens: int = 256
    prefetch_policy: str = "timeout"
    prefetch_timeout_base_s: float = 1.0
    prefetch_timeout_per_ki_token_s: float = 0.25

    #: the prefetch policies the replay models (SGLang's ``best_effort`` is not modelled)
    POLICIES = ("timeout", "wait_complete")

    def prefetch_timeout_s(self, tokens: int) -> Optional[float]:
        """Seconds a prefetch of a requested span of ``tokens`` may take under
        ``prefetch_policy: timeout``; ``None`` under ``wait_complete``. As SGLang 0.5.23
        (``UnifiedRadixCache._start_storage_prefetch_wait``): ``base + pages × page_size / 1024
        × per_ki_token``, pages = the span asked of storage (``stats_requested_tokens``, the
        page-aligned tokens after the device match, known before the hit query), so ``tokens /
        1024 × per_ki_token`` for a page-aligned span."""
        if self.prefetch_policy != "timeout":
            return None
        return self.prefetch_timeout_base_s + tokens / 1024 * self.prefetch_timeout_per_ki_token_s


class Engine:
    """One system's engine: HBM cache + host pool + an L3 :class:`~flatcake.replay.systems.L3System`.

    Args:
        system: the L3 system (owns the backend and the host pool).
        profile: model profile (cost model).
        cfg: engine knobs.
    """

    def __init__(self, system, profile: ModelProfile, cfg: EngineConfig):
        self.system = system
        self.profile = profile
        self.cfg = cfg
        self.hbm = HbmCache(cfg.hbm_pages)
        self.pages = HostPages(system.pool)
        self.content = PageContent(system.pool)
        if self.content.page_bytes != profile.page_bytes:
            raise ValueError("host pool page bytes disagree with the model profile")
        if self.pages.free_pages < 2 * STORAGE_BATCH_PAGES:
            raise ValueError(f"host_pool_pages must be >= {2 * STORAGE_BATCH_PAGES}")

    def flush(self) -> None:
        """Drop the HBM prefix cache, as SGLang's ``POST /flush_cache`` drops its device (and
        host) tiers; the L3 keeps its pages."""
        self.hbm = HbmCache(self.cfg.hbm_pages)

    def run(self, keys: Sequence[str], prompt_tokens: int) -> RequestOutcome:
        """Serve one request whose prompt has page keys ``keys`` and ``prompt_tokens`` tokens."""
        t_start = time.perf_counter()
        P = self.profile.page_size
        sysm = self.system
        out = RequestOutcome(pages=len(keys), prompt_tokens=prompt_tokens)
        usable = keys[: reusable_pages(len(keys), prompt_tokens, P)]
        n_hbm = self.hbm.match_prefix(usable)
        out.hbm_pages = n_hbm
        rest = usable[n_hbm:]
        thr = self.cfg.prefetch_threshold_tokens
        loaded = 0
        if rest and len(rest) * P >= thr:
            hit = sysm.exists(list(rest), list(keys[:n_hbm]))
            out.query_s = sysm.last_call_s
            hit = max(0, min(int(hit), len(rest)))
            out.l3_query_pages = hit
            if hit and hit * P >= thr:
                # SGLang's clock starts at the first admission poll that finds the prefetch not
                # done: here, after the hit query; its budget is for the span asked (rest)
                deadline = self.cfg.prefetch_timeout_s(len(rest) * P)
                for b in range(0, hit, STORAGE_BATCH_PAGES):
                    if deadline is not None and out.read_s > deadline:
                        break
                    batch = list(rest[b: min(hit, b + STORAGE_BATCH_PAGES)])
                    host = self.pages.alloc(len(batch))
                    try:
                        got, dram, ssd = sysm.get(batch, host, list(keys[: n_hbm + b]))
                        out.read_s += sysm.last_call_s
                        out.backlog_pages += sysm.last_backlog_pages
                        sysm.after_call()
                        for i in range(got):
                            if not self.content.verify(int(host[i * P]), batch[i]):
                                out.verify_failures += 1
                    finally:
                        self.pages.free(host)
                    loaded += got
                    out.dram_pages += dram
                    out.ssd_pages += ssd
                    if got < len(batch):
                        break
        computed = list(keys[n_hbm + loaded:])
        out.computed_pages = len(computed)
        # prefill: tokens not delivered from HBM or L3 (the partial tail page is always computed)
        cached_tokens = (n_hbm + loaded) * P
        out.prefill_s = self.profile.prefill_s(max(0, prompt_tokens - cached_tokens), cached_tokens)
        out.load_s = self.profile.load_s(loaded * self.profile.page_bytes)
        # backup (write-through) of the newly computed pages
        for b in range(0, len(computed), STORAGE_BATCH_PAGES):
            batch = computed[b: b + STORAGE_BATCH_PAGES]
            host = self.pages.alloc(len(batch))
            try:
                for i, k in enumerate(batch):
                    self.content.fill(int(host[i * P]), k)
                sysm.prepare_set(batch)
                ok = sysm.set(batch, host, list(keys[: n_hbm + loaded + b]))
                out.write_s += sysm.last_call_s
                sysm.after_call()
            finally:
                self.pages.free(host)
            if not ok:
                out.failed_write_pages += len(computed) - b
                break
            out.written_pages += len(batch)
        self.hbm.insert(keys)
        out.wall_s = time.perf_counter() - t_start
        return out
