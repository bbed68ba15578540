"""FIFO waiting, woken by the kernel.

``flock`` alone is not fair, so waiters form an explicit queue: each waiter
owns one entry file in ``queue/`` named by a strictly increasing sequence
number and keeps an exclusive flock on it while it lives. A waiter blocks in
the kernel on the entry just ahead of it; only the head blocks on the lock
itself. When a waiter leaves (promoted, timed out, or killed: the kernel drops
a dead process's flocks) the one behind it wakes at once, in the manner of
etcd's mutex where each waiter watches only its predecessor. No sleep loops,
and PID reuse is irrelevant: liveness is the flock itself.
"""

from __future__ import annotations

import fcntl
import os
import signal
import time
from collections.abc import Callable
from types import FrameType

from singleflight.core.fs import Dir
from singleflight.local.store import LockStore

_SEQ_FILE = ".seq"


class Interrupted(Exception):
    """Raised from a signal handler to break out of a blocking flock."""


def _on_alarm(signum: int, frame: FrameType | None) -> None:
    raise Interrupted


def flock_until(fd: int, deadline: float) -> bool:
    """Exclusive flock on ``fd``, blocking in the kernel until ``deadline`` (monotonic).

    On False the caller must close ``fd``: the alarm may land just after the
    kernel granted the lock, and closing is what gives it back.
    """
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        return True
    except BlockingIOError:
        pass
    remaining = deadline - time.monotonic()
    if remaining <= 0:
        return False
    try:
        old = signal.signal(signal.SIGALRM, _on_alarm)
    except ValueError:
        # Not the main thread (a server calling the API from a worker): no
        # signal to cut the kernel wait short, so poll instead. pearing-run and
        # the CLI agents always wait in their main thread, woken by the kernel.
        return _poll_flock(fd, deadline)
    try:
        signal.setitimer(signal.ITIMER_REAL, remaining)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX)
        finally:
            signal.setitimer(signal.ITIMER_REAL, 0)
        return True
    except Interrupted:
        return False
    finally:
        signal.signal(signal.SIGALRM, old)


def _poll_flock(fd: int, deadline: float) -> bool:
    while time.monotonic() < deadline:
        if try_flock(fd):
            return True
        time.sleep(0.005)
    return try_flock(fd)


def try_flock(fd: int) -> bool:
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        return False
    return True


def _entries(qdir: Dir) -> list[str]:
    return sorted(n for n in qdir.listdir() if n[:1].isdigit())


def _seq(name: str) -> int:
    return int(name.split(".", 1)[0])


def live_entries(store: LockStore) -> list[str]:
    """Queue entries whose waiter is alive; dead ones are swept on the way."""
    qdir = store.sub("queue")
    live = []
    for name in _entries(qdir):
        try:
            fd = qdir.open(name, os.O_RDWR)
        except FileNotFoundError:
            continue
        try:
            if try_flock(fd):
                qdir.unlink(name)  # its waiter died (kill -9) before leaving
            else:
                live.append(name)
        finally:
            os.close(fd)
    return live


class Waiter:
    """One place in the queue, held for as long as this object's fd is open."""

    def __init__(self, store: LockStore, ticket_id: str) -> None:
        self.store, self.ticket_id = store, ticket_id
        self.qdir = store.sub("queue")
        self.name: str | None = None
        self.fd = -1
        self.seq = 0

    def enqueue(self) -> int:
        """Take the next place in line. Caller holds ``store.mutex()``."""
        names = _entries(self.qdir)
        counter = self.qdir.read(_SEQ_FILE)
        last = max([_seq(names[-1])] if names else [0])
        if counter and counter.strip().isdigit():
            last = max(last, int(counter))
        self.seq = last + 1
        name = f"{self.seq:020d}.{self.ticket_id}"
        tmp = f".new.{self.ticket_id}"
        fd = self.qdir.open(tmp, os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o600)
        # Lock before the entry becomes visible, so nobody can take it for dead.
        fcntl.flock(fd, fcntl.LOCK_EX)
        self.qdir.rename(tmp, name)
        self.qdir.write_atomic(_SEQ_FILE, f"{self.seq}\n".encode(), durable=False)
        self.fd, self.name = fd, name
        return self.seq

    def position(self) -> int:
        assert self.name is not None
        return sum(1 for n in _entries(self.qdir) if n < self.name) + 1

    def wait(self, lock_fd: int, deadline: Callable[[], float]) -> bool:
        """Block until this waiter holds ``lock_fd`` (True) or ``deadline()`` passes.

        ``deadline`` is asked again whenever it runs out, so a heartbeat that
        extends a waiting ticket keeps its place in line.
        """
        assert self.name is not None
        while True:
            ahead = [n for n in _entries(self.qdir) if n < self.name]
            if not ahead:
                if flock_until(lock_fd, deadline()):
                    return True
            else:
                pred = ahead[-1]
                try:
                    fd = self.qdir.open(pred, os.O_RDWR)
                except FileNotFoundError:
                    continue
                try:
                    if flock_until(fd, deadline()):
                        # Its waiter is gone; a live one unlinks before closing,
                        # so a name still here belongs to a killed waiter.
                        self.qdir.unlink(pred)
                        continue
                finally:
                    os.close(fd)
            if time.monotonic() >= deadline():
                return False

    def leave(self) -> None:
        if self.name is not None:
            self.qdir.unlink(self.name)
            self.name = None
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1
