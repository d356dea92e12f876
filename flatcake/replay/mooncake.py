"""``mooncake``: the real Mooncake Store with its SSD offload, as SGLang 0.5.23 deploys it
(``docs/baselines.md``).

* **SGLang's own backend**: SGLang's ``MooncakeStore``, created by
  ``StorageBackendFactory.create_backend("mooncake", config)`` and driven through its zero-copy
  path (``batch_exists`` → ``batch_get_v1`` / ``batch_set_v1``) with the host-pool double
  registered, exactly as SGLang's controller calls it. Its master and client are the CPU builds of
  the maintained wheel :data:`MOONCAKE_WHEEL` (protocol ``tcp``, metadata ``P2PHANDSHAKE``).
* **Equal capacity**: the client's global DRAM segment is FlatCake's ``dram.capacity_bytes``
  (at least :data:`MIN_SEGMENT_BYTES`, the smallest the client accepts); its SSD offload
  (bucket storage backend) is capped at FlatCake's SSD capacity
  (``MOONCAKE_OFFLOAD_TOTAL_SIZE_LIMIT_BYTES`` and ``..._BUCKET_MAX_TOTAL_SIZE``) with bucket
  eviction on, so a full disk evicts old buckets instead of failing every write.
* **Lease**: the master keeps every object it handed out or stored for ``default_kv_lease_ttl``
  (10 s by default) and cannot evict it from DRAM meanwhile, so any write burst larger than the
  DRAM segment within 10 s fails with "insufficient space". The harness starts the master with
  ``lease_ttl_ms`` (default :data:`DEFAULTS`, 500 ms: far above a page transfer here).
* **Isolation**: the master's and the transfer engine's listeners bind all addresses, so a replay
  that includes ``mooncake`` runs whole inside a network namespace with loopback only
  (:func:`run_in_namespace`, called by ``flatcake-replay``); each ``MooncakeSystem`` starts its
  own master there (a fresh, empty store per run) and stops it by process id.
* **Media**: which medium served a hit is read from the store's replica descriptors just before
  the timed call (a memory replica: DRAM; else the local-disk replica: SSD).

Needs: the wheel, the Debian package ``libibverbs1`` (the wheel loads ``libibverbs.so.1`` at
import without declaring it; ``make venv`` installs it), the ``sglang-controller`` extra (SGLang's
backend imports its host-pool package), root and iproute2 for the namespace.
:func:`unavailable_reason` says which is missing; the replay then skips this system with it.
"""

from __future__ import annotations

import gc
import logging
import math
import os
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Iterator, Mapping, Optional, Sequence

from flatcake.replay.engine import ModelProfile
from flatcake.replay.systems import COUNTER_KEYS, L3System, profile_storage_config

log = logging.getLogger(__name__)

#: the pip requirement ``make venv`` installs (its CPU build: master and client run without a GPU)
MOONCAKE_WHEEL = "mooncake-transfer-engine-non-cuda==0.3.13.post1"
#: set (to the namespace's name) in a replay that runs inside the harness's network namespace
NETNS_ENV = "FLATCAKE_REPLAY_NETNS"
MASTER_RPC_PORT = 50051
MASTER_METRICS_PORT = 9003
#: the Mooncake client refuses a global segment below 16 MiB
MIN_SEGMENT_BYTES = 16 << 20
#: ``mooncake_extra`` keys: master lease (ms), DRAM eviction watermark and ratio, offload bucket
#: size and client staging buffer (bytes; both divided by ``--scale``), bucket eviction policy,
#: offload heartbeat (s), and whether the master offloads to SSD at eviction (true) or at every put
#: (false) (docs/baselines.md § mooncake)
DEFAULTS: dict[str, Any] = {"lease_ttl_ms": 500, "eviction_high_watermark": 0.7, "eviction_ratio": 0.2,
                            "bucket_bytes": 256 << 20, "staging_bytes": 1 << 30, "eviction_policy": "lru",
                            "heartbeat_s": 1, "offload_on_evict": True}
#: keys Mooncake takes as integers: a fraction would be truncated (a heartbeat of 0.5 s to 0)
WHOLE_KEYS = {"lease_ttl_ms": "milliseconds", "heartbeat_s": "seconds", "bucket_bytes": "bytes",
              "staging_bytes": "bytes"}


