"""FlatCake cluster: one cache across nodes (issue 12). This package holds the etcd side only.

* :mod:`flatcake.cluster.netns` — a local test cluster: network namespaces joined to a hub
  namespace by veth pairs, one etcd in the hub, everything torn down by process id.
* :mod:`flatcake.cluster.etcd` — a thin etcd v3 session over ``etcd3gw`` (endpoint failover,
  a node lease kept alive, batched transactions, paginated range reads, a resumable watch).
* :mod:`flatcake.cluster.records` — the record format and key layout in etcd.
* :mod:`flatcake.cluster.index` — the replicated key -> GVA index (publish rounds and retired
  scopes; a lock-free in-memory view fed by bootstrap + watch).
* :mod:`flatcake.cluster.coordinator` — per-node free DRAM/SSD bytes and compare-and-swap
  reservations of another node's space.
* :mod:`flatcake.cluster.node` — a cluster member: registration (unique ``node_id``), lease,
  index and coordinator together.

Nothing here is imported by the core backend: a FlatCake without ``cluster.etcd`` configured
never imports this package, and this ``__init__`` imports no submodule (``etcd3gw`` is the
optional ``cluster`` extra). See docs/cluster.md.
"""
