"""The request record: what became of one request uuid, kept for dedupe and claims.

A plain ``__slots__`` class, not a dataclass, for the start-up reason given in ``ticket``.
"""

from __future__ import annotations

import time

from singleflight.core import jsontext
from singleflight.core.const import REQUEST_ACTIVE, REQUEST_FAILED, REQUEST_SUCCEEDED, TYPE_CHECKING
from singleflight.core.record import checked, is_uuid, loads

if TYPE_CHECKING:
    from collections.abc import Callable
    from typing import Any, Final

    from singleflight.core.ticket import Ticket

# A lock's records, as a backend names them (``Backend.read_record``): the last successful
# start (--min-interval) and one record per request uuid (--request-uuid / --request-key).
SUCCESS_RECORD: Final = "success"
REQUEST_PREFIX: Final = "request/"
# The backend's own records: what an identity is doing (update-user-activity), and the highest
# fence a target accepted per resource (pearing-guard fence).
ACTIVITY_PREFIX: Final = "activity/"
FENCE_PREFIX: Final = "fence/"


class Key:
    """Where a record lives in a backend: among a lock's (``lock``: its (scope, name)) or the
    backend's own (None), by ``name``. What a record holds is the rules' (``rules``)."""

    __slots__ = ("lock", "name")

    def __init__(self, lock: tuple[str, str] | None, name: str) -> None:
        self.lock, self.name = lock, name

    def __repr__(self) -> str:
        return f"Key({self.lock!r}, {self.name!r})"


def lock_record(repo: str, lock: str, name: str) -> Key:
    return Key((repo, lock), name)


def request_record(request_uuid: str) -> str:
    return REQUEST_PREFIX + request_uuid


def activity_record(identity: str) -> Key:
    return Key(None, ACTIVITY_PREFIX + identity)


def fence_record(resource: str) -> Key:
    return Key(None, FENCE_PREFIX + resource)


# ``Backend.write_record``'s ``seen`` for a write whatever the record holds now.
ANY_VERSION: Final = object()

_REQUEST_STATES: Final = frozenset({REQUEST_ACTIVE, REQUEST_SUCCEEDED, REQUEST_FAILED})
_REQUEST_STRINGS: dict[str, Callable[[str], bool]] = {"state": _REQUEST_STATES.__contains__, "ticket_id": is_uuid}
_REQUEST_TYPES: dict[str, tuple[type, ...]] = {
    "state": (str,),
    "ticket_id": (str,),
    "pid": (int,),
    "start": (int,),
    "fence": (int,),
    "status": (int,),
    "created_at": (int, float),
    "finished_at": (int, float),
    "expires_at": (int, float),
    "started_at": (int, float),
}


class RequestRecord:
    """What became of one request uuid: a run in flight (active) or how it ended."""

    __slots__ = (*_REQUEST_TYPES, "previous")

    def __init__(
        self,
        *,
        state: str,
        ticket_id: str | None = None,
        pid: int | None = None,
        start: int | None = None,
        fence: int | None = None,
        status: int | None = None,
        created_at: float | None = None,
        finished_at: float | None = None,
        expires_at: float | None = None,
        started_at: float | None = None,
        previous: RequestRecord | None = None,
    ) -> None:
        self.state, self.ticket_id, self.pid, self.start = state, ticket_id, pid, start
        self.fence, self.status = fence, status
        self.created_at, self.finished_at, self.expires_at, self.started_at = (
            created_at,
            finished_at,
            expires_at,
            started_at,
        )
        self.previous = previous

    state: str
    ticket_id: str | None
    pid: int | None
    start: int | None
    fence: int | None
    status: int | None
    created_at: float | None
    finished_at: float | None
    expires_at: float | None
    started_at: float | None
    previous: RequestRecord | None

    @classmethod
    def finished(cls, ticket: Ticket, status: int | None, window: float) -> RequestRecord:
        """How a request ended: a success is deduplicated for ``window`` seconds."""
        now = time.time()
        return cls(
            state=REQUEST_SUCCEEDED if status == 0 else REQUEST_FAILED,
            ticket_id=ticket.ticket_id,
            fence=ticket.fence,
            status=status,
            started_at=ticket.acquired_at,
            finished_at=now,
            expires_at=now + window,
        )

    @classmethod
    def succeeded(cls, ticket: Ticket, window: float) -> RequestRecord:
        """A run's success, deduplicated for ``window`` seconds from its start: the same bytes
        whenever and wherever it is built (holder or wrapper), so a copy prepared before COMMAND
        started is the one put in place at its end (``Backend.prepare_record``)."""
        started = ticket.acquired_at if ticket.acquired_at is not None else time.time()
        return cls(
            state=REQUEST_SUCCEEDED,
            ticket_id=ticket.ticket_id,
            fence=ticket.fence,
            status=0,
            started_at=started,
            expires_at=started + window,
        )

    @property
    def active(self) -> bool:
        return self.state == REQUEST_ACTIVE

    def succeeded_within(self, now: float) -> bool:
        """A success still inside its dedupe window: a replay must not run again."""
        return self.state == REQUEST_SUCCEEDED and (self.expires_at or 0.0) > now

    def to_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {name: getattr(self, name) for name in _REQUEST_TYPES}
        out["previous"] = self.previous.to_dict() if self.previous is not None else None
        return out

    def to_json(self) -> bytes:
        return jsontext.dumps(self.to_dict()).encode()

    @classmethod
    def from_dict(cls, obj: Any, depth: int = 0) -> RequestRecord:
        values = checked(obj, _REQUEST_TYPES, ("state",), _REQUEST_STRINGS)
        prev = obj.get("previous")
        if prev is not None and not isinstance(prev, dict):
            raise ValueError(f"previous is {type(prev).__name__}, not object")
        # One run back is all a claim restores; older history is dropped on the next write.
        previous = cls.from_dict(prev, depth + 1) if prev is not None and depth < 1 else None
        return cls(**values, previous=previous)

    @classmethod
    def from_json(cls, data: bytes) -> RequestRecord:
        return cls.from_dict(loads(data))