def check_extra(extra: Mapping[str, Any]) -> dict[str, Any]:
    """``replay.mooncake_extra`` merged over :data:`DEFAULTS`, validated.

    Raises:
        ValueError: an unknown key, a number that is not positive and finite, a fraction where
            Mooncake takes a whole number (:data:`WHOLE_KEYS`), a watermark or ratio outside
            (0, 1], an eviction policy other than ``lru``/``fifo``/``none``, or an
            ``offload_on_evict`` that is not a boolean (the message names the key).
    """
    if not isinstance(extra, Mapping):
        raise ValueError(f"replay.mooncake_extra: must be a mapping (got {extra!r})")
    unknown = sorted(set(extra) - set(DEFAULTS))
    if unknown:
        raise ValueError(f"replay.mooncake_extra: unknown key(s) {unknown} (known: {', '.join(DEFAULTS)})")
    out = {**DEFAULTS, **dict(extra)}
    for k, v in out.items():
        if k == "offload_on_evict":
            if not isinstance(v, bool):
                raise ValueError(f"replay.mooncake_extra.offload_on_evict: true or false (got {v!r})")
            continue
        if k == "eviction_policy":
            if v not in ("lru", "fifo", "none"):
                raise ValueError(f"replay.mooncake_extra.eviction_policy: lru, fifo or none (got {v!r})")
            continue
        if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v) or v <= 0:
            raise ValueError(f"replay.mooncake_extra.{k}: must be a positive finite number (got {v!r})")
        if k in WHOLE_KEYS and v != int(v):
            raise ValueError(f"replay.mooncake_extra.{k}: must be a whole number ({WHOLE_KEYS[k]}; got {v!r})")
        if k in ("eviction_high_watermark", "eviction_ratio") and v > 1:
            raise ValueError(f"replay.mooncake_extra.{k}: a fraction in (0, 1] (got {v!r})")
    return out


def unavailable_reason() -> Optional[str]:
    """Why the ``mooncake`` system cannot run here, or None when it can.

    Checks the wheel (and ``libibverbs.so.1``, which it loads at import), then, outside the
    harness's namespace, root and iproute2 (needed to create the namespace)."""
    try:
        import mooncake.store  # noqa: F401
    except ImportError as e:
        if "libibverbs" in str(e):
            return ("the Mooncake wheel loads libibverbs.so.1, which is missing: install the Debian package "
                    "libibverbs1 (make venv does so as root)")
        return f"the Mooncake wheel is not installed ({e}); make venv installs {MOONCAKE_WHEEL}"
    if os.environ.get(NETNS_ENV):
        return None
    if os.geteuid() != 0:
        return "creating the network namespace Mooncake must run in needs root (ip netns add)"
    if shutil.which("ip") is None:
        return "creating the network namespace Mooncake must run in needs iproute2's ip command"
    return None


