"""The backend's own records, once for every store: what an identity is doing, and the fence
ledger (the highest fence a target accepted per resource). A store only reads and
compare-and-sets a record (``Backend.read_record`` / ``write_record``); what it holds, how it
is checked and when a fence is stale are decided here."""

from __future__ import annotations

import time

from singleflight.core import jsontext
from singleflight.core.const import MAX_FENCE, TYPE_CHECKING
from singleflight.core.errors import CorruptRecord, StaleFence
from singleflight.core.record import loads
from singleflight.core.request import ANY_VERSION, Key, activity_record, fence_record

if TYPE_CHECKING:
    from typing import Any, Protocol

    from singleflight.backend import Backend
else:
    Protocol = object  # the checker's Protocols are plain classes at run time


class _Ledger(Protocol):
    """A store of fence records: a backend, or a ledger file of its own (``pearing-guard fence
    --ledger PATH``, ``core.ledger.FileLedger``)."""

    def read_record(self, key: Key) -> tuple[bytes | None, Any, str]: ...

    def write_record(self, key: Key, body: bytes | None, seen: Any) -> bool: ...


def read_activity(backend: Backend, identity: str) -> str | None:
    body, _, where = backend.read_record(activity_record(identity))
    if body is None:
        return None
    try:
        text = loads(body)["activity"]
        if text is not None and not isinstance(text, str):
            raise TypeError("activity is not text")
    except (ValueError, KeyError, TypeError):
        raise CorruptRecord(where, "not an activity record") from None
    return text


def write_activity(backend: Backend, identity: str, text: str | None) -> None:
    """Set (text) or clear (None) what ``identity`` is doing; the last word wins."""
    body = None if text is None else jsontext.dumps({"activity": text, "at": time.time()}).encode()
    backend.write_record(activity_record(identity), body, ANY_VERSION)


def accept_fence(ledger: _Ledger, resource: str, fence: int) -> int:
    """Accept ``fence`` for ``resource`` if it is >= the highest accepted so far, recorded by
    compare-and-set (so a lower fence never overwrites a higher one, whatever the interleaving);
    StaleFence otherwise. The fence itself is returned."""
    key = fence_record(resource)
    while True:
        raw, seen, where = ledger.read_record(key)
        highest = 0 if raw is None else _fence_of(where, raw)
        if fence < highest:
            raise StaleFence(resource, fence, highest)
        if fence == highest or ledger.write_record(key, str(fence).encode(), seen):
            return fence


def _fence_of(where: str, raw: bytes) -> int:
    """The fence a ledger record holds: exactly what ``accept_fence`` writes, ``str(fence)`` of a
    fence from 1 to MAX_FENCE (ASCII digits, no sign, space or leading zero). Anything else was
    written by some other hand, and reading it leniently could let a stale fence pass (int()
    takes " -5", "+5\\n" and "1_000"; "-5" would even be overwritten): a corrupt record (74),
    left for a person."""
    n = len(raw)
    if 0 < n <= len(str(MAX_FENCE)) and raw.isdigit() and raw[:1] != b"0" and int(raw) <= MAX_FENCE:
        return int(raw)
    shown = repr(raw[:40])[1:] + ("..." if n > 40 else "")  # escaped: one line, whatever it holds
    raise CorruptRecord(where, f"holds {shown}, not a fence (an integer from 1 to {MAX_FENCE} in ASCII digits)")
