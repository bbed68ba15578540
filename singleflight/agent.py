"""The agent: the detached holder of a ticket taken by ``pearing-cli acquire-lock``,
``pearing-mcp`` or ``Lock``. It is pearing-run without a COMMAND: the same acquire
path (``acquire.acquire``), the same holder.

    python -m singleflight.agent 'start {"backend": ..., "ticket": ..., "report_fd": N, ...}'

(its one argument is the ``start`` message of ``core/protocol.py``: where its ticket is, which
of its fds are its pipes, its mode.)

It waits in the FIFO line while its owner heartbeats the waiting ticket, takes
the lock, then keeps the lease until release, lease expiry without heartbeat,
or the kill of its process. It reports on its report fd (``queued``, ``ready``,
``ended``, ``lost``, ``released``, ``error``); the owner may be long gone.

An owner that gives a control fd answers for the ticket while it lives: when every
copy of its end is closed (it died, was interrupted, its MCP client went away)
the agent leaves the line within a second, and never takes the lock for nobody.
A ``Lock`` (``auto``/``manual``) sends ``started PID STAMP`` when its block begins
(the lease is then renewed while that process lives) and ``exited`` when it ends;
it going before ``started`` releases. ``wait`` (pearing-mcp) answers only while the
ticket waits: once held, the ticket is its client's, kept by heartbeats.
"""

from __future__ import annotations

import math
import os
import select
import signal
import sys
import threading

from singleflight.acquire import acquire
from singleflight.backend import Opened, open_backend
from singleflight.core import fault, protocol
from singleflight.core.const import CANCELLED, WAITING, ExitCode
from singleflight.core.errors import LineFull, NotHeld, PearingError
from singleflight.core.proc import ensure_std_fds
from singleflight.core.protocol import Channel
from singleflight.core.reasons import EndReason
from singleflight.holder import Holder, HolderConfig
from singleflight.rules import tickets

# The control mode that answers only while waiting (ops.CONTROL_WAIT; not imported: the agent
# starts on every acquire-lock, and ops brings subprocess along).
_WAIT_ONLY = "wait"


# The start message is a line of a few hundred bytes; a stdin that goes on past this is not one.
_MAX_START = 65536


def _read_start() -> str:
    """The start message, on stdin (never in argv: it names the backend's URL, which may carry a
    password); stdin is /dev/null afterwards."""
    chunks: list[bytes] = []
    size = 0
    try:
        while size <= _MAX_START and (chunk := os.read(0, 65536)):
            chunks.append(chunk)
            size += len(chunk)
    except OSError as exc:  # fd 0 closed, or not readable
        raise ValueError(f"no start message on stdin ({exc.strerror})") from None
    finally:
        null = os.open(os.devnull, os.O_RDONLY)
        if null != 0:
            os.dup2(null, 0)
            os.close(null)
    data = b"".join(chunks)
    if size > _MAX_START:
        raise ValueError(f"a start message is under {_MAX_START} bytes")
    return data.decode(errors="replace").rstrip("\n")


def main(argv: list[str]) -> int:
    try:
        if argv:
            raise ValueError(f"no arguments (the start message comes on stdin), not {len(argv)}")
        start = protocol.AgentStart.from_word(_read_start())
    except ValueError as exc:
        # Only ops starts an agent: this is a bug, or someone running it by hand (with fd 2
        # closed, Python has no sys.stderr: the exit code alone says it).
        if sys.stderr is not None:
            sys.stderr.write(f"singleflight.agent: error: {exc}\n")
        return int(ExitCode.USAGE)
    # Daemonise: the caller reaps our parent (once it has heard us out), so a long-lived caller
    # (pearing-mcp) collects no zombies; init reaps us when the lease ends.
    fault.pause("pause-agent-start")  # a machine too busy to start us for a whole lease
    if os.fork() > 0:
        os._exit(0)
    ensure_std_fds()
    signal.signal(signal.SIGPIPE, signal.SIG_IGN)
    chan = Channel(start.control_fd, start.report_fd)
    where = (start.repo, start.lock, start.ticket)
    try:
        return _agent(chan, start.backend, start.lock_dir, where, mode=start.mode)
    except PearingError as exc:
        # A corrupt record or a planted symlink: the owner exits with this code and line.
        chan.send(protocol.error(exc.exit_code, str(exc)))
        return int(exc.exit_code)