def _ip(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(["ip", *args], capture_output=True, text=True, check=False)


def _stop_pid(pid: int, timeout_s: float = 5.0) -> None:
    """SIGTERM ``pid``, then SIGKILL after ``timeout_s``; returns once the process is gone."""
    for sig, wait in ((signal.SIGTERM, timeout_s), (signal.SIGKILL, timeout_s)):
        try:
            os.kill(pid, sig)
        except ProcessLookupError:
            return
        end = time.monotonic() + wait
        while time.monotonic() < end:
            try:
                os.kill(pid, 0)
            except ProcessLookupError:
                return
            time.sleep(0.05)


@contextmanager
def network_namespace(name: str) -> Iterator[str]:
    """Create network namespace ``name`` with loopback up; on exit stop every process left in it
    by process id and delete it.

    Raises:
        RuntimeError: ``ip netns add`` failed (its message included).
    """
    r = _ip("netns", "add", name)
    if r.returncode != 0:
        raise RuntimeError(f"cannot create network namespace {name}: {r.stderr.strip()}")
    try:
        _ip("-n", name, "link", "set", "lo", "up")
        yield name
    finally:
        pids = _ip("netns", "pids", name).stdout.split()
        for pid in pids:
            _stop_pid(int(pid))
        _ip("netns", "delete", name)


def run_in_namespace(argv: Sequence[str], command: Optional[Sequence[str]] = None, prefix: str = "fc-replay",
                     env_extra: Optional[dict] = None, stop_wait_s: float = 30.0) -> int:
    """Run ``command + argv`` (default: ``flatcake-replay``, i.e. ``python -m
    flatcake.replay.cli``) again inside a new network namespace (loopback only) named
    ``{prefix}-{pid}`` and return its exit status; the namespace and anything left running in it
    are removed after, also on SIGTERM (an interrupt waits ``stop_wait_s`` for the child).
    ``env_extra`` adds environment variables (the namespace's name is in ``NETNS_ENV``).

    Raises:
        RuntimeError: the namespace cannot be created.
    """
    name = f"{prefix}-{os.getpid()}"
    root = str(Path(__file__).resolve().parents[2])
    env = {**os.environ, NETNS_ENV: name, "PYTHONPATH": os.pathsep.join(
        p for p in (root, os.environ.get("PYTHONPATH", "")) if p), **(env_extra or {})}
    env.setdefault("MC_LOG_LEVEL", "ERROR")  # Mooncake logs every call at INFO and each failed put
    command = list(command) if command is not None else [sys.executable, "-m", "flatcake.replay.cli"]

    def on_term(signum, frame):  # a SIGTERM still removes the namespace and what runs in it
        raise KeyboardInterrupt

    previous = signal.signal(signal.SIGTERM, on_term) if threading.current_thread() is threading.main_thread() else None
    try:
        with network_namespace(name):
            proc = subprocess.Popen(["ip", "netns", "exec", name, *command, *argv], env=env)
            try:
                return proc.wait()
            except KeyboardInterrupt:
                proc.send_signal(signal.SIGINT)
                try:
                    return proc.wait(timeout=stop_wait_s)
                except subprocess.TimeoutExpired:
                    proc.kill()
                    return proc.wait()
    finally:
        if previous is not None:
            signal.signal(signal.SIGTERM, previous)


def _master_binary() -> str:
    here = Path(sys.executable).parent / "mooncake_master"
    found = str(here) if here.exists() else shutil.which("mooncake_master")
    if not found:
        raise RuntimeError(f"mooncake_master not found beside {sys.executable} or on PATH ({MOONCAKE_WHEEL})")
    return found


class MooncakeMaster:
    """One ``mooncake_master`` process with SSD offload enabled, in the current namespace.

    Args:
        opts: :data:`DEFAULTS` keys ``lease_ttl_ms`` (``--default_kv_lease_ttl``),
            ``eviction_high_watermark`` and ``eviction_ratio`` (the DRAM eviction flags).
        log_path: the master's output goes there.

    Raises (``start``):
        RuntimeError: the binary is missing, exits, or does not listen within 30 s.
    """

    def __init__(self, opts: Mapping[str, Any], log_path: Path):
        self.flags = [f"--default_kv_lease_ttl={int(opts['lease_ttl_ms'])}",
                      f"--eviction_high_watermark_ratio={float(opts['eviction_high_watermark'])}",
                      f"--eviction_ratio={float(opts['eviction_ratio'])}",
                      f"--offload_on_evict={'true' if opts['offload_on_evict'] else 'false'}"]
        self.log_path = Path(log_path)
        self.proc: Optional[subprocess.Popen] = None

    def start(self) -> "MooncakeMaster":
        cmd = [_master_binary(), f"--rpc_port={MASTER_RPC_PORT}", f"--metrics_port={MASTER_METRICS_PORT}",
               "--enable_offload=true", "--enable_metric_reporting=false", *self.flags]
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        with open(self.log_path, "ab") as out:
            self.proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT)
        end = time.monotonic() + 30.0
        while time.monotonic() < end:
            if self.proc.poll() is not None:
                raise RuntimeError(f"mooncake_master exited with {self.proc.returncode}; see {self.log_path}")
            try:
                socket.create_connection(("127.0.0.1", MASTER_RPC_PORT), timeout=0.5).close()
                return self
            except OSError:
                time.sleep(0.1)
        self.stop()
        raise RuntimeError(f"mooncake_master did not listen on port {MASTER_RPC_PORT} within 30 s; see {self.log_path}")

    def stop(self) -> None:
        """Stop the master by its process id and wait until it is gone (the next master binds
        the same port)."""
        if self.proc is not None:
            self.proc.terminate()  # our child: wait() reaps it (kill -0 would see the zombie)
            try:
                self.proc.wait(timeout=5.0)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
            self.proc = None


