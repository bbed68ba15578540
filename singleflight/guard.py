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

import fcntl
import hmac
import json
import os
import stat
import time
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from typing import Any

from singleflight.core import fault as _fault
from singleflight.core import names
from singleflight.core import proc as _proc
from singleflight.core.const import (
    DEFAULT_GUARD_MAX_SECONDS,
    ENV_BACKEND,
    ENV_LOCK,
    ENV_LOCK_DIR,
    ENV_REPO,
    ENV_TICKET,
    ENV_TOKEN,
    ENV_TOKEN_FILE,
    HELD,
)
from singleflight.core.errors import BadValue, CorruptRecord, LockDirError, NotHeld, StaleFence, UsageError
from singleflight.core.fs import Dir
from singleflight.lease import describe_end, token_hash
from singleflight.store import LockDir, LockStore, resolve_lock_dir


class Verdict:
    """Whether a token belongs to the live holder of its lock right now."""

    __slots__ = ("fence", "lock", "ok", "reason", "repo", "ticket_id")

    def __init__(
        self, ok: bool, reason: str, *, lock: str = "", repo: str = "", ticket_id: str = "", fence: int | None = None
    ) -> None:
        self.ok, self.reason = ok, reason
        self.lock, self.repo, self.ticket_id, self.fence = lock, repo, ticket_id, fence

    def as_dict(self) -> dict[str, Any]:
        return {
            "ok": self.ok,
            "reason": self.reason,
            "lock_name": self.lock,
            "repo": self.repo,
            "ticket_id": self.ticket_id,
            "fence": self.fence,
        }


class _Claim:
    __slots__ = ("backend", "lock", "lock_dir", "repo", "ticket_id", "token")

    def __init__(
        self, lock: str, repo: str, ticket_id: str | None, token: str, lock_dir: str, *, backend: str | None = None
    ) -> None:
        self.lock, self.repo, self.ticket_id, self.token, self.lock_dir = lock, repo, ticket_id, token, lock_dir
        self.backend = backend


def _claim(token_file: str | None, env: Mapping[str, str]) -> _Claim | Verdict:
    """Where the token comes from: --token-file, PEARING_TOKEN_FILE, or PEARING_TOKEN + lock + repo."""
    path = token_file or env.get(ENV_TOKEN_FILE)
    if path:
        try:
            fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
        except FileNotFoundError:
            return Verdict(False, f"token file {path} is gone: its run has ended")
        except OSError as exc:
            return Verdict(False, f"token file {path}: {exc.strerror}")
        try:
            if not stat.S_ISREG(os.fstat(fd).st_mode):
                return Verdict(False, f"token file {path} is not a regular file")
            data = os.read(fd, 65536)
        finally:
            os.close(fd)
        try:
            obj = json.loads(data)
            return _Claim(
                names.lock_name(str(obj["lock"])),
                names.scope(str(obj["repo"])),
                names.ticket_id(str(obj["ticket"])),
                str(obj["token"]),
                str(obj.get("lock_dir") or resolve_lock_dir(env.get(ENV_LOCK_DIR))),
                backend=str(obj["backend"]) if obj.get("backend") else None,
            )
        except (ValueError, KeyError, TypeError, BadValue):
            return Verdict(False, f"token file {path} is not a pearing token file")
    token, lock = env.get(ENV_TOKEN), env.get(ENV_LOCK)
    if not token or not lock:
        raise UsageError("no token: give --token-file, or set PEARING_TOKEN_FILE, or PEARING_TOKEN and PEARING_LOCK")
    ticket = env.get(ENV_TICKET)
    return _Claim(
        names.lock_name(lock, "PEARING_LOCK"),
        names.scope(env.get(ENV_REPO) or "default"),
        names.ticket_id(ticket) if ticket else None,
        token,
        resolve_lock_dir(env.get(ENV_LOCK_DIR) or None),
        backend=env.get(ENV_BACKEND) or None,
    )


def _judge(store: LockStore, claim: _Claim) -> Verdict:
    digest = token_hash(claim.token)
    if claim.ticket_id:
        t = store.read_ticket(claim.ticket_id)
    else:
        t = next((x for x in store.tickets() if x.token_hash == digest), None)

    def refuse(reason: str) -> Verdict:
        return Verdict(
            False,
            reason,
            lock=claim.lock,
            repo=claim.repo,
            ticket_id=t.ticket_id if t else "",
            fence=t.fence if t else None,
        )

    # Constant-time compare: a forger learns nothing from timing.
    if t is None or t.token_hash is None or not hmac.compare_digest(t.token_hash, digest):
        t = None
        return refuse("unknown or forged token")
    current = store.read_fence()
    if t.fence is not None and current > t.fence:
        return refuse(f"superseded by fence {current}")
    if t.state != HELD:
        return refuse(describe_end(t))
    if t.boot_id != _proc.boot_id() or not _proc.alive(t.holder_pid, t.holder_start):
        return refuse("holder gone")
    left = t.lease_left(time.monotonic())
    if left is not None and left <= 0:
        return refuse(f"lease expired at {t.public()['lease_expires_at']}")
    return Verdict(True, "live", lock=claim.lock, repo=claim.repo, ticket_id=t.ticket_id, fence=t.fence)


