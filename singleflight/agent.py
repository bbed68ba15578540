"""The agent: the detached holder of a ticket taken by ``pearing-cli acquire-lock``,
``pearing-mcp`` or ``Lock``. It is pearing-run without a COMMAND: the same acquire
path (``acquire.acquire``), the same holder.

    python -m singleflight.agent BACKEND LOCK_DIR REPO LOCK TICKET REPORT_FD [CONTROL_FD auto|manual]

It waits in the FIFO line while its owner heartbeats the waiting ticket, takes
the lock, then keeps the lease until release, lease expiry without heartbeat,
or the kill of its process. It reports on REPORT_FD (``queued``, ``ready``,
``ended``, ``lost``, ``released``, ``error``); the owner may be long gone. A
``Lock`` also gives CONTROL_FD: ``started PID STAMP`` when its block begins
(the lease is then renewed while that process lives) and ``exited`` when it ends.
"""

from __future__ import annotations

import math
import os
import signal
import sys

from singleflight.acquire import acquire
from singleflight.backend import open_backend
from singleflight.core import protocol
from singleflight.core.const import ExitCode
from singleflight.core.errors import PearingError
from singleflight.core.proc import ensure_std_fds
from singleflight.core.protocol import Channel
from singleflight.core.reasons import EndReason
from singleflight.holder import Holder, HolderConfig


def main(argv: list[str]) -> int:
    url, lock_dir, repo, lock, ticket_id, report_fd, *control = argv
    # Daemonise: the caller reaps our parent at once, so a long-lived caller
    # (pearing-mcp) collects no zombies; init reaps us when the lease ends.
    if os.fork() > 0:
        os._exit(0)
    ensure_std_fds()
    signal.signal(signal.SIGPIPE, signal.SIG_IGN)
    chan = Channel(int(control[0]) if control else -1, int(report_fd))
    auto = control[1:] == ["auto"]
    try:
        return _agent(chan, url, lock_dir, (repo, lock, ticket_id), auto=auto)
    except PearingError as exc:
        # A corrupt record or a planted symlink: the owner exits with this code and line.
        chan.send(protocol.error(exc.exit_code, str(exc)))
        return int(exc.exit_code)


def _agent(chan: Channel, url: str, lock_dir: str, where: tuple[str, str, str], *, auto: bool) -> int:
    repo, lock, ticket_id = where
    lk = open_backend(url, lock_dir).lock(repo, lock, create=False)
    # From here on the ticket's liveness is ours (the CLI call may exit).
    ticket = lk.adopt(ticket_id, os.getpid())
    if ticket is None:
        chan.send(protocol.Message(protocol.ENDED))
        return int(ExitCode.REFUSED)
    queued = False

    def on_queued(position: int) -> None:
        nonlocal queued
        queued = True
        chan.send(protocol.Message(protocol.QUEUED))

    grip = acquire(
        lk,
        ticket,
        until=math.inf,
        ticket_deadline=lambda: lk.waiting_deadline(ticket_id),
        on_queued=on_queued,
        timeout_reason=EndReason.WAITING_LEASE_EXPIRED,
    )
    if grip is None:
        chan.send(protocol.Message(protocol.ENDED))
        return 0
    # A poke (a heartbeat that shortened the lease, a release) stays pending until the
    # holder's own handler is in place, instead of being lost or fatal.
    signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGUSR1})
    current = lk.read(ticket_id)
    if current is None or not current.live:  # released while it was being promoted
        grip.close()
        chan.send(protocol.Message(protocol.ENDED))
        return 0
    lease, taken = lk.take(grip, current, promoted=queued, kill_grace=0.0)
    chan.send(protocol.ready(taken))
    cfg = HolderConfig(heartbeat_auto=auto, owned_by_wrapper=False)
    Holder(lk, lease, cfg, chan).serve()  # unblocks: a poke that came meanwhile is handled now


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
