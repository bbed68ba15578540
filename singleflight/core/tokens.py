"""The run's secret: minted here, stored only as a hash, kept in the clear only in its
holder's 0600 token file; and what a guard reads back from that file or the environment.

    LOCK_DIR/locks/SCOPE.../@LOCK/tokens/TICKET.token     on either backend: the token
                                                          never leaves the acquiring host
"""

from __future__ import annotations

import os
import stat

from singleflight.core import jsontext, names, schemes
from singleflight.core.const import (
    DEFAULT_SCOPE,
    ENV_BACKEND,
    ENV_LOCK,
    ENV_LOCK_DIR,
    ENV_REPO,
    ENV_TICKET,
    ENV_TOKEN,
    ENV_TOKEN_FILE,
    TYPE_CHECKING,
)
from singleflight.core.errors import BadValue, LockDirError, UsageError, Vanished
from singleflight.core.fs import Dir, lock_parts, resolve_lock_dir
from singleflight.core.record import loads, rfc3339
from singleflight.core.ticket import Ticket

if TYPE_CHECKING:
    from collections.abc import Callable, Mapping
    from typing import Any

# A token file is a few hundred bytes; anything larger is not ours.
_MAX_TOKEN_FILE = 65536


def mint_token() -> str:
    """The run's secret: 256 random bits from the kernel, as 64 hex digits. Only its holder
    learns it. (``secrets.token_hex(32)`` is this, after importing ``random``, ``base64``,
    ``hmac`` and OpenSSL: ~10 ms the holder spent before COMMAND could start.)"""
    return os.urandom(32).hex()


def token_hash(token: str) -> str:
    """The token's SHA-256, as stored in its ticket. CPython's own SHA-256 imports in well under
    a millisecond; hashlib loads OpenSSL (libcrypto), which every holder and guard paid before
    COMMAND or the guarded write could start. Same digest either way (tests check it)."""
    try:
        from _sha256 import sha256  # type: ignore[import-not-found,unused-ignore]  # CPython <= 3.11
    except ImportError:
        try:
            from _sha2 import sha256  # type: ignore[import-not-found,no-redef,unused-ignore]  # >= 3.12
        except ImportError:
            from hashlib import sha256  # type: ignore[assignment,unused-ignore]
    return str(sha256(token.encode()).hexdigest())


def same_secret(a: str, b: str) -> bool:
    """``a == b`` in time that does not depend on where they differ (a forger learns nothing
    from timing). ``hmac.compare_digest`` is this function; importing ``hmac`` loads OpenSSL."""
    try:
        from _operator import _compare_digest  # type: ignore[attr-defined,unused-ignore]
    except ImportError:
        from hmac import compare_digest as _compare_digest  # type: ignore[no-redef,unused-ignore]
    return bool(_compare_digest(a.encode(), b.encode()))


class TokenFiles:
    """The token files of one (repo, lock), in the lock's directory on this host.

    On every backend they live in the local lock dir (the token never leaves the acquiring
    host), so whoever ends a ticket on this host removes its file through this, not the store.
    """

    def __init__(self, lock_dir: str, lock_root: Dir | None, parts: list[str] | None = None) -> None:
        self.lock_dir, self.root, self._parts = lock_dir, lock_root, parts
        self._dir: Dir | None = None
        self._opened_root = False

    @classmethod
    def at(cls, lock_dir: str, repo: str, lock: str) -> TokenFiles:
        """The token files of (repo, lock) in ``lock_dir``; its directories are opened at first use."""
        return cls(lock_dir, None, lock_parts(repo, lock))

    def _root(self, *, create: bool) -> Dir | None:
        if self.root is None:
            assert self._parts is not None
            try:
                top = Dir.open_root(self.lock_dir, create=create)
            except LockDirError:
                if create:
                    raise
                return None  # no lock dir: no token files
            try:
                self.root = top.walk(self._parts, create=create)
            except FileNotFoundError:
                return None
            finally:
                top.close()
            self._opened_root = True
        return self.root

    def _tokens(self, *, create: bool = True) -> Dir | None:
        if self._dir is None:
            root = self._root(create=create)
            if root is None:
                return None
            try:
                self._dir = root.sub("tokens", create=create)
            except FileNotFoundError:
                return None
        return self._dir

    def ready(self) -> None:
        """Open the directories now, not in the middle of a hand-over that must not wait on them."""
        self._tokens(create=False)

    def path(self, ticket_id: str) -> str:
        if self.root is not None:
            return self.root.child_path(f"tokens/{ticket_id}.token")
        assert self._parts is not None
        return os.path.join(os.path.abspath(self.lock_dir), *self._parts, "tokens", f"{ticket_id}.token")

    def exists(self, ticket_id: str) -> bool:
        d = self._tokens(create=False)
        return d is not None and d.lstat(f"{ticket_id}.token") is not None

    def write(self, ticket: Ticket, token: str, **extra: str) -> str:
        body: dict[str, Any] = {
            "lock": ticket.lock_name,
            "repo": ticket.repo,
            "ticket": ticket.ticket_id,
            "fence": ticket.fence,
            "token": token,
            "lease_expires_at": rfc3339(ticket.lease_expires_at),
            "lock_dir": self.lock_dir,
            **extra,
        }
        for again in (False, True):
            d = self._tokens()
            assert d is not None
            try:
                d.write_atomic(f"{ticket.ticket_id}.token", jsontext.dumps(body).encode(), durable=False)
                break
            except Vanished:
                # Pruned as idle on this host (another backend's lock of the same name) between our
                # open and our write: the path, made afresh. A store's own dir is never taken so.
                if again or self._parts is None:
                    raise
                self.close()  # ours (``at``): the root goes too, and is walked to again
        return self.path(ticket.ticket_id)

    def remove(self, ticket_id: str) -> None:
        d = self._tokens(create=False)
        if d is not None:
            d.unlink(f"{ticket_id}.token")

    def close(self) -> None:
        if self._dir is not None:
            self._dir.close()
            self._dir = None
        if self._opened_root and self.root is not None:
            self.root.close()
            self.root, self._opened_root = None, False


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


