"""The seed's lock commands on etcd (pearing-cli and pearing-mcp with --backend etcd://...).

The ticket's lease in the cluster plays the detached holder: it keeps the lock
until release, or until its owner stops heartbeating (lease expiry). The token
file is written on the acquiring host, 0600 in the local lock dir.
"""

from __future__ import annotations

import json
import time
from typing import Any

from singleflight import lease as local_lease
from singleflight.api import Outcome
from singleflight.core import names
from singleflight.core.const import CANCELLED, HELD, RELEASED, WAITING
from singleflight.core.errors import NotHeld, UnknownTicket
from singleflight.core.ticket import Ticket, new_uuid4
from singleflight.etcd.client import Cluster
from singleflight.etcd.lock import ROOT, EtcdLock, parse_ticket
from singleflight.store import LockDir

_REQUEST_RETENTION = 24 * 3600.0


class EtcdBackend:
    def __init__(self, url: str, lock_dir: str) -> None:
        self.cluster = Cluster(url)
        self.lock_dir = LockDir(lock_dir)

    def close(self) -> None:
        self.lock_dir.close()

    def __enter__(self) -> EtcdBackend:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _lock(self, lock: str, repo: str) -> EtcdLock:
        return EtcdLock(self.cluster, names.scope(repo), names.lock_name(lock))

    def _view(self, el: EtcdLock, t: Ticket, kv: dict[str, Any] | None) -> dict[str, Any]:
        position = token_file = None
        if kv is not None:
            kvs, _ = el.queue()
            keys = [k["key"] for k in kvs]
            if kv["key"] in keys:
                i = keys.index(kv["key"])
                t.state = HELD if i == 0 else WAITING
                t.fence = kv["create_revision"] if i == 0 else None
                position = None if i == 0 else i
            left = self.cluster.ttl(kv["lease"])
            t.lease_expires_at = time.time() + left if left > 0 else t.lease_expires_at
            if t.state == HELD:
                with self.lock_dir.lock_store(el.repo, el.lock) as store:
                    path = store.token_file_path(t.ticket_id)
                    token_file = path if store.sub("tokens").lstat(f"{t.ticket_id}.token") else None
        activity = self.cluster.get(f"{ROOT}activity/{t.identity}")
        text = json.loads(activity["value"]).get("activity") if activity else None
        return t.public(activity=text, queue_position=position, token_file=token_file)

    def _find(self, el: EtcdLock, ticket_id: str) -> tuple[Ticket, dict[str, Any] | None]:
        found = el.ticket(ticket_id)
        if found is None:
            raise UnknownTicket(ticket_id)
        return found

    def acquire(
        self, lock: str, repo: str, *, request_uuid: str, lease_seconds: float, wait_seconds: float, identity: str
    ) -> Outcome:
        request_uuid = names.request_uuid(request_uuid)
        el = self._lock(lock, repo)
        rec = el.read_request(request_uuid)
        if rec and rec.get("ticket_id"):
            return self._existing(el, str(rec["ticket_id"]), wait_seconds)
        t = Ticket(
            ticket_id=new_uuid4(),
            request_uuid=request_uuid,
            lock_name=el.lock,
            repo=el.repo,
            identity=identity,
            state=WAITING,
            lease_seconds=lease_seconds,
            created_at=time.time(),
        )
        token = local_lease.mint_token()
        t.token_hash = local_lease.token_hash(token)
        lease, _ = el.enqueue(t)
        # Only one acquisition per uuid, even when two arrive at once: the uuid record is
        # created by compare-and-swap, and the loser withdraws its ticket for the winner's.
        keep = self.cluster.grant(int(_REQUEST_RETENTION))
        if not el.claim_request(request_uuid, {"state": "active", "ticket_id": t.ticket_id}, keep, None):
            self.cluster.revoke(lease)
            self.cluster.revoke(keep)
            rec = el.read_request(request_uuid) or {}
            return self._existing(el, str(rec.get("ticket_id")), wait_seconds)
        # Written now, read by the owner once held: the token is never sent to the cluster.
        with self.lock_dir.lock_store(el.repo, el.lock) as store:
            store.write_token_file(t, token, backend=self.cluster.url)
        kv = self.cluster.get(el.q + t.ticket_id)
        return self._wait(el, t, kv, wait_seconds)

    def _existing(self, el: EtcdLock, ticket_id: str, wait_seconds: float) -> Outcome:
        """The same request uuid again: its ticket, never a second one."""
        found = el.ticket(ticket_id)
        if found is None:
            raise UnknownTicket(ticket_id)
        t, kv = found
        if kv is None:
            return Outcome(self._view(el, t, None), 1, f"ticket {t.ticket_id}: {local_lease.describe_end(t)}")
        return self._wait(el, t, kv, wait_seconds)

    def _wait(self, el: EtcdLock, t: Ticket, kv: dict[str, Any] | None, wait_seconds: float) -> Outcome:
        if kv is not None:
            el.wait_turn(t.ticket_id, time.monotonic() + wait_seconds)
        t, kv = self._find(el, t.ticket_id)
        view = self._view(el, t, kv)
        if view["state"] == HELD:
            return Outcome(view)
        if view["state"] == WAITING:
            return Outcome(view, 75, "still waiting in line")
        return Outcome(view, 1, f"ticket {t.ticket_id}: {local_lease.describe_end(t)}")

    def get(self, lock: str, repo: str, ticket_id: str) -> dict[str, Any]:
        el = self._lock(lock, repo)
        t, kv = self._find(el, names.ticket_id(ticket_id))
        return self._view(el, t, kv)

    def heartbeat(self, lock: str, repo: str, ticket_id: str, lease_seconds: float) -> dict[str, Any]:
        """Renew the ticket's lease (for the TTL it was granted with)."""
        el = self._lock(lock, repo)
        t, kv = self._find(el, names.ticket_id(ticket_id))
        if kv is None:
            raise NotHeld(t.ticket_id, local_lease.describe_end(t))
        if self.cluster.keepalive(kv["lease"]) <= 0:
            raise NotHeld(t.ticket_id, "lease expired")
        return self._view(el, t, kv)

    def release(self, lock: str, repo: str, ticket_id: str) -> dict[str, Any]:
        el = self._lock(lock, repo)
        t, kv = self._find(el, names.ticket_id(ticket_id))
        if kv is None:
            cur = el.ticket(t.ticket_id)
            ended = cur[0] if cur else t
            if ended.state in (RELEASED, CANCELLED):
                return self._view(el, ended, None)
            raise NotHeld(t.ticket_id, local_lease.describe_end(ended))
        view = self._view(el, t, kv)
        final = RELEASED if view["state"] == HELD else CANCELLED
        el.end(t, kv["lease"], final, "released by owner")
        with self.lock_dir.lock_store(el.repo, el.lock) as store:
            store.remove_token_file(t.ticket_id)
        return self._view(el, t, None)

    def update_activity(self, identity: str, activity: str | None) -> dict[str, Any]:
        names.identity(identity)
        key = f"{ROOT}activity/{identity}"
        if activity is None:
            self.cluster.delete(key)
        else:
            self.cluster.put(key, json.dumps({"activity": activity, "at": time.time()}).encode())
        return {"identity": identity, "activity": activity}

    def status(self, repo: str, lock: str | None) -> list[dict[str, Any]]:
        names.scope(repo)
        prefix = f"{ROOT}{repo}/@" + (f"{names.lock_name(lock)}/" if lock else "")
        kvs, _ = self.cluster.range_prefix(prefix)
        by_lock: dict[str, list[dict[str, Any]]] = {}
        for kv in kvs:
            rest = kv["key"][len(f"{ROOT}{repo}/@") :]
            name, _, kind = rest.partition("/")
            if kind.startswith("q/"):
                by_lock.setdefault(name, []).append(kv)
        out = []
        for name in sorted(by_lock):
            el = EtcdLock(self.cluster, repo, name)
            q = by_lock[name]
            holder = self._view(el, parse_ticket(q[0]["value"]), q[0])
            left = self.cluster.ttl(q[0]["lease"])
            holder["lease_left"] = float(left) if left > 0 else None
            waiters = [self._view(el, parse_ticket(kv["value"]), kv) for kv in q[1:]]
            out.append(
                {
                    "lock_name": name,
                    "repo": repo,
                    "state": "held",
                    "fence": q[0]["create_revision"],
                    "holder": holder,
                    "waiters": waiters,
                }
            )
        return out
