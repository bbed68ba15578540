"""The lock dir backend: a kernel ``flock`` per lock, FIFO queue files, records on disk. One host."""

from __future__ import annotations

import fcntl
import math
import os
import signal
import time
from collections.abc import Callable
from contextlib import AbstractContextManager
from types import FrameType
from typing import Any

from singleflight.core import fault, names, proc
from singleflight.core.const import (
    CLAIM_BUSY,
    CLAIM_DONE,
    CLAIM_RUN,
    DEFAULT_KILL_GRACE,
    HELD,
    QUEUE_LATEST,
    RELEASED,
    REQUEST_ACTIVE,
    WAITING,
)
from singleflight.core.errors import UnknownLock
from singleflight.core.line import Line
from singleflight.core.protocol import Taken
from singleflight.core.reasons import EndReason, Loss
from singleflight.core.request import RequestRecord
from singleflight.core.ticket import Ticket
from singleflight.core.tokens import Claim, Facts, TokenFiles
from singleflight.local import lease, queue
from singleflight.local.store import LockDir, LockStore


class FlockGrip:
    """The lock file's fd, flocked. One open file description, so one flock: the wrapper's
    and the holder's copies (fork) keep the lock until both are closed."""

    keep_every = None

    def __init__(self, fd: int) -> None:
        self.fd = fd

    def fds(self) -> set[int]:
        return {self.fd}

    def keep(self) -> None:
        """The fd keeps the lock by being open."""

    def still_ours(self) -> bool:
        return True  # the kernel keeps a flock for as long as the fd is open, frozen or not

    def close(self) -> None:
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1

    release = close

    def handover(self) -> dict[str, Any]:
        return {}  # an fd: the holder gets it by the fork (``LocalLock.holder_waits_too``)


def _on_poke(signum: int, frame: FrameType | None) -> None:
    raise queue.Interrupted


class LocalPlace:
    def __init__(self, lk: LocalLock, ticket: Ticket, fd: int, grip: FlockGrip | None) -> None:
        self.lk, self.ticket, self.fd, self.grip = lk, ticket, fd, grip
        self.waiter: queue.Waiter | None = None
        self._mask: set[int | signal.Signals] | None = None  # the signal mask before we queued

    def queue(self, deadline: float) -> int:
        store = self.lk.store
        # From the moment our entry is visible, release-lock-ticket or a newer `latest` run may
        # poke us: held back until the wait's kernel call, where it is handled.
        self._mask = signal.pthread_sigmask(signal.SIG_BLOCK, queue.POKES)
        signal.signal(queue.WAITER_POKE, _on_poke)
        self.waiter = queue.Waiter(store, self.ticket.ticket_id)
        superseded: list[Ticket] = []
        with store.mutex():
            if self.ticket.queue_mode == QUEUE_LATEST:
                superseded = self._supersede()
            place = min((queue.seq_of(store, t.ticket_id) or 0 for t in superseded), default=0)
            self.waiter.enqueue(deadline, seq=place or None)
            if store.read_ticket(self.ticket.ticket_id) is None:
                store.write_ticket(self.ticket)
        for t in superseded:
            lease.poke(t, waiter=True)  # its waiter re-reads its ticket at once and leaves busy
        return self.waiter.position()

    def _supersede(self) -> list[Ticket]:
        """Cancel the older ``latest`` waiters of this lock. Caller holds the mutex."""
        store, me, now = self.lk.store, self.ticket.ticket_id, time.time()
        out = []
        for t in store.tickets():
            if t.state == WAITING and t.queue_mode == QUEUE_LATEST and t.ticket_id != me:
                t.supersede(me, now)
                store.write_ticket(t)
                out.append(t)
        return out

    def wait(self, deadline: Callable[[], float]) -> FlockGrip | None:
        assert self.waiter is not None
        got = self.waiter.wait(self.fd, deadline)
        if not got:
            return None
        fault.point("mid-promotion")
        self.grip = FlockGrip(self.fd)
        return self.grip

    def leave(self) -> None:
        if self.waiter is not None:
            self.waiter.leave()
            self.waiter = None
        if self._mask is not None:
            # A poke that came after the wait is moot (the ticket is read again): drop it.
            while signal.sigtimedwait(queue.POKES, 0) is not None:
                pass
            # One sent before we stopped waiting may still arrive (its sender read us waiting).
            signal.signal(queue.WAITER_POKE, signal.SIG_IGN)
            signal.pthread_sigmask(signal.SIG_SETMASK, self._mask)
            self._mask = None
        if self.grip is None and self.fd >= 0:
            os.close(self.fd)
        self.fd = -1


