"""The lock dir backend: a kernel ``flock`` per lock, FIFO queue files, records on disk. One host."""

from __future__ import annotations

import fcntl
import os
import time
from contextlib import contextmanager

from singleflight.core import fault, names, proc
from singleflight.core.const import (
    ENV_SLOT,
    HELD,
    REQUEST_ACTIVE,
    TYPE_CHECKING,
    WAITING,
)
from singleflight.core.errors import UnknownLock, UnknownTicket, Vanished
from singleflight.core.fs import same_file
from singleflight.core.request import FENCE_PREFIX, Key, RequestRecord
from singleflight.core.ticket import Ticket
from singleflight.core.tokens import Claim, Facts
from singleflight.local import lease, queue, slots
from singleflight.local.place import FlockGrip, LocalLease, LocalPlace
from singleflight.local.records import ActivityRecords, LockRecords
from singleflight.local.store import LockDir, LockStore

if TYPE_CHECKING:
    from collections.abc import Callable, Iterator
    from typing import Any

    from singleflight.core.idle import Idle
    from singleflight.core.ledger import FileLedger
    from singleflight.core.line import Line
    from singleflight.core.protocol import Taken


class LocalLock:
    """One (scope, lock) in the lock dir."""

    def __init__(self, backend: LocalBackend, store: LockStore) -> None:
        self.backend, self.store = backend, store
        self.repo, self.lock = store.repo, store.lock

    def close(self) -> None:
        if self.backend.open_stores.get((self.repo, self.lock)) is self.store:
            del self.backend.open_stores[(self.repo, self.lock)]
        self.store.close()

    # -- acquiring -------------------------------------------------------------------------

    def enter(self, ticket: Ticket) -> tuple[FlockGrip | None, LocalPlace]:
        place = self._arrive(ticket)
        return place.grip, place

    def _arrive(self, ticket: Ticket) -> LocalPlace:
        if ticket.slots > 1 or slots.ever_slotted(self.store):
            # A wrong --slots is 64 even when the lock is busy and the run would not wait. (Not
            # the last word: the join and the take check again, under the mutex.)
            with self.store.mutex():
                slots.check(self.store, ticket)
        if ticket.slots > 1:
            return self._enter_slots(ticket)
        store, again = self.store, False
        while True:
            try:
                fd = store.open_lock_file()
            except Vanished:
                store.reopen()  # pruned as idle since we opened it: its path, made afresh
                continue
            if not again:
                fault.pause("pause-lock-open")
            again = True
            if not queue.try_flock(fd):
                return LocalPlace(store, ticket, fd, None)  # ``wait`` checks the file it gets
            if same_file(store.dir, "lock", fd):
                break
            # Prune unlinked the file we opened (the lock was idle): a flock on it would be a
            # second lock beside the newcomers' on the new file. Open the path again.
            os.close(fd)
            store.reopen()
        if not queue.live_entries(store):
            return LocalPlace(store, ticket, fd, FlockGrip(fd))
        # Free for a moment, but others are in line: they go first.
        fcntl.flock(fd, fcntl.LOCK_UN)
        return LocalPlace(store, ticket, fd, None)

    def _enter_slots(self, ticket: Ticket) -> LocalPlace:
        """A free slot at once (nobody in line), or the slot files for the head of the line."""
        held = slots.SlotSet(self.store, ticket.slots)
        try:
            slot = held.try_any()
            if slot is not None:
                if not queue.live_entries(self.store):
                    return LocalPlace(self.store, ticket, -1, FlockGrip(held.keep_taken(), slot))
                held.undo()  # free for a moment, but others are in line: they go first
        except BaseException:
            held.close()
            raise
        return LocalPlace(self.store, ticket, -1, None, held)

    # -- --cancel-in-progress (the rules: rules/events.py) -----------------------------------

    def _holder_records(self) -> list[Ticket]:
        found = []
        for name in slots.pointers(self.store):
            holder_id = self.store.read_pointer(name)
            t = self.store.read_ticket(holder_id) if holder_id and names.is_uuid(holder_id) else None
            # Another slot's last holder may have ended long ago: only this slot's stands for it.
            if t is not None and (name == "holder" or t.live):
                found.append(t)
        return sorted(found, key=lambda t: t.fence or 0)

    def take(
        self, grip: FlockGrip | dict[str, Any], ticket: Ticket, *, promoted: bool, kill_grace: float
    ) -> tuple[LocalLease, Taken]:
        if isinstance(grip, dict):  # handed over to a holder forked as the run started to wait
            grip = FlockGrip.from_handover(grip)
        token = lease.take_ownership(self.store, ticket, promoted=promoted, slot=grip.slot)
        assert ticket.fence is not None
        env = {ENV_SLOT: str(grip.slot)}
        # (The pipe protocol's, loaded by every process that takes a lock: not by pearing-guard.)
        from singleflight.core.protocol import Taken

        taken = Taken(ticket.fence, token, self.store.tokens.path(ticket.ticket_id), env)
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
            # Created behind a holder or a waiter, it waits behind another holder (promoted), even
            # if that one is gone before its agent gets going: as on etcd.
            ticket.promoted = self._taken() or bool(queue.live_entries(store))
            store.write_ticket(ticket)
            store.write_request(
                ticket.request_uuid,
                RequestRecord(state=REQUEST_ACTIVE, ticket_id=ticket.ticket_id, created_at=time.time()),
            )
        return ticket

    def _taken(self) -> bool:
        """Does a live holder have the lock now? (Its pointer, not the flock: a probe of the
        flock would turn a run that finds the lock free into a waiter for that instant.)"""
        return any(h.state == HELD and proc.alive(h.holder_pid, h.holder_start) for h in self._holder_records())

    def read(self, ticket_id: str) -> Ticket | None:
        return self.store.read_ticket(ticket_id)

    def end(
        self, ticket_id: str, state: str, reason: str, *, only_if_held: bool = True, release: bool = True
    ) -> Ticket | None:
        # The flock is the grip's: ending the record never frees the lock by itself. A waiter's
        # entry in line is its own (flocked): it is woken to leave it.
        ended = lease.end(self.store, ticket_id, state, reason, only_if_held=only_if_held)
        if ended is not None and ended.fence is None and queue.in_line(self.store, ticket_id):
            lease.wake_waiter(ended)  # only a process in line handles the poke (not an owner's)
        return ended

    def update(self, ticket_id: str, change: Callable[[Ticket], bool]) -> Ticket | None:
        """Under the lock's mutex, where every write of a ticket happens (a holder ending its
        token for a cancel request too)."""
        store = self.store
        with store.mutex():
            t = store.read_ticket(ticket_id)
            if t is None:
                raise UnknownTicket(ticket_id)
            if not change(t) or not t.live:
                return None
            store.write_ticket(t)
        return t

    def line(self) -> Line:
        from singleflight.core.line import Line  # status's and a waiter's, not a free lock's

        store, now = self.store, time.monotonic()
        holders = []
        waiters = []
        for t in store.tickets():
            if not proc.alive(t.holder_pid, t.holder_start):
                continue
            left = t.lease_left(now)
            if t.state == HELD and (left is None or left > 0):
                holders.append(t)
            elif t.state == WAITING:
                waiters.append(t)
        holders += slots.stopping(store, {h.ticket_id for h in holders})  # COMMAND still being stopped
        holders.sort(key=lambda h: h.fence or 0)
        total = max([t.slots for t in holders + waiters], default=1)
        order = {n.rpartition(".")[2]: i for i, n in enumerate(queue.live_entries(store))}
        # An agent still starting has no entry yet: it joins at the end, so it is listed there.
        waiters.sort(key=lambda w: order.get(w.ticket_id, len(order)))
        unplaced = frozenset(w.ticket_id for w in waiters if w.ticket_id not in order)
        entries: list[Ticket | dict[str, Any]] = [*holders, *waiters]
        return Line(
            entries,
            held=bool(holders),
            fence=store.read_fence(),
            extra={},
            unplaced=unplaced,
            holders=len(holders),
            slots=total,
        )


