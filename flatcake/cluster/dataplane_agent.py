"""A data-plane node process driven over stdin/stdout (JSON lines), for the tests and
``scripts/bench_cluster.py``: a :class:`~flatcake.cluster.node.ClusterNode` (the replicated
index) plus this node's data plane — a Transfer Engine, an exported DRAM region, one SSD pool
file served by :class:`~flatcake.cluster.remote_ssd.SsdOwnerServer`, and the remote readers.

Lifecycle::

    python -m flatcake.cluster.dataplane_agent     (under ip netns exec <node namespace>)
      -> start {host, config, layers, chunk_bytes, dram_pages, ssd_dir, ...}
      -> write_dram / write_ssd {scope, seq, keys, seed}   pages of deterministic bytes, published
      -> resolve {keys} (the view's RemotePages, kept) -> read {handle | keys}   remote reads
      -> overwrite_dram {keys, seed}                         reuse slots under a reader
      -> close | SIGKILL

Page bytes are :func:`page_data` of (seed, key): the driver computes what a page must hold.
Replies: ``{"ok": true, ...}`` or ``{"ok": false, "error": ...}``; a command never kills the agent.
"""

from __future__ import annotations

import base64
import json
import os
import sys
import time
from typing import Optional

import numpy as np
import xxhash

from flatcake.cluster.agent import serve
from flatcake.gva.address import MEDIUM_DRAM, MEDIUM_SSD, encode_gva

COMMANDS = {"start", "write_dram", "write_ssd", "overwrite_dram", "churn_dram", "wait", "resolve", "read", "raw_read",
            "publish_meta", "set_piece_delay", "stats", "close"}


def page_data(seed: int, key: str, page_bytes: int) -> np.ndarray:
    """Deterministic uint8 ``[page_bytes]`` content of page ``key`` under ``seed``."""
    rng = np.random.default_rng(xxhash.xxh3_64_intdigest(f"{seed}/{key}".encode()))
    return rng.integers(0, 256, page_bytes, dtype=np.uint8)


