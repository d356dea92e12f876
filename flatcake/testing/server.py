"""Start a real SGLang 0.5.23 server on the CPU (:mod:`flatcake.testing.serve_cpu`), talk to it and
stop it: the harness of ``tests/e2e/`` and of anyone checking FlatCake in a server by hand.

Lifecycle::

    server = CpuServer(ServerSpec(model_path=..., storage=flatcake_storage(pool_dir)), workdir)
    server.start()              # setsid subprocess on 127.0.0.1:<free port>, own PROMETHEUS_MULTIPROC_DIR
    server.wait_ready()         # GET /health_generate == 200 (30-40 s on 2 cores)
    g = server.generate(ids)    # POST /generate (input_ids, greedy) -> Generation(output_ids, storage_tokens, ...)
    server.flush()              # POST /flush_cache?timeout= (device + host tiers; L3 keeps its pages)
    server.stop()               # SIGTERM to the main pid, then SIGKILL to the whole process group

SGLang SIGKILLs its scheduler at shutdown, so a backend's ``close()`` never runs: a restarted server
sees the pool exactly as a crash would leave it. Everything the server writes (pool, log, metrics
directory) lies under ``workdir``.
"""

from __future__ import annotations

import json
import os
import re
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Dict, List, Optional, Sequence, Tuple

import requests

from flatcake.testing.serve_cpu import cpu_server_args, cpu_server_env

#: per-request timeout: 2 of 11 runs had a ~12 s stall on a first long request under CPU contention
REQUEST_TIMEOUT_S = 180.0
#: start-up limit (imports, tokenizer, scheduler; 30-40 s alone on 2 cores, more when the suite runs)
START_TIMEOUT_S = 240.0

_LABEL = re.compile(r'(\w+)="([^"]*)"')

#: the ``dynamic``-backend keys that select FlatCake (``README.md``)
FLATCAKE_DYNAMIC = {"backend_name": "flatcake", "module_path": "flatcake", "class_name": "FlatCakeStorage",
                    "interface_v1": 1, "hicache_storage_pass_prefix_keys": True}


def flatcake_storage(pool_dir: str | Path, **overrides: Any) -> Dict[str, Any]:
    """FlatCake's extra config for a test server: a small pool (2 × 64 MiB SSD files, 16 MiB DRAM;
    the defaults preallocate 2 GiB per rank) in ``pool_dir``, plus ``overrides`` (dotted keys)."""
    cfg = dict(FLATCAKE_DYNAMIC)
    cfg.update({"ssd.path": str(pool_dir), "ssd.file_bytes": 64 << 20, "ssd.max_files": 2,
                "dram.capacity_bytes": 16 << 20})
    cfg.update(overrides)
    return cfg


#: SGLang's ``dynamic`` linker keys that select FlatCake's direct L3 linker (``docs/linker.md``)
FLATCAKE_LINKER = {"linker": "FlatCakeLinker", "linker_module_path": "flatcake.linker"}
#: the SGLang flags of the direct linker (the config JSON follows the last one)
LINKER_FLAGS = ["--enable-unified-cache-external-linker", "--unified-cache-external-linker-backend", "dynamic",
                "--unified-cache-external-linker-config"]


def flatcake_linker(pool_dir: str | Path, **overrides: Any) -> Dict[str, Any]:
    """FlatCake's ``linker_extra_config`` for a test server with the direct linker: the same small
    pool as :func:`flatcake_storage` (FlatCake's keys only), plus ``overrides`` (dotted keys)."""
    cfg = {"ssd.path": str(pool_dir), "ssd.file_bytes": 64 << 20, "ssd.max_files": 2, "dram.capacity_bytes": 16 << 20}
    cfg.update(overrides)
    return cfg


