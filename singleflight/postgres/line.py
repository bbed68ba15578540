"""A lock's line in the database: its row (the fence), its tickets in ``seq`` order, and the one
transaction that promotes a waiter.

Every step that changes who holds or waits locks the lock's row first (``SELECT ... FOR
UPDATE``), so they happen one at a time per lock: the sweep of lapsed places and leases (on the
database's clock, ``clock_timestamp()``), the count of who is ahead, and the promotion, which
raises the fence in the same transaction. No advisory lock: a pooler in transaction mode keeps
a row lock to its transaction, where a session's advisory lock would outlive it.
"""

from __future__ import annotations

import zlib

from singleflight.core import jsontext
from singleflight.core.const import EXPIRED, HELD, MAX_FENCE, PLACE_TTL, TYPE_CHECKING, WAITING
from singleflight.core.reasons import EndReason
from singleflight.core.ticket import Ticket
from singleflight.postgres.db import Db, corrupt

if TYPE_CHECKING:
    from typing import Any

    import psycopg

# A waiter's place lapses this long after its waiter (or owner) stops renewing it (killed, frozen).
WAIT_TTL = float(PLACE_TTL)
# How often a waiter renews its place and looks again without being woken.
WAIT_TICK = 1.0

# Until when a row holds (its lease) or keeps its place in line, on the database's clock.
_UNTIL = "(CASE WHEN hold THEN held_until ELSE place_until END)"
# The columns every read of a ticket takes: ``alive``, its place or lease has not lapsed; then
# that time, which a lapsed one reads as its end. COLS_N of them: a query's own columns follow.
COLS = f"body, line, hold, fence, slot, ver, {_UNTIL} > clock_timestamp() AS alive, " + (
    f"extract(epoch FROM {_UNTIL})::float8"
)
COLS_N = 8
# The sweep: tickets in line whose place or lease lapsed leave it (a live one reads as expired,
# ended when its lease or place ran out, not when the sweep came by: every read says one time).
_SWEEP = f"""UPDATE {{s}}.tickets SET line = false, hold = false, ended_at = {_UNTIL},
    ver = ver + 1, body = CASE WHEN body->>'state' IN ('waiting', 'held')
        THEN body || jsonb_build_object('state', 'expired', 'end_reason', %s::text,
                                        'ended_at', extract(epoch FROM {_UNTIL})::float8)
        ELSE body END
    WHERE scope = %s AND name = %s AND line AND {_UNTIL} <= clock_timestamp()"""


def _digest(text: str) -> str:
    """64 bits of ``text`` (zlib's CRC, not hashlib: an uncontended run loads no hashlib). Two
    names that share a channel only wake each other's waiters for nothing."""
    raw = text.encode()
    return f"{zlib.crc32(raw):08x}{zlib.crc32(raw, 0x5EED):08x}"


def channel(db: Db, repo: str, lock: str) -> str:
    """The LISTEN channel of a lock (an identifier: at most 63 bytes, hence a digest)."""
    return "pearing_" + _digest(f"{db.schema}\0{repo}\0{lock}")


def ticket_channel(db: Db, ticket_id: str) -> str:
    """A holder's own channel: a cancel request for it is announced there."""
    return "pearing_t_" + _digest(f"{db.schema}\0{ticket_id}")


def to_ticket(ticket_id: str, body: Any) -> Ticket:
    try:
        if isinstance(body, (str, bytes)):
            body = jsontext.loads(body)
        t = Ticket.from_dict(body)
        if t.ticket_id != ticket_id:
            raise ValueError(f"names ticket {t.ticket_id}")
    except (ValueError, TypeError, KeyError, AttributeError) as exc:
        raise corrupt("tickets", ticket_id, f"not a ticket: {exc}") from None
    return t


def body_of(t: Ticket) -> str:
    return t.to_json().decode()


def as_stored(ticket_id: str, row: tuple[Any, ...]) -> Ticket:
    """The ticket a row (``COLS``) holds, its state from its place: in line and not lapsed, the
    holder holds (with its fence) and a waiter waits; a live one out of line or lapsed expired."""
    body, line, hold, fence, slot, _, alive, until = row[:COLS_N]
    t = to_ticket(ticket_id, body)
    if t.live:
        if line and alive:
            t.state = HELD if hold else WAITING
            t.fence = int(fence) if hold and fence is not None else None
            t.slot = slot if hold else t.slot
        else:  # lapsed (ended when its lease ran out), or out of line unended (now)
            t.end(EXPIRED, EndReason.LEASE_EXPIRED.text(), at=until if line and until is not None else None)
    return t


