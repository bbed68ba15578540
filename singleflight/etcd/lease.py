"""The holder's lease on etcd: the ticket's deadline on its own clock, the etcd lease kept
alive at TTL/3, and giving up early when cut off from the cluster.

Two clocks, two jobs. The ticket's lease (``--lease-seconds`` since the last renewal or
heartbeat) is recorded in its key's value and enforced here by the holder's own clock,
exactly as the lock dir does with its ticket record: a heartbeat within every lease
period is enough, whatever the etcd lease's TTL. The etcd lease only proves the holder
(and its wrapper) alive: both keep it alive every TTL/3, whatever the heartbeat mode.
"""

from __future__ import annotations

import contextlib
import select
import time

from singleflight.core import fault
from singleflight.core.const import ENDED_TICKET_RETENTION, TYPE_CHECKING
from singleflight.core.errors import BackendUnavailable
from singleflight.core.reasons import EndReason, Loss
from singleflight.core.ticket import Ticket, hold_gone, unreachable_loss
from singleflight.core.tokens import TokenFiles
from singleflight.etcd import ending
from singleflight.etcd.client import Cluster, Refused, cmp, op_delete, op_put, revision
from singleflight.etcd.lock import Mutex, ttl_of
from singleflight.etcd.records import deadline_mono, parse, refresh_copy, stamp_lease, value
from singleflight.etcd.tickets import ticket_of
from singleflight.etcd.watch import KeyWatch

if TYPE_CHECKING:
    from collections.abc import Callable
    from typing import Any

# A holder that could not reach the cluster asks again this often, until its cut-off.
_RETRY = 0.25
# The holder settles (its lease, pid, deadline into the key) this long after COMMAND started:
# a write at once would delay the release of a short COMMAND by one more fsync, and until then
# the key is first in line, kept alive with its waiting lease by both wrapper and holder.
_SETTLE_AFTER = 0.1
# How long after the hand-over the old holder cleans up (see ``housekeeping``).
_HOUSEKEEPING_AFTER = 0.2


def margin_for(ttl: int, kill_grace: float, request_timeout: float) -> float:
    """How long before the etcd lease can expire a holder cut off from the cluster gives up.

    The cluster expires the lease on its own clock, whatever we do. So we give up early
    enough for COMMAND to be stopped (SIGTERM, then SIGKILL after the grace, after at most
    one more request timeout) before the next holder can be promoted: never two COMMANDs
    at once. Lease >= 3 x (grace + 1.5 s) keeps the whole grace.
    """
    return min(kill_grace + 0.5 + request_timeout, ttl / 3)


