"""A small etcd v3 client for the grpc-gateway JSON API (etcd >= 3.4), with failover.

Requests are JSON over a plain socket (``wire.py``), one kept-alive connection per
member, made when first needed. ``Cluster`` tries the members of
``etcd://HOST:PORT[,HOST:PORT...]`` in turn, so a dead member costs one connection
timeout, not the run. Watches (``watch.py``) are read in the calling thread from the
gateway's stream (no watcher threads), so a process can still fork.

Why not etcd3gw (and requests under it): importing it took 115 ms in every etcd process
(pearing-run, each pearing-cli heartbeat, each pearing-guard verify), and the larger
process it makes cost a hand-over about 15 ms more in fork and copy-on-write faults;
only a dozen requests are needed here. Members are reached directly (no proxy).
"""

from __future__ import annotations

import base64
import contextlib
import time

from singleflight.core import jsontext
from singleflight.core.const import TYPE_CHECKING
from singleflight.core.errors import BackendUnavailable
from singleflight.etcd.url import parse_url
from singleflight.etcd.wire import ELECTION_PAUSE, Conn, election_answer

if TYPE_CHECKING:
    from typing import Any

API_PATH = "/v3/"  # etcd >= 3.4; passed explicitly, no version discovery round trip


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


class Refused(Exception):
    """The cluster answered, and said no (a lease that no longer exists, a bad request):
    not a member failure, so no other member is tried."""

    def __init__(self, code: int, message: str) -> None:
        super().__init__(message)
        self.code = code


# gRPC codes that describe the request, not the member: asking another member changes nothing.
_NOT_FOUND, _INVALID, _FAILED_PRECONDITION, _OUT_OF_RANGE = 5, 3, 9, 11
_REQUEST_CODES = frozenset({_NOT_FOUND, _INVALID, _FAILED_PRECONDITION, _OUT_OF_RANGE})
# etcd's answers of those codes that describe the member, not the request (its words,
# api/v3rpc/rpctypes/error.go): it cannot serve it yet (starting, before it knows the cluster's
# version), or at all (a learner), or is behind the revision asked. Another member may: a member
# that failed, as one that lost its leader. Raised as a Refused, one went past every caller that
# is ready for an unreachable cluster only (a waiter's keepalive, a holder's renewal): exit 70.
_MEMBER_STATES = frozenset(
    {
        "etcdserver: not capable",
        "etcdserver: rpc not supported for learner",
        "etcdserver: mvcc: required revision is a future revision",
    }
)


def _refusal(detail: str | None) -> Refused | None:
    try:
        body = jsontext.loads(detail or "")
        code = int(body.get("code", -1))
    except (ValueError, TypeError, AttributeError, RecursionError):
        return None
    message = str(body.get("message") or body.get("error") or "")
    return Refused(code, message) if code in _REQUEST_CODES and message not in _MEMBER_STATES else None


class NotEtcd(Exception):
    """A member's HTTP 200 whose body is not etcd's answer to the call (a wrong port, a proxy's
    page): the member failed, as one that did not answer."""


# What the readers below take from an answer, checked once here (``decode``) so that none of
# them can fail on a peer that is not etcd: int64s are JSON strings of ASCII digits, bytes base64.
_INTS = frozenset({"revision", "create_revision", "mod_revision", "lease", "count", "deleted", "ID", "TTL"})
_BYTES = frozenset({"key", "value"})
_LISTS = frozenset({"kvs", "responses"})
_OBJECTS = frozenset({"header", "result", "response_range", "response_put", "response_delete_range", "response_txn"})
_NEEDS = {"lease/grant": ("ID",)}


def _check(obj: Any, where: str) -> dict[str, Any]:
    """``obj``, if it is an object whose known fields (and theirs) have etcd's types. A loop,
    not recursion: a hostile answer nested a thousand deep is refused, not a RecursionError."""
    if not isinstance(obj, dict):
        raise NotEtcd(f"{where} is not an object")
    todo = [(obj, where)]
    while todo:
        part, at = todo.pop()
        if not isinstance(part, dict):
            raise NotEtcd(f"{at} is not an object")
        for name, value in part.items():
            if name in _OBJECTS:
                todo.append((value, name))
            elif name in _LISTS:
                if not isinstance(value, list):
                    raise NotEtcd(f"{at}.{name} is not a list")
                todo += [(item, name) for item in value]
            elif not _fits(name, value):
                raise NotEtcd(f"{at}.{name} is not etcd's")
    return obj


def _fits(name: str, value: Any) -> bool:
    if name in _INTS:
        return isinstance(value, str) and value.isascii() and value.removeprefix("-").isdigit() and len(value) <= 20
    if name in _BYTES:
        if not isinstance(value, str):
            return False
        try:
            base64.b64decode(value, validate=True)
        except ValueError:  # binascii.Error
            return False
        return True
    if name == "succeeded":
        return isinstance(value, bool)
    return True


