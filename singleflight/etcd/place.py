"""One arrival at a lock in the cluster: the lock at once, or a key at the end of its line."""

from __future__ import annotations

import math
import time

from singleflight.core.const import ENDED_TICKET_RETENTION, QUEUE_LATEST, TYPE_CHECKING
from singleflight.core.errors import LineFull
from singleflight.core.ticket import Ticket
from singleflight.etcd import events
from singleflight.etcd.client import Cluster
from singleflight.etcd.grip import EtcdGrip
from singleflight.etcd.lock import FIRST, WAIT_TTL, Mutex, ttl_of

if TYPE_CHECKING:
    from collections.abc import Callable
    from typing import Any, Protocol
else:
    Protocol = object  # the checker's Protocols are plain classes at run time


class _Lock(Protocol):
    """What an arrival needs of its lock (``backend.EtcdLock``), named here so this module
    does not import the backend that imports it."""

    cluster: Cluster
    mutex: Mutex

    def kept_at(self, ticket_id: str) -> float: ...

    def token_of(self, ticket_id: str) -> str: ...

    def keep_hold(self, ticket: Ticket) -> bool: ...


class EtcdPlace:
    """One arrival: the lock at once (``grip``), or a key at the end of the line on a waiting lease."""

    def __init__(
        self, lk: _Lock, ticket: Ticket, lease: int, grip: EtcdGrip | None, kv: dict[str, Any] | None = None
    ) -> None:
        self.lk, self.ticket, self.lease, self.grip = lk, ticket, lease, grip
        self.kv = kv  # our key, once in line (a CLI ticket's agent finds it there already)
        self.waiting_lease = 0
        self.waiting_kept = 0.0  # when a keepalive of the waiting lease that succeeded was sent
        self.keep_lease = 0
        self.gone = False

    def queue(self, deadline: Callable[[], float]) -> int:
        mutex = self.lk.mutex
        # A key of ours on a short lease: a waiter killed with -9 leaves the line within seconds.
        self.waiting_kept = time.monotonic()
        self.waiting_lease = self.lk.cluster.grant(WAIT_TTL)
        if self.ticket.queue_mode == QUEUE_LATEST:
            kv, ahead = events.join_latest(mutex, self.ticket, self.waiting_lease, self.lease, self.kv)
            self.gone = kv is None  # superseded or cancelled before we got here
            self.kv = kv or self.kv
        elif self.kv is None:
            self.kv, ahead = mutex.join(self.ticket, self.waiting_lease)
        else:
            kv, ahead = mutex.rehome(self.kv, self.waiting_lease)
            self.gone = kv is None  # cancelled (release-lock-ticket) before we got here
            self.kv = kv or self.kv
        self._admit(ahead)
        # Granted now, while there is time: the end record goes straight onto it at the release,
        # and no grant-and-put lands on the cluster during the next hand-over.
        self.keep_lease = self.lk.cluster.grant(int(ENDED_TICKET_RETENTION))
        return max(1, ahead - self.ticket.slots + 1)  # the first N hold: a place behind them

    def _admit(self, ahead: int) -> None:
        """``--max-waiting``, joined first and counted after: ``ahead`` is what the join's own
        transaction saw before our key (the first of them holds). A later arrival always
        counts us, so of two at the bound the later one leaves (``acquire`` ends its ticket,
        whose key goes with it). A ``latest`` arrival that took an older one's key added no
        waiter. With ``--slots N`` the first N hold."""
        bound = self.ticket.max_waiting
        if bound is None or self.gone or self.kv is None or self.kv["key"] != self.lk.mutex.q + self.ticket.ticket_id:
            return
        n = self.ticket.slots  # the first N keys hold: only those behind them wait
        waiting = max(0, ahead - n)
        if waiting >= bound and ahead >= n:
            raise LineFull(waiting, bound)

    def wait(self, deadline: Callable[[], float]) -> EtcdGrip | None:
        if self.gone or self.kv is None:
            return None

        end = math.inf

        def until() -> float:
            nonlocal end
            end = deadline()  # a cluster read: asked when the wait starts and every tick, not at the hand-over
            return end

        mutex, kv = self.lk.mutex, self.kv
        latest = self.ticket.queue_mode == QUEUE_LATEST
        outcome, mine = mutex.wait_first(
            kv["key"],
            kv["create_revision"],
            until,
            self._tick,
            ticket_id=self.ticket.ticket_id,
            watch_mine=latest,
            slots=self.ticket.slots,
        )
        if outcome != FIRST or mine is None:
            return None
        # A waiter frozen (^Z) past its own deadline and resumed never takes the lock. (A
        # cancelled ticket is caught by the read that found it first: its key is ended.)
        if time.monotonic() >= end:
            return None
        tid = self.ticket.ticket_id
        self.grip = EtcdGrip(
            self.lk.cluster,
            self.lease,
            mine,
            ttl_of(self.ticket.lease_seconds),
            kept_at=self.lk.kept_at(tid),
            token=self.lk.token_of(tid),
            waiting_lease=self.waiting_lease,
            waiting_kept_at=self.waiting_kept,
            keep_lease=self.keep_lease,
        )
        return self.grip

    def _tick(self) -> bool:
        """Every second while waiting: keep our place and the holder's lease. A waiter frozen
        (^Z) renews neither: its key leaves the line within WAIT_TTL, and once resumed it never
        takes the lock after its own deadline (``wait``)."""
        sent = time.monotonic()
        if self.lk.cluster.keepalive(self.waiting_lease) <= 0:
            return False
        self.waiting_kept = sent
        return self.lk.keep_hold(self.ticket)

    def leave(self) -> None:
        if self.grip is None:
            for lease in (self.waiting_lease, self.lease, self.keep_lease):
                if lease:
                    self.lk.cluster.revoke(lease)