class LocalLease:
    """The holder's lease: the lock fd, and the ticket's records in the lock dir."""

    def __init__(self, store: LockStore, grip: FlockGrip, ticket: Ticket) -> None:
        self.store, self.grip, self.ticket = store, grip, ticket

    def renew(self) -> None:
        self.ticket = lease.renew(self.store, self.ticket.ticket_id, self.ticket.lease_seconds)

    def check(self) -> Loss | None:
        with self.store.mutex():
            t = self.store.read_ticket(self.ticket.ticket_id)
        if t is not None and t.state == HELD and t.superseded_by:
            return Loss(EndReason.SUPERSEDED, t.superseded_by)
        if t is None:
            return Loss(EndReason.VANISHED)
        if t.state == RELEASED:
            return Loss(EndReason.RELEASED_BY_OWNER)
        if t.state != HELD:
            return Loss(EndReason.LEASE_EXPIRED, text=t.describe_end())
        self.ticket = t
        return Loss(EndReason.LEASE_EXPIRED) if (t.lease_deadline_mono or 0) <= time.monotonic() else None

    def end(self, state: str, reason: str) -> None:
        lease.end(self.store, self.ticket.ticket_id, state, reason)

    def keep(self) -> None:
        """The fd keeps the lock by being open."""

    def wake_fd(self) -> None:
        """A cancel request pokes the holder (SIGUSR1): no fd to watch."""

    def release(self) -> None:
        self.grip.close()  # the kernel hands the lock to the head waiter now (once every copy is closed)

    def housekeeping(self) -> None:
        lease.housekeeping(self.store)