def decode(path: str, request: dict[str, Any], data: bytes) -> dict[str, Any]:
    """The answer to ``request`` at ``path``; NotEtcd when it is not etcd's: JSON, an object,
    a header with the revision, a key in every kv, and for a txn one response per op of the
    branch it took, each of that op's kind."""
    try:
        obj = jsontext.loads(data)
    except (ValueError, RecursionError) as exc:  # UnicodeDecodeError is a ValueError too
        raise NotEtcd(f"not JSON: {exc}") from None
    r = _check(obj, "answer")
    inner = _check(r.get("result"), "result") if path == "lease/keepalive" else r
    header = inner.get("header")  # its type checked with the rest
    if not isinstance(header, dict) or "revision" not in header:
        raise NotEtcd("no header with a revision")
    for name in _NEEDS.get(path, ()):
        if name not in inner:
            raise NotEtcd(f"answer has no {name}")
    ranges = [resp.get("response_range", {}) for resp in r.get("responses", [])]
    if not all("key" in kv for part in [r, *ranges] for kv in part.get("kvs", [])):
        raise NotEtcd("a kv has no key")
    if path == "kv/txn":
        ops = request.get("success" if r.get("succeeded") else "failure", [])
        want = ["response" + next(iter(op)).removeprefix("request") for op in ops]
        if [next(iter(resp), "") for resp in r.get("responses", [])] != want:
            raise NotEtcd(f"txn answer is not one response per op ({', '.join(want) or 'none'})")
    return r


def _shown(text: str) -> str:
    """A member's words in our one line: its first 80 characters, control characters escaped
    (a proxy's error page is several lines of HTML)."""
    return "".join(c if c.isprintable() else repr(c)[1:-1] for c in text[:80])


class Cluster:
    def __init__(self, url: str, *, timeout: float = 2.0) -> None:
        self.url = url
        self.endpoints, prefix = parse_url(url)
        # Every key lives under this root: locks, requests, activity, the ledger.
        self.root = f"/{prefix}/"
        self.timeout = timeout
        self.api_path = API_PATH
        self._conns: list[Conn | None] = [None] * len(self.endpoints)  # made when first needed
        self.current = 0  # the member that answered last: requests (and watches) go there first

    def close(self) -> None:
        """Close the kept-alive connections (a later request opens a new one)."""
        for conn in self._conns:
            if conn is not None:
                conn.close()

    def post(self, path: str, body: dict[str, Any]) -> dict[str, Any]:
        """etcd's answer to ``body`` at ``path``, from the first member that gives one.

        Every write must be safe to send twice. A member that fails after it applied a
        request (killed, restarted, cut off between its apply and its answer) cannot say so:
        the client sees a connection that broke before any answer, exactly as for a member
        that never got the request, and sends the same request to the next member (and, on
        a kept-alive connection, to the same member once more: ``Conn.request``). etcd has
        no request ids to drop a duplicate, so each write settles it itself: a put of the
        same value is the same record; a compare-and-swap that fails reads what is there and
        knows its own write (our ticket on our lease in the key we joined: ``Mutex._join``;
        the victim we superseded: ``events._take_over``; our own claim: ``claim_request``,
        ``rules.requests.claim``); a grant sent twice leaves a lease nobody uses, which
        lapses at its TTL; a revoke or delete of what is gone already does nothing.
        """
        payload = jsontext.dumps(body).encode()
        patience: float | None = None
        while True:
            errors, electing = self._post_once(path, body, payload)
            if isinstance(errors, dict):
                return errors
            now = time.monotonic()
            patience = now + self.timeout if patience is None else patience
            if not electing or now + ELECTION_PAUSE >= patience:
                raise BackendUnavailable(self.url, "; ".join(errors))
            time.sleep(ELECTION_PAUSE)

    def _post_once(self, path: str, body: dict[str, Any], payload: bytes) -> tuple[dict[str, Any] | list[str], bool]:
        """One round over the members: etcd's answer, or each member's error and whether every
        member answered that an election is on."""
        errors: list[str] = []
        electing = True
        for i in range(len(self.endpoints)):
            k = (self.current + i) % len(self.endpoints)
            where = f"{self.endpoints[k][0]}:{self.endpoints[k][1]}"
            conn = self._conns[k]
            if conn is None:
                host, port = self.endpoints[k]
                conn = self._conns[k] = Conn(host, port, self.timeout)
            try:
                status, data = conn.request(API_PATH + path, payload)
            except OSError as exc:
                errors.append(f"{where}: {type(exc).__name__}")
                electing = False
                continue
            if status == 200:
                try:
                    result = decode(path, body, data)
                except NotEtcd as exc:
                    conn.close()  # whatever it is, it is not asked again on this connection
                    errors.append(f"{where}: not an etcd answer ({_shown(str(exc))})")
                    electing = False
                    continue
                self.current = k
                return result, False
            text = data.decode(errors="replace")
            refused = _refusal(text)
            if refused is not None:
                self.current = k
                raise refused
            # A member that lost quorum (or its leader), or cannot serve yet, answers with an error:
            # try the next one.
            errors.append(f"{where}: {_shown(text)}")
            electing = electing and election_answer(text)
        return errors, electing and bool(errors)

    # -- kv ------------------------------------------------------------------

    def range_prefix(
        self, prefix: str, *, sort_create: bool = True, keys_only: bool = False
    ) -> tuple[list[dict[str, Any]], int]:
        """Keys under ``prefix`` (oldest create revision first) and the store revision."""
        body = op_range(prefix, prefix=True, sort="ASCEND" if sort_create else None, keys_only=keys_only)
        r = self.post("kv/range", body["request_range"])
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
        """Whole seconds left on the lease, rounded down (0: under a second; -1: gone)."""
        return int(self.post("kv/lease/timetolive", {"ID": str(lease)}).get("TTL", -1))

    def revoke(self, lease: int) -> None:
        # Gone already, or unreachable: then its TTL ends it.
        with contextlib.suppress(Refused, BackendUnavailable):
            self.post("kv/lease/revoke", {"ID": str(lease)})


