"""The holder's lease in the database: kept with one UPDATE every third of the TTL, on the
database's clock (``held_until``), and judged lost on the holder's own monotonic clock, counted
from before the keep was sent: cut off for longer than the lease less a margin, COMMAND is
stopped before the row can lapse and the next waiter be promoted.

The ticket's own deadline (``--lease-seconds`` since the last renewal or heartbeat) is in its
body and enforced here on the holder's clock, as on the other stores.
"""

from __future__ import annotations

import contextlib
import time

from singleflight.core import proc
from singleflight.core.const import RELEASED, TYPE_CHECKING
from singleflight.core.errors import BackendUnavailable
from singleflight.core.reasons import Loss
from singleflight.core.ticket import Ticket, hold_gone, unreachable_loss
from singleflight.postgres import records
from singleflight.postgres.db import Db
from singleflight.postgres.line import body_of, channel, ticket_channel, to_ticket
from singleflight.postgres.place import KEEP_SQL, PgGrip

if TYPE_CHECKING:
    from collections.abc import Callable
    from typing import Any

# A holder that could not reach the server asks again this often, until its cut-off.
_RETRY = 0.25
# How often ``end`` looks again for guarded commands of its ticket, and how many rounds.
_GUARD_POLL = 0.05
_END_ROUNDS = 200


