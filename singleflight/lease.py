"""Ticket transitions that must happen under the lock's mutex: where a fence
gets bumped, a token minted, a lease renewed or ended.
"""

from __future__ import annotations

import fcntl
import hashlib
import os
import signal
import time
from collections.abc import Iterator
from contextlib import contextmanager

from singleflight.core import fault as _fault
from singleflight.core import proc as _proc
from singleflight.core.const import CANCELLED, EXPIRED, HELD, RELEASED, WAITING
from singleflight.core.errors import NotHeld, UnknownTicket
from singleflight.core.ticket import Ticket
from singleflight.store import LockStore


def mint_token() -> str:
    """The run's secret: 256 random bits. Only its holder learns it."""
    import secrets  # here, not at the top: pearing-guard verify imports this module

    return secrets.token_hex(32)


def token_hash(token: str) -> str:
    return hashlib.sha256(token.encode()).hexdigest()


@contextmanager
def guard_exclusive(store: LockStore) -> Iterator[None]:
    """Wait for in-flight ``pearing-guard exec`` commands before ending a lease."""
    fd = store.open_lock_file("guard.lock")
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)


def sweep_previous_holder(store: LockStore, new_ticket_id: str) -> None:
    """Mark the previous holder's ticket expired if it died holding (kill -9).

    Caller holds the flock and the mutex; holding the flock proves that holder
    is gone, since the kernel frees it only then. Only the ``holder`` pointer is
    read, not every ticket: this runs on every hand-over.
    """
    previous = store.read_pointer("holder")
    if previous and previous != new_ticket_id:
        t = store.read_ticket(previous)
        if t is not None and t.state == HELD:
            t.state, t.end_reason, t.ended_at = EXPIRED, "holder gone", time.time()
            store.write_ticket(t)
            # Its token file too: a raw token stays on disk only while its ticket is held.
            store.remove_token_file(previous)


def sweep_dead_waiters(store: LockStore) -> int:
    """Cancel waiting tickets whose waiter died. Off the hot path (after a release)."""
    swept = 0
    for t in store.tickets():
        if t.state == WAITING and not _proc.alive(t.holder_pid, t.holder_start):
            with store.mutex():
                cur = store.read_ticket(t.ticket_id)
                if cur is not None and cur.state == WAITING and not _proc.alive(cur.holder_pid, cur.holder_start):
                    cur.state, cur.end_reason, cur.ended_at = CANCELLED, "waiter gone", time.time()
                    store.write_ticket(cur)
                    swept += 1
    return swept


def take_ownership(store: LockStore, ticket: Ticket, *, promoted: bool) -> str:
    """Turn ``ticket`` into the held one; returns the token. Caller owns the flock."""
    _fault.point("after-flock")
    # A guarded side effect of the previous holder may still be in flight if
    # that holder was killed (-9 skips its own expiry path): wait for it, so
    # it lands before this holder's fence exists.
    with guard_exclusive(store):
        pass
    with store.mutex():
        sweep_previous_holder(store, ticket.ticket_id)
        # The pointer goes first: a kill right after it names a ticket that is not held.
        store.write_pointer("holder", ticket.ticket_id)
        fence = store.bump_fence()
        token = mint_token()
        now = time.time()
        ticket.state = HELD
        ticket.fence = fence
        ticket.token_hash = token_hash(token)
        ticket.holder_pid = os.getpid()
        ticket.holder_start = _proc.start_time(os.getpid())
        ticket.boot_id = _proc.boot_id()
        ticket.acquired_at = now
        ticket.promoted = promoted
        ticket.queue_seq = None
        ticket.set_lease(ticket.lease_seconds)
        store.write_ticket(ticket)
    store.write_token_file(ticket, token)
    _fault.point("after-token-file")
    return token


def renew(store: LockStore, ticket_id: str, seconds: float) -> Ticket:
    """Extend a held (or waiting) ticket's lease by ``seconds`` from now.

    Refused once the monotonic deadline has passed, even if the holder has not
    yet noticed: a lapsed lease is never revived.
    """
    with store.mutex():
        t = store.read_ticket(ticket_id)
        if t is None:
            raise UnknownTicket(ticket_id)
        check_live(store, t)
        before = t.lease_deadline_mono
        t.set_lease(seconds)
        store.write_ticket(t)
    if t.state == HELD and before is not None and (t.lease_deadline_mono or 0) < before:
        # A shorter lease than before: the holder sleeps until the deadline it knows,
        # so make it re-read the ticket now, or the lock would outlive the lease.
        _poke_holder(t)
    return t


def _poke_holder(t: Ticket) -> None:
    """SIGUSR1 to a held ticket's holder (another process), checked by pid and start time."""
    pid = t.holder_pid
    if pid is None or pid == os.getpid():
        return
    try:
        fd = os.pidfd_open(pid)
    except OSError:
        return
    try:
        if _proc.start_time(pid) == t.holder_start:
            signal.pidfd_send_signal(fd, signal.SIGUSR1)
    except OSError:
        pass
    finally:
        os.close(fd)


def check_live(store: LockStore, t: Ticket) -> None:
    """Raise NotHeld unless ``t`` is a held or waiting ticket whose lease still runs."""
    if t.state not in (HELD, WAITING):
        raise NotHeld(t.ticket_id, describe_end(t))
    left = t.lease_left(time.monotonic())
    if left is not None and left <= 0:
        raise NotHeld(t.ticket_id, f"lease expired at {t.public()['lease_expires_at']}")
    if not _proc.alive(t.holder_pid, t.holder_start):
        raise NotHeld(t.ticket_id, "holder gone")


def describe_end(t: Ticket) -> str:
    reason = f" ({t.end_reason})" if t.end_reason else ""
    when = t.public()["ended_at"]
    return f"{t.state}{reason}" + (f" at {when}" if when else "")


def end(
    store: LockStore,
    ticket_id: str,
    state: str,
    reason: str,
    *,
    only_if_held: bool = True,
) -> Ticket | None:
    """Move a ticket to a final state (released / expired / cancelled).

    Takes the guard lock first, so a guarded side effect in flight completes
    before the token stops being live and the lock can change hands.
    Returns the ticket, or None when it had already ended.
    """
    with guard_exclusive(store), store.mutex():
        t = store.read_ticket(ticket_id)
        if t is None:
            raise UnknownTicket(ticket_id)
        if t.state not in (HELD, WAITING) or (only_if_held and t.state != HELD):
            return None
        t.state, t.end_reason, t.ended_at = state, reason, time.time()
        store.write_ticket(t)
        return t


def record_request(store: LockStore, request_uuid: str, ticket: Ticket, status: int | None, window: float) -> None:
    """Remember how a request ended: success is deduplicated for ``window`` seconds."""
    now = time.time()
    state = "succeeded" if status == 0 else "failed"
    store.write_request(
        request_uuid,
        {
            "state": state,
            "ticket_id": ticket.ticket_id,
            "fence": ticket.fence,
            "status": status,
            "finished_at": now,
            "expires_at": now + window,
        },
    )


__all__ = ["EXPIRED", "RELEASED", "end", "renew", "take_ownership"]
