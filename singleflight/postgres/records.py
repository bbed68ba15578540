"""Records in the ``records`` table: a lock's (its last success, its requests) under its scope
and name, the backend's own (activity, the fence ledger) under the empty scope. What they hold
is the rules'. ``version`` counts the writes: the compare-and-set of ``write_record``."""

from __future__ import annotations

from singleflight.core.const import TYPE_CHECKING
from singleflight.core.request import ANY_VERSION
from singleflight.postgres.db import Db, corrupt

if TYPE_CHECKING:
    from typing import Any

    import psycopg

    from singleflight.core.request import Key
    from singleflight.core.ticket import Ticket


# Is record ``r`` still there for its readers? One with a run lives while the run's ticket is in
# line; before its ticket has a row (a run claims its request first), until ``expires_at`` (the
# run's lease from the claim). One kept for so long, until ``expires_at``.
LIVE = """CASE WHEN r.run IS NULL THEN r.expires_at IS NULL OR r.expires_at > clock_timestamp()
    ELSE EXISTS (SELECT 1 FROM {s}.tickets t WHERE t.id = r.run AND t.line)
      OR (NOT EXISTS (SELECT 1 FROM {s}.tickets t WHERE t.id = r.run) AND r.expires_at > clock_timestamp())
    END"""


def _where(key: Key) -> tuple[str, str, str]:
    scope, name = key.lock if key.lock is not None else ("", "")
    return scope, name, key.name


def place(key: Key) -> str:
    scope, name, k = _where(key)
    return f"postgresql table records key {scope}/{name}/{k}" if scope else f"postgresql table records key {k}"


def read(db: Db, cur: psycopg.Cursor[Any], key: Key) -> tuple[bytes | None, Any, str]:
    """(body, version, where); a run's record whose run is no longer in line reads as None."""
    row = db.one(
        cur,
        f"SELECT r.body, r.version, {LIVE} FROM {{s}}.records r WHERE r.scope = %s AND r.name = %s AND r.key = %s",
        _where(key),
    )
    if row is None:
        return None, None, place(key)
    body, version, live = row
    if not isinstance(body, (bytes, memoryview)) or type(version) is not int:
        raise corrupt("records", "/".join(_where(key)), "a column holds a value of the wrong type")
    if not live:
        return None, version, place(key)
    return bytes(body), version, place(key)


def write(
    db: Db, cur: psycopg.Cursor[Any], key: Key, body: bytes | None, seen: Any, *, run: Ticket | None, keep: float | None
) -> bool:
    where = _where(key)
    args: tuple[Any, ...] = ()
    if seen is ANY_VERSION:
        check = ""
    elif seen is None:
        check = " AND false"  # nothing was there: only the insert below may write
    else:
        check, args = " AND version = %s", (seen,)
    if body is None:
        if seen is None:
            return not db.ex(cur, "SELECT 1 FROM {s}.records WHERE scope = %s AND name = %s AND key = %s", where)
        return bool(
            db.ex(
                cur,
                f"DELETE FROM {{s}}.records WHERE scope = %s AND name = %s AND key = %s{check} RETURNING 1",
                (*where, *args),
            )
        )
    run_id = run.ticket_id if run is not None else None
    if run is not None:
        keep = max(2.0, run.lease_seconds)  # until its ticket has a row (``LIVE``)
    expires = "clock_timestamp() + make_interval(secs => %s)" if keep is not None else "NULL::timestamptz"
    extra = (max(1.0, keep),) if keep is not None else ()
    done = db.ex(
        cur,
        f"""UPDATE {{s}}.records SET body = %s, version = version + 1, run = %s, expires_at = {expires}
            WHERE scope = %s AND name = %s AND key = %s{check} RETURNING 1""",
        (body, run_id, *extra, *where, *args),
    )
    if done:
        return True
    if seen is not None and seen is not ANY_VERSION:
        return False
    if seen is None:
        # An expired or a dead run's record reads as None, yet is there: it is ours to replace.
        db.ex(cur, f"DELETE FROM {{s}}.records r WHERE scope = %s AND name = %s AND key = %s AND NOT {LIVE}", where)
    rows = db.ex(
        cur,
        f"""INSERT INTO {{s}}.records (scope, name, key, body, version, run, expires_at)
            VALUES (%s, %s, %s, %s, 1, %s, {expires}) ON CONFLICT DO NOTHING RETURNING 1""",
        (*where, body, run_id, *extra),
    )
    return bool(rows)
