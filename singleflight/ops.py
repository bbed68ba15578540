"""The seed's lock commands over any backend: what pearing-cli, pearing-mcp and ``Lock`` call.

``acquire`` records a waiting ticket and starts its agent (``singleflight.agent``,
the runner without a COMMAND), which takes the lock through the same acquire
path as pearing-run and keeps it after this call returns.
"""

from __future__ import annotations

import contextlib
import math
import os
import subprocess
import sys
import time
from typing import TYPE_CHECKING, Any

from singleflight.core import names, proc, protocol
from singleflight.core.const import HELD, QUEUE_FIFO, WAITING, ExitCode
from singleflight.core.errors import NotHeld, PearingError, UnknownTicket
from singleflight.core.protocol import Channel
from singleflight.core.record import new_uuid4
from singleflight.core.ticket import Ticket
from singleflight.rules import tickets

if TYPE_CHECKING:
    from singleflight.backend import Backend, LockOps

# How long acquire-lock waits for its agent to start and report, beyond --wait-seconds.
_AGENT_START_SECONDS = 15.0


class Outcome:
    """A ticket to print and the exit code that goes with it."""

    __slots__ = ("code", "reason", "ticket")

    def __init__(self, ticket: dict[str, Any], code: ExitCode = ExitCode.OK, reason: str | None = None) -> None:
        self.ticket, self.code, self.reason = ticket, code, reason


class AgentFailed(PearingError):
    """The agent reported an error (a corrupt record, a planted symlink): its line and code."""

    def __init__(self, code: ExitCode, message: str) -> None:
        super().__init__(message)
        self.exit_code = code


def _outcome(backend: Backend, lk: LockOps, t: Ticket) -> Outcome:
    view = tickets.view(backend, lk, t)
    if view["state"] == HELD:
        return Outcome(view)
    if view["state"] == WAITING:
        return Outcome(view, ExitCode.BUSY, "still waiting in line")
    if t.superseded_by:  # a newer `latest` request replaced it: busy, as pearing-run exits
        return Outcome(view, ExitCode.BUSY, f"ticket {t.ticket_id}: {t.describe_end()}")
    return Outcome(view, ExitCode.REFUSED, f"ticket {t.ticket_id}: {t.describe_end()}")


def acquire(
    backend: Backend,
    lock: str,
    repo: str,
    *,
    request_uuid: str,
    lease_seconds: float,
    wait_seconds: float,
    identity: str,
    control: str | None = None,
    queue_mode: str = QUEUE_FIFO,
    cancel_in_progress: bool = False,
) -> tuple[Outcome, Channel | None]:
    """Take the lock or queue for it; one ticket per request uuid.

    ``control`` (``auto`` / ``manual``, for ``Lock``) keeps a channel to the agent
    open and returns it; the caller then tells the agent when its block starts.
    """
    request_uuid = names.request_uuid(request_uuid)
    lk = backend.lock(names.scope(repo), names.lock_name(lock))
    try:
        mine = Ticket(
            ticket_id=new_uuid4(),
            request_uuid=request_uuid,
            lock_name=lk.lock,
            repo=lk.repo,
            identity=identity,
            state=WAITING,
            lease_seconds=lease_seconds,
            # Who answers for the ticket until its agent adopts it: with its start time, or
            # it reads as dead and housekeeping cancels it (a back-to-back acquire lost its turn).
            holder_pid=os.getpid(),
            holder_start=proc.start_time(os.getpid()),
            queue_mode=queue_mode,
            cancel_in_progress=cancel_in_progress,
            kill_grace=0.0,
        )
        t = lk.create(mine)
        if t.ticket_id != mine.ticket_id:
            return _existing(backend, lk, t, lease_seconds, wait_seconds), None
        return _start_agent(backend, lk, t, wait_seconds, control)
    finally:
        lk.close()


def _existing(backend: Backend, lk: LockOps, t: Ticket, lease_seconds: float, wait_seconds: float) -> Outcome:
    """Same request uuid again: never a second ticket, never behind itself; renews a waiting one."""
    if t.state == WAITING:
        # It may have ended (or be just being promoted): reported below as it stands.
        until = time.monotonic() + wait_seconds
        while True:
            with contextlib.suppress(NotHeld):
                t = lk.renew(t.ticket_id, lease_seconds)
            # The whole wait, whatever the lease: its owner is here, heartbeating it.
            lk.await_turn(t.ticket_id, max(0.0, min(until - time.monotonic(), _beat(lease_seconds))))
            cur = lk.read(t.ticket_id)
            if cur is None or cur.state != WAITING or time.monotonic() >= until:
                break
    return _outcome(backend, lk, lk.read(t.ticket_id) or t)


