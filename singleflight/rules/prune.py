"""``pearing-cli prune``: which idle locks go, written once for every store.

A store shuts out a lock's acquirers for a moment, tells what it found (``core.idle.Idle``),
and removes the lock's state only if ``keep`` finds no reason to keep it (``Backend.prune``).
Kept, whatever the age: a lock in use (a holder, a waiter, a guarded command), a request in
flight, a success inside its dedupe window. Kept while younger than ``--older-than``: a lock
used since, its last success (``--min-interval`` counts from it) and any request record. So an
operator picks ``--older-than`` at least as long as the longest ``--min-interval`` they use
(docs/choices.md); a dedupe window is honoured whatever it is.
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING, Any

from singleflight.core.errors import CorruptRecord, NotPermitted, UnknownLock
from singleflight.core.record import epoch, loads
from singleflight.core.request import RequestRecord

if TYPE_CHECKING:
    from singleflight.backend import Backend
    from singleflight.core.idle import Idle


def prune(backend: Backend, repo: str | None, *, older_than: float, dry_run: bool) -> dict[str, Any]:
    """Every lock of scope ``repo`` (None: of every scope) judged and, unless kept, removed."""

    def keep(idle: Idle) -> str | None:
        # The time of the judgement, not of the run's start: a store that dates a lock by when it
        # looked (etcd's first look) finds it idle "since now", which --older-than 0 lets go.
        return keep_because(idle, now=time.time(), older_than=older_than)

    pruned: list[dict[str, str]] = []
    kept: list[dict[str, str]] = []
    for scope, name in backend.locks(repo, idle=True):
        try:
            why = backend.prune(scope, name, keep, dry_run=dry_run)
        except UnknownLock:
            continue  # gone since the listing (another prune)
        except (CorruptRecord, NotPermitted) as exc:
            why = str(exc)  # left for a person, named; the other locks are still looked at
        entry = {"repo": scope, "lock_name": name}
        if why is None:
            pruned.append(entry)
        else:
            kept.append({**entry, "why": why})
    return {"older_than": older_than, "dry_run": dry_run, "count": len(pruned), "pruned": pruned, "kept": kept}


def keep_because(idle: Idle, *, now: float, older_than: float) -> str | None:
    """Why the lock must stay (None: it may go)."""
    if idle.in_use is not None:
        return idle.in_use
    recent = now - older_than
    if idle.last_used > recent:
        return "used within --older-than"
    if idle.success is not None:
        try:
            started = epoch(loads(idle.success)["started_at"], "started_at")
        except (ValueError, KeyError, TypeError, AttributeError):
            return "a success record that does not parse (left for a person)"
        if started > recent:
            return "a success within --older-than (--min-interval counts from it)"
    for body in idle.requests:
        try:
            rec = RequestRecord.from_json(body)
        except (ValueError, TypeError):
            return "a request record that does not parse (left for a person)"
        if rec.active:
            return "a request in flight"
        if rec.succeeded_within(now):
            return "a request inside its dedupe window"
        if max(rec.created_at or 0.0, rec.started_at or 0.0, rec.finished_at or 0.0) > recent:
            return "a request within --older-than"
    return None
