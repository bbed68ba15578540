"""The PostgreSQL backend: the lock, line, leases, fences and records of every (scope, lock) in
tables of one schema (the tenant), for many hosts. Token files stay on the acquiring host, in the
local lock dir, and name the backend, so ``pearing-guard`` asks the database."""

from __future__ import annotations

import contextlib
import os
import time
from contextlib import contextmanager

from singleflight.core import names, proc
from singleflight.core.const import (
    ENV_BACKEND,
    ENV_SLOT,
    HELD,
    QUEUE_LATEST,
    REQUEST_ACTIVE,
    REQUEST_RETENTION,
    TYPE_CHECKING,
    WAITING,
)
from singleflight.core.errors import BackendUnavailable, NotHeld
from singleflight.core.request import RequestRecord, lock_record, request_record
from singleflight.core.ticket import Ticket
from singleflight.core.tokens import Claim, Facts, mint_token, token_hash
from singleflight.postgres import records
from singleflight.postgres.db import Db
from singleflight.postgres.line import WAIT_TTL, Line, as_stored, body_of, read_row, to_ticket
from singleflight.postgres.place import PgGrip, PgPlace, lease_ttl
from singleflight.postgres.tickets import PgTickets
from singleflight.postgres.url import parse_url

if TYPE_CHECKING:
    from collections.abc import Callable, Iterator
    from typing import Any

    import psycopg

    from singleflight.core.idle import Idle
    from singleflight.core.protocol import Taken
    from singleflight.core.request import Key
    from singleflight.postgres.lease import PgLease