class PgLease:
    def __init__(
        self, lk: Any, db: Db, grip: PgGrip, ticket: Ticket, *, margin: float, ver: int | None, reached: bool
    ) -> None:
        self.lk, self.db, self.grip, self.ticket = lk, db, grip, ticket
        self.ttl, self.margin, self.kept_at = grip.ttl, margin, grip.kept_at
        self.fence = grip.fence
        self.deadline = ticket.lease_deadline_mono or time.monotonic()
        # ``take`` recorded us and kept the lease in one statement (the version it wrote), found
        # the row lost already (the first check says why), or could not reach the server.
        self.unreachable = not reached
        self.ver = ver
        self.lapsed = reached and ver is None
        self.gone = False
        # The end ``end`` could not write (past the cut-off, or the server out of reach):
        # ``release`` writes it with the row's release, once COMMAND is dead.
        self.unwritten: tuple[str, str] | None = None
        self._listen: Db | None = None
        db.not_after = self._cut_off  # never blocked in a request past it
        self._schedule()

    def _cut_off(self) -> float:
        return self.kept_at + self.ttl - self.margin

    def _schedule(self) -> None:
        cut_off = self._cut_off()
        look = min(cut_off, time.monotonic() + _RETRY) if self.unreachable else self.kept_at + self.ttl / 3
        self.ticket.lease_deadline_mono = min(self.deadline, cut_off, look)

    def _body(self) -> str:
        look = self.ticket.lease_deadline_mono
        self.ticket.lease_deadline_mono = self.deadline
        try:
            return body_of(self.ticket)
        finally:
            self.ticket.lease_deadline_mono = look

    def _keep(self) -> None:
        sent = time.monotonic()
        try:
            rows = self.db.q(KEEP_SQL, (self.ttl, self.ticket.ticket_id))
        except BackendUnavailable:
            self.unreachable = True
            return  # the cut-off stays where the last keep put it
        self.unreachable = False
        if not rows:
            self.lapsed = True
            self.ticket.lease_deadline_mono = sent
            return
        self.kept_at = sent

    def _record(self) -> bool:
        """Write the ticket into our row by compare-and-set on the version we last saw: never
        over an end, a release or a heartbeat we have not seen (that one stands)."""
        with contextlib.suppress(BackendUnavailable):
            for _ in range(3):
                with self.db.tx() as cur:
                    sql = "SELECT body, ver, line AND hold AND fence = %s FROM {s}.tickets WHERE id = %s FOR UPDATE"
                    row = self.db.one(cur, sql, (self.fence, self.ticket.ticket_id))
                    if row is None or not row[2]:
                        return False
                    t = to_ticket(self.ticket.ticket_id, row[0])
                    if not t.live:
                        return False
                    if self.ver is not None and row[1] != self.ver:
                        self._follow(t, row[1])
                        continue
                    self.ticket.superseded_by = t.superseded_by
                    self.db.ex(
                        cur,
                        "UPDATE {s}.tickets SET body = %s, ver = ver + 1 WHERE id = %s RETURNING ver",
                        (self._body(), self.ticket.ticket_id),
                    )
                    self.ver = row[1] + 1
                    return True
        return False

    def _follow(self, t: Ticket, ver: int) -> None:
        """Another write (a heartbeat, a cancel request) came in: it stands."""
        self.ver = ver
        self.ticket.superseded_by = self.ticket.superseded_by or t.superseded_by
        due = t.deadline_here()
        if due is not None:
            self.deadline = due
            self.ticket.lease_expires_at, self.ticket.lease_seconds = t.lease_expires_at, t.lease_seconds

    def renew(self) -> None:
        self.ticket.set_lease(self.ticket.lease_seconds)
        self.ticket.boot_id = proc.boot_id()
        self.deadline = self.ticket.lease_deadline_mono or time.monotonic()
        self._keep()
        if self.lapsed:
            return
        if not self.unreachable:
            self._record()
        self._schedule()

    def check(self) -> Loss | None:
        now = time.monotonic()
        self._drain()
        row = None
        try:
            if self.unreachable or now >= self.kept_at + self.ttl / 3:
                self._keep()
            if not self.unreachable and not self.lapsed:
                row = self.db.q(
                    "SELECT body, ver, line AND hold AND fence = %s FROM {s}.tickets WHERE id = %s",
                    (self.fence, self.ticket.ticket_id),
                )
        except BackendUnavailable:
            self.unreachable = True
        if self.unreachable:
            loss = unreachable_loss(now, self.deadline, self._cut_off(), self.kept_at + self.ttl)
            if loss is None:
                self._schedule()
            return loss
        if not row or not row[0][2]:  # our row no longer in line, holding, with our fence
            return hold_gone(to_ticket(self.ticket.ticket_id, row[0][0]) if row else None)
        t = to_ticket(self.ticket.ticket_id, row[0][0])
        loss = t.loss()
        if loss is not None:
            self.ticket.superseded_by = t.superseded_by or self.ticket.superseded_by
            return loss
        self.ver = row[0][1]
        due = t.deadline_here()
        self.deadline = due if due is not None else self.deadline
        self.ticket.lease_expires_at, self.ticket.lease_seconds = t.lease_expires_at, t.lease_seconds
        self._schedule()
        return None

    # -- a cancel request, by NOTIFY on the holder's own channel -------------------------------

    def wake_fd(self) -> int | None:
        if not self.ticket.cancel_in_progress or not self.db.url.listen:
            return None
        if self._listen is None:
            listener = Db(self.lk.backend.url, timeout=self.db.timeout)
            try:
                listener.q(f'LISTEN "{ticket_channel(self.db, self.ticket.ticket_id)}"')
            except BackendUnavailable:
                listener.close()
                return None
            self._listen = listener
        return self._listen.conn().fileno()

    def _drain(self) -> None:
        if self._listen is not None:
            try:
                while self._listen.notified(0):
                    pass
            except BackendUnavailable:
                self._listen.close()
                self._listen = None

    # -- the end --------------------------------------------------------------------------------

    def end(
        self, state: str, reason: str | Callable[[Ticket], str | None], keep: Callable[[], None] | None = None
    ) -> bool:
        """The token dies once the guarded commands of its ticket have ended. Released: the row
        leaves the line in the same step (the next waiter is woken); else it stays, ended, until
        ``release``: the lock is ours while COMMAND is being stopped."""
        if not isinstance(reason, str):
            return end_judged(self, state, reason, keep)
        self.unwritten = (state, reason)
        if self.unreachable or not await_guards(self):
            return False
        with contextlib.suppress(BackendUnavailable), self.db.tx() as cur:
            row = self.db.one(
                cur,
                "SELECT body FROM {s}.tickets WHERE id = %s AND line AND fence = %s FOR UPDATE",
                (self.ticket.ticket_id, self.fence),
            )
            if row is None or not to_ticket(self.ticket.ticket_id, row[0]).live:
                self.unwritten = None
                return False  # gone, or ended by its owner: that end stands
            self.unwritten = None
            self.ticket.end(state, reason)
            leave = state == RELEASED
            self.db.ex(
                cur,
                """UPDATE {s}.tickets SET body = %s, ver = ver + 1, ended_at = clock_timestamp(),
                   line = line AND NOT %s, hold = hold AND NOT %s WHERE id = %s""",
                (self._body(), leave, leave, self.ticket.ticket_id),
            )
            if leave:
                self.gone = True
                self.db.ex(cur, "SELECT pg_notify(%s, '')", (channel(self.db, self.lk.repo, self.lk.lock),))
            return True
        return False

    def keep(self) -> None:
        if not self.unreachable:
            with contextlib.suppress(BackendUnavailable):
                self.db.q(KEEP_SQL, (self.ttl, self.ticket.ticket_id))

    def release(self, announce: Callable[[], None]) -> None:
        """Our row leaves the line, ended (as ``end`` would have, if it could not): the next
        waiter is woken now. (Unreachable: it lapses.)"""
        if self._listen is not None:
            self._listen.close()
        # COMMAND is dead: a request still blocked past the cut-off can no longer let two run at
        # once, so this one is sent past it too, bounded by the request timeout. Else a holder
        # that gave up (or took its grace to stop COMMAND) left the row taken until the server's
        # lease ran out, which the wrapper kept alive until it exited: the next run found it busy.
        # (The lock dir drops its flock, etcd deletes its key, whenever they lose.)
        self.db.not_after = None
        if not self.gone:
            with contextlib.suppress(BackendUnavailable), self.db.tx() as cur:
                row = self.db.one(
                    cur,
                    "SELECT body FROM {s}.tickets WHERE id = %s AND line AND fence = %s FOR UPDATE",
                    (self.ticket.ticket_id, self.fence),
                )
                body = None  # as stored: ended by ``end``, or by its owner
                if row is not None and self.unwritten is not None and to_ticket(self.ticket.ticket_id, row[0]).live:
                    self.ticket.end(*self.unwritten)
                    body = self._body()
                rows = self.db.ex(
                    cur,
                    """UPDATE {s}.tickets SET line = false, hold = false, ver = ver + 1,
                       body = COALESCE(%s::jsonb, body), ended_at = COALESCE(ended_at, clock_timestamp())
                       WHERE id = %s AND line AND fence = %s RETURNING 1""",
                    (body, self.ticket.ticket_id, self.fence),
                )
                if rows:
                    self.db.ex(cur, "SELECT pg_notify(%s, '')", (channel(self.db, self.lk.repo, self.lk.lock),))
        announce()
        housekeeping(self.db, self.lk.repo, self.lk.lock)


