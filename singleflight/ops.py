"""The seed's lock commands over any backend: what pearing-cli, pearing-mcp and ``Lock`` call.

``acquire`` records a waiting ticket and starts its agent (``singleflight.agent``,
the runner without a COMMAND), which takes the lock through the same acquire
path as pearing-run and keeps it after this call returns.

An owner that answers for its ticket (``Lock``, pearing-mcp: ``control``) keeps a
channel to the agent open while this process lives, and only here: a forked child
closes its copies at once, so the agent reads the channel's EOF as this process gone.
"""

from __future__ import annotations

import contextlib
import math
import os
import select
import sys
import threading
import time
import weakref
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, Final

from singleflight.core import fault, names, proc, protocol
from singleflight.core.const import HELD, PLACE_TTL, QUEUE_FIFO, WAITING, ExitCode
from singleflight.core.errors import NotHeld, PearingError, UnknownTicket
from singleflight.core.protocol import Channel
from singleflight.core.record import new_uuid4
from singleflight.core.ticket import Ticket
from singleflight.rules import records, tickets

if TYPE_CHECKING:
    from singleflight.backend import LockOps, Opened

# How long acquire-lock waits for its agent to start and report, beyond --wait-seconds.
_AGENT_START_SECONDS = 15.0
# ``control`` for an owner that answers for its ticket only while it waits (pearing-mcp:
# once held, the ticket is its client's); the agent's start message says it (singleflight.agent).
CONTROL_WAIT: Final = "wait"
# How often a wait that may be stopped (``stopped``) looks whether it was.
_STOP_POLL = 0.2

# Every control channel this process holds: a forked child closes its copies (below).
_channels: weakref.WeakSet[Channel] = weakref.WeakSet()
# Tickets still waiting after the call that made them returned (the wait ran out): their
# channel stays open while this process lives, so its agent leaves the line when this
# process goes, and a retry of the same request here picks the channel up again.
_kept: dict[str, Channel] = {}
_kept_mutex = threading.Lock()


def _in_child() -> None:
    """After fork, in the child: the channels are the parent's. Kept open here, the parent's
    death would go unseen while the child lives; written to, the child would speak for it."""
    global _kept_mutex
    for chan in list(_channels):
        chan.close()
    _channels.clear()
    _kept.clear()
    _kept_mutex = threading.Lock()  # another thread may have held it at the fork


os.register_at_fork(after_in_child=_in_child)


class Outcome:
    """A ticket to print and the exit code that goes with it.

    ``why``: how the ticket ended (or that it still waits), without its id; ``reason``: the
    line a front end prints, naming the ticket once (``NotHeld`` names it itself from ``why``).
    """

    __slots__ = ("code", "ticket", "why")

    def __init__(self, ticket: dict[str, Any], code: ExitCode = ExitCode.OK, why: str | None = None) -> None:
        self.ticket, self.code, self.why = ticket, code, why

    @property
    def reason(self) -> str | None:
        if self.why is None or (self.code == ExitCode.BUSY and self.ticket.get("state") == WAITING):
            return self.why
        return f"ticket {self.ticket['ticket_id']}: {self.why}"


class AgentFailed(PearingError):
    """The agent reported an error (a corrupt record, a planted symlink): its line and code."""

    def __init__(self, code: ExitCode, message: str) -> None:
        super().__init__(message)
        self.exit_code = code


def _outcome(at: Opened, lk: LockOps, t: Ticket) -> Outcome:
    view = tickets.view(at, lk, t)
    if view["state"] == HELD:
        return Outcome(view)
    if view["state"] == WAITING:
        return Outcome(view, ExitCode.BUSY, "still waiting in line")
    if t.superseded_by or t.turned_away:  # replaced by a newer `latest` request, or the line
        return Outcome(view, ExitCode.BUSY, t.describe_end())  # was full: busy, as pearing-run exits
    return Outcome(view, ExitCode.REFUSED, t.describe_end())


