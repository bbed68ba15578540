"""The thread service on PostgreSQL: a thread's highest fence in ``threads``, its replies in
``replies`` in the order accepted (``seq``). A reply lands in one transaction over the thread's
row as read, only while its fence is the one the rule judged (rules/threads.py)."""

from __future__ import annotations

import json
from typing import Any

from singleflight.core.record import stored_reply
from singleflight.postgres.db import Db, corrupt


def read(db: Db, repo: str, thread: int) -> tuple[list[dict[str, Any]], int | None]:
    with db.tx() as cur:
        top = db.one(cur, "SELECT fence FROM {s}.threads WHERE scope = %s AND thread = %s", (repo, thread))
        rows = db.ex(
            cur,
            "SELECT reply_id, body FROM {s}.replies WHERE scope = %s AND thread = %s ORDER BY seq",
            (repo, thread),
        )
    # A thread's row is made by its first reply; one without a fence (None) accepted none yet.
    highest = _fence(repo, thread, top[0]) if top is not None and top[0] is not None else None
    return [_reply(repo, thread, r[0], r[1]) for r in rows], highest


def add(db: Db, repo: str, thread: int, reply: dict[str, Any], *, highest: int | None) -> bool:
    key = (repo, thread)
    with db.tx() as cur:
        db.ex(cur, "INSERT INTO {s}.threads (scope, thread) VALUES (%s, %s) ON CONFLICT DO NOTHING", key)
        top = db.one(cur, "SELECT fence FROM {s}.threads WHERE scope = %s AND thread = %s FOR UPDATE", key)
        if db.ex(
            cur,
            "SELECT 1 FROM {s}.replies WHERE scope = %s AND thread = %s AND reply_id = %s",
            (*key, reply["reply_id"]),
        ):
            return True  # sent twice: stored already
        now = _fence(repo, thread, top[0]) if top is not None and top[0] is not None else None
        if now != highest:
            return False
        db.ex(
            cur,
            "INSERT INTO {s}.replies (scope, thread, reply_id, body) VALUES (%s, %s, %s, %s)",
            (*key, reply["reply_id"], json.dumps(reply, sort_keys=True)),
        )
        fence = reply["fence"]
        if fence is not None and (highest is None or fence > highest):
            db.ex(cur, "UPDATE {s}.threads SET fence = %s WHERE scope = %s AND thread = %s", (fence, *key))
    return True


def _fence(repo: str, thread: int, value: Any) -> int:
    if type(value) is not int or value < 1:
        raise corrupt("threads", f"{repo}/{thread}", f"not a fence: {value!r}")
    return value


def _reply(repo: str, thread: int, reply_id: str, r: Any) -> dict[str, Any]:
    where = f"{repo}/{thread}/{reply_id}"
    reply = stored_reply(r)
    if reply is None:
        raise corrupt("replies", where, "a reply field holds a value of the wrong type")
    return reply
