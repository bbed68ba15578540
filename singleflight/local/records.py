"""The lock dir's records of a lock's runs: the last success (``success``) and one file per request
(``requests/UUID.json``), beside the lock's tickets. What they hold is rules/requests.py's."""

from __future__ import annotations

from typing import Any

from singleflight.core import proc
from singleflight.core.fs import Dir
from singleflight.core.request import ANY_VERSION, REQUEST_PREFIX, SUCCESS_RECORD, RequestRecord
from singleflight.core.ticket import Ticket
from singleflight.local.store import LockStore


class LocalRecords:
    """What ``LockOps`` offers of a lock's records, on the lock dir."""

    store: LockStore

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
        return (None if body is not None and self._dead_claim(body) else body), body, d.child_path(file)

    def _dead_claim(self, body: bytes) -> bool:
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
        d, file, durable = self._where(name)
        prepared = _prepared(file)
        try:
            with store.mutex():
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
            if body is not None:
                d.unlink(prepared)

    def prepare_record(self, name: str, body: bytes) -> None:
        # Written (and fsynced) now, while there is room: at the end it is only renamed.
        d, file, _ = self._where(name)
        d.write_atomic(_prepared(file), body, durable=True)


def _prepared(file: str) -> str:
    return f".{file.removesuffix('.json')}.succeeded"
