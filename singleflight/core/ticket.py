"""The ticket: one run's place in a lock's line (waiting, held, ended), as stored and as shown.

Plain ``__slots__`` classes (this one and ``request.RequestRecord``) rather than dataclasses:
``dataclasses`` pulls in ``inspect`` (about 10 ms), and every ``pearing-run`` loads tickets.
"""

from __future__ import annotations

import time

from singleflight.core import jsontext, names
from singleflight.core.const import (
    CANCELLED,
    EXPIRED,
    HELD,
    QUEUE_FIFO,
    QUEUE_MODES,
    RELEASED,
    TYPE_CHECKING,
    WAITING,
)
from singleflight.core.errors import SlotsMismatch
from singleflight.core.reasons import EndReason, Loss
from singleflight.core.record import HEX, checked, is_uuid, loads, rfc3339, valid

if TYPE_CHECKING:
    from collections.abc import Callable, Iterable
    from typing import Any, Final

# Stored fields, in order. Those in _HIDDEN never leave the backend (token_hash)
# or mean nothing to users (monotonic stamps, the holder's start time).
FIELDS = (
    "ticket_id",
    "request_uuid",
    "lock_name",
    "repo",
    "identity",
    "state",
    "fence",
    "lease_seconds",
    "lease_expires_at",
    "lease_deadline_mono",
    "boot_id",
    "holder_pid",
    "holder_start",
    "holder_host",
    "owner_pid",
    "owner_start",
    "promoted",
    "created_at",
    "acquired_at",
    "ended_at",
    "end_reason",
    "token_hash",
    "queue_mode",
    "cancel_in_progress",
    "kill_grace",
    "superseded_by",
    "max_waiting",
    "slots",
    "slot",
)
_HIDDEN = frozenset({"lease_deadline_mono", "boot_id", "holder_start", "token_hash", "owner_pid", "owner_start"})
_TIMES = frozenset({"lease_expires_at", "created_at", "acquired_at", "ended_at"})
_TYPES: dict[str, tuple[type, ...]] = {
    "ticket_id": (str,),
    "request_uuid": (str,),
    "lock_name": (str,),
    "repo": (str,),
    "identity": (str,),
    "state": (str,),
    "fence": (int,),
    "lease_seconds": (int, float),
    "lease_expires_at": (int, float),
    "lease_deadline_mono": (int, float),
    "boot_id": (str,),
    "holder_pid": (int,),
    "holder_start": (int,),
    "holder_host": (str,),
    "owner_pid": (int,),
    "owner_start": (int,),
    "promoted": (bool,),
    "created_at": (int, float),
    "acquired_at": (int, float),
    "ended_at": (int, float),
    "end_reason": (str,),
    "token_hash": (str,),
    "queue_mode": (str,),
    "cancel_in_progress": (bool,),
    "kill_grace": (int, float),
    "superseded_by": (str,),
    "max_waiting": (int,),
    "slots": (int,),
    "slot": (int,),
}

_STATES: Final = frozenset({WAITING, HELD, RELEASED, EXPIRED, CANCELLED})


# Per field, beyond its type: what a record written by this tool always satisfies. A name that
# becomes a file name (ticket id, identity) must never reach the OS unchecked.
_TICKET_STRINGS: dict[str, Callable[[str], bool]] = {
    "ticket_id": is_uuid,
    "request_uuid": is_uuid,
    "lock_name": valid(names.lock_name),
    "repo": valid(names.scope),
    "identity": valid(names.identity),
    "state": _STATES.__contains__,
    "token_hash": lambda v: len(v) == 64 and set(v) <= HEX,
    "queue_mode": QUEUE_MODES.__contains__,
    "superseded_by": is_uuid,
}