class LocalLock:
    """One (scope, lock) in the lock dir."""

    def __init__(self, backend: LocalBackend, store: LockStore) -> None:
        self.backend, self.store = backend, store
        self.repo, self.lock = store.repo, store.lock

    def close(self) -> None:
        self.store.close()

    holder_waits_too = False  # the holder needs the flocked fd: forked with it, once ours

    def grip_from(self, info: dict[str, Any]) -> FlockGrip:
        raise AssertionError("the lock dir forks its holder with the grip")

    # -- requests ------------------------------------------------------------------------

    def read_request(self, request_uuid: str) -> RequestRecord | None:
        return self.store.read_request(request_uuid)

    def last_success(self) -> float | None:
        return self.store.read_last_success()

    def claim_request(self, ticket: Ticket) -> str:
        store, now, uuid = self.store, time.time(), ticket.request_uuid
        with store.mutex():
            rec = store.read_request(uuid)
            if rec is not None:
                if rec.succeeded_within(now):
                    return CLAIM_DONE
                if rec.active and self._request_alive(rec):
                    return CLAIM_BUSY
            store.write_request(
                uuid,
                RequestRecord(
                    state=REQUEST_ACTIVE,
                    ticket_id=ticket.ticket_id,
                    pid=os.getpid(),
                    start=proc.start_time(os.getpid()),
                    created_at=now,
                    previous=rec,
                ),
            )
        return CLAIM_RUN

    def _request_alive(self, rec: RequestRecord) -> bool:
        """Is the run that claimed this request still waiting or holding?"""
        if rec.pid is not None and proc.alive(rec.pid, rec.start):
            return True
        t = self.store.read_ticket(rec.ticket_id) if rec.ticket_id else None
        return t is not None and t.live and proc.alive(t.holder_pid, t.holder_start)

    def unclaim_request(self, ticket: Ticket) -> None:
        uuid = ticket.request_uuid
        with self.store.mutex():
            rec = self.store.read_request(uuid)
            if rec and rec.ticket_id == ticket.ticket_id:
                if rec.previous is not None:
                    self.store.write_request(uuid, rec.previous)
                else:
                    self.store.remove_request(uuid)

    # -- acquiring -------------------------------------------------------------------------

    def enter(self, ticket: Ticket) -> LocalPlace:
        fd = self.store.open_lock_file()
        if queue.try_flock(fd):
            if not queue.live_entries(self.store):
                return LocalPlace(self, ticket, fd, FlockGrip(fd))
            # Free for a moment, but others are in line: they go first.
            fcntl.flock(fd, fcntl.LOCK_UN)
        return LocalPlace(self, ticket, fd, None)

    def cancel_holder(self, ticket: Ticket) -> float | None:
        store = self.store
        with store.mutex():
            holder_id = store.read_pointer("holder")
            h = store.read_ticket(holder_id) if holder_id and names.is_uuid(holder_id) else None
            if h is None or h.state != HELD or not h.cancel_in_progress or h.ticket_id == ticket.ticket_id:
                return None
            if not proc.alive(h.holder_pid, h.holder_start):
                return None
            if not h.superseded_by:
                h.superseded_by = ticket.ticket_id
                store.write_ticket(h)
        lease.poke(h)  # its holder checks its ticket now: token dead, COMMAND stopped, lock released
        return h.kill_grace if h.kill_grace is not None else DEFAULT_KILL_GRACE

    def take(self, grip: FlockGrip, ticket: Ticket, *, promoted: bool, kill_grace: float) -> tuple[LocalLease, Taken]:
        token = lease.take_ownership(self.store, ticket, promoted=promoted)
        assert ticket.fence is not None
        taken = Taken(ticket.fence, token, self.store.tokens.path(ticket.ticket_id), {})
        return LocalLease(self.store, grip, ticket), taken

    # -- the ticket ------------------------------------------------------------------------

    def create(self, ticket: Ticket) -> Ticket:
        store = self.store
        with store.mutex():
            rec = store.read_request(ticket.request_uuid)
            existing = store.read_ticket(rec.ticket_id) if rec and rec.ticket_id else None
            if existing is not None:
                return existing
            ticket.set_lease(ticket.lease_seconds)
            store.write_ticket(ticket)
            store.write_request(
                ticket.request_uuid,
                RequestRecord(state=REQUEST_ACTIVE, ticket_id=ticket.ticket_id, created_at=time.time()),
            )
        return ticket

    def read(self, ticket_id: str) -> Ticket | None:
        return self.store.read_ticket(ticket_id)

    def adopt(self, ticket_id: str, pid: int) -> Ticket | None:
        with self.store.mutex():
            t = self.store.read_ticket(ticket_id)
            if t is None or t.state != WAITING:
                return None
            t.holder_pid, t.holder_start = pid, proc.start_time(pid)
            self.store.write_ticket(t)
            return t

    def waiting_deadline(self, ticket_id: str) -> float:
        t = self.store.read_ticket(ticket_id)
        if t is None or t.state != WAITING:
            return 0.0
        return math.inf if t.lease_deadline_mono is None else t.lease_deadline_mono

    def end(
        self, ticket_id: str, state: str, reason: str, *, only_if_held: bool = True, release: bool = True
    ) -> Ticket | None:
        # The flock is the grip's: ending the record never frees the lock by itself.
        return lease.end(self.store, ticket_id, state, reason, only_if_held=only_if_held)

    def prepare_request(self, ticket: Ticket, window: float) -> None:
        # The success record is written (and fsynced) now, while there is room, so a
        # success at the end only renames it into place: a disk that filled up while
        # COMMAND ran cannot make a finished request look unfinished and run it twice.
        # Its dedupe window therefore counts from the start of the run.
        record = RequestRecord.finished(ticket, 0, window)
        record.finished_at = None
        self.store.sub("requests").write_atomic(_prepared(ticket), record.to_json(), durable=True)

    def record_request(self, ticket: Ticket, status: int | None, window: float) -> None:
        requests, uuid = self.store.sub("requests"), ticket.request_uuid
        try:
            if status == 0 and requests.lstat(_prepared(ticket)) is not None:
                requests.rename(_prepared(ticket), f"{uuid}.json")
                requests.fsync()
                return
            self.store.write_request(uuid, RequestRecord.finished(ticket, status, window))
        finally:
            requests.unlink(_prepared(ticket))

    def record_success(self, ticket: Ticket) -> None:
        self.store.write_last_success(ticket.acquired_at or time.time(), ticket.ticket_id)

    def renew(self, ticket_id: str, seconds: float) -> Ticket:
        return lease.renew(self.store, ticket_id, seconds)

    @property
    def tokens(self) -> TokenFiles:
        return self.store.tokens

    def stop(self, t: Ticket, state: str, reason: str, *, within: float) -> Ticket | None:
        ended = lease.end(self.store, t.ticket_id, state, reason, only_if_held=False)
        if ended is not None:
            # Its holder stops COMMAND and lets go of the flock; a waiter leaves the line.
            sig = queue.WAITER_POKE if t.state == WAITING else signal.SIGUSR1
            proc.poke_and_wait(t.holder_pid, t.holder_start, sig, within)
        return ended

    def orphaned(self, t: Ticket) -> bool:
        return not proc.alive(t.holder_pid, t.holder_start)  # the kernel has freed its flock

    def position(self, t: Ticket) -> int | None:
        mine = [i for i, n in enumerate(queue.live_entries(self.store)) if n.endswith("." + t.ticket_id)]
        return mine[0] + 1 if mine else None

    def await_turn(self, ticket_id: str, wait_seconds: float) -> None:
        store = self.store
        entry = next((n for n in queue.live_entries(store) if n.endswith("." + ticket_id)), None)
        if wait_seconds <= 0:
            if entry is None:
                # An agent that is not in line yet is still starting (or taking a free
                # lock) and settles in moments; only a ticket in line is "waiting".
                _poll(lambda: self._settled(ticket_id), 2.0)
            return
        if entry is not None:
            try:
                fd = store.sub("queue").open(entry, os.O_RDWR)
            except FileNotFoundError:
                pass
            else:
                try:
                    # The agent keeps this entry flocked until it leaves the line.
                    if not queue.flock_until(fd, time.monotonic() + wait_seconds):
                        return
                finally:
                    os.close(fd)
        # The agent has just left the line and is taking the lock (or is not in line
        # yet): its state changes in moments, so wait for that, not 75 at once.
        _poll(lambda: self._state(ticket_id) != WAITING, min(wait_seconds, 5.0) if entry is None else 5.0)

    def _state(self, ticket_id: str) -> str | None:
        t = self.store.read_ticket(ticket_id)
        return None if t is None else t.state

    def _settled(self, ticket_id: str) -> bool:
        return self._state(ticket_id) != WAITING or any(
            n.endswith("." + ticket_id) for n in queue.live_entries(self.store)
        )

    def line(self) -> Line:
        store, now = self.store, time.monotonic()
        holder = None
        waiters = []
        for t in store.tickets():
            if not proc.alive(t.holder_pid, t.holder_start):
                continue
            left = t.lease_left(now)
            if t.state == HELD and (left is None or left > 0):
                holder = t
            elif t.state == WAITING:
                waiters.append(t)
        order = {n.rpartition(".")[2]: i for i, n in enumerate(queue.live_entries(store))}
        waiters.sort(key=lambda w: order.get(w.ticket_id, -1))  # one still starting is not in line yet
        entries: list[Ticket | dict[str, Any]] = [holder, *waiters] if holder else [*waiters]
        return Line(entries, held=holder is not None, fence=store.read_fence(), extra={})


