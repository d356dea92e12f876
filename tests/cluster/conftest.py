"""Fixtures for the cluster tests: a local cluster in network namespaces (skipped with the reason
when the machine cannot make one), node agents, and a check that nothing is left behind."""

from __future__ import annotations

import os
import subprocess

import pytest

from flatcake.cluster.netns import LocalCluster, leftover_namespaces, unavailable_reason


def _etcd_pids() -> set[int]:
    out = subprocess.run(["pgrep", "-x", "etcd"], capture_output=True, text=True, check=False).stdout
    return {int(p) for p in out.split()}


@pytest.fixture
def local_cluster(request):
    """Factory ``local_cluster(n)`` -> a started :class:`LocalCluster`; on teardown every one is
    closed and the test fails if a namespace, an etcd process or its /dev/shm directory remains."""
    reason = unavailable_reason()
    if reason:
        pytest.skip(reason)
    made: list[LocalCluster] = []
    etcd_before = _etcd_pids()

    def _make(n: int) -> LocalCluster:
        c = LocalCluster(n).start()
        made.append(c)
        return c

    yield _make
    for c in made:
        c.close()
    for c in made:
        assert leftover_namespaces(c.name) == [], f"namespaces of {c.name} left behind"
        assert not os.path.exists(c.data_root), f"{c.data_root} left behind"
    assert _etcd_pids() <= etcd_before, "an etcd process was left behind"


@pytest.fixture
def agents():
    """Factory ``agents(cluster, [i, ...])`` -> one :class:`AgentClient` per node index; their
    processes are stopped by the cluster's close."""
    from flatcake.cluster.agent import AgentClient

    def _make(cluster, nodes):
        return [AgentClient(cluster, i) for i in nodes]

    return _make
