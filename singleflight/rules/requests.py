"""What a run leaves behind for the next ones: its request's outcome (--request-uuid, --request-key)
and a success's start (--min-interval). Written by one function, whoever finishes the run: its
holder, or its wrapper when the holder died after COMMAND ended.

A backend only reads and compare-and-sets a lock's named records (``Backend.read_record``,
``write_record``) and can prepare one ahead (``prepare_record``); what they hold, when a claim
stands and how long a record is kept are decided here.
"""

from __future__ import annotations

import contextlib
import time

from singleflight.core import jsontext
from singleflight.core.const import CLAIM_BUSY, CLAIM_DONE, CLAIM_RUN, REQUEST_ACTIVE, TYPE_CHECKING
from singleflight.core.errors import BackendUnavailable, CorruptRecord
from singleflight.core.record import epoch, loads
from singleflight.core.request import ANY_VERSION, SUCCESS_RECORD, Key, RequestRecord, lock_record, request_record

if TYPE_CHECKING:
    from typing import Any

    from singleflight.backend import Backend
    from singleflight.core.ticket import Ticket


def _key(t: Ticket, name: str) -> Key:
    return lock_record(t.repo, t.lock_name, name)


def record_end(backend: Backend, ticket: Ticket, status: int | None, *, window: float | None, success: bool) -> None:
    """The end-of-run record: the request's outcome (``window``: its dedupe window, None when the
    run named no request) and, if ``success`` is asked for and COMMAND exited 0, its start.

    Written before the lock is released, so a waiter promoted next sees it and is deduplicated.
    Raises the store's error: a success that could not be recorded must not pass for one that was.
    """
    if window is not None:
        rec = RequestRecord.succeeded(ticket, window) if status == 0 else RequestRecord.finished(ticket, status, window)
        keep = max(1.0, (rec.expires_at or 0.0) - time.time())
        backend.write_record(_key(ticket, request_record(ticket.request_uuid)), rec.to_json(), ANY_VERSION, keep=keep)
    if success and status == 0:
        body = {"started_at": ticket.acquired_at or time.time(), "ticket_id": ticket.ticket_id, "fence": ticket.fence}
        backend.write_record(_key(ticket, SUCCESS_RECORD), jsontext.dumps(body).encode(), ANY_VERSION)


def prepare_end(backend: Backend, ticket: Ticket, window: float) -> None:
    """Before COMMAND starts: the success record its end would write, prepared now, while there is
    room, so a disk that filled up meanwhile cannot make a finished request look unfinished and
    run it twice. (So a success's dedupe window counts from the run's start.)"""
    backend.prepare_record(
        _key(ticket, request_record(ticket.request_uuid)), RequestRecord.succeeded(ticket, window).to_json()
    )


def last_success(backend: Backend, repo: str, lock: str) -> float | None:
    """When the last run of this (scope, lock) that succeeded started (epoch seconds)."""
    body, _, where = backend.read_record(lock_record(repo, lock, SUCCESS_RECORD))
    if body is None:
        return None
    try:
        return epoch(loads(body)["started_at"], "started_at")
    except (ValueError, KeyError, TypeError, AttributeError) as exc:
        raise CorruptRecord(where, f"not a success record: {exc}") from None


def read_request(backend: Backend, ticket: Ticket) -> tuple[RequestRecord | None, Any]:
    """The record of ``ticket``'s request (None: none, or a claim whose run is gone), and its version."""
    body, seen, where = backend.read_record(_key(ticket, request_record(ticket.request_uuid)))
    if body is None:
        return None, seen
    try:
        return RequestRecord.from_json(body), seen
    except (ValueError, TypeError) as exc:
        raise CorruptRecord(where, f"not a request record: {exc}") from None


# A claim races only other runs of the same request; past this many lost races it is in flight.
_CLAIM_TRIES = 50


def claim(backend: Backend, ticket: Ticket) -> str:
    """Before a run of ``ticket.request_uuid``: CLAIM_RUN (the request is ours now), CLAIM_DONE
    (it succeeded within its dedupe window: a replay does no work twice) or CLAIM_BUSY (another
    run of it holds or waits). The claim lives as long as the run (``unclaim`` puts back what
    was there if the run does not happen after all)."""
    uuid = ticket.request_uuid
    for _ in range(_CLAIM_TRIES):
        rec, seen = read_request(backend, ticket)
        now = time.time()
        if rec is not None:
            if rec.active and rec.ticket_id == ticket.ticket_id:
                # Our own claim: a write sent again to the next member, after the first had
                # applied it and died before answering, finds it there.
                return CLAIM_RUN
            if rec.succeeded_within(now):
                return CLAIM_DONE
            if rec.active:
                return CLAIM_BUSY  # a claim whose run is gone reads as none (``read_record``)
        mine = RequestRecord(
            state=REQUEST_ACTIVE,
            ticket_id=ticket.ticket_id,
            pid=ticket.holder_pid,
            start=ticket.holder_start,
            created_at=now,
            previous=rec,
        )
        if backend.write_record(_key(ticket, request_record(uuid)), mine.to_json(), seen, run=ticket):
            return CLAIM_RUN
        # Another run of the request changed the record between our read and write: look again.
    return CLAIM_BUSY


def unclaim(backend: Backend, ticket: Ticket) -> None:
    """The run did not happen after all (busy, timed out, deduplicated while waiting): the request
    record goes back to what it was before our claim. Best effort: an unreachable store keeps the
    claim, which lapses with the run (etcd: its lease) or reads as dead (the lock dir)."""
    with contextlib.suppress(BackendUnavailable):
        rec, seen = read_request(backend, ticket)
        if rec is not None and rec.ticket_id == ticket.ticket_id:
            previous = rec.previous
            body = previous.to_json() if previous is not None else None
            keep = None if previous is None else max(1.0, (previous.expires_at or 0.0) - time.time())
            backend.write_record(_key(ticket, request_record(ticket.request_uuid)), body, seen, keep=keep)
