"""The guard's side of the PostgreSQL backend: what the database knows of a token (``Facts``),
in one transaction, and an in-flight guarded command (a ``guards`` row, which the next holder's
promotion and this holder's end wait for)."""

from __future__ import annotations

import contextlib
import os
import uuid

from singleflight.core import proc
from singleflight.core.const import TYPE_CHECKING
from singleflight.core.tokens import Claim, Facts, same_secret
from singleflight.postgres.db import Db
from singleflight.postgres.line import COLS, COLS_N, Line, as_stored, channel

if TYPE_CHECKING:
    from collections.abc import Iterator
    from typing import Any

    import psycopg


def _facts(db: Db, cur: psycopg.Cursor[Any], claim: Claim, digest: str) -> Facts:
    key = (claim.repo, claim.lock)
    fence_row = db.one(cur, "SELECT fence FROM {s}.locks WHERE scope = %s AND name = %s", key)
    fence_now = fence_row[0] if fence_row is not None and fence_row[0] else None
    if claim.ticket_id:
        rows = db.ex(
            cur,
            f"""SELECT id, {COLS}, held_until - clock_timestamp() FROM {{s}}.tickets
                WHERE id = %s AND scope = %s AND name = %s""",
            (claim.ticket_id, *key),
        )
    else:
        rows = db.ex(
            cur,
            f"""SELECT id, {COLS}, held_until - clock_timestamp() FROM {{s}}.tickets
                WHERE scope = %s AND name = %s AND line ORDER BY seq""",
            key,
        )
        # Constant-time compare: a forger learns nothing from timing.
        rows = [r for r in rows if same_secret(str((r[1] or {}).get("token_hash") or ""), digest)][:1]
    if not rows:
        return Facts(None, fence_now=fence_now)
    r = rows[0]
    t = as_stored(r[0], r[1 : COLS_N + 1])
    t.lease_deadline_mono = t.deadline_here()
    here = t.holder_host == os.uname().nodename
    alive = not here or proc.alive(t.holder_pid, t.holder_start)
    left = r[COLS_N + 1].total_seconds() if r[COLS_N + 1] is not None else None
    margin = min((t.kill_grace or 0.0) + 1.5, max(2.0, t.lease_seconds) / 3)

    def cut_off() -> bool:
        return left is None or left <= margin

    return Facts(t, fence_now=fence_now, holder_alive=alive, cut_off=cut_off)


@contextlib.contextmanager
def guard(db: Db, claim: Claim, digest: str, hold: float | None) -> Iterator[Facts]:
    if hold is None:
        with db.tx() as cur:
            facts = _facts(db, cur, claim, digest)
        yield facts
        return
    gid = str(uuid.uuid4())
    key = (claim.repo, claim.lock)
    with db.tx() as cur:
        Line(db, cur, *key).lock_row()
        held = db.ex(
            cur,
            """INSERT INTO {s}.guards (id, scope, name, ticket_id, until)
               SELECT %s, %s, %s, id, clock_timestamp() + make_interval(secs => %s) FROM {s}.tickets
               WHERE id = %s AND scope = %s AND name = %s AND line AND hold AND held_until > clock_timestamp()
               RETURNING 1""",
            (gid, *key, hold + 2, claim.ticket_id or "", *key),
        )
        facts = _facts(db, cur, claim, digest) if held else Facts(None)
    try:
        yield facts
    finally:
        if held:
            with db.tx() as cur:
                db.ex(cur, "DELETE FROM {s}.guards WHERE id = %s", (gid,))
                db.ex(cur, "SELECT pg_notify(%s, '')", (channel(db, *key),))
