"""A ticket's end and its views, once for every backend: release (idempotent, held -> released,
waiting -> cancelled), the end of an orphan, the ticket object of SPEC.md and a lock's status.

A backend only reads and ends tickets and says where one stands in line; how a ticket's process
is made to let go (``stop``) is written here once.
"""

from __future__ import annotations

import math
import os
import signal
import time
from contextlib import contextmanager

from singleflight.core import names, proc
from singleflight.core.const import CANCELLED, EXPIRED, HELD, RELEASED, TYPE_CHECKING, WAITING
from singleflight.core.errors import NotHeld, UnknownLock, UnknownTicket
from singleflight.core.reasons import EndReason
from singleflight.core.tokens import TokenFiles
from singleflight.rules import records

if TYPE_CHECKING:
    from collections.abc import Iterator
    from typing import Any

    from singleflight.backend import LockOps, Opened
    from singleflight.core.line import Line
    from singleflight.core.ticket import Ticket

# How long a release waits for the ticket's process to let go of the lock (a holder stops
# its COMMAND first: TERM, its grace, KILL). Past it the release returns; the lock follows.
RELEASE_WAIT = 10.0
# How often a release looks whether a holder elsewhere has let go.
_OUT_OF_LINE_POLL = 0.05
# How long an agent may take to start and take the ticket whose turn it is.
_SETTLE = 5.0
# A wait for another process's ticket looks every tenth of the time it has waited: 5 ms at first,
# 50 ms from half a second on.
_TURN_POLL = (0.005, 0.05)


@contextmanager
def existing_lock(at: Opened, lock: str, repo: str, ticket_id: str) -> Iterator[LockOps]:
    """The lock a command names a ticket of, which must exist (closed after): a lock the store
    has no record of is that ticket's "unknown ticket", naming the ticket asked for."""
    try:
        lk = at.backend.lock(names.scope(repo), names.lock_name(lock), create=False)
        try:
            yield lk
        finally:
            lk.close()
    except UnknownLock as exc:
        raise UnknownLock(exc.repo, exc.lock, ticket_id) from None


def _tokens(at: Opened, repo: str, lock: str) -> TokenFiles:
    """This host's token files of the lock: in the lock dir on every backend, whoever stores the ticket."""
    return TokenFiles.at(at.lock_dir, repo, lock)


def _remove_token(at: Opened, t: Ticket) -> None:
    tokens = _tokens(at, t.repo, t.lock_name)
    try:
        tokens.remove(t.ticket_id)
    finally:
        tokens.close()


def release(at: Opened, lk: LockOps, ticket_id: str) -> Ticket:
    """Release a held ticket or cancel a waiting one, and wait until its process let go.

    Idempotent: a ticket released or cancelled already is returned as it is. Any other end
    (expired, superseded) is NotHeld with its reason: its owner must stop.
    """
    t = lk.read(ticket_id)
    if t is None:
        raise UnknownTicket(ticket_id)
    if not t.live:
        return _released_already(t)
    ended = stop(lk, t, RELEASED, EndReason.RELEASED_BY_OWNER, within=RELEASE_WAIT)
    if ended is None:  # it ended on its own meanwhile
        return _released_already(lk.read(ticket_id) or t)
    _remove_token(at, t)
    return lk.read(ticket_id) or ended


def stop(lk: LockOps, t: Ticket, state: str, reason: str, *, within: float) -> Ticket | None:
    """End a live ticket (its token dies; a waiting one is cancelled) and have its process let go
    of the lock, waiting at most ``within`` for it. None if it had ended already.

    - A waiter leaves the line at once: the store takes it out (the lock dir, where a waiter's
      own process holds its place, wakes it and waits for it to go).
    - A holder on this host that has settled is poked: it stops COMMAND first, lets go, exits.
    - One elsewhere, or still settling (its take finds the end), lets go at its next look: until
      it is out of the line.
    - One whose processes are all gone is let go of here and now.
    """
    here = t.holder_host in (None, os.uname().nodename)
    gone = here and t.orphaned()
    ended = lk.end(t.ticket_id, state, reason, only_if_held=False, release=gone)
    if ended is None or gone:
        return ended
    if ended.fence is None:  # it was waiting: out of the line now
        return ended
    if here and ended.acquired_at is not None:
        proc.poke_and_wait(ended.holder_pid, ended.holder_start, signal.SIGUSR1, within)
    else:
        _await_out_of_line(lk, ended.ticket_id, within)
    return ended


