"""A storage agent (:mod:`flatcake.cluster.storage_agent`) with the commands the write-time
placement tests need (``docs/cluster.md``, "Write-time placement on another node"): fill the
node's own media until a put fails for lack of space, with every stored scope pinned as by a
reader in progress (so the local policy cannot reclaim it), and look keys up in the node's
cluster view.

Extra commands (``{"ok": true, ...}`` replies, as the storage agent's):

============== ================================================================================
command        arguments -> reply
============== ================================================================================
``fill``       ``tag``, optional ``pages`` (64), ``max_rounds`` (64): with placement on other
               nodes switched off, back up rounds of ``pages`` pages, then of one page, pinning
               each, until a put fails -> ``pages`` stored, ``rounds`` tried
``unhold``     -> ``released``: the pins ``fill`` took
``view``       ``keys`` -> ``nodes``: the GVA node field of each key in this node's cluster view
               (None: not in the view)
``placement``  ``on`` (bool) -> ``{}``: switch placement on other nodes on or off
``timed_set``  ``keys`` -> ``ok``, ``put_s``: seconds ``batch_set_v1`` took (pages filled first,
               not timed; a local SSD round is queued, a placed one stored by the target)
============== ================================================================================

Used under ``ip netns exec`` like the storage agent (:class:`PlacementAgentClient`).
"""

from __future__ import annotations

import sys
import time

from flatcake.cluster.agent import serve
from flatcake.cluster.dataplane_agent import DataPlaneClient
from flatcake.cluster.storage_agent import COMMANDS as STORAGE_COMMANDS
from flatcake.cluster.storage_agent import StorageAgent
from flatcake.gva.address import node_of

COMMANDS = STORAGE_COMMANDS | {"fill", "unhold", "view", "placement", "timed_set"}


class PlacementAgent(StorageAgent):
    """The storage agent's commands plus ``fill``, ``unhold``, ``view``, ``placement``."""

    def __init__(self):
        super().__init__()
        self.held: list = []
        self._overflow = None

    def placement(self, on: bool) -> dict:
        """Switch placement on other nodes on (the member's placer) or off."""
        backup = self.be.store.backup
        if not on and backup.overflow is not None:
            self._overflow, backup.overflow = backup.overflow, None
        elif on and backup.overflow is None:
            backup.overflow = self._overflow
        return {}

    def fill(self, tag: str, pages: int = 64, max_rounds: int = 64) -> dict:
        """Back up and pin rounds until a put fails (placement elsewhere off meanwhile)."""
        was_on = self.be.store.backup.overflow is not None
        self.placement(False)
        stored = tried = 0
        try:
            for size in (pages, 1):
                while tried < max_rounds:
                    keys = [f"{tag}{tried:04d}-{j:04d}".ljust(64, "f") for j in range(size)]
                    tried += 1
                    ok = self.set(keys)["ok"]
                    self.held.extend(self.be.store.scopes.pin_leading_run(keys))
                    stored += sum(ok)
                    if not all(ok):
                        break
        finally:
            self.placement(was_on)
        return {"pages": stored, "rounds": tried}

    def timed_set(self, keys: list) -> dict:
        """Fill host pages with the keys' bytes, then time ``batch_set_v1`` alone."""
        self._fill(keys)
        t0 = time.perf_counter()
        ok = self.be.batch_set_v1(keys, self._slots(len(keys)))
        return {"ok": list(ok), "put_s": time.perf_counter() - t0}

    def unhold(self) -> dict:
        """Drop the pins :meth:`fill` took."""
        held, self.held = self.held, []
        if held and self.be is not None:
            self.be.store.scopes.unpin(held)
        return {"released": len(held)}

    def view(self, keys: list) -> dict:
        """The GVA node field of each key in this node's cluster view (None: not there)."""
        pages = self.be.cluster.node.index.lookup(keys)
        return {"nodes": [None if p is None else node_of(p.gva) for p in pages]}

    def close(self) -> dict:
        """Drop the pins, then close the backend."""
        self.unhold()
        return super().close()


class PlacementAgentClient(DataPlaneClient):
    """The driver's end of one placement agent in node ``i``'s namespace (as
    :class:`~flatcake.cluster.storage_agent.StorageAgentClient`)."""

    MODULE = "flatcake.cluster.placement_agent"


def main() -> int:
    """Serve a placement agent's commands from stdin; returns 0."""
    import flatcake.adapter.storage  # noqa: F401  (imported before the first command)

    return serve(PlacementAgent(), COMMANDS, "placement-agent")


if __name__ == "__main__":
    sys.exit(main())
