"""Helpers shared by the tests: SGLang storage configs, host-pool doubles, deterministic page bytes."""

from __future__ import annotations

import torch
import xxhash

from flatcake.adapter.host_pool import MHAHostPoolDouble, MLAHostPoolDouble
from flatcake.config import FLATCAKE_EXTRA
from flatcake.replay.systems import storage_config as replay_storage_config



def storage_config(extra: dict, *, mla: bool = False, layout: str = "page_first", model: str = "test-model",
                   tp_rank: int = 0, tp_size: int = 1):
    """SGLang's storage config for one rank, with FlatCake selected through the dynamic backend."""
    return replay_storage_config({**FLATCAKE_EXTRA, **extra}, model=model, mla=mla, layout=layout,
                                 tp_rank=tp_rank, tp_size=tp_size)


def make_pool(*, mla=False, layout="page_first", dtype=torch.bfloat16, pages=64, page_size=4, layers=3):
    if mla:
        return MLAHostPoolDouble(size=pages * page_size, page_size=page_size, layer_num=layers, kv_cache_dim=24, dtype=dtype, layout=layout)
    return MHAHostPoolDouble(size=pages * page_size, page_size=page_size, layer_num=layers, head_num=2, head_dim=16, dtype=dtype, layout=layout)


def page_pattern(key: str, numel: int, dtype: torch.dtype) -> torch.Tensor:
    """Deterministic bytes for a page: a function of its key only."""
    seed = xxhash.xxh64_intdigest(key.encode()) & ((1 << 62) - 1)
    g = torch.Generator().manual_seed(seed)
    nbytes = numel * torch.empty((), dtype=dtype).element_size()
    return torch.randint(0, 256, (nbytes,), dtype=torch.uint8, generator=g).view(dtype)


def fill_page(pool, slot: int, key: str) -> None:
    """Write ``page_pattern(key)`` into the host page starting at token slot ``slot``."""
    flat = pool.get_data_page(slot, flat=True)
    pool.set_from_flat_data_page(slot, page_pattern(key, flat.numel(), pool.dtype))


def page_matches(pool, slot: int, key: str) -> bool:
    flat = pool.get_data_page(slot, flat=True)
    return torch.equal(flat.view(torch.uint8), page_pattern(key, flat.numel(), pool.dtype).view(torch.uint8))


def slots_of(pool, pages):
    """int64 host_indices (token slots) for host pages ``pages``."""
    ps = pool.page_size
    return torch.cat([torch.arange(p * ps, (p + 1) * ps) for p in pages]).to(torch.int64)


def write_pages(be, pool, keys, pages, prefix=()):
    """Fill host pages ``pages`` with ``keys``' bytes and back them up through ``batch_set_v1``
    with ``prefix_keys=prefix``, as SGLang's backup thread does; returns its per-page result."""
    from sglang.srt.mem_cache.hicache_storage import HiCacheStorageExtraInfo

    pages = list(pages)
    for k, p in zip(keys, pages):
        fill_page(pool, p * pool.page_size, k)
    return be.batch_set_v1(keys, slots_of(pool, pages), HiCacheStorageExtraInfo(prefix_keys=list(prefix or [])))


def make_store(ssd_dir: str, *, mla=False, layout="page_first", pages=64, page_size=4, layers=3, role="single",
               **overrides):
    """A core :class:`~flatcake.store.page_store.PageStore` without SGLang: ``(store, pool, kv_layout)`` over a
    host-pool double; ``overrides`` are dotted config keys (``ssd.file_bytes=...`` as
    ``**{"ssd.file_bytes": ...}``). Defaults: 4 pool files of 8 MiB, DRAM off."""
    from flatcake.config import load_config
    from flatcake.common.layout import KvPageLayout
    from flatcake.store.page_store import PageStore

    cfg = load_config(None, {"ssd.path": ssd_dir, "ssd.file_bytes": 8 << 20, "ssd.max_files": 4,
                             "dram.capacity_bytes": 0, **overrides})
    pool = make_pool(mla=mla, layout=layout, pages=pages, page_size=page_size, layers=layers)
    lay = KvPageLayout.from_host_pool(pool)
    return PageStore(cfg, lay.geometry, f"test|{lay.name}", role=role), pool, lay


def put_pages(store, pool, lay, keys, pages, prefix=None):
    """Core-level backup: fill host pages ``pages`` with ``keys``' bytes, ``store.put`` them."""
    pages = list(pages)
    for k, p in zip(keys, pages):
        fill_page(pool, p * pool.page_size, k)
    return store.put(keys, lay, pages, prefix)


def two_requests_share(query, keys) -> None:
    """Two requests whose prompts share ``keys`` and then differ ask for them before they are
    written (``query(keys_of_request)`` is the hit query: ``be.batch_exists``,
    ``store.leading_run``, ...): the prefix reference count of ``keys`` becomes 2, a shared
    prompt. (The same request's query re-issued would count once.)"""
    for req in ("req-a", "req-b"):
        query(list(keys) + [f"{keys[-1]}+{req}"])


def slow_read_in_background(be, pool, keys, pages, delay_s: float = 0.3):
    """Start ``be.batch_get_v1(keys, pages)`` on a thread whose FC-CIO restore takes ``delay_s``
    longer; returns ``(thread, results)`` once the read is inside the restore (its scopes pinned)."""
    import threading
    import time

    started, results = threading.Event(), []
    real = be.store.cio.restore

    def slow_restore(*a, **k):
        started.set()
        time.sleep(delay_s)
        return real(*a, **k)

    be.store.cio.restore = slow_restore
    t = threading.Thread(target=lambda: results.append(be.batch_get_v1(keys, slots_of(pool, pages))))
    t.start()
    started.wait(5)
    return t, results


def record_local_clusters(monkeypatch) -> list:
    """Makes every :class:`flatcake.cluster.netns.LocalCluster` started from now on (this test)
    append itself to the returned list, so the test can check afterwards that none left a
    network namespace or its /dev/shm data root behind."""
    import flatcake.cluster.netns as netns

    made: list = []

    class Recorded(netns.LocalCluster):
        def start(self):
            made.append(self)
            return super().start()

    monkeypatch.setattr(netns, "LocalCluster", Recorded)
    return made
