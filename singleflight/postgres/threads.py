"""The thread service on PostgreSQL: a thread's highest fence in ``threads``, its replies in
``replies`` in the order accepted (``seq``). A reply lands in one transaction over the thread's
row as read, only while its fence is the one the rule judged (rules/threads.py)."""

from __future__ import annotations

import json
from typing import Any

from singleflight.core.record import epoch
from singleflight.postgres.db import Db, corrupt

_FIELDS = ("reply_id", "parent_id", "kind", "body", "links", "identity", "fence", "ticket_id", "created_at")


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
    ok = (
        isinstance(r, dict)
        and isinstance(r.get("reply_id"), str)
        and (r.get("parent_id") is None or isinstance(r.get("parent_id"), str))
        and isinstance(r.get("kind"), str)
        and isinstance(r.get("body"), str)
        and isinstance(r.get("links"), list)
        and all(isinstance(x, str) for x in r["links"])
        and isinstance(r.get("identity"), str)
        and (r.get("fence") is None or (type(r.get("fence")) is int and r["fence"] >= 1))
        and (r.get("ticket_id") is None or isinstance(r.get("ticket_id"), str))
    )
    try:
        created = epoch(r.get("created_at") if ok else None, "created_at")
    except TypeError:
        ok = False
    if not ok:
        raise corrupt("replies", where, "a reply field holds a value of the wrong type")
    return {**{k: r.get(k) for k in _FIELDS}, "created_at": created}