class Line:
    """The line of one (scope, lock), inside a transaction that locked its row (``lock_row``)."""

    def __init__(self, db: Db, cur: psycopg.Cursor[Any], repo: str, lock: str) -> None:
        self.db, self.cur, self.repo, self.lock = db, cur, repo, lock
        self.fence = 0
        self.rows: list[tuple[str, bool, int | None, int]] = []  # (id, hold, slot, seq), in order
        self.guarded = False

    def lock_row(self) -> Line:
        db, cur, key = self.db, self.cur, (self.repo, self.lock)
        db.ex(cur, "INSERT INTO {s}.locks (scope, name) VALUES (%s, %s) ON CONFLICT DO NOTHING", key)
        row = db.one(cur, "SELECT fence, pruned FROM {s}.locks WHERE scope = %s AND name = %s FOR UPDATE", key)
        fence = row[0] if row is not None else 0
        if row is not None and row[1] is True:  # pruned as idle, and back: its fence goes on
            db.ex(cur, "UPDATE {s}.locks SET pruned = false WHERE scope = %s AND name = %s", key)
        if type(fence) is not int or not 0 <= fence <= MAX_FENCE:
            raise corrupt("locks", f"{self.repo}/{self.lock}", f"fence is not a fence: {fence!r}")
        self.fence = fence
        db.ex(cur, _SWEEP, (EndReason.LEASE_EXPIRED.text(), *key))
        self.rows = [
            (r[0], bool(r[1]), r[2], r[3])
            for r in db.ex(
                cur,
                "SELECT id, hold, slot, seq FROM {s}.tickets WHERE scope = %s AND name = %s AND line ORDER BY seq",
                key,
            )
        ]
        g = db.one(
            cur,
            "SELECT count(*) FROM {s}.guards WHERE scope = %s AND name = %s AND until > clock_timestamp()",
            key,
        )
        self.guarded = bool(g and g[0])
        return self

    @property
    def holders(self) -> list[tuple[str, bool, int | None, int]]:
        return [r for r in self.rows if r[1]]

    @property
    def waiters(self) -> list[tuple[str, bool, int | None, int]]:
        return [r for r in self.rows if not r[1]]

    def free_for(self, slots: int) -> bool:
        """Would a newcomer hold at once? (Nobody waits, a slot is free, no guard in flight.)"""
        return not self.waiters and len(self.holders) < slots and not self.guarded

    def my_turn(self, ticket_id: str, slots: int) -> bool | None:
        """Is the waiting ``ticket_id`` among the first waiters for a free slot? None: not in line."""
        ids = [r[0] for r in self.waiters]
        if ticket_id not in ids:
            return None
        return not self.guarded and len(self.holders) + ids.index(ticket_id) < slots

    def ahead(self, ticket_id: str | None = None) -> int:
        """How many are in line (holders and waiters) ahead of ``ticket_id`` (None: all)."""
        ids = [r[0] for r in self.rows]
        return ids.index(ticket_id) if ticket_id in ids else len(ids)

    def next_fence(self) -> int:
        """The next fence, written into the lock's row now (committed with the promotion)."""
        if self.fence >= MAX_FENCE:
            raise corrupt("locks", f"{self.repo}/{self.lock}", "holds the largest fence; none can follow")
        self.fence += 1
        # Durable whatever the server's or role's default: a fence a crash (or a failover to a
        # synchronous standby) could forget would be issued twice.
        self.db.ex(self.cur, "SET LOCAL synchronous_commit TO on")
        self.db.ex(
            self.cur,
            "UPDATE {s}.locks SET fence = %s, used_at = clock_timestamp() WHERE scope = %s AND name = %s",
            (self.fence, self.repo, self.lock),
        )
        return self.fence

    def free_slot(self, slots: int) -> int:
        used = {r[2] for r in self.holders}
        return next(i for i in range(slots) if i not in used) if slots > 1 else 0

    def promote(self, t: Ticket, ttl: float, *, insert: bool) -> None:
        """``t`` holds from now: the next fence, a slot, its lease on the database's clock."""
        t.fence, t.slot, t.state = self.next_fence(), self.free_slot(t.slots), HELD
        params = (t.fence, t.slot, ttl, body_of(t), t.ticket_id)
        if insert:
            self.db.ex(
                self.cur,
                """INSERT INTO {s}.tickets (fence, slot, held_until, body, id, scope, name, line, hold)
                   VALUES (%s, %s, clock_timestamp() + make_interval(secs => %s), %s, %s, %s, %s, true, true)""",
                (*params, self.repo, self.lock),
            )
        else:
            self.db.ex(
                self.cur,
                """UPDATE {s}.tickets SET fence = %s, slot = %s, hold = true, ver = ver + 1,
                   held_until = clock_timestamp() + make_interval(secs => %s), body = %s WHERE id = %s""",
                params,
            )
        self.db.ex(self.cur, "SELECT pg_notify(%s, '')", (channel(self.db, self.repo, self.lock),))


def read_row(db: Db, cur: psycopg.Cursor[Any], ticket_id: str, *, lock: bool = False) -> tuple[Any, ...] | None:
    """A ticket's row (``COLS``), or None."""
    sql = f"SELECT {COLS}, scope, name FROM {{s}}.tickets WHERE id = %s" + (" FOR UPDATE" if lock else "")
    return db.one(cur, sql, (ticket_id,))