class Ticket:
    __slots__ = FIELDS

    def __init__(
        self,
        *,
        ticket_id: str,
        request_uuid: str,
        lock_name: str,
        repo: str,
        identity: str,
        state: str = WAITING,
        fence: int | None = None,
        lease_seconds: float = 0.0,
        lease_expires_at: float | None = None,
        lease_deadline_mono: float | None = None,
        boot_id: str | None = None,
        holder_pid: int | None = None,
        holder_start: int | None = None,
        holder_host: str | None = None,
        owner_pid: int | None = None,
        owner_start: int | None = None,
        promoted: bool | None = False,
        created_at: float | None = None,
        acquired_at: float | None = None,
        ended_at: float | None = None,
        end_reason: str | None = None,
        token_hash: str | None = None,
        queue_mode: str | None = QUEUE_FIFO,
        cancel_in_progress: bool | None = False,
        kill_grace: float | None = None,
        superseded_by: str | None = None,
        max_waiting: int | None = None,
        slots: int | None = 1,
        slot: int | None = None,
    ) -> None:
        self.ticket_id, self.request_uuid = ticket_id, request_uuid
        self.lock_name, self.repo, self.identity = lock_name, repo, identity
        self.state, self.fence = state, fence
        self.lease_seconds = float(lease_seconds or 0.0)
        self.lease_expires_at, self.lease_deadline_mono, self.boot_id = lease_expires_at, lease_deadline_mono, boot_id
        self.holder_pid, self.holder_start, self.holder_host = holder_pid, holder_start, holder_host
        # Where a store records it (etcd): the process that keeps the lock while COMMAND lives
        # even if the holder died (pearing-run's wrapper), or the agent that waited itself.
        self.owner_pid, self.owner_start = owner_pid, owner_start
        self.promoted = bool(promoted)
        self.created_at = time.time() if created_at is None else created_at
        self.acquired_at, self.ended_at, self.end_reason = acquired_at, ended_at, end_reason
        self.token_hash = token_hash
        # Event-driven concurrency: a `latest` waiter is replaced by a newer one; a holder that
        # opted in to cancel-in-progress is stopped (token dead, TERM, KILL after kill_grace)
        # when a newer opted-in run asks (superseded_by).
        self.queue_mode = queue_mode or QUEUE_FIFO
        self.cancel_in_progress = bool(cancel_in_progress)
        self.kill_grace, self.superseded_by = kill_grace, superseded_by
        # --max-waiting: this arrival joins the line only while fewer than this many wait (None:
        # no bound); checked once, as it joins (``Place.queue``).
        self.max_waiting = max_waiting
        # --slots: how many runs of the lock may hold at once (every live ticket of a lock says
        # the same), and which of them this one holds (0..slots-1, PEARING_SLOT) once held.
        self.slots, self.slot = slots or 1, slot

    ticket_id: str
    request_uuid: str
    lock_name: str
    repo: str
    identity: str
    state: str
    fence: int | None
    lease_seconds: float
    lease_expires_at: float | None
    lease_deadline_mono: float | None
    boot_id: str | None
    holder_pid: int | None
    holder_start: int | None
    holder_host: str | None
    owner_pid: int | None
    owner_start: int | None
    promoted: bool
    created_at: float
    acquired_at: float | None
    ended_at: float | None
    end_reason: str | None
    token_hash: str | None
    queue_mode: str
    cancel_in_progress: bool
    kill_grace: float | None
    superseded_by: str | None
    max_waiting: int | None
    slots: int
    slot: int | None

    def to_dict(self) -> dict[str, Any]:
        return {name: getattr(self, name) for name in FIELDS}

    def to_json(self) -> bytes:
        return jsontext.dumps(self.to_dict()).encode()

    @classmethod
    def from_dict(cls, obj: Any) -> Ticket:
        """A ticket from its decoded record; ValueError for wrong fields or types."""
        required = ("ticket_id", "request_uuid", "lock_name", "repo", "identity", "state")
        return cls(**checked(obj, _TYPES, required, _TICKET_STRINGS))

    @classmethod
    def from_json(cls, data: bytes) -> Ticket:
        return cls.from_dict(loads(data))

    def lease_left(self, now_mono: float) -> float | None:
        if self.lease_deadline_mono is None:
            return None
        return self.lease_deadline_mono - now_mono

    def deadline_here(self) -> float | None:
        """The lease's deadline on this host's monotonic clock (None: none recorded).

        Set on this boot: its monotonic stamp, exact. Set on another host (or boot): its
        wall-clock expiry, which is as good as the two clocks agree (keep them in sync: NTP).
        """
        from singleflight.core import proc

        if self.lease_deadline_mono is not None and self.boot_id and self.boot_id == proc.boot_id():
            return self.lease_deadline_mono
        if self.lease_expires_at is not None:
            return time.monotonic() + (self.lease_expires_at - time.time())
        return None

    def set_lease(self, seconds: float) -> None:
        from singleflight.core import proc

        self.boot_id = proc.boot_id()  # a monotonic stamp means something on its own boot only
        self.lease_seconds = seconds
        self.lease_deadline_mono = time.monotonic() + seconds
        self.lease_expires_at = time.time() + seconds

    def end(self, state: str, reason: str, at: float | None = None) -> None:
        """The ticket ends (released, expired, cancelled) for ``reason`` (an ``EndReason``'s text).
        A waiting ticket is never released (it held nothing): it is cancelled."""
        if self.state == WAITING and state == RELEASED:
            state = CANCELLED
        self.state, self.end_reason, self.ended_at = state, str(reason), time.time() if at is None else at

    def supersede(self, by: str, at: float | None = None) -> None:
        """A newer ``latest`` waiter takes its place: it leaves the line busy, never runs."""
        self.end(CANCELLED, EndReason.SUPERSEDED.text(by), at)
        self.superseded_by = by

    @property
    def turned_away(self) -> bool:
        """Ended because the line was full when it arrived (``--max-waiting``): busy, not refused."""
        return self.state == CANCELLED and self.end_reason == EndReason.LINE_FULL

    @property
    def live(self) -> bool:
        return self.state in (HELD, WAITING)

    def refusal(self, *, gone: bool) -> str | None:
        """Why a heartbeat of this ticket is refused (None: it is not): it ended, its lease ran out
        (a lapsed lease is never revived, even before its holder noticed), or its process is
        ``gone``. One wording on every backend."""
        if not self.live:
            return self.describe_end()
        due = self.deadline_here()
        if due is not None and due <= time.monotonic():
            return f"lease expired at {rfc3339(self.lease_expires_at)}"
        if gone:
            return EndReason.HOLDER_GONE.text()
        return None

    def orphaned(self) -> bool:
        """Is nobody on this host left to keep this ticket's lock? Its holder (or waiter) is dead,
        and so is the process that keeps the lock while COMMAND lives, where the store records
        one (``owner_pid``: pearing-run's wrapper). A ticket of another machine is not ours to
        judge: its lease tells. (Its host by name, or by boot: a host renamed while it runs is
        still this boot.)"""
        import os

        from singleflight.core import proc

        if self.holder_host not in (None, os.uname().nodename) and self.boot_id != proc.boot_id():
            return False
        return not proc.alive(self.holder_pid, self.holder_start) and not proc.alive(self.owner_pid, self.owner_start)

    def poke(self) -> None:
        """Have its holder look at this ticket now, not at its next deadline (a release, a shorter
        lease, a cancel request): SIGUSR1 to its exact pid, once its holder has settled on this
        host (``settled``), its handler in place. Anyone else learns at its next look, or by what
        its store wakes it with: a holder still settling, at its take (``LockOps.take``)."""
        import os
        import signal

        from singleflight.core import proc

        if self.settled() and self.holder_host in (None, os.uname().nodename):
            proc.signal_exact(self.holder_pid, self.holder_start, signal.SIGUSR1)

    def settled(self) -> bool:
        """Held, and its holder has recorded itself (its pid, since when): the one process whose
        handler takes a poke. Promoted but not yet settled (etcd's, PostgreSQL's hand-over), the
        pid recorded is still the waiter's: pearing-run's wrapper passes SIGUSR1 on to COMMAND."""
        return self.state == HELD and self.acquired_at is not None

    def loss(self) -> Loss | None:
        """Its holder's verdict on it as the store has it now (every store's ``Lease.check``):
        None while it is still the holder's, else why not."""
        if not self.live:  # ended by its owner or by expiry: that end record stands
            if self.state == RELEASED:
                return Loss(EndReason.RELEASED_BY_OWNER)
            # Cancelled while it waited, found so as its turn came (``LockOps.take``): by its
            # owner (a lost lock), or by a newer ``latest`` run (busy, as any superseded waiter).
            if self.state == CANCELLED and self.superseded_by:
                return Loss(EndReason.SUPERSEDED, self.superseded_by)
            if self.end_reason == EndReason.RELEASED_BY_OWNER.value:
                return Loss(EndReason.RELEASED_BY_OWNER, text=self.describe_end())
            return Loss(EndReason.LEASE_EXPIRED, text=self.describe_end())
        if self.superseded_by:  # a newer run that opted in to cancel-in-progress asked us to stop
            return Loss(EndReason.SUPERSEDED, self.superseded_by)
        # A heartbeat (pearing-cli, from COMMAND) may have moved the deadline: the one stored counts.
        due = self.deadline_here()
        if due is not None and due <= time.monotonic():
            return Loss(EndReason.LEASE_EXPIRED)
        return None

    def describe_end(self) -> str:
        """Why an ended ticket ended, as users read it: ``expired (holder gone) at ...``."""
        reason = f" ({self.end_reason})" if self.end_reason else ""
        when = rfc3339(self.ended_at)
        return f"{self.state}{reason}" + (f" at {when}" if when else "")

    def public(
        self,
        *,
        activity: str | None = None,
        queue_position: int | None = None,
        token_file: str | None = None,
    ) -> dict[str, Any]:
        out: dict[str, Any] = {}
        for name in FIELDS:
            if name in _HIDDEN:
                continue
            value = getattr(self, name)
            out[name] = rfc3339(value) if name in _TIMES else value
        out["queue_position"] = queue_position if self.state == WAITING else None
        out["activity"] = activity
        if token_file is not None:
            out["token_file"] = token_file
        return out


