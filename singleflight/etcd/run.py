"""pearing-run on etcd: the same wrapper, with the lock and lease in the cluster.

The wrapper creates the ticket's key (on its lease) and waits its turn; the
forked holder keeps the lease alive (keepalive at TTL/3) and notices loss. The
token file stays local (0600, in the lock dir) and names the backend, so
``pearing-guard`` knows where to check it.
"""

from __future__ import annotations

import contextlib
import json
import os
import time
from typing import TYPE_CHECKING, Any

from singleflight import lease as local_lease
from singleflight.core.const import CANCELLED, ENV_BACKEND, EXPIRED, HELD, RELEASED
from singleflight.core.errors import BackendUnavailable, PearingError
from singleflight.etcd.client import Cluster
from singleflight.etcd.lock import EtcdLock, parse_ticket, ttl_of
from singleflight.runner import Runner, RunOptions
from singleflight.store import LockDir, LockStore

if TYPE_CHECKING:
    from singleflight.core.protocol import Channel
    from singleflight.core.ticket import Ticket
    from singleflight.holder import HolderConfig


class EtcdLease:
    """LeaseDriver for a ticket whose lock lives in etcd."""

    def __init__(self, elock: EtcdLock, lease: int, ticket: Ticket, tokens: LockStore, kill_grace: float) -> None:
        self.elock, self.lease, self.ticket, self.tokens = elock, lease, ticket, tokens
        self.ttl = ttl_of(ticket.lease_seconds)
        # The cluster expires the lease on its own clock, whatever we do. So we give up
        # early enough for COMMAND to be stopped (SIGTERM, then SIGKILL after the grace,
        # after at most one more request timeout) before the next holder can be promoted:
        # never two COMMANDs at once. Lease >= 3 x (grace + 1 s) keeps the whole grace.
        self.margin = min(kill_grace + 0.5 + elock.cluster.timeout, self.ttl / 3)
        self.unreachable = False
        ticket.lease_deadline_mono = time.monotonic() + self.ttl - self.margin
        ticket.lease_expires_at = time.time() + self.ttl
        self.renew()

    def renew(self) -> None:
        sent = time.monotonic()
        try:
            ttl = self.elock.cluster.keepalive(self.lease)
        except BackendUnavailable:
            self.unreachable = True
            return  # the deadline stays where the last keepalive put it
        self.unreachable = False
        # Counted from when we asked: etcd's clock started no earlier.
        self.ticket.lease_deadline_mono = sent + ttl - self.margin if ttl > 0 else 0.0

    def check(self) -> str | None:
        if self.unreachable:
            return "backend unreachable"  # no more requests: the grace is counting
        sent = time.monotonic()
        try:
            left = self.elock.cluster.ttl(self.lease)
            if left > 0 and sent + left - self.margin > time.monotonic():
                # A manual heartbeat (pearing-cli) extended it in the cluster.
                self.ticket.lease_deadline_mono = sent + left - self.margin
                return None
            if left > 0:
                return "lease about to expire"
            now = self.elock.ticket(self.ticket.ticket_id)
        except BackendUnavailable:
            self.unreachable = True
            return "backend unreachable"
        if now is not None and now[0].state == RELEASED:
            return RELEASED
        return "lease expired"

    def end(self, state: str, reason: str) -> None:
        if self.unreachable:
            return  # stopping COMMAND must not wait on a cluster we cannot reach
        with contextlib.suppress(BackendUnavailable):
            self.elock.end(self.ticket, self.lease, state, reason)

    def record_request(self, request_uuid: str, status: int | None, window: float) -> None:
        with contextlib.suppress(BackendUnavailable):
            _record_request(self.elock, request_uuid, self.ticket, status, window)

    def remove_token_file(self) -> None:
        self.tokens.remove_token_file(self.ticket.ticket_id)

    def release(self) -> None:
        """end() revoked the lease: the key is gone and the next waiter promoted."""

    def housekeeping(self) -> None:
        """Ended tickets and request records expire on their own leases."""


