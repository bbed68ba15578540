"""The thread service, once for every backend: the seed's ``get-thread-tree`` / ``create-reply``
as a fenced target (SPEC "The thread service").

Thread N of a scope is guarded by the lock ``thread-work.N`` of that scope. A reply carries a
fence, the first of: the caller's own (``--fence``); ``PEARING_FENCE`` when the environment is a
pearing-run COMMAND's of that very lock; the fence of a ticket this identity holds on it now
(the seed's CLI flow: acquire-lock, then create-reply). The store accepts a reply only if its
fence is >= the highest the thread accepted, in the same step that stores it
(``Backend.add_reply``): a holder that lost its lease, or a process it left behind, cannot
reply after a newer holder did. A reply with no fence at all is refused, unless the caller
says it is an unfenced note (a person's), stored with ``fence: null``.
"""

from __future__ import annotations

import time
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any

from singleflight.core import names
from singleflight.core.const import ENV_FENCE, ENV_LOCK, ENV_REPO, ENV_TICKET, HELD
from singleflight.core.errors import (
    BadValue,
    FenceContended,
    NotHeld,
    PearingError,
    StaleFence,
    UnknownLock,
    UsageError,
)
from singleflight.core.record import new_uuid4, rfc3339

if TYPE_CHECKING:
    from singleflight.backend import Backend


def lock_of(thread: int) -> str:
    """The lock that guards thread N (the seed's convention)."""
    return f"thread-work.{thread}"


class NoFence(PearingError):
    """A reply that carries no fence and is not an unfenced note: refused (exit 1)."""

    exit_code = NotHeld.exit_code

    def __init__(self, repo: str, thread: int) -> None:
        super().__init__(
            f"no fence for thread {repo}#{thread}: hold {lock_of(thread)} in scope {repo!r} "
            "(pearing-run or pearing-cli acquire-lock), pass --fence N, or --unfenced for a note"
        )


def tree(backend: Backend, repo: str, thread: int) -> dict[str, Any]:
    """The thread as the seed shows it: replies nested under their parents, each level in the
    order the thread accepted them, and the highest fence accepted (None before the first)."""
    repo, thread = names.scope(repo, "repo"), names.thread(thread)
    rows, highest = backend.read_thread(repo, thread)
    by_id: dict[str, dict[str, Any]] = {}
    top: list[dict[str, Any]] = []
    for row in rows:
        node = {**row, "created_at": rfc3339(row["created_at"]), "replies": []}
        by_id[row["reply_id"]] = node
        parent = by_id.get(row["parent_id"]) if row["parent_id"] else None
        (parent["replies"] if parent is not None else top).append(node)
    return {"repo": repo, "thread": thread, "lock_name": lock_of(thread), "fence": highest, "replies": top}


def reply(
    backend: Backend,
    repo: str,
    thread: int | str,
    *,
    kind: str,
    body: str,
    links: Sequence[str] = (),
    parent: str | None = None,
    fence: int | str | None = None,
    unfenced: bool = False,
    identity: str,
    env: Mapping[str, str],
    spelling: Mapping[str, str] | None = None,
) -> dict[str, Any]:
    """Store one reply and return it as stored. ``spelling``: the front end's names of the
    values (``--kind`` on the command line, ``kind`` in Python and MCP), for its messages."""
    say = {"kind": "kind", "body": "body", "link": "link", "parent": "parent", "fence": "fence", **(spelling or {})}
    repo, number = names.scope(repo, "repo"), names.thread(thread)
    now = time.time()
    row: dict[str, Any] = {
        "reply_id": new_uuid4(),
        "parent_id": None if parent is None else names.reply_id(parent, say["parent"]),
        "kind": names.reply_kind(kind, say["kind"]),
        "body": names.reply_body(body, say["body"]),
        "links": names.reply_links(list(links), say["link"]),
        "identity": names.identity(identity),
        "fence": None,
        "ticket_id": None,
        "created_at": now,
    }
    if fence is not None and unfenced:
        raise UsageError(f"give {say['fence']} or the unfenced flag, not both")
    if not unfenced:
        row["fence"], row["ticket_id"] = _fence_of(
            backend, repo, number, fence, identity=identity, env=env, what=say["fence"]
        )
    _store(backend, repo, number, row)
    return {**row, "created_at": rfc3339(now), "replies": []}


# Writers of one thread race only each other; each loser reads again at once.
_TRIES = 64


def _store(backend: Backend, repo: str, thread: int, row: dict[str, Any]) -> None:
    """The rule, once for every store: a fence below the thread's highest is refused, a parent
    must be a reply of this thread (replies are never removed: one seen stays), and the store
    appends only while the highest it holds is the one judged here (else judged again)."""
    where = f"thread {repo}#{thread}"
    fence, parent = row["fence"], row["parent_id"]
    for _ in range(_TRIES):
        rows, highest = backend.read_thread(repo, thread)
        if parent is not None and all(r["reply_id"] != parent for r in rows):
            raise BadValue("parent", parent, f"is not a reply of {where}")
        if fence is not None and highest is not None and fence < highest:
            raise StaleFence(where, fence, highest)
        if backend.add_reply(repo, thread, row, highest=highest):
            return
    raise FenceContended(f"the fence of {where}", _TRIES)


def _fence_of(
    backend: Backend,
    repo: str,
    thread: int,
    given: int | str | None,
    *,
    identity: str,
    env: Mapping[str, str],
    what: str,
) -> tuple[int, str | None]:
    """(fence, the ticket it came from when known): the SPEC's order of the three sources."""
    lock = lock_of(thread)
    in_command = env.get(ENV_LOCK) == lock and (env.get(ENV_REPO) or "default") == repo
    ticket = env.get(ENV_TICKET) if in_command else None
    if given is not None:
        return names.fence(given, what), ticket
    if in_command and env.get(ENV_FENCE):
        return names.fence(env[ENV_FENCE], ENV_FENCE), ticket
    held = _held_by(backend, repo, lock, identity)
    if held is None:
        raise NoFence(repo, thread)
    return held


def _held_by(backend: Backend, repo: str, lock: str, identity: str) -> tuple[int, str] | None:
    """The fence and ticket of the ticket ``identity`` holds on the lock now, if any."""
    try:
        lk = backend.lock(repo, lock, create=False)
    except UnknownLock:
        return None
    try:
        line = lk.line()
    finally:
        lk.close()
    first = line.entries[0] if line.held and line.entries else None
    if first is None or isinstance(first, dict) or first.state != HELD or first.identity != identity:
        return None
    if first.fence is None:
        return None
    return first.fence, first.ticket_id
