"""This node's data plane, built from the ``cluster`` section: what a backend starts next to its
:class:`~flatcake.cluster.node.ClusterNode` to serve its pages to other nodes and read theirs
(docs/cluster.md, "Data plane").

Lifecycle::

    DataPlane(cluster, node_id, lease, region=..., ssd=(path_of, file_bytes)).start()
        Transfer Engine on cluster.advertise's host (P2PHANDSHAKE, tcp)
        DRAM region registered once; SSD server on cluster.advertise's port, staging ring of
            cluster.staging_slots x cluster.staging_slot_bytes
        P/dataplane/<node_id> kept on the node's lease (DescriptorKeeper)
    read(pages, layers, chunk_bytes, out)   RemoteReader: other nodes' pages, verified
    close()

Nothing here is imported unless ``cluster.etcd`` is set.
"""

from __future__ import annotations

from typing import Callable, Optional, Sequence

import numpy as np

from flatcake.cluster.etcd import EtcdSession
from flatcake.cluster.peers import DescriptorKeeper, PeerDirectory
from flatcake.cluster.records import RemotePage
from flatcake.cluster.remote import RemoteReader
from flatcake.cluster.remote_dram import RemoteDramReader, export_dram
from flatcake.cluster.remote_ssd import SsdOwnerServer
from flatcake.cluster.remote_ssd_reader import RemoteSsdReader
from flatcake.cluster.transfer import DataPlaneDescriptor, RemoteReadResult, TransferEndpoint
from flatcake.config import ClusterConfig, ConfigError


def split_advertise(advertise: Optional[str]) -> tuple[str, int]:
    """``cluster.advertise`` ``host:port`` -> ``(host, port)`` (IPv6 brackets removed).

    Raises:
        ConfigError: it is unset (the data plane needs it), naming ``cluster.advertise``.
    """
    if not advertise:
        raise ConfigError("cluster.advertise: the data plane needs host:port (the Transfer Engine runs on the "
                          "host, remote SSD requests are served on the port)")
    host, _, port = advertise.rpartition(":")
    return host.strip("[]"), int(port)


class DataPlane:
    """This node's Transfer Engine, exported media and remote readers.

    Args:
        cluster: the ``cluster`` section (``advertise``, ``prefix``, ``etcd``, ``timeout_s``,
            ``lease_ttl_s``, ``remote_timeout_s``, ``staging_slots``, ``staging_slot_bytes``,
            ``landing_bytes``).
        node_id: this node's id (the GVA node field).
        lease: callable returning the node's current lease id (``ClusterNode.lease_id``).
        region: this node's :class:`~flatcake.media.dram.DramRegion`, or None (no DRAM served).
        ssd: ``(path_of, file_bytes)`` of this node's SSD pool (``SsdFilePool.path_of``,
            ``ssd.file_bytes``), or None (no SSD served).

    Raises:
        ConfigError: ``cluster.advertise`` is unset (from the constructor).
    """

    def __init__(self, cluster: ClusterConfig, node_id: int, lease: Callable[[], int], region=None,
                 ssd: Optional[tuple[Callable[[int], str], int]] = None):
        self.cfg, self.node_id, self.lease = cluster, node_id, lease
        self.host, self.port = split_advertise(cluster.advertise)
        self.region, self.ssd = region, ssd
        self.endpoint: Optional[TransferEndpoint] = None
        self.server: Optional[SsdOwnerServer] = None
        self.keeper: Optional[DescriptorKeeper] = None
        self.reader: Optional[RemoteReader] = None

    def start(self) -> "DataPlane":
        """Start the engine, export the media, publish the descriptor.

        Raises:
            ImportError: the Mooncake wheel cannot load (``te_unavailable_reason`` says why).
            TransferError: the engine did not start or refused a registration.
            zmq.ZMQError: the advertised port cannot be bound.
            EtcdUnavailable: etcd did not answer the first publication.
        """
        c = self.cfg
        self.endpoint = TransferEndpoint(self.host, c.remote_timeout_s)
        dram_addr, dram_bytes = export_dram(self.endpoint, self.region) if self.region is not None else (0, 0)
        ssd_rpc = ""
        if self.ssd is not None:
            path_of, file_bytes = self.ssd
            self.server = SsdOwnerServer(self.endpoint, path_of, file_bytes, f"tcp://*:{self.port}", c.staging_slots,
                                         c.staging_slot_bytes, c.remote_timeout_s).start()
            ssd_rpc = f"tcp://{self.host}:{self.port}"
        desc = DataPlaneDescriptor(self.node_id, self.endpoint.address, dram_addr, dram_bytes, ssd_rpc)
        self.keeper = DescriptorKeeper(EtcdSession(c.etcd, c.timeout_s), c.prefix, desc, self.lease,
                                       interval_s=c.lease_ttl_s / 3).start()
        peers = PeerDirectory(EtcdSession(c.etcd, c.timeout_s), c.prefix)
        self.reader = RemoteReader(peers, RemoteDramReader(self.endpoint, c.landing_bytes),
                                   RemoteSsdReader(self.endpoint, c.landing_bytes, c.remote_timeout_s))
        return self

    def read(self, pages: Sequence[Optional[RemotePage]], layers: int, chunk_bytes: int,
             out: Optional[np.ndarray] = None) -> RemoteReadResult:
        """:meth:`RemoteReader.read <flatcake.cluster.remote.RemoteReader.read>` (never raises for I/O)."""
        return self.reader.read(pages, layers, chunk_bytes, out)

    def close(self) -> None:
        """Stop serving: descriptor keeper, SSD server, readers' sockets, registrations."""
        if self.keeper is not None:
            self.keeper.close()
        if self.server is not None:
            self.server.close()
        if self.reader is not None and self.reader.ssd is not None:
            self.reader.ssd.close()
        if self.endpoint is not None:
            self.endpoint.close()
