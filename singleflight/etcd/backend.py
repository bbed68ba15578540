"""The etcd backend: the lock, queue, lease and records of every (scope, lock) in a cluster.

Token files stay on the acquiring host, 0600 in the local lock dir, and name
the backend, so ``pearing-guard`` checks the cluster.
"""

from __future__ import annotations

import contextlib
import json
import os
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

from singleflight.core import names, proc
from singleflight.core.const import (
    CANCELLED,
    CLAIM_BUSY,
    CLAIM_DONE,
    CLAIM_RUN,
    ENV_BACKEND,
    EXPIRED,
    HELD,
    RELEASED,
    REQUEST_ACTIVE,
    WAITING,
)
from singleflight.core.errors import BackendUnavailable, NotHeld, UnknownTicket
from singleflight.core.fs import Dir, lock_parts
from singleflight.core.protocol import Taken
from singleflight.core.ticket import RequestRecord, Ticket
from singleflight.core.tokens import Claim, TokenFiles, Verdict, mint_token, token_hash
from singleflight.etcd import lock as recipe
from singleflight.etcd.client import Cluster, b64, parse_url
from singleflight.etcd.lease import EtcdGrip, EtcdLease
from singleflight.etcd.lock import Mutex, parse_ticket, ttl_of

_REQUEST_RETENTION = 24 * 3600.0
# How long a release waits for a holder on this host to let go.
_RELEASE_WAIT = 10.0


class EtcdPlace:
    def __init__(self, lk: EtcdLock, ticket: Ticket, lease: int, grip: EtcdGrip | None) -> None:
        self.lk, self.ticket, self.lease, self.grip = lk, ticket, lease, grip

    def queue(self, deadline: float) -> int:
        kvs, _ = self.lk.mutex.queue()
        keys = [kv["key"] for kv in kvs]
        mine = self.lk.mutex.q + self.ticket.ticket_id
        return keys.index(mine) if mine in keys else len(keys)

    def wait(self, deadline: Callable[[], float]) -> EtcdGrip | None:
        mutex, cluster, tid = self.lk.mutex, self.lk.cluster, self.ticket.ticket_id
        step_len = ttl_of(self.ticket.lease_seconds) / 3
        while True:
            end = deadline()
            if time.monotonic() >= end:
                return None
            # Keep our place: the waiting key's lease is renewed between watches.
            got = mutex.wait_turn(tid, min(end, time.monotonic() + step_len))
            if got is not None:
                self.grip = EtcdGrip(cluster, self.lease, got, ttl_of(self.ticket.lease_seconds))
                return self.grip
            if cluster.get(mutex.q + tid) is None or cluster.keepalive(self.lease) <= 0:
                return None

    def leave(self) -> None:
        if self.grip is None:
            self.lk.cluster.revoke(self.lease)


