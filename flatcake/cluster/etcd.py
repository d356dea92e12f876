"""A thin etcd v3 session over ``etcd3gw`` (the HTTP/JSON gateway client; the ``cluster`` extra).

Why ``etcd3gw``: it is the maintained pure-Python client that attaches keys to a lease, resumes a
watch from a revision and reads ranges page by page (/work/shared/design/scale-out-facts.md).
This module uses its HTTP plumbing and error mapping (``Etcd3Client.post`` / ``get_url`` /
``session``) and speaks the gateway's JSON itself, for two reasons measured against its helpers:
its ``Watcher`` drops the stream's end, cancellation and ``compact_revision`` silently (a watcher
could not tell it must resume or re-bootstrap), and ``get`` does not return the ``more`` flag or
the header revision a paginated read at one revision needs.

Keys and values are bytes on the wire (base64 in the JSON); this module takes ``str`` keys
(UTF-8) and ``bytes`` values. Every call has a timeout (``timeout_s``); a call that no endpoint
answers raises :class:`EtcdUnavailable`.
"""

from __future__ import annotations

import base64
import json
import socket
from dataclasses import dataclass
from typing import Any, Iterator, Optional, Sequence
from urllib.parse import urlsplit

import etcd3gw
import requests
import urllib3
from etcd3gw import exceptions as gw_exc

from flatcake.cluster.records import prefix_end


class EtcdUnavailable(RuntimeError):
    """No etcd endpoint answered (connection refused, timed out, or the server is unavailable)."""


class WatchIdle(EtcdUnavailable):
    """A watch stream stayed silent past its idle limit (normal on a quiet cluster: re-open it)."""


class WatchCompacted(RuntimeError):
    """The watch's start revision was compacted away; re-read the range (``compact_revision``).

    Attributes:
        compact_revision: the oldest revision etcd still has.
    """

    def __init__(self, compact_revision: int):
        super().__init__(f"watch start revision compacted (oldest kept: {compact_revision})")
        self.compact_revision = compact_revision


@dataclass(frozen=True)
class StoreHeader:
    """Who answered and how far its history goes: the ``header`` of every gateway response.

    A healthy store only moves forward: ``revision`` and ``raft_term`` never decrease and
    ``cluster_id`` never changes. A store restarted empty or restored from an older snapshot
    breaks that (docs/cluster.md, "The metadata store lost state").

    Attributes:
        cluster_id: the etcd cluster's id (decimal text; new when the cluster is re-created
            with another ``--initial-cluster`` or token).
        member_id: the member that answered (decimal text; changes on failover between members).
        revision: the store's revision when it answered.
        raft_term: the raft term of the member that answered.
    """

    cluster_id: str
    member_id: str
    revision: int
    raft_term: int

    @classmethod
    def of(cls, response: dict) -> "StoreHeader":
        """The header of a gateway response (missing fields: '' and 0)."""
        h = response.get("header", {})
        return cls(str(h.get("cluster_id", "")), str(h.get("member_id", "")), int(h.get("revision", 0) or 0),
                   int(h.get("raft_term", 0) or 0))


def b64(s: str | bytes) -> str:
    """base64 text of a key or value (UTF-8 for ``str``)."""
    return base64.b64encode(s.encode() if isinstance(s, str) else s).decode()


def unb64(s: str) -> bytes:
    """Bytes of a gateway base64 field ('' -> b'')."""
    return base64.b64decode(s) if s else b""


def parse_endpoint(ep: str) -> tuple[str, str, int]:
    """``http://host:port`` (or ``host:port``) -> ``(scheme, host, port)``.

    Raises:
        ValueError: not an http(s) URL with a host and a port.
    """
    u = urlsplit(ep if "://" in ep else f"http://{ep}")
    if u.scheme not in ("http", "https") or not u.hostname or u.port is None:
        raise ValueError(f"{ep!r} is not http(s)://host:port")
    return u.scheme, u.hostname, u.port


def op_put(key: str, value: bytes, lease: int = 0) -> dict:
    """A transaction ``request_put`` (on lease ``lease`` when non-zero)."""
    req = {"key": b64(key), "value": b64(value)}
    if lease:
        req["lease"] = str(lease)
    return {"request_put": req}


def op_delete(key: str) -> dict:
    """A transaction ``request_delete_range`` of the one key ``key``."""
    return {"request_delete_range": {"key": b64(key)}}


def op_delete_prefix(prefix: str) -> dict:
    """A transaction ``request_delete_range`` over every key starting with ``prefix``."""
    return {"request_delete_range": {"key": b64(prefix), "range_end": b64(prefix_end(prefix))}}


