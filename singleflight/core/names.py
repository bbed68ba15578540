"""Validation of every value a user can pass, used by every front end.

One function per kind of value, so pearing-run, pearing-cli, pearing-mcp and ``Lock``
refuse the same value with the same exit code and the same words. The rule for which
error: a value that breaks its rule is ``BadValue`` naming the flag or parameter and
the value; a combination of flags or parameters that cannot go together (or a required
one missing) is ``UsageError``. Both exit 64. Each function takes ``what``, the name to
print in the front end's own spelling (``--request-key`` on the command line,
``request_key`` in Python and MCP); apart from that name the wording is the same.

Plain string checks instead of ``re``: this runs on every ``pearing-run`` and
``re`` costs a few milliseconds to import.
"""

from __future__ import annotations

from singleflight.core.const import (
    MAX_ACTIVITY,
    MAX_FENCE,
    MAX_SECONDS,
    MAX_SLOTS,
    MAX_WAITING,
    MIN_LEASE_SECONDS,
    TYPE_CHECKING,
)
from singleflight.core.errors import BadValue, UsageError, shown

if TYPE_CHECKING:
    from collections.abc import Sequence
    from typing import Final, Literal, overload

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


def request_uuid(value: str, what: str = "request uuid") -> str:
    """A UUID in its canonical 8-4-4-4-12 hex form; returned lower-cased."""
    low = value.lower()
    parts = low.split("-")
    if [len(p) for p in parts] != [8, 4, 4, 4, 12] or not set("".join(parts)) <= _HEX:
        raise BadValue(what, value, "must be a UUID like 8-4-4-4-12 hex digits")
    return low


if TYPE_CHECKING:  # the overloads are the checker's: typing stays off the start-up path

    @overload
    def request(
        uuid: str | None, key: str | None, *, uuid_what: str = ..., key_what: str = ..., required: Literal[True]
    ) -> str: ...
    @overload
    def request(
        uuid: str | None, key: str | None, *, uuid_what: str = ..., key_what: str = ..., required: bool = ...
    ) -> str | None: ...


def request(
    uuid: str | None,
    key: str | None,
    *,
    uuid_what: str = "--request-uuid",
    key_what: str = "--request-key",
    required: bool = False,
) -> str | None:
    """The request uuid: ``uuid`` as given, or the documented UUIDv5 of ``key`` (core.keys).

    None when neither is given (unless ``required``); both is a UsageError.
    """
    if uuid is not None and key is not None:
        raise UsageError(f"give {uuid_what} or {key_what}, not both")
    if key is not None:
        from singleflight.core import keys  # --request-key's alone

        return keys.request_key_uuid(key, key_what)
    if uuid is not None:
        return request_uuid(uuid, uuid_what)
    if required:
        raise UsageError(f"give {uuid_what} or {key_what}")
    return None


def choice(value: str, what: str, allowed: Sequence[str]) -> str:
    """One of ``allowed`` (``--heartbeat auto|manual``, ``--queue fifo|latest``), exactly as spelt."""
    if not isinstance(value, str) or value not in allowed:
        listed = ", ".join(allowed[:-1]) + f" or {allowed[-1]}" if len(allowed) > 1 else allowed[0]
        raise BadValue(what, shown(value), f"must be {listed}")
    return value


def activity(text: str, what: str = "activity") -> str:
    """An identity's activity: 1 to MAX_ACTIVITY characters, not only whitespace."""
    if not isinstance(text, str) or not text.strip() or len(text) > MAX_ACTIVITY:
        raise BadValue(what, shown(text), f"must be 1 to {MAX_ACTIVITY} characters, not all blank")
    return text


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
        return float("inf")


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
    if not number >= 0:  # negative, or NaN (math.isnan would load math, a shared library)
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


def max_waiting(value: str | int, what: str = "--max-waiting") -> int:
    """How many may wait in line before a newcomer is turned away: 0 to MAX_WAITING."""
    return _integer(value, what, 0, MAX_WAITING)


def slots(value: str | int, what: str = "--slots") -> int:
    """How many runs of a lock may hold it at once: 1 to MAX_SLOTS."""
    return _integer(value, what, 1, MAX_SLOTS)


def fence(value: str | int, what: str = "fence") -> int:
    """A fence: 1 to MAX_FENCE (etcd revisions are int64)."""
    return _integer(value, what, 1, MAX_FENCE)


# -- the thread service -----------------------------------------------------------------------
MAX_THREAD: Final = 10**15  # a thread number: a positive decimal, as an issue or PR number is
MAX_REPLY_BODY: Final = 64 * 1024  # bytes of UTF-8
MAX_LINK: Final = 1024
MAX_LINKS: Final = 32
REPLY_KIND_PATTERN: Final = r"^[a-z][a-z0-9-]{0,31}$"
_KIND_FIRST: Final = frozenset("abcdefghijklmnopqrstuvwxyz")
_KIND_CHARS: Final = _KIND_FIRST | _DIGITS | frozenset("-")


