"""Starting a store's cluster member from the backend (``docs/cluster.md``, "Backend wiring").

Kept apart from :mod:`flatcake.adapter.storage` so that a FlatCake without ``cluster.etcd``
never imports :mod:`flatcake.cluster` (its optional dependencies: etcd3gw, zmq, Mooncake).
"""

from __future__ import annotations

import logging

log = logging.getLogger("flatcake.adapter")


def start_member(cfg, store, namespace: str):
    """A started :class:`~flatcake.cluster.member.ClusterMember` for ``store``, or ``None`` when
    ``cluster.etcd`` is empty (nothing imported) or the store is an MLA follower rank (its
    writer rank serves the pages).

    Args:
        cfg: the validated :class:`~flatcake.config.FlatCakeConfig`.
        store: the opened :class:`~flatcake.store.page_store.PageStore`.
        namespace: the store's namespace.

    Raises:
        ConfigError: ``cluster.advertise`` unset, ``node_id`` taken in this namespace's cluster.
        EtcdUnavailable, ImportError, TransferError, zmq.ZMQError: the cluster could not be
            joined (``ClusterMember.start``). The store is closed before any of these propagates.
    """
    if not cfg.cluster.enabled:
        return None
    if store.role == "follower":
        log.info("flatcake: MLA follower rank: its writer rank serves the pages to the cluster")
        return None
    try:
        from flatcake.cluster.member import ClusterMember

        member = ClusterMember(cfg, store, namespace).start()
    except BaseException:
        store.close()
        raise
    log.info("flatcake: cluster node %d joined %s (%s)", cfg.node_id, member.cluster_cfg.prefix,
             cfg.cluster.advertise)
    return member


def stop_member(member) -> None:
    """Close ``member`` (None: nothing); never raises."""
    if member is not None:
        member.close()