def offload_env(ssd_bytes: int, opts: Mapping[str, Any]) -> dict[str, str]:
    """The client's SSD-offload settings (it reads them from the environment at ``setup``)."""
    return {
        "MOONCAKE_OFFLOAD_STORAGE_BACKEND_DESCRIPTOR": "bucket_storage_backend",
        "MOONCAKE_OFFLOAD_TOTAL_SIZE_LIMIT_BYTES": str(int(ssd_bytes)),
        "MOONCAKE_OFFLOAD_BUCKET_MAX_TOTAL_SIZE": str(int(ssd_bytes)),
        "MOONCAKE_OFFLOAD_BUCKET_EVICTION_POLICY": str(opts["eviction_policy"]),
        "MOONCAKE_OFFLOAD_BUCKET_SIZE_LIMIT_BYTES": str(int(opts["bucket_bytes"])),
        "MOONCAKE_OFFLOAD_LOCAL_BUFFER_SIZE_BYTES": str(int(opts["staging_bytes"])),
        "MOONCAKE_OFFLOAD_HEARTBEAT_INTERVAL_SECONDS": str(int(opts["heartbeat_s"])),
    }


@contextmanager
def _environ(values: Mapping[str, str]) -> Iterator[None]:
    saved = {k: os.environ.get(k) for k in values}
    os.environ.update(values)
    try:
        yield
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def _import_backend_module() -> None:
    """Import SGLang's ``mooncake_store`` module on a short-lived thread. An exception swallowed
    during that import keeps its frames alive, and through ``f_back`` every caller's frame with
    every local assigned later (the backend: its client would outlive :meth:`MooncakeSystem.close`
    and retry the stopped master at exit); a thread's stack has no callers of ours.

    Raises:
        ImportError (or what the import raised): the module does not import here.
    """
    import importlib

    from flatcake.replay.sglang_cpu import ensure_importable

    ensure_importable()
    failure: list[BaseException] = []

    def run() -> None:
        try:
            importlib.import_module("sglang.srt.mem_cache.storage.mooncake_store.mooncake_store")
        except BaseException as e:  # noqa: BLE001 - re-raised on the caller's thread
            failure.append(e)

    t = threading.Thread(target=run, name="fc-mooncake-import")
    t.start()
    t.join()
    if failure:
        raise failure[0]


