"""A small etcd v3 client over etcd3gw (the grpc-gateway JSON API), with failover.

etcd3gw talks to one member; ``Cluster`` tries the members of
``etcd://HOST:PORT[,HOST:PORT...]`` in turn, so a dead member costs one
connection timeout, not the run. Watches are read in the calling thread from
the gateway's stream (no watcher threads), so a process can still fork safely.
Only what the lock recipe needs is here; etcd3gw's ``Lock`` is deliberately not
used (it never waits, leaks leases, and runs the body when not acquired).
"""

from __future__ import annotations

import base64
import contextlib
import json
import time
from collections.abc import Callable
from typing import Any, TypeVar

from singleflight.core.errors import BackendUnavailable, BadValue

API_PATH = "/v3/"  # etcd >= 3.4; passed explicitly, no version discovery round trip
_T = TypeVar("_T")


DEFAULT_PREFIX = "pearing"
_URL_RULE = "must be etcd://HOST:PORT[,HOST:PORT...][/PREFIX]"
_PREFIX_CHARS = frozenset("ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789._-")


def parse_url(url: str) -> tuple[list[tuple[str, int]], str]:
    """``etcd://h1:2379,h2:2379/team-a`` -> ([(h1, 2379), (h2, 2379)], "team-a").

    The prefix is the tenant: every key of every command lives under ``/PREFIX/``
    (default ``pearing``), so two teams or environments can share one cluster.
    It follows the scope rule: segments of [A-Za-z0-9._-], none empty, '.' or '..'.
    """
    if not url.startswith("etcd://"):
        raise BadValue("backend", url, _URL_RULE)
    hosts, _, prefix = url[len("etcd://") :].partition("/")
    prefix = prefix or DEFAULT_PREFIX  # none, or a trailing slash alone: the default tenant
    segments = prefix.split("/")
    if len(prefix) > 200 or any(not seg or seg in (".", "..") or not set(seg) <= _PREFIX_CHARS for seg in segments):
        raise BadValue("backend", url, f"{_URL_RULE}; PREFIX is segments of [A-Za-z0-9._-] joined by '/'")
    out = []
    for part in hosts.split(","):
        host, _, port = part.rpartition(":")
        if not host or not port.isdigit() or not 0 < int(port) < 65536:
            raise BadValue("backend", url, _URL_RULE)
        out.append((host.strip("[]"), int(port)))
    return out, prefix


def b64(data: str | bytes) -> str:
    raw = data.encode() if isinstance(data, str) else data
    return base64.b64encode(raw).decode()


def unb64(data: str) -> bytes:
    return base64.b64decode(data)


def prefix_end(prefix: str) -> str:
    """The range end that covers every key starting with ``prefix``."""
    raw = bytearray(prefix.encode())
    raw[-1] += 1
    return b64(bytes(raw))