def check_slots(ticket: Ticket, line: Iterable[Ticket]) -> None:
    """``--slots`` against the lock's, on every store: a lock has one number of slots at a time,
    that of the first live ticket in line order (holders first, ``ticket`` itself skipped). Each
    live ticket agreed with those ahead of it when it joined, and of two that disagree the later
    leaves, so the first one speaks for the lock; a store reads no more of its line than that."""
    for t in line:
        if t.live and t.ticket_id != ticket.ticket_id:
            if t.slots != ticket.slots:
                raise SlotsMismatch(ticket.slots, t.slots)
            return


def hold_gone(record: Ticket | None) -> Loss:
    """A holder's verdict when the store no longer shows its hold (a network store: its key, its
    row holding with its fence): its owner released it (the ticket's ``record`` says so), else the
    lease went."""
    if record is not None and record.state == RELEASED:
        return Loss(EndReason.RELEASED_BY_OWNER)
    return Loss(EndReason.LEASE_EXPIRED)


def unreachable_loss(now: float, deadline: float, cut_off: float, lapse_at: float) -> Loss | None:
    """A holder's verdict while its network store cannot be reached: its lease is over at its
    deadline (nobody could have heartbeated through it), and it gives up at its cut-off (a margin
    before the store could expire it, at ``lapse_at``: no more requests, and the kill grace ends
    by then)."""
    if now >= deadline:
        # Past its own deadline: frozen, most likely, while the wrapper kept the lease (then the
        # whole grace is COMMAND's) or did not (then nothing left is ours to race).
        return Loss(EndReason.LEASE_EXPIRED)
    if now >= cut_off:
        return Loss(EndReason.UNREACHABLE, lapse_at=lapse_at)
    return None
