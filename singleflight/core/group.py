"""Stopping COMMAND's process group, the one way: SIGTERM, the grace, SIGKILL, then wait until no
member is left. The lock may change hands only after that, so whoever stops the group (the
holder on a lost lease, the wrapper when its holder died) keeps the lock meanwhile (``keep``:
an etcd lease's keepalive)."""

from __future__ import annotations

import contextlib
import os
import select
import signal
import time

from singleflight.core import proc
from singleflight.core.const import TYPE_CHECKING

if TYPE_CHECKING:
    from collections.abc import Callable

# select() takes at most this many seconds on every platform Python supports.
_MAX_SELECT_S = 86400.0 * 365
# How often the lock is kept while COMMAND is being stopped (an etcd lease's keepalive).
KEEP_EVERY = 0.5
# After SIGKILL a group is gone in moments; a process stuck in the kernel (D state) runs
# no user code again, so the lock is not held hostage to it for longer than this.
_GROUP_GONE_WITHIN = 10.0


def killpg(pgid: int, sig: int) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pgid, sig)


def wait_for_exit(pidfd: int, seconds: float, keep: Callable[[], object]) -> bool:
    """Wait for the process behind ``pidfd`` to exit, at most ``seconds``, calling ``keep`` meanwhile."""
    deadline = time.monotonic() + min(seconds, _MAX_SELECT_S)
    while True:
        left = deadline - time.monotonic()
        if left <= 0:
            return False
        if select.select([pidfd], [], [], min(left, KEEP_EVERY))[0]:
            return True
        keep()


def wait_for_group(pgid: int, keep: Callable[[], object]) -> None:
    """After SIGKILL: until no member of the group is left (zombies do not count)."""
    deadline = time.monotonic() + _GROUP_GONE_WITHIN
    kept = time.monotonic()
    while proc.group_alive(pgid) and time.monotonic() < deadline:
        if time.monotonic() - kept >= KEEP_EVERY:
            keep()
            kept = time.monotonic()
        time.sleep(0.005)


def stop(pgid: int, pidfd: int | None, grace: float, keep: Callable[[], object], *, leader_done: bool = False) -> None:
    """Stop the group led by ``pgid``: TERM (unless its leader is gone already), its ``grace``
    for the leader (``pidfd``) to exit, then KILL for whatever is left, and wait for it all."""
    if not leader_done:
        killpg(pgid, signal.SIGTERM)
        if pidfd is not None:
            wait_for_exit(pidfd, grace, keep)
    # Whatever is left of the group (the leader or its children) may not go on.
    killpg(pgid, signal.SIGKILL)
    wait_for_group(pgid, keep)
