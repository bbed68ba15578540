"""Validation of every value a user can pass, used by every front end.

Plain string checks instead of ``re``: this runs on every ``pearing-run`` and
``re`` costs a few milliseconds to import.
"""

from __future__ import annotations

import math
from typing import Final

from singleflight.core.errors import BadValue

_ALNUM: Final = frozenset("ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789")
_NAME_CHARS: Final = _ALNUM | frozenset("._-")
_IDENTITY_CHARS: Final = _NAME_CHARS | frozenset("@+:")
_HEX: Final = frozenset("0123456789abcdef")
MAX_LOCK_NAME: Final = 128
MAX_SCOPE: Final = 200


def lock_name(value: str, what: str = "lock name") -> str:
    if not (1 <= len(value) <= MAX_LOCK_NAME and value[0] in _ALNUM and set(value) <= _NAME_CHARS):
        raise BadValue(what, value, "must match ^[A-Za-z0-9][A-Za-z0-9._-]{0,127}$")
    return value


def scope(value: str, what: str = "scope") -> str:
    if not value or len(value) > MAX_SCOPE:
        raise BadValue(what, value, f"must be 1 to {MAX_SCOPE} characters")
    for seg in value.split("/"):
        if not seg or seg in (".", "..") or not set(seg) <= _NAME_CHARS:
            raise BadValue(what, value, "segments of [A-Za-z0-9._-] joined by '/', none empty, '.' or '..'")
    return value


def identity(value: str) -> str:
    if not (1 <= len(value) <= 128 and value[0] in _ALNUM and set(value) <= _IDENTITY_CHARS):
        raise BadValue("identity", value, "must match ^[A-Za-z0-9][A-Za-z0-9._@+:-]{0,127}$")
    return value


def request_uuid(value: str) -> str:
    """A UUID in its canonical 8-4-4-4-12 hex form; returned lower-cased."""
    low = value.lower()
    parts = low.split("-")
    if [len(p) for p in parts] != [8, 4, 4, 4, 12] or not set("".join(parts)) <= _HEX:
        raise BadValue("request uuid", value, "must be a UUID like 8-4-4-4-12 hex digits")
    return low


def ticket_id(value: str) -> str:
    try:
        return request_uuid(value)
    except BadValue:
        raise BadValue("ticket id", value, "must be a UUID like 8-4-4-4-12 hex digits") from None


def seconds(value: str | float, what: str, *, minimum: float = 0.0, allow_zero: bool = True) -> float:
    try:
        number = float(value)
    except (TypeError, ValueError):
        raise BadValue(what, value, "must be a number of seconds") from None
    if not math.isfinite(number) or number < minimum or (number == 0 and not allow_zero):
        rule = f">= {minimum:g}" if allow_zero else "> 0"
        raise BadValue(what, value, f"must be a finite number of seconds {rule}")
    if number > 10 * 365 * 86400:
        raise BadValue(what, value, "must be at most ten years")
    return number


def _integer(value: str | float) -> int:
    """int(value), refusing what int() would silently truncate (2.7) or crash on (inf)."""
    if isinstance(value, float) and not value.is_integer():
        raise ValueError(value)
    try:
        return int(value)
    except OverflowError:
        raise ValueError(value) from None


def exit_status(value: str | int, what: str = "--busy-exit-code") -> int:
    try:
        number = _integer(value)
    except (TypeError, ValueError):
        raise BadValue(what, value, "must be an integer 0-255") from None
    if not 0 <= number <= 255:
        raise BadValue(what, value, "must be an integer 0-255")
    return number


def fence(value: str | int) -> int:
    try:
        number = _integer(value)
    except (TypeError, ValueError):
        raise BadValue("fence", value, "must be an integer >= 1") from None
    if number < 1:
        raise BadValue("fence", value, "must be an integer >= 1")
    return number
