"""A cluster node holding a real :class:`~flatcake.adapter.storage.FlatCakeStorage` over a CPU
host-pool double, driven over stdin/stdout one JSON object per line (:func:`~flatcake.cluster.agent.serve`)
— how the tests (and tools) check the backend's cluster wiring across network namespaces
(``docs/cluster.md``, "Backend wiring").

Lifecycle::

    python -m flatcake.cluster.storage_agent        (under ``ip netns exec <node namespace>``)
      -> start   build the backend (cluster.etcd set: it joins the cluster) and register the pool
      -> set / exists / get / wait / clear / stats / flush ...
      -> close   (or SIGKILL: its records expire with its lease)

Interface (stable; every reply is ``{"ok": true, ...}`` or ``{"ok": false, "error": "..."}``):

============== ================================================================================
command        arguments -> reply
============== ================================================================================
``start``      ``config`` (FlatCake overrides: ``node_id``, ``cluster.*``, ...), ``ssd_dir``,
               optional ``mla`` (False), ``layout`` ("page_first"), ``pages`` (64 host pages),
               ``page_size`` (4 tokens), ``layers`` (4), ``model`` ("test-model")
               -> ``page_bytes``, ``namespace``, ``cluster`` (bool: a member was started);
               a second ``start`` closes the previous backend first (its node leaves)
``set``        ``keys``, optional ``shared`` (False: two hit queries first, so Table 2 places
               the round on DRAM as a shared prompt), ``prefix`` (prefix keys)
               -> ``ok`` [bool], ``media`` ["dram"|"ssd"|None] (after the write queue drained)
``exists``     ``keys`` -> ``n`` (``batch_exists``: local run continued by the cluster view)
``get``        ``keys`` -> ``ok`` [bool] (``batch_get_v1`` into zeroed host pages) and
               ``equal`` [bool]: the page's bytes equal :func:`key_bytes` of its key
``get_flat``   ``keys`` -> ``ok``, ``equal`` through the generic ``batch_get`` (flat pages)
``wait``       ``keys``, ``n`` (default all), ``timeout_s`` (10) -> ``done``, ``n``: polls
               ``exists`` until it reports exactly ``n`` (0: until they are gone)
``clear``      -> ``{}`` (``FlatCakeStorage.clear``; retires reach the cluster with ``flush``)
``flush``      ``timeout_s`` -> ``flushed``: write queue drained and cluster publications committed
``stats``      -> ``stats``: ``flatcake_stats()`` (JSON; ``stats["cluster"]`` with a cluster)
``close``      -> ``{}``
============== ================================================================================

Page content is :func:`key_bytes` (a function of the key only), so any node can check a page
another node wrote. Keys are ``str``; pages ``i`` of a call use host pages ``0..len(keys)-1``.
"""

from __future__ import annotations

import sys
import time
from typing import Optional

import numpy as np
import torch
import xxhash

from flatcake.cluster.agent import serve
from flatcake.cluster.dataplane_agent import DataPlaneClient

COMMANDS = {"start", "set", "exists", "get", "get_flat", "wait", "clear", "flush", "stats", "close"}


def key_bytes(key: str, nbytes: int) -> np.ndarray:
    """Deterministic uint8 ``[nbytes]`` content of page ``key`` (a function of the key only)."""
    rng = np.random.default_rng(xxhash.xxh3_64_intdigest(key.encode()))
    return rng.integers(0, 256, nbytes, dtype=np.uint8)


