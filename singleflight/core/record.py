"""Decoding a stored record so that nothing in it can crash the reader: JSON that fails to
parse, fields of the wrong type or out of range, and strings no OS call accepts are all one
``ValueError``. Shared by both record kinds (``ticket.Ticket``, ``request.RequestRecord``),
with the two values every record carries: times as users read them and fresh uuids.
"""

from __future__ import annotations

import os
import time

from singleflight.core import jsontext, names
from singleflight.core.const import MAX_FENCE, MAX_SLOTS, MAX_WAITING, TYPE_CHECKING
from singleflight.core.errors import BadValue

if TYPE_CHECKING:
    from collections.abc import Callable
    from typing import Any, Final


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


HEX: Final = frozenset("0123456789abcdef")
# Free text in a record (a host name, a boot id, an end reason): bounded, and no NUL,
# which no OS call accepts.
_MAX_TEXT: Final = 1024
# A pid is a C int to the OS (pidfd_open overflows beyond); a start stamp is clock ticks.
_MAX_PID: Final = 2**31 - 1
_MAX_INT: Final = 2**63 - 1


def is_uuid(value: str) -> bool:
    try:
        return names.request_uuid(value) == value
    except BadValue:
        return False


def valid(check: Callable[[str], object]) -> Callable[[str], bool]:
    def ok(value: str) -> bool:
        try:
            check(value)
        except BadValue:
            return False
        return True

    return ok


def _text(value: str) -> bool:
    return len(value) <= _MAX_TEXT and "\0" not in value


# Beyond its type: what an integer field of either record kind written by this tool satisfies.
_INT_RANGES: dict[str, tuple[int, int]] = {
    "fence": (1, MAX_FENCE),
    "max_waiting": (0, MAX_WAITING),
    "slots": (1, MAX_SLOTS),
    "slot": (0, MAX_SLOTS - 1),
    "holder_pid": (1, _MAX_PID),
    "holder_start": (0, _MAX_INT),
    "pid": (1, _MAX_PID),
    "start": (0, _MAX_INT),
    "status": (-_MAX_PID, _MAX_PID),
}


def checked(
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
            if not _finite(value) or abs(value) > 1e15:
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
        return jsontext.loads(data)
    except RecursionError:
        raise ValueError("nested too deeply") from None


def epoch(value: object, what: str = "time") -> float:
    """A recorded time in epoch seconds: a finite number within the range every record keeps
    (no bool, no NaN, no 1e300, which a clock or ``rfc3339`` would overflow on); TypeError else."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise TypeError(f"{what} is not a number")
    if not _finite(value) or abs(value) > 1e15:
        raise TypeError(f"{what} is not a finite number of seconds: {value!r}")
    return float(value)


def _finite(value: float) -> bool:
    """``math.isfinite`` without loading math (a shared library) on every start: an int too large
    for a float raises the same OverflowError, NaN and the infinities are not finite."""
    x = float(value)
    return -_INF < x < _INF


_INF = float("inf")


# A stored reply's fields (the thread service: rules/threads.py), as every store keeps them.
REPLY_FIELDS: Final = ("reply_id", "parent_id", "kind", "body", "links", "identity", "fence", "ticket_id", "created_at")


def stored_reply(r: Any) -> dict[str, Any] | None:
    """A reply as a store read it back (decoded JSON), its ``created_at`` as epoch seconds; None
    when a field holds a value of the wrong type (the store names where, as corrupt)."""
    ok = (
        isinstance(r, dict)
        and isinstance(r.get("reply_id"), str)
        and (r.get("parent_id") is None or isinstance(r.get("parent_id"), str))
        and isinstance(r.get("kind"), str)
        and isinstance(r.get("body"), str)
        and isinstance(r.get("links"), list)
        and all(isinstance(x, str) for x in r["links"])
        and isinstance(r.get("identity"), str)
        and (r.get("fence") is None or (type(r.get("fence")) is int and r["fence"] >= 1))
        and (r.get("ticket_id") is None or isinstance(r.get("ticket_id"), str))
    )
    if not ok:
        return None
    try:
        created = epoch(r.get("created_at"), "created_at")
    except TypeError:
        return None
    return {**{k: r.get(k) for k in REPLY_FIELDS}, "created_at": created}
