"""What a run leaves behind for the next ones: its request's outcome (--request-uuid, --request-key)
and a success's start (--min-interval). Written by one function, whoever finishes the run: its
holder, or its wrapper when the holder died after COMMAND ended."""

from __future__ import annotations

import contextlib
import time
from typing import TYPE_CHECKING

from singleflight.core.const import CLAIM_BUSY, CLAIM_DONE, CLAIM_RUN, REQUEST_ACTIVE
from singleflight.core.errors import BackendUnavailable
from singleflight.core.request import RequestRecord

if TYPE_CHECKING:
    from singleflight.backend import LockOps
    from singleflight.core.ticket import Ticket


def record_end(lk: LockOps, ticket: Ticket, status: int | None, *, window: float | None, success: bool) -> None:
    """The end-of-run record: the request's outcome (``window``: its dedupe window, None when the
    run named no request) and, if ``success`` is asked for and COMMAND exited 0, its start.

    Written before the lock is released, so a waiter promoted next sees it and is deduplicated.
    Raises the store's error: a success that could not be recorded must not pass for one that was.
    """
    if window is not None:
        lk.record_request(ticket, status, window)
    if success and status == 0:
        lk.record_success(ticket)


# A claim races only other runs of the same request; past this many lost races it is in flight.
_CLAIM_TRIES = 50


def claim(lk: LockOps, ticket: Ticket) -> str:
    """Before a run of ``ticket.request_uuid``: CLAIM_RUN (the request is ours now), CLAIM_DONE
    (it succeeded within its dedupe window: a replay does no work twice) or CLAIM_BUSY (another
    run of it holds or waits). The claim lives as long as the run (``unclaim`` puts back what
    was there if the run does not happen after all)."""
    uuid = ticket.request_uuid
    for _ in range(_CLAIM_TRIES):
        rec, seen = lk.read_request(uuid)
        now = time.time()
        if rec is not None:
            if rec.active and rec.ticket_id == ticket.ticket_id:
                # Our own claim: a write sent again to the next member, after the first had
                # applied it and died before answering, finds it there.
                return CLAIM_RUN
            if rec.succeeded_within(now):
                return CLAIM_DONE
            if rec.active and lk.request_alive(rec):
                return CLAIM_BUSY
        mine = RequestRecord(
            state=REQUEST_ACTIVE,
            ticket_id=ticket.ticket_id,
            pid=ticket.holder_pid,
            start=ticket.holder_start,
            created_at=now,
            previous=rec,
        )
        if lk.put_request(ticket, mine, seen):
            return CLAIM_RUN
        # Another run of the request changed the record between our read and write: look again.
    return CLAIM_BUSY


def unclaim(lk: LockOps, ticket: Ticket) -> None:
    """The run did not happen after all (busy, timed out, deduplicated while waiting): the request
    record goes back to what it was before our claim. Best effort: an unreachable store keeps the
    claim, which lapses with the run (etcd: its lease) or reads as dead (the lock dir)."""
    with contextlib.suppress(BackendUnavailable):
        rec, seen = lk.read_request(ticket.request_uuid)
        if rec is not None and rec.ticket_id == ticket.ticket_id:
            lk.put_request(ticket, rec.previous, seen)
