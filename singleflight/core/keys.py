"""Request keys and durations: the two values of ``--request-key`` and ``--min-interval``.

Request key
-----------
``--request-key KEY`` is ``--request-uuid`` of the UUIDv5 (RFC 9562, SHA-1) of KEY's
UTF-8 bytes in the project namespace::

    PEARING_NS = uuid5(NAMESPACE_URL, "https://pearing.dev/singleflight/request-key")
               = 0bc18d53-9e2d-560b-a732-131556d00dc1  (see REQUEST_KEY_NAMESPACE)
    request uuid = uuid5(PEARING_NS, KEY)            # KEY encoded as UTF-8, as given

The URL is only a name inside the URL namespace; nothing is fetched. Any program can
reproduce the uuid:

- Python: ``uuid.uuid5(uuid.UUID(REQUEST_KEY_NAMESPACE), key)`` (str, UTF-8 inside);
- Go (github.com/google/uuid): ``uuid.NewSHA1(uuid.MustParse(ns), []byte(key))``;
- shell (util-linux): ``uuidgen --sha1 --namespace NS --name "$KEY"``.

The output is the canonical lower-case 8-4-4-4-12 form. KEY is hashed exactly as given:
no trimming, no case folding, no Unicode normalisation (NFC and NFD spellings of the same
text are different keys).

A key is 1 to 256 characters (Unicode code points, Python's ``len``; Go's
``utf8.RuneCountInString``) and must not contain

- control characters: C0 (U+0000-U+001F), DEL (U+007F), C1 (U+0080-U+009F): they would
  break the one-line logs and the shell quoting of whoever replays the key;
- anything UTF-8 cannot encode (lone surrogates, which Python lets through from
  ``surrogateescape`` argv decoding of invalid bytes): their uuid would not be reproducible;
- only whitespace (``str.isspace``): a blank key is an empty template variable, not an event
  id, and would make every such run one request. Leading or trailing spaces around real text
  are kept and hashed.

Other code points (unassigned ones included) are accepted, so which keys are valid does not
depend on the Unicode tables of one Python version.

Duration
--------
``--min-interval`` takes plain seconds (``90``, ``1.5``: ASCII digits, an optional ``.`` and
more digits) or numbers with units ``s``, ``m``, ``h``, ``d`` (86400 s), ``w`` (7 d),
optionally combined from the largest unit down, each at most once (``1h30m``, ``1d12h``,
``1.5h``). Lower case only, so ``M`` is never mistaken for months. Refused: 0, signs, spaces,
exponents, ``inf`` / ``nan``, non-ASCII digits, ``.5`` or ``5.``, ``30m1h``, more than ten
years.

Cost: this runs on every ``pearing-run``, busy skips included. ``import uuid`` costs ~2.2 ms
(it imports ``platform``) and hashlib's OpenSSL binding ~2.5 ms, so uuid5 is hand-rolled on
CPython's built-in ``_sha1`` (~0.3 ms, imported only when a key is hashed), falling back to
hashlib where that module is missing; tests prove the result equals ``uuid.uuid5``. No ``re``.
"""

from __future__ import annotations

import math
from typing import Final

from singleflight.core.errors import BadValue

REQUEST_KEY_NAMESPACE_URL: Final = "https://pearing.dev/singleflight/request-key"
REQUEST_KEY_NAMESPACE: Final = "0bc18d53-9e2d-560b-a732-131556d00dc1"
MAX_REQUEST_KEY: Final = 256

_NS_BYTES: Final = bytes.fromhex(REQUEST_KEY_NAMESPACE.replace("-", ""))
_CONTROLS: Final = frozenset(chr(c) for c in (*range(0x20), *range(0x7F, 0xA0)))
# The error line echoes at most this much of a bad value: it must stay one readable line.
_SHOWN_CHARS: Final = 64

