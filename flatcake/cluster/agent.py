"""A cluster node process driven over its stdin/stdout, one JSON object per line — how the tests
and ``scripts/cluster_up.py`` run nodes in their network namespaces (a pipe crosses namespaces;
no test traffic goes over the cluster's network).

Lifecycle::

    python -m flatcake.cluster.agent        (under ``ip netns exec <node namespace>``)
      -> {"cmd": "start", "config": {...}}  a ClusterNode joins (the config is FlatCake's overrides)
      -> publish / retire / flush / lookup / wait / stats / capacity / reserve / release ...
      -> {"cmd": "close"} (revoke the lease) or SIGKILL (records expire with the lease)

Every reply is ``{"ok": true, ...}`` or ``{"ok": false, "error": "..."}``; a command never kills
the agent. :class:`AgentClient` is the other end.
"""

from __future__ import annotations

import json
import logging
import subprocess
import sys
import time
from typing import Any, Optional


class _Agent:
    def __init__(self):
        self.node = None
        self.capacity = None
        self.reservations: dict[str, Any] = {}

    def start(self, config: dict, register_wait_s: Optional[float] = None) -> dict:
        """Join: ``config`` = FlatCake overrides (``node_id``, ``cluster.*``). Reply: ``lease``."""
        from flatcake.cluster.coordinator import Capacity
        from flatcake.cluster.node import ClusterNode
        from flatcake.config import load_config

        cfg = load_config(None, config)
        self.capacity = Capacity(cfg.node_id, 0, 0)
        self.node = ClusterNode(cfg.cluster, cfg.node_id, lambda: self.capacity).start(register_wait_s)
        return {"lease": self.node.lease_id()}

    def publish(self, scope: int, seq: int, medium: int, keys: list, gvas: list, stride: int,
                checksums: Optional[list] = None) -> dict:
        """Queue one round (ClusterIndex.publish_round). Reply: ``published_s`` (wall clock)."""
        rec = self.node.index.publish_round(scope, seq, medium, keys, gvas, stride, checksums)
        return {"published_s": rec.published_s}

    def retire(self, scope: int) -> dict:
        """Queue the retire of ``scope``."""
        self.node.index.retire_scope(scope)
        return {}

    def flush(self, timeout_s: float = 10.0) -> dict:
        """Wait for the publisher. Reply: ``flushed`` (bool)."""
        return {"flushed": self.node.index.flush(timeout_s)}

    def lookup(self, keys: list) -> dict:
        """Look ``keys`` up in the view. Reply: ``pages`` (dict or None each), ``elapsed_s`` (in-process)."""
        t0 = time.perf_counter()
        pages = self.node.index.lookup(keys)
        elapsed = time.perf_counter() - t0
        return {"elapsed_s": elapsed, "pages": [None if p is None else {
            "node": p.node, "gva": p.gva, "scope": p.scope_id, "stride": p.layer_stride,
            "checksums": None if p.checksums is None else [int(x) for x in p.checksums]} for p in pages]}

    def wait(self, keys: list, present: bool = True, timeout_s: float = 10.0) -> dict:
        """Poll until every key is (``present``) or none is in the view. Reply: ``done``, ``elapsed_s``."""
        t0 = time.monotonic()
        while True:
            n = sum(self.node.index.view.contains(k) for k in keys)
            if n == (len(keys) if present else 0):
                return {"done": True, "elapsed_s": time.monotonic() - t0}
            if time.monotonic() - t0 > timeout_s:
                return {"done": False, "elapsed_s": time.monotonic() - t0, "present": n}
            time.sleep(0.002)

    def stats(self) -> dict:
        """Reply: ``stats`` (ClusterNode.stats) and ``propagation_s`` (seconds, per received record)."""
        return {"stats": self.node.stats(), "propagation_s": self.node.index.view.propagation_s()}

    def capacity_set(self, dram_free: int, ssd_free: int, dram_cap: int = 0, ssd_cap: int = 0) -> dict:
        """Set the free bytes this node reports and publish them now."""
        from flatcake.cluster.coordinator import Capacity

        self.capacity = Capacity(self.node.node_id, dram_free, ssd_free, dram_cap, ssd_cap)
        self.node.coordinator.publish()
        return {}

    def capacity_of(self, node: int) -> dict:
        """Reply: ``capacity`` of ``node`` as published (``dram_free``, ``ssd_free`` bytes) or None."""
        c = self.node.coordinator.capacity_of(node)
        return {"capacity": None if c is None else {"dram_free": c.dram_free_bytes, "ssd_free": c.ssd_free_bytes}}

    def reserve(self, target: int, medium: int, nbytes: int, start_at: float = 0.0) -> dict:
        """Reserve ``nbytes`` of ``target``'s medium, first spinning until wall clock ``start_at``.
        Reply: ``reserved`` (bool) and its ``key``."""
        while time.time() < start_at:  # line several agents up on one instant (a race)
            pass
        r = self.node.coordinator.reserve(target, medium, nbytes)
        if r is None:
            return {"reserved": False}
        self.reservations[r.key] = r
        return {"reserved": True, "key": r.key}

    def release(self, key: str) -> dict:
        """Give back the reservation ``key``."""
        self.node.coordinator.release(self.reservations.pop(key))
        return {}

    def reserved(self, target: int, medium: int) -> dict:
        """Reply: ``bytes`` reserved on ``target``'s medium by every node."""
        return {"bytes": self.node.coordinator.reserved_bytes(target, medium)}

    def compact(self) -> dict:
        """Compact etcd's history up to its current revision. Reply: ``revision``."""
        rev = self.node.session.revision()
        self.node.session.compact(rev)
        return {"revision": rev}

    def close(self, revoke: bool = True) -> dict:
        """Leave the cluster (``revoke``: drop the lease now, else let it expire)."""
        if self.node is not None:
            self.node.close(revoke=revoke)
            self.node = None
        return {}


