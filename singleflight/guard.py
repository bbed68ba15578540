"""Fence side effects that can outlive a lease: verify, guarded exec, fence ledger.

The Python API of ``pearing-guard``::

    from singleflight import guard

    verdict = guard.verify()                 # token from PEARING_TOKEN_FILE
    if not verdict.ok:
        raise SystemExit(verdict.reason)
    with guard.guarded():                    # no expiry or hand-over in here
        post_reply()
    guard.accept_fence("branch:thread-42", verdict.fence)   # target side

``verify`` runs before every guarded write, so this module imports little.
"""

from __future__ import annotations

import os
from contextlib import contextmanager

from singleflight.backend import open_backend
from singleflight.core import names
from singleflight.core.const import DEFAULT_GUARD_MAX_SECONDS, ENV_LOCK_DIR, TYPE_CHECKING
from singleflight.core.errors import BadValue, LockDirError, NotHeld
from singleflight.core.fs import Dir, resolve_lock_dir
from singleflight.core.tokens import Verdict, read_claim
from singleflight.rules import verdict

if TYPE_CHECKING:
    from collections.abc import Iterator, Mapping

__all__ = ["Verdict", "accept_fence", "guarded", "verify"]


def verify(token_file: str | None = None, env: Mapping[str, str] | None = None) -> Verdict:
    """Is this token the live holder's right now? Never raises for a refusal."""
    claim = read_claim(token_file, os.environ if env is None else env)
    if isinstance(claim, Verdict):
        return claim
    try:
        # Never create the lock dir to judge a token: a missing one means an unknown token.
        backend = open_backend(claim.backend, claim.lock_dir, create=False)
    except LockDirError:
        return claim.refuse(verdict.UNKNOWN)
    return verdict.verify(backend, claim)


@contextmanager
def guarded(
    token_file: str | None = None,
    env: Mapping[str, str] | None = None,
    *,
    hold_seconds: float = DEFAULT_GUARD_MAX_SECONDS,
) -> Iterator[Verdict]:
    """Verify, then hold off expiry and hand-over of the lease for the block's duration.

    Raises NotHeld (exit 1) when the token is not live.
    """
    claim = read_claim(token_file, os.environ if env is None else env)
    if isinstance(claim, Verdict):
        raise NotHeld(claim.ticket_id or "-", claim.reason)
    try:
        backend = open_backend(claim.backend, claim.lock_dir, create=False)
    except LockDirError:
        raise NotHeld(claim.ticket_id or "-", verdict.UNKNOWN) from None
    with verdict.hold_off(backend, claim, hold_seconds) as held:
        yield held


def accept_fence(
    resource: str, fence: int, ledger: str | None = None, *, backend: str | None = None, lock_dir: str | None = None
) -> int:
    """Accept ``fence`` for ``resource`` if it is >= the highest seen; record it durably.

    Returns the fence. Raises StaleFence otherwise. The ledger is ``ledger`` (a
    file, on any backend), else the backend's own (the lock dir's ledger.json,
    or a key in etcd).
    """
    if not resource or len(resource) > 512 or any(ord(c) < 32 or ord(c) == 127 for c in resource):
        raise BadValue("resource", resource, "must be 1 to 512 printable characters")
    fence = names.fence(fence)
    from singleflight.rules import records  # fence's, not verify's

    if ledger:
        from singleflight.core.ledger import FileLedger

        path = os.path.abspath(ledger)
        parent, name = os.path.split(path)
        with Dir.open_checked(parent, what="the ledger's directory") as d:
            return records.accept_fence(FileLedger(d, name), resource, fence)
    lock_dir_path = resolve_lock_dir(lock_dir if lock_dir is not None else os.environ.get(ENV_LOCK_DIR) or None)
    store = open_backend(backend, lock_dir_path)
    try:
        return records.accept_fence(store, resource, fence)
    finally:
        store.close()
