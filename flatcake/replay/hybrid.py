"""Hybrid model profiles in the replay: the data in SGLang's v2 host pools (DeepSeek-V4).

A profile with ``model.pools`` (a list, one entry per host pool) is *hybrid*: as in SGLang
0.5.23's DeepSeek-V4 HiCache (``mem_cache/hybrid_cache/hybrid_pool_assembler.py``), the KV
anchor is SGLang's ``LogicalHostPool`` (page indices, no bytes) and every byte lives in the
extra pools, each one SGLang's own ``DeepSeekV4PagedHostPool`` built on the CPU with the
pool's geometry. Pool entry keys:

* ``name``: SGLang's ``PoolName`` value (``deepseek_v4_c4``, ``deepseek_v4_c4_indexer``,
  ``swa``, ...); not ``kv``.
* ``layers``: layers the pool holds.
* ``item_bytes``: bytes of one host page of one layer (``DeepSeekV4PagedHostPool.item_bytes``).
* ``hit_policy``: ``all_pages`` (KV-derived: every page of the prefix, read and written with
  the KV pages, ``indices_from_pool = kv``) or ``trailing_pages`` (only the last
  ``window_pages`` pages before the cut, read after the KV-derived pools and written for the
  last pages of each backup: SGLang's SWA state).
* ``window_pages``: ``trailing_pages`` only: pages of the window (default 1).

:class:`PoolSpec` is one entry; :class:`HybridPools` the host pools of one system;
:class:`PoolContent` the deterministic bytes of one pool's pages. The engine that drives them
is :class:`flatcake.replay.hybrid_engine.HybridEngine`.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, replace
from typing import Any, Mapping, Optional, Sequence

import numpy as np
import torch
import xxhash

#: hit policies a pool entry may name (SGLang's ``PoolHitPolicy`` values)
HIT_POLICIES = ("all_pages", "trailing_pages")
_KEYS = {"name", "layers", "item_bytes", "hit_policy", "window_pages"}
_MIX = 0x5851F42D4C957F2D  # odd 63-bit multiplier (as flatcake.replay.engine.PageContent)


@dataclass(frozen=True)
class PoolSpec:
    """One extra host pool of a hybrid profile (one ``model.pools`` entry).

    Attributes:
        name: SGLang's pool name (``PoolName`` value).
        layers: layers of the pool.
        item_bytes: bytes per layer per host page.
        hit_policy: ``all_pages`` or ``trailing_pages``.
        window_pages: pages of a ``trailing_pages`` window (1 for ``all_pages``).
    """

    name: str
    layers: int
    item_bytes: int
    hit_policy: str = "all_pages"
    window_pages: int = 1

    @property
    def page_bytes(self) -> int:
        """Bytes of one page of this pool (all layers)."""
        return self.layers * self.item_bytes

    @property
    def trailing(self) -> bool:
        """True for a ``trailing_pages`` pool (SGLang's SWA state)."""
        return self.hit_policy == "trailing_pages"

    @classmethod
    def from_dict(cls, d: Mapping[str, Any], i: int) -> "PoolSpec":
        """Build entry ``i`` of ``model.pools``.

        Raises:
            ValueError: an unknown key, a missing or non-positive number, an unknown pool name
                or hit policy (the message names ``model.pools[i].<key>``).
        """
        from sglang.srt.mem_cache.hicache_storage import PoolName

        where = f"model.pools[{i}]"
        if not isinstance(d, Mapping):
            raise ValueError(f"{where}: expected a mapping (got {d!r})")
        extra = set(d) - _KEYS
        if extra:
            raise ValueError(f"{where}: unknown key(s) {sorted(extra)}")
        names = {p.value for p in PoolName} - {PoolName.KV.value}
        name = str(d.get("name", ""))
        if name not in names:
            raise ValueError(f"{where}.name: {name!r} is not an extra pool of SGLang ({', '.join(sorted(names))})")
        kw: dict[str, Any] = {"name": name}
        for k in ("layers", "item_bytes", "window_pages"):
            if k not in d:
                if k == "window_pages":
                    continue
                raise ValueError(f"{where}.{k}: required")
            try:
                kw[k] = int(float(d[k]))
            except (TypeError, ValueError):
                raise ValueError(f"{where}.{k}: expected an integer (got {d[k]!r})") from None
            if kw[k] < 1:
                raise ValueError(f"{where}.{k}: must be at least 1 (got {kw[k]})")
        pol = str(d.get("hit_policy", "all_pages"))
        if pol not in HIT_POLICIES:
            raise ValueError(f"{where}.hit_policy: one of {', '.join(HIT_POLICIES)} (got {pol!r})")
        if pol == "all_pages" and kw.get("window_pages", 1) != 1:
            raise ValueError(f"{where}.window_pages: only for hit_policy trailing_pages")
        return cls(hit_policy=pol, **kw)

    def scaled(self, n: int) -> "PoolSpec":
        """``item_bytes`` divided by ``n`` (``--scale N``).

        Raises:
            ValueError: ``n`` does not divide ``item_bytes`` (names ``--scale`` and the pool).
        """
        if self.item_bytes % n:
            raise ValueError(f"--scale: {n} must divide model.pools[{self.name}].item_bytes ({self.item_bytes})")
        return replace(self, item_bytes=self.item_bytes // n)


def parse_pools(raw: Any) -> tuple[PoolSpec, ...]:
    """``model.pools`` as :class:`PoolSpec` s (profile order).

    Raises:
        ValueError: not a list, an entry is bad (:meth:`PoolSpec.from_dict`), a name repeats, or
            no pool is ``all_pages`` (nothing would carry the prefix's pages).
    """
    if not isinstance(raw, (list, tuple)):
        raise ValueError(f"model.pools: expected a list of pools (got {raw!r})")
    specs = tuple(PoolSpec.from_dict(d, i) for i, d in enumerate(raw))
    names = [s.name for s in specs]
    if len(set(names)) != len(names):
        raise ValueError(f"model.pools: a pool name repeats ({names})")
    if not any(not s.trailing for s in specs):
        raise ValueError("model.pools: needs at least one all_pages pool (the prefix's pages)")
    return specs


def pools_as_dicts(specs: Sequence[PoolSpec]) -> list[dict]:
    """``specs`` as plain dicts (``summary.json``), each with its ``page_bytes``."""
    return [{**asdict(s), "page_bytes": s.page_bytes} for s in specs]


class HybridPools:
    """The host pools of one system running a hybrid profile.

    ``anchor`` is SGLang's ``LogicalHostPool`` (``pages × page_size`` token slots, no bytes);
    ``pools[name]`` SGLang's ``DeepSeekV4PagedHostPool`` for each spec, pages of ``page_size``
    slots, in ``layout``, unpinned on the CPU. Each ``all_pages`` pool has the anchor's
    ``pages``, so an anchor page number addresses the same page in each (SGLang's KV-derived
    pools use the anchor's indices); the ``trailing_pages`` pools have their own, smaller host
    space, as SGLang's SWA host pool (``swa_num_host_pages``): :attr:`trailing_host_pages` =
    2 × the largest window, one free list for all of them (a 6.4 MB DeepSeek-V4 SWA page would
    otherwise cost 3.3 GB of host memory for 512 pages).

    Args:
        specs: the profile's pools.
        pages: host pages per pool.
        page_size: tokens per page.
        layout: host layout (``page_first``, ``layer_first``, ``page_first_direct``).
    """

    def __init__(self, specs: Sequence[PoolSpec], pages: int, page_size: int, layout: str):
        from flatcake.replay.sglang_cpu import ensure_importable

        ensure_importable()
        from sglang.srt.mem_cache.memory_pool_host import DeepSeekV4PagedHostPool, LogicalHostPool

        self.specs = tuple(specs)
        self.anchor = LogicalHostPool(pages * page_size, page_size, layout=layout)
        self.pools = {}
        self.trailing_host_pages = 2 * max((s.window_pages for s in self.specs if s.trailing), default=0)
        for s in self.specs:
            # the host pool reads only the device buffers' count (its layers) and, for a GPU
            # copy kernel, their shapes: one 1-row CPU buffer per layer stands in
            dev = [torch.empty(1, s.item_bytes, dtype=torch.uint8) for _ in range(s.layers)]
            self.pools[s.name] = DeepSeekV4PagedHostPool(
                s.name, dev, item_bytes=s.item_bytes, num_host_pages=self.trailing_host_pages if s.trailing else pages,
                slot_page_size=page_size,
                layout=layout, device="cpu", pin_memory=False)

    @property
    def derived(self) -> tuple[PoolSpec, ...]:
        """The ``all_pages`` (KV-derived) pools."""
        return tuple(s for s in self.specs if not s.trailing)

    @property
    def trailing(self) -> tuple[PoolSpec, ...]:
        """The ``trailing_pages`` pools."""
        return tuple(s for s in self.specs if s.trailing)


class PoolContent:
    """Deterministic bytes of one pool's pages, and their bit-exact check.

    ``bytes(pool, key)`` = the little-endian int64 words ``w[i] = i × 0x5851F42D4C957F2D +
    xxh64(pool + "/" + key)`` (wrapping), cut to the pool's page bytes, in the order of the
    pool's flat data page (``get_data_page(slot, flat=True)``, uint8). Pools differ in the seed,
    so a page read into the wrong pool never verifies.

    Args:
        pool: SGLang host pool (``get_data_page``, ``set_from_flat_data_page``).
        name: the pool's name (part of the seed).
    """

    def __init__(self, pool, name: str):
        self.pool = pool
        self.name = name
        self.page_bytes = int(pool.get_data_page(0, flat=True).numel())
        words = -(-self.page_bytes // 8)
        self._base = torch.from_numpy((np.arange(words, dtype=np.uint64) * np.uint64(_MIX)).view(np.int64))
        self._buf = torch.empty_like(self._base)

    def expected(self, key: str) -> torch.Tensor:
        """The page's bytes: uint8 tensor of ``page_bytes`` (a view of a reused buffer)."""
        seed = xxhash.xxh64_intdigest(f"{self.name}/{key}".encode()) - (1 << 63)
        torch.add(self._base, seed, out=self._buf)
        return self._buf.view(torch.uint8)[: self.page_bytes]

    def fill(self, host_slot: int, key: str) -> None:
        """Write ``key``'s bytes into the pool's page at token slot ``host_slot``."""
        self.pool.set_from_flat_data_page(host_slot, self.expected(key))

    def verify(self, host_slot: int, key: str) -> bool:
        """True when the pool's page at ``host_slot`` holds exactly ``key``'s bytes."""
        got = self.pool.get_data_page(host_slot, flat=True)
        return torch.equal(got.reshape(-1).view(torch.uint8), self.expected(key))


def pool_transfer(spec: PoolSpec, keys: Optional[list] = None, host_indices: Optional[torch.Tensor] = None):
    """SGLang ``PoolTransfer`` for ``spec``: ``all_pages`` pools are KV-derived
    (``indices_from_pool = kv``), ``trailing_pages`` pools carry their window's ``keys``."""
    from sglang.srt.mem_cache.hicache_storage import PoolHitPolicy, PoolName, PoolTransfer

    return PoolTransfer(name=PoolName(spec.name), host_indices=host_indices, keys=keys,
                        hit_policy=PoolHitPolicy(spec.hit_policy),
                        indices_from_pool=None if spec.trailing else PoolName.KV)
