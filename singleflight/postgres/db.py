"""One connection to the database, as every part of the backend uses it.

psycopg is imported here, on the postgres path only: a lock dir or etcd run never loads it.
Autocommit, with explicit transactions where a step reads and writes (``tx``). Every request
has a deadline on this host's clock: a server that stops answering (SIGSTOP, a partition) makes
the request fail at its deadline (the socket is shut down under it), never hang the holder past
its own cut-off. A connection that failed is dropped and opened again at the next request: a
restarted server or a terminated backend costs one failed request.
"""

from __future__ import annotations

import contextlib
import os
import socket
import threading
import time

from singleflight.core.const import TYPE_CHECKING, ExitCode
from singleflight.core.errors import BackendUnavailable, CorruptRecord, NotPermitted, PearingError
from singleflight.postgres import schema
from singleflight.postgres.url import parse_url

if TYPE_CHECKING:
    from collections.abc import Callable, Iterator
    from typing import Any

    import psycopg

# Libpq counts its connect timeout in whole seconds, 2 at least.
_CONNECT_TIMEOUT = 2
# A session of ours idle inside a transaction this long is ended by the server. Every transaction
# of ours is a few statements sent back to back; one idle that long is a client frozen (SIGSTOP,
# a paused VM) inside it, holding the lock's row that every arrival at that lock waits for.
_IDLE_IN_TRANSACTION_MS = 5000


class DriverMissing(PearingError):
    """The postgres extra is not installed: a part of the install is missing (69), not a busy
    lock (75), which a cron job would take for a skipped run."""

    exit_code = ExitCode.UNAVAILABLE

    def __init__(self) -> None:
        super().__init__("the PostgreSQL driver is not installed: pip install 'pearing-singleflight[postgres]'")


def _psycopg() -> Any:
    try:
        import psycopg
    except ImportError:
        raise DriverMissing from None
    return psycopg


def _cut_off(pg: Any) -> tuple[type[BaseException], ...]:
    """What says the connection is gone: the server unreachable or restarted, our backend
    terminated, or our session ended for idling in a transaction (we were frozen inside it)."""
    return (pg.OperationalError, pg.InterfaceError, pg.errors.IdleInTransactionSessionTimeout)


