"""What a backend does, and the one place that turns a URL into one.

A backend keeps the lock, the queue, the lease, the fence and the records of every (scope,
lock). Each store's package implements this interface and is named in the scheme table
(``core.schemes``): ``singleflight.local`` (a kernel ``flock`` in the lock dir; one host) and
``singleflight.etcd`` (a cluster; many hosts). The runner, the holder, the guard and the seed's
commands see only these protocols, so an algorithm is written once and a
backend differs only behind them.

The acquire path, for pearing-run, the CLI's agent and ``Lock`` alike::

    lock = backend.lock(repo, name)
    grip, place = lock.enter(ticket)      # the lock at once (grip), else a place to queue
    place.queue(); grip = place.wait(deadline)     # FIFO, bounded, woken by the backend
    lease, taken = lock.take(grip, ticket, ...)    # in the holder: fence, token, token file
    Holder(lease, ...).serve()                     # renew / check / end / release

A run that gets the lock at once forks its holder with the grip. One that waits forks it as it
starts to wait and, once first, hands it the grip (``Grip.handover``: a description, and the
lock dir's flocked fd over their socketpair), which ``LockOps.take`` takes as the grip: no fork
lies between the previous holder's release and COMMAND's start.
"""

from __future__ import annotations

from contextlib import AbstractContextManager

from singleflight.core import schemes
from singleflight.core.const import TYPE_CHECKING
from singleflight.core.errors import BadValue

if TYPE_CHECKING:
    from collections.abc import Callable
    from typing import Any, Protocol

    from singleflight.core.idle import Idle
    from singleflight.core.line import Line
    from singleflight.core.protocol import Taken
    from singleflight.core.reasons import Loss
    from singleflight.core.request import Key
    from singleflight.core.ticket import Ticket
    from singleflight.core.tokens import Claim, Facts
else:
    Protocol = object  # the checker's Protocols are plain classes at run time


class Grip(Protocol):
    """What an acquisition holds: the lock's fd (local) or the ticket's lease (etcd).

    The wrapper and its holder both have it. The lock is released only once COMMAND is
    dead, whichever of the two dies or freezes first: the lock dir's flock lives while
    either keeps its copy of the fd; an etcd lease is kept alive by both.
    """

    def keep(self) -> float | None:
        """While COMMAND lives: keep the lock ours a while longer once that is due (an etcd
        keepalive; a call before then sends nothing); never raises. How many seconds until it is
        due again; None: never (the lock dir's fd keeps it), and no need to call again."""

    def still_ours(self) -> bool:
        """Right before COMMAND starts: is the lock certainly still ours? (An etcd lease that
        nobody could keep alive for a whole TTL, wrapper and holder frozen, may have lapsed.)"""

    def close(self) -> None:
        """This process lets go of its share; the holder's share may still hold the lock."""

    def release(self) -> None:
        """The holder is gone and COMMAND is dead: free the lock now."""

    def handover(self) -> tuple[dict[str, Any], set[int]]:
        """What another process needs to hold this grip too: a description, and the fds that
        go with it (the lock dir's flocked fd; none on etcd). A holder forked with the grip keeps
        those fds open (the rest are closed); one forked before the grip existed gets both over
        its socketpair (the fds by SCM_RIGHTS), and ``take`` accepts the description with the
        fds it received as ``"fds"``."""


class Place(Protocol):
    """One arrival at a lock that did not get it at once: the right to queue for it."""

    def queue(self, deadline: Callable[[], float]) -> int:
        """Take a place at the end of the line, held at most until ``deadline()`` (monotonic; asked
        once the ticket is written, and later calls by ``wait`` may extend it); its 1-based
        position. A ticket whose ``queue_mode`` is ``latest`` cancels the older ``latest`` waiters
        and takes their place.
        A ticket with ``max_waiting`` joins only while fewer wait ahead of it, counted and joined
        in one step (two arrivals at once never both pass the bound); else ``LineFull``."""

    def wait(self, deadline: Callable[[], float]) -> Grip | None:
        """Block until first in line and holding (the grip), or ``deadline()`` (monotonic) passes.

        ``deadline`` is asked again whenever it runs out, so a heartbeat that
        extends a waiting ticket keeps its place; 0 ends the wait at once.
        """

    def leave(self) -> None:
        """Leave the line (also after ``wait`` returned the grip)."""