def acquire(
    at: Opened,
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
    max_waiting: int | None = None,
    slots: int = 1,
    stopped: Callable[[], bool] | None = None,
) -> tuple[Outcome, Channel | None]:
    """Take the lock or queue for it; one ticket per request uuid.

    ``control`` makes this process the ticket's owner while it lives. ``auto`` / ``manual``
    (``Lock``) returns the channel once held; the caller then tells the agent when its block
    starts and ends. ``CONTROL_WAIT`` (pearing-mcp) answers only while the ticket waits. A
    ticket still waiting when the call returns stays this process's (see ``_kept``).
    ``stopped`` ends the wait early when it turns true (the ticket keeps waiting).
    ``max_waiting``: busy at once, the ticket cancelled (line full), when that many wait already.
    ``slots``: how many may hold the lock at once (every live ticket of the lock says the same).
    """
    request_uuid = names.request_uuid(request_uuid)
    lk = at.backend.lock(names.scope(repo), names.lock_name(lock))
    try:
        mine = Ticket(
            ticket_id=new_uuid4(),
            request_uuid=request_uuid,
            lock_name=lock,
            repo=repo,
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
            max_waiting=None if max_waiting is None else names.max_waiting(max_waiting, "max_waiting"),
            slots=names.slots(slots, "slots"),
        )
        _prune()
        t = lk.create(mine)
        if t.ticket_id != mine.ticket_id:
            with _kept_mutex:
                chan = _kept.pop(t.ticket_id, None)
            if chan is not None:  # ours, still waiting or promoted meanwhile: resume on its channel
                with contextlib.suppress(NotHeld):
                    t = tickets.heartbeat(lk, t.ticket_id, lease_seconds)  # a retry renews like a heartbeat
                heard = (protocol.QUEUED, wait_seconds)
                return _follow(at, lk, t, chan, heard=heard, control=control, stopped=stopped)
            return _existing(at, lk, t, lease_seconds, wait_seconds, stopped=stopped), None
        return _start_agent(at, lk, t, wait_seconds=wait_seconds, control=control, stopped=stopped)
    finally:
        lk.close()


def _existing(
    at: Opened,
    lk: LockOps,
    t: Ticket,
    lease_seconds: float,
    wait_seconds: float,
    *,
    stopped: Callable[[], bool] | None = None,
) -> Outcome:
    """Same request uuid again: never a second ticket, never behind itself; renews a waiting one."""
    if t.state == WAITING:
        # It may have ended (or be just being promoted): reported below as it stands.
        until = (begun := time.monotonic()) + wait_seconds
        while True:
            with contextlib.suppress(NotHeld):
                t = tickets.heartbeat(lk, t.ticket_id, lease_seconds)
            # The whole wait, whatever the lease: its owner is here, heartbeating it.
            step = min(until - time.monotonic(), _beat(lease_seconds), math.inf if stopped is None else _STOP_POLL)
            tickets.await_turn(lk, t.ticket_id, max(0.0, step), since=begun)
            cur = lk.read(t.ticket_id)
            if cur is None or cur.state != WAITING or time.monotonic() >= until or (stopped and stopped()):
                break
    return _outcome(at, lk, lk.read(t.ticket_id) or t)


def _beat(lease_seconds: float, queued: bool = True) -> float:
    """How often an owner heartbeats its waiting ticket; until its agent queued, often enough to keep its place."""
    return max(lease_seconds / 3.0, 0.1) if queued else min(max(lease_seconds / 3.0, 0.1), PLACE_TTL / 3.0)


def _start_agent(
    at: Opened,
    lk: LockOps,
    t: Ticket,
    *,
    wait_seconds: float,
    control: str | None,
    stopped: Callable[[], bool] | None,
) -> tuple[Outcome, Channel | None]:
    r, w = os.pipe()
    fds = [w]
    ctl_r = ctl_w = -1
    if control is not None:
        ctl_r, ctl_w = os.pipe()
        fds.append(ctl_r)
    start = protocol.AgentStart(
        backend=at.url,
        lock_dir=at.lock_dir,
        repo=t.repo,
        lock=t.lock_name,
        ticket=t.ticket_id,
        report_fd=w,
        control_fd=ctl_r,
        mode=control,
    )
    # The start message goes on the agent's stdin, not argv, which any user can read (a URL may
    # carry a password); written whole before the spawn (a pipe holds 64 KiB), read to EOF.
    msg_r, msg_w = os.pipe()
    fds.append(msg_r)
    to_agent = Channel(-1, msg_w)
    to_agent.send(start.message())  # a fresh pipe with room: it cannot fail for the reader
    to_agent.close_write()
    fault.pause("pause-agent-spawn")  # its ticket made and seen, its agent not started yet
    import subprocess  # here: heartbeat, status and release never start an agent (~8 ms with threading's kin)

    chan = Channel(r, ctl_w)
    _channels.add(chan)
    try:
        proc = subprocess.Popen(
            [sys.executable, "-m", "singleflight.agent"],
            stdin=msg_r,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
            pass_fds=fds,
            start_new_session=True,
        )
    except BaseException:
        chan.close()
        raise
    finally:
        for fd in fds:
            os.close(fd)
    # The agent daemonises as soon as its interpreter is up, and its child keeps the pipes. Its
    # first process is reaped after the follow, not before it: a busy machine may take seconds
    # to start Python, and the waiting ticket is heartbeat meanwhile (its lease may be short).
    try:
        return _follow(at, lk, t, chan, heard=(None, wait_seconds), control=control, stopped=stopped)
    finally:
        proc.wait()