def free_port() -> int:
    """A TCP port on 127.0.0.1 that was free a moment ago."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@dataclass
class ServerSpec:
    """One server's arguments. ``storage``: FlatCake's ``dynamic`` extra config
    (:func:`flatcake_storage`), or None for HiCache without L3 (``hicache=False``: no HiCache at all).
    ``launcher``: start through ``flatcake-sglang`` (``storage`` then passed as
    ``--hicache-storage-backend flatcake`` with the FlatCake keys only). ``linker``: FlatCake's
    ``linker_extra_config`` (:func:`flatcake_linker`): SGLang's direct L3 linker instead of HiCache
    (no HiCache flags; through the launcher as ``flatcake-sglang --direct``)."""

    model_path: str
    page_size: int = 16
    layout: str = "page_first_direct"
    max_total_tokens: int = 4096
    hicache: bool = True
    hicache_ratio: float = 2.0
    prefetch_policy: str = "wait_complete"
    write_policy: Optional[str] = None
    storage: Optional[Dict[str, Any]] = None
    linker: Optional[Dict[str, Any]] = None
    launcher: bool = False
    extra_args: List[str] = field(default_factory=list)
    env: Dict[str, str] = field(default_factory=dict)

    def argv(self, port: int) -> List[str]:
        """The server's command line after ``python -m flatcake.testing.serve_cpu``."""
        args = (["--launcher"] if self.launcher else []) + [
            "--model-path", self.model_path, "--host", "127.0.0.1", "--port", str(port),
            "--enable-cache-report", "--enable-metrics", "--log-level", "info",
        ] + cpu_server_args(self.page_size, self.layout, self.max_total_tokens)
        if self.linker is not None:
            if self.launcher:
                args.insert(1, "--direct")
                return args + ["--unified-cache-external-linker-config",
                               json.dumps({"linker_extra_config": self.linker})] + list(self.extra_args)
            return args + LINKER_FLAGS + [json.dumps({**FLATCAKE_LINKER, "linker_extra_config": self.linker})] \
                + list(self.extra_args)
        if self.hicache:
            args += ["--enable-hierarchical-cache", "--hicache-ratio", str(self.hicache_ratio),
                     "--hicache-storage-prefetch-policy", self.prefetch_policy]
            if self.write_policy:
                args += ["--hicache-write-policy", self.write_policy]
        if self.hicache and self.storage is not None:
            if self.launcher:
                own = {k: v for k, v in self.storage.items() if k not in FLATCAKE_DYNAMIC}
                args += ["--hicache-storage-backend", "flatcake",
                         "--hicache-storage-backend-extra-config", json.dumps(own)]
            else:
                args += ["--hicache-storage-backend", "dynamic",
                         "--hicache-storage-backend-extra-config", json.dumps(self.storage)]
        return args + list(self.extra_args)


@dataclass(frozen=True)
class Generation:
    """One ``/generate`` answer: the greedy ``output_ids``, the prompt length and where SGLang says
    the cached prefix came from (``meta_info.cached_tokens_details``: tokens from device, host and
    storage; zeros when nothing was cached)."""

    output_ids: List[int]
    prompt_tokens: int
    cached_tokens: int
    device_tokens: int
    host_tokens: int
    storage_tokens: int
    meta: Dict[str, Any]

    @classmethod
    def from_response(cls, body: Dict[str, Any]) -> "Generation":
        meta = body["meta_info"]
        details = meta.get("cached_tokens_details") or {}
        return cls(output_ids=list(body["output_ids"]), prompt_tokens=int(meta["prompt_tokens"]),
                   cached_tokens=int(meta.get("cached_tokens") or 0), device_tokens=int(details.get("device", 0)),
                   host_tokens=int(details.get("host", 0)), storage_tokens=int(details.get("storage", 0)), meta=meta)


class ServerError(RuntimeError):
    """The server did not start, died, or answered with an error (the message holds its log tail)."""