class DataPlaneAgent:
    """The commands (see the module docstring); one instance per process."""

    def __init__(self):
        self.node = None
        self.handles: dict[int, list] = {}
        self.slot_of: dict[str, int] = {}
        self.ssd_used = 0

    def start(self, config: dict, layers: int, chunk_bytes: int, dram_pages: int, ssd_dir: str,
              file_bytes: int = 64 << 20) -> dict:
        """Join the cluster and start the data plane (:class:`~flatcake.cluster.dataplane.DataPlane`)
        on a DRAM region of ``dram_pages`` pages and one SSD pool file in ``ssd_dir``. ``config``:
        FlatCake overrides (``node_id``, ``cluster.*`` incl. ``cluster.advertise`` and the data-plane
        keys). Reply: ``te`` (the engine's address)."""
        from flatcake.cluster.dataplane import DataPlane
        from flatcake.cluster.node import ClusterNode
        from flatcake.config import DramConfig, load_config
        from flatcake.media.dram import DramRegion

        cfg = load_config(None, config)
        self.node_id, self.layers, self.chunk_bytes = cfg.node_id, layers, chunk_bytes
        self.page_bytes = layers * chunk_bytes
        self.region = DramRegion(DramConfig(capacity_bytes=dram_pages * self.page_bytes, pin="off"), self.page_bytes)
        self.pool_path = os.path.join(ssd_dir, f"node{cfg.node_id}-00000.pool")
        self.file_bytes = file_bytes
        with open(self.pool_path, "wb") as f:
            f.truncate(file_bytes)
        # the pages' destination, preallocated and touched as a host pool is (reads copy into it)
        self.out_buf = np.ones((max(1, cfg.cluster.landing_bytes // self.page_bytes), self.page_bytes), dtype=np.uint8)
        self.node = ClusterNode(cfg.cluster, cfg.node_id).start()
        self.dp = DataPlane(cfg.cluster, cfg.node_id, self.node.lease_id, self.region,
                            (lambda i: self.pool_path, file_bytes)).start()
        return {"te": self.dp.endpoint.address}

    def write_dram(self, scope: int, seq: int, keys: list, seed: int) -> dict:
        """Write pages into free DRAM slots, checksum them, publish the round. Reply: ``gvas``."""
        from flatcake.cluster.remote_dram import dram_round_checksums

        slots = self.region.allocate_locked(len(keys))
        if slots is None:
            raise RuntimeError("DRAM region full")
        arr = self.region.slots.numpy()
        for s, k in zip(slots, keys):
            arr[s] = page_data(seed, k, self.page_bytes)
            self.slot_of[k] = s
        self.region.set_identity(slots, keys)
        sums = dram_round_checksums(self.region, slots, self.layers)
        gvas = [encode_gva(MEDIUM_DRAM, self.node_id, s * self.page_bytes) for s in slots]
        self.node.index.publish_round(scope, seq, MEDIUM_DRAM, keys, gvas, self.chunk_bytes, sums)
        return {"gvas": gvas}

    def overwrite_dram(self, keys: list, seed: int) -> dict:
        """Put other bytes into the slots of ``keys`` (a reclaimed slot reused), no publication."""
        arr = self.region.slots.numpy()
        for k in keys:
            arr[self.slot_of[k]] = page_data(seed, k, self.page_bytes)
        return {}

    def churn_dram(self, keys: list, seed: int, other_seed: int, seconds: float) -> dict:
        """For ``seconds``, on a thread, keep rewriting the slots of ``keys`` alternately with the
        bytes of ``other_seed`` and of ``seed`` (slots reclaimed and reused while others read them;
        no publication). Returns at once. Reply: ``started``."""
        import threading

        arr = self.region.slots.numpy()
        versions = [[page_data(sd, k, self.page_bytes) for k in keys] for sd in (other_seed, seed)]
        slots = [self.slot_of[k] for k in keys]

        def run():
            end = time.monotonic() + seconds
            n = 0
            while time.monotonic() < end:
                for s, page in zip(slots, versions[n % 2]):
                    arr[s] = page
                n += 1
            for s, page in zip(slots, versions[1]):
                arr[s] = page

        threading.Thread(target=run, name="churn", daemon=True).start()
        return {"started": True}

    def write_ssd(self, scope: int, seq: int, keys: list, seed: int) -> dict:
        """Append one layer-major round (chunk (p, l) at base + (l * n + p) * chunk_bytes) to the
        pool file, checksum it, publish it. Reply: ``gvas``."""
        from flatcake.common.align import align_up
        from flatcake.cluster.transfer import page_checksums

        n, cb = len(keys), self.chunk_bytes
        pages = np.stack([page_data(seed, k, self.page_bytes) for k in keys]) if keys else np.zeros((0, 0), np.uint8)
        base = self.ssd_used
        layer_major = pages.reshape(n, self.layers, cb).transpose(1, 0, 2).copy()
        if base + layer_major.nbytes > self.file_bytes:
            raise RuntimeError("SSD pool file full")
        with open(self.pool_path, "r+b") as f:
            f.seek(base)
            f.write(layer_major.tobytes())
            f.flush()
            os.fsync(f.fileno())
        self.ssd_used = align_up(base + layer_major.nbytes)
        gvas = [encode_gva(MEDIUM_SSD, self.node_id, base + p * cb) for p in range(n)]
        self.node.index.publish_round(scope, seq, MEDIUM_SSD, keys, gvas, n * cb,
                                      page_checksums(pages, self.layers, cb))
        return {"gvas": gvas}

    def wait(self, keys: list, present: bool = True, timeout_s: float = 10.0) -> dict:
        """Poll the view until every key is (``present``) or none is. Reply: ``done``, ``elapsed_s``."""
        t0 = time.monotonic()
        while True:
            n = sum(self.node.index.view.contains(k) for k in keys)
            if n == (len(keys) if present else 0):
                return {"done": True, "elapsed_s": time.monotonic() - t0}
            if time.monotonic() - t0 > timeout_s:
                return {"done": False, "elapsed_s": time.monotonic() - t0, "present": n}
            time.sleep(0.002)

    def resolve(self, keys: list) -> dict:
        """Look ``keys`` up in the view now and keep the pages. Reply: ``handle``, ``found``."""
        pages = self.node.index.lookup(keys)
        h = len(self.handles) + 1
        self.handles[h] = pages
        return {"handle": h, "found": sum(p is not None for p in pages)}

    def read(self, handle: Optional[int] = None, keys: Optional[list] = None, data: bool = False) -> dict:
        """Read the pages of ``handle`` (or look ``keys`` up now) from their owners
        (:class:`~flatcake.cluster.remote.RemoteReader`). Reply: ``hit`` (bools), ``misses`` (by
        cause), ``elapsed_s`` (seconds in the reader), ``bytes`` read, ``data`` (base64 of each page
        hit, None for a miss) when asked."""
        pages = self.handles[handle] if handle is not None else self.node.index.lookup(keys)
        out = self.out_buf if len(pages) <= len(self.out_buf) else None
        t0 = time.perf_counter()
        res = self.dp.read(pages, self.layers, self.chunk_bytes, out)
        elapsed = time.perf_counter() - t0
        reply = {"hit": res.hit.tolist(), "misses": res.misses, "elapsed_s": elapsed,
                 "bytes": int(res.hit.sum()) * self.page_bytes}
        if data:
            reply["data"] = [base64.b64encode(res.data[i].tobytes()).decode() if h else None
                             for i, h in enumerate(res.hit)]
        return reply

    def raw_read(self, handle: int) -> dict:
        """The Transfer Engine's raw read of the same bytes as :meth:`read` of DRAM pages: the same
        merged entries (:func:`~flatcake.cluster.remote_dram.transfer_list`), one synchronous batch
        per landing buffer's worth, no checksum, no copy out. Reply: ``ok``, ``elapsed_s``, ``bytes``."""
        from flatcake.cluster.remote_dram import transfer_list

        pages = self.handles[handle]
        desc = self.dp.reader.peers.get(pages[0].node)
        land = self.dp.reader.dram.pool.get()
        per = max(1, land.nbytes // self.page_bytes)
        t0 = time.perf_counter()
        ok = True
        for lo in range(0, len(pages), per):
            local, remote, lengths, sent = transfer_list(desc, pages[lo: lo + per], self.layers, self.chunk_bytes, land.addr)
            ok &= len(sent) == len(pages[lo: lo + per]) and self.dp.endpoint.read(desc.te, local, remote, lengths)
        return {"ok": bool(ok), "elapsed_s": time.perf_counter() - t0, "bytes": len(pages) * self.page_bytes}

    def publish_meta(self, scope: int, seq: int, pages: int = 128) -> dict:
        """Publish a round of ``pages`` page keys with no bytes behind them (SSD GVAs, checksums),
        for the propagation delay. Reply: ``keys``."""
        keys = [f"meta{scope:04d}{seq:06d}{i:04d}".ljust(64, "m") for i in range(pages)]
        gvas = [encode_gva(MEDIUM_SSD, self.node_id, (1 << 40) + ((seq * pages + i) << 12)) for i in range(pages)]
        sums = np.arange(pages * self.layers, dtype=np.uint64).reshape(pages, self.layers)
        self.node.index.publish_round(scope, seq, MEDIUM_SSD, keys, gvas, pages * self.chunk_bytes, sums)
        return {"keys": keys}

    def set_piece_delay(self, seconds: float) -> dict:
        """Make this node's SSD server sleep before each piece (a slow disk; tests only)."""
        self.dp.server.piece_delay_s = seconds
        return {}

    def stats(self) -> dict:
        """Reply: SSD server counters and the view's ``propagation_s`` samples."""
        s, r = self.dp.server, self.dp.reader.ssd
        return {"pieces_served": s.pieces_served, "requests": s.requests, "dropped": s.dropped, "read_s": s.read_s,
                "ssd_wait_s": r.wait_s, "ssd_pull_s": r.pull_s, "ssd_copy_s": r.copy_s,
                "propagation_s": self.node.index.view.propagation_s()}

    def close(self) -> dict:
        """Leave the cluster (revoke the lease), stop the server, remove the pool file."""
        if self.node is not None:
            self.dp.close()
            self.node.close()
            self.node = None
            try:
                os.unlink(self.pool_path)
            except OSError:
                pass
        return {}


class DataPlaneClient:
    """The driver's end of one data-plane agent, started in node ``i``'s namespace by
    :meth:`flatcake.cluster.netns.LocalCluster.spawn` (stopped by the cluster's close).

    Args:
        cluster: the :class:`~flatcake.cluster.netns.LocalCluster`; i: node index.
    """

    #: the agent's module, run with ``python -m`` in the node's namespace (subclasses: their agent)
    MODULE = "flatcake.cluster.dataplane_agent"

    def __init__(self, cluster, i: int):
        import subprocess

        self.i = i
        self.proc = cluster.spawn(i, [sys.executable, "-m", self.MODULE],
                                  stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, bufsize=1)

    def send(self, cmd: str, **kw) -> None:
        """Send a command without reading its reply."""
        self.proc.stdin.write(json.dumps({"cmd": cmd, **kw}) + "\n")
        self.proc.stdin.flush()

    def reply(self, limit_s: float = 120.0) -> dict:
        """The next reply line.

        Raises:
            RuntimeError: the agent exited, or sent nothing for ``limit_s`` seconds (a guard
                against a hung test, not a measurement).
        """
        import select

        ready, _, _ = select.select([self.proc.stdout], [], [], limit_s)
        if not ready:
            raise RuntimeError(f"data-plane agent {self.i}: no reply within {limit_s} s")
        line = self.proc.stdout.readline()
        if not line:
            raise RuntimeError(f"data-plane agent {self.i} exited (status {self.proc.poll()})")
        return json.loads(line)

    def must(self, cmd: str, limit_s: float = 120.0, **kw) -> dict:
        """Send ``cmd`` and return its reply. Raises RuntimeError when it is not ok."""
        self.send(cmd, **kw)
        out = self.reply(limit_s)
        if not out.get("ok"):
            raise RuntimeError(f"data-plane agent {self.i} {cmd}: {out.get('error')}")
        return out


def main() -> int:
    """Serve the data-plane agent's commands from stdin (:func:`flatcake.cluster.agent.serve`)."""
    return serve(DataPlaneAgent(), COMMANDS, "dp-agent")


if __name__ == "__main__":
    sys.exit(main())
