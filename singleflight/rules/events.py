"""``--cancel-in-progress``, once for every backend: who may be asked to stop, when a request
stands, its withdrawal, and when the holder acts on it (SPEC 15).

A newcomer that opted in asks an opted-in holder to stop by setting ``superseded_by`` in the
holder's ticket. The work is never lost to it:

- a newcomer that leaves before taking the lock (its wait ran out, ^C) takes its request
  back (``withdraw``), unless the holder has acted on it already: the holder's run is then
  being stopped for the newcomer, which keeps its place until that run is gone;
- one that cannot take it back (kill -9) no longer waits, and a holder acts only on a
  request whose newcomer still does (``stands``), judged once no guarded command of its
  ticket is in flight and in the same step as its token dies (``act``: a judged
  ``Lease.end``), so no withdrawal can slip in between;
- a holder whose COMMAND has ended has nothing left to cancel: its run ends as it would have.

A request that does not stand is cleared by whoever finds it. A backend offers only the
holder's record as it stands, a compare-and-set of a ticket (``update``), a poke, and a
judged end of a lease.
"""

from __future__ import annotations

import contextlib

from singleflight.core.const import DEFAULT_KILL_GRACE, EXPIRED, RELEASED, TYPE_CHECKING, WAITING
from singleflight.core.errors import BackendUnavailable, NotHeld
from singleflight.core.reasons import EndReason

if TYPE_CHECKING:
    from collections.abc import Callable

    from singleflight.backend import Lease, LockOps
    from singleflight.core.ticket import Ticket

# A newcomer waits at least the holder's kill grace and this much more for its run to stop.
SLACK = 5.0
# Compare-and-set rounds lost to heartbeats before giving up (each loser looks again at once).
_TRIES = 5


class Asked:
    """The holder a newcomer asked to stop (or found asked already by a request that stands).

    A plain ``__slots__`` class: ``dataclasses`` pulls in ``inspect``, about 10 ms on every
    pearing-run (this module is on the acquire path)."""

    __slots__ = ("grace", "handed_on", "holder")

    def __init__(self, holder: str, grace: float, handed_on: bool = False) -> None:
        self.holder = holder
        self.grace = grace  # its kill grace: how long stopping its COMMAND may take
        self.handed_on = handed_on  # seen gone after stopping for us: its lock is being handed on


def stands(lk: LockOps, by: str) -> bool:
    """Does the newcomer ``by`` still wait, its process alive? (Its ticket, not its entry in line:
    the lock dir publishes an entry's deadline a moment after the entry, and a newcomer caught
    between its wait and its withdrawal is still waiting: it then keeps its place, ``withdraw``.)"""
    t = lk.read(by)
    return t is not None and t.state == WAITING and not t.orphaned()


def target(lk: LockOps, ticket: Ticket) -> Asked | None:
    """The holder ``ticket`` may ask to stop. Only read: the request is made once we are in line
    (``ask``), where the holder can see that we wait."""
    for h in holders(lk):  # with --slots: the opted-in one with the lowest fence
        asked = _askable(lk, h, ticket)
        if asked is not None:
            return asked
    return None


def _holder(lk: LockOps, ticket_id: str) -> Ticket | None:
    """The holder ``ticket_id`` as recorded now, if it still holds (or is being stopped)."""
    return next((h for h in holders(lk) if h.ticket_id == ticket_id), None)


def holders(lk: LockOps) -> list[Ticket]:
    """The tickets holding as the line stands (their tokens may have died already: COMMAND being
    stopped), lowest fence first: the one first in line, or with ``--slots`` every slot's.
    Another client's key is not a ticket: left out."""
    line = lk.line()
    return [e for e in line.entries[: line.holders] if not isinstance(e, dict)]