class EtcdRunner(Runner):
    def __init__(self, opts: RunOptions, url: str) -> None:
        super().__init__(opts)
        self.url = url
        self.lease_id = 0
        self.kv: dict[str, Any] = {}

    def _open(self) -> None:
        self.cluster = Cluster(self.url)
        self.elock = EtcdLock(self.cluster, self.o.repo, self.o.job)
        # Token files stay on this host, in the (local, 0700) lock dir.
        self.store = LockDir(self.o.lock_dir).lock_store(self.o.repo, self.o.job)

    def _claim_request(self, request_uuid: str) -> str:
        # The ticket's lease comes first: the claim lives exactly as long as this run.
        self.lease_id = self.cluster.grant(ttl_of(self.o.lease_seconds))
        while True:
            seen = self.cluster.get(self.elock.r + request_uuid)
            rec = json.loads(seen["value"]) if seen else None
            if rec is not None:
                if rec.get("state") == "succeeded" and float(rec.get("expires_at") or 0) > time.time():
                    self.cluster.revoke(self.lease_id)
                    return "done"
                if rec.get("state") == "active":  # on a live lease, or it would be gone
                    self.cluster.revoke(self.lease_id)
                    return "busy"
            claim = {"state": "active", "ticket_id": self.ticket.ticket_id, "created_at": time.time(), "previous": rec}
            if self.elock.claim_request(request_uuid, claim, self.lease_id, seen):
                self.request_claimed = True
                return "run"
            # Someone changed the record between our read and write: look again.

    def _unclaim_request(self) -> None:
        uuid = self.o.request_uuid
        if not (self.request_claimed and uuid):
            return
        with contextlib.suppress(BackendUnavailable):
            rec = self.elock.read_request(uuid)
            if rec and rec.get("ticket_id") == self.ticket.ticket_id:
                previous = rec.get("previous")
                if isinstance(previous, dict):
                    self.elock.write_request(uuid, previous, self.o.dedupe_window)
                else:
                    self.cluster.delete(self.elock.r + uuid)
        self.request_claimed = False

    def _acquire(self) -> int | None:
        o, t = self.o, self.ticket
        self.token = local_lease.mint_token()
        t.token_hash = local_lease.token_hash(self.token)
        self.lease_id, _ = self.elock.enqueue(t, self.lease_id)
        kvs, _ = self.elock.queue()
        first = bool(kvs) and kvs[0]["key"] == self.elock.q + t.ticket_id
        # First in line, once the previous holder's guarded side effects have landed.
        if first and self.elock.wait_guards(time.monotonic() + o.wait_seconds):
            self.kv = kvs[0]
            return self.lease_id
        if o.wait_seconds <= 0:
            self.cluster.revoke(self.lease_id)
            self.log.event("busy", lock=o.job, repo=o.repo)
            return None
        started = time.monotonic()
        deadline = started + o.wait_seconds
        self.log.event("waiting", lock=o.job, max_wait=f"{o.wait_seconds:g}s")
        got = None
        while got is None and time.monotonic() < deadline:
            # Keep our place: the waiting key's lease is renewed between watches.
            step = min(deadline, time.monotonic() + ttl_of(o.lease_seconds) / 3)
            got = self.elock.wait_turn(t.ticket_id, step)
            if got is None and self.cluster.keepalive(self.lease_id) <= 0:
                break
        self.waited = time.monotonic() - started
        if got is None:
            with contextlib.suppress(BackendUnavailable):
                self.elock.end(t, self.lease_id, CANCELLED, "wait timed out")
            self.log.event("wait-timeout", lock=o.job, waited=f"{self.waited:.3f}s")
            return None
        t.promoted = True
        self.kv = got
        return self.lease_id

    def _drop_grip(self, grip: int) -> None:
        """The lease lives in the cluster; the holder keeps it alive from here."""

    def _grip_fds(self, grip: int) -> set[int]:
        return set()  # the grip is a lease id, not an fd

    def _serve(self, grip: int, cfg: HolderConfig, chan: Channel) -> int:
        from singleflight.holder import Holder

        try:
            # Fresh connections (the parent's are not ours), and a request timeout short
            # enough that a dead member cannot hold the holder past its deadline.
            cluster = Cluster(self.url, timeout=max(0.2, min(1.0, ttl_of(self.o.lease_seconds) / 10)))
            elock = EtcdLock(cluster, self.o.repo, self.o.job)
            store = LockDir(self.o.lock_dir, create=False).lock_store(self.o.repo, self.o.job, create=False)
            # The wrapper saw our key first in line (with the previous holder's guards gone).
            kv = self.kv
            t = parse_ticket(kv["value"])
            t.state, t.fence = HELD, kv["create_revision"]
            t.holder_pid = os.getpid()
            t.acquired_at = time.time()
            self.ticket.fence = t.fence
            driver = EtcdLease(elock, grip, t, store, self.o.kill_grace)
            # Remember the newest fence, so an older token can be told it was superseded.
            cluster.put(elock.base + "last", str(t.fence).encode())
            # The token file names the backend, so pearing-guard checks the cluster.
            token_file = store.write_token_file(t, self.token, backend=self.url, lease=str(grip), key=kv["key"])
            # PEARING_BACKEND too: COMMAND's pearing-cli heartbeats and guards must reach the cluster.
            env = {"ETCD_LOCK_KEY": kv["key"], "ETCD_LOCK_REV": str(kv["create_revision"]), ENV_BACKEND: self.url}
            chan.send(
                "ready " + json.dumps({"fence": t.fence, "token": self.token, "token_file": token_file, "env": env})
            )
            Holder(driver, cfg, chan).serve()
        except PearingError as exc:
            chan.send(f"error {int(exc.exit_code)} {exc}")
            return int(exc.exit_code)
        except Exception as exc:  # noqa: BLE001 - the holder must report, never vanish silently
            chan.send(f"error 70 internal error in holder (a bug): {exc!r}")
            return 70
        return 0

    def _end_after_holder_death(self) -> None:
        with contextlib.suppress(PearingError):
            self.elock.end(self.ticket, self.lease_id, EXPIRED, "holder gone")
            self.store.remove_token_file(self.ticket.ticket_id)

    def _release_without_holder(self, status: int) -> None:
        with contextlib.suppress(PearingError):
            if self.o.request_uuid:
                _record_request(self.elock, self.o.request_uuid, self.ticket, status, self.o.dedupe_window)
            self.elock.end(self.ticket, self.lease_id, RELEASED, f"command exited {status}")
            self.store.remove_token_file(self.ticket.ticket_id)

    def _clean_up_after_holder(self) -> None:
        self.cluster.revoke(self.lease_id)
        with contextlib.suppress(PearingError):
            self.store.remove_token_file(self.ticket.ticket_id)


def _record_request(elock: EtcdLock, request_uuid: str, t: Ticket, status: int | None, window: float) -> None:
    """How a request ended; a success is remembered for ``window`` (the record's lease)."""
    now = time.time()
    record = {
        "state": "succeeded" if status == 0 else "failed",
        "ticket_id": t.ticket_id,
        "fence": t.fence,
        "status": status,
        "finished_at": now,
        "expires_at": now + window,
    }
    elock.write_request(request_uuid, record, max(window, 1.0))