class LocalBackend:
    def __init__(self, url: str, lock_dir: str, *, create: bool = True) -> None:
        self.url, self.lock_dir = url, lock_dir
        self.dir = LockDir(lock_dir, create=create)
        # The locks this process has open (``lock``): their records are read and written through
        # the same files, not opened again.
        self.open_stores: dict[tuple[str, str], LockStore] = {}

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
            store = self.dir.lock_store(repo, lock, create=create)
        except FileNotFoundError:
            raise UnknownLock(repo, lock) from None
        self.open_stores[(repo, lock)] = store
        return LocalLock(self, store)

    def locks(self, repo: str | None, *, idle: bool = False) -> list[tuple[str, str]]:
        out = []
        for store in self.dir.iter_locks(repo):
            with store:
                # A lock with tickets in line or holding has a live queue entry or a holder's
                # pointer to a live ticket; idle ones are left for ``idle`` (``status`` judges
                # each listed one on its own, so this only keeps the scan cheap).
                if idle or queue.live_entries(store) or LocalLock(self, store)._taken():
                    out.append((store.repo, store.lock))
        return sorted(out)

    def prune(self, repo: str, lock: str, keep: Callable[[Idle], str | None], *, dry_run: bool) -> str | None:
        from singleflight.local import prune  # pearing-cli prune's, not pearing-run's

        return prune.prune(self.dir, repo, lock, keep, dry_run=dry_run)

    # -- records ---------------------------------------------------------------------------

    @contextmanager
    def _lock_records(self, key: Key) -> Iterator[LockRecords]:
        assert key.lock is not None
        store = self.open_stores.get(key.lock)
        if store is not None:
            yield LockRecords(store)
            return
        with self.dir.lock_store(*key.lock) as opened:
            yield LockRecords(opened)

    def _own(self, key: Key) -> ActivityRecords | FileLedger:
        if key.name.startswith(FENCE_PREFIX):
            from singleflight.core.ledger import FileLedger  # pearing-guard fence's, not pearing-run's

            return FileLedger(self.dir.root, "ledger.json")
        return ActivityRecords(self.dir.root)

    def read_record(self, key: Key) -> tuple[bytes | None, Any, str]:
        if key.lock is None:
            return self._own(key).read_record(key)
        with self._lock_records(key) as records:
            return records.read_record(key.name)

    def write_record(
        self, key: Key, body: bytes | None, seen: Any, *, run: Ticket | None = None, keep: float | None = None
    ) -> bool:
        if key.lock is None:
            return self._own(key).write_record(key, body, seen)
        with self._lock_records(key) as records:
            return records.write_record(key.name, body, seen, run=run, keep=keep)

    def prepare_record(self, key: Key, body: bytes) -> None:
        with self._lock_records(key) as records:
            records.prepare_record(key.name, body)

    @contextmanager
    def guard(self, claim: Claim, digest: str, hold: float | None) -> Iterator[Facts]:
        from singleflight.local import guard  # hmac and the rest: pearing-guard's, not pearing-run's

        if hold is None:
            yield guard.facts(claim, digest)
            return
        with guard.hold_guard(claim) as held:  # the time bound is the caller's (exec's --max-seconds)
            yield guard.facts(claim, digest) if held else Facts(None)

    def read_thread(self, repo: str, thread: int) -> tuple[list[dict[str, Any]], int | None]:
        from singleflight.local.threads import Threads  # sqlite3: the thread service's, not pearing-run's

        return Threads(self.dir.root).read(repo, thread)

    def add_reply(self, repo: str, thread: int, reply: dict[str, Any], *, highest: int | None) -> bool:
        from singleflight.local.threads import Threads

        return Threads(self.dir.root).add(repo, thread, reply, highest=highest)
