"""Test-only fault injection: die with SIGKILL at a named step.

Off unless ``PEARING_FAULT`` names points (comma-separated), e.g.
``PEARING_FAULT=after-fence-bump``. The reliability suite uses it to prove that
a kill at any step never leaves a lock held forever, two holders at once, or a
fence reused. Points: after-flock, after-fence-bump, after-token-file,
after-holder-spawn, after-command-spawn, before-finish, mid-release, mid-promotion, mid-ledger. Pause points (SIGSTOP
instead): pause-holder-start, pause-guard-spawned, pause-command-spawn (pearing-run's wrapper,
after telling its holder ``spawning`` and right before it spawns COMMAND or the --skip-if check:
a test starts a process there that is older than COMMAND yet younger than that word),
pause-agent-start (an agent of pearing-cli / MCP / ``Lock``, its interpreter up, right before
it daemonises: an agent that a busy machine starts late), pause-agent-spawn (pearing-cli /
MCP / ``Lock`` with a waiting ticket made, right before it spawns the ticket's agent: an owner
that dies there leaves a ticket nobody answers for), pause-before-finish (a holder whose
COMMAND has ended, before it records the end and ends the ticket), pause-agent-take (an agent
whose turn came, right before it takes the lock), pause-agent-ready (an agent that has taken the
lock, right before it tells its owner: promoted as its owner's wait runs out), pause-lock-open (a lock
dir acquirer between opening the lock's file and its first flock: a prune may remove it then),
pause-queued (an acquirer just in line, before its wait's first pass: newcomers count it then),
pause-in-mutex (a lock dir acquirer joining the line, inside the lock's record mutex;
on PostgreSQL, inside the transaction that holds the lock's row), pause-etcd-settle (an etcd
holder whose COMMAND has started, right before it records itself in its key), pause-etcd-end-read
(an etcd end of another process's ticket, release-lock-ticket's, between reading its key and
writing it).

With ``PEARING_FAULT_GATE=PATH`` a pause point waits for PATH to exist instead of stopping (it
first creates ``PATH.PID``): the process stays runnable, so a test can send it a stop signal
inside the window (one sent to a stopped process is discarded when it is continued).
"""

from __future__ import annotations

import os
import signal

_ARMED = frozenset(filter(None, os.environ.get("PEARING_FAULT", "").split(",")))


def point(name: str) -> None:
    if name in _ARMED:
        os.kill(os.getpid(), signal.SIGKILL)


def pause(name: str) -> None:
    """Stop here (SIGSTOP) if armed: a test then signals the process inside a narrow window."""
    if name not in _ARMED:
        return
    gate = os.environ.get("PEARING_FAULT_GATE")
    if not gate:
        os.kill(os.getpid(), signal.SIGSTOP)
        return
    import time

    with open(f"{gate}.{os.getpid()}", "w"):
        pass
    while not os.path.exists(gate):
        time.sleep(0.005)
