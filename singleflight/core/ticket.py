"""The records of one lock, as stored and as shown: the ticket and the request record.

Plain ``__slots__`` classes rather than dataclasses: ``dataclasses`` pulls in
``inspect`` (about 10 ms), and every ``pearing-run`` loads tickets.
"""

from __future__ import annotations

import json
import math
import os
import time
from collections.abc import Callable
from typing import Any, Final

from singleflight.core import names
from singleflight.core.const import (
    CANCELLED,
    EXPIRED,
    HELD,
    MAX_FENCE,
    QUEUE_FIFO,
    QUEUE_MODES,
    RELEASED,
    REQUEST_ACTIVE,
    REQUEST_FAILED,
    REQUEST_SUCCEEDED,
    WAITING,
)
from singleflight.core.errors import BadValue
from singleflight.core.reasons import EndReason

# Stored fields, in order. Those in _HIDDEN never leave the backend (token_hash)
# or mean nothing to users (monotonic stamps, the holder's start time).
FIELDS = (
    "ticket_id",
    "request_uuid",
    "lock_name",
    "repo",
    "identity",
    "state",
    "fence",
    "lease_seconds",
    "lease_expires_at",
    "lease_deadline_mono",
    "boot_id",
    "holder_pid",
    "holder_start",
    "holder_host",
    "promoted",
    "created_at",
    "acquired_at",
    "ended_at",
    "end_reason",
    "token_hash",
    "queue_mode",
    "cancel_in_progress",
    "kill_grace",
    "superseded_by",
)
_HIDDEN = frozenset({"lease_deadline_mono", "boot_id", "holder_start", "token_hash"})
_TIMES = frozenset({"lease_expires_at", "created_at", "acquired_at", "ended_at"})
_TYPES: dict[str, tuple[type, ...]] = {
    "ticket_id": (str,),
    "request_uuid": (str,),
    "lock_name": (str,),
    "repo": (str,),
    "identity": (str,),
    "state": (str,),
    "fence": (int,),
    "lease_seconds": (int, float),
    "lease_expires_at": (int, float),
    "lease_deadline_mono": (int, float),
    "boot_id": (str,),
    "holder_pid": (int,),
    "holder_start": (int,),
    "holder_host": (str,),
    "promoted": (bool,),
    "created_at": (int, float),
    "acquired_at": (int, float),
    "ended_at": (int, float),
    "end_reason": (str,),
    "token_hash": (str,),
    "queue_mode": (str,),
    "cancel_in_progress": (bool,),
    "kill_grace": (int, float),
    "superseded_by": (str,),
}


def rfc3339(epoch: float | None) -> str | None:
    if epoch is None:
        return None
    whole = int(epoch)
    millis = int((epoch - whole) * 1000)
    return time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(whole)) + f".{millis:03d}Z"


def new_uuid4() -> str:
    """A random UUID4 string (``uuid`` is not imported to keep start-up short)."""
    b = bytearray(os.urandom(16))
    b[6] = (b[6] & 0x0F) | 0x40
    b[8] = (b[8] & 0x3F) | 0x80
    h = b.hex()
    return f"{h[:8]}-{h[8:12]}-{h[12:16]}-{h[16:20]}-{h[20:]}"


_STATES: Final = frozenset({WAITING, HELD, RELEASED, EXPIRED, CANCELLED})
_REQUEST_STATES: Final = frozenset({REQUEST_ACTIVE, REQUEST_SUCCEEDED, REQUEST_FAILED})
_HEX: Final = frozenset("0123456789abcdef")
# Free text in a record (a host name, a boot id, an end reason): bounded, and no NUL,
# which no OS call accepts.
_MAX_TEXT: Final = 1024
# A pid is a C int to the OS (pidfd_open overflows beyond); a start stamp is clock ticks.
_MAX_PID: Final = 2**31 - 1
_MAX_INT: Final = 2**63 - 1


def _uuid(value: str) -> bool:
    try:
        return names.request_uuid(value) == value
    except BadValue:
        return False


def _valid(check: Callable[[str], object]) -> Callable[[str], bool]:
    def ok(value: str) -> bool:
        try:
            check(value)
        except BadValue:
            return False
        return True

    return ok


def _text(value: str) -> bool:
    return len(value) <= _MAX_TEXT and "\0" not in value


