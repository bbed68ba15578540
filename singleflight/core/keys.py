"""Request keys: the uuid that ``--request-key KEY`` stands for.

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

Cost: this runs on every ``pearing-run``, busy skips included. ``import uuid`` costs ~2.2 ms
(it imports ``platform``) and hashlib's OpenSSL binding ~2.5 ms, so uuid5 is hand-rolled on
CPython's built-in ``_sha1`` (~0.3 ms, imported only when a key is hashed), falling back to
hashlib where that module is missing; tests prove the result equals ``uuid.uuid5``. No ``re``.
"""

from __future__ import annotations

from singleflight.core.const import TYPE_CHECKING
from singleflight.core.errors import BadValue, shown

if TYPE_CHECKING:
    from typing import Final

REQUEST_KEY_NAMESPACE_URL: Final = "https://pearing.dev/singleflight/request-key"
REQUEST_KEY_NAMESPACE: Final = "0bc18d53-9e2d-560b-a732-131556d00dc1"
MAX_REQUEST_KEY: Final = 256

_NS_BYTES: Final = bytes.fromhex(REQUEST_KEY_NAMESPACE.replace("-", ""))
_CONTROLS: Final = frozenset(chr(c) for c in (*range(0x20), *range(0x7F, 0xA0)))


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
        raise BadValue(what, shown(key), f"must be 1 to {MAX_REQUEST_KEY} characters, not {len(key)}")
    if not _CONTROLS.isdisjoint(key):
        raise BadValue(what, key, "must not contain control characters (U+0000-U+001F, U+007F-U+009F)")
    try:
        data = key.encode("utf-8")
    except UnicodeEncodeError:
        raise BadValue(what, key, "must be valid Unicode text (no lone surrogates)") from None
    if key.isspace():
        raise BadValue(what, key, "must not be only whitespace")
    return _uuid5(_NS_BYTES, data)