def _await_out_of_line(lk: LockOps, ticket_id: str, within: float) -> None:
    """A holder elsewhere lets go at its next look (a third of its lease at most)."""
    deadline = time.monotonic() + within
    while any(not isinstance(e, dict) and e.ticket_id == ticket_id for e in lk.line().entries):
        if time.monotonic() >= deadline:
            return
        time.sleep(_OUT_OF_LINE_POLL)


def _released_already(t: Ticket) -> Ticket:
    if t.state in (RELEASED, CANCELLED):
        return t
    raise NotHeld(t.ticket_id, t.describe_end())


def heartbeat(lk: LockOps, ticket_id: str, seconds: float) -> Ticket:
    """Extend a live ticket's lease to ``seconds`` from now (manual heartbeat, a retried acquire).

    Refused once it ended, its lease ran out (a lapsed lease is never revived, even before its
    holder noticed) or its process is gone: NotHeld, one wording on every backend.
    """
    was: list[float | None] = [None]

    def extend(t: Ticket) -> bool:
        refused = t.refusal(gone=t.live and t.orphaned())
        if refused is not None:
            raise NotHeld(t.ticket_id, refused)
        was[0] = t.lease_expires_at
        t.set_lease(seconds)
        return True

    t = lk.update(ticket_id, extend)
    assert t is not None, "a live ticket is written"
    before = was[0]
    if t.state == HELD and before is not None and (t.lease_expires_at or 0.0) < before:
        # A shorter lease than before: the holder sleeps until the deadline it knows, so make
        # it look now, or the lock would outlive the lease.
        t.poke()
    return lk.read(ticket_id) or t  # its state and fence as they stand


def adopt(lk: LockOps, ticket_id: str, pid: int) -> Ticket | None:
    """The agent ``pid`` (on this host) answers for this waiting ticket from now on: its pid in
    the ticket, by compare-and-set. None when it is no longer waiting (released, promoted for
    somebody else, lapsed) or gone."""
    start, host = proc.start_time(pid), os.uname().nodename

    def take_over(t: Ticket) -> bool:
        if t.state != WAITING:
            return False
        t.holder_pid, t.holder_start, t.holder_host = pid, start, host
        return True

    try:
        return lk.update(ticket_id, take_over)
    except (UnknownTicket, NotHeld):
        return None


def await_turn(lk: LockOps, ticket_id: str, wait_seconds: float, *, since: float | None = None) -> None:
    """Block until the waiting ticket ``ticket_id``, whose agent is another process, is promoted
    or ends, at most ``wait_seconds``; then, if its agent has not taken its place in line yet
    (still starting) or its turn has come, the moments that agent takes to settle: a ticket
    about to hold is not answered "waiting". (Its owner waits here only for a request sent
    again; the first call follows its agent's word.) ``since``: when the caller began to wait
    (monotonic), if that was before this call (it waits in steps)."""
    start = time.monotonic()
    end = start + max(wait_seconds, 0.0)
    start = start if since is None else since
    settled_by = None
    while (t := lk.read(ticket_id)) is not None and t.state == WAITING:
        now = time.monotonic()
        if now >= end:
            line = lk.line()
            place = line.position(ticket_id)
            if place is not None and place > line.slots - line.holders:
                return  # in line behind others: it is waiting
            settled_by = settled_by or now + _SETTLE
            if now >= settled_by:
                return
        time.sleep(min(max((time.monotonic() - start) / 10, _TURN_POLL[0]), _TURN_POLL[1]))