# Per field, beyond its type: what a record written by this tool always satisfies. A name that
# becomes a file name (ticket id, identity) must never reach the OS unchecked.
_TICKET_STRINGS: dict[str, Callable[[str], bool]] = {
    "ticket_id": _uuid,
    "request_uuid": _uuid,
    "lock_name": _valid(names.lock_name),
    "repo": _valid(names.scope),
    "identity": _valid(names.identity),
    "state": _STATES.__contains__,
    "token_hash": lambda v: len(v) == 64 and set(v) <= _HEX,
    "queue_mode": QUEUE_MODES.__contains__,
    "superseded_by": _uuid,
}
_INT_RANGES: dict[str, tuple[int, int]] = {
    "fence": (1, MAX_FENCE),
    "holder_pid": (1, _MAX_PID),
    "holder_start": (0, _MAX_INT),
    "pid": (1, _MAX_PID),
    "start": (0, _MAX_INT),
    "status": (-_MAX_PID, _MAX_PID),
}


def _checked(
    obj: Any,
    fields: dict[str, tuple[type, ...]],
    required: tuple[str, ...],
    strings: dict[str, Callable[[str], bool]],
) -> dict[str, Any]:
    """The fields of a decoded record, each of its type (bool is no number) and in its range,
    or None. ValueError names the first field that is not."""
    if not isinstance(obj, dict):
        raise ValueError("not a JSON object")
    out: dict[str, Any] = {}
    for name, types in fields.items():
        value = obj.get(name)
        if value is None:
            if name in required:
                raise ValueError(f"missing {name}")
        elif not isinstance(value, types) or (isinstance(value, bool) and bool not in types):
            raise ValueError(f"{name} is {type(value).__name__}, not {types[0].__name__}")
        elif isinstance(value, str):
            if not strings.get(name, _text)(value):
                raise ValueError(f"{name} is not a valid value: {value[:40]!r}")
        elif isinstance(value, float):
            if not math.isfinite(value) or abs(value) > 1e15:
                raise ValueError(f"{name} is not a finite number of seconds: {value!r}")
        elif isinstance(value, int) and not isinstance(value, bool):
            low, high = _INT_RANGES.get(name, (-(10**15), 10**15))
            if not low <= value <= high:
                raise ValueError(f"{name} is out of range: {value}")
        out[name] = value
    return out


def loads(data: bytes) -> Any:
    """JSON of a record; ValueError for anything that is not (deep nesting included)."""
    try:
        return json.loads(data)
    except RecursionError:
        raise ValueError("nested too deeply") from None


