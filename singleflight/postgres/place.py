"""One arrival at a lock in the database: the lock at once (the grip), or a row at the end of
its line that its waiter renews, woken by LISTEN/NOTIFY (or a short poll where it cannot listen)."""

from __future__ import annotations

import contextlib
import time

from singleflight.core import fault
from singleflight.core.cadence import Cadence
from singleflight.core.const import QUEUE_LATEST, TYPE_CHECKING
from singleflight.core.errors import BackendUnavailable, LineFull
from singleflight.core.ticket import Ticket
from singleflight.postgres.db import Db
from singleflight.postgres.line import WAIT_TICK, WAIT_TTL, Line, body_of, channel

if TYPE_CHECKING:
    from collections.abc import Callable
    from typing import Any
# Without LISTEN (listen=0, a pooler in transaction mode), a waiter looks this often.
POLL_EVERY = 0.1
# A waiter whose request failed (its connection dropped by the server) asks again this often.
_RETRY = 0.25
# UPDATE of the holder's lease on the database's clock: only while it is still ours.
KEEP_SQL = """UPDATE {s}.tickets SET held_until = clock_timestamp() + make_interval(secs => %s)
    WHERE id = %s AND line AND hold AND held_until > clock_timestamp() RETURNING fence"""


def lease_ttl(seconds: float) -> float:
    """The store's lease of a holder: its --lease-seconds, 2 s at least (a keep every third)."""
    return max(2.0, float(seconds))


class PgGrip:
    """Our row, holding, its fence and token, and the holder's lease on the database's clock:
    kept by the wrapper and the holder both (``keep``), so a frozen holder cannot let it lapse
    into a second COMMAND. No fd: it is all data (``handover``)."""

    def __init__(self, url: str, ticket_id: str, fence: int, slot: int, token: str, ttl: float, kept_at: float) -> None:  # noqa: PLR0917 (the parts ``handover`` lists)
        self.url, self.ticket_id, self.fence, self.slot, self.token = url, ticket_id, fence, slot, token
        self.ttl, self.kept_at = ttl, kept_at
        self._cadence = Cadence(ttl, at=kept_at)
        self._db: Db | None = None

    @property
    def db(self) -> Db:
        if self._db is None:
            self._db = Db(self.url, timeout=max(0.5, min(2.0, self.ttl / 6)))
        return self._db

    def handover(self) -> tuple[dict[str, Any], set[int]]:
        info = {
            "ticket_id": self.ticket_id,
            "fence": self.fence,
            "slot": self.slot,
            "token": self.token,
            "ttl": self.ttl,
            "kept_at": self.kept_at,
        }
        return info, set()

    @classmethod
    def from_handover(cls, url: str, info: dict[str, Any]) -> PgGrip:
        """The grip ``handover`` described (monotonic stamps are the host's, shared by its processes)."""
        return cls(
            url,
            str(info["ticket_id"]),
            int(info["fence"]),
            int(info["slot"]),
            str(info["token"]),
            float(info["ttl"]),
            float(info["kept_at"]),
        )

    def _keep(self) -> bool:
        sent = time.monotonic()
        if not self.db.q(KEEP_SQL, (self.ttl, self.ticket_id)):
            return False
        self.kept_at = sent  # counted from before we asked: the database's clock started no earlier
        return True

    def keep(self) -> float:
        """The lease kept, once a third of it has gone since the last try; how long until the next."""
        if (left := self._cadence.due()) > 0:
            return left
        with contextlib.suppress(BackendUnavailable):
            self._keep()
        return self._cadence.every

    def still_ours(self) -> bool:
        """Kept within half the lease: certainly ours, no request. Else look (wrapper and holder
        were both frozen, or the server was slow): a lapsed lease may have promoted the next."""
        if time.monotonic() - self.kept_at < self.ttl / 2:
            return True
        try:
            return self._keep()
        except BackendUnavailable:
            return False

    def close(self) -> None:
        if self._db is not None:
            self._db.close()
            self._db = None

    def release(self) -> None:
        """The holder is gone and COMMAND is dead: our row leaves the line (a ticket still live
        reads as expired: its holder never ended it), the next waiter is woken."""
        with contextlib.suppress(BackendUnavailable), self.db.tx() as cur:
            db = self.db
            rows = db.ex(
                cur,
                """UPDATE {s}.tickets SET line = false, hold = false, ended_at = clock_timestamp(), ver = ver + 1,
                   body = CASE WHEN body->>'state' IN ('waiting', 'held')
                     THEN body || jsonb_build_object('state', 'expired', 'end_reason', 'holder gone',
                                   'ended_at', extract(epoch FROM clock_timestamp())::float8)
                     ELSE body END
                   WHERE id = %s AND line AND fence = %s RETURNING scope, name""",
                (self.ticket_id, self.fence),
            )
            if rows:
                db.ex(cur, "SELECT pg_notify(%s, '')", (channel(db, rows[0][0], rows[0][1]),))
        self.close()