class Lease(Protocol):
    """The holder's side of a held ticket: its lease, its token's liveness, its lock."""

    ticket: Ticket

    def renew(self) -> None:
        """Extend the lease by ``ticket.lease_seconds`` (auto heartbeat); never over a heartbeat
        the holder has not seen (compare-and-set on what it last read): that beat then stands,
        and ``ticket`` says so. Every store; the holder's first manual lease relies on it."""

    def check(self) -> Loss | None:
        """At the deadline or when poked: None if still ours (deadline updated), else why it is
        not (``Loss.released``: its owner released it)."""

    def end(
        self, state: str, reason: str | Callable[[Ticket], str | None], keep: Callable[[], None] | None = None
    ) -> bool:
        """The token stops being live, once no guarded command of its ticket is in flight (the
        lease kept meanwhile: by ``keep``, called at least every ``cadence.guarded_every`` of the
        lease, when given). The lock stays ours until ``release``, so COMMAND can be stopped
        first. True when this call ended it.

        ``reason`` may be a judgement (``rules.events``: a cancel request that stands): given the
        live ticket as stored once no guarded command is in flight, the end's reason, or None to
        leave it live; judged and ended in one step, so no other write lands in between."""

    def keep(self) -> None:
        """While COMMAND is being stopped: keep the lock ours a while longer; never raises."""

    def wake_fd(self) -> int | None:
        """An fd that turns readable when the backend has news for this lease (on etcd: an
        opted-in holder's key changed, as a cancel-in-progress request does); the holder then
        calls ``check``. None: no such fd now (asked again before every wait)."""

    def release(self, announce: Callable[[], None]) -> None:
        """Let go of the lock (the next waiter is promoted now), then ``announce`` it (its owner
        hears the lock is free), then tidy up after the run: the store's housekeeping, off the
        hand-over's path."""


class LockOps(Protocol):
    """One (scope, lock) on a backend (its caller knows which)."""

    def close(self) -> None: ...

    # -- acquiring ---------------------------------------------------------------------------
    def enter(self, ticket: Ticket) -> tuple[Grip | None, Place]:
        """Arrive: the lock itself when it is free and nobody is in line (the place then needs no
        ``leave``), else no grip and a place to queue from."""

    def take(self, grip: Any, ticket: Ticket, *, promoted: bool, kill_grace: float) -> tuple[Lease, Taken]:
        """In the holder: issue the fence, mint the token, write the token file.

        ``grip`` is the one this backend's ``Place`` returned (opaque to the runner), or, in a
        holder forked as its run started to wait, what that grip's ``handover`` described.
        A ticket its owner ended meanwhile (released as its turn came) is not taken: NotHeld.
        """

    # -- the ticket, from any process ----------------------------------------------------------
    def create(self, ticket: Ticket) -> Ticket:
        """Record a new waiting ticket for ``ticket.request_uuid``, or return the ticket that
        request already has (one ticket per request uuid, even when two arrive at once)."""

    def read(self, ticket_id: str) -> Ticket | None: ...

    def end(
        self, ticket_id: str, state: str, reason: str, *, only_if_held: bool = True, release: bool = True
    ) -> Ticket | None:
        """End a ticket (None if it had ended already); a waiting one only with ``only_if_held``
        False. With ``release`` (the caller's own ticket, or one whose processes are all gone) it
        leaves the line and frees the lock now. Without, a holder's token dies and the lock stays
        taken until the grip is released (COMMAND is still being stopped); a waiter leaves the
        line at once and is woken, but only while it still waits: one whose turn has just come
        is ended as a holder (its process, still settling, finds the end at its take)."""

    def update(self, ticket_id: str, change: Callable[[Ticket], bool]) -> Ticket | None:
        """Compare-and-set of a live ticket: ``change`` gets it as stored (read again if another
        write came in between) and says whether to write it; the ticket written, or None when
        ``change`` declined or it is no longer live (an ended ticket is never written here).
        UnknownTicket when there is no such ticket; NotHeld when its lease went meanwhile."""

    def line(self) -> Line:
        """The line as it stands: the holder first, then the waiters in order; the lock's fence."""


