"""The ticket: one acquisition of one lock, as stored and as shown.

A plain ``__slots__`` class rather than a dataclass: ``dataclasses`` pulls in
``inspect`` (about 10 ms), and every ``pearing-run`` loads tickets.
"""

from __future__ import annotations

import json
import os
import time
from typing import Any

from singleflight.core.const import HELD, WAITING

# Stored fields, in order. Those starting with an underscore in PUBLIC_HIDDEN
# never leave the lock dir (token_hash) or mean nothing to users (monotonic stamps).
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
    "queue_seq",
    "promoted",
    "created_at",
    "acquired_at",
    "ended_at",
    "end_reason",
    "token_hash",
)
_HIDDEN = frozenset({"lease_deadline_mono", "boot_id", "holder_start", "queue_seq", "token_hash"})
_TIMES = ("lease_expires_at", "created_at", "acquired_at", "ended_at")


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


class Ticket:
    __slots__ = FIELDS

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
    boot_id: str
    holder_pid: int | None
    holder_start: int | None
    queue_seq: int | None
    promoted: bool
    created_at: float
    acquired_at: float | None
    ended_at: float | None
    end_reason: str | None
    token_hash: str | None

    def __init__(self, **values: Any) -> None:
        for name in FIELDS:
            setattr(self, name, values.get(name))
        if self.promoted is None:
            self.promoted = False

    def to_json(self) -> bytes:
        return json.dumps({name: getattr(self, name) for name in FIELDS}, sort_keys=False).encode()

    @classmethod
    def from_json(cls, data: bytes) -> Ticket:
        obj = json.loads(data)
        if not isinstance(obj, dict) or not isinstance(obj.get("ticket_id"), str):
            raise ValueError("not a ticket object")
        return cls(**{k: obj.get(k) for k in FIELDS})

    def lease_left(self, now_mono: float) -> float | None:
        if self.lease_deadline_mono is None:
            return None
        return self.lease_deadline_mono - now_mono

    def set_lease(self, seconds: float) -> None:
        self.lease_seconds = seconds
        self.lease_deadline_mono = time.monotonic() + seconds
        self.lease_expires_at = time.time() + seconds

    @property
    def live(self) -> bool:
        return self.state in (HELD, WAITING)

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
