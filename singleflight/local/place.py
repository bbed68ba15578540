"""The lock dir's grip and place in line: a kernel ``flock`` on the lock file, and a FIFO entry
in the queue dir while waiting for it (``queue.Waiter``); the holder's lease over that grip."""

from __future__ import annotations

import os
import signal
import time
from types import FrameType

from singleflight.core import cadence, fault
from singleflight.core.const import QUEUE_LATEST, TYPE_CHECKING, WAITING
from singleflight.core.errors import LineFull
from singleflight.core.fs import same_file
from singleflight.core.reasons import EndReason, Loss
from singleflight.core.ticket import Ticket
from singleflight.local import lease, queue, slots
from singleflight.local.slots import SlotSet

if TYPE_CHECKING:
    from collections.abc import Callable
    from typing import Any

    from singleflight.local.store import LockStore


class FlockGrip:
    """The lock file's fd (or slot ``slot``'s file's), flocked. One open file description, so
    one flock: the wrapper's and the holder's copies (fork, or SCM_RIGHTS) keep the lock until
    both are closed."""

    def __init__(self, fd: int, slot: int = 0) -> None:
        self.fd, self.slot = fd, slot

    def keep(self) -> None:
        """The fd keeps the lock by being open: never due."""

    def still_ours(self) -> bool:
        return True  # the kernel keeps a flock for as long as the fd is open, frozen or not

    def close(self) -> None:
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1

    release = close

    def handover(self) -> tuple[dict[str, Any], set[int]]:
        return {"slot": self.slot}, {self.fd}  # the fd itself goes beside the message

    @classmethod
    def from_handover(cls, info: dict[str, Any]) -> FlockGrip:
        """The grip ``handover`` described, with the fd that came with it (ours now)."""
        fds = info.get("fds")
        if not isinstance(fds, list) or len(fds) != 1 or not isinstance(fds[0], int):
            for fd in fds if isinstance(fds, list) else ():
                os.close(fd)
            raise ValueError(f"a lock dir's grip is one fd, not {fds!r}")  # a bug: reported as 70
        return cls(fds[0], slot=int(info.get("slot", 0)))


def _nothing() -> None:
    """The lock dir's fd keeps the lock: nothing to send."""


def _on_poke(signum: int, frame: FrameType | None) -> None:
    raise queue.Interrupted