class PgLock(PgTickets):
    """One (scope, lock) in the database: its tickets, and taking it."""

    def __init__(self, backend: PgBackend, repo: str, lock: str, *, must_exist: bool = False) -> None:
        super().__init__(backend.db, backend.lock_dir, repo, lock, must_exist=must_exist)
        self.backend = backend
        self._minted: dict[str, str] = {}

    def _mint(self, ticket: Ticket) -> str:
        """The run's token, minted as it arrives: its hash goes into the row as it is promoted."""
        token = self._minted.get(ticket.ticket_id)
        if token is None:
            token = self._minted[ticket.ticket_id] = mint_token()
        return token

    # -- acquiring -------------------------------------------------------------------------

    def enter(self, ticket: Ticket) -> tuple[PgGrip | None, PgPlace]:
        ticket.holder_host = ticket.holder_host or os.uname().nodename
        token = self._mint(ticket)
        ttl = lease_ttl(ticket.lease_seconds)
        sent = time.monotonic()
        with self.db.tx() as cur:
            line = Line(self.db, cur, self.repo, self.lock).lock_row()
            if ticket.slots > 1 or line.rows:
                self._check_slots(cur, line, ticket)
            in_line = ticket.ticket_id in [r[0] for r in line.rows]
            if not in_line and line.free_for(ticket.slots):
                ticket.token_hash = token_hash(token)
                line.promote(ticket, ttl, insert=True)
                grip = PgGrip(self.backend.url, ticket.ticket_id, ticket.fence or 0, ticket.slot or 0, token, ttl, sent)
                return grip, PgPlace(self, ticket, grip, in_line=False)
        if in_line:  # a CLI ticket's row, in line since its create: its agent takes it from there
            taken, _ = self.try_take(ticket, renew=None)
            return taken, PgPlace(self, ticket, taken, in_line=True)
        return None, PgPlace(self, ticket, None, in_line=False)

    def _check_slots(self, cur: psycopg.Cursor[Any], line: Line, ticket: Ticket) -> None:
        """A wrong --slots is 64 whatever the line: every live ticket in it must agree."""
        from singleflight.core.ticket import check_slots

        ids = [r[0] for r in line.rows if r[0] != ticket.ticket_id]
        if not ids:
            return
        rows = self.db.ex(cur, "SELECT id, body FROM {s}.tickets WHERE id = ANY(%s)", (ids,))
        check_slots(ticket, [to_ticket(r[0], r[1]) for r in rows])

    def try_take(self, ticket: Ticket, *, renew: float | None) -> tuple[PgGrip | None, bool]:
        """Promote ``ticket`` if it is its turn (one transaction: the fence rises with it); else
        renew its place for ``renew`` seconds. (The grip or None, whether it is still in line.)"""
        token = self._mint(ticket)
        ttl = lease_ttl(ticket.lease_seconds)
        sent = time.monotonic()
        with self.db.tx() as cur:
            line = Line(self.db, cur, self.repo, self.lock).lock_row()
            turn = line.my_turn(ticket.ticket_id, ticket.slots)
            if turn is None:
                return None, False
            if not turn:
                if renew is not None:
                    self.db.ex(
                        cur,
                        """UPDATE {s}.tickets SET place_until = clock_timestamp() + make_interval(secs => %s)
                           WHERE id = %s""",
                        (renew, ticket.ticket_id),
                    )
                return None, True
            row = read_row(self.db, cur, ticket.ticket_id)
            assert row is not None
            t = to_ticket(ticket.ticket_id, row[0])  # as stored: a heartbeat or a request since stays
            if not t.live:
                return None, False
            t.token_hash = token_hash(token)
            line.promote(t, ttl, insert=False)
        ticket.fence, ticket.slot, ticket.token_hash = t.fence, t.slot, t.token_hash
        return PgGrip(self.backend.url, t.ticket_id, t.fence or 0, t.slot or 0, token, ttl, sent), True

    def leave_line(self, ticket_id: str) -> None:
        """A waiter leaves without the lock (its ticket was ended by ``acquire``, or reads expired)."""
        with self.db.tx() as cur:
            rows = self.db.ex(
                cur,
                "UPDATE {s}.tickets SET line = false WHERE id = %s AND line AND NOT hold RETURNING id",
                (ticket_id,),
            )
            if rows:
                self.db.ex(cur, "SELECT pg_notify(%s, '')", (self.channel,))

    def supersede_latest(self, cur: psycopg.Cursor[Any], line: Line, t: Ticket) -> int | None:
        """``--queue latest``: the older live ``latest`` waiters end, superseded by ``t``, which
        takes the place (``seq``) of the earliest of them."""
        waiting = [r for r in line.waiters if r[0] != t.ticket_id]
        if not waiting:
            return None
        rows = self.db.ex(cur, "SELECT id, body FROM {s}.tickets WHERE id = ANY(%s)", ([r[0] for r in waiting],))
        bodies = {r[0]: to_ticket(r[0], r[1]) for r in rows}
        victims = [r for r in waiting if bodies[r[0]].live and bodies[r[0]].queue_mode == QUEUE_LATEST]
        if not victims:
            return None
        now = time.time()
        for r in victims:
            old = bodies[r[0]]
            old.supersede(t.ticket_id, now)
            self.write(cur, old, leave=True)
        seq = victims[0][3]
        mine = [r for r in line.rows if r[0] == t.ticket_id]
        if mine and mine[0][3] < seq:
            seq = mine[0][3]  # ours is the earliest place already
        elif mine:
            self.db.ex(cur, "UPDATE {s}.tickets SET seq = %s WHERE id = %s", (seq, t.ticket_id))
            line.rows.remove(mine[0])
        if not mine or mine[0][3] > seq:
            line.rows.insert(line.rows.index(victims[0]), (t.ticket_id, False, None, seq))
        line.rows = [r for r in line.rows if r not in victims]
        return seq

    # -- --cancel-in-progress (the rules: rules/events.py) -----------------------------------

    def take(
        self, grip: PgGrip | dict[str, Any], ticket: Ticket, *, promoted: bool, kill_grace: float
    ) -> tuple[PgLease, Taken]:
        """In the holder: our row holds since the promotion, with its fence and our token's hash.
        The holder's pid and deadline go into it now, on the holder's own connection, in the same
        statement that keeps its lease (a holder frozen before its first word finds the lease as
        the wrapper kept it meanwhile, or lapsed: then it is lost, and nothing is written)."""
        from singleflight.postgres.lease import PgLease

        if isinstance(grip, dict):
            grip = PgGrip.from_handover(self.backend.url, grip)
        db = Db(self.backend.url, timeout=max(0.2, min(1.0, grip.ttl / 10)))
        sent = time.monotonic()
        ver: int | None = None
        reached = False
        with contextlib.suppress(BackendUnavailable), db.tx() as cur:
            row = read_row(db, cur, grip.ticket_id, lock=True)
            t = ticket if row is None else as_stored(grip.ticket_id, row)
            if row is not None and not t.live:
                # Its owner released it as its turn came, before this holder's first word.
                raise NotHeld(grip.ticket_id, t.describe_end())
            if row is not None:
                self._settle(t, grip, promoted)
                done = db.ex(
                    cur,
                    """UPDATE {s}.tickets SET held_until = clock_timestamp() + make_interval(secs => %s),
                       body = %s, ver = ver + 1 WHERE id = %s AND line AND hold AND fence = %s
                       AND held_until > clock_timestamp() RETURNING ver""",
                    (grip.ttl, body_of(t), grip.ticket_id, grip.fence),
                )
                if done:
                    ver, grip.kept_at = done[0][0], sent
            reached = True
        if ver is None:  # not written: what we know of it
            t = ticket
            self._settle(t, grip, promoted)
        ticket.fence, ticket.token_hash, ticket.slot = grip.fence, t.token_hash, grip.slot
        margin = min(kill_grace + 0.5 + db.timeout, grip.ttl / 3)
        driver = PgLease(self, db, grip, t, margin=margin, ver=ver, reached=reached)
        token_file = self.tokens.write(t, grip.token, backend=self.backend.url, key=f"{self.repo}/{self.lock}")
        env = {ENV_BACKEND: self.backend.url, ENV_SLOT: str(grip.slot)}
        from singleflight.core.protocol import Taken

        return driver, Taken(grip.fence, grip.token, token_file, env)

    @staticmethod
    def _settle(t: Ticket, grip: PgGrip, promoted: bool) -> None:
        """The ticket as its holder records it: who holds, since when, its own deadline."""
        t.owner_pid, t.owner_start = t.holder_pid, t.holder_start  # who waited: the wrapper, or the agent
        t.state, t.fence, t.slot, t.promoted = HELD, grip.fence, grip.slot, promoted or t.promoted
        t.holder_pid, t.holder_start = os.getpid(), proc.start_time(os.getpid())
        t.holder_host = os.uname().nodename
        t.acquired_at = time.time()
        t.token_hash = token_hash(grip.token)
        t.set_lease(t.lease_seconds)
        t.boot_id = proc.boot_id()

    # -- the ticket ------------------------------------------------------------------------

    def create(self, ticket: Ticket) -> Ticket:
        """A CLI ticket's row, in line at once, and its request record, in one transaction: one
        ticket per request uuid. Its place lasts WAIT_TTL: its owner renews it until the agent
        that waits for it has started, and an owner killed before that leaves no ticket behind."""
        db = self.db
        ticket.holder_host = os.uname().nodename
        ticket.set_lease(ticket.lease_seconds)
        ticket.boot_id = proc.boot_id()
        with db.tx() as cur:
            line = Line(db, cur, self.repo, self.lock).lock_row()
            key = lock_record(self.repo, self.lock, request_record(ticket.request_uuid))
            found = records.read(db, cur, key)
            if found[0] is not None:
                rec = RequestRecord.from_json(found[0])
                if rec.ticket_id:
                    row = read_row(db, cur, rec.ticket_id)
                    if row is not None:
                        return as_stored(rec.ticket_id, row)
            # Created behind a holder, waiter or guard, it waits behind another holder (promoted).
            ticket.promoted = not line.free_for(ticket.slots)
            ticket.state = WAITING
            db.ex(
                cur,
                """INSERT INTO {s}.tickets (id, scope, name, line, hold, place_until, body)
                   VALUES (%s, %s, %s, true, false, clock_timestamp() + make_interval(secs => %s), %s)""",
                (ticket.ticket_id, self.repo, self.lock, WAIT_TTL, body_of(ticket)),
            )
            record = RequestRecord(state=REQUEST_ACTIVE, ticket_id=ticket.ticket_id, created_at=time.time())
            records.write(db, cur, key, record.to_json(), found[1], run=None, keep=REQUEST_RETENTION)
        return ticket


