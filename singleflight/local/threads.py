"""The lock dir's thread service: one SQLite database, ``LOCK_DIR/threads.sqlite3`` (WAL).

A reply and the thread's highest fence change in one ``BEGIN IMMEDIATE`` transaction, only while
the highest fence is still the one the rule judged (rules/threads.py), so a lower fence can never
be stored after a higher one, whatever the interleaving of writers. ``synchronous=FULL``: an
accepted fence survives a power cut, so a stale writer is refused after a reboot too.

The database is opened through the lock dir's own fd (``/proc/self/fd/N/...``), so a symlink
put where the lock dir was is never followed, and the file itself must be a regular file of
this user's that nobody else can write (as the ledger). SQLite's ``-wal`` and ``-shm`` files
live beside it, in the lock dir that only this user can write.
"""

from __future__ import annotations

import json
import os
import sqlite3
import time
from typing import Any

from singleflight.core.errors import CorruptRecord, NotPermitted
from singleflight.core.fs import Dir, check_trusted
from singleflight.core.record import epoch

NAME = "threads.sqlite3"
SCHEMA_VERSION = 1
_SCHEMA = (
    "CREATE TABLE IF NOT EXISTS schema_version (version INTEGER NOT NULL)",
    "CREATE TABLE IF NOT EXISTS threads (repo TEXT NOT NULL, thread INTEGER NOT NULL, fence INTEGER,"
    " PRIMARY KEY (repo, thread))",
    "CREATE TABLE IF NOT EXISTS replies (seq INTEGER PRIMARY KEY AUTOINCREMENT, repo TEXT NOT NULL,"
    " thread INTEGER NOT NULL, reply_id TEXT NOT NULL UNIQUE, parent_id TEXT, kind TEXT NOT NULL,"
    " body TEXT NOT NULL, links TEXT NOT NULL, identity TEXT NOT NULL, fence INTEGER, ticket_id TEXT,"
    " created_at REAL NOT NULL)",
    "CREATE INDEX IF NOT EXISTS replies_by_thread ON replies (repo, thread, seq)",
)
_COLUMNS = "reply_id, parent_id, kind, body, links, identity, fence, ticket_id, created_at"
# Writers queue on SQLite's lock; one reply is one short transaction.
_BUSY_MS = 30_000


