"""Why a ticket ended, or a lease was lost: one enum, so no reason is a string parsed back.

A ticket's record keeps the reason's text (``end_reason``, shown to users); code passes the
``EndReason`` and, over the holder's pipe, a ``Loss`` names it (``lost NAME TEXT``). A
superseded ticket says by whom in ``superseded_by``, never only in its text.
"""

from __future__ import annotations

from enum import Enum


class EndReason(str, Enum):
    RELEASED_BY_OWNER = "released by owner"
    COMMAND_EXITED = "command exited"  # + its status
    COMMAND_ENDED = "command ended"  # its status unknown (the wrapper was killed)
    DEDUPLICATED = "deduplicated"
    HOLDER_GONE = "holder gone"
    WAITER_GONE = "waiter gone"
    LEASE_EXPIRED = "lease expired"
    LAPSED_BEFORE_START = "lease lapsed before COMMAND started"
    UNREACHABLE = "backend unreachable"
    WAIT_TIMED_OUT = "wait timed out"
    WAITING_LEASE_EXPIRED = "waiting lease expired without heartbeat"
    SUPERSEDED = "superseded by"  # + the newer ticket
    LINE_FULL = "line full"  # turned away by its --max-waiting: busy, never queued
    MAX_RUNTIME = "max runtime"  # + the limit
    STOPPED = "holder stopped by signal"  # + its name
    VANISHED = "ticket vanished"
    REFUSED = "refused"  # a renewal refused, a record unreadable: the error's own line is the text
    INTERNAL = "internal error in holder (a bug)"  # + the exception

    # Stored and shown as its text: str() and f-strings must not say "EndReason.X".
    def __str__(self) -> str:
        return self.value

    def __format__(self, spec: str) -> str:
        return self.value.__format__(spec)

    def text(self, detail: object = None) -> str:
        """The reason as recorded and shown, with its detail where it takes one."""
        if detail is None:
            return self.value
        if self is EndReason.MAX_RUNTIME:
            return f"max runtime {detail:g} s reached" if isinstance(detail, float) else f"max runtime {detail}"
        sep = ": " if self is EndReason.INTERNAL else " "
        return f"{self.value}{sep}{detail}"


class Loss:
    """A lost lease (or a released one) as a holder reports it: the reason and its text."""

    __slots__ = ("lapse_at", "reason", "text")

    def __init__(
        self, reason: EndReason, detail: object = None, *, text: str | None = None, lapse_at: float | None = None
    ) -> None:
        self.reason = reason
        self.text = text if text is not None else reason.text(detail)
        # A loss to a store out of reach: when (monotonic) the store may expire the lease and
        # promote the next. COMMAND must be dead by then, whatever its kill grace.
        self.lapse_at = lapse_at

    def __str__(self) -> str:
        return self.text

    def __repr__(self) -> str:
        return f"Loss({self.reason.name}, {self.text!r})"

    @property
    def released(self) -> bool:
        """Its owner released it (pearing-cli release-lock-ticket): not a loss of the run's."""
        return self.reason is EndReason.RELEASED_BY_OWNER

    @property
    def superseded(self) -> bool:
        """A newer run that opted in to cancel-in-progress asked it to stop: the run exits busy."""
        return self.reason is EndReason.SUPERSEDED

    @property
    def expired(self) -> bool:
        return self.reason in (EndReason.LEASE_EXPIRED, EndReason.LAPSED_BEFORE_START)