def waiting_deadline(lk: LockOps, ticket_id: str) -> float:
    """A waiting ticket's lease as heartbeats extend it (monotonic; ``inf``: none); 0 once it has
    ended (released, cancelled, superseded): its wait is over. (A ticket just promoted reads as
    held before its waiter has taken the lock: still live, its wait goes on to take it.)"""
    t = lk.read(ticket_id)
    if t is None or not t.live:
        return 0.0
    due = t.deadline_here()
    return math.inf if due is None else due


def end_orphan(at: Opened, lk: LockOps, t: Ticket) -> Ticket:
    """End a ticket whose process died without a word: nobody holds or waits for it any more."""
    final = EXPIRED if t.state == HELD else CANCELLED
    ended = lk.end(t.ticket_id, final, EndReason.HOLDER_GONE, only_if_held=False)
    _remove_token(at, t)
    return lk.read(t.ticket_id) or ended or t


def view(at: Opened, lk: LockOps, t: Ticket) -> dict[str, Any]:
    """The ticket object of SPEC.md, as its owner sees it."""
    if t.state == HELD and t.orphaned():
        # Never report a lock held whose holder is gone: nobody keeps it any more.
        t = end_orphan(at, lk, t)
    position = lk.line().position(t.ticket_id) if t.state == WAITING else None
    tokens = _tokens(at, t.repo, t.lock_name)
    try:
        return _public(at, tokens, t, position)
    finally:
        tokens.close()


def _public(at: Opened, tokens: TokenFiles, t: Ticket, position: int | None) -> dict[str, Any]:
    token_file = None
    if t.state == HELD and tokens.exists(t.ticket_id):
        token_file = tokens.path(t.ticket_id)
    return t.public(
        activity=records.read_activity(at.backend, t.identity), queue_position=position, token_file=token_file
    )


def status(at: Opened, lk: LockOps, repo: str, lock: str) -> dict[str, Any]:
    """Who holds the lock (``lk``: ``repo``'s ``lock``), who waits in what order, and its fence."""
    line = lk.line()
    tokens = _tokens(at, repo, lock)
    try:
        return {"lock_name": lock, "repo": repo, **_status(at, line, tokens)}
    finally:
        tokens.close()


def _status(at: Opened, line: Line, tokens: TokenFiles) -> dict[str, Any]:
    entries: list[dict[str, Any]] = []
    now = time.monotonic()
    for i, e in enumerate(line.entries):
        holding = i < line.holders
        if isinstance(e, dict):  # another client's key in the line (etcdctl lock)
            entries.append(e)
            if holding:
                e.setdefault("lease_left", None)
            continue
        entries.append(_public(at, tokens, e, line.position(e.ticket_id)))
        if holding:
            left = e.lease_left(now)
            entries[-1]["lease_left"] = None if left is None else round(max(0.0, left), 3)
    holders = entries[: line.holders]
    return {
        "state": "held" if line.held else "free",
        "fence": line.fence,
        # The holder with the lowest fence (the only one without --slots); every one in ``holders``.
        "holder": holders[0] if holders else None,
        "holders": holders,
        "slots": {"used": len(holders), "total": line.slots},
        "waiters": entries[line.holders :],
        **line.extra,
    }


def statuses(at: Opened, repo: str | None, lock: str | None, *, idle: bool = False) -> list[dict[str, Any]]:
    """The locks of a scope (None: of every scope) with a holder or waiters, each with them;
    ``idle`` adds the free ones. One lock asked for by name is shown whatever its state."""
    if lock is not None:
        assert repo is not None
        wanted = [(repo, lock)] if (repo, lock) in at.backend.locks(repo, idle=True) else []
    else:
        wanted = at.backend.locks(repo, idle=idle)
    out = []
    for scope, name in wanted:
        lk = at.backend.lock(scope, name)
        try:
            found = status(at, lk, scope, name)
        finally:
            lk.close()  # its token files' directories: a server lives for days
        if idle or lock is not None or found["holder"] is not None or found["waiters"]:
            out.append(found)
    return out