def _mark(lk: LockOps, holder: Ticket, by: str | None) -> bool:
    """Compare-and-set of the holder's ``superseded_by``: only while its ticket is live and its
    request still the one we judged. A holder newly asked is told at once."""
    seen = holder.superseded_by

    def change(t: Ticket) -> bool:
        if not t.live or t.superseded_by != seen:
            return False
        t.superseded_by = by
        return True

    try:
        done = lk.update(holder.ticket_id, change)
    except NotHeld:
        return False  # its lease went meanwhile
    if done is not None and by is not None:
        done.poke()  # its holder checks its ticket now, not at its next deadline
    return done is not None


def _askable(lk: LockOps, h: Ticket, ticket: Ticket) -> Asked | None:
    """Who may be asked: a holder that opted in, is not ours, and is alive (a dead one lets go by
    itself). Never one that did not opt in."""
    if not h.live or not h.cancel_in_progress or h.ticket_id == ticket.ticket_id or h.orphaned():
        return None
    return Asked(h.ticket_id, h.kill_grace if h.kill_grace is not None else DEFAULT_KILL_GRACE)


def ask(lk: LockOps, ticket: Ticket, holder: Asked) -> Asked | None:
    """Ask ``holder`` to stop (its token dies first, then its COMMAND), ``ticket`` being in line
    now. An earlier request that stands keeps its place (we wait behind it all the same); one
    whose newcomer is gone is replaced. None when there is nobody to ask any more."""
    for _ in range(_TRIES):
        h = _holder(lk, holder.holder)
        if h is None or _askable(lk, h, ticket) is None:
            return None
        if h.superseded_by == ticket.ticket_id or (h.superseded_by and stands(lk, h.superseded_by)):
            return holder
        if _mark(lk, h, ticket.ticket_id):
            return holder
    return None


def withdraw(lk: LockOps, ticket: Ticket, asked: Asked) -> float:
    """We are leaving before taking the lock: take our request back. How much longer to keep our
    place instead: 0 once withdrawn (or never acted on); while the holder is stopping its run
    for us, its kill grace and the slack; once, the slack alone after it is gone, while its
    lock is handed on (it would otherwise go to nobody, and neither run did the work)."""
    for _ in range(_TRIES):
        h = _holder(lk, asked.holder)
        if h is None:
            old = lk.read(asked.holder)
            stopped_for_us = old is not None and old.superseded_by == ticket.ticket_id and old.state != RELEASED
            return _handed_on(asked) if stopped_for_us else 0.0
        if h.superseded_by != ticket.ticket_id:
            return 0.0
        if not h.live:  # its token died for us: it is stopping its COMMAND
            return _handed_on(asked) if h.orphaned() else asked.grace + SLACK
        if _mark(lk, h, None):
            return 0.0
    return 0.0


def _handed_on(asked: Asked) -> float:
    if asked.handed_on:
        return 0.0
    asked.handed_on = True
    return SLACK


def act(lk: LockOps, lease: Lease, *, command_ended: Callable[[], bool], keep: Callable[[], None]) -> str | None:
    """In the holder, asked to stop: the newcomer it stops for (its token is dead now), or None
    when no request stands (its COMMAND ended, its newcomer left or died; the request is cleared
    and the run goes on). ``keep`` keeps the lease ours while guarded commands are waited for.

    The request is judged by the store's end (``Lease.end``), once no guarded command of the
    ticket is in flight and in the same step as its token dies: a withdrawal lands before or
    after, never between the judgement and the end."""

    def judge(t: Ticket) -> str | None:
        by = t.superseded_by
        if not by or command_ended() or not stands(lk, by):
            return None
        lease.ticket.superseded_by = by  # what the end record says it was stopped for
        return EndReason.SUPERSEDED.text(by)

    if lease.end(EXPIRED, judge, keep):
        return lease.ticket.superseded_by
    # Not ended: a request that does not stand is cleared (a standing one the store could not
    # act on now, lease lost or store out of reach, is left for the next look; so is the clearing
    # when the store is out of reach).
    with contextlib.suppress(BackendUnavailable):
        t = lk.read(lease.ticket.ticket_id)
        if t is not None and t.live and t.superseded_by and judge(t) is None:
            _mark(lk, t, None)
    return None