def _agent(chan: Channel, url: str, lock_dir: str, where: tuple[str, str, str], *, mode: str | None) -> int:
    repo, lock, ticket_id = where
    at = Opened(url, lock_dir)
    lk = at.backend.lock(repo, lock, create=False)
    # From here on the ticket's liveness is ours (the CLI call may exit).
    ticket = tickets.adopt(lk, ticket_id, os.getpid())
    if ticket is None:
        chan.send(protocol.Message(protocol.ENDED))
        return int(ExitCode.REFUSED)
    owner = _Owner(chan.rfd, url, lock_dir, where) if chan.rfd >= 0 else None
    queued = False

    def on_queued(position: int) -> None:
        nonlocal queued
        queued = True
        if owner is not None and owner.queued():
            lk.end(ticket_id, CANCELLED, EndReason.WAITER_GONE, only_if_held=False)
        chan.send(protocol.Message(protocol.QUEUED))

    def deadline() -> float:
        # Asked whenever the wait wakes: the watcher's stop() wakes it once the owner is gone.
        return 0.0 if owner is not None and owner.gone else tickets.waiting_deadline(lk, ticket_id)

    try:
        grip = acquire(
            lk,
            ticket,
            until=math.inf,
            ticket_deadline=deadline,
            on_queued=on_queued,
            timeout_reason=EndReason.WAITING_LEASE_EXPIRED,
        )
    except LineFull:
        grip = None  # its ticket ended as turned away: the owner reads why from it
    gone = owner is not None and owner.settle()
    if grip is None:
        chan.send(protocol.Message(protocol.ENDED))
        return 0
    # A poke (a heartbeat that shortened the lease, a release) stays pending until the
    # holder's own handler is in place, instead of being lost or fatal.
    signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGUSR1})
    if gone:  # the lock came just as its owner went: nobody would be inside
        lk.end(ticket_id, CANCELLED, EndReason.WAITER_GONE, only_if_held=False)
    fault.pause("pause-agent-take")
    current = lk.read(ticket_id)
    try:
        if current is None or not current.live:
            raise NotHeld(ticket_id, "ended")
        lease, taken = lk.take(grip, current, promoted=queued, kill_grace=0.0)
    except NotHeld:
        # Released (or its owner gone) while it was being promoted: nobody is inside, so the lock
        # is freed now (etcd's key, PostgreSQL's row would otherwise stay for the lease).
        grip.release()
        chan.send(protocol.Message(protocol.ENDED))
        return 0
    fault.pause("pause-agent-ready")
    chan.send(protocol.ready(taken))
    if mode == _WAIT_ONLY and chan.rfd >= 0:
        # Held: the ticket is its client's now, kept by heartbeats whatever becomes of the server.
        os.close(chan.rfd)
        chan.rfd = -1
    cfg = HolderConfig(heartbeat_auto=mode == "auto", owned_by_wrapper=False)
    # Unblocks: a poke that came meanwhile is handled now.
    Holder(at, lk, lease, cfg, chan).serve()


class _Owner:
    """Watches the owner's end of the control pipe while the ticket waits, in a thread of its own:
    the main thread is blocked in the backend's wait. When every copy of that end is closed
    the owner is gone, and its ticket leaves the line through ``rules.tickets.stop``
    (the path of a release of a waiting ticket: its record ends, the wait wakes)."""

    def __init__(self, fd: int, url: str, lock_dir: str, where: tuple[str, str, str]) -> None:
        self.fd, self.url, self.lock_dir, self.where = fd, url, lock_dir, where
        self.gone = False
        self._mutex = threading.Lock()
        self._phase = "starting"  # -> queued (a poke is handled now) -> settled (the wait is over)
        self._wake_r, self._wake_w = os.pipe()
        thread = threading.Thread(target=self._watch, name="owner", daemon=True)
        # Every signal goes to the main thread: a poke must cut its kernel wait short, and a
        # thread created with them blocked cannot take one in the moment before it blocks them.
        old = signal.pthread_sigmask(signal.SIG_BLOCK, signal.valid_signals())
        try:
            thread.start()
        finally:
            signal.pthread_sigmask(signal.SIG_SETMASK, old)

    def queued(self) -> bool:
        """The main thread took its place in line (a poke is handled from here). True: the
        owner went before that, and the caller ends the ticket itself."""
        with self._mutex:
            self._phase = "queued"
            return self.gone

    def settle(self) -> bool:
        """The wait is over: stop watching (the holder reads the channel from here). True if
        the owner went during the wait."""
        with self._mutex:
            self._phase = "settled"
        os.write(self._wake_w, b"x")
        return self.gone

    def _watch(self) -> None:
        poller = select.poll()
        # No POLLIN: nothing is sent while the ticket waits, and whatever comes is the holder's
        # to read. A pipe whose every writer closed reports POLLHUP whatever the mask.
        poller.register(self.fd, 0)
        poller.register(self._wake_r, select.POLLIN)
        while True:
            ready = dict(poller.poll())
            if self._wake_r in ready:
                return
            if self.fd in ready:
                break
        with self._mutex:
            if self._phase == "settled":
                return
            self.gone = True
            if self._phase != "queued":
                return  # not in line yet: the main thread ends the ticket when it gets there
            self._leave()

    def _leave(self) -> None:
        repo, lock, ticket_id = self.where
        lk = open_backend(self.url, self.lock_dir).lock(repo, lock, create=False)
        try:
            t = lk.read(ticket_id)
            if t is not None and t.state == WAITING:
                tickets.stop(lk, t, CANCELLED, EndReason.WAITER_GONE, within=0.0)
        except PearingError:
            pass  # the wait still ends at its next look (``deadline`` says 0 from now)
        finally:
            lk.close()


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
