"""The L3 systems of ``scripts/serve_bench.py``: one real SGLang server per system, all with the
same model, page size, device pool, host pool, prefetch policy and prefetch threshold, and — where
a system has them — the same DRAM and SSD capacities.

* ``flatcake``: FlatCake through ``flatcake-sglang`` (``--hicache-storage-backend flatcake``:
  ``buffer_only`` host memory, the FC-MAS plugin); DRAM = the host pool's bytes (FlatCake's DRAM
  replaces SGLang's host cache, README), SSD = the SSD capacity in ``ssd_file_bytes`` files;
* ``flatcake-hostcache``: FlatCake through ``flatcake-sglang`` with SGLang's host tier kept
  (``--hicache-host-memory-mode cache``, as every other system has it) and no DRAM of its own
  (``dram.capacity_bytes`` 0: every page on SSD): the same memory as ``file``, FlatCake as the
  SSD tier behind SGLang's host cache;
* ``file``: SGLang's ``HiCacheFile`` (``--hicache-storage-backend file``), ``file_storage_path``,
  ``max_size`` = the SSD capacity (SGLang's LRU file evictor);
* ``mooncake``: SGLang's own ``MooncakeStore`` (``--hicache-storage-backend mooncake``) on the CPU
  wheel, its master started here (:class:`flatcake.replay.mooncake.MooncakeMaster`, SSD offload on),
  protocol ``tcp``, ``P2PHANDSHAKE``; global segment = the host pool's bytes (at least 16 MiB),
  SSD offload = the SSD capacity (the replay's settings, docs/baselines.md);
* ``peercache``: PeerCache (PyPI ``peercache``, :data:`PEERCACHE_PIN`) through ``dynamic``
  (``peercache.store.PeerCacheStore``, ``interface_v1``), p2p mode over its TCP transport;
  published DRAM pool = the host pool's bytes, write-through disk tier = the SSD capacity; every
  listener on 127.0.0.1, its metrics server off;
* ``none``: HiCache (device + host pools) without L3.

:func:`unavailable` says why a system cannot run here (the bench then skips it and records why).
Mooncake's master and transfer engine listen on every address, so a bench with ``mooncake`` runs
inside a network namespace with loopback only (the replay's rule; ``serve_bench.py`` re-executes
itself there).
"""

from __future__ import annotations

import importlib.util
import os
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Dict, List, Optional

from flatcake.replay import mooncake as mc
from flatcake.testing.server import FLATCAKE_DYNAMIC, ServerSpec, free_port

SYSTEMS = ("flatcake", "flatcake-hostcache", "file", "mooncake", "peercache", "none")
#: the systems that are FlatCake (through ``flatcake-sglang``)
FLATCAKE_SYSTEMS = ("flatcake", "flatcake-hostcache")
#: the PyPI package of the ``peercache`` system (its TCP transport runs on a CPU)
PEERCACHE_PIN = "peercache==0.8.4"
#: set inside the network namespace ``serve_bench.py`` re-executes itself in
NETNS_ENV = "FLATCAKE_SERVE_BENCH_NETNS"


@dataclass(frozen=True)
class Sizes:
    """What every server gets. ``page_size``: tokens per page; ``device_tokens``: the device KV
    pool (``--max-total-tokens``); ``hicache_ratio``: host pool / device pool; ``kv_token_bytes``:
    KV bytes per token; ``ssd_bytes``: each L3's disk capacity, a whole number of FlatCake's
    ``ssd_file_bytes`` files; ``prefetch_threshold``: tokens (SGLang's extra-config key, the same
    for every L3)."""

    page_size: int
    device_tokens: int
    hicache_ratio: float
    kv_token_bytes: int
    ssd_bytes: int
    ssd_file_bytes: int
    prefetch_threshold: int

    @property
    def host_bytes(self) -> int:
        """Bytes of SGLang's host pool (every system has one; FlatCake's DRAM gets as many)."""
        return int(self.hicache_ratio * self.device_tokens) * self.kv_token_bytes


def unavailable(name: str) -> Optional[str]:
    """Why system ``name`` cannot run on this machine, or None."""
    if name == "mooncake":
        why = mc.unavailable_reason()
        if why is None and not os.environ.get(NETNS_ENV) and os.geteuid() != 0:
            why = "the Mooncake master must run in a network namespace (it listens on every address): needs root"
        return why
    if name == "peercache":
        if importlib.util.find_spec("peercache") is None:
            return f"the peercache package is not installed (pip install --no-deps {PEERCACHE_PIN})"
        try:
            import peercache.store  # noqa: F401  (loads libibverbs/librdmacm, which the wheel links)
        except Exception as e:  # noqa: BLE001 - any import failure is the reason
            return f"peercache does not import: {type(e).__name__}: {e}"
    return None