def _jsonable(x):
    if isinstance(x, dict):
        return {str(k): _jsonable(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [_jsonable(v) for v in x]
    if isinstance(x, np.generic):
        return x.item()
    return x


class StorageAgent:
    """The commands (module docstring); one instance per process."""

    def __init__(self):
        self.be = None
        self.pool = None

    def start(self, config: dict, ssd_dir: str, mla: bool = False, layout: str = "page_first", pages: int = 64,
              page_size: int = 4, layers: int = 4, model: str = "test-model") -> dict:
        """Build and register the backend (see the module docstring); a backend already
        started is closed first (its node leaves the cluster)."""
        from flatcake.adapter.host_pool import MHAHostPoolDouble, MLAHostPoolDouble
        from flatcake.adapter.storage import FlatCakeStorage
        from flatcake.config import FLATCAKE_EXTRA
        from flatcake.replay.systems import storage_config

        self.close()
        extra = {**FLATCAKE_EXTRA, "ssd.path": ssd_dir, "ssd.file_bytes": 8 << 20, "ssd.max_files": 4,
                 "dram.capacity_bytes": 4 << 20, "placement.requery_window_s": 0, **config}
        if mla:
            self.pool = MLAHostPoolDouble(size=pages * page_size, page_size=page_size, layer_num=layers,
                                          kv_cache_dim=24, dtype=torch.bfloat16, layout=layout)
        else:
            self.pool = MHAHostPoolDouble(size=pages * page_size, page_size=page_size, layer_num=layers, head_num=2,
                                          head_dim=16, dtype=torch.bfloat16, layout=layout)
        self.be = FlatCakeStorage(storage_config(extra, model=model, mla=mla, layout=layout))
        self.be.register_mem_pool_host(self.pool)
        return {"page_bytes": self.be.layout.geometry.page_bytes, "namespace": self.be.namespace,
                "cluster": self.be.cluster is not None}

    def _slots(self, n: int) -> torch.Tensor:
        ps = self.pool.page_size
        return torch.arange(n * ps, dtype=torch.int64)

    def _fill(self, keys: list) -> None:
        for i, k in enumerate(keys):
            flat = self.pool.get_data_page(i * self.pool.page_size, flat=True)
            nbytes = flat.numel() * flat.element_size()
            self.pool.set_from_flat_data_page(i * self.pool.page_size,
                                              torch.from_numpy(key_bytes(k, nbytes)).view(self.pool.dtype))

    def _equal(self, keys: list) -> list:
        out = []
        for i, k in enumerate(keys):
            flat = self.pool.get_data_page(i * self.pool.page_size, flat=True).contiguous()
            got = flat.view(torch.uint8).numpy()
            out.append(bool(np.array_equal(got, key_bytes(k, got.size))))
        return out

    def set(self, keys: list, shared: bool = False, prefix: Optional[list] = None) -> dict:
        """Fill host pages with the keys' bytes and back them up (``batch_set_v1``)."""
        from sglang.srt.mem_cache.hicache_storage import HiCacheStorageExtraInfo

        info = HiCacheStorageExtraInfo(prefix_keys=list(prefix or []))
        if shared:  # two hit queries of the missing keys: prefix refcount 2 -> DRAM (Table 2)
            self.be.batch_exists(keys, info)
            self.be.batch_exists(keys, info)
        self._fill(keys)
        ok = self.be.batch_set_v1(keys, self._slots(len(keys)), info)
        self.be.store.flush_writes()
        return {"ok": list(ok), "media": list(self.be.medium_summary(keys).media)}

    def exists(self, keys: list) -> dict:
        """``batch_exists``."""
        return {"n": int(self.be.batch_exists(keys))}

    def get(self, keys: list) -> dict:
        """``batch_get_v1`` into zeroed host pages, then compare the bytes."""
        for i in range(len(keys)):
            flat = self.pool.get_data_page(i * self.pool.page_size, flat=True)
            self.pool.set_from_flat_data_page(i * self.pool.page_size, torch.zeros_like(flat))
        ok = list(self.be.batch_get_v1(keys, self._slots(len(keys))))
        return {"ok": ok, "equal": self._equal(keys)}

    def get_flat(self, keys: list) -> dict:
        """The generic ``batch_get`` (flat pages), then compare the bytes."""
        got = self.be.batch_get(keys)
        equal = []
        for k, t in zip(keys, got):
            b = None if t is None else t.contiguous().view(torch.uint8).numpy()
            equal.append(b is not None and bool(np.array_equal(b, key_bytes(k, b.size))))
        return {"ok": [t is not None for t in got], "equal": equal}

    def wait(self, keys: list, n: Optional[int] = None, timeout_s: float = 10.0) -> dict:
        """Poll ``batch_exists`` until it reports ``n`` (default ``len(keys)``)."""
        want = len(keys) if n is None else n
        t0 = time.monotonic()
        while True:
            got = int(self.be.batch_exists(keys))
            if got == want or time.monotonic() - t0 > timeout_s:
                return {"done": got == want, "n": got, "elapsed_s": time.monotonic() - t0}
            time.sleep(0.01)

    def clear(self) -> dict:
        """``FlatCakeStorage.clear``."""
        self.be.clear()
        return {}

    def flush(self, timeout_s: float = 10.0) -> dict:
        """Drain the write queue, then commit the queued cluster publications."""
        return {"flushed": self.be.flush_writes(timeout_s)}

    def stats(self) -> dict:
        """``flatcake_stats()``."""
        return {"stats": _jsonable(self.be.flatcake_stats())}

    def close(self) -> dict:
        """Close the backend (its cluster member leaves: the lease is revoked)."""
        if self.be is not None:
            self.be.close()
            self.be = None
        return {}


class StorageAgentClient(DataPlaneClient):
    """The driver's end of one storage agent, started in node ``i``'s namespace by
    :meth:`flatcake.cluster.netns.LocalCluster.spawn` (stopped by the cluster's close); ``send``,
    ``reply(limit_s)`` and ``must(cmd, limit_s, **kw)`` as
    :class:`~flatcake.cluster.dataplane_agent.DataPlaneClient` (``must`` raises RuntimeError when
    the reply is not ok; a reply guard of ``limit_s`` seconds turns a hang into an error).

    Args:
        cluster: the :class:`~flatcake.cluster.netns.LocalCluster`; i: node index.
    """

    MODULE = "flatcake.cluster.storage_agent"


def main() -> int:
    """Serve a storage node's commands from stdin (:func:`~flatcake.cluster.agent.serve`); returns 0."""
    import flatcake.adapter.storage  # noqa: F401  (imported before the first command)

    return serve(StorageAgent(), COMMANDS, "storage-agent")


if __name__ == "__main__":
    sys.exit(main())