class EtcdLock:
    """One (scope, lock) in the cluster."""

    def __init__(self, backend: EtcdBackend, repo: str, lock: str) -> None:
        self.backend, self.repo, self.lock = backend, repo, lock
        self.cluster = backend.cluster
        self.mutex = Mutex(self.cluster, repo, lock)
        self._leases: dict[str, int] = {}
        self._tokens: TokenFiles | None = None

    def close(self) -> None:
        if self._tokens is not None:
            self._tokens.close()
            self._tokens.root.close()
            self._tokens = None

    @property
    def tokens(self) -> TokenFiles:
        """This host's token files of the lock, in the local lock dir."""
        if self._tokens is None:
            root = Dir.open_root(self.backend.lock_dir, create=True)
            try:
                d = root.walk(lock_parts(self.repo, self.lock))
            finally:
                root.close()
            self._tokens = TokenFiles(self.backend.lock_dir, d)
        return self._tokens

    def _lease_for(self, ticket: Ticket) -> int:
        lease = self._leases.get(ticket.ticket_id)
        if lease is None:
            lease = self._leases[ticket.ticket_id] = self.cluster.grant(ttl_of(ticket.lease_seconds))
        return lease

    # -- requests ------------------------------------------------------------------------

    def read_request(self, request_uuid: str) -> RequestRecord | None:
        return self.mutex.read_request_kv(request_uuid)[0]

    def last_success(self) -> float | None:
        return self.mutex.read_last_success()

    def claim_request(self, ticket: Ticket) -> str:
        # The ticket's lease comes first: the claim lives exactly as long as this run.
        lease = self._lease_for(ticket)
        uuid = ticket.request_uuid
        while True:
            rec, seen = self.mutex.read_request_kv(uuid)
            if rec is not None:
                if rec.succeeded_within(time.time()):
                    self._drop_lease(ticket)
                    return CLAIM_DONE
                if rec.active:  # on a live lease, or it would be gone
                    self._drop_lease(ticket)
                    return CLAIM_BUSY
            claim = RequestRecord(
                state=REQUEST_ACTIVE, ticket_id=ticket.ticket_id, created_at=time.time(), previous=rec
            )
            if self.mutex.claim_request(uuid, claim, lease, seen):
                return CLAIM_RUN
            # Someone changed the record between our read and write: look again.

    def _drop_lease(self, ticket: Ticket) -> None:
        lease = self._leases.pop(ticket.ticket_id, None)
        if lease:
            self.cluster.revoke(lease)

    def unclaim_request(self, ticket: Ticket) -> None:
        uuid = ticket.request_uuid
        with contextlib.suppress(BackendUnavailable):
            rec, _ = self.mutex.read_request_kv(uuid)
            if rec and rec.ticket_id == ticket.ticket_id:
                if rec.previous is not None:
                    self.mutex.write_request(uuid, rec.previous, max(1.0, (rec.previous.expires_at or 0) - time.time()))
                else:
                    self.cluster.delete(self.mutex.r + uuid)

    # -- acquiring -------------------------------------------------------------------------

    def enter(self, ticket: Ticket) -> EtcdPlace:
        mutex = self.mutex
        kv = self.cluster.get(mutex.q + ticket.ticket_id)
        if kv is not None:  # created by pearing-cli acquire-lock: its agent takes over
            lease = kv["lease"]
        else:
            ticket.holder_host = ticket.holder_host or os.uname().nodename
            lease, _ = mutex.enqueue(ticket, self._lease_for(ticket))
        self._leases[ticket.ticket_id] = lease
        kvs, _ = mutex.queue()
        first = bool(kvs) and kvs[0]["key"] == mutex.q + ticket.ticket_id
        # First in line, once the previous holder's guarded side effects have landed.
        if first and mutex.wait_guards(time.monotonic()):
            return EtcdPlace(self, ticket, lease, EtcdGrip(self.cluster, lease, kvs[0], ttl_of(ticket.lease_seconds)))
        return EtcdPlace(self, ticket, lease, None)

    def cancel_holder(self, ticket: Ticket) -> float | None:
        """Not yet on etcd: an opted-in holder there is left alone, as one that did not opt in."""
        return None

    def take(self, grip: EtcdGrip, ticket: Ticket, *, promoted: bool, kill_grace: float) -> tuple[EtcdLease, Taken]:
        # A request timeout short enough that a dead member cannot hold the holder past its deadline.
        cluster = Cluster(self.backend.url, timeout=max(0.2, min(1.0, ttl_of(ticket.lease_seconds) / 10)))
        mutex = Mutex(cluster, self.repo, self.lock)
        kv = grip.kv
        key, fence = str(kv["key"]), int(str(kv["create_revision"]))
        token = mint_token()
        t = parse_ticket(kv["value"])
        t.state, t.fence, t.promoted = HELD, fence, promoted
        t.holder_pid, t.holder_start = os.getpid(), proc.start_time(os.getpid())
        t.holder_host = os.uname().nodename
        t.acquired_at = time.time()
        t.token_hash = token_hash(token)
        # The token's hash goes into our key (a put keeps its create revision, so the fence),
        # and the newest fence is remembered, so an older token can be told it was superseded.
        r = cluster.txn(
            [{"key": b64(key), "result": "EQUAL", "target": "CREATE", "create_revision": str(fence)}],
            [
                {"request_put": {"key": b64(key), "value": b64(recipe.value(t, grip.lease)), "lease": str(grip.lease)}},
                {"request_put": {"key": b64(mutex.base + "last"), "value": b64(str(fence))}},
            ],
            [],
        )
        if not r.get("succeeded"):
            raise NotHeld(t.ticket_id, "lease expired before the holder took it")
        ticket.fence, ticket.token_hash = fence, t.token_hash
        driver = EtcdLease(mutex, grip.lease, t, self.tokens, kill_grace)
        token_file = self.tokens.write(t, token, backend=self.backend.url, lease=str(grip.lease), key=key)
        # PEARING_BACKEND too: COMMAND's pearing-cli heartbeats and guards must reach the cluster.
        env = {"ETCD_LOCK_KEY": key, "ETCD_LOCK_REV": str(fence), ENV_BACKEND: self.backend.url}
        return driver, Taken(fence, token, token_file, env)

    # -- the ticket ------------------------------------------------------------------------

    def create(self, ticket: Ticket) -> Ticket:
        mutex = self.mutex
        rec, _ = mutex.read_request_kv(ticket.request_uuid)
        if rec is not None and rec.ticket_id:
            return self._existing(rec.ticket_id)
        ticket.holder_host = os.uname().nodename
        lease, _ = mutex.enqueue(ticket, self._lease_for(ticket))
        # Only one acquisition per uuid, even when two arrive at once: the uuid record is
        # created by compare-and-swap, and the loser withdraws its ticket for the winner's.
        keep = self.cluster.grant(int(_REQUEST_RETENTION))
        record = RequestRecord(state=REQUEST_ACTIVE, ticket_id=ticket.ticket_id, created_at=time.time())
        if not mutex.claim_request(ticket.request_uuid, record, keep, None):
            self.cluster.revoke(lease)
            self.cluster.revoke(keep)
            rec, _ = mutex.read_request_kv(ticket.request_uuid)
            return self._existing(rec.ticket_id if rec and rec.ticket_id else ticket.ticket_id)
        ticket.set_lease(ticket.lease_seconds)
        return ticket

    def _existing(self, ticket_id: str) -> Ticket:
        found = self.mutex.ticket(ticket_id)
        if found is None:
            raise UnknownTicket(ticket_id)
        return found[0]

    def read(self, ticket_id: str) -> Ticket | None:
        found = self.mutex.ticket(ticket_id)
        return found[0] if found else None

    def adopt(self, ticket_id: str, pid: int) -> Ticket | None:
        kv = self.cluster.get(self.mutex.q + ticket_id)
        if kv is None:
            return None
        t = parse_ticket(kv["value"])
        t.holder_pid, t.holder_start, t.holder_host = pid, proc.start_time(pid), os.uname().nodename
        self.cluster.put(kv["key"], recipe.value(t, kv["lease"]), kv["lease"])
        self._leases[ticket_id] = kv["lease"]
        return t

    def waiting_deadline(self, ticket_id: str) -> float:
        kv = self.cluster.get(self.mutex.q + ticket_id)
        if kv is None:
            return 0.0
        left = self.cluster.ttl(kv["lease"])
        return time.monotonic() + left if left > 0 else 0.0

    def end(
        self, ticket_id: str, state: str, reason: str, *, only_if_held: bool = True, release: bool = True
    ) -> Ticket | None:
        found = self.mutex.ticket(ticket_id)
        if found is None:
            return None
        t, kv = found
        if kv is None:
            return None
        if not t.live or (only_if_held and t.state != HELD):
            if release and not t.live:
                self.cluster.revoke(kv["lease"])  # its token died earlier; now the lock goes too
            return None
        self.mutex.end(t, kv["lease"], state, reason, revoke=release)
        return t

    def record_request(self, ticket: Ticket, status: int | None, window: float) -> None:
        record = RequestRecord.finished(ticket, status, window)
        self.mutex.write_request(ticket.request_uuid, record, max(window, 1.0))

    def remove_token_file(self, ticket_id: str) -> None:
        self.tokens.remove(ticket_id)

    def renew(self, ticket_id: str, seconds: float) -> Ticket:
        """Renew the ticket's lease (for the TTL it was granted with)."""
        found = self.mutex.ticket(ticket_id)
        if found is None:
            raise UnknownTicket(ticket_id)
        t, kv = found
        if kv is None:
            raise NotHeld(t.ticket_id, t.describe_end())
        if self.cluster.keepalive(kv["lease"]) <= 0:
            raise NotHeld(t.ticket_id, "lease expired")
        return t

    def release(self, ticket_id: str) -> Ticket:
        found = self.mutex.ticket(ticket_id)
        if found is None:
            raise UnknownTicket(ticket_id)
        t, kv = found
        if kv is None:
            if t.state in (RELEASED, CANCELLED):
                return t
            raise NotHeld(t.ticket_id, t.describe_end())
        final = RELEASED if t.state == HELD else CANCELLED
        self.mutex.end(t, kv["lease"], final, "released by owner")
        self.tokens.remove(t.ticket_id)
        if t.holder_host == os.uname().nodename:
            _poke_and_wait(t)
        return self.read(ticket_id) or t

    def end_orphan(self, t: Ticket) -> Ticket:
        self.end(t.ticket_id, EXPIRED if t.state == HELD else CANCELLED, "holder gone", only_if_held=False)
        self.tokens.remove(t.ticket_id)
        return self.read(t.ticket_id) or t

    def await_turn(self, ticket_id: str, wait_seconds: float) -> None:
        if self.cluster.get(self.mutex.q + ticket_id) is not None:
            self.mutex.wait_turn(ticket_id, time.monotonic() + wait_seconds)

    def view(self, t: Ticket) -> dict[str, Any]:
        position = token_file = None
        kv = self.cluster.get(self.mutex.q + t.ticket_id) if t.live else None
        if kv is not None:
            kvs, _ = self.mutex.queue()
            keys = [k["key"] for k in kvs]
            if kv["key"] in keys:
                i = keys.index(kv["key"])
                t.state = HELD if i == 0 else WAITING
                t.fence = kv["create_revision"] if i == 0 else None
                position = None if i == 0 else i
            left = self.cluster.ttl(kv["lease"])
            t.lease_expires_at = time.time() + left if left > 0 else t.lease_expires_at
            if t.state == HELD and self.tokens.exists(t.ticket_id):
                token_file = self.tokens.path(t.ticket_id)
        return t.public(activity=self.backend.read_activity(t.identity), queue_position=position, token_file=token_file)

    def status(self) -> dict[str, Any]:
        q, _ = self.mutex.queue()
        holder = self.view(parse_ticket(q[0]["value"])) if q else None
        if holder is not None:
            left = self.cluster.ttl(q[0]["lease"])
            holder["lease_left"] = float(left) if left > 0 else None
        return {
            "lock_name": self.lock,
            "repo": self.repo,
            "state": "held" if q else "free",
            "fence": q[0]["create_revision"] if q else None,
            "holder": holder,
            "waiters": [self.view(parse_ticket(kv["value"])) for kv in q[1:]],
        }