class Backend(Protocol):
    """A store of locks, opened from its URL and this host's lock dir (``open_backend``); those two
    are its opener's (``Opened``), not something a store publishes."""

    def close(self) -> None: ...

    def lock(self, repo: str, lock: str, *, create: bool = True) -> LockOps: ...

    def locks(self, repo: str | None, *, idle: bool = False) -> list[tuple[str, str]]:
        """(scope, lock) of every lock with a ticket in line or holding (``idle``: of every lock
        the store keeps state for) in scope ``repo``, or in every scope (None); sorted."""

    def prune(self, repo: str, lock: str, keep: Callable[[Idle], str | None], *, dry_run: bool) -> str | None:
        """Remove the idle state of (``repo``, ``lock``) unless ``keep`` (the rules', asked once the
        store has shut out every acquirer of that lock for a moment) says why not: that reason,
        or None once removed (``dry_run``: would be). A lock in use is judged without waiting for
        it. Its fence never goes back: a lock that comes back continues above its last one.
        UnknownLock when the store keeps nothing of it (any more)."""

    # -- records: what they hold is the rules' (rules/requests.py, rules/records.py) -----------
    def read_record(self, key: Key) -> tuple[bytes | None, Any, str]:
        """The record ``key`` names (``core.request``: a lock's last success or request, an
        identity's activity, a resource's fence) as stored, the version ``write_record`` compares
        with, and where it is (for an error naming it). A record written to live with a run
        (``run=``) whose run is gone reads as None."""

    def write_record(
        self, key: Key, body: bytes | None, seen: Any, *, run: Ticket | None = None, keep: float | None = None
    ) -> bool:
        """Write (None: remove) the record, only while it is still as ``seen`` (``ANY_VERSION``:
        whatever it is); False when it changed. A fence record is written durably. With ``run``
        it lives as long as that run; with ``keep`` the store may drop it after so many seconds.
        A copy of exactly ``body`` prepared before (``prepare_record``) is put in place without a
        write that could fail for space."""

    def prepare_record(self, key: Key, body: bytes) -> None:
        """Before COMMAND starts: keep ``body`` ready for ``write_record`` at its end."""

    def guard(self, claim: Claim, digest: str, hold: float | None) -> AbstractContextManager[Facts]:
        """What the store knows of the claimed ticket (``digest``: its token's hash), in one read.
        With ``hold`` (seconds at most), expiry and hand-over of that ticket wait while inside:
        the facts are read once the hold is in place (of no ticket when there is none to hold)."""

    # -- the thread service (a fenced target): rules/threads.py ------------------------------
    def read_thread(self, repo: str, thread: int) -> tuple[list[dict[str, Any]], int | None]:
        """The thread's replies in the order it accepted them, and the highest fence it accepted."""

    def add_reply(self, repo: str, thread: int, reply: dict[str, Any], *, highest: int | None) -> bool:
        """Store ``reply`` and raise the thread's highest fence to its fence if that is higher, in
        one atomic step, only while the thread's highest is still ``highest`` (None: none yet);
        False when it changed meanwhile. A reply stored already (sent twice) is True. The rules
        (the fence judged, the parent) are rules/threads.py's."""


def backend_url(flag: str | None, env_value: str | None) -> str:
    """``--backend``, else PEARING_BACKEND, else the local lock dir; checked, never opened."""
    url = flag if flag is not None else env_value or schemes.DEFAULT.prefix
    scheme = schemes.scheme_of(url)
    if scheme is None:
        raise BadValue("backend", url, f"must be {schemes.forms()}")
    scheme.validate(url)
    return url


class Opened:
    """A backend as a front end opened it, with where it is: its ``url`` (what an agent started
    for a ticket opens too) and this host's ``lock_dir`` (token files are there on every
    backend). What the seed's commands (``singleflight.ops``) are given."""

    __slots__ = ("backend", "lock_dir", "url")

    def __init__(self, url: str | None, lock_dir: str, *, create: bool = True) -> None:
        self.url, self.lock_dir = backend_url(url, None), lock_dir
        self.backend = open_backend(self.url, lock_dir, create=create)

    def close(self) -> None:
        self.backend.close()


def open_backend(url: str | None, lock_dir: str, *, create: bool = True) -> Backend:
    """The backend ``url`` names (None: the lock dir), from the one table of schemes.

    The lock dir is used by every backend: it keeps this host's token files. Without
    ``create``, a missing lock dir is an error (LockDirError), not made.
    """
    url = backend_url(url, None)
    scheme = schemes.scheme_of(url)
    assert scheme is not None
    backend: Backend = scheme.backend_class()(url, lock_dir, create=create)
    return backend