class LocalPlace:
    def __init__(
        self, store: LockStore, ticket: Ticket, fd: int, grip: FlockGrip | None, slots: SlotSet | None = None
    ) -> None:
        self.store, self.ticket, self.fd, self.grip = store, ticket, fd, grip
        self.slot_set = slots  # --slots N: the slot files, the head of the line waits for any of them
        self.waiter: queue.Waiter | None = None
        self._mask: set[int | signal.Signals] | None = None  # the signal mask before we queued

    def queue(self, deadline: Callable[[], float]) -> int:
        store = self.store
        # From the moment our entry is visible, release-lock-ticket or a newer `latest` run may
        # poke us: held back until the wait's kernel call, where it is handled.
        self._mask = signal.pthread_sigmask(signal.SIG_BLOCK, queue.POKES)
        signal.signal(queue.WAITER_POKE, _on_poke)
        self.waiter = queue.Waiter(store, self.ticket.ticket_id)
        with store.mutex():
            fault.pause("pause-in-mutex")
            older = self._older_latest() if self.ticket.queue_mode == QUEUE_LATEST else []
            slots.check(store, self.ticket)  # before the bound: a wrong --slots is a usage error
            if not older:  # taking an older `latest` waiter's place adds no waiter
                self._admit()
            superseded = self._supersede(older)
            place = min((queue.seq_of(store, t.ticket_id) or 0 for t in superseded), default=0)
            if store.read_ticket(self.ticket.ticket_id) is None:
                store.write_ticket(self.ticket)
            # Asked once the ticket is written: before, a run's lease reads as ended (0), and an
            # entry published with 0 is stale from birth, to newcomers a waiter frozen past its
            # deadline, until the wait's first pass. A newcomer arriving meanwhile (a loaded host
            # keeps it open) got in line past --max-waiting, or ahead of us.
            self.waiter.enqueue(deadline(), seq=place or None)
        for t in superseded:
            lease.poke(t, waiter=True)  # its waiter re-reads its ticket at once and leaves busy
        return self.waiter.position()

    def _older_latest(self) -> list[Ticket]:
        me = self.ticket.ticket_id
        return [
            t for t in self.store.tickets() if t.state == WAITING and t.queue_mode == QUEUE_LATEST and t.ticket_id != me
        ]

    def _admit(self) -> None:
        """``--max-waiting``: the live waiters counted under the mutex every arrival joins under,
        so two newcomers at the bound cannot both get in; the later one is turned away."""
        bound = self.ticket.max_waiting
        if bound is None:
            return
        mine = "." + self.ticket.ticket_id
        waiting = sum(1 for name in queue.live_entries(self.store) if not name.endswith(mine))
        if waiting >= bound:
            raise LineFull(waiting, bound)

    def _supersede(self, older: list[Ticket]) -> list[Ticket]:
        """Cancel the older ``latest`` waiters of this lock. Caller holds the mutex."""
        me, now = self.ticket.ticket_id, time.time()
        for t in older:
            t.supersede(me, now)
            self.store.write_ticket(t)
        return older

    def wait(self, deadline: Callable[[], float]) -> FlockGrip | None:
        assert self.waiter is not None
        while True:
            if not self.waiter.wait(self.fd, deadline, self.slot_set):
                return None
            # Our fd was opened before we were in line: if prune took the idle lock meanwhile,
            # the flock we got is on its unlinked file. In line now, prune leaves the new one be.
            # (A lock with slots is never pruned: local/prune.py.)
            if self.slot_set is not None or same_file(self.store.dir, "lock", self.fd):
                break
            os.close(self.fd)
            self.fd = -1
            self.fd = self.store.open_lock_file()
        fault.point("mid-promotion")
        if self.slot_set is not None:
            assert self.slot_set.taken is not None
            slot = self.slot_set.taken
            self.fd = self.slot_set.keep_taken()
            self.grip = FlockGrip(self.fd, slot)
            return self.grip
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
        if self.grip is None and self.slot_set is not None:
            self.slot_set.close()
        self.fd = -1


class LocalLease:
    """The holder's lease: the lock fd, and the ticket's records in the lock dir."""

    def __init__(self, store: LockStore, grip: FlockGrip, ticket: Ticket) -> None:
        self.store, self.grip, self.ticket = store, grip, ticket

    def renew(self) -> None:
        t = self.ticket
        self.ticket = lease.renew(self.store, t.ticket_id, t.lease_seconds, t.lease_expires_at)

    def check(self) -> Loss | None:
        with self.store.mutex():
            t = self.store.read_ticket(self.ticket.ticket_id)
        if t is None:
            return Loss(EndReason.VANISHED)
        loss = t.loss()
        if loss is None:
            self.ticket = t
        return loss

    def end(
        self, state: str, reason: str | Callable[[Ticket], str | None], keep: Callable[[], None] | None = None
    ) -> bool:
        tid = self.ticket.ticket_id
        if isinstance(reason, str):  # the guard lock is waited for in the kernel: the fd keeps the lock
            return lease.end(self.store, tid, state, reason) is not None
        every = cadence.guarded_every(self.ticket.lease_seconds)
        return lease.end_judged(self.store, tid, state, reason, keep=keep or _nothing, every=every)

    def keep(self) -> None:
        """The fd keeps the lock by being open."""

    def wake_fd(self) -> None:
        """A cancel request pokes the holder (SIGUSR1): no fd to watch."""

    def release(self, announce: Callable[[], None]) -> None:
        self.grip.close()  # the kernel hands the lock to the head waiter now (once every copy is closed)
        announce()
        lease.housekeeping(self.store)
