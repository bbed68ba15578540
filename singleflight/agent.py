"""The detached holder of a ``pearing-cli acquire-lock`` ticket.

Run as ``python -m singleflight.agent LOCK_DIR REPO LOCK TICKET FD`` with FD a
pipe to the CLI call that started it. It waits in the FIFO queue while its
owner heartbeats the waiting ticket, takes the lock, then keeps the lease until
release, lease expiry without heartbeat, or the kill of its process. It reports
``queued``, ``held``, ``ended`` or ``error CODE MESSAGE`` lines on FD; the CLI may be long gone.
"""

from __future__ import annotations

import os
import signal
import sys
from types import FrameType

from singleflight import lease, queue
from singleflight.core import fault as _fault
from singleflight.core import proc as _proc
from singleflight.core.const import CANCELLED, WAITING
from singleflight.core.errors import PearingError
from singleflight.core.protocol import Channel
from singleflight.holder import Holder, HolderConfig, LocalLease
from singleflight.store import LockDir


def _interrupt(signum: int, frame: FrameType | None) -> None:
    raise queue.Interrupted


def main(argv: list[str]) -> int:
    lock_dir, repo, lock, ticket_id, report_fd = argv
    # Daemonise: the caller reaps our parent at once, so a long-lived caller
    # (pearing-mcp) collects no zombies; init reaps us when the lease ends.
    if os.fork() > 0:
        os._exit(0)
    signal.signal(signal.SIGPIPE, signal.SIG_IGN)
    chan = Channel(-1, int(report_fd))
    try:
        return _agent(chan, lock_dir, repo, lock, ticket_id)
    except PearingError as exc:
        # A corrupt record or a planted symlink: the CLI call exits with this code and line.
        chan.send(f"error {int(exc.exit_code)} {exc}")
        return int(exc.exit_code)


def _agent(chan: Channel, lock_dir: str, repo: str, lock: str, ticket_id: str) -> int:
    store = LockDir(lock_dir, create=False).lock_store(repo, lock, create=False)
    ticket = store.read_ticket(ticket_id)
    if ticket is None or ticket.state != WAITING:
        chan.send("ended")
        return 1
    with store.mutex():
        # From here on the ticket's liveness is ours (the CLI call may exit).
        ticket = store.read_ticket(ticket_id)
        if ticket is None or ticket.state != WAITING:
            chan.send("ended")
            return 1
        ticket.holder_pid, ticket.holder_start = os.getpid(), _proc.start_time(os.getpid())
        store.write_ticket(ticket)
    fd = store.open_lock_file()
    waited = False
    if not (queue.try_flock(fd) and not queue.live_entries(store)):
        waited = True
        waiter = queue.Waiter(store, ticket_id)
        with store.mutex():
            ticket = store.read_ticket(ticket_id)
            if ticket is None or ticket.state != WAITING:
                chan.send("ended")
                return 1
            ticket.queue_seq = waiter.enqueue()
            store.write_ticket(ticket)
        chan.send("queued")

        def deadline() -> float:
            """The waiting lease, as heartbeats extend it; 0 once released/cancelled."""
            t = store.read_ticket(ticket_id)
            if t is None or t.state != WAITING or t.lease_deadline_mono is None:
                return 0.0
            return t.lease_deadline_mono

        # release-lock-ticket pokes us with SIGUSR1 to re-read the ticket at once.
        signal.signal(signal.SIGUSR1, _interrupt)
        got = False
        try:
            got = waiter.wait(fd, deadline)
            if got:
                _fault.point("mid-promotion")
        finally:
            # From here until the holder's own handler is in place, a poke (a heartbeat that
            # shortened the lease, a release) stays pending instead of being lost or fatal.
            signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGUSR1})
            waiter.leave()
        if not got:
            os.close(fd)
            lease.end(store, ticket_id, CANCELLED, "waiting lease expired without heartbeat", only_if_held=False)
            chan.send("ended")
            return 0
    ticket = store.read_ticket(ticket_id)
    if ticket is None or ticket.state != WAITING:
        chan.send("ended")
        return 1
    signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGUSR1})
    lease.take_ownership(store, ticket, promoted=waited)
    chan.send("held")
    cfg = HolderConfig(heartbeat_auto=False, max_runtime=None, kill_grace=0.0, request_uuid=None, dedupe_window=0.0)
    holder = Holder(LocalLease(store, fd, ticket), cfg, chan)
    signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGUSR1})  # a pending poke is handled now
    holder.serve()
    return 0  # not reached: serve() exits the process


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
