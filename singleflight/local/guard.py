"""The lock dir's side of pearing-guard: what it knows of a claimed ticket, and the hold-off lock."""

from __future__ import annotations

import fcntl
import os
from contextlib import contextmanager

from singleflight.core import proc
from singleflight.core.const import TYPE_CHECKING
from singleflight.core.errors import LockDirError, Vanished
from singleflight.core.tokens import Claim, Facts, same_secret
from singleflight.local.store import LockDir, LockStore

if TYPE_CHECKING:
    from collections.abc import Iterator


def facts(claim: Claim, digest: str) -> Facts:
    store = _open_store(claim)
    if store is None:
        return Facts(None)
    with store:
        if claim.ticket_id:
            t = store.read_ticket(claim.ticket_id)
        else:
            t = next((x for x in store.tickets() if same_secret(x.token_hash or "", digest)), None)
        if t is None:
            return Facts(None)
        alive = t.boot_id == proc.boot_id() and proc.alive(t.holder_pid, t.holder_start)
        return Facts(t, fence_now=store.read_fence(), holder_alive=alive)


def _open_store(claim: Claim) -> LockStore | None:
    """The claimed lock's files, or None when they do not exist (an unknown token)."""
    try:
        with LockDir(claim.lock_dir, create=False) as lock_dir:
            return lock_dir.lock_store(claim.repo, claim.lock, create=False)
    except (FileNotFoundError, LockDirError):
        return None


@contextmanager
def hold_guard(claim: Claim) -> Iterator[bool]:
    """Hold ``guard.lock`` shared for the block (False: the lock has no files at all).

    Expiry and release take ``guard.lock`` exclusively, so a lease cannot lapse
    into a new holder while the side effect is in flight. The time bound is the
    caller's (pearing-guard exec kills CMD after --max-seconds).
    """
    store = _open_store(claim)
    if store is None:
        yield False
        return
    with store:
        try:
            fd = store.open_lock_file("guard.lock")
        except Vanished:
            yield False  # pruned as idle since we found it: no ticket of it to hold off
            return
        try:
            fcntl.flock(fd, fcntl.LOCK_SH)
            yield True
        finally:
            os.close(fd)
