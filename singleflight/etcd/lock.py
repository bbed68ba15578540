"""The lock recipe on etcd, after etcd's own ``client/v3/concurrency/mutex.go``.

Every key lives under ``/PREFIX/`` (the URL's tenant, default ``pearing``):

    /PREFIX/SCOPE/@LOCK/q/TICKET     one key per ticket, on the ticket's lease, created
                                     in a txn only if absent; the holder is the key with
                                     the lowest create revision (FIFO for free), and that
                                     revision is the fence
    /PREFIX/SCOPE/@LOCK/g/ID         an in-flight pearing-guard exec; a new holder waits
                                     for these to go before it proceeds
    /PREFIX/SCOPE/@LOCK/e/TICKET     an ended ticket, kept an hour on a lease of its own
    /PREFIX/SCOPE/@LOCK/t/TICKET     the ticket as created, kept an hour (a lapsed lease reads expired)
    /PREFIX/SCOPE/@LOCK/r/UUID       request-uuid record (dedupe), on a retention lease
    /PREFIX/SCOPE/@LOCK/s            the last successful start (--min-interval)
    /PREFIX/activity/IDENTITY        update-user-activity
    /PREFIX/ledger/RESOURCE          pearing-guard fence, updated by compare-and-swap

A waiter watches only the key just ahead of it, from the revision it read the
queue at, then re-reads the queue (and checks its own key still exists).
"""

from __future__ import annotations

import json
import math
import os
import time
from typing import Any

from singleflight.core.const import ENDED_TICKET_RETENTION, EXPIRED, HELD, WAITING
from singleflight.core.errors import CorruptRecord
from singleflight.core.ticket import RequestRecord, Ticket
from singleflight.etcd.client import Cluster, b64


def ttl_of(seconds: float) -> int:
    """etcd leases count whole seconds; round up so a lease is never shorter than asked."""
    return max(2, math.ceil(seconds))