class EtcdLease:
    """A held ticket in the cluster, driven by the holder process.

    ``ticket.lease_deadline_mono`` is when the holder must look next: the ticket's own
    deadline, the next keepalive (TTL/3 after the last), or the cut-off (the last
    keepalive + TTL - margin), whichever comes first; and soon after taking it, to settle:
    the key moves onto the holder's lease with the holder's pid and deadline. COMMAND starts
    before that: the key was first in line and its token's hash in it.
    """

    def __init__(
        self,
        mutex: Mutex,
        lease: int,
        kv: dict[str, Any],
        ticket: Ticket,
        tokens: TokenFiles,
        *,
        margin: float,
        kept_at: float,
        waiting_lease: int = 0,
        keep_lease: int = 0,
    ) -> None:
        self.mutex, self.lease, self.ticket, self.tokens = mutex, lease, ticket, tokens
        self.waiting_lease, self.keep_lease = waiting_lease, keep_lease
        self.key, self.fence, self.mod = str(kv["key"]), int(kv["create_revision"]), int(kv["mod_revision"])
        self.ttl = ttl_of(ticket.lease_seconds)
        self.margin = margin
        self.kept_at = kept_at
        self.deadline = ticket.lease_deadline_mono or time.monotonic()  # the ticket's own
        self.unreachable = False
        self.lapsed = False
        self.key_gone = False
        self.settled = False
        self.settle_at = time.monotonic() + _SETTLE_AFTER
        self.ended: bytes | None = None
        # Opted in to cancel-in-progress: a newer run's request arrives as a put on our key.
        self.watch: KeyWatch | None = None
        self._schedule()

    @property
    def cluster(self) -> Cluster:
        return self.mutex.cluster

    def _cut_off(self) -> float:
        return self.kept_at + self.ttl - self.margin

    def _schedule(self) -> None:
        cut_off = self._cut_off()
        # Unreachable: ask again soon. Else: the next keepalive, a third of the TTL after the last.
        look = min(cut_off, time.monotonic() + _RETRY) if self.unreachable else self.kept_at + self.ttl / 3
        if not self.settled:
            look = min(look, self.settle_at)
        self.ticket.lease_deadline_mono = min(self.deadline, cut_off, look)

    def _body(self) -> bytes:
        """The ticket as recorded: its own deadline, not our next look."""
        look = self.ticket.lease_deadline_mono
        self.ticket.lease_deadline_mono = self.deadline
        try:
            return value(self.ticket, self.lease, margin=self.margin)
        finally:
            self.ticket.lease_deadline_mono = look

    def _keepalive(self) -> None:
        sent = time.monotonic()
        try:
            ttl = self.cluster.keepalive(self.lease)
            if self.waiting_lease and not self.settled:
                self.cluster.keepalive(self.waiting_lease)
        except BackendUnavailable:
            self.unreachable = True
            return  # the cut-off stays where the last keepalive put it
        self.unreachable = False
        if ttl <= 0:
            # Revoked by pearing-cli release-lock-ticket, or expired by the cluster (holder
            # and wrapper frozen together past the TTL): the next check tells which.
            self.lapsed = True
            self.ticket.lease_deadline_mono = sent
            return
        # Counted from when we asked: etcd's clock started no earlier.
        self.kept_at = sent

    def renew(self) -> None:
        """Auto heartbeat: the ticket's deadline moves on (recorded, for guards), and a keepalive."""
        stamp_lease(self.ticket, self.ticket.lease_seconds)
        self.deadline = self.ticket.lease_deadline_mono or time.monotonic()
        self._keepalive()
        if self.lapsed:
            return  # looked at now, by the check it scheduled
        if not self.unreachable and self.settled:
            with contextlib.suppress(BackendUnavailable):
                self._record()
        self._schedule()

    def _record(self, *, copy: bool = False) -> bool:
        """Write the ticket (its deadline) into our key, on the holder's lease: compare-and-swap,
        never over an end or a release. False when it was ended or released meanwhile. ``copy``:
        settling, its copy goes onto the end record's lease too."""
        for _ in range(3):
            ops = [op_put(self.key, self._body(), self.lease)]
            if not self.settled:
                ops.append(op_put(self.mutex.base + "last", str(self.fence).encode()))
            if copy:
                ops.append(op_put(self.mutex.t + self.ticket.ticket_id, self._body(), self.keep_lease))
            elif self.settled:
                ops.append(refresh_copy(self.mutex.t + self.ticket.ticket_id, self._body()))
            try:
                r = self.cluster.txn([cmp(self.key, "MOD", "EQUAL", self.mod)], ops, [])
            except Refused:
                return False  # our lease is gone
            if r.get("succeeded"):
                self.mod = revision(r)
                return True
            kv = self.cluster.get(self.key)
            t = parse(kv["value"]) if kv is not None else None
            if kv is None or t is None or not t.live or kv["create_revision"] != self.fence:
                return False  # the next check says why
            # A heartbeat (pearing-cli) came in between: it stands, shorter or longer (SPEC: the
            # lease now runs N seconds), never our own deadline written over it; nor is a cancel
            # request dropped (``check`` acts on it). The lock dir's renewal does the same.
            self.mod = kv["mod_revision"]
            self.ticket.superseded_by = self.ticket.superseded_by or t.superseded_by
            due = deadline_mono(t)
            if due is not None:
                self.deadline = due
                self.ticket.lease_expires_at, self.ticket.lease_seconds = t.lease_expires_at, t.lease_seconds
        return False

    def settle(self) -> None:
        """Soon after COMMAND started: the key moves onto the holder's lease (a put keeps its
        create revision: the fence), with the holder's pid and deadline; the newest fence is
        remembered, so an older token can be told it was superseded; and a copy of the ticket
        goes onto an hour's lease (the end record's), so a run whose every process died, its key
        lapsed, reads "expired" for that hour, not "unknown" (our own end takes the copy away)."""
        fault.pause("pause-etcd-settle")
        if not self.keep_lease:
            with contextlib.suppress(BackendUnavailable, Refused):
                self.keep_lease = self.cluster.grant(int(ENDED_TICKET_RETENTION))
        settled = self._record(copy=bool(self.keep_lease))
        if not settled and self.keep_lease:
            # The copy's lease, granted as we joined the line, may have run out in an hour's wait:
            # settled without the copy, and the end record goes on our lease (housekeeping moves it).
            self.keep_lease = 0
            settled = self._record()
        if settled:
            self.settled = True  # the waiting lease, now empty, lapses within seconds
            self._watch()
        else:
            self.lapsed = True  # ended, released or lapsed before we could: the check says which

    def _watch(self) -> None:
        """An opted-in holder watches its key from the last revision it has seen of it, so a
        cancel request from any host reaches it in moments, not at its next look."""
        if not self.ticket.cancel_in_progress:
            return
        try:
            if self.watch is not None and self.watch.stream is not None:
                self.watch.follow(self.cluster.current)  # the member that answered our last request
            else:
                self.watch = KeyWatch(self.cluster, self.key, self.mod)
                self.watch.start()
        except BackendUnavailable:
            self.watch = None  # the next check tries again

    def wake_fd(self) -> int | None:
        return self.watch.fileno() if self.watch is not None and self.watch.stream is not None else None

    def _drain(self) -> None:
        """Take in what the watch has (the holder polls its fd); ``check`` reads the key anyway."""
        w = self.watch
        if w is not None and w.stream is not None and select.select([w], [], [], 0)[0]:
            try:
                w.poll()
            except BackendUnavailable:
                w.close()

    def check(self) -> Loss | None:
        now = time.monotonic()
        kv = None
        self._drain()
        try:
            if self.unreachable or now >= self.kept_at + self.ttl / 3:
                self._keepalive()
            if not self.settled and not self.unreachable and not self.lapsed and now >= self.settle_at:
                self.settle()
            if not self.unreachable and not self.lapsed:
                kv = self.cluster.get(self.key)
        except BackendUnavailable:
            self.unreachable = True
        if self.unreachable:
            loss = unreachable_loss(now, self.deadline, self._cut_off(), self.kept_at + self.ttl)
            if loss is None:
                self._schedule()
            return loss
        if kv is None or kv["create_revision"] != self.fence:
            found = None
            with contextlib.suppress(BackendUnavailable):
                found = ticket_of(self.mutex, self.ticket.ticket_id)
            return hold_gone(found[0] if found is not None else None)
        t = parse(kv["value"])
        if t is None:
            return Loss(EndReason.VANISHED)
        loss = t.loss()
        if loss is not None:
            self.ticket.superseded_by = t.superseded_by or self.ticket.superseded_by
            return loss
        self.mod = kv["mod_revision"]
        # A heartbeat (pearing-cli, from COMMAND) may have moved it, and with it the lease length.
        due = deadline_mono(t)
        self.deadline = due if due is not None else self.deadline
        self.ticket.lease_expires_at, self.ticket.lease_seconds = t.lease_expires_at, t.lease_seconds
        if self.settled:
            self._watch()
        self._schedule()
        return None

    end = ending.end  # the token dies, after the guarded commands of its ticket

    def keep(self) -> None:
        if not self.unreachable:
            with contextlib.suppress(BackendUnavailable, Refused):
                self.cluster.keepalive(self.lease)
                if self.waiting_lease and not self.settled:
                    self.cluster.keepalive(self.waiting_lease)

    def release(self, announce: Callable[[], None]) -> None:
        """Our key goes: the next waiter is promoted now. (Unreachable: its lease lapses.)"""
        if self.watch is not None:
            self.watch.close()
        if not self.key_gone:
            with contextlib.suppress(BackendUnavailable, Refused):
                self.cluster.txn([cmp(self.key, "CREATE", "EQUAL", self.fence)], [op_delete(self.key)], [])
        announce()
        self._housekeeping()

    def _housekeeping(self) -> None:
        """After the hand-over: our lease goes (one write, as etcdctl's session revoke), the end
        record onto an hour's lease first if it has none yet (a run that did not wait). The
        waiting lease, empty by now, lapses by itself.

        A moment later, not at once: the next holder's first read would wait behind this
        write's fsync (etcd's one raft loop serves both). The wrapper has exited already."""
        time.sleep(_HOUSEKEEPING_AFTER)
        with contextlib.suppress(BackendUnavailable, Refused):
            if self.ended is not None and not self.keep_lease:
                keep = self.cluster.grant(int(ENDED_TICKET_RETENTION))
                self.cluster.put(self.mutex.e + self.ticket.ticket_id, self.ended, keep)
            self.cluster.revoke(self.lease)
