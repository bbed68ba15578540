"""Validation of every value a user can pass, used by every front end.

Plain string checks instead of ``re``: this runs on every ``pearing-run`` and
``re`` costs a few milliseconds to import.
"""

from __future__ import annotations

import math
from typing import Final

from singleflight.core.const import MAX_FENCE, MAX_SECONDS, MIN_LEASE_SECONDS
from singleflight.core.errors import BadValue

_ALNUM: Final = frozenset("ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789")
_NAME_CHARS: Final = _ALNUM | frozenset("._-")
_IDENTITY_CHARS: Final = _NAME_CHARS | frozenset("@+:")
_HEX: Final = frozenset("0123456789abcdef")
_DIGITS: Final = frozenset("0123456789")
MAX_LOCK_NAME: Final = 128
MAX_SCOPE: Final = 200
# The same rules as regular expressions, for messages and the MCP input schemas.
LOCK_NAME_PATTERN: Final = r"^[A-Za-z0-9][A-Za-z0-9._-]{0,127}$"
SCOPE_PATTERN: Final = r"^[A-Za-z0-9._-]+(/[A-Za-z0-9._-]+)*$"  # and no '.' or '..' segment
IDENTITY_PATTERN: Final = r"^[A-Za-z0-9][A-Za-z0-9._@+:-]{0,127}$"
UUID_PATTERN: Final = r"^[0-9A-Fa-f]{8}-[0-9A-Fa-f]{4}-[0-9A-Fa-f]{4}-[0-9A-Fa-f]{4}-[0-9A-Fa-f]{12}$"


def lock_name(value: str, what: str = "lock name") -> str:
    if not (1 <= len(value) <= MAX_LOCK_NAME and value[0] in _ALNUM and set(value) <= _NAME_CHARS):
        raise BadValue(what, value, f"must match {LOCK_NAME_PATTERN}")
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
        raise BadValue("identity", value, f"must match {IDENTITY_PATTERN}")
    return value


def request_uuid(value: str) -> str:
    """A UUID in its canonical 8-4-4-4-12 hex form; returned lower-cased."""
    low = value.lower()
    parts = low.split("-")
    if [len(p) for p in parts] != [8, 4, 4, 4, 12] or not set("".join(parts)) <= _HEX:
        raise BadValue("request uuid", value, "must be a UUID like 8-4-4-4-12 hex digits")
    return low


def is_uuid(value: str) -> bool:
    """A canonical lower-case UUID (what every id we write is): a record's pointer must be one."""
    parts = value.split("-")
    return [len(p) for p in parts] == [8, 4, 4, 4, 12] and set("".join(parts)) <= _HEX


def ticket_id(value: str) -> str:
    try:
        return request_uuid(value)
    except BadValue:
        raise BadValue("ticket id", value, "must be a UUID like 8-4-4-4-12 hex digits") from None


def _digits(text: str) -> bool:
    """ASCII decimal digits only: ``str.isdigit()`` and ``float()`` also take Arabic-Indic or full-width ones."""
    return bool(text) and set(text) <= _DIGITS


def _decimal(value: object) -> float | None:
    """The value of DIGITS or DIGITS.DIGITS text, or of a real JSON / Python number; else None."""
    if isinstance(value, str):
        whole, dot, fraction = value.partition(".")
        if not _digits(whole) or (dot and not _digits(fraction)):
            return None
        return float(value)  # at most inf for thousands of digits: the ceiling refuses it
    if isinstance(value, bool) or not isinstance(value, int | float):
        return None  # True is not a number, whatever Python says
    try:
        return float(value)
    except OverflowError:  # an int beyond any float
        return math.inf


def seconds(value: str | float, what: str, *, minimum: float = 0.0, allow_zero: bool = True) -> float:
    """A number of seconds from a flag, the environment or JSON.

    Text has one grammar: ASCII digits with an optional fraction, ``5``, ``0.5``, ``10.25``
    (the JSON number grammar without sign or exponent, so a value reads the same in a shell
    and in an MCP call). Refused: ``.5`` and ``5.``, any sign (negative is simply refused),
    spaces, ``_``, exponents, ``inf`` / ``nan``, hex, non-ASCII digits. From JSON or Python:
    an int or a finite float, never a bool. At most MAX_SECONDS (ten years).
    """
    number = _decimal(value)
    if number is None:
        if isinstance(value, str) and value[:1] in ("+", "-") and _decimal(value[1:]) is not None:
            raise BadValue(what, value, "must be written without a sign (a negative duration is refused)")
        raise BadValue(what, value, "must be a number of seconds in ASCII digits, like 5 or 0.5")
    if math.isnan(number) or number < 0:
        raise BadValue(what, value, "must be a finite number of seconds, not negative")
    if number == 0 and not allow_zero:
        raise BadValue(what, value, "must be more than 0 seconds")
    if number < minimum:
        raise BadValue(what, value, f"must be at least {minimum:g} seconds")
    if number > MAX_SECONDS:
        raise BadValue(what, value, f"must be at most ten years ({MAX_SECONDS:.0f} seconds)")
    return number


def lease_seconds(value: str | float, what: str = "--lease-seconds") -> float:
    """A lease length: ``seconds`` of at least MIN_LEASE_SECONDS."""
    return seconds(value, what, minimum=MIN_LEASE_SECONDS, allow_zero=False)


def _integer(value: str | int, what: str, low: int, high: int) -> int:
    """ASCII digits only, or a Python / JSON int (not a bool, not a float: 2.0 is refused)."""
    rule = f"must be an integer from {low} to {high} in ASCII digits"
    if isinstance(value, str) and _digits(value):
        digits = value.lstrip("0") or "0"
        # int() refuses thousands of digits (ValueError, CVE-2020-10735): longer is over the ceiling anyway.
        number = int(digits) if len(digits) <= len(str(high)) else high + 1
    elif isinstance(value, int) and not isinstance(value, bool):
        number = value
    else:
        raise BadValue(what, value, rule)
    if not low <= number <= high:
        raise BadValue(what, value, rule)
    return number


def exit_status(value: str | int, what: str = "--busy-exit-code") -> int:
    return _integer(value, what, 0, 255)


def fence(value: str | int) -> int:
    """A fence: 1 to MAX_FENCE (etcd revisions are int64)."""
    return _integer(value, "fence", 1, MAX_FENCE)