class Db:
    """A lazily opened connection, its requests bounded by ``timeout`` seconds."""

    def __init__(self, url: str, *, timeout: float = 10.0) -> None:
        self.url = parse_url(url)
        self.schema = self.url.schema
        self.s = f'"{self.schema}"'  # the schema, quoted, for the SQL
        self.timeout = timeout
        # A holder's cut-off (monotonic): no request may still be blocked past it, so one that
        # could not end before it is not sent (a connect takes up to its 2 s timeout).
        self.not_after: Callable[[], float] | None = None
        self._conn: psycopg.Connection[Any] | None = None

    def close(self) -> None:
        if self._conn is not None:
            with contextlib.suppress(Exception):
                self._conn.close()
            self._conn = None

    def _unavailable(self, exc: BaseException) -> BackendUnavailable:
        self.close()
        detail = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        return BackendUnavailable(self.url.masked, detail)

    def _left(self) -> float:
        """How long the next request may take: ``timeout``, or less before the cut-off."""
        if self.not_after is None:
            return self.timeout
        left = min(self.timeout, self.not_after() - time.monotonic())
        if left <= 0:
            raise BackendUnavailable(self.url.masked, "no time left before the holder's cut-off")
        return left

    def conn(self) -> psycopg.Connection[Any]:
        if self._conn is None or self._conn.closed:
            pg = _psycopg()
            if self.not_after is not None and time.monotonic() + _CONNECT_TIMEOUT >= self.not_after():
                raise BackendUnavailable(self.url.masked, "no time to connect before the holder's cut-off")
            try:
                with self._watch(None):
                    c = pg.connect(
                        self.url.conninfo,
                        autocommit=True,
                        connect_timeout=max(_CONNECT_TIMEOUT, int(self.timeout)),
                        application_name="pearing",
                    )
                if not self.url.listen:
                    # Behind a pooler in transaction mode (listen=0) the next statement may reach
                    # another server connection: none prepared on the server, no session setting
                    # (the pooler's own idle_transaction_timeout does the next one's work there).
                    c.prepare_threshold = None
                else:
                    c.execute(f"SET idle_in_transaction_session_timeout = {_IDLE_IN_TRANSACTION_MS}")
            except pg.Error as exc:
                raise self._unavailable(exc) from None
            self._conn = c
            self._ensure_schema(c)
        return self._conn

    @contextlib.contextmanager
    def _watch(self, fd: int | None) -> Iterator[None]:
        """While inside: past ``timeout``, the connection's socket is shut down, so a request
        blocked on a server that stopped answering fails now instead of hanging."""
        if fd is None:
            yield
            return
        fired = threading.Event()

        def cut() -> None:
            fired.set()
            with contextlib.suppress(OSError):
                s = socket.socket(fileno=os.dup(fd))
                try:
                    s.shutdown(socket.SHUT_RDWR)
                finally:
                    s.close()

        timer = threading.Timer(self._left(), cut)
        timer.daemon = True
        timer.start()
        try:
            yield
        finally:
            timer.cancel()

    @contextlib.contextmanager
    def tx(self) -> Iterator[psycopg.Cursor[Any]]:
        """A transaction (or, nested, a savepoint); any failure to reach the server is
        BackendUnavailable, a value of the wrong type in a row is the caller's to name."""
        pg = _psycopg()
        c = self.conn()
        try:
            with self._watch(c.fileno()), c.transaction(), c.cursor() as cur:
                yield cur
        except _cut_off(pg) as exc:
            raise self._unavailable(exc) from None

    def q(self, sql: str, params: Any = ()) -> list[tuple[Any, ...]]:
        """One statement on its own (autocommit); its rows."""
        pg = _psycopg()
        c = self.conn()
        try:
            with self._watch(c.fileno()), c.cursor() as cur:
                cur.execute(sql.replace("{s}", self.s), params)
                return cur.fetchall() if cur.description is not None else []
        except _cut_off(pg) as exc:
            raise self._unavailable(exc) from None

    def notified(self, timeout: float) -> bool:
        """Block until a NOTIFY on a channel this connection LISTENs on, at most ``timeout``
        seconds (0: only what has arrived); whether one came. BackendUnavailable if it broke."""
        pg = _psycopg()
        try:
            return any(True for _ in self.conn().notifies(timeout=max(0.0, timeout), stop_after=1))
        except _cut_off(pg) as exc:
            raise self._unavailable(exc) from None

    def ex(self, cur: psycopg.Cursor[Any], sql: str, params: Any = ()) -> list[tuple[Any, ...]]:
        """One statement in ``tx``'s transaction; its rows. ``{s}`` in ``sql`` is the schema."""
        cur.execute(sql.replace("{s}", self.s), params)
        return cur.fetchall() if cur.description is not None else []

    def one(self, cur: psycopg.Cursor[Any], sql: str, params: Any = ()) -> tuple[Any, ...] | None:
        rows = self.ex(cur, sql, params)
        return rows[0] if rows else None

    # -- the schema ----------------------------------------------------------------------------

    def _ensure_schema(self, c: psycopg.Connection[Any]) -> None:
        pg = _psycopg()
        try:
            with self._watch(c.fileno()):
                row = c.execute(f"SELECT max(version) FROM {self.s}.pearing_schema").fetchone()
            if row is not None and (row[0] or 0) >= schema.VERSION:
                return
        except (pg.errors.UndefinedTable, pg.errors.InvalidSchemaName):
            pass
        except _cut_off(pg) as exc:
            raise self._unavailable(exc) from None
        for attempt in range(5):
            try:
                with self._watch(c.fileno()), c.transaction():
                    self._migrate(c)
                return
            except pg.errors.InsufficientPrivilege as exc:
                self.close()
                raise NotPermitted(
                    self.url.masked,
                    f"may not create schema {self.schema!r} ({str(exc).strip().splitlines()[0]}); "
                    "have a DBA run: pearing-cli init-db --print-sql",
                ) from None
            except (pg.errors.UniqueViolation, pg.errors.DuplicateObject, pg.errors.DuplicateTable):
                if attempt == 4:
                    raise
            except _cut_off(pg) as exc:
                raise self._unavailable(exc) from None

    def _migrate(self, c: psycopg.Connection[Any]) -> None:
        for sql in schema.head(self.schema):
            c.execute(sql)
        # Two first users at once: the second waits here, then finds the steps applied.
        c.execute(f"LOCK TABLE {self.s}.pearing_schema IN EXCLUSIVE MODE")
        row = c.execute(f"SELECT max(version) FROM {self.s}.pearing_schema").fetchone()
        for version, stmts in schema.steps(self.schema, (row[0] if row else None) or 0):
            for sql in stmts:
                c.execute(sql)
            c.execute(f"INSERT INTO {self.s}.pearing_schema (version) VALUES (%s)", (version,))


def corrupt(table: str, key: str, detail: str) -> CorruptRecord:
    """A row written by hand with a value of the wrong type: 74, naming its table and key."""
    return CorruptRecord(f"postgresql table {table} key {key}", detail)
