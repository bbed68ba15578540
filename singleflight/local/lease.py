"""Ticket transitions that must happen under the lock's mutex: where a fence
gets bumped, a token minted, a lease renewed or ended.
"""

from __future__ import annotations

import os
import signal
import time
from contextlib import contextmanager

from singleflight.core import fault, proc
from singleflight.core.const import (
    CANCELLED,
    ENDED_TICKET_RETENTION,
    EXPIRED,
    HELD,
    HOUSEKEEPING_EVERY,
    REQUEST_RETENTION,
    TYPE_CHECKING,
    WAITING,
)
from singleflight.core.errors import CorruptRecord, NotHeld, UnknownTicket, Vanished
from singleflight.core.reasons import EndReason
from singleflight.core.ticket import Ticket
from singleflight.core.tokens import mint_token, token_hash
from singleflight.local import queue, slots
from singleflight.local.store import LockStore, flocked

if TYPE_CHECKING:
    from collections.abc import Callable, Iterator


@contextmanager
def guard_exclusive(store: LockStore) -> Iterator[None]:
    """Wait for in-flight ``pearing-guard exec`` commands before ending a lease."""
    fd = flocked(store, "guard.lock")
    try:
        yield
    finally:
        os.close(fd)


def end_judged(
    store: LockStore,
    ticket_id: str,
    state: str,
    judge: Callable[[Ticket], str | None],
    *,
    keep: Callable[[], None],
    every: float,
) -> bool:
    """A held ticket ended for the reason ``judge`` gives it as stored (None: left live), once no
    guarded command is in flight: the guard lock first (``keep`` called every ``every`` s while
    waiting for it), then the judgement and the end under the mutex, which every other write of
    the ticket takes too: none lands between them."""
    fd = store.open_lock_file("guard.lock")
    try:
        while not queue.flock_until(fd, time.monotonic() + every):
            os.close(fd)  # see flock_until: a lock granted as the alarm fired goes with it
            fd = -1
            keep()
            fd = store.open_lock_file("guard.lock")
        with store.mutex():
            t = store.read_ticket(ticket_id)
            why = judge(t) if t is not None and t.state == HELD else None
            if t is None or why is None:
                return False
            t.end(state, why)
            store.write_ticket(t)
            return True
    finally:
        if fd >= 0:
            os.close(fd)


def sweep_previous_holder(store: LockStore, new_ticket_id: str, name: str = "holder") -> int:
    """Mark the previous holder's ticket expired if it died holding (kill -9); return the
    highest fence among the tickets looked at (0 if none), which the next fence must exceed.

    Caller holds the flock and the mutex; holding the flock proves that holder
    is gone, since the kernel frees it only then. Only the ``holder`` pointer (``name``: the
    slot's) is read, not every ticket: this runs on every hand-over. Without a usable pointer
    (none yet, or garbage: it is only a hint) every live ticket is looked at instead; with
    slots, only those of this slot (the others' holders may well be alive).
    """
    previous = store.read_pointer(name)
    if previous is not None:
        t = store.read_ticket(previous) if previous != new_ticket_id else None
        candidates = [t] if t is not None else []
    else:
        slot = slots.slot_of(name)
        candidates = [t for t in store.tickets() if (t.slot or 0) == slot]
    floor = 0
    for t in candidates:
        floor = max(floor, t.fence or 0)
        if t.state == HELD and t.ticket_id != new_ticket_id:
            t.end(EXPIRED, EndReason.HOLDER_GONE)
            store.write_ticket(t)
            # Its token file too: a raw token stays on disk only while its ticket is held.
            store.tokens.remove(t.ticket_id)
    return floor


def sweep_dead_waiters(store: LockStore) -> int:
    """Cancel waiting tickets whose waiter died. Off the hot path (after a release)."""
    swept = 0
    for t in store.tickets():
        if t.state == WAITING and not proc.alive(t.holder_pid, t.holder_start):
            with store.mutex():
                cur = store.read_ticket(t.ticket_id)
                if cur is not None and cur.state == WAITING and not proc.alive(cur.holder_pid, cur.holder_start):
                    cur.end(CANCELLED, EndReason.WAITER_GONE)
                    store.write_ticket(cur)
                    swept += 1
    return swept