class MooncakeSystem(L3System):
    """See the module docstring.

    Args:
        root: the SSD offload directory (SGLang adds a ``rank_*`` directory below it).
        dram_bytes, ssd_bytes: capacities (bytes).
        extra: :data:`DEFAULTS` overrides.

    Raises:
        RuntimeError: not inside the harness's namespace, or the master or the client fails to
            start (Mooncake's error code included).
        ValueError: ``extra`` that :func:`check_extra` refuses (the message names the key).
    """

    name = "mooncake"

    def __init__(self, profile: ModelProfile, pool, root: Path, dram_bytes: int, ssd_bytes: int,
                 extra: Optional[Mapping[str, Any]] = None):
        if not os.environ.get(NETNS_ENV):
            raise RuntimeError("the mooncake system binds all addresses: run it through flatcake-replay, which runs "
                               "the replay inside a network namespace")
        _import_backend_module()
        from sglang.srt.mem_cache.storage.backend_factory import StorageBackendFactory

        self.opts = check_extra(extra or {})  # the one merge over DEFAULTS, validated
        self.root = Path(root).resolve()  # the client refuses a relative storage_filepath (--out runs/x)
        self.root.mkdir(parents=True, exist_ok=True)
        self.segment_bytes = max(int(dram_bytes), MIN_SEGMENT_BYTES)
        self.master = MooncakeMaster(self.opts, self.root.parent / "mooncake-master.log").start()
        cfg = {"master_server_address": f"127.0.0.1:{MASTER_RPC_PORT}", "local_hostname": "127.0.0.1",
               "metadata_server": "P2PHANDSHAKE", "protocol": "tcp", "global_segment_size": self.segment_bytes,
               "enable_ssd_offload": True, "ssd_offload_path": str(self.root), "check_server": False}
        try:
            with _environ(offload_env(ssd_bytes, self.opts)):
                backend = StorageBackendFactory.create_backend("mooncake", profile_storage_config(profile, cfg), None)
            backend.register_mem_pool_host(pool)
        except Exception:
            self.master.stop()
            raise
        super().__init__(profile, pool, backend)
        self._c = dict.fromkeys(COUNTER_KEYS, 0)
        self._c_lock = threading.Lock()  # the serving model calls from several threads
        inner = self.inner
        self._suffix = f"{inner.mla_suffix}" if inner.is_mla_backend else f"{inner.mha_suffix}"
        self._objects_per_page = 1 if inner.is_mla_backend else 2
        self._media_failed = False

    def _object_key(self, key: str) -> str:
        # SGLang's MooncakeStore names a page's K object <config_prefix>_<key>_<suffix>_k
        prefix = f"{self.inner.config_prefix}_" if self.inner.config_prefix else ""
        return f"{prefix}{key}_{self._suffix}_k"

    def _media(self, keys: Sequence[str]) -> tuple:
        """Per key ``"dram"`` (a memory replica), ``"ssd"`` (only a disk replica) or None."""
        if not keys:
            return ()
        try:
            desc = self.inner.store.batch_get_replica_desc([self._object_key(k) for k in keys])
        except Exception:  # bookkeeping only: unknown media count as SSD
            if not self._media_failed:
                self._media_failed = True
                log.exception("mooncake: batch_get_replica_desc failed; hits are counted as SSD hits")
            return ("ssd",) * len(keys)
        out = []
        for k in keys:
            reps = desc.get(self._object_key(k)) or []
            if any(r.is_memory_replica() for r in reps):
                out.append("dram")
            elif reps:
                out.append("ssd")
            else:
                out.append(None)
        return tuple(out)

    def medium_summary(self, keys):
        from flatcake.store.page_store import MediumSummary

        media = self._media(keys)
        ssd = media.count("ssd")
        return MediumSummary(media.count("dram"), ssd, ssd * self.profile.page_bytes, media)

    def get(self, keys, host_indices, prefix_keys):
        media = self._media(keys)  # before the timed call: harness bookkeeping
        count = self.get_v1(keys, host_indices, prefix_keys)
        dram = sum(1 for m in media[:count] if m == "dram")
        ssd, pb = count - dram, self.profile.page_bytes
        with self._c_lock:
            self._c["hit_pages_dram"] += dram
            self._c["hit_pages_ssd"] += ssd
            self._c["ssd_read_bytes"] += ssd * pb  # objects are read whole: no over-read
            self._c["ssd_read_ops"] += ssd * self._objects_per_page
            self._c["logical_read_bytes_ssd"] += ssd * pb
        return count, dram, ssd

    def set(self, keys, host_indices, prefix_keys):
        res = self.set_v1(keys, host_indices, prefix_keys)
        if res is None:
            return False
        ok = sum(1 for r in res if r)
        with self._c_lock:
            self._c["dram_write_bytes"] += ok * self.profile.page_bytes
            self._c["logical_write_bytes"] += ok * self.profile.page_bytes
        return bool(res) and ok == len(res)

    def counters(self) -> dict[str, int]:
        """Cumulative counters; ``ssd_write_bytes`` is the bucket bytes on disk now (every put is
        offloaded, buckets evicted since are not counted) and ``ssd_write_ops`` the buckets."""
        with self._c_lock:
            c = dict(self._c)
        buckets = [p for p in self.root.rglob("*.bucket") if p.is_file()]
        c["ssd_write_bytes"] = sum(p.stat().st_size for p in buckets)
        c["ssd_write_ops"] = len(buckets)
        return c

    def close(self) -> None:
        """Close the client while its master still runs (its destructor unmounts the segment
        from the master and waits for it otherwise), then stop the master."""
        if self.inner is not None:
            try:
                self.inner.store.close()  # SGLang's close() leaves it to the destructor
            except Exception:
                self._error("close")
            self.backend = self.inner = None
            gc.collect()  # the client's destructor runs now, not at exit
        self.master.stop()