def thread(value: str | int, what: str = "thread") -> int:
    """A thread number: a positive decimal (42), as the seed's ``get-thread-tree REPO 42``."""
    try:
        return _integer(value, what, 1, MAX_THREAD)
    except BadValue:
        raise BadValue(what, shown(value), "must be a positive decimal number, like 42") from None


def reply_kind(value: str, what: str = "kind") -> str:
    if not (isinstance(value, str) and 1 <= len(value) <= 32 and value[0] in _KIND_FIRST and set(value) <= _KIND_CHARS):
        raise BadValue(what, shown(value), f"must match {REPLY_KIND_PATTERN}")
    return value


def reply_body(value: str, what: str = "body") -> str:
    """A reply's text: not blank, at most 64 KiB of UTF-8, no NUL (a C reader would cut it short)."""
    if not isinstance(value, str) or not value.strip() or "\0" in value:
        raise BadValue(what, shown(value), "must be text, not blank, without NUL bytes")
    try:
        size = len(value.encode())
    except UnicodeEncodeError:  # a lone surrogate from a hostile JSON string
        raise BadValue(what, shown(value), "must be valid Unicode text") from None
    if size > MAX_REPLY_BODY:
        raise BadValue(what, f"{size} bytes", f"must be at most {MAX_REPLY_BODY} bytes")
    return value


def reply_link(value: str, what: str = "link") -> str:
    """``KIND:TARGET``, e.g. ``branch:codex/thread-42``: a kind as a reply's, then a non-blank target."""
    if not isinstance(value, str):
        raise BadValue(what, shown(value), "must be KIND:TARGET, like branch:codex/thread-42")
    kind, colon, target = value.partition(":")
    ok = (
        colon
        and target.strip()
        and len(value) <= MAX_LINK
        and "\0" not in value
        and not any(c in target for c in "\n\r")
    )
    if not ok:
        raise BadValue(
            what, shown(value), f"must be KIND:TARGET (at most {MAX_LINK} characters), like branch:codex/thread-42"
        )
    try:
        reply_kind(kind)
    except BadValue:
        raise BadValue(what, shown(value), f"must start with a KIND matching {REPLY_KIND_PATTERN}, then ':'") from None
    return value


def reply_links(values: Sequence[str], what: str = "link") -> list[str]:
    if isinstance(values, str) or len(values) > MAX_LINKS:
        raise BadValue(what, shown(values), f"must be a list of at most {MAX_LINKS} links")
    return [reply_link(v, what) for v in values]


def reply_id(value: str, what: str = "parent") -> str:
    """A reply id (we mint them as UUIDs): a canonical lower-case UUID."""
    if not isinstance(value, str) or not is_uuid(value):
        raise BadValue(what, shown(value), "must be a reply id (a UUID like 8-4-4-4-12 hex digits)")
    return value


_UNIT_SECONDS: Final = {"w": 7 * 86400, "d": 86400, "h": 3600, "m": 60, "s": 1}
# Position in largest-first order: a combined duration must go strictly down this list.
_UNIT_RANK: Final = {unit: rank for rank, unit in enumerate(_UNIT_SECONDS)}
# Enough for every honest spelling; keeps hostile input from costing anything.
_MAX_DURATION_TEXT: Final = 64
_DURATION_FORMS: Final = "30s, 50m, 2h, 1d, 1w, 1h30m, 1.5h, or plain seconds like 90"


def _duration_text(text: str) -> float | None:
    if not text or len(text) > _MAX_DURATION_TEXT:
        return None
    if text[-1] in _DIGITS:
        return _decimal(text)
    total = 0.0
    start = 0
    last_rank = -1
    for i, ch in enumerate(text):
        if ch in _DIGITS or ch == ".":
            continue
        rank = _UNIT_RANK.get(ch)
        if rank is None or rank <= last_rank:
            return None
        number = _decimal(text[start:i])
        if number is None:
            return None
        total += number * _UNIT_SECONDS[ch]
        last_rank, start = rank, i + 1
    return total if start == len(text) else None


def duration(value: str | float, what: str, *, allow_zero: bool = False) -> float:
    """Seconds in a duration (``--min-interval``, ``--dedupe-window``); BadValue otherwise.

    Plain seconds in the grammar of ``seconds`` (``90``, ``1.5``), or numbers in that
    grammar with the units ``s``, ``m``, ``h``, ``d`` (86400 s), ``w`` (7 d), combined
    from the largest unit down, each at most once (``1h30m``, ``1d12h``, ``1.5h``).
    Lower case only, so ``M`` is never mistaken for months. Refused: signs, spaces,
    exponents, ``inf`` / ``nan``, non-ASCII digits, ``.5`` or ``5.``, ``30m1h``, more
    than MAX_SECONDS (ten years), and 0 unless ``allow_zero``. From JSON or Python: an
    int or a finite float, never a bool.
    """
    number = _duration_text(value) if isinstance(value, str) else _decimal(value)
    # NaN fails every comparison, so it is refused with the rest.
    if number is None or not (number >= 0 if allow_zero else number > 0) or not number <= MAX_SECONDS:
        floor = ">= 0" if allow_zero else "> 0"
        raise BadValue(what, shown(value), f"must be a duration {floor} and at most ten years: {_DURATION_FORMS}")
    return number