def prune_ended(store: LockStore, now: float, keep: float = ENDED_TICKET_RETENTION) -> int:
    """Remove ended tickets older than ``keep``, except the last holder's: its fence is
    what a lost fence file continues from."""
    d = store.sub("ended")
    # Every slot's last holder (``holder``, ``holder.N`` with --slots).
    pointers = [n for n in store.dir.listdir() if n == "holder" or n.startswith("holder.")]
    last = {f"{t}.json" for t in map(store.read_pointer, pointers) if t is not None}
    removed = 0
    for name in d.listdir():
        if name in last:
            continue
        st = d.lstat(name)
        if st is not None and st.st_mtime < now - keep:
            removed += d.unlink(name)
    return removed


def prune_requests(store: LockStore, now: float) -> int:
    """Remove request records that ended and whose dedupe window has passed, and claims whose run
    is gone (they read as none) once REQUEST_RETENTION has passed since they were made, as etcd's
    lease and PostgreSQL's expiry drop them: pearing-cli acquire-lock's record of a uuid's ticket
    is never ended, and one file per request would otherwise stay for good."""
    from singleflight.local.records import LockRecords

    d = store.sub("requests")
    removed = 0
    for name in d.listdir():
        if not name.endswith(".json") or name.startswith("."):
            continue
        try:
            rec = store.read_request(name[:-5])
        except CorruptRecord:
            continue  # left as it is, for its request's next run to name (74): not the others' tidying
        if rec is None:
            continue
        if rec.active:
            old = (rec.created_at or now) < now - REQUEST_RETENTION
            gone = old and LockRecords(store).dead_claim(d.read(name) or b"")
        else:
            gone = (rec.expires_at or 0.0) < now
        if gone:
            removed += d.unlink(name)
    return removed


def housekeeping(store: LockStore, every: float = HOUSEKEEPING_EVERY) -> bool:
    """Prune ended tickets and old request records, cancel dead waiters.

    At most once per ``every`` seconds per lock: it reads every record, and
    right after a release it would compete for the CPU with the next
    holder's hand-over.
    """
    now = time.time()
    if store.dir.lstat("lock") is None:
        return False  # pruned as idle once we let go: nothing left to tidy, nothing to make again
    st = store.dir.lstat(".housekeeping")
    if st is not None and now - st.st_mtime < every:
        return False
    try:
        store.dir.write_atomic(".housekeeping", b"", durable=False)
        prune_ended(store, now)
        prune_requests(store, now)
        sweep_dead_waiters(store)
    except Vanished:
        return False  # pruned meanwhile: prune tidied up
    return True


def take_ownership(store: LockStore, ticket: Ticket, *, promoted: bool, slot: int = 0) -> str:
    """Turn ``ticket`` into the held one (of slot ``slot``); returns the token. Caller owns the
    slot's flock."""
    fault.point("after-flock")
    # A guarded side effect of the previous holder may still be in flight if
    # that holder was killed (-9 skips its own expiry path): wait for it, so
    # it lands before this holder's fence exists.
    with guard_exclusive(store):
        pass
    with store.mutex():
        stored = store.read_ticket(ticket.ticket_id)
        if stored is not None and not stored.live:
            # Its owner released it (release-lock-ticket) as its turn came, before this holder's
            # first word: that end stands, and it gets no fence (``LockOps.take``).
            raise NotHeld(ticket.ticket_id, stored.describe_end())
        # Two runs with different --slots that each found a slot free: the first to get here
        # holds, the other is refused before it has a fence.
        slots.check(store, ticket)
        # A fence file rolled back (restored from a backup, rewritten by hand) must not
        # reissue the last holder's fence: that holder's record is read here anyway.
        floor = sweep_previous_holder(store, ticket.ticket_id, slots.pointer(slot))
        # The pointer goes first: a kill right after it names a ticket that is not held.
        store.write_pointer(slots.pointer(slot), ticket.ticket_id)
        fence = store.bump_fence(floor)
        token = mint_token()
        ticket.state = HELD
        ticket.fence, ticket.slot = fence, slot
        ticket.token_hash = token_hash(token)
        ticket.holder_pid = os.getpid()
        ticket.holder_start = proc.start_time(os.getpid())
        ticket.boot_id = proc.boot_id()
        ticket.holder_host = os.uname().nodename
        ticket.acquired_at = time.time()
        ticket.promoted = promoted or ticket.promoted  # or it was created behind a holder
        ticket.set_lease(ticket.lease_seconds)
        store.write_ticket(ticket)
    store.tokens.write(ticket, token)
    fault.point("after-token-file")
    return token