class Facts:
    """What a backend knows, in one read, of the ticket a token claims.

    ``ticket``: as it stands (on etcd its state from its place in line: the first is held),
    or None when the store has no record of it. ``fence_now``: the highest fence issued for
    the lock so far; a higher one than the ticket's means a later holder superseded it.
    ``holder_alive``: False only when its holder is known to be dead (it runs on this host).
    ``cut_off``: asked last, of a ticket otherwise live (it may cost a round trip): can its
    holder not reach the store for long enough to keep its lease?
    """

    __slots__ = ("cut_off", "fence_now", "holder_alive", "ticket")

    def __init__(
        self,
        ticket: Ticket | None,
        *,
        fence_now: int | None = None,
        holder_alive: bool = True,
        cut_off: Callable[[], bool] | None = None,
    ) -> None:
        self.ticket, self.fence_now, self.holder_alive, self.cut_off = ticket, fence_now, holder_alive, cut_off


class Claim:
    """A token and what it claims to hold: where a guard looks it up."""

    __slots__ = ("backend", "lock", "lock_dir", "repo", "ticket_id", "token")

    def __init__(
        self, lock: str, repo: str, ticket_id: str | None, token: str, *, lock_dir: str, backend: str | None
    ) -> None:
        self.lock, self.repo, self.ticket_id, self.token, self.lock_dir = lock, repo, ticket_id, token, lock_dir
        self.backend = backend

    def of_ticket(self, ticket_id: str) -> Claim:
        return Claim(self.lock, self.repo, ticket_id, self.token, lock_dir=self.lock_dir, backend=self.backend)

    def refuse(self, reason: str, *, ticket_id: str | None = None, fence: int | None = None) -> Verdict:
        tid = ticket_id if ticket_id is not None else self.ticket_id or ""
        return Verdict(False, reason, lock=self.lock, repo=self.repo, ticket_id=tid, fence=fence)

    def live(self, fence: int | None, *, ticket_id: str | None = None) -> Verdict:
        tid = ticket_id if ticket_id is not None else self.ticket_id or ""
        return Verdict(True, "live", lock=self.lock, repo=self.repo, ticket_id=tid, fence=fence)


def _read_token_file(path: str) -> bytes | Verdict:
    # O_NONBLOCK: a FIFO planted at the path must not hang the guard in open();
    # O_NOFOLLOW: nor may a symlink point it elsewhere.
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC | os.O_NONBLOCK | os.O_NOCTTY)
    except FileNotFoundError:
        return Verdict(False, f"token file {path} is gone: its run has ended")
    except OSError as exc:
        return Verdict(False, f"token file {path}: {exc.strerror}")
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            return Verdict(False, f"token file {path} is not a regular file")
        return os.read(fd, _MAX_TOKEN_FILE + 1)
    finally:
        os.close(fd)


def read_claim(token_file: str | None, env: Mapping[str, str]) -> Claim | Verdict:
    """Where the token comes from: --token-file, PEARING_TOKEN_FILE, or PEARING_TOKEN + lock + repo.

    A Verdict when that source already says no (a token file that is gone or not ours).
    """
    path = token_file or env.get(ENV_TOKEN_FILE)
    if path:
        data = _read_token_file(path)
        if isinstance(data, Verdict):
            return data
        try:
            if len(data) > _MAX_TOKEN_FILE:
                raise ValueError("too large")
            obj = loads(data)
            backend = obj.get("backend")
            if backend and (not isinstance(backend, str) or schemes.scheme_of(backend) is None):
                raise ValueError("backend is not a backend url")
            lock_dir = obj.get("lock_dir")
            if lock_dir is not None and (
                not isinstance(lock_dir, str) or not os.path.isabs(lock_dir) or "\0" in lock_dir
            ):
                raise ValueError("lock_dir is not an absolute path")
            return Claim(
                names.lock_name(str(obj["lock"])),
                names.scope(str(obj["repo"])),
                names.ticket_id(str(obj["ticket"])),
                str(obj["token"]),
                lock_dir=lock_dir or resolve_lock_dir(env.get(ENV_LOCK_DIR)),
                backend=str(backend) if backend else None,
            )
        except (ValueError, KeyError, TypeError, AttributeError, BadValue):
            return Verdict(False, f"token file {path} is not a pearing token file")
    token, lock = env.get(ENV_TOKEN), env.get(ENV_LOCK)
    if not token or not lock:
        raise UsageError("no token: give --token-file, or set PEARING_TOKEN_FILE, or PEARING_TOKEN and PEARING_LOCK")
    ticket = env.get(ENV_TICKET)
    return Claim(
        names.lock_name(lock, "PEARING_LOCK"),
        names.scope(env.get(ENV_REPO) or DEFAULT_SCOPE),
        names.ticket_id(ticket) if ticket else None,
        token,
        lock_dir=resolve_lock_dir(env.get(ENV_LOCK_DIR) or None),
        backend=env.get(ENV_BACKEND) or None,
    )
