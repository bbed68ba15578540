"""The lock dir's records: a lock's last success (``success``) and one file per request
(``requests/UUID.json``), beside the lock's tickets; an identity's activity (``activity/ID``);
the fence ledger (``ledger.json``, ``core.ledger``). What they hold is the rules'."""

from __future__ import annotations

import fcntl

from singleflight.core import proc
from singleflight.core.const import TYPE_CHECKING
from singleflight.core.fs import Dir
from singleflight.core.request import ACTIVITY_PREFIX, ANY_VERSION, REQUEST_PREFIX, SUCCESS_RECORD, Key, RequestRecord
from singleflight.core.ticket import Ticket
from singleflight.local.store import LockStore

if TYPE_CHECKING:
    from typing import Any


class LockRecords:
    """A lock's records, in its directory."""

    def __init__(self, store: LockStore) -> None:
        self.store = store

    def _where(self, name: str) -> tuple[Dir, str, bool]:
        """The directory and file of a record, and whether it must survive a crash (a request's:
        a finished run's record lost would run its replay again)."""
        if name == SUCCESS_RECORD:
            return self.store.dir, "success", False
        if name.startswith(REQUEST_PREFIX):
            return self.store.sub("requests"), name[len(REQUEST_PREFIX) :] + ".json", True
        raise ValueError(f"no such record: {name!r}")

    def read_record(self, name: str) -> tuple[bytes | None, Any, str]:
        d, file, _ = self._where(name)
        body = d.read(file)
        return (None if body is not None and self.dead_claim(body) else body), body, d.child_path(file)

    def dead_claim(self, body: bytes) -> bool:
        """A request's claim whose run is gone: its claimant (or its ticket's process) is dead. On
        disk it stays until overwritten; it reads as none."""
        try:
            rec = RequestRecord.from_json(body)
        except (ValueError, TypeError):
            return False  # the rules read it, and name it corrupt
        if not rec.active:
            return False
        if rec.pid is not None and proc.alive(rec.pid, rec.start):
            return False
        t = self.store.read_ticket(rec.ticket_id) if rec.ticket_id else None
        return not (t is not None and t.live and proc.alive(t.holder_pid, t.holder_start))

    def write_record(
        self, name: str, body: bytes | None, seen: Any, *, run: Ticket | None = None, keep: float | None = None
    ) -> bool:
        """Compare-and-swap under the lock's mutex. ``run`` and ``keep`` need nothing here: a
        dead run's claim reads as none, and housekeeping prunes a request after its window."""
        store = self.store
        d: Dir | None = None
        try:
            with store.mutex():
                # Found under the mutex: a lock pruned as idle before is opened afresh by it.
                d, file, durable = self._where(name)
                prepared = _prepared(file)
                if seen is not ANY_VERSION and d.read(file) != seen:
                    return False
                if body is None:
                    d.unlink(file)
                elif d.read(prepared) == body:
                    d.rename(prepared, file)
                    d.fsync()
                else:
                    d.write_atomic(file, body, durable=durable)
            return True
        finally:
            if body is not None and d is not None:
                d.unlink(_prepared(file))

    def prepare_record(self, name: str, body: bytes) -> None:
        # Written (and fsynced) now, while there is room: at the end it is only renamed.
        d, file, _ = self._where(name)
        d.write_atomic(_prepared(file), body, durable=True)


def _prepared(file: str) -> str:
    return f".{file.removesuffix('.json')}.succeeded"


class ActivityRecords:
    """Each identity's activity, one file per identity in ``activity/``. A compare-and-set holds
    the directory's own flock; a write whatever is there (the usual one) needs none."""

    def __init__(self, root: Dir) -> None:
        self.root = root

    @staticmethod
    def _identity(key: Key) -> str:
        if key.lock is not None or not key.name.startswith(ACTIVITY_PREFIX):
            raise ValueError(f"no such record: {key!r}")
        return key.name[len(ACTIVITY_PREFIX) :]

    def read_record(self, key: Key) -> tuple[bytes | None, Any, str]:
        identity = self._identity(key)
        with self.root.sub("activity") as d:
            body = d.read(identity)
            return body, body, d.child_path(identity)

    def write_record(self, key: Key, body: bytes | None, seen: Any) -> bool:
        identity = self._identity(key)
        with self.root.sub("activity") as d:
            if seen is not ANY_VERSION:
                fcntl.flock(d.fd, fcntl.LOCK_EX)  # released as the directory's fd closes
                if d.read(identity) != seen:
                    return False
            if body is None:
                d.unlink(identity)
            else:
                d.write_atomic(identity, body, durable=False)
            return True