def await_guards(lease: PgLease, keep: Callable[[], None] | None = None) -> bool:
    """Until no guarded command of the lease's ticket is in flight, the lease kept meanwhile (by
    ``keep`` when given). False: lost, or the server out of reach until the cut-off."""
    for _ in range(_END_ROUNDS * 100):
        try:
            rows = lease.db.q(
                "SELECT 1 FROM {s}.guards WHERE ticket_id = %s AND until > clock_timestamp()",
                (lease.ticket.ticket_id,),
            )
        except BackendUnavailable:
            return False
        if not rows:
            return True
        if time.monotonic() >= lease._cut_off() or lease.lapsed:
            return False
        if time.monotonic() >= lease.kept_at + lease.ttl / 3 and keep is not None:
            keep()  # the holder's (a renewal keeps the lease too; ``PgLease.keep`` does not say so)
        if time.monotonic() >= lease.kept_at + lease.ttl / 3:
            lease._keep()
        time.sleep(_GUARD_POLL)
    return False


def housekeeping(db: Db, repo: str, lock: str) -> None:
    """After the hand-over: ended tickets older than their retention, expired records and lapsed
    guards go; the holder's connection closes."""
    with contextlib.suppress(BackendUnavailable):
        db.q(
            """DELETE FROM {s}.tickets WHERE NOT line AND ended_at < clock_timestamp() - interval '1 hour'
               AND scope = %s AND name = %s""",
            (repo, lock),
        )
        db.q(f"DELETE FROM {{s}}.records r WHERE r.expires_at < clock_timestamp() AND NOT {records.LIVE}")
        # A guarded command killed before it let go leaves its row; lapsed, nobody waits for it.
        db.q("DELETE FROM {s}.guards WHERE until < clock_timestamp() - interval '1 minute'")
    db.close()


def end_judged(
    lease: PgLease, state: str, judge: Callable[[Ticket], str | None], keep: Callable[[], None] | None
) -> bool:
    """The token dies for the reason ``judge`` gives its row's ticket (None: it stays live), once
    no guarded command of it is in flight, judged and ended under the row's lock."""
    if lease.unreachable or not await_guards(lease, keep):
        return False
    try:
        with lease.db.tx() as cur:
            row = lease.db.one(
                cur,
                "SELECT body FROM {s}.tickets WHERE id = %s AND line AND fence = %s FOR UPDATE",
                (lease.ticket.ticket_id, lease.fence),
            )
            t = None if row is None else to_ticket(lease.ticket.ticket_id, row[0])
            why = judge(t) if t is not None and t.live else None
            if t is None or why is None:
                return False
            t.end(state, why)
            lease.db.ex(
                cur,
                "UPDATE {s}.tickets SET body = %s, ver = ver + 1, ended_at = clock_timestamp() WHERE id = %s",
                (body_of(t), t.ticket_id),
            )
            lease.ticket.end(state, why)
            return True
    except BackendUnavailable:
        return False
