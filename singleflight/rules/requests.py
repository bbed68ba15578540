"""What a run leaves behind for the next ones: its request's outcome (--request-uuid, --request-key)
and a success's start (--min-interval). Written by one function, whoever finishes the run: its
holder, or its wrapper when the holder died after COMMAND ended."""

from __future__ import annotations

from typing import TYPE_CHECKING

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
