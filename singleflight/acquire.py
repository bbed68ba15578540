"""The one acquire path: pearing-run's wrapper and the agent behind pearing-cli, pearing-mcp
and ``Lock`` take the lock through ``acquire``, so the FIFO rules cannot differ between them."""

from __future__ import annotations

import contextlib
import time

from singleflight.core import fault
from singleflight.core.const import CANCELLED, TYPE_CHECKING
from singleflight.core.errors import LineFull, PearingError
from singleflight.core.reasons import EndReason
from singleflight.rules import events

if TYPE_CHECKING:
    from collections.abc import Callable

    from singleflight.backend import Grip, LockOps
    from singleflight.core.ticket import Ticket


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
    cancel-in-progress asks an opted-in holder to stop once it is in line, and then waits at
    least that holder's kill grace and a few seconds; leaving without the lock, it takes its
    request back, or, if the holder acted on it already, keeps its place until that run is
    gone (``rules.events``). ``ticket.queue_mode`` ``latest`` replaces the older ``latest``
    waiters (the backend's ``queue``). None when busy or when the wait ran out; the ticket is
    then ended as cancelled with ``timeout_reason`` (unless it was superseded). ``LineFull``
    when the line held ``ticket.max_waiting`` waiters as it arrived (the backend counts and
    joins in one step); the ticket is ended as cancelled, line full, before it is raised.
    """
    grip, place = lk.enter(ticket)
    if grip is not None:
        return grip
    holder = events.target(lk, ticket) if ticket.cancel_in_progress else None
    if holder is not None:
        until = max(until, time.monotonic() + holder.grace + events.SLACK)
    if until <= time.monotonic():
        place.leave()
        return None

    def deadline() -> float:
        return min(until, ticket_deadline())

    # Import what holding needs now, while we wait, not after the hand-over.
    import select  # noqa: F401

    from singleflight import holder as _holder  # noqa: F401

    asked = None
    try:
        try:
            # Asked by the backend, not here: a run's ticket is written as it joins (the lock
            # dir's ``queue``), and before that its lease reads as ended, 0.
            position = place.queue(deadline)
        except LineFull:
            # Ended while its key is still in line (etcd): the end record says why, not a lapse.
            with contextlib.suppress(PearingError):
                lk.end(ticket.ticket_id, CANCELLED, EndReason.LINE_FULL, only_if_held=False)
            raise
        fault.pause("pause-queued")
        on_queued(position)
        # Asked once we are in line: a holder acts only on a request whose newcomer waits there.
        asked = events.ask(lk, ticket, holder) if holder is not None else None
        grip = place.wait(deadline)
        while grip is None and asked is not None:
            more = 0.0
            with contextlib.suppress(PearingError):  # not taken back: our leaving the line says it
                more = events.withdraw(lk, ticket, asked)
            if more <= 0 or ticket_deadline() <= time.monotonic():
                break
            # Its run is being stopped for us: whatever our own wait, we take the lock after it,
            # or neither run would do the work.
            until = time.monotonic() + more
            grip = place.wait(deadline)
        if grip is None:
            with contextlib.suppress(PearingError):
                lk.end(ticket.ticket_id, CANCELLED, timeout_reason, only_if_held=False)
    except BaseException:
        if asked is not None and grip is None:  # ^C: our request goes with us
            with contextlib.suppress(PearingError):
                events.withdraw(lk, ticket, asked)
        raise
    finally:
        place.leave()
    return grip
