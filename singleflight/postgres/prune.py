"""``pearing-cli prune`` on PostgreSQL: an idle lock's tickets and records go, in one transaction
under its row's lock (no acquirer can join meanwhile). The row itself stays, marked pruned, with
its fence: a lock that comes back continues above its last fence."""

from __future__ import annotations

import time

from singleflight.core.const import TYPE_CHECKING
from singleflight.core.errors import UnknownLock
from singleflight.core.idle import Idle
from singleflight.core.request import REQUEST_PREFIX, SUCCESS_RECORD
from singleflight.postgres.db import Db
from singleflight.postgres.line import Line

if TYPE_CHECKING:
    from collections.abc import Callable


def prune(db: Db, repo: str, lock: str, keep: Callable[[Idle], str | None], *, dry_run: bool) -> str | None:
    key = (repo, lock)
    with db.tx() as cur:
        row = db.one(cur, "SELECT pruned FROM {s}.locks WHERE scope = %s AND name = %s", key)
        if row is None or row[0] is True:
            raise UnknownLock(repo, lock)
        line = Line(db, cur, repo, lock).lock_row()
        in_use = "held" if line.holders else "waited for" if line.waiters else None
        if line.guarded:
            in_use = in_use or "a guarded command in flight"
        used = db.one(
            cur,
            """SELECT extract(epoch FROM greatest(l.used_at, (SELECT max(ended_at) FROM {s}.tickets t
                 WHERE t.scope = l.scope AND t.name = l.name)))::float8
               FROM {s}.locks l WHERE scope = %s AND name = %s""",
            key,
        )
        last_used = used[0] if used is not None and used[0] is not None else time.time()
        recs = db.ex(cur, "SELECT key, body FROM {s}.records WHERE scope = %s AND name = %s", key)
        success = next((bytes(b) for k, b in recs if k == SUCCESS_RECORD), None)
        requests = [bytes(b) for k, b in recs if k.startswith(REQUEST_PREFIX)]
        why = keep(Idle(in_use=in_use, last_used=last_used, success=success, requests=requests))
        if why is not None or dry_run:
            return why
        db.ex(cur, "DELETE FROM {s}.tickets WHERE scope = %s AND name = %s AND NOT line", key)
        db.ex(cur, "DELETE FROM {s}.records WHERE scope = %s AND name = %s", key)
        db.ex(cur, "UPDATE {s}.locks SET pruned = true WHERE scope = %s AND name = %s", key)
    return None