class Mutex:
    def __init__(self, cluster: Cluster, repo: str, lock: str) -> None:
        self.cluster, self.repo, self.lock = cluster, repo, lock
        self.base = f"{cluster.root}{repo}/@{lock}/"
        self.q, self.g, self.e, self.r, self.t = (self.base + s for s in ("q/", "g/", "e/", "r/", "t/"))

    # -- queue ---------------------------------------------------------------

    def enqueue(self, t: Ticket, lease: int = 0) -> tuple[int, int]:
        """Create the ticket's key on its lease (a fresh one unless given); (lease id, revision)."""
        lease = lease or self.cluster.grant(ttl_of(t.lease_seconds))
        # A copy outlives the ticket's lease (an hour), so a lapsed ticket reads "expired", not unknown.
        keep = self.cluster.grant(int(ENDED_TICKET_RETENTION))
        key, body = self.q + t.ticket_id, b64(value(t, lease))
        r = self.cluster.txn(
            [{"key": b64(key), "result": "EQUAL", "target": "CREATE", "create_revision": "0"}],
            [
                {"request_put": {"key": b64(key), "value": body, "lease": str(lease)}},
                {"request_put": {"key": b64(self.t + t.ticket_id), "value": body, "lease": str(keep)}},
            ],
            [],
        )
        if not r.get("succeeded"):
            self.cluster.revoke(lease)
            raise RuntimeError(f"ticket key {key} already exists")
        return lease, int(r["header"]["revision"])

    def queue(self) -> tuple[list[dict[str, Any]], int]:
        return self.cluster.range_prefix(self.q)

    def holder(self) -> dict[str, Any] | None:
        kvs, _ = self.queue()
        return kvs[0] if kvs else None

    def wait_turn(self, ticket_id: str, deadline: float) -> dict[str, Any] | None:
        """Block until our key is the oldest (its kv), our key is gone, or the deadline (None)."""
        mine = self.q + ticket_id
        while True:
            kvs, rev = self.queue()
            keys = [kv["key"] for kv in kvs]
            if mine not in keys:
                return None
            i = keys.index(mine)
            if i == 0:
                return kvs[0] if self.wait_guards(deadline) else None
            if not self.cluster.wait_deleted(keys[i - 1], rev, deadline):
                return None

    def wait_guards(self, deadline: float) -> bool:
        """A guarded side effect of the previous holder lands before we proceed."""
        while True:
            guards, rev = self.cluster.range_prefix(self.g)
            if not guards:
                return True
            if not self.cluster.wait_deleted(guards[0]["key"], rev, deadline):
                return False

    # -- tickets ---------------------------------------------------------------

    def ticket(self, ticket_id: str) -> tuple[Ticket, dict[str, Any] | None] | None:
        """The ticket as it stands now (state from the queue), and its queue key."""
        kv = self.cluster.get(self.q + ticket_id)
        if kv is not None:
            t = parse_ticket(kv["value"])
            if not t.live:  # its token is dead; its COMMAND is being stopped, the lock still taken
                return t, kv
            first = self.holder()
            held = first is not None and first["key"] == kv["key"]
            t.state = HELD if held else WAITING
            t.fence = kv["create_revision"] if held else None
            return t, kv
        ended = self.cluster.get(self.e + ticket_id)
        if ended:
            return parse_ticket(ended["value"]), None
        copy = self.cluster.get(self.t + ticket_id)
        if copy is None:
            return None
        t = parse_ticket(copy["value"])  # its lease lapsed without an end record
        t.state, t.end_reason = EXPIRED, "lease expired"
        return t, None

    def end(self, t: Ticket, lease: int, state: str, reason: str, *, revoke: bool = True) -> None:
        """Record the ticket's end (kept an hour); then revoke its lease: the key goes, the next is
        promoted. Without ``revoke`` the key stays, marked ended: the token is dead, the lock still ours."""
        t.state, t.end_reason, t.ended_at = state, reason, time.time()
        keep = self.cluster.grant(int(ENDED_TICKET_RETENTION))
        body = b64(value(t, lease))
        self.cluster.txn(
            [],
            [
                {"request_put": {"key": b64(self.e + t.ticket_id), "value": body, "lease": str(keep)}},
                *(
                    []
                    if revoke
                    else [{"request_put": {"key": b64(self.q + t.ticket_id), "value": body, "lease": str(lease)}}]
                ),
            ],
            [],
        )
        if revoke:
            self.cluster.revoke(lease)

    # -- the last successful start (--min-interval), across hosts -------------------

    def read_last_success(self) -> float | None:
        kv = self.cluster.get(self.base + "s")
        if kv is None:
            return None
        try:
            value = json.loads(kv["value"])["started_at"]
            if isinstance(value, bool) or not isinstance(value, (int, float)):
                raise TypeError("started_at is not a number")
        except (ValueError, KeyError, TypeError) as exc:
            raise CorruptRecord(f"etcd:{self.base}s", f"not a success record: {exc}") from None
        return float(value)

    def write_last_success(self, started_at: float, ticket_id: str) -> None:
        self.cluster.put(self.base + "s", json.dumps({"started_at": started_at, "ticket_id": ticket_id}).encode())

    # -- request records ---------------------------------------------------------

    def read_request_kv(self, uuid: str) -> tuple[RequestRecord | None, dict[str, Any] | None]:
        """The request record and its kv (for a compare-and-swap on its mod revision)."""
        kv = self.cluster.get(self.r + uuid)
        if kv is None:
            return None, None
        try:
            return RequestRecord.from_json(kv["value"]), kv
        except (ValueError, TypeError) as exc:
            raise CorruptRecord(f"etcd:{self.r}{uuid}", f"not a request record: {exc}") from None

    def claim_request(self, uuid: str, record: RequestRecord, lease: int, seen: dict[str, Any] | None) -> bool:
        """Write ``record`` only if the request key is still as ``seen`` (compare-and-swap).

        The claim rides on the claimant's ticket lease: if the claimant dies, its claim
        goes with it, and a replay may run again; while it lives, replays see it.
        """
        key = b64(self.r + uuid)
        cmp = (
            {"key": key, "result": "EQUAL", "target": "MOD", "mod_revision": str(seen["mod_revision"])}
            if seen
            else {"key": key, "result": "EQUAL", "target": "CREATE", "create_revision": "0"}
        )
        put = {"request_put": {"key": key, "value": b64(record.to_json()), "lease": str(lease)}}
        return bool(self.cluster.txn([cmp], [put], []).get("succeeded"))

    def write_request(self, uuid: str, record: RequestRecord, ttl: float) -> None:
        keep = self.cluster.grant(ttl_of(ttl))
        self.cluster.put(self.r + uuid, record.to_json(), keep)


