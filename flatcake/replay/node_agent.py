"""One node of the multi-node replay (``flatcake-replay --nodes N``; docs/replay.md): a full
FlatCake — its own DRAM region, SSD pool directory, host pool and HBM prefix cache, i.e. its own
:class:`~flatcake.replay.engine.Engine` (the replay's one engine core, serving one request at a
time) over a ``flatcake`` system — in a process of its own,
started in a node network namespace by :class:`flatcake.cluster.netns.LocalCluster` and driven over
stdin/stdout, one JSON object per line (:func:`flatcake.cluster.agent.serve`).

Lifecycle::

    python -m flatcake.replay.node_agent        (under ip netns exec <node namespace>)
      -> start {flatcake, profile, engine, host_pool_pages, out}   build the system and engine
      -> run {keys, prompt_tokens}   one request -> its RequestOutcome (a dict) + its hit split
      -> visible {keys, timeout_s}   cluster mode: wait until another node's new pages are in the view
      -> stats                       cumulative counters, backend errors, the cluster section
      -> close                       close the backend (its SSD directory is removed by the parent)

The parent (:mod:`flatcake.replay.cluster_replay`) sets ``node_id`` and, in cluster mode, the
``cluster`` section (``cluster.etcd``: the hub's etcd; ``cluster.advertise``: this node's
address and port) in ``flatcake``; in isolated mode there is no cluster section.

Hit split of one request (pages): ``local_dram`` / ``local_ssd`` are the deltas of the store's
``hit_pages_dram`` / ``hit_pages_ssd`` counters (pages its own media delivered);
``remote_dram`` / ``remote_ssd`` the deltas of
``FlatCakeStorage.flatcake_stats()["cluster"]["remote_read_pages"]["dram"|"ssd"]`` — 0 with
``remote_reported: false`` where the backend has no such counters.
"""

from __future__ import annotations

import dataclasses
import sys
import time
from pathlib import Path
from typing import Any, Optional

from flatcake.cluster.agent import serve

COMMANDS = {"start", "run", "visible", "stats", "close"}
#: seconds ``run`` waits for the node's queued SSD writes after a request (:meth:`ReplayNode.run`)
SETTLE_TIMEOUT_S = 60.0


def remote_pages(stats: dict) -> Optional[dict[str, int]]:
    """``{"dram": pages, "ssd": pages}`` read from other nodes so far (cumulative), from a
    ``flatcake_stats()`` dict; None when it has no ``cluster.remote_read_pages``."""
    rr = (stats.get("cluster") or {}).get("remote_read_pages") if isinstance(stats.get("cluster"), dict) else None
    if not isinstance(rr, dict):
        return None
    return {"dram": int(rr.get("dram", 0)), "ssd": int(rr.get("ssd", 0))}


class ReplayNode:
    """The commands of one replay node (see the module docstring); one instance per process."""

    def __init__(self):
        self.system = None
        self.engine = None

    def start(self, flatcake: dict, profile: dict, engine: dict, host_pool_pages: int, out: str) -> dict:
        """Build the node's ``flatcake`` system (storage in ``<out>/flatcake-ssd``) and its engine.

        Args:
            flatcake: flattened FlatCake keys (``dram.capacity_bytes``, ``node_id``, ``cluster.*``…).
            profile: :meth:`ModelProfile.as_dict` of a dense profile.
            engine: :class:`EngineConfig` fields.
            host_pool_pages: host-pool pages of the node.
            out: the node's directory.

        Reply: ``cluster`` (whether the backend reports cluster counters).
        """
        from flatcake.replay.engine import EngineConfig, ModelProfile
        from flatcake.replay.startup import make_engine
        from flatcake.replay.systems import make_system

        prof = ModelProfile.from_dict(profile)
        Path(out).mkdir(parents=True, exist_ok=True)
        # its keys as given (not at equal capacity: no baseline to match), unlike make_replay_system
        self.system = make_system("flatcake", prof, host_pool_pages, Path(out), flatcake)
        self.engine = make_engine(self.system, prof, EngineConfig(**engine))
        return {"cluster": remote_pages(self._stats()) is not None}

    def _stats(self) -> dict:
        fn = getattr(self.system.inner, "flatcake_stats", None)
        return fn() if fn is not None else {}

    def _settle(self) -> None:
        """Wait until the pages this request wrote are on their medium (the write queue drained):
        a trace's next request comes seconds later, far more than a write round takes, and one
        request at a time leaves no such gap. In a cluster the store publishes a round once it is
        written, so the next request, on any node, can find it."""
        self.system.inner.flush_writes(SETTLE_TIMEOUT_S)  # and, in a cluster, the rounds committed to etcd

    def _member(self):
        """The backend's :class:`~flatcake.cluster.member.ClusterMember`, or None (no cluster)."""
        return getattr(self.system.inner, "cluster", None)

    def visible(self, keys: list, timeout_s: float = 2.0) -> dict:
        """Wait until every one of ``keys`` (pages another node wrote) is in this node's cluster
        view, for up to ``timeout_s`` seconds. Reply: ``present`` (keys found), ``waited_s``,
        ``cluster`` (False: no cluster, nothing waited for)."""
        member = self._member()
        if member is None:
            return {"present": 0, "waited_s": 0.0, "cluster": False}
        t0 = time.monotonic()
        while True:
            present = sum(p is not None for p in member.node.index.lookup(keys))
            if present == len(keys) or time.monotonic() - t0 > timeout_s:
                return {"present": present, "waited_s": time.monotonic() - t0, "cluster": True}
            time.sleep(0.002)

    def run(self, keys: list, prompt_tokens: int) -> dict:
        """Serve one request (:meth:`Engine.run`). Reply: ``outcome`` (the RequestOutcome's fields),
        ``local_dram``, ``local_ssd``, ``remote_dram``, ``remote_ssd`` (pages), ``remote_reported``."""
        before = self._stats()
        out = self.engine.run(keys, int(prompt_tokens))
        after = self._stats()
        rb, ra = remote_pages(before), remote_pages(after)
        reply: dict[str, Any] = {"outcome": dataclasses.asdict(out), "remote_reported": ra is not None}
        for medium in ("dram", "ssd"):
            reply[f"local_{medium}"] = int(after.get(f"hit_pages_{medium}", 0)) - int(before.get(f"hit_pages_{medium}", 0))
            reply[f"remote_{medium}"] = (ra[medium] - rb[medium]) if ra is not None and rb is not None else 0
        self._settle()
        return reply

    def stats(self) -> dict:
        """Reply: ``counters`` (the system's cumulative counters), ``errors`` (backend exceptions
        caught), ``cluster`` (the ``cluster`` part of ``flatcake_stats()``, or None)."""
        cluster = self._stats().get("cluster")
        return {"counters": self.system.counters(), "errors": int(self.system.errors),
                "cluster": cluster if isinstance(cluster, dict) else None}

    def close(self) -> dict:
        """Close the backend (idempotent)."""
        if self.system is not None:
            self.system.close()
            self.system = None
        return {}


def main() -> int:
    """Serve a replay node's commands from stdin (:func:`flatcake.cluster.agent.serve`); returns 0."""
    return serve(ReplayNode(), COMMANDS, "replay-node")


if __name__ == "__main__":
    sys.exit(main())
