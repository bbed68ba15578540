"""A lock's line as a backend reads it, for the views above (``rules.tickets.status``)."""

from __future__ import annotations

from singleflight.core.const import TYPE_CHECKING

if TYPE_CHECKING:
    from typing import Any

    from singleflight.core.ticket import Ticket


class Line:
    """The line as it stands: ``entries`` in order, the first holding the lock when ``held``
    (a ticket, or another client's key as its public dict, with ``lease_left`` when it holds);
    the lock's ``fence`` (the last one issued, held or not); and what the backend shows beside
    them (``extra``: etcd's mutex prefix). ``unplaced``: waiting tickets listed last that have
    no place in line yet (the lock dir's agent that is still starting); they have no position.
    With ``--slots``, the first ``holders`` entries hold (lowest fence first) of ``slots``."""

    __slots__ = ("entries", "extra", "fence", "held", "holders", "slots", "unplaced")

    def __init__(
        self,
        entries: list[Ticket | dict[str, Any]],
        *,
        held: bool,
        fence: int | None,
        extra: dict[str, Any],
        unplaced: frozenset[str] = frozenset(),
        holders: int | None = None,
        slots: int = 1,
    ) -> None:
        self.entries, self.held, self.fence, self.extra = entries, held, fence, extra
        self.unplaced = unplaced
        self.holders = (1 if held else 0) if holders is None else holders
        self.slots = slots

    def position(self, ticket_id: str) -> int | None:
        """A waiting ticket's 1-based place behind the holder (None: the holder, or not in line)."""
        waiters = self.entries[self.holders :]
        for i, e in enumerate(waiters):
            if not isinstance(e, dict) and e.ticket_id == ticket_id:
                return None if ticket_id in self.unplaced else i + 1
        return None
