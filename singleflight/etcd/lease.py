"""The holder's lease on etcd: keepalive at TTL/3, and giving up early when cut off."""

from __future__ import annotations

import contextlib
import time
from typing import Any

from singleflight.core.const import RELEASED
from singleflight.core.errors import BackendUnavailable
from singleflight.core.ticket import RequestRecord, Ticket
from singleflight.core.tokens import TokenFiles
from singleflight.etcd.client import Cluster
from singleflight.etcd.lock import Mutex, ttl_of


class EtcdGrip:
    """The ticket's lease, first in line: what the wrapper hands its holder. No fd.

    Wrapper and holder both keep it alive, so a frozen holder cannot let it lapse into a
    second COMMAND; it is revoked by the holder, or by the wrapper once COMMAND is dead.
    """

    def __init__(self, cluster: Cluster, lease: int, kv: dict[str, Any], ttl: int) -> None:
        self.cluster, self.lease, self.kv = cluster, lease, kv
        self.keep_every: float | None = ttl / 3

    def fds(self) -> set[int]:
        return set()

    def keep(self) -> None:
        with contextlib.suppress(BackendUnavailable):
            self.cluster.keepalive(self.lease)

    def close(self) -> None:
        """The lease lives in the cluster; the holder revokes it when it hands over."""

    def release(self) -> None:
        self.cluster.revoke(self.lease)


class EtcdLease:
    """A held ticket's lease in the cluster, driven by the holder process."""

    def __init__(self, mutex: Mutex, lease: int, ticket: Ticket, tokens: TokenFiles, kill_grace: float) -> None:
        self.mutex, self.lease, self.ticket, self.tokens = mutex, lease, ticket, tokens
        self.ttl = ttl_of(ticket.lease_seconds)
        # The cluster expires the lease on its own clock, whatever we do. So we give up
        # early enough for COMMAND to be stopped (SIGTERM, then SIGKILL after the grace,
        # after at most one more request timeout) before the next holder can be promoted:
        # never two COMMANDs at once. Lease >= 3 x (grace + 1 s) keeps the whole grace.
        self.margin = min(kill_grace + 0.5 + mutex.cluster.timeout, self.ttl / 3)
        self.unreachable = False
        ticket.lease_deadline_mono = time.monotonic() + self.ttl - self.margin
        ticket.lease_expires_at = time.time() + self.ttl
        self.renew()

    def renew(self) -> None:
        sent = time.monotonic()
        try:
            ttl = self.mutex.cluster.keepalive(self.lease)
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
            left = self.mutex.cluster.ttl(self.lease)
            if left > 0 and sent + left - self.margin > time.monotonic():
                # A manual heartbeat (pearing-cli) extended it in the cluster.
                self.ticket.lease_deadline_mono = sent + left - self.margin
                return None
            if left > 0:
                return "lease about to expire"
            now = self.mutex.ticket(self.ticket.ticket_id)
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
            self.mutex.end(self.ticket, self.lease, state, reason, revoke=False)

    def keep(self) -> None:
        if not self.unreachable:
            with contextlib.suppress(BackendUnavailable):
                self.mutex.cluster.keepalive(self.lease)

    def prepare_request(self, window: float) -> None:
        """A cluster does not run out of disk under one run: nothing to prepare."""

    def record_request(self, status: int | None, window: float) -> None:
        with contextlib.suppress(BackendUnavailable):
            record = RequestRecord.finished(self.ticket, status, window)
            self.mutex.write_request(self.ticket.request_uuid, record, max(window, 1.0))

    def record_success(self) -> None:
        with contextlib.suppress(BackendUnavailable):
            self.mutex.write_last_success(self.ticket.acquired_at or time.time(), self.ticket.ticket_id)

    def remove_token_file(self) -> None:
        self.tokens.remove(self.ticket.ticket_id)

    def release(self) -> None:
        """Revoke the lease: the key goes and the next waiter is promoted."""
        self.mutex.cluster.revoke(self.lease)

    def housekeeping(self) -> None:
        """Ended tickets and request records expire on their own leases."""
