"""One entry point for reading other nodes' pages: route each page by its GVA (node, medium) to
the remote DRAM or remote SSD reader (paper §3.1: the GVA's node and medium fields are the route).

Lifecycle of a remote read::

    pages from the cluster view (None where no node has the key)
      -> grouped by (owner node, medium), each group read from its owner
         (descriptor from the PeerDirectory; DRAM: RemoteDramReader, SSD: RemoteSsdReader)
      -> a failed transfer: the owner's descriptor is looked up again; changed (the owner
         restarted) -> the group is read again once with the new one; else the owner is
         suspended for a back-off (its pages are misses without a transfer); one that was
         silent or unknown has its descriptor looked up again before the next read
      -> one RemoteReadResult: hit/miss per page, misses by cause

Never raises for an I/O fault; a miss is a miss whatever its cause.
"""

from __future__ import annotations

from typing import Optional, Sequence

import numpy as np

from flatcake.cluster.peers import PeerDirectory
from flatcake.cluster.records import RemotePage
from flatcake.cluster.remote_dram import RemoteDramReader
from flatcake.cluster.remote_ssd_reader import RemoteSsdReader
from flatcake.cluster.transfer import RemoteReadResult
from flatcake.gva.address import MEDIUM_DRAM, MEDIUM_SSD, medium_of

#: miss causes that make the owner's descriptor suspect (looked up again before the next read);
#: a failed transfer also suspends reads from the owner for a back-off (PeerDirectory.suspend)
SUSPECT = ("timeout", "unknown_owner")


class RemoteReader:
    """Reads pages of any other node, any medium.

    Args:
        peers: the descriptors of the other nodes.
        dram: the remote DRAM reader; ssd: the remote SSD reader (None: SSD pages are misses).
    """

    def __init__(self, peers: PeerDirectory, dram: RemoteDramReader, ssd: Optional[RemoteSsdReader] = None):
        self.peers, self.dram, self.ssd = peers, dram, ssd

    def read(self, pages: Sequence[Optional[RemotePage]], layers: int, chunk_bytes: int,
             out: Optional[np.ndarray] = None) -> RemoteReadResult:
        """Read ``pages`` (None entries are misses, counted as ``not_in_view``).

        Args:
            pages: ``[n]`` from :meth:`flatcake.cluster.index.ClusterIndex.lookup`.
            layers, chunk_bytes: the page geometry.
            out: optional uint8 ``[>= n, layers * chunk_bytes]`` for the pages' bytes.

        Returns:
            :class:`RemoteReadResult` ``[n]`` with ``misses`` also holding ``not_in_view`` (and
            ``suspended``: pages of an owner in back-off after a failed transfer).

        Raises:
            ValueError: ``out`` has the wrong shape.
        """
        page_bytes = layers * chunk_bytes
        res = RemoteReadResult.empty(len(pages), page_bytes, out)
        res.misses["not_in_view"] = 0
        groups: dict[tuple[int, int], list[int]] = {}
        for i, p in enumerate(pages):
            if p is None:
                res.misses["not_in_view"] += 1
            else:
                groups.setdefault((p.node, medium_of(p.gva)), []).append(i)
        for (node, medium), idx in groups.items():
            if self.peers.suspended(node):  # a transfer from it failed recently: no transfer now
                res.misses["suspended"] = res.misses.get("suspended", 0) + len(idx)
                continue
            whole = len(idx) == len(pages)  # one group in order: read straight into res.data
            group, desc = [pages[i] for i in idx], self.peers.get(node)
            part = self._read_group(desc, medium, group, layers, chunk_bytes, res.data if whole else None)
            if part.misses.get("failed"):  # the owner restarted (new descriptor)? then read again once
                fresh = self.peers.replaced(node, desc)
                if fresh is not None:
                    part = self._read_group(fresh, medium, group, layers, chunk_bytes, res.data if whole else None)
            if whole:
                res.hit[:] = part.hit
            else:
                res.hit[idx] = part.hit
                sel = np.asarray(idx)[part.hit]
                res.data[sel] = part.data[part.hit]
            for k, v in part.misses.items():
                res.misses[k] = res.misses.get(k, 0) + v
            if part.misses.get("failed"):  # a transfer failed: back off from this owner
                self.peers.suspend(node)
            elif any(part.misses.get(k) for k in SUSPECT):  # silent or unknown: look it up again
                self.peers.invalidate(node)
            elif part.hit.any():
                self.peers.succeeded(node)
        return res

    def _read_group(self, desc, medium: int, pages: list, layers: int, chunk_bytes: int,
                    out: Optional[np.ndarray]) -> RemoteReadResult:
        if medium == MEDIUM_DRAM:
            return self.dram.read(desc, pages, layers, chunk_bytes, out)
        if medium == MEDIUM_SSD and self.ssd is not None:
            return self.ssd.read(desc, pages, layers, chunk_bytes, out)
        res = RemoteReadResult.empty(len(pages), layers * chunk_bytes, out)
        res.misses["failed"] = len(pages)  # a medium this node cannot read remotely
        return res
