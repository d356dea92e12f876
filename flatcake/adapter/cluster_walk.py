"""The hit query and the read over this node's pages and other nodes' pages, interleaved
(docs/cluster.md, "Backend wiring").

In a cluster a conversation's pages can alternate between nodes: turn 1 computed (and stored) on
node A, turn 2 on B (which finds turn 1 on A and stores only its own new pages), turn 3 on A,
and so on. A prefix is then a sequence of runs, each held locally or by another node. Both walks
below take runs in turn — local, then other nodes', then local again — until a key is held by
neither (the hit query) or a page cannot be delivered (the read). A key held locally is always
taken from the local store.
"""

from __future__ import annotations

from typing import Optional, Sequence


def _local_run(store, keys: Sequence[str], start: int) -> int:
    """Keys from ``start`` this node holds, one after the other (lock-free, no hit bookkeeping)."""
    n = 0
    for k in keys[start:]:
        if not store.exists(k):
            break
        n += 1
    return n


def hit_run(store, cluster, keys: Sequence[str], prefix_keys: Optional[list]) -> int:
    """Length of the leading run of ``keys`` held by this node or, where ``cluster`` (a
    :class:`~flatcake.cluster.member.ClusterMember`, or None) is set, by other nodes.
    Memory only: never the network. The first local run feeds the store's placement signals
    (:meth:`~flatcake.store.page_store.PageStore.leading_run`), as without a cluster.

    Args:
        store: the :class:`~flatcake.store.page_store.PageStore`.
        cluster: the member, or None (this node alone).
        keys: page keys of the request, in prefix order.
        prefix_keys: SGLang's ``extra_info.prefix_keys`` (keys before ``keys[0]``), or None.

    Returns:
        pages (int, 0..len(keys)).
    """
    n = store.leading_run(keys, prefix_keys)
    if cluster is None:
        return n
    while n < len(keys):
        m = cluster.extend_run(keys, n)
        if m == n:
            break
        n = m + _local_run(store, keys, m)
    return n


def read_run(store, cluster, keys: Sequence[str], layout, page_ids) -> list[bool]:
    """Read the leading run of ``keys`` into pages ``page_ids`` of ``layout``: local runs from the
    store, other nodes' runs through ``cluster.fill`` (verified bytes only).

    Args:
        store: the :class:`~flatcake.store.page_store.PageStore`.
        cluster: the member, or None (local reads only, exactly as without a cluster).
        keys: page keys, in prefix order.
        layout: the destination :class:`~flatcake.common.layout.KvPageLayout`.
        page_ids: int page ids in ``layout`` (a list or an int64 tensor), one per key.

    Returns:
        per-page bools, a leading run of True (a page after the first miss is never reported).
        Never raises beyond what ``store.get`` / ``cluster.fill`` raise (neither does).
    """
    out = store.get(keys, layout, page_ids)
    if cluster is None:
        return out
    n = next((i for i, ok in enumerate(out) if not ok), len(out))
    while n < len(keys):
        h = cluster.fill(keys, out, layout, page_ids)
        if h == 0:
            break
        n += h
        if n >= len(keys) or not store.exists(keys[n]):
            continue  # the next page is not local: another remote run, or the end
        more = store.get(keys[n:], layout, page_ids[n:])
        k = next((i for i, ok in enumerate(more) if not ok), len(more))
        if k == 0:
            break
        out[n: n + k] = [True] * k
        n += k
    return out
