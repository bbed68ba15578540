"""The one acquire path: pearing-run's wrapper and the agent behind pearing-cli, pearing-mcp
and ``Lock`` take the lock through ``acquire``, so the FIFO rules cannot differ between them."""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable
from typing import TYPE_CHECKING

from singleflight.core.const import CANCELLED
from singleflight.core.errors import PearingError

if TYPE_CHECKING:
    from singleflight.backend import Grip, LockOps
    from singleflight.core.ticket import Ticket

# A newcomer that cancelled an opted-in holder waits at least its kill grace and this much more.
_CANCEL_SLACK = 5.0


def acquire(
    lk: LockOps,
    ticket: Ticket,
    *,
    until: float,
    ticket_deadline: Callable[[], float],
    on_queued: Callable[[int], None],
    timeout_reason: str,
) -> Grip | None:
    """The lock at once (when free and nobody is in line), or a place in line and a bounded wait.

    Waits until ``until`` (monotonic) at most, and no longer than ``ticket_deadline()`` (the
    waiting ticket's lease; 0 once it was released or superseded). A ticket that opted in to
    cancel-in-progress first asks an opted-in holder to stop, and then waits at least that
    holder's kill grace and a few seconds. ``ticket.queue_mode`` ``latest`` replaces the older
    ``latest`` waiters (the backend's ``queue``). None when busy or when the wait ran out; the
    ticket is then ended as cancelled with ``timeout_reason`` (unless it was superseded).
    """
    place = lk.enter(ticket)
    if place.grip is not None:
        return place.grip
    if ticket.cancel_in_progress:
        grace = lk.cancel_holder(ticket)
        if grace is not None:
            until = max(until, time.monotonic() + grace + _CANCEL_SLACK)
    if until <= time.monotonic():
        place.leave()
        return None

    def deadline() -> float:
        return min(until, ticket_deadline())

    # Import what holding needs now, while we wait, not after the hand-over.
    import hashlib  # noqa: F401
    import json  # noqa: F401
    import secrets  # noqa: F401
    import select  # noqa: F401

    from singleflight import holder  # noqa: F401

    grip = None
    try:
        on_queued(place.queue(deadline()))
        grip = place.wait(deadline)
        if grip is None:
            with contextlib.suppress(PearingError):
                lk.end(ticket.ticket_id, CANCELLED, timeout_reason, only_if_held=False)
    finally:
        place.leave()
    return grip