TEN_YEARS: Final = 10 * 365 * 86400
_DIGITS: Final = frozenset("0123456789")
_UNIT_SECONDS: Final = {"w": 7 * 86400, "d": 86400, "h": 3600, "m": 60, "s": 1}
# Position in largest-first order: a combined duration must go strictly down this list.
_UNIT_RANK: Final = {unit: rank for rank, unit in enumerate(_UNIT_SECONDS)}
# Enough for every honest spelling; keeps hostile input from costing anything.
_MAX_DURATION_TEXT: Final = 64
DURATION_RULE: Final = (
    "must be a duration > 0 and at most ten years: 30s, 50m, 2h, 1d, 1w, 1h30m, 1.5h, or plain seconds like 90"
)


def _shown(value: object) -> object:
    if isinstance(value, str) and len(value) > _SHOWN_CHARS:
        return value[:_SHOWN_CHARS] + "..."
    # repr() of an int above 4300 digits raises ValueError (CPython's int_max_str_digits).
    if isinstance(value, int) and value.bit_length() > _SHOWN_CHARS:
        return f"<{value.bit_length()}-bit integer>"
    return value


def _sha1(data: bytes) -> bytes:
    # CPython's own SHA-1 imports in ~0.3 ms; hashlib's OpenSSL binding takes ~2.5 ms,
    # which a busy skip with --request-key would otherwise pay. Same digest either way.
    try:
        from _sha1 import sha1  # type: ignore[import-not-found,unused-ignore]
    except ImportError:
        from hashlib import sha1
    return bytes(sha1(data).digest())


def _uuid5(namespace: bytes, name: bytes) -> str:
    raw = bytearray(_sha1(namespace + name)[:16])
    raw[6] = (raw[6] & 0x0F) | 0x50
    raw[8] = (raw[8] & 0x3F) | 0x80
    h = raw.hex()
    return f"{h[:8]}-{h[8:12]}-{h[12:16]}-{h[16:20]}-{h[20:]}"


def request_key_uuid(key: str, what: str = "--request-key") -> str:
    """The request uuid that ``--request-key KEY`` stands for; BadValue if KEY breaks its rule."""
    if not 1 <= len(key) <= MAX_REQUEST_KEY:
        raise BadValue(what, _shown(key), f"must be 1 to {MAX_REQUEST_KEY} characters, not {len(key)}")
    if not _CONTROLS.isdisjoint(key):
        raise BadValue(what, key, "must not contain control characters (U+0000-U+001F, U+007F-U+009F)")
    try:
        data = key.encode("utf-8")
    except UnicodeEncodeError:
        raise BadValue(what, key, "must be valid Unicode text (no lone surrogates)") from None
    if key.isspace():
        raise BadValue(what, key, "must not be only whitespace")
    return _uuid5(_NS_BYTES, data)


def _number(text: str) -> float | None:
    whole, dot, fraction = text.partition(".")
    if not whole or not _DIGITS.issuperset(whole):
        return None
    if dot and (not fraction or not _DIGITS.issuperset(fraction)):
        return None
    return float(text)


def _parse_duration(text: str) -> float | None:
    if not text or len(text) > _MAX_DURATION_TEXT:
        return None
    if text[-1] in _DIGITS:
        return _number(text)
    total = 0.0
    start = 0
    last_rank = -1
    for i, ch in enumerate(text):
        if ch in _DIGITS or ch == ".":
            continue
        rank = _UNIT_RANK.get(ch)
        if rank is None or rank <= last_rank:
            return None
        number = _number(text[start:i])
        if number is None:
            return None
        total += number * _UNIT_SECONDS[ch]
        last_rank, start = rank, i + 1
    return total if start == len(text) else None


def duration(value: str | int | float, what: str = "--min-interval") -> float:
    """Seconds in ``value`` (see the module docstring for the forms); BadValue otherwise."""
    if isinstance(value, bool):
        number: float | None = None
    elif isinstance(value, int):
        # float() of a huge int overflows; compare as int first.
        number = float(value) if 0 < value <= TEN_YEARS else None
    elif isinstance(value, float):
        number = value if math.isfinite(value) else None
    elif isinstance(value, str):
        number = _parse_duration(value)
    else:
        number = None
    if number is None or not 0 < number <= TEN_YEARS:
        raise BadValue(what, _shown(value), DURATION_RULE)
    return number