def renew(store: LockStore, ticket_id: str, seconds: float, seen: float | None) -> Ticket:
    """The holder's own renewal: its lease runs ``seconds`` from now. Refused once it lapsed,
    even if the holder has not yet noticed (a frozen holder woken late): never revived. A
    heartbeat the holder has not seen yet (the lease's expiry is no longer ``seen``) stands,
    shorter or longer, as on etcd: the ticket is returned as that beat left it."""
    with store.mutex():
        t = store.read_ticket(ticket_id)
        if t is None:
            raise UnknownTicket(ticket_id)
        refused = t.refusal(gone=not proc.alive(t.holder_pid, t.holder_start))
        if refused is not None:
            raise NotHeld(t.ticket_id, refused)
        if t.lease_expires_at != seen:
            return t
        t.set_lease(seconds)
        store.write_ticket(t)
    return t


def poke(t: Ticket, *, waiter: bool = False) -> bool:
    """Tell a ticket's process (another one) to re-read the ticket now: SIGUSR1 to a holder,
    the waiters' own signal to a waiter (``queue.WAITER_POKE``)."""
    return proc.signal_exact(t.holder_pid, t.holder_start, queue.WAITER_POKE if waiter else signal.SIGUSR1)


# How long ending another process's waiting ticket waits for that waiter to leave the line (its
# entry is its own, flocked: until it goes, an arrival would queue behind it).
LEAVE_WAIT = 10.0


def wake_waiter(t: Ticket) -> None:
    """Its waiter (in line) re-reads the ticket now (``queue.WAITER_POKE``) and leaves the line;
    another process's is waited for (``LEAVE_WAIT`` at most), our own only told."""
    if t.holder_pid != os.getpid():
        proc.poke_and_wait(t.holder_pid, t.holder_start, queue.WAITER_POKE, LEAVE_WAIT)
    elif signal.getsignal(queue.WAITER_POKE) not in (signal.SIG_DFL, None):
        poke(t, waiter=True)


def end(
    store: LockStore,
    ticket_id: str,
    state: str,
    reason: str,
    *,
    only_if_held: bool = True,
) -> Ticket | None:
    """Move a ticket to a final state (released / expired / cancelled).

    A held ticket's end takes the guard lock first, so a guarded side effect in flight completes
    before the token stops being live and the lock can change hands. A waiting ticket has no
    token, so nothing guarded runs under it: it ends at once (a waiter whose wait ran out must
    not wait for another run's guarded command). Returns the ticket, or None when it had
    already ended.
    """
    if not only_if_held:  # (a holder ending its own ticket, every run, skips this look)
        with store.mutex():  # promotion happens under the mutex too: a ticket read waiting stays so
            t = store.read_ticket(ticket_id)
            if t is None:
                raise UnknownTicket(ticket_id)
            if t.state == WAITING:
                t.end(state, reason)
                store.write_ticket(t)
                return t
    with guard_exclusive(store), store.mutex():  # the guard lock first: the lock order
        t = store.read_ticket(ticket_id)
        if t is None:
            raise UnknownTicket(ticket_id)
        if t.state not in (HELD, WAITING) or (only_if_held and t.state != HELD):
            return None
        t.end(state, reason)
        store.write_ticket(t)
        return t