class PgPlace:
    """One arrival: the lock at once (``grip``), or a row in line (``queue``) that ``wait`` renews."""

    def __init__(self, lk: Any, ticket: Ticket, grip: PgGrip | None, *, in_line: bool) -> None:
        self.lk, self.ticket, self.grip = lk, ticket, grip
        self.in_line = in_line  # a CLI ticket's row is in line already, from its create
        self.joined = False
        self.gone = False
        # When our place was last renewed (monotonic, as the request was sent): it lasts
        # WAIT_TTL from then on the server's clock, which started no earlier.
        self.kept = 0.0
        self._listen: Any = None

    @property
    def db(self) -> Db:
        db: Db = self.lk.db
        return db

    def queue(self, deadline: Callable[[], float]) -> int:
        t, db = self.ticket, self.db
        self._start_listening()
        sent = time.monotonic()
        with db.tx() as cur:
            line = Line(db, cur, self.lk.repo, self.lk.lock).lock_row()
            fault.pause("pause-in-mutex")
            mine = t.ticket_id in [r[0] for r in line.rows]  # before a takeover puts us there
            seq = self.lk.supersede_latest(cur, line, t) if t.queue_mode == QUEUE_LATEST else None
            if self.in_line and not mine:
                self.gone = True  # cancelled (release-lock-ticket) or lapsed before we got here
                return 1
            ahead = line.ahead(t.ticket_id)
            waiting = max(0, ahead - t.slots)
            # --max-waiting: counted under the lock's row, so two arrivals at once never both pass.
            # A ``latest`` arrival that took an older one's place adds no waiter.
            if seq is None and t.max_waiting is not None and waiting >= t.max_waiting and ahead >= t.slots:
                raise LineFull(waiting, t.max_waiting)
            t.promoted = True  # if it is ever held, it waited behind another holder
            if mine:
                db.ex(
                    cur,
                    """UPDATE {s}.tickets SET place_until = clock_timestamp() + make_interval(secs => %s)
                       WHERE id = %s""",
                    (WAIT_TTL, t.ticket_id),
                )
            else:
                db.ex(
                    cur,
                    """INSERT INTO {s}.tickets (id, scope, name, line, hold, place_until, body, seq)
                       VALUES (%s, %s, %s, true, false, clock_timestamp() + make_interval(secs => %s), %s,
                               COALESCE(%s, nextval(pg_get_serial_sequence(%s, 'seq'))))""",
                    (t.ticket_id, self.lk.repo, self.lk.lock, WAIT_TTL, body_of(t), seq, f"{db.s}.tickets"),
                )
        self.joined, self.kept = True, sent
        return max(1, ahead - t.slots + 1)

    def _start_listening(self) -> None:
        if not self.db.url.listen or self._listen is not None:
            return
        listener = Db(self.lk.backend.url, timeout=5.0)
        try:
            listener.q(f'LISTEN "{self.lk.channel}"')
        except BackendUnavailable:
            listener.close()
            return
        self._listen = listener

    def _nap(self, until: float) -> None:
        """Until woken (a NOTIFY on the lock's channel) or ``until`` (monotonic)."""
        left = until - time.monotonic()
        if left <= 0:
            return
        if self._listen is None:
            time.sleep(min(left, POLL_EVERY))
            return
        try:
            self._listen.notified(left)
        except BackendUnavailable:  # the listening connection broke: poll from now on
            self._listen.close()
            self._listen = None

    def wait(self, deadline: Callable[[], float]) -> PgGrip | None:
        """Our turn (the grip), or None: our place gone, or ``deadline()`` passed.

        A request that fails (the server restarted, terminated our connection, a pooler recycled
        it) is asked again on a new connection while our place lasts, as an etcd waiter re-opens
        its watch on another member; the deadline stays the last one read. Only a server out of
        reach until our place lapses (WAIT_TTL since it was last renewed) ends the wait: then
        BackendUnavailable (75)."""
        if self.gone or not self.joined:
            return None
        end: float | None = None
        while True:
            try:
                if end is None:
                    end = deadline()
                sent = time.monotonic()
                grip, in_line = self.lk.try_take(self.ticket, renew=WAIT_TTL)
                if grip is None and in_line:
                    self.kept = sent
                    end = deadline()
            except BackendUnavailable:
                now = time.monotonic()
                if now >= self.kept + WAIT_TTL:
                    raise
                if end is not None and now >= end:
                    return None
                time.sleep(min(_RETRY, self.kept + WAIT_TTL - now))
                continue
            if isinstance(grip, PgGrip):
                if time.monotonic() >= end:
                    # Frozen (^Z) past our own deadline and resumed: never take the lock then.
                    grip.release()
                    return None
                self.grip = grip
                return grip
            if not in_line:
                return None  # cancelled, superseded, or our place lapsed
            now = time.monotonic()
            if now >= end:
                return None
            self._nap(min(end, now + WAIT_TICK))

    def leave(self) -> None:
        if self._listen is not None:
            self._listen.close()
            self._listen = None
        if self.grip is None and self.joined:
            with contextlib.suppress(BackendUnavailable):
                self.lk.leave_line(self.ticket.ticket_id)
