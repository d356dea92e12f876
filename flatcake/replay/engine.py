"""The serial engine: SGLang's scheduler serving one request at a time, minus the GPU; and the
model profile (KV geometry, prefill cost) every replay uses.

:class:`Engine` is the :class:`~flatcake.replay.engine_core.EngineCore` (the steps every replay
engine shares: HBM match, prefetch threshold and budget, 128-page reads and write-backs, verify)
with its steps run in order on the calling thread. Lifecycle of one request (arrival order, one
request at a time)::

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
from dataclasses import dataclass, replace
from typing import Any, Mapping, Sequence

import torch

from flatcake.adapter.host_pool import MHAHostPoolDouble, MLAHostPoolDouble
# the engine core's parts, importable from here as before issue 25
from flatcake.replay.engine_core import (EngineConfig, EngineCore, HbmCache, HostPages, PageContent,
                                         Prefix, prefill_tokens, read_batches, reusable_counts, reusable_pages,
                                         usable_hit, verify_pages, write_batches, write_dense_batch)


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


# -------------------------------------------------------------------------- the serial engine
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


class Engine(EngineCore):
    """One system's engine, one request at a time: the :class:`EngineCore` (HBM cache, host
    pool) over an L3 :class:`~flatcake.replay.systems.L3System`, the steps run in order on the
    calling thread, each storage call's seconds (``last_call_s``) summed into the request's TTFT.

    Args:
        system: the L3 system (owns the backend and the host pool).
        profile: model profile (cost model).
        cfg: engine knobs.

    Raises:
        ValueError: the host pool's page bytes disagree with ``profile``, or ``host_pool_pages``
            is below 2 × 128.
    """

    def __init__(self, system, profile: ModelProfile, cfg: EngineConfig):
        self.system = system
        self.content = PageContent(system.pool)
        if self.content.page_bytes != profile.page_bytes:
            raise ValueError("host pool page bytes disagree with the model profile")
        super().__init__(profile, cfg, system.pool)

    def run(self, keys: Sequence[str], prompt_tokens: int) -> RequestOutcome:
        """Serve one request whose prompt has page keys ``keys`` and ``prompt_tokens`` tokens."""
        t_start = time.perf_counter()
        P = self.profile.page_size
        sysm = self.system
        out = RequestOutcome(pages=len(keys), prompt_tokens=prompt_tokens)
        prefix = self.match(keys, prompt_tokens)
        n_hbm = out.hbm_pages = prefix.hbm
        rest = list(prefix.rest)
        loaded = 0
        if self.asks_l3(len(rest)):
            hit = usable_hit(sysm.exists(rest, list(keys[:n_hbm])), len(rest))
            out.query_s = sysm.last_call_s
            out.l3_query_pages = hit
            if self.asks_l3(hit):
                # SGLang's clock starts at the first admission poll that finds the prefetch not
                # done: here, after the hit query; its budget is for the span asked (rest)
                budget = self.prefetch_budget_s(prefix)
                loaded = read_batches(hit, lambda b, e: self._read(rest, b, e, keys[: n_hbm + b], out),
                                      lambda: budget is not None and out.read_s > budget)
        computed = list(keys[n_hbm + loaded:])
        out.computed_pages = len(computed)
        # prefill: tokens not delivered from HBM or L3 (the partial tail page is always computed)
        new, cached = prefill_tokens(prompt_tokens, n_hbm + loaded, P)
        out.prefill_s = self.profile.prefill_s(new, cached)
        out.load_s = self.profile.load_s(loaded * self.profile.page_bytes)
        # backup (write-through) of the newly computed pages
        wb = write_batches(keys, n_hbm + loaded, lambda batch, pre: self._write(batch, pre, out))
        out.written_pages, out.failed_write_pages = wb.written, wb.failed
        self.insert(keys)
        out.wall_s = time.perf_counter() - t_start
        return out

    def _read(self, rest: Sequence[str], b: int, e: int, prefix_keys: Sequence[str], out: RequestOutcome) -> int:
        """One 128-page read of ``rest[b:e]`` into bounce host pages: timed, split by medium from
        the system's counters, every delivered page verified; returns the pages delivered."""
        P, sysm = self.profile.page_size, self.system
        batch = list(rest[b:e])
        host = self.pages.alloc(len(batch))
        try:
            got, dram, ssd = sysm.get(batch, host, list(prefix_keys))
            out.read_s += sysm.last_call_s
            out.backlog_pages += sysm.last_backlog_pages
            sysm.after_call()
            out.verify_failures += verify_pages(self.content, host, batch, got, P)
        finally:
            self.pages.free(host)
        out.dram_pages += dram
        out.ssd_pages += ssd
        return got

    def _write(self, batch: Sequence[str], prefix_keys: Sequence[str], out: RequestOutcome) -> bool:
        """One 128-page write-back of ``batch`` from bounce host pages; its seconds to ``write_s``."""
        host = self.pages.alloc(len(batch))
        try:
            ok = write_dense_batch(self.system, self.content, host, batch, prefix_keys, self.profile.page_size)
            out.write_s += self.system.last_call_s
        finally:
            self.pages.free(host)
        return ok


__all__ = ["Engine", "EngineConfig", "EngineCore", "HbmCache", "HostPages", "ModelProfile", "PageContent", "Prefix",
           "RequestOutcome", "reusable_counts", "reusable_pages"]
