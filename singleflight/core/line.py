"""A lock's line as a backend reads it, for the views above (``rules.tickets.status``)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from singleflight.core.ticket import Ticket


class Line:
    """The line as it stands: ``entries`` in order, the first holding the lock when ``held``
    (a ticket, or another client's key as its public dict, with ``lease_left`` when it holds);
    the lock's ``fence`` (the last one issued, held or not); and what the backend shows beside
    them (``extra``: etcd's mutex prefix)."""

    __slots__ = ("entries", "extra", "fence", "held")

    def __init__(
        self, entries: list[Ticket | dict[str, Any]], *, held: bool, fence: int | None, extra: dict[str, Any]
    ) -> None:
        self.entries, self.held, self.fence, self.extra = entries, held, fence, extra