class Cluster:
    def __init__(self, url: str, *, timeout: float = 2.0) -> None:
        try:
            import etcd3gw
        except ImportError:
            raise BadValue(
                "backend", url, "the etcd backend needs etcd3gw: pip install 'pearing-singleflight[etcd]'"
            ) from None
        self.url = url
        self.endpoints, prefix = parse_url(url)
        # Every key lives under this root: locks, requests, activity, the ledger.
        self.root = f"/{prefix}/"
        self.timeout = timeout
        self._clients = [
            etcd3gw.Etcd3Client(host=h, port=p, timeout=timeout, api_path=API_PATH) for h, p in self.endpoints
        ]
        self._current = 0

    def _call(self, fn: Callable[[Any], _T]) -> _T:
        from etcd3gw import exceptions

        errors = []
        for i in range(len(self._clients)):
            k = (self._current + i) % len(self._clients)
            try:
                result = fn(self._clients[k])
            except (exceptions.ConnectionFailedError, exceptions.ConnectionTimeoutError) as exc:
                errors.append(f"{self.endpoints[k][0]}:{self.endpoints[k][1]}: {type(exc).__name__}")
                continue
            except exceptions.Etcd3Exception as exc:
                # A member that lost quorum answers with an error: try the next one.
                errors.append(f"{self.endpoints[k][0]}:{self.endpoints[k][1]}: {str(exc)[:80]}")
                continue
            self._current = k
            return result
        raise BackendUnavailable(self.url, "; ".join(errors))

    def post(self, path: str, body: dict[str, Any]) -> dict[str, Any]:
        return self._call(lambda c: c.post(c.get_url(path), json=body))

    # -- kv ------------------------------------------------------------------

    def range_prefix(self, prefix: str, *, sort_create: bool = True) -> tuple[list[dict[str, Any]], int]:
        """Keys under ``prefix`` (oldest create revision first) and the store revision."""
        body: dict[str, Any] = {"key": b64(prefix), "range_end": prefix_end(prefix)}
        if sort_create:
            body.update(sort_order="ASCEND", sort_target="CREATE")
        r = self.post("kv/range", body)
        return [_kv(kv) for kv in r.get("kvs", [])], int(r["header"]["revision"])

    def get(self, key: str) -> dict[str, Any] | None:
        r = self.post("kv/range", {"key": b64(key)})
        kvs = r.get("kvs", [])
        return _kv(kvs[0]) if kvs else None

    def txn(
        self, compare: list[dict[str, Any]], success: list[dict[str, Any]], failure: list[dict[str, Any]]
    ) -> dict[str, Any]:
        return self.post("kv/txn", {"compare": compare, "success": success, "failure": failure})

    def put(self, key: str, value: bytes, lease: int | None = None) -> int:
        body: dict[str, Any] = {"key": b64(key), "value": b64(value)}
        if lease:
            body["lease"] = str(lease)
        return int(self.post("kv/put", body)["header"]["revision"])

    def delete(self, key: str) -> bool:
        return int(self.post("kv/deleterange", {"key": b64(key)}).get("deleted", 0)) > 0

    # -- leases ----------------------------------------------------------------

    def grant(self, ttl: int) -> int:
        return int(self.post("lease/grant", {"TTL": str(ttl)})["ID"])

    def keepalive(self, lease: int) -> int:
        """The lease's renewed TTL, or -1 when it no longer exists."""
        r = self.post("lease/keepalive", {"ID": str(lease)})
        return int(r.get("result", {}).get("TTL", -1))

    def ttl(self, lease: int) -> int:
        """Seconds left on the lease (-1: gone)."""
        return int(self.post("kv/lease/timetolive", {"ID": str(lease)}).get("TTL", -1))

    def revoke(self, lease: int) -> None:
        from etcd3gw import exceptions

        # Gone already, or unreachable: then its TTL ends it.
        with contextlib.suppress(exceptions.Etcd3Exception, BackendUnavailable):
            self.post("kv/lease/revoke", {"ID": str(lease)})

    # -- watch -----------------------------------------------------------------

    def wait_deleted(self, key: str, after_revision: int, deadline: float) -> bool:
        """Block until ``key`` is deleted (at a revision after ``after_revision``) or the deadline.

        Reads the gateway's watch stream in this thread; True when the delete was seen.
        """
        import requests

        body = {"create_request": {"key": b64(key), "start_revision": str(after_revision + 1), "filters": ["NOPUT"]}}
        for client in self._rotation():
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                return False
            try:
                resp = client.session.post(
                    client.get_url("watch"), json=body, stream=True, timeout=(self.timeout, max(0.05, remaining))
                )
                try:
                    for line in resp.iter_lines():
                        if not line:
                            continue
                        result = json.loads(line).get("result", {})
                        if any(ev.get("type") == "DELETE" for ev in result.get("events", [])):
                            return True
                        if time.monotonic() >= deadline:
                            return False
                finally:
                    resp.close()
            except requests.exceptions.ReadTimeout:
                return False
            except (requests.exceptions.ConnectionError, requests.exceptions.ChunkedEncodingError):
                continue  # next member
        raise BackendUnavailable(self.url, "no member answered the watch")

    def _rotation(self) -> list[Any]:
        n = len(self._clients)
        return [self._clients[(self._current + i) % n] for i in range(n)]


def _kv(kv: dict[str, Any]) -> dict[str, Any]:
    return {
        "key": unb64(kv["key"]).decode(),
        "value": unb64(kv.get("value", "")),
        "create_revision": int(kv.get("create_revision", 0)),
        "mod_revision": int(kv.get("mod_revision", 0)),
        "lease": int(kv.get("lease", 0)),
    }
