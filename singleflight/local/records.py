"""The lock dir's records of a lock's runs: request records (dedupe) and the last success
(--min-interval), beside the lock's tickets."""

from __future__ import annotations

import time
from typing import Any

from singleflight.core import proc
from singleflight.core.request import RequestRecord
from singleflight.core.ticket import Ticket
from singleflight.local.store import LockStore


class LocalRecords:
    """What ``LockOps`` offers of a lock's records, on the lock dir."""

    store: LockStore

    def last_success(self) -> float | None:
        return self.store.read_last_success()

    def read_request(self, request_uuid: str) -> tuple[RequestRecord | None, Any]:
        rec = self.store.read_request(request_uuid)
        return rec, rec

    def put_request(self, ticket: Ticket, record: RequestRecord | None, seen: Any) -> bool:
        """Compare-and-swap under the lock's mutex: only if the record is still the one ``seen``."""
        store, uuid = self.store, ticket.request_uuid
        with store.mutex():
            cur = store.read_request(uuid)
            if (cur.to_json() if cur else None) != (seen.to_json() if seen else None):
                return False
            if record is None:
                store.remove_request(uuid)
            else:
                store.write_request(uuid, record)
        return True

    def request_alive(self, record: RequestRecord) -> bool:
        """Is the run that claimed this request still waiting or holding?"""
        if record.pid is not None and proc.alive(record.pid, record.start):
            return True
        t = self.store.read_ticket(record.ticket_id) if record.ticket_id else None
        return t is not None and t.live and proc.alive(t.holder_pid, t.holder_start)

    def prepare_request(self, ticket: Ticket, window: float) -> None:
        # The success record is written (and fsynced) now, while there is room, so a
        # success at the end only renames it into place: a disk that filled up while
        # COMMAND ran cannot make a finished request look unfinished and run it twice.
        # Its dedupe window therefore counts from the start of the run.
        record = RequestRecord.finished(ticket, 0, window)
        record.finished_at = None
        self.store.sub("requests").write_atomic(_prepared(ticket), record.to_json(), durable=True)

    def record_request(self, ticket: Ticket, status: int | None, window: float) -> None:
        requests, uuid = self.store.sub("requests"), ticket.request_uuid
        try:
            if status == 0 and requests.lstat(_prepared(ticket)) is not None:
                requests.rename(_prepared(ticket), f"{uuid}.json")
                requests.fsync()
                return
            self.store.write_request(uuid, RequestRecord.finished(ticket, status, window))
        finally:
            requests.unlink(_prepared(ticket))

    def record_success(self, ticket: Ticket) -> None:
        self.store.write_last_success(ticket.acquired_at or time.time(), ticket.ticket_id)


def _prepared(ticket: Ticket) -> str:
    return f".{ticket.request_uuid}.succeeded"
