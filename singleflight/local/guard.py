"""The lock dir's side of pearing-guard: is a token live, and hold off its take-over."""

from __future__ import annotations

import fcntl
import hmac
import os
import time
from collections.abc import Iterator
from contextlib import contextmanager

from singleflight.core import proc
from singleflight.core.const import HELD
from singleflight.core.errors import LockDirError, NotHeld
from singleflight.core.ticket import rfc3339
from singleflight.core.tokens import Claim, Verdict, token_hash
from singleflight.local.store import LockDir, LockStore


def judge(store: LockStore, claim: Claim) -> Verdict:
    digest = token_hash(claim.token)
    if claim.ticket_id:
        t = store.read_ticket(claim.ticket_id)
    else:
        t = next((x for x in store.tickets() if x.token_hash == digest), None)
    # Constant-time compare: a forger learns nothing from timing.
    if t is None or t.token_hash is None or not hmac.compare_digest(t.token_hash, digest):
        return claim.refuse("unknown or forged token", ticket_id="")
    current = store.read_fence()
    if t.fence is not None and current > t.fence:
        return claim.refuse(f"superseded by fence {current}", ticket_id=t.ticket_id, fence=t.fence)
    if t.state != HELD:
        return claim.refuse(t.describe_end(), ticket_id=t.ticket_id, fence=t.fence)
    if t.boot_id != proc.boot_id() or not proc.alive(t.holder_pid, t.holder_start):
        return claim.refuse("holder gone", ticket_id=t.ticket_id, fence=t.fence)
    left = t.lease_left(time.monotonic())
    if left is not None and left <= 0:
        return claim.refuse(f"lease expired at {rfc3339(t.lease_expires_at)}", ticket_id=t.ticket_id, fence=t.fence)
    return Verdict(True, "live", lock=claim.lock, repo=claim.repo, ticket_id=t.ticket_id, fence=t.fence)


def _open_store(claim: Claim) -> LockStore | None:
    """The claimed lock's files, or None when they do not exist (an unknown token)."""
    try:
        with LockDir(claim.lock_dir, create=False) as lock_dir:
            return lock_dir.lock_store(claim.repo, claim.lock, create=False)
    except (FileNotFoundError, LockDirError):
        return None


def verify(claim: Claim) -> Verdict:
    store = _open_store(claim)
    if store is None:
        return claim.refuse("unknown or forged token")
    with store:
        return judge(store, claim)


@contextmanager
def hold_off(claim: Claim) -> Iterator[Verdict]:
    """Verify, then hold ``guard.lock`` shared for the block.

    Expiry and release take ``guard.lock`` exclusively, so a lease cannot lapse
    into a new holder while the side effect is in flight. The time bound is the
    caller's (pearing-guard exec kills CMD after --max-seconds).
    """
    store = _open_store(claim)
    if store is None:
        raise NotHeld(claim.ticket_id or "-", "unknown or forged token")
    with store:
        fd = store.open_lock_file("guard.lock")
        try:
            fcntl.flock(fd, fcntl.LOCK_SH)
            verdict = judge(store, claim)
            if not verdict.ok:
                raise NotHeld(verdict.ticket_id or "-", verdict.reason)
            yield verdict
        finally:
            os.close(fd)