def _judge_etcd(claim: _Claim) -> Verdict:
    from singleflight.core.errors import BackendUnavailable
    from singleflight.etcd import lock as etcd_lock
    from singleflight.etcd.client import Cluster

    assert claim.backend is not None
    if not claim.ticket_id:
        raise UsageError("on etcd, verify needs the ticket: PEARING_TICKET or a token file")
    try:
        ok, reason, fence = etcd_lock.verify(
            Cluster(claim.backend), claim.repo, claim.lock, claim.ticket_id, token_hash(claim.token)
        )
    except BackendUnavailable as exc:
        ok, reason, fence = False, str(exc), None
    return Verdict(ok, reason, lock=claim.lock, repo=claim.repo, ticket_id=claim.ticket_id, fence=fence)


def _open_store(claim: _Claim) -> LockStore | None:
    """The claimed lock's files, or None when they do not exist (an unknown token)."""
    try:
        with LockDir(claim.lock_dir, create=False) as lock_dir:
            return lock_dir.lock_store(claim.repo, claim.lock, create=False)
    except (FileNotFoundError, LockDirError):
        return None


def verify(token_file: str | None = None, env: Mapping[str, str] | None = None) -> Verdict:
    """Is this token the live holder's right now? Never raises for a refusal."""
    claim = _claim(token_file, os.environ if env is None else env)
    if isinstance(claim, Verdict):
        return claim
    if claim.backend:
        return _judge_etcd(claim)
    store = _open_store(claim)
    if store is None:
        return Verdict(False, "unknown or forged token", lock=claim.lock, repo=claim.repo)
    with store:
        return _judge(store, claim)


@contextmanager
def guarded(
    token_file: str | None = None,
    env: Mapping[str, str] | None = None,
    *,
    hold_seconds: float = DEFAULT_GUARD_MAX_SECONDS,
) -> Iterator[Verdict]:
    """Verify, then hold off expiry and hand-over of the lease for the block's duration.

    Expiry and release take ``guard.lock`` exclusively; we hold it shared, so a
    lease cannot lapse into a new holder while the side effect is in flight.
    Raises NotHeld (exit 1) when the token is not live.
    """
    claim = _claim(token_file, os.environ if env is None else env)
    if isinstance(claim, Verdict):
        raise NotHeld(claim.ticket_id or "-", claim.reason)
    if claim.backend:
        with _guarded_etcd(claim, hold_seconds) as verdict:
            yield verdict
        return
    store = _open_store(claim)
    if store is None:
        raise NotHeld(claim.ticket_id or "-", "unknown or forged token")
    with store:
        fd = store.open_lock_file("guard.lock")
        try:
            fcntl.flock(fd, fcntl.LOCK_SH)
            verdict = _judge(store, claim)
            if not verdict.ok:
                raise NotHeld(verdict.ticket_id or "-", verdict.reason)
            yield verdict
        finally:
            os.close(fd)


@contextmanager
def _guarded_etcd(claim: _Claim, hold_seconds: float) -> Iterator[Verdict]:
    from singleflight.etcd import lock as etcd_lock
    from singleflight.etcd.client import Cluster

    assert claim.backend is not None and claim.ticket_id is not None
    cluster = Cluster(claim.backend)
    held = etcd_lock.hold_guard(cluster, claim.repo, claim.lock, claim.ticket_id, hold_seconds)
    if held is None:
        raise NotHeld(claim.ticket_id, "unknown token or lease expired")
    try:
        verdict = _judge_etcd(claim)
        if not verdict.ok:
            raise NotHeld(claim.ticket_id, verdict.reason)
        yield verdict
    finally:
        cluster.revoke(held[1])


def default_ledger(lock_dir: str | None = None) -> str:
    return os.path.join(resolve_lock_dir(lock_dir), "ledger.json")


def accept_fence(resource: str, fence: int, ledger: str | None = None, *, backend: str | None = None) -> int:
    """Accept ``fence`` for ``resource`` if it is >= the highest seen; record it durably.

    Returns the highest fence now recorded. Raises StaleFence otherwise.
    Callers are serialised by a flock beside the ledger, so a lower fence can
    never overwrite a higher one, whatever the interleaving.
    """
    if not resource or len(resource) > 512 or any(ord(c) < 32 for c in resource):
        raise BadValue("resource", resource, "must be 1 to 512 printable characters")
    fence = names.fence(fence)
    if backend and not ledger:
        from singleflight.etcd import lock as etcd_lock
        from singleflight.etcd.client import Cluster

        return etcd_lock.accept_fence(Cluster(backend), resource, fence)
    path = os.path.abspath(ledger) if ledger else default_ledger()
    parent, name = os.path.split(path)
    if ledger:
        try:
            d = Dir(os.open(parent, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC), parent)
        except FileNotFoundError:
            raise LockDirError(path, "the ledger's directory does not exist") from None
        except OSError as exc:
            raise LockDirError(path, exc.strerror or str(exc)) from None
    else:
        d = Dir.open_root(parent, create=True)
    with d:
        lock_fd = d.open(name + ".lock", os.O_RDWR | os.O_CREAT, 0o600)
        try:
            fcntl.flock(lock_fd, fcntl.LOCK_EX)
            data = d.read(name)
            try:
                table = json.loads(data) if data else {}
                if not isinstance(table, dict) or not all(isinstance(v, int) for v in table.values()):
                    raise ValueError("not an object of integers")
            except ValueError as exc:
                raise CorruptRecord(path, str(exc)) from None
            highest = int(table.get(resource, 0))
            if fence < highest:
                raise StaleFence(resource, fence, highest)
            if fence > highest:
                table[resource] = fence
                _fault.point("mid-ledger")
                d.write_atomic(name, json.dumps(table, sort_keys=True).encode(), durable=True)
            return fence
        finally:
            os.close(lock_fd)
