"""The holder's view of COMMAND (or a ``Lock``'s process): its pid, a pidfd on it, and, when the
wrapper died between spawning it and naming it, finding it by the run's secret."""

from __future__ import annotations

import os
import select
import time

from singleflight.core import proc
from singleflight.core.const import ENV_TOKEN, TYPE_CHECKING

if TYPE_CHECKING:
    from collections.abc import Callable

# A wrapper killed mid-spawn: how long the holder looks for the process it may have started.
SPAWNED_FOUND_WITHIN = 1.0


class Watched:
    """What the holder knows of the process it answers for. ``fd`` is a pidfd the holder's loop
    polls (readable once the process exits)."""

    __slots__ = ("done", "fd", "pid", "spawning")

    def __init__(self) -> None:
        self.pid: int | None = None
        self.fd: int | None = None
        self.done = False
        # Told COMMAND is about to start, not yet its pid: the moment it was told (``boot_ticks``).
        self.spawning: int | None = None

    def started(self, pid: int, stamp: int, poller: select.poll | None) -> None:
        """COMMAND (or the --skip-if check) runs: watch it."""
        self.spawning = None
        if self.fd is not None:  # the --skip-if check came first
            if not self.done and poller is not None:
                poller.unregister(self.fd)
            os.close(self.fd)
        self.pid, self.done = pid, False
        self.fd = pidfd(pid, stamp)
        if self.fd is None:
            self.done = True
        elif poller is not None:
            poller.register(self.fd, select.POLLIN)

    def ended(self) -> bool:
        """Has it ended, even if the loop has not seen its pidfd yet?"""
        if self.done:
            return True
        return self.fd is not None and bool(select.select([self.fd], [], [], 0)[0])

    def find_spawned(self, digest: str | None, keep: Callable[[], None], poller: select.poll | None) -> None:
        """The wrapper died between spawning COMMAND and telling us its pid (kill -9): find it by
        the run's token in its environment, as if told. A process just spawned may take a moment
        to exec; one that never started (the wrapper died before the spawn) is not waited for long.

        Never by the ticket id: it is public (``pearing-cli status``), and a process carrying it,
        adopted in COMMAND's place, let the lock go when it exited while COMMAND ran on. The token
        is the run's secret, minted once the lock was ours: only its 0600 token file and what the
        run started have it (a --skip-if check's own daemon too, hence the second rule: started
        no earlier than the ``spawning`` word, which the wrapper stamped before the spawn; the
        moment we heard it may already be after COMMAND's start)."""
        since, self.spawning = self.spawning, None
        if since is None or digest is None:
            return
        matches = token_matcher(digest)
        deadline = time.monotonic() + SPAWNED_FOUND_WITHIN
        while (found := proc.spawned_with_env(ENV_TOKEN, matches, since)) is None:
            if time.monotonic() >= deadline:
                return
            time.sleep(0.02)
            keep()
        self.started(*found, poller)


def pidfd(pid: int, stamp: int | None) -> int | None:
    """A pidfd on the process, or None if it is already gone (or the pid was reused)."""
    try:
        fd = os.pidfd_open(pid)
    except ProcessLookupError:
        return None
    if proc.start_time(pid) != stamp:
        os.close(fd)
        return None
    return fd


def token_matcher(digest: str) -> Callable[[bytes], bool]:
    """Is a value the token whose hash is ``digest`` (the ticket keeps only the hash)? In
    constant time, as every comparison with a secret."""
    from singleflight.core.tokens import same_secret, token_hash

    def matches(value: bytes) -> bool:
        return same_secret(token_hash(value.decode(errors="replace")), digest)

    return matches