class Ticket:
    __slots__ = FIELDS

    def __init__(
        self,
        *,
        ticket_id: str,
        request_uuid: str,
        lock_name: str,
        repo: str,
        identity: str,
        state: str = WAITING,
        fence: int | None = None,
        lease_seconds: float = 0.0,
        lease_expires_at: float | None = None,
        lease_deadline_mono: float | None = None,
        boot_id: str | None = None,
        holder_pid: int | None = None,
        holder_start: int | None = None,
        holder_host: str | None = None,
        promoted: bool | None = False,
        created_at: float | None = None,
        acquired_at: float | None = None,
        ended_at: float | None = None,
        end_reason: str | None = None,
        token_hash: str | None = None,
        queue_mode: str | None = QUEUE_FIFO,
        cancel_in_progress: bool | None = False,
        kill_grace: float | None = None,
        superseded_by: str | None = None,
    ) -> None:
        self.ticket_id, self.request_uuid = ticket_id, request_uuid
        self.lock_name, self.repo, self.identity = lock_name, repo, identity
        self.state, self.fence = state, fence
        self.lease_seconds = float(lease_seconds or 0.0)
        self.lease_expires_at, self.lease_deadline_mono, self.boot_id = lease_expires_at, lease_deadline_mono, boot_id
        self.holder_pid, self.holder_start, self.holder_host = holder_pid, holder_start, holder_host
        self.promoted = bool(promoted)
        self.created_at = time.time() if created_at is None else created_at
        self.acquired_at, self.ended_at, self.end_reason = acquired_at, ended_at, end_reason
        self.token_hash = token_hash
        # Event-driven concurrency: a `latest` waiter is replaced by a newer one; a holder that
        # opted in to cancel-in-progress is stopped (token dead, TERM, KILL after kill_grace)
        # when a newer opted-in run asks (superseded_by).
        self.queue_mode = queue_mode or QUEUE_FIFO
        self.cancel_in_progress = bool(cancel_in_progress)
        self.kill_grace, self.superseded_by = kill_grace, superseded_by

    ticket_id: str
    request_uuid: str
    lock_name: str
    repo: str
    identity: str
    state: str
    fence: int | None
    lease_seconds: float
    lease_expires_at: float | None
    lease_deadline_mono: float | None
    boot_id: str | None
    holder_pid: int | None
    holder_start: int | None
    holder_host: str | None
    promoted: bool
    created_at: float
    acquired_at: float | None
    ended_at: float | None
    end_reason: str | None
    token_hash: str | None
    queue_mode: str
    cancel_in_progress: bool
    kill_grace: float | None
    superseded_by: str | None

    def to_dict(self) -> dict[str, Any]:
        return {name: getattr(self, name) for name in FIELDS}

    def to_json(self) -> bytes:
        return json.dumps(self.to_dict()).encode()

    @classmethod
    def from_dict(cls, obj: Any) -> Ticket:
        """A ticket from its decoded record; ValueError for wrong fields or types."""
        required = ("ticket_id", "request_uuid", "lock_name", "repo", "identity", "state")
        return cls(**_checked(obj, _TYPES, required, _TICKET_STRINGS))

    @classmethod
    def from_json(cls, data: bytes) -> Ticket:
        return cls.from_dict(loads(data))

    def lease_left(self, now_mono: float) -> float | None:
        if self.lease_deadline_mono is None:
            return None
        return self.lease_deadline_mono - now_mono

    def set_lease(self, seconds: float) -> None:
        self.lease_seconds = seconds
        self.lease_deadline_mono = time.monotonic() + seconds
        self.lease_expires_at = time.time() + seconds

    def end(self, state: str, reason: str, at: float | None = None) -> None:
        """The ticket ends (released, expired, cancelled) for ``reason`` (an ``EndReason``'s text)."""
        self.state, self.end_reason, self.ended_at = state, str(reason), time.time() if at is None else at

    def supersede(self, by: str, at: float | None = None) -> None:
        """A newer ``latest`` waiter takes its place: it leaves the line busy, never runs."""
        self.end(CANCELLED, EndReason.SUPERSEDED.text(by), at)
        self.superseded_by = by

    @property
    def live(self) -> bool:
        return self.state in (HELD, WAITING)

    def describe_end(self) -> str:
        """Why an ended ticket ended, as users read it: ``expired (holder gone) at ...``."""
        reason = f" ({self.end_reason})" if self.end_reason else ""
        when = rfc3339(self.ended_at)
        return f"{self.state}{reason}" + (f" at {when}" if when else "")

    def public(
        self,
        *,
        activity: str | None = None,
        queue_position: int | None = None,
        token_file: str | None = None,
    ) -> dict[str, Any]:
        out: dict[str, Any] = {}
        for name in FIELDS:
            if name in _HIDDEN:
                continue
            value = getattr(self, name)
            out[name] = rfc3339(value) if name in _TIMES else value
        out["queue_position"] = queue_position if self.state == WAITING else None
        out["activity"] = activity
        if token_file is not None:
            out["token_file"] = token_file
        return out


_REQUEST_STRINGS: dict[str, Callable[[str], bool]] = {"state": _REQUEST_STATES.__contains__, "ticket_id": _uuid}
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
        return json.dumps(self.to_dict()).encode()

    @classmethod
    def from_dict(cls, obj: Any, depth: int = 0) -> RequestRecord:
        values = _checked(obj, _REQUEST_TYPES, ("state",), _REQUEST_STRINGS)
        prev = obj.get("previous")
        if prev is not None and not isinstance(prev, dict):
            raise ValueError(f"previous is {type(prev).__name__}, not object")
        # One run back is all a claim restores; older history is dropped on the next write.
        previous = cls.from_dict(prev, depth + 1) if prev is not None and depth < 1 else None
        return cls(**values, previous=previous)

    @classmethod
    def from_json(cls, data: bytes) -> RequestRecord:
        return cls.from_dict(loads(data))