# -- request bodies for txn -----------------------------------------------------------


def cmp(key: str, target: str, result: str, value: int, *, prefix: bool = False) -> dict[str, Any]:
    """A txn compare on ``key`` (or every key under it): target CREATE / MOD, result EQUAL / GREATER ...

    Over a prefix it holds when it holds for every key there (and an empty range
    compares as revision 0): ``cmp(q, "CREATE", "EQUAL", 0, prefix=True)`` is "nobody in line".
    """
    field = {"CREATE": "create_revision", "MOD": "mod_revision"}[target]
    out = {"key": b64(key), "target": target, "result": result, field: str(value)}
    if prefix:
        out["range_end"] = prefix_end(key)
    return out


def op_put(key: str, value: bytes, lease: int = 0, *, keep_lease: bool = False) -> dict[str, Any]:
    """A put; ``keep_lease``: on the lease the key has (etcd refuses it for a key that is not there)."""
    body: dict[str, Any] = {"key": b64(key), "value": b64(value)}
    if lease:
        body["lease"] = str(lease)
    if keep_lease:
        body["ignore_lease"] = True
    return {"request_put": body}


def op_delete(key: str, *, prefix: bool = False) -> dict[str, Any]:
    body = {"key": b64(key)}
    if prefix:
        body["range_end"] = prefix_end(key)
    return {"request_delete_range": body}


def op_txn(
    compare: list[dict[str, Any]], success: list[dict[str, Any]], failure: list[dict[str, Any]]
) -> dict[str, Any]:
    """A txn nested in a txn's branch (etcd >= 3.3): a third outcome in one round trip."""
    return {"request_txn": {"compare": compare, "success": success, "failure": failure}}


def op_range(
    key: str,
    *,
    prefix: bool = False,
    sort: str | None = None,
    limit: int = 0,
    keys_only: bool = False,
    count_only: bool = False,
    max_create: int = 0,
) -> dict[str, Any]:
    """A range request: ``sort`` ASCEND / DESCEND by create revision."""
    body: dict[str, Any] = {"key": b64(key)}
    if prefix:
        body["range_end"] = prefix_end(key)
    if sort:
        body.update(sort_order=sort, sort_target="CREATE")
    if limit:
        body["limit"] = str(limit)
    if keys_only:
        body["keys_only"] = True
    if count_only:
        body["count_only"] = True
    if max_create:
        body["max_create_revision"] = str(max_create)
    return {"request_range": body}


def ranged(r: dict[str, Any], i: int) -> tuple[list[dict[str, Any]], int]:
    """The kvs and count of the ``i``-th response of a txn (a range)."""
    rr = r.get("responses", [])[i].get("response_range", {})
    return [_kv(kv) for kv in rr.get("kvs", [])], int(rr.get("count", 0) or 0)


def nested(r: dict[str, Any], i: int) -> dict[str, Any]:
    """The answer of the ``i``-th op of a txn, a nested txn."""
    out: dict[str, Any] = r.get("responses", [])[i].get("response_txn", {})
    return out


def revision(r: dict[str, Any]) -> int:
    return int(r["header"]["revision"])


def _kv(kv: dict[str, Any]) -> dict[str, Any]:
    return {
        "key": unb64(kv["key"]).decode(errors="replace"),
        "value": unb64(kv.get("value", "")),
        "create_revision": int(kv.get("create_revision", 0)),
        "mod_revision": int(kv.get("mod_revision", 0)),
        "lease": int(kv.get("lease", 0)),
    }