def _poke_and_wait(t: Ticket) -> None:
    """A holder on this host learns its ticket ended now, not at its next lease check."""
    import select
    import signal

    if t.holder_pid is None or not proc.alive(t.holder_pid, t.holder_start):
        return
    try:
        pidfd = os.pidfd_open(t.holder_pid)
    except OSError:
        return
    try:
        if proc.signal_exact(t.holder_pid, t.holder_start, signal.SIGUSR1):
            select.select([pidfd], [], [], _RELEASE_WAIT)
    finally:
        os.close(pidfd)


class EtcdBackend:
    def __init__(self, url: str, lock_dir: str) -> None:
        parse_url(url)
        self.url, self.lock_dir = url, lock_dir
        self.cluster = Cluster(url)

    def close(self) -> None:
        """Connections close with the process; nothing else is held."""

    def __enter__(self) -> EtcdBackend:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def lock(self, repo: str, lock: str, *, create: bool = True) -> EtcdLock:
        return EtcdLock(self, names.scope(repo), names.lock_name(lock))

    def read_activity(self, identity: str) -> str | None:
        kv = self.cluster.get(f"{self.cluster.root}activity/{identity}")
        if kv is None:
            return None
        with contextlib.suppress(ValueError, AttributeError):
            text = json.loads(kv["value"]).get("activity")
            return str(text) if text is not None else None
        return None

    def update_activity(self, identity: str, activity: str | None) -> None:
        key = f"{self.cluster.root}activity/{identity}"
        if activity is None:
            self.cluster.delete(key)
        else:
            self.cluster.put(key, json.dumps({"activity": activity, "at": time.time()}).encode())

    def status(self, repo: str, lock: str | None) -> list[dict[str, Any]]:
        prefix = f"{self.cluster.root}{repo}/@" + (f"{lock}/" if lock else "")
        kvs, _ = self.cluster.range_prefix(prefix)
        found = set()
        for kv in kvs:
            name, _, kind = kv["key"][len(f"{self.cluster.root}{repo}/@") :].partition("/")
            if kind.startswith("q/"):
                found.add(name)
        return [EtcdLock(self, repo, name).status() for name in sorted(found)]

    def verify(self, claim: Claim) -> Verdict:
        if not claim.ticket_id:
            from singleflight.core.errors import UsageError

            raise UsageError("on etcd, verify needs the ticket: PEARING_TICKET or a token file")
        try:
            ok, reason, fence = recipe.verify(
                self.cluster, claim.repo, claim.lock, claim.ticket_id, token_hash(claim.token)
            )
        except BackendUnavailable as exc:
            ok, reason, fence = False, str(exc), None
        if ok:
            return claim.live(fence)
        return claim.refuse(reason, fence=fence)

    @contextmanager
    def hold_off(self, claim: Claim, seconds: float) -> Iterator[Verdict]:
        if not claim.ticket_id:
            raise NotHeld("-", "unknown token: on etcd a guard needs the ticket id")
        held = recipe.hold_guard(self.cluster, claim.repo, claim.lock, claim.ticket_id, seconds)
        if held is None:
            raise NotHeld(claim.ticket_id, "unknown token or lease expired")
        try:
            verdict = self.verify(claim)
            if not verdict.ok:
                raise NotHeld(claim.ticket_id, verdict.reason)
            yield verdict
        finally:
            self.cluster.revoke(held[1])

    def accept_fence(self, resource: str, fence: int) -> int:
        return recipe.accept_fence(self.cluster, resource, fence)