def _beat(lease_seconds: float) -> float:
    """How often an owner waiting in acquire-lock heartbeats its waiting ticket."""
    return max(lease_seconds / 3.0, 0.1)


def _start_agent(
    backend: Backend, lk: LockOps, t: Ticket, wait_seconds: float, control: str | None
) -> tuple[Outcome, Channel | None]:
    r, w = os.pipe()
    fds = [w]
    argv = [sys.executable, "-m", "singleflight.agent", backend.url, backend.lock_dir, t.repo, t.lock_name]
    argv += [t.ticket_id, str(w)]
    ctl_r = ctl_w = -1
    if control is not None:
        ctl_r, ctl_w = os.pipe()
        fds.append(ctl_r)
        argv += [str(ctl_r), control]
    proc = subprocess.Popen(
        argv,
        stdin=subprocess.DEVNULL,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        pass_fds=fds,
        start_new_session=True,
    )
    for fd in fds:
        os.close(fd)
    proc.wait()  # the agent daemonises at once; its child keeps the pipes
    chan = Channel(r, ctl_w)
    deadline = time.monotonic() + _AGENT_START_SECONDS
    last = None
    beat = math.inf
    try:
        while True:
            msg = chan.recv_until(min(deadline, beat))
            if msg is None and not chan.eof and time.monotonic() < deadline:
                # Waiting in line: the whole wait, whatever the lease (its owner is here).
                with contextlib.suppress(NotHeld):
                    lk.renew(t.ticket_id, t.lease_seconds)
                beat = time.monotonic() + _beat(t.lease_seconds)
                continue
            if msg is None:
                break
            if msg.kind == protocol.ERROR:
                cur = lk.read(t.ticket_id) or t
                if cur.live:
                    tickets.end_orphan(lk, cur)
                raise AgentFailed(msg.code, msg.text)
            last = msg.kind
            if msg.kind == protocol.QUEUED:
                deadline = time.monotonic() + wait_seconds
                beat = time.monotonic() + _beat(t.lease_seconds)
                continue
            break
    except BaseException:
        chan.close()
        raise
    cur = lk.read(t.ticket_id) or t
    if last is None and chan.eof and cur.live:
        cur = tickets.end_orphan(lk, cur)  # every write end closed: the agent died without a word
    out = _outcome(backend, lk, cur)
    if control is not None and last == protocol.READY:
        return out, chan
    chan.close()
    return out, None


def get(backend: Backend, lock: str, repo: str, ticket_id: str) -> dict[str, Any]:
    ticket_id = names.ticket_id(ticket_id)
    lk = backend.lock(names.scope(repo), names.lock_name(lock), create=False)
    try:
        t = lk.read(ticket_id)
        if t is None:
            raise UnknownTicket(ticket_id)
        return tickets.view(backend, lk, t)
    finally:
        lk.close()


def heartbeat(backend: Backend, lock: str, repo: str, ticket_id: str, lease_seconds: float) -> dict[str, Any]:
    ticket_id = names.ticket_id(ticket_id)
    lk = backend.lock(names.scope(repo), names.lock_name(lock), create=False)
    try:
        return tickets.view(backend, lk, lk.renew(ticket_id, lease_seconds))
    finally:
        lk.close()


def release(backend: Backend, lock: str, repo: str, ticket_id: str) -> dict[str, Any]:
    """Release (held) or cancel (waiting). Idempotent; a lost lease is an error."""
    ticket_id = names.ticket_id(ticket_id)
    lk = backend.lock(names.scope(repo), names.lock_name(lock), create=False)
    try:
        return tickets.view(backend, lk, tickets.release(lk, ticket_id))
    finally:
        lk.close()


def update_activity(backend: Backend, identity: str, activity: str | None) -> dict[str, Any]:
    """Set (text) or clear (None) what ``identity`` is doing; every front end's text is checked here."""
    if activity is not None:
        names.activity(activity)
    backend.update_activity(names.identity(identity), activity)
    return {"identity": identity, "activity": activity}


def status(backend: Backend, repo: str, lock: str | None) -> list[dict[str, Any]]:
    return tickets.statuses(backend, names.scope(repo), None if lock is None else names.lock_name(lock))