def op_range(key: str, prefix: bool = False) -> dict:
    """A transaction ``request_range`` of ``key`` (or every key starting with it)."""
    req = {"key": b64(key)}
    if prefix:
        req["range_end"] = b64(prefix_end(key))
    return {"request_range": req}


def kvs_of(range_response: dict) -> list[tuple[str, bytes, dict]]:
    """``(key, value, kv)`` of a range response (``kv`` keeps the revisions and lease as text)."""
    return [(unb64(kv["key"]).decode(), unb64(kv.get("value", "")), kv) for kv in range_response.get("kvs", [])]


class EtcdSession:
    """One connection (a ``requests`` session per endpoint) to an etcd cluster; not shared
    between threads that stream (each watcher makes its own).

    Args:
        endpoints: ``http://host:port`` of the etcd members; calls go to the one that last
            answered and fail over to the next.
        timeout_s: seconds per HTTP call (connect and read).

    Raises:
        ValueError: an endpoint is not ``http(s)://host:port``.
    """

    def __init__(self, endpoints: Sequence[str], timeout_s: float = 2.0):
        if not endpoints:
            raise ValueError("no etcd endpoint")
        self.timeout_s = timeout_s
        self._clients = []
        for ep in endpoints:
            scheme, host, port = parse_endpoint(ep)
            self._clients.append(etcd3gw.client(host=host, port=port, protocol=scheme, timeout=timeout_s,
                                                api_path="/v3/"))
        self._cur = 0
        self._watch_resp = None

    def call(self, path: str, payload: dict) -> dict:
        """POST ``payload`` to the gateway's ``path`` (``kv/range``, ``kv/txn``, ``lease/grant``...).

        Raises:
            EtcdUnavailable: every endpoint failed to answer.
            etcd3gw.exceptions.Etcd3Exception: etcd answered with an error (bad request...).
        """
        last: Exception | None = None
        for i in range(len(self._clients)):
            c = self._clients[(self._cur + i) % len(self._clients)]
            try:
                out = c.post(c.get_url(path), data=json.dumps(payload))
                self._cur = (self._cur + i) % len(self._clients)
                return out
            except (gw_exc.ConnectionFailedError, gw_exc.ConnectionTimeoutError, requests.RequestException) as e:
                last = e
        raise EtcdUnavailable(f"no etcd endpoint answered {path}: {last}")

    # leases -----------------------------------------------------------------------------------
    def grant_lease(self, ttl_s: int) -> int:
        """A new lease of ``ttl_s`` seconds; returns its id."""
        return int(self.call("lease/grant", {"TTL": ttl_s, "ID": 0})["ID"])

    def keepalive(self, lease: int) -> int:
        """Renew ``lease``; returns its TTL in seconds, or -1 when it has expired."""
        out = self.call("lease/keepalive", {"ID": str(lease)})
        return int(out.get("result", {}).get("TTL", -1))

    def revoke(self, lease: int) -> None:
        """Revoke ``lease`` (its keys are deleted at once)."""
        self.call("kv/lease/revoke", {"ID": str(lease)})

    # key-value --------------------------------------------------------------------------------
    def txn(self, success: Sequence[dict], compare: Sequence[dict] = (), failure: Sequence[dict] = ()) -> dict:
        """One transaction; returns the gateway's response (``succeeded``, ``responses``, ``header``)."""
        return self.call("kv/txn", {"compare": list(compare), "success": list(success), "failure": list(failure)})

    def put(self, key: str, value: bytes, lease: int = 0) -> int:
        """Put one key; returns the revision it was written at."""
        return int(self.txn([op_put(key, value, lease)])["header"]["revision"])

    def create(self, key: str, value: bytes, lease: int = 0) -> tuple[bool, Optional[bytes]]:
        """Put ``key`` only if it does not exist. Returns ``(created, existing value or None)``."""
        out = self.txn([op_put(key, value, lease)], compare=[{"key": b64(key), "target": "CREATE",
                                                               "result": "EQUAL", "create_revision": "0"}],
                       failure=[op_range(key)])
        if out.get("succeeded"):
            return True, None
        kvs = kvs_of(out["responses"][0]["response_range"])
        return False, kvs[0][1] if kvs else None

    def get(self, key: str) -> Optional[bytes]:
        """The value of ``key``, or None."""
        kvs = kvs_of(self.call("kv/range", {"key": b64(key)}))
        return kvs[0][1] if kvs else None

    def delete_prefix(self, prefix: str) -> int:
        """Delete every key starting with ``prefix``; returns how many."""
        return int(self.call("kv/deleterange", op_delete_prefix(prefix)["request_delete_range"]).get("deleted", 0))

    def range_prefix(self, prefix: str, page_keys: int = 1000) -> tuple[StoreHeader, list[tuple[str, bytes, dict]]]:
        """Every key under ``prefix`` at one revision, read ``page_keys`` keys per request
        (linearizable: the first request goes through the leader's read index).

        Returns:
            ``(header, [(key, value, kv), ...])`` in key order; ``header`` is the first
            response's: ``header.revision`` is the store revision the read saw (a watch from
            ``revision + 1`` misses nothing) and every page is read at it.
        """
        end = b64(prefix_end(prefix))
        start, header, out = b64(prefix), None, []
        while True:
            req = {"key": start, "range_end": end, "limit": page_keys}
            if header is not None:
                req["revision"] = header.revision
            resp = self.call("kv/range", req)
            header = header or StoreHeader.of(resp)
            page = kvs_of(resp)
            out.extend(page)
            if not resp.get("more") or not page:
                return header, out
            start = b64(page[-1][0].encode() + b"\0")

    def header(self) -> StoreHeader:
        """The store's header now (one linearizable count-only read: its revision is at least
        every revision committed before the call)."""
        return StoreHeader.of(self.call("kv/range", {"key": b64("\0"), "count_only": True}))

    def revision(self) -> int:
        """The store's current revision."""
        return self.header().revision

    def compact(self, revision: int) -> None:
        """Compact the history up to ``revision`` (older revisions can no longer be watched)."""
        self.call("kv/compaction", {"revision": str(revision), "physical": True})

    # watch ------------------------------------------------------------------------------------
    def watch_prefix(self, prefix: str, start_revision: int,
                     idle_s: float) -> Iterator[tuple[StoreHeader, list[dict]]]:
        """Stream the events under ``prefix`` from ``start_revision`` on: ``(header, events)``
        per response, the first one (the watch created) with no events; all events of one
        revision come in one response. Each event is the gateway's dict with ``type``
        (``"DELETE"``; absent for a put) and ``kv`` (key, value still base64). ``header`` is the
        answering member's (:class:`StoreHeader`): the caller checks it before applying events
        (a store that went back in time or changed identity).

        Args:
            idle_s: a stream silent this many seconds is dropped (raises EtcdUnavailable; the
                caller resumes from its last revision, so nothing is lost).

        Raises:
            EtcdUnavailable: connection failed or reset.
            WatchIdle: silent past ``idle_s`` (a subclass of EtcdUnavailable).
            WatchCompacted: ``start_revision`` was compacted.
        """
        c = self._clients[self._cur]
        req = {"create_request": {"key": b64(prefix), "range_end": b64(prefix_end(prefix)),
                                  "start_revision": str(start_revision)}}
        try:
            resp = c.session.post(c.get_url("watch"), json=req, stream=True, timeout=(self.timeout_s, idle_s))
        except requests.RequestException as e:
            self._cur = (self._cur + 1) % len(self._clients)
            raise EtcdUnavailable(f"watch: {e}") from None
        self._watch_resp = resp
        try:
            yield from self._watch_lines(resp)
        except (requests.RequestException, ValueError) as e:
            if e.args and isinstance(e.args[0], urllib3.exceptions.ReadTimeoutError):
                raise WatchIdle(f"watch silent for {idle_s} s") from None
            raise EtcdUnavailable(f"watch stream ended: {e}") from None
        finally:
            self._watch_resp = None
            resp.close()
        raise EtcdUnavailable("watch stream closed by the server")

    def abort_watch(self) -> None:
        """End the current :meth:`watch_prefix` stream from another thread (its reader gets
        EtcdUnavailable at once instead of waiting up to ``idle_s``)."""
        resp = self._watch_resp
        if resp is None:
            return
        try:
            sock = socket.fromfd(resp.raw.fileno(), socket.AF_INET, socket.SOCK_STREAM)
            sock.shutdown(socket.SHUT_RDWR)  # the socket, not this duplicate descriptor
            sock.close()
        except (OSError, ValueError, AttributeError):
            pass

    @staticmethod
    def _watch_lines(resp) -> Iterator[tuple[StoreHeader, list[dict]]]:
        for line in resp.iter_lines():
            if not line.strip():
                continue
            msg = json.loads(line)
            if "error" in msg:
                raise EtcdUnavailable(f"watch error: {msg['error']}")
            result: dict[str, Any] = msg.get("result", {})
            if int(result.get("compact_revision", 0) or 0):
                raise WatchCompacted(int(result["compact_revision"]))
            if result.get("canceled"):
                raise EtcdUnavailable(f"watch canceled: {result.get('cancel_reason', '')}")
            yield StoreHeader.of(result), result.get("events", [])