def _follow(
    at: Opened,
    lk: LockOps,
    t: Ticket,
    chan: Channel,
    *,
    heard: tuple[str | None, float],
    control: str | None,
    stopped: Callable[[], bool] | None,
) -> tuple[Outcome, Channel | None]:
    """Hear the agent out: until it holds, the ticket ends, or the wait runs out (``heard``:
    the last message it sent, and the wait left once it has queued)."""
    last, wait_seconds = heard
    deadline = time.monotonic() + (wait_seconds if last == protocol.QUEUED else _AGENT_START_SECONDS)
    # The owner heartbeats its waiting ticket from the start, not from the agent's ``queued``:
    # a busy machine may start the agent after a short lease or place has run out.
    beat = time.monotonic() + _beat(t.lease_seconds, last == protocol.QUEUED)
    try:
        while True:
            until = min(deadline, beat)
            if stopped is not None:
                if stopped():
                    break
                until = min(until, time.monotonic() + _STOP_POLL)
            msg = chan.recv_until(until)
            if msg is None and not chan.eof and time.monotonic() < deadline:
                if time.monotonic() >= beat:
                    # Waiting (in line, or for the agent to start): the whole wait, whatever the
                    # lease, while its owner is here.
                    with contextlib.suppress(NotHeld):
                        tickets.heartbeat(lk, t.ticket_id, t.lease_seconds)
                    beat = time.monotonic() + _beat(t.lease_seconds, last == protocol.QUEUED)
                continue
            if msg is None:
                break
            if msg.kind == protocol.ERROR:
                cur = lk.read(t.ticket_id) or t
                if cur.live:
                    tickets.end_orphan(at, lk, cur)
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
    if last != protocol.READY and cur.state == HELD and not chan.eof:
        # Promoted just as the wait ran out: its agent is taking the lock. Hear it say so,
        # or the caller is told "held" with no token, and the agent lets go of it for nobody.
        last = _await_ready(chan) or last
        cur = lk.read(t.ticket_id) or t
    if last is None and chan.eof and cur.live:
        cur = tickets.end_orphan(at, lk, cur)  # every write end closed: the agent died without a word
    out = _outcome(at, lk, cur)
    if control is not None and last == protocol.READY and control != CONTROL_WAIT and out.code == ExitCode.OK:
        return out, chan
    if control is not None and last != protocol.READY and out.ticket["state"] == WAITING and not chan.eof:
        with _kept_mutex:
            _kept[t.ticket_id] = chan
        return out, None
    chan.close()
    return out, None


def _await_ready(chan: Channel) -> str | None:
    """``ready`` from an agent that holds (None: it said something else, or went)."""
    until = time.monotonic() + _AGENT_START_SECONDS
    while (msg := chan.recv_until(until)) is not None:
        if msg.kind == protocol.READY:
            return protocol.READY
        if msg.kind != protocol.QUEUED:
            return None
    return None


def _prune() -> None:
    """Let go of kept channels whose agent has exited (its ticket ended): a server lives for days.
    What an agent said is kept in its channel's buffer, for a retry that resumes it."""
    with _kept_mutex:
        for ticket_id, chan in list(_kept.items()):
            while not chan.eof and select.select([chan.rfd], [], [], 0)[0]:
                chan.fill()
            if chan.eof:
                chan.close()
                del _kept[ticket_id]


def _drop_kept(ticket_id: str) -> None:
    with _kept_mutex:
        chan = _kept.pop(ticket_id, None)
    if chan is not None:
        chan.close()


def get(at: Opened, lock: str, repo: str, ticket_id: str) -> dict[str, Any]:
    ticket_id = names.ticket_id(ticket_id)
    with tickets.existing_lock(at, lock, repo, ticket_id) as lk:
        t = lk.read(ticket_id)
        if t is None:
            raise UnknownTicket(ticket_id)
        return tickets.view(at, lk, t)


def heartbeat(at: Opened, lock: str, repo: str, ticket_id: str, lease_seconds: float) -> dict[str, Any]:
    ticket_id = names.ticket_id(ticket_id)
    with tickets.existing_lock(at, lock, repo, ticket_id) as lk:
        return tickets.view(at, lk, tickets.heartbeat(lk, ticket_id, lease_seconds))


def release(at: Opened, lock: str, repo: str, ticket_id: str) -> dict[str, Any]:
    """Release (held) or cancel (waiting). Idempotent; a lost lease is an error."""
    ticket_id = names.ticket_id(ticket_id)
    try:
        with tickets.existing_lock(at, lock, repo, ticket_id) as lk:
            return tickets.view(at, lk, tickets.release(at, lk, ticket_id))
    finally:
        _drop_kept(ticket_id)  # its agent has let go: nothing left to answer for


def update_activity(at: Opened, identity: str, activity: str | None) -> dict[str, Any]:
    """Set (text) or clear (None) what ``identity`` is doing; every front end's text is checked here."""
    if activity is not None:
        names.activity(activity)
    records.write_activity(at.backend, names.identity(identity), activity)
    return {"identity": identity, "activity": activity}


def status(at: Opened, repo: str | None, lock: str | None, *, idle: bool = False) -> list[dict[str, Any]]:
    """``repo`` None: every scope."""
    scope = None if repo is None else names.scope(repo)
    return tickets.statuses(at, scope, None if lock is None else names.lock_name(lock), idle=idle)