class CpuServer:
    """A real SGLang server process group on 127.0.0.1 (see the module docstring)."""

    def __init__(self, spec: ServerSpec, workdir: str | Path, name: str = "server"):
        self.spec = spec
        self.workdir = Path(workdir)
        self.name = name
        self.port = 0
        self.proc: Optional[subprocess.Popen] = None
        self.log_path = self.workdir / f"{name}.log"
        self.prom_dir = self.workdir / f"{name}-prometheus"
        self.tmp_dir = self.workdir / f"{name}-tmp"

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    # ------------------------------------------------------------------ lifecycle
    def start(self) -> "CpuServer":
        self.workdir.mkdir(parents=True, exist_ok=True)
        self.prom_dir.mkdir(parents=True, exist_ok=True)
        for stale in self.prom_dir.iterdir():
            stale.unlink()
        self.port = free_port()
        env = cpu_server_env()
        tmp = self.tmp_dir  # SGLang leaves its IPC socket files in $TMPDIR
        tmp.mkdir(exist_ok=True)
        env.update({"PROMETHEUS_MULTIPROC_DIR": str(self.prom_dir), "PYTHONUNBUFFERED": "1",
                    "TOKENIZERS_PARALLELISM": "false", "HF_HUB_OFFLINE": "1", "TMPDIR": str(tmp)})
        env.update(self.spec.env)
        cmd = [sys.executable, "-m", "flatcake.testing.serve_cpu"] + self.spec.argv(self.port)
        with open(self.log_path, "ab") as log:
            log.write(f"\n=== {time.strftime('%H:%M:%S')} {' '.join(cmd)}\n".encode())
            self.proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env,
                                         start_new_session=True, cwd=str(self.workdir))
        return self

    def wait_ready(self, timeout_s: float = START_TIMEOUT_S) -> "CpuServer":
        """Wait until ``/health_generate`` answers 200 (a real forward pass ran)."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.proc is None or self.proc.poll() is not None:
                raise ServerError(f"{self.name} exited ({self.proc and self.proc.returncode}) during start-up:\n"
                                  + self.log_tail())
            try:
                if requests.get(self.url + "/health_generate", timeout=30).status_code == 200:
                    return self
            except requests.RequestException:
                pass
            time.sleep(1.0)
        raise ServerError(f"{self.name} not ready after {timeout_s:.0f} s:\n" + self.log_tail())

    def stop(self, grace_s: float = 15.0) -> None:
        """SIGTERM the main process (SGLang then SIGKILLs its scheduler), wait ``grace_s``, then
        SIGKILL whatever is left of the process group, and remove the ``/dev/shm`` files its
        processes had open (:meth:`_shared_memory_in_use`)."""
        if self.proc is None:
            return
        pgid = self.proc.pid
        shared = self._shared_memory_in_use()
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=grace_s)
            except subprocess.TimeoutExpired:
                pass
        try:
            os.killpg(pgid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        if self.proc.poll() is None:
            self.proc.wait(timeout=30)
        deadline = time.monotonic() + 30
        while _group_alive(pgid) and time.monotonic() < deadline:
            time.sleep(0.2)
        self.proc = None
        self._unlink(shared)

    def _shared_memory_in_use(self) -> set:
        """``/dev/shm`` files the server's processes (its process group) have open or mapped now:
        SGLang's load snapshot, its ``sgl_shm_*`` queues, multiprocessing semaphores."""
        pgid, found = self.proc.pid, set()
        for proc in Path("/proc").iterdir():
            if not proc.name.isdigit():
                continue
            try:
                if int((proc / "stat").read_text().rsplit(")", 1)[1].split()[2]) != pgid:
                    continue
                paths = [os.readlink(fd) for fd in (proc / "fd").iterdir()]
                paths += [line.split(None, 5)[5] for line in (proc / "maps").read_text().splitlines()
                          if len(line.split(None, 5)) == 6]
            except (OSError, IndexError, ValueError):
                continue
            found.update(p.replace(" (deleted)", "") for p in paths if p.startswith("/dev/shm/"))
        return found

    @staticmethod
    def _unlink(paths: set) -> None:
        """Remove ``/dev/shm`` files the killed processes could not unlink themselves (SGLang
        SIGKILLs its scheduler; its own sweep, ``utils/stale_shm_cleanup.py``, runs only in its CI)."""
        for path in paths:
            try:
                os.unlink(path)
            except OSError:
                pass

    def __enter__(self) -> "CpuServer":
        return self.start().wait_ready()

    def __exit__(self, *exc) -> None:
        self.stop()

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def log_tail(self, lines: int = 60) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return "(no log)"

    def log_text(self) -> str:
        return self.log_path.read_text(errors="replace") if self.log_path.exists() else ""

    # ------------------------------------------------------------------ requests
    def post(self, path: str, payload: Optional[dict] = None, timeout_s: float = REQUEST_TIMEOUT_S) -> requests.Response:
        r = requests.post(self.url + path, json=payload, timeout=timeout_s)
        if r.status_code != 200:
            raise ServerError(f"POST {path} -> {r.status_code}: {r.text[:500]}\n" + self.log_tail(30))
        return r

    def get(self, path: str, timeout_s: float = 60.0) -> requests.Response:
        r = requests.get(self.url + path, timeout=timeout_s)
        if r.status_code != 200:
            raise ServerError(f"GET {path} -> {r.status_code}: {r.text[:500]}")
        return r

    def generate(self, input_ids: Sequence[int], max_new_tokens: int = 16, session_id: Optional[str] = None,
                 **sampling: Any) -> Generation:
        """Greedy generation from token ids (``temperature`` 0 and ``ignore_eos`` unless given).
        ``session_id``: SGLang 0.5.23's top-level ``GenerateReqInput.session_id`` (a stable
        identity, no session state: it reaches ``InsertParams.session_id`` and a direct linker's
        ``offload(session_id=...)``)."""
        params = {"max_new_tokens": max_new_tokens, "temperature": 0.0, "ignore_eos": True, **sampling}
        payload: Dict[str, Any] = {"input_ids": list(input_ids), "sampling_params": params}
        if session_id is not None:
            payload["session_id"] = session_id
        body = self.post("/generate", payload).json()
        return Generation.from_response(body)

    def flush(self, wait_s: float = 180.0, headers: Optional[Dict[str, str]] = None) -> str:
        """``POST /flush_cache?timeout=wait_s``: drop the device and host tiers once SGLang's
        scheduler is idle (SGLang defers the flush up to ``wait_s`` while a batch, a backup or a
        prefetch is still in flight; without a timeout it refuses at once, even for the batch that
        just answered). ``headers``: e.g. the admin bearer token of a server started with
        ``--admin-api-key``."""
        r = requests.post(self.url + "/flush_cache", params={"timeout": wait_s}, headers=headers,
                          timeout=wait_s + 60)
        if r.status_code != 200:
            raise ServerError(f"POST /flush_cache -> {r.status_code}: {r.text[:500]}\n" + self.log_tail(30))
        return r.text

    def metrics(self) -> str:
        """The ``/metrics`` page (Prometheus text format)."""
        return self.get("/metrics").text


def _group_alive(pgid: int) -> bool:
    try:
        os.killpg(pgid, 0)
        return True
    except ProcessLookupError:
        return False
    except PermissionError:
        return True



def metric_samples(text: str, prefix: str = "") -> List[Tuple[str, Dict[str, str], float]]:
    """``(name, labels, value)`` for every sample in a Prometheus text page whose metric name
    starts with ``prefix``."""
    out = []
    for line in text.splitlines():
        if line.startswith("#") or not line.startswith(prefix):
            continue
        head, _, value = line.rpartition(" ")
        name, _, labels = head.partition("{")
        out.append((name, dict(_LABEL.findall(labels)), float(value)))
    return out


def metric_values(text: str, name: str) -> List[Tuple[Dict[str, str], float]]:
    """``(labels, value)`` for every sample of metric ``name`` in a Prometheus text page."""
    return [(labels, v) for n, labels, v in metric_samples(text, name) if n == name]


def metric_total(text: str, name: str, **labels: str) -> float:
    """The sum of metric ``name`` over its samples whose labels include ``labels``."""
    return sum(v for got, v in metric_values(text, name) if all(got.get(k) == x for k, x in labels.items()))
