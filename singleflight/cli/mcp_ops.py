"""pearing-mcp's tools' work, without the SDK: each checks its arguments as pearing-cli does
(``core.names``, the MCP spelling of each parameter) and calls one function of ``ops``."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, TypeVar

from singleflight import guard, ops
from singleflight.backend import Opened
from singleflight.cli import mcp_errors
from singleflight.core import names
from singleflight.core.const import ENV_LOCK_DIR, ExitCode
from singleflight.core.errors import PearingError, UsageError

_T = TypeVar("_T")


class Ended(PearingError):
    """acquire_lock for a request whose ticket has already ended: its owner must stop."""

    exit_code = ExitCode.REFUSED


class Ops:
    """The tools' work, without the SDK: validate like pearing-cli, call the backend.

    Every method blocks (acquire for up to ``wait_seconds``) and raises
    ``PearingError`` with the one line the caller sees.
    """

    def __init__(self, lock_dir: str, ident: str, url: str | None = None) -> None:
        self.lock_dir, self.identity, self.backend_url = lock_dir, ident, url

    def _call(self, work: Callable[[Opened], _T]) -> _T:
        # One backend per call: a server lives for days, so every fd is closed at once.
        b = Opened(self.backend_url, self.lock_dir)
        try:
            return work(b)
        finally:
            b.close()

    def check(self) -> None:
        """Open (and create) the lock dir now: a bad one is an exit code, not an error on every call."""
        self._call(lambda b: None)

    def acquire(
        self,
        repo: str,
        lock_name: str,
        request_uuid: str,
        lease_seconds: float,
        wait_seconds: float,
        *,
        max_waiting: int | None = None,
        slots: int = 1,
        stopped: Callable[[], bool] | None = None,
    ) -> dict[str, Any]:
        """``stopped``: the call was cancelled (its client gone): stop waiting at once."""
        lock, scope = names.lock_name(lock_name, "lock_name"), names.scope(repo, "repo")
        uuid = names.request_uuid(request_uuid, "request_uuid")
        lease = names.lease_seconds(lease_seconds, "lease_seconds")
        wait = names.seconds(wait_seconds, "wait_seconds")
        bound = None if max_waiting is None else names.max_waiting(max_waiting, "max_waiting")
        n = names.slots(slots, "slots")
        out, _ = self._call(
            lambda b: ops.acquire(
                b,
                lock,
                scope,
                request_uuid=uuid,
                lease_seconds=lease,
                wait_seconds=wait,
                identity=self.identity,
                # A waiting ticket answers to this server, and so to its client: when the client
                # goes (stdin closed, the server exits) or the server dies, its agent leaves the
                # line. Once held, the ticket is the client's, kept by its heartbeats.
                control=ops.CONTROL_WAIT,
                max_waiting=bound,
                slots=n,
                stopped=stopped,
            )
        )
        if out.code == ExitCode.REFUSED:
            raise Ended(out.reason or f"ticket {out.ticket['ticket_id']}: {out.ticket['state']}")
        # Held (0) or still waiting in its FIFO place (75): the ticket's state says which.
        return out.ticket

    def get(self, repo: str, lock_name: str, ticket_id: str) -> dict[str, Any]:
        lock, scope = names.lock_name(lock_name, "lock_name"), names.scope(repo, "repo")
        return self._call(lambda b: ops.get(b, lock, scope, ticket_id))

    def heartbeat(self, repo: str, lock_name: str, ticket_id: str, lease_seconds: float) -> dict[str, Any]:
        lock, scope = names.lock_name(lock_name, "lock_name"), names.scope(repo, "repo")
        lease = names.lease_seconds(lease_seconds, "lease_seconds")
        return self._call(lambda b: ops.heartbeat(b, lock, scope, ticket_id, lease))

    def release(self, repo: str, lock_name: str, ticket_id: str) -> dict[str, Any]:
        lock, scope = names.lock_name(lock_name, "lock_name"), names.scope(repo, "repo")
        return self._call(lambda b: ops.release(b, lock, scope, ticket_id))

    def update_activity(self, activity: str | None, clear: bool) -> dict[str, Any]:
        if (activity is None) == (not clear):
            raise UsageError("give exactly one of activity (the text) or clear=true")
        if activity is not None:
            names.activity(activity, "activity")
        return self._call(lambda b: ops.update_activity(b, self.identity, activity))

    def status(self, repo: str, lock_name: str | None) -> list[dict[str, Any]]:
        scope = names.scope(repo, "repo")
        lock = None if lock_name is None else names.lock_name(lock_name, "lock_name")
        return self._call(lambda b: ops.status(b, scope, lock))

    def verify(self, token_file: str) -> dict[str, Any]:
        mcp_errors.token_file(token_file)
        # Only the path given counts: never a token from the server's own environment.
        return guard.verify(token_file, env={ENV_LOCK_DIR: self.lock_dir}).as_dict()