def value(t: Ticket, lease: int) -> bytes:
    obj = {name: getattr(t, name) for name in ("ticket_id", "request_uuid", "lock_name", "repo", "identity")}
    obj.update(
        state=t.state,
        lease_seconds=t.lease_seconds,
        lease=str(lease),
        token_hash=t.token_hash,
        holder_pid=t.holder_pid,
        holder_start=t.holder_start,
        holder_host=t.holder_host or os.uname().nodename,
        promoted=t.promoted,
        created_at=t.created_at,
        acquired_at=t.acquired_at,
        ended_at=t.ended_at,
        end_reason=t.end_reason,
        fence=t.fence,
    )
    return json.dumps(obj).encode()


def parse_ticket(raw: bytes) -> Ticket:
    return Ticket.from_dict(json.loads(raw))


def verify(cluster: Cluster, repo: str, lock: str, ticket_id: str, token_hash: str) -> tuple[bool, str, int | None]:
    """(live, reason, fence) for a token of a ticket held in etcd."""
    import hmac

    el = Mutex(cluster, repo, lock)
    kvs, _ = el.queue()
    mine = next((kv for kv in kvs if kv["key"] == el.q + ticket_id), None)
    if mine is None:
        ended = cluster.get(el.e + ticket_id)
        t = parse_ticket(ended["value"]) if ended else None
        if t is not None and t.token_hash and hmac.compare_digest(t.token_hash, token_hash):
            last = cluster.get(el.base + "last")
            newer = kvs[0]["create_revision"] if kvs else int(last["value"]) if last else None
            if newer is not None and t.fence is not None and newer > t.fence:
                return False, f"superseded by fence {newer}", t.fence
            return False, f"{t.state} ({t.end_reason})", t.fence
        return False, "unknown or forged token (or its lease expired)", None
    t = parse_ticket(mine["value"])
    if not t.token_hash or not hmac.compare_digest(t.token_hash, token_hash):
        return False, "unknown or forged token", None
    if kvs[0] is not mine:
        return False, "not the holder: waiting in line", None
    return True, "live", mine["create_revision"]


def accept_fence(cluster: Cluster, resource: str, fence: int) -> int:
    """The ledger as an etcd key, updated by compare-and-swap on its mod revision."""
    from singleflight.core.errors import StaleFence

    key = f"{cluster.root}ledger/{resource}"
    while True:
        kv = cluster.get(key)
        highest = int(kv["value"]) if kv else 0
        if fence < highest:
            raise StaleFence(resource, fence, highest)
        if fence == highest:
            return fence
        cmp = (
            {"key": b64(key), "result": "EQUAL", "target": "MOD", "mod_revision": str(kv["mod_revision"])}
            if kv
            else {"key": b64(key), "result": "EQUAL", "target": "CREATE", "create_revision": "0"}
        )
        r = cluster.txn([cmp], [{"request_put": {"key": b64(key), "value": b64(str(fence))}}], [])
        if r.get("succeeded"):
            return fence


def hold_guard(cluster: Cluster, repo: str, lock: str, ticket_id: str, seconds: float) -> tuple[str, int] | None:
    """Register an in-flight guarded command, only while our ticket key exists.

    A new holder waits for these keys to go (Mutex.wait_guards), so the side
    effect lands before the next holder proceeds. Returns (key, lease) or None.
    """
    import uuid

    el = Mutex(cluster, repo, lock)
    lease = cluster.grant(ttl_of(seconds + 2))
    key = el.g + str(uuid.uuid4())
    r = cluster.txn(
        [{"key": b64(el.q + ticket_id), "result": "GREATER", "target": "CREATE", "create_revision": "0"}],
        [{"request_put": {"key": b64(key), "value": b64(ticket_id), "lease": str(lease)}}],
        [],
    )
    if not r.get("succeeded"):
        cluster.revoke(lease)
        return None
    return key, lease
