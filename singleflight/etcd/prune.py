"""``pearing-cli prune`` on etcd: an idle lock's keys go, in one transaction.

etcd keeps no time of a key's last change, so the first prune that finds a lock idle notes when,
in the lock's ``idle`` key (that time and the store's revision then); a later one tells by the
keys' mod revisions whether anything changed since, and counts the lock's idle time from the note.
A lock's keys go in one transaction, only if none of them changed after the read its judgement
came from (nobody joined the line, guarded, ran or recorded meanwhile). Fences are the create
revisions of the cluster, which only grow: a lock that comes back continues above its last fence
with no record of it kept (``last``, the newest fence, goes with the rest).
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from typing import Any

from singleflight.core.errors import UnknownLock
from singleflight.core.idle import Idle
from singleflight.etcd.client import Cluster, cmp, op_delete, op_put
from singleflight.etcd.lock import Mutex

_NOTE = "idle"


def prune(cluster: Cluster, repo: str, lock: str, keep: Callable[[Idle], str | None], *, dry_run: bool) -> str | None:
    mutex = Mutex(cluster, repo, lock)
    kvs, rev = cluster.range_prefix(mutex.base)
    if not kvs:
        raise UnknownLock(repo, lock)
    in_use, success, requests, note, changed = None, None, [], None, 0
    for kv in kvs:
        key = kv["key"]
        if key.startswith(mutex.q):
            in_use = in_use or "held"  # the first in line holds; etcd has no line without a holder
        elif key.startswith(mutex.g):
            in_use = in_use or "a guarded command in flight"
        if key == mutex.base + _NOTE:
            note = _note(kv["value"])
            continue
        changed = max(changed, int(kv["mod_revision"]))
        if key == mutex.base + "s":
            success = kv["value"]
        elif key.startswith(mutex.r):
            requests.append(kv["value"])
    # Unchanged since the note: idle since its time. Else (no note, or a run since): from now.
    since = note[0] if note is not None and changed <= note[1] else None
    now = time.time()
    why = keep(Idle(in_use=in_use, last_used=now if since is None else since, success=success, requests=requests))
    # Nothing of the lock may change between this read and the transaction that acts on it.
    unchanged = [cmp(mutex.base, "MOD", "LESS", rev + 1, prefix=True)]
    if why is not None:
        if since is None and in_use is None and not dry_run:
            body = json.dumps({"since": now, "revision": rev}).encode()
            cluster.txn(unchanged, [op_put(mutex.base + _NOTE, body)], [])
        return why
    if dry_run:
        return None
    if not cluster.txn(unchanged, [op_delete(mutex.base, prefix=True)], []).get("succeeded"):
        return "busy"  # used while we judged it: it is not idle now
    return None


def _note(raw: bytes) -> tuple[float, int] | None:
    """(since, revision) of a note; None for anything else (written by another hand: noted again)."""
    try:
        obj: Any = json.loads(raw)
        since, revision = obj["since"], obj["revision"]
    except (ValueError, KeyError, TypeError):
        return None
    if isinstance(since, bool) or not isinstance(since, (int, float)) or not isinstance(revision, int):
        return None
    return float(since), revision