COMMANDS = {"start", "publish", "retire", "flush", "lookup", "wait", "stats", "capacity_set", "capacity_of",
            "reserve", "release", "reserved", "compact", "close"}


def serve(agent, commands, tag: str) -> int:
    """Serve ``agent``'s methods named in ``commands`` from stdin, one JSON object per line
    (``{"cmd": name, **kwargs}``), each answered on stdout with ``{"ok": True, **result}`` or
    ``{"ok": False, "error": ...}``, until EOF or ``{"cmd": "exit"}``; then ``agent.close()``.
    ``tag`` prefixes the agent's log lines (stderr). Returns 0."""
    logging.basicConfig(level=logging.WARNING, stream=sys.stderr, format=f"{tag} %(levelname)s %(name)s: %(message)s")
    for line in sys.stdin:
        if not line.strip():
            continue
        msg = json.loads(line)
        cmd = msg.pop("cmd")
        if cmd == "exit":
            break
        try:
            if cmd not in commands:
                raise ValueError(f"unknown command {cmd!r}")
            reply = {"ok": True, **getattr(agent, cmd)(**msg)}
        except Exception as e:
            reply = {"ok": False, "error": f"{type(e).__name__}: {e}"}
        sys.stdout.write(json.dumps(reply) + "\n")
        sys.stdout.flush()
    agent.close()
    return 0


def main() -> int:
    """Serve a cluster node's commands from stdin (:func:`serve`); returns 0."""
    import flatcake.cluster.node  # noqa: F401  (imported before the first command: agents start in parallel)

    return serve(_Agent(), COMMANDS, "agent")


class AgentClient:
    """The driver's end of one agent process (started in a node namespace by
    :meth:`flatcake.cluster.netns.LocalCluster.spawn`).

    Args:
        cluster: the :class:`~flatcake.cluster.netns.LocalCluster`; i: node index.
    """

    def __init__(self, cluster, i: int):
        self.i = i
        self.proc: subprocess.Popen = cluster.spawn(
            i, [sys.executable, "-m", "flatcake.cluster.agent"], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
            text=True, bufsize=1)

    def call(self, cmd: str, **kw) -> dict:
        """Send one command and return its reply (``ok`` False carries ``error``).

        Raises:
            RuntimeError: the agent exited.
        """
        self.proc.stdin.write(json.dumps({"cmd": cmd, **kw}) + "\n")
        self.proc.stdin.flush()
        line = self.proc.stdout.readline()
        if not line:
            raise RuntimeError(f"agent {self.i} exited (status {self.proc.poll()})")
        return json.loads(line)

    def must(self, cmd: str, **kw) -> dict:
        """:meth:`call` that raises RuntimeError when the reply is not ok."""
        out = self.call(cmd, **kw)
        if not out.get("ok"):
            raise RuntimeError(f"agent {self.i} {cmd}: {out.get('error')}")
        return out

    def send(self, cmd: str, **kw) -> None:
        """Send a command without reading its reply (read it with :meth:`reply`)."""
        self.proc.stdin.write(json.dumps({"cmd": cmd, **kw}) + "\n")
        self.proc.stdin.flush()

    def reply(self) -> dict:
        """The next reply line."""
        line = self.proc.stdout.readline()
        if not line:
            raise RuntimeError(f"agent {self.i} exited (status {self.proc.poll()})")
        return json.loads(line)


def node_config(endpoint: str, node_id: int, ttl_s: int = 2, advertise: Optional[str] = None,
                extra: Optional[dict] = None) -> dict:
    """FlatCake overrides of a test node: ``node_id`` and the ``cluster`` section."""
    cfg = {"node_id": node_id, "cluster.etcd": [endpoint], "cluster.lease_ttl_s": ttl_s,
           "cluster.capacity_interval_s": 0.5, "cluster.timeout_s": 1.0, "cluster.watch_idle_s": 1.0}
    if advertise:
        cfg["cluster.advertise"] = advertise
    return {**cfg, **(extra or {})}


if __name__ == "__main__":
    sys.exit(main())