class System:
    """One system's server arguments, its helper processes and its storage directory.

    Lifecycle: ``before_start()`` (helper processes) → ``spec(model)`` → the server → ``stop()``
    (helpers) → ``remove_storage()``."""

    def __init__(self, name: str, sizes: Sizes, root: Path):
        if name not in SYSTEMS:
            raise ValueError(f"unknown system {name!r} (known: {', '.join(SYSTEMS)})")
        self.name = name
        self.sizes = sizes
        self.root = Path(root)
        self.storage_dir = self.root / f"{name}-l3"
        self._master: Optional[mc.MooncakeMaster] = None

    # ----------------------------------------------------------------- lifecycle
    def before_start(self) -> None:
        self.storage_dir.mkdir(parents=True, exist_ok=True)
        if self.name == "mooncake":
            self._master = mc.MooncakeMaster(self._mooncake_opts(), self.root / "mooncake-master.log").start()

    def stop(self) -> None:
        if self._master is not None:
            self._master.stop()
            self._master = None

    def remove_storage(self) -> None:
        shutil.rmtree(self.storage_dir, ignore_errors=True)

    # ----------------------------------------------------------------- the server
    def spec(self, model_path: str) -> ServerSpec:
        s = self.sizes
        common: Dict[str, Any] = {"model_path": model_path, "page_size": s.page_size,
                                  "max_total_tokens": s.device_tokens, "hicache_ratio": s.hicache_ratio,
                                  "prefetch_policy": "wait_complete"}
        threshold = {"prefetch_threshold": s.prefetch_threshold}
        if self.name == "none":
            return ServerSpec(**common)
        if self.name in FLATCAKE_SYSTEMS:
            files = max(2, -(-s.ssd_bytes // s.ssd_file_bytes))
            cfg = dict(FLATCAKE_DYNAMIC, **threshold)
            host_cache = self.name == "flatcake-hostcache"
            cfg.update({"ssd.path": str(self.storage_dir), "ssd.file_bytes": s.ssd_file_bytes,
                        "ssd.max_files": files, "dram.capacity_bytes": 0 if host_cache else s.host_bytes})
            extra = ["--hicache-host-memory-mode", "cache"] if host_cache else []
            return ServerSpec(storage=cfg, launcher=True, extra_args=extra, **common)
        backend, extra, env = self._backend_args()
        extra.update(threshold)
        return ServerSpec(extra_args=["--hicache-storage-backend", backend,
                                      "--hicache-storage-backend-extra-config", _json(extra)],
                          env=env, **common)

    def _mooncake_opts(self) -> dict:
        # the replay's settings (docs/baselines.md), buckets and staging sized to this run's SSD
        return mc.check_extra({"bucket_bytes": max(16 << 20, self.sizes.ssd_bytes // 8),
                               "staging_bytes": max(64 << 20, self.sizes.ssd_bytes // 4)})

    def _backend_args(self) -> tuple:
        s = self.sizes
        if self.name == "file":
            return "file", {"file_storage_path": str(self.storage_dir), "max_size": s.ssd_bytes}, {}
        if self.name == "mooncake":
            extra = {"master_server_address": f"127.0.0.1:{mc.MASTER_RPC_PORT}", "local_hostname": "127.0.0.1",
                     "metadata_server": "P2PHANDSHAKE", "protocol": "tcp",
                     "global_segment_size": max(s.host_bytes, mc.MIN_SEGMENT_BYTES),
                     "enable_ssd_offload": True, "ssd_offload_path": str(self.storage_dir), "check_server": False}
            env = mc.offload_env(s.ssd_bytes, self._mooncake_opts())
            # SGLang's shared transfer engine asks for this host's address; the namespace has loopback only
            env["SGLANG_HOST_IP"] = "127.0.0.1"
            env.setdefault("MC_LOG_LEVEL", os.environ.get("MC_LOG_LEVEL", "ERROR"))
            return "mooncake", extra, env
        if self.name == "peercache":
            extra = {"backend_name": "peercache", "module_path": "peercache.store", "class_name": "PeerCacheStore",
                     "interface_v1": 1, "mode": "p2p", "protocol": "tcp",
                     "discovery_addr": f"127.0.0.1:{free_port()}", "local_hostname": "127.0.0.1",
                     "rdma_bind_host": "127.0.0.1", "control_bind_host": "127.0.0.1", "meta_bind_host": "127.0.0.1",
                     "metrics_enabled": False, "node_id": "serve-bench",
                     "global_segment_size": s.host_bytes, "disk_enabled": True,
                     "disk_path": str(self.storage_dir), "disk_size": s.ssd_bytes}
            return "dynamic", extra, {}
        raise AssertionError(self.name)


def _json(obj: dict) -> str:
    import json

    return json.dumps(obj)


def storage_files(root: Path) -> List[Path]:
    """Every file under ``root`` (a system's storage directory; none when it does not exist). A
    backend may create and remove files meanwhile: ``os.walk`` skips what vanished."""
    return [Path(d) / f for d, _, files in os.walk(root) for f in files]


__all__ = ["FLATCAKE_SYSTEMS", "NETNS_ENV", "PEERCACHE_PIN", "SYSTEMS", "Sizes", "System", "storage_files", "unavailable"]