def _prepared(ticket: Ticket) -> str:
    return f".{ticket.request_uuid}.succeeded"


def _poll(done: Callable[[], bool], timeout: float) -> None:
    """Moments at most (an agent starting, a holder writing one record): 5 ms polls."""
    deadline = time.monotonic() + timeout
    while not done() and time.monotonic() < deadline:
        time.sleep(0.005)


class LocalBackend:
    url = "local"

    def __init__(self, lock_dir: str, *, create: bool = True) -> None:
        self.lock_dir = lock_dir
        self.dir = LockDir(lock_dir, create=create)

    def close(self) -> None:
        self.dir.close()

    def __enter__(self) -> LocalBackend:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def lock(self, repo: str, lock: str, *, create: bool = True) -> LocalLock:
        names.lock_name(lock)
        names.scope(repo)
        try:
            return LocalLock(self, self.dir.lock_store(repo, lock, create=create))
        except FileNotFoundError:
            raise UnknownLock(repo, lock) from None

    def locks(self, repo: str) -> list[str]:
        out = []
        for store in self.dir.iter_locks(repo):
            with store:
                out.append(store.lock)
        return out

    def read_activity(self, identity: str) -> str | None:
        return self.dir.read_activity(identity)

    def update_activity(self, identity: str, activity: str | None) -> None:
        self.dir.write_activity(identity, activity)

    def guard_facts(self, claim: Claim, digest: str) -> Facts:
        from singleflight.local import guard  # hmac and the rest: pearing-guard's, not pearing-run's

        return guard.facts(claim, digest)

    def hold_guard(self, claim: Claim, seconds: float) -> AbstractContextManager[bool]:
        from singleflight.local import guard

        return guard.hold_guard(claim)

    def accept_fence(self, resource: str, fence: int) -> int:
        from singleflight.core import ledger

        return ledger.accept(self.dir.root, "ledger.json", resource, fence)
