"""Few exceptions, each carrying data; ``str()`` is the one line the user sees."""

from __future__ import annotations

from singleflight.core.const import TYPE_CHECKING, ExitCode

if TYPE_CHECKING:
    from typing import Final

# An error line echoes at most this much of a bad value: it must stay one readable line.
_SHOWN_CHARS: Final = 64


def shown(value: object) -> object:
    """``value`` as a BadValue may echo it: long text cut short, a huge int by its size."""
    if isinstance(value, str) and len(value) > _SHOWN_CHARS:
        return value[:_SHOWN_CHARS] + "..."
    # repr() of an int above 4300 digits raises ValueError (CPython's int_max_str_digits).
    if isinstance(value, int) and value.bit_length() > _SHOWN_CHARS:
        return f"<{value.bit_length()}-bit integer>"
    return value


class PearingError(Exception):
    exit_code: ExitCode = ExitCode.SOFTWARE


class BadValue(PearingError, ValueError):
    """A flag, name, scope, uuid, number or path that breaks its rule."""

    exit_code = ExitCode.USAGE

    def __init__(self, what: str, value: object, rule: str) -> None:
        self.what, self.value, self.rule = what, value, rule
        super().__init__(f"bad {what} {value!r}: {rule}")


class UsageError(PearingError, ValueError):
    exit_code = ExitCode.USAGE


class LockDirError(PearingError):
    """The lock dir (or a file in it) cannot be created or written."""

    exit_code = ExitCode.CANTCREAT

    def __init__(self, path: str, detail: str) -> None:
        self.path = path
        super().__init__(f"{path}: {detail}")


class Vanished(LockDirError):
    """A directory inside the lock dir was removed while open (``pearing-cli prune`` took an idle
    lock's): nothing can be created in it. The lock's owners open the path again and retry."""

    def __init__(self, path: str) -> None:
        super().__init__(path, "removed meanwhile (pruned as idle); run again")


class NotPermitted(PearingError):
    """A hostile or mis-permissioned lock dir, or a symlink planted in it."""

    exit_code = ExitCode.NOPERM

    def __init__(self, path: str, detail: str) -> None:
        self.path = path
        super().__init__(f"{path}: {detail}")


class CorruptRecord(PearingError):
    exit_code = ExitCode.IOERR

    def __init__(self, path: str, detail: str) -> None:
        self.path = path
        super().__init__(f"corrupt record {path}: {detail} (fix or remove it by hand; it is never reset)")


class NotHeld(PearingError):
    """Heartbeat, release or verify of a ticket whose owner must stop."""

    exit_code = ExitCode.REFUSED

    def __init__(self, ticket_id: str, reason: str) -> None:
        self.ticket_id, self.reason = ticket_id, reason
        super().__init__(f"ticket {ticket_id}: {reason}")


class UnknownTicket(NotHeld):
    def __init__(self, ticket_id: str) -> None:
        super().__init__(ticket_id, "unknown ticket")


class UnknownLock(NotHeld):
    """A ticket looked up in a lock that does not exist in the scope (no record of it at all)."""

    def __init__(self, repo: str, lock: str, ticket_id: str = "-") -> None:
        self.repo, self.lock = repo, lock
        super().__init__(ticket_id, f"unknown ticket: no lock {lock!r} in scope {repo!r}")


class LineFull(PearingError):
    """--max-waiting: the line already holds as many waiters as this arrival allows; it is turned
    away at once (busy), never queued."""

    exit_code = ExitCode.BUSY

    def __init__(self, waiting: int, bound: int) -> None:
        self.waiting, self.bound = waiting, bound
        super().__init__(f"line full: {waiting} waiting, at most {bound} may wait")


class SlotsMismatch(UsageError):
    """A run whose --slots is not what the lock's live tickets use: the lock has one number of
    slots at a time, or "at most N at once" would mean nothing."""

    def __init__(self, asked: int, live: int) -> None:
        self.asked, self.live = asked, live
        super().__init__(f"slots {asked} differs from the {live} slot(s) the lock's live tickets use")


class StaleFence(PearingError):
    exit_code = ExitCode.REFUSED

    def __init__(self, resource: str, fence: int, highest: int) -> None:
        self.resource, self.fence, self.highest = resource, fence, highest
        super().__init__(f"stale fence {fence} < {highest} for {resource!r}")


class BackendUnavailable(PearingError):
    """No member of the distributed backend answered: the lease cannot be proven."""

    exit_code = ExitCode.BUSY

    def __init__(self, url: str, detail: str) -> None:
        self.url = url
        super().__init__(f"backend {url} unreachable: {detail}")


class Refused(PearingError):
    """A side effect refused before anything was done, for a reason the user must act on."""

    exit_code = ExitCode.REFUSED

    def __init__(self, reason: str) -> None:
        self.reason = reason
        super().__init__(reason)


class StaleRefFence(Refused):
    """A fenced git push under a lower fence than the one the remote's fence ref holds."""

    def __init__(self, ref: str, fence: int, highest: int) -> None:
        self.ref, self.fence, self.highest = ref, fence, highest
        super().__init__(f"stale fence {fence} < {highest}")


class CorruptFenceRef(PearingError):
    """A fence ref on a remote that does not hold a fence commit: never overwritten."""

    exit_code = ExitCode.IOERR

    def __init__(self, remote: str, ref: str, detail: str) -> None:
        self.remote, self.ref = remote, ref
        super().__init__(f"corrupt fence ref {ref} on {remote}: {detail} (fix or remove it by hand; it is never reset)")


class FenceContended(PearingError):
    """Every try of a fenced write lost the race for the target's fence to another writer (a push
    for the fence ref, a reply for its thread's fence): nothing written, try again later (75)."""

    exit_code = ExitCode.BUSY

    def __init__(self, target: str, tries: int, *, done: str = "nothing written") -> None:
        self.target, self.tries = target, tries
        super().__init__(f"{target} moved under each of {tries} tries; {done}")


class ToolNotFound(PearingError):
    exit_code = ExitCode.NOTFOUND

    def __init__(self, tool: str) -> None:
        self.tool = tool
        super().__init__(f"{tool} not found on PATH")


class ToolFailed(PearingError):
    """An external tool (git) failed on its own: its status and output are passed on unchanged,
    so the front end writes ``stderr`` as it is and exits ``status``, never this class's code."""

    def __init__(self, argv: list[str], status: int, stdout: bytes, stderr: bytes) -> None:
        self.argv, self.status, self.stdout, self.stderr = argv, status, stdout, stderr
        super().__init__(f"{argv[0]} exited {status}")