class Threads:
    """The thread service on the lock dir ``root`` (an open, checked ``Dir``)."""

    def __init__(self, root: Dir) -> None:
        self.root = root
        self.path = root.child_path(NAME)

    def _connect(self) -> sqlite3.Connection:
        fd = self.root.open(NAME, os.O_RDWR | os.O_CREAT | os.O_NOCTTY | os.O_NONBLOCK, 0o600)
        try:
            checked = os.fstat(fd)
            check_trusted(self.path, checked, "the thread database")
            # By the directory's fd: a symlink put where the lock dir was is not followed.
            by_fd = f"/proc/self/fd/{self.root.fd}/{NAME}"
            db = sqlite3.connect(by_fd, timeout=_BUSY_MS / 1000, isolation_level=None)
            st = os.stat(by_fd, follow_symlinks=False)
            if (st.st_dev, st.st_ino) != (checked.st_dev, checked.st_ino):
                db.close()
                raise NotPermitted(self.path, "was replaced while it was opened; refusing it")
        finally:
            os.close(fd)
        try:
            db.execute(f"PRAGMA busy_timeout = {_BUSY_MS}")
            db.execute("PRAGMA journal_mode = WAL")
            db.execute("PRAGMA synchronous = FULL")
            self._migrate(db)
        except sqlite3.DatabaseError as exc:
            db.close()
            raise CorruptRecord(self.path, f"not a thread database: {exc}") from None
        return db

    def _migrate(self, db: sqlite3.Connection) -> None:
        """Created on first use; a newer schema than ours is refused, never rewritten."""
        db.execute("BEGIN IMMEDIATE")
        try:
            for ddl in _SCHEMA:
                db.execute(ddl)
            row = db.execute("SELECT max(version) FROM schema_version").fetchone()
            version = row[0] if row else None
            if version is None:
                db.execute("INSERT INTO schema_version (version) VALUES (?)", (SCHEMA_VERSION,))
            elif not isinstance(version, int) or version > SCHEMA_VERSION:
                raise CorruptRecord(self.path, f"schema version {version!r}; this version knows {SCHEMA_VERSION}")
            db.execute("COMMIT")
        except BaseException:
            db.execute("ROLLBACK")
            raise

    def read(self, repo: str, thread: int) -> tuple[list[dict[str, Any]], int | None]:
        db = self._connect()
        try:
            db.execute("BEGIN")
            rows = db.execute(
                f"SELECT {_COLUMNS} FROM replies WHERE repo = ? AND thread = ? ORDER BY seq", (repo, thread)
            ).fetchall()
            top = db.execute("SELECT fence FROM threads WHERE repo = ? AND thread = ?", (repo, thread)).fetchone()
            db.execute("COMMIT")
        except sqlite3.DatabaseError as exc:
            raise CorruptRecord(self.path, str(exc)) from None
        finally:
            db.close()
        highest = self._fence(top[0] if top else None, f"thread {repo}#{thread}")
        return [self._reply(r) for r in rows], highest

    def add(self, repo: str, thread: int, reply: dict[str, Any], *, highest: int | None) -> bool:
        """``Backend.add_reply``: one ``BEGIN IMMEDIATE`` transaction, the check and the insert."""
        where = f"thread {repo}#{thread}"
        fence, parent = reply["fence"], reply["parent_id"]
        db = self._connect()
        try:
            db.execute("BEGIN IMMEDIATE")
            try:
                if db.execute("SELECT 1 FROM replies WHERE reply_id = ?", (reply["reply_id"],)).fetchone():
                    db.execute("ROLLBACK")
                    return True  # stored already (a retry of the same reply)
                top = db.execute("SELECT fence FROM threads WHERE repo = ? AND thread = ?", (repo, thread)).fetchone()
                if self._fence(top[0] if top else None, where) != highest:
                    db.execute("ROLLBACK")
                    return False  # another writer's fence landed since the rule read it
                db.execute(
                    f"INSERT INTO replies (repo, thread, {_COLUMNS}) VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?)",
                    (
                        repo,
                        thread,
                        reply["reply_id"],
                        parent,
                        reply["kind"],
                        reply["body"],
                        json.dumps(reply["links"]),
                        reply["identity"],
                        fence,
                        reply["ticket_id"],
                        reply.get("created_at", time.time()),
                    ),
                )
                if fence is not None and (highest is None or fence > highest):
                    db.execute(
                        "INSERT INTO threads (repo, thread, fence) VALUES (?, ?, ?)"
                        " ON CONFLICT (repo, thread) DO UPDATE SET fence = excluded.fence",
                        (repo, thread, fence),
                    )
                db.execute("COMMIT")
                return True
            except BaseException:
                if db.in_transaction:
                    db.execute("ROLLBACK")
                raise
        except sqlite3.DatabaseError as exc:
            raise CorruptRecord(self.path, str(exc)) from None
        finally:
            db.close()

    def _fence(self, value: object, where: str) -> int | None:
        if value is None:
            return None
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise CorruptRecord(self.path, f"{where}: fence {value!r} is not a positive integer")
        return value

    def _reply(self, row: tuple[Any, ...]) -> dict[str, Any]:
        reply_id, parent_id, kind, body, links, identity, fence, ticket_id, created_at = row
        where = f"reply {reply_id!r}"
        try:
            parsed = json.loads(links) if isinstance(links, str) else None
        except ValueError:
            parsed = None
        ok = (
            isinstance(reply_id, str)
            and (parent_id is None or isinstance(parent_id, str))
            and isinstance(kind, str)
            and isinstance(body, str)
            and isinstance(parsed, list)
            and all(isinstance(x, str) for x in parsed)
            and isinstance(identity, str)
            and (ticket_id is None or isinstance(ticket_id, str))
        )
        try:
            created_at = epoch(created_at if ok else None, "created_at")
        except TypeError:
            ok = False
        if not ok:
            raise CorruptRecord(self.path, f"{where}: a column holds a value of the wrong type")
        return {
            "reply_id": reply_id,
            "parent_id": parent_id,
            "kind": kind,
            "body": body,
            "links": parsed,
            "identity": identity,
            "fence": self._fence(fence, where),
            "ticket_id": ticket_id,
            "created_at": created_at,
        }