class PgBackend:
    def __init__(self, url: str, lock_dir: str, *, create: bool = True) -> None:
        parse_url(url)
        self.url, self.lock_dir = url, lock_dir
        self.db = Db(url)

    def close(self) -> None:
        self.db.close()

    def __enter__(self) -> PgBackend:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def lock(self, repo: str, lock: str, *, create: bool = True) -> PgLock:
        return PgLock(self, names.scope(repo), names.lock_name(lock), must_exist=not create)

    def locks(self, repo: str | None, *, idle: bool = False) -> list[tuple[str, str]]:
        table = "locks" if idle else "tickets"
        where = " AND NOT pruned" if idle else " AND line"
        if repo is None:
            rows = self.db.q(f"SELECT DISTINCT scope, name FROM {{s}}.{table} WHERE scope <> ''{where}")
        else:
            rows = self.db.q(f"SELECT DISTINCT scope, name FROM {{s}}.{table} WHERE scope = %s{where}", (repo,))
        return sorted((r[0], r[1]) for r in rows)

    def prune(self, repo: str, lock: str, keep: Callable[[Idle], str | None], *, dry_run: bool) -> str | None:
        from singleflight.postgres import prune  # pearing-cli prune's, not pearing-run's

        return prune.prune(self.db, repo, lock, keep, dry_run=dry_run)

    # -- records ---------------------------------------------------------------------------

    def read_record(self, key: Key) -> tuple[bytes | None, Any, str]:
        with self.db.tx() as cur:
            return records.read(self.db, cur, key)

    def write_record(
        self, key: Key, body: bytes | None, seen: Any, *, run: Ticket | None = None, keep: float | None = None
    ) -> bool:
        with self.db.tx() as cur:
            return records.write(self.db, cur, key, body, seen, run=run, keep=keep)

    def prepare_record(self, key: Key, body: bytes) -> None:
        """A database does not run out of disk under one run here: nothing to prepare."""

    @contextmanager
    def guard(self, claim: Claim, digest: str, hold: float | None) -> Iterator[Facts]:
        from singleflight.postgres import guard  # pearing-guard's, not pearing-run's

        with guard.guard(self.db, claim, digest, hold) as facts:
            yield facts

    def read_thread(self, repo: str, thread: int) -> tuple[list[dict[str, Any]], int | None]:
        from singleflight.postgres import threads

        return threads.read(self.db, repo, thread)

    def add_reply(self, repo: str, thread: int, reply: dict[str, Any], *, highest: int | None) -> bool:
        from singleflight.postgres import threads

        return threads.add(self.db, repo, thread, reply, highest=highest)


def setup_sql(url: str) -> str:
    """The DDL of ``url``'s schema, for a DBA (``pearing-cli init-db --print-sql``; the scheme
    table names it)."""
    from singleflight.postgres import schema

    return schema.print_sql(parse_url(url).schema)
