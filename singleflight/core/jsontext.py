"""JSON as the hot paths write and read it: json's own C codec, without the json package.

Every record, token file and pipe message is JSON, so every pearing-run, holder and
pearing-guard verify encodes and decodes it. Importing the json package costs each of them
``re`` (json compiles its patterns at import): about 8 ms of a start. ``_json`` is the C half
that ``json.dumps(obj)`` and ``json.loads(text)`` call when given no options: the same encoder
and the same scanner, so the same text and the same values. Whatever this path does not take
(bytes, bad JSON, an object JSON cannot hold, an interpreter without ``_json``) goes to json
itself, which gives the result or raises its own error in its own words.
"""

from __future__ import annotations

from singleflight.core.const import TYPE_CHECKING

if TYPE_CHECKING:
    from typing import Any

try:
    from _json import encode_basestring_ascii, make_encoder, make_scanner

    _C = True
except ImportError:  # an interpreter without json's C half: json does all of it
    _C = False

# What json.loads strips around the value (json.decoder's WHITESPACE).
_WS = " \t\n\r"


class _Defaults:
    """``json.JSONDecoder()``'s settings, the attributes ``make_scanner`` reads."""

    strict = True
    object_hook = None
    object_pairs_hook = None
    parse_float = float
    parse_int = int
    parse_constant = {"-Infinity": float("-inf"), "Infinity": float("inf"), "NaN": float("nan")}.__getitem__


# (typeshed asks for a make_scanner as the context: any object with these attributes is one.)
_scan = make_scanner(_Defaults) if _C else None  # type: ignore[arg-type]


def _unencodable(obj: object) -> object:
    raise TypeError(f"Object of type {obj.__class__.__name__} is not JSON serializable")


def dumps(obj: Any) -> str:
    """``json.dumps(obj)``: the same text (ASCII, ", " and ": ", NaN allowed, keys as given)."""
    if _C:
        try:
            # A new encoder each call, as json makes one: its circular-reference markers start empty.
            chunks = make_encoder({}, _unencodable, encode_basestring_ascii, None, ": ", ", ", False, False, True)(
                obj, 0
            )
            return "".join(chunks)
        except (TypeError, ValueError):
            pass  # json says what is wrong, in its words
    import json

    return json.dumps(obj)


def loads(text: str | bytes) -> Any:
    """``json.loads(text)``: one value, with only whitespace around it."""
    s = _utf8(text) if isinstance(text, (bytes, bytearray)) else text
    if _scan is not None and isinstance(s, str):
        start = len(s) - len(s.lstrip(_WS))
        try:
            obj, end = _scan(s, start)
        # Bad JSON: the scanner words its error with json.decoder's JSONDecodeError, which it
        # looks up in sys.modules without importing it (CPython 3.11), so where json is not
        # loaded it fails with SystemError instead; json, below, says what is wrong.
        except (StopIteration, ValueError, SystemError):
            pass
        else:
            if not s[end:].strip(_WS):
                return obj
    import json  # bad JSON (json's own error), bytes in another encoding, or no _json

    return json.loads(text)


def _utf8(data: bytes | bytearray) -> str | None:
    """Bytes as json.loads reads them where that is surely UTF-8: an object or an array whose
    second byte is no NUL (no BOM, not UTF-16 or UTF-32: json's detect_encoding says utf-8)."""
    if data[:1] in (b"{", b"[") and data[1:2] != b"\x00":
        try:
            return data.decode("utf-8", "surrogatepass")
        except UnicodeDecodeError:
            pass
    return None
