"""A lock's tickets in the database, as any process sees them: read one (its state from its
row's place in line), change it by compare-and-set, end it, stop its process, the line as it
stands. Taking the lock is ``PgLock``'s (backend.py), which adds it."""

from __future__ import annotations

import os

from singleflight.core import proc
from singleflight.core.const import EXPIRED, HELD, TYPE_CHECKING, WAITING
from singleflight.core.errors import UnknownLock, UnknownTicket
from singleflight.core.ticket import Ticket
from singleflight.core.tokens import TokenFiles
from singleflight.postgres.db import Db
from singleflight.postgres.line import (
    COLS,
    COLS_N,
    WAIT_TTL,
    Line,
    as_stored,
    body_of,
    channel,
    read_row,
    ticket_channel,
)

if TYPE_CHECKING:
    from collections.abc import Callable
    from typing import Any

    import psycopg

    from singleflight.core.line import Line as LineView


class PgTickets:
    def __init__(self, db: Db, lock_dir: str, repo: str, lock: str, *, must_exist: bool = False) -> None:
        self.db, self.lock_dir, self.repo, self.lock = db, lock_dir, repo, lock
        self.must_exist = must_exist
        self.channel = channel(db, repo, lock)
        self._tokens: TokenFiles | None = None

    def close(self) -> None:
        if self._tokens is not None:
            self._tokens.close()
            self._tokens = None

    @property
    def tokens(self) -> TokenFiles:
        if self._tokens is None:
            self._tokens = TokenFiles.at(self.lock_dir, self.repo, self.lock)
        return self._tokens

    def _mine(self, row: tuple[Any, ...]) -> bool:
        return (row[COLS_N], row[COLS_N + 1]) == (self.repo, self.lock)

    def read(self, ticket_id: str) -> Ticket | None:
        with self.db.tx() as cur:
            row = read_row(self.db, cur, ticket_id)
            if row is None or not self._mine(row):
                self._lock_must_exist(cur)
                return None
            return as_stored(ticket_id, row)

    def _lock_must_exist(self, cur: psycopg.Cursor[Any]) -> None:
        if self.must_exist and not self.db.ex(
            cur, "SELECT 1 FROM {s}.locks WHERE scope = %s AND name = %s", (self.repo, self.lock)
        ):
            raise UnknownLock(self.repo, self.lock)

    def _existing(self, ticket_id: str) -> Ticket:
        t = self.read(ticket_id)
        if t is None:
            raise UnknownTicket(ticket_id)
        return t

    def write(self, cur: psycopg.Cursor[Any], t: Ticket, *, leave: bool = False) -> None:
        """Write the ticket's body (its end: with ``leave`` it leaves the line too, and who waits
        is woken)."""
        ended = "clock_timestamp()" if not t.live else "ended_at"
        if leave:
            self.db.ex(
                cur,
                f"""UPDATE {{s}}.tickets SET body = %s, ver = ver + 1, line = false, hold = false,
                    ended_at = {ended} WHERE id = %s""",
                (body_of(t), t.ticket_id),
            )
            self.db.ex(cur, "SELECT pg_notify(%s, '')", (self.channel,))
        else:
            self.db.ex(
                cur,
                f"UPDATE {{s}}.tickets SET body = %s, ver = ver + 1, ended_at = {ended} WHERE id = %s",
                (body_of(t), t.ticket_id),
            )

    def end(
        self, ticket_id: str, state: str, reason: str, *, only_if_held: bool = True, release: bool = True
    ) -> Ticket | None:
        with self.db.tx() as cur:
            Line(self.db, cur, self.repo, self.lock).lock_row()
            row = read_row(self.db, cur, ticket_id, lock=True)
            if row is None or not self._mine(row):
                return None
            t = as_stored(ticket_id, row)
            in_line = bool(row[1])
            if not t.live or (only_if_held and t.state != HELD):
                if release and not t.live and in_line:
                    self.write(cur, to_body(row, ticket_id), leave=True)  # its token died earlier; the lock goes too
                return None
            waiting = t.state == WAITING  # promotion happens under the same row lock: it stays so
            t.end(state, reason)
            self.write(cur, t, leave=release or waiting)
            return t

    def update(self, ticket_id: str, change: Callable[[Ticket], bool]) -> Ticket | None:
        """Compare-and-set under the row's lock: ``change`` sees the ticket as stored."""
        with self.db.tx() as cur:
            row = read_row(self.db, cur, ticket_id, lock=True)
            if row is None or not self._mine(row):
                self._lock_must_exist(cur)
                raise UnknownTicket(ticket_id)
            t = as_stored(ticket_id, row)
            if not t.live:
                change(t)  # ended or lapsed: the change says why, if it asks
                return None
            if not change(t) or not t.live:
                return None
            self.write(cur, t)
            if t.state == WAITING and t.holder_host == os.uname().nodename and _is_me(t.holder_pid, t.holder_start):
                # Ours: we created it and answer for it until its agent starts (a busy machine may
                # start it late), or we are that agent: our heartbeat keeps its place. Only ours:
                # anyone else's must not keep a dead waiter in line.
                self.db.ex(
                    cur,
                    """UPDATE {s}.tickets SET place_until = greatest(place_until,
                       clock_timestamp() + make_interval(secs => %s)) WHERE id = %s AND line AND NOT hold""",
                    (WAIT_TTL, ticket_id),
                )
            if t.superseded_by and t.state == HELD:
                self.db.ex(cur, "SELECT pg_notify(%s, '')", (ticket_channel(self.db, ticket_id),))
            return t

    def line(self) -> LineView:
        from singleflight.core.line import Line as LineView  # status's and a waiter's, not a free lock's

        db = self.db
        key = (self.repo, self.lock)
        with db.tx() as cur:
            rows = db.ex(
                cur,
                f"SELECT id, {COLS} FROM {{s}}.tickets WHERE scope = %s AND name = %s AND line ORDER BY seq",
                key,
            )
            fence_row = db.one(cur, "SELECT fence FROM {s}.locks WHERE scope = %s AND name = %s", key)
        holders: list[Ticket] = []
        waiters: list[Ticket] = []
        for r in rows:
            t = as_stored(r[0], r[1:])
            if t.state == HELD or (not t.live and r[3] and r[7]):
                holders.append(t)  # a holder whose token died is still holding, COMMAND being stopped
            elif t.state == WAITING:
                waiters.append(t)
        holders.sort(key=lambda h: h.fence or 0)
        for t in holders:
            t.lease_deadline_mono = t.deadline_here()
        total = max([t.slots for t in holders + waiters], default=1)
        entries: list[Ticket | dict[str, Any]] = [*holders, *waiters]
        fence = fence_row[0] if fence_row is not None and fence_row[0] else None
        return LineView(entries, held=bool(holders), fence=fence, extra={}, holders=len(holders), slots=total)


def _is_me(pid: int | None, start: int | None) -> bool:
    """Is this process the one a ticket names (its pid and start time)?"""
    return pid == os.getpid() and start == proc.start_time(pid)


def to_body(row: tuple[Any, ...], ticket_id: str) -> Ticket:
    """The ticket as its body holds it (no state from its place)."""
    from singleflight.postgres.line import to_ticket

    return to_ticket(ticket_id, row[0])


__all__ = ["EXPIRED", "PgTickets"]
