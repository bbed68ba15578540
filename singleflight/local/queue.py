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
from types import FrameType

from singleflight.core.const import TYPE_CHECKING
from singleflight.core.fs import Dir
from singleflight.local.store import LockStore

if TYPE_CHECKING:
    from collections.abc import Callable
    from typing import Protocol
else:
    Protocol = object  # the checker's Protocols are plain classes at run time

_SEQ_FILE = ".seq"


class Interrupted(Exception):
    """Raised from a signal handler to break out of a blocking flock."""


# The signal that tells a waiter to re-read its ticket (released, superseded). Not SIGUSR1:
# pearing-run forwards that one to COMMAND, and a poke sent to a waiter just as it was promoted
# may arrive late. Once it stops waiting, a waiter ignores this one.
WAITER_POKE = signal.SIGRTMIN + 1
POKES = frozenset({WAITER_POKE})


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
        mask = signal.pthread_sigmask(signal.SIG_BLOCK, ())
        try:
            # A poke (re-read your ticket) is held back by the waiter everywhere but
            # here, in the kernel wait it is meant to cut short: its handler raises, and an
            # exception anywhere else would escape the wait. One that came meanwhile lands now.
            signal.pthread_sigmask(signal.SIG_UNBLOCK, POKES)
            fcntl.flock(fd, fcntl.LOCK_EX)
        finally:
            signal.pthread_sigmask(signal.SIG_SETMASK, mask)
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


_ASCII_DIGITS = frozenset("0123456789")


def _entries(qdir: Dir) -> list[str]:
    """Queue entries, ``SEQ.TICKET`` with SEQ 20 ASCII digits; any other name is not ours."""
    return sorted(n for n in qdir.listdir() if len(n) > 21 and n[20] == "." and set(n[:20]) <= _ASCII_DIGITS)


def in_line(store: LockStore, ticket_id: str) -> bool:
    """Has the ticket an entry in the queue (its waiter is in the wait, or joining or leaving
    it, with its poke handled or ignored)? Names only: nothing is tried or swept."""
    return any(n.endswith("." + ticket_id) for n in _entries(store.sub("queue")))


def _seq(name: str) -> int:
    return int(name.split(".", 1)[0])


def seq_of(store: LockStore, ticket_id: str) -> int | None:
    """The place in line of a ticket's entry, if it has one."""
    for name in _entries(store.sub("queue")):
        if name.endswith("." + ticket_id):
            return _seq(name)
    return None


def _deadline_of(qdir: Dir, name: str) -> float | None:
    """The monotonic deadline a waiter wrote into its entry (None: unknown, e.g. being written)."""
    try:
        data = qdir.read(name)
    except FileNotFoundError:
        return None
    text = data.decode("ascii", "replace").strip() if data else ""
    try:
        return float(text) if text else None
    except ValueError:
        return None


def _stale(deadline: float | None, now: float) -> bool:
    """A waiter past its own deadline (stopped with ^Z, frozen) keeps no place in line."""
    return deadline is not None and deadline <= now


def live_entries(store: LockStore) -> list[str]:
    """Queue entries whose waiter is alive and within its deadline; dead ones are swept."""
    qdir = store.sub("queue")
    live = []
    now = time.monotonic()
    for name in _entries(qdir):
        try:
            fd = qdir.open(name, os.O_RDWR)
        except FileNotFoundError:
            continue
        try:
            if try_flock(fd):
                qdir.unlink(name)  # its waiter died (kill -9) before leaving
            elif not _stale(_deadline_of(qdir, name), now):
                live.append(name)
        finally:
            os.close(fd)
    return live


class Head(Protocol):
    """What the head of the line waits for when it is not one lock file (``slots.SlotSet``)."""

    def until(self, deadline: float) -> bool: ...

    def undo(self) -> None: ...


class Waiter:
    """One place in the queue, held for as long as this object's fd is open.

    The entry holds the waiter's deadline (CLOCK_MONOTONIC, shared by every process
    of the host): a waiter suspended past it is skipped by the ones behind, and once
    resumed it leaves without taking the lock. No waiter can block the line for
    longer than its own wait.
    """

    def __init__(self, store: LockStore, ticket_id: str) -> None:
        self.store, self.ticket_id = store, ticket_id
        self.name: str | None = None
        self.fd = -1
        self.seq = 0
        self.published: float | None = None

    @property
    def qdir(self) -> Dir:
        # Asked each time, not kept: the store's directory is opened afresh if prune took it
        # before we were in line (``LockStore.reopen``).
        return self.store.sub("queue")

    def enqueue(self, deadline: float, *, seq: int | None = None) -> int:
        """Take the next place in line, or place ``seq`` (a superseded waiter's). Caller holds
        ``store.mutex()``."""
        names = _entries(self.qdir)
        counter = self.qdir.read(_SEQ_FILE)
        last = max([_seq(names[-1])] if names else [0])
        text = counter.strip() if counter else b""
        # ASCII digits that fit the 20-digit entry names; anything else is no counter at all
        # (int() of thousands of digits raises, and longer names would break the FIFO order).
        if text and len(text) <= 19 and all(48 <= c <= 57 for c in text):
            last = max(last, int(text))
        self.seq = seq if seq is not None else last + 1
        name = f"{self.seq:020d}.{self.ticket_id}"
        tmp = f".new.{self.ticket_id}"
        fd = self.qdir.open(tmp, os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o600)
        # Lock before the entry becomes visible, so nobody can take it for dead.
        fcntl.flock(fd, fcntl.LOCK_EX)
        self.fd = fd
        self._publish(deadline)
        self.qdir.rename(tmp, name)
        self.qdir.write_atomic(_SEQ_FILE, f"{max(self.seq, last)}\n".encode(), durable=False)
        self.name = name
        return self.seq

    def _publish(self, deadline: float) -> None:
        # Fixed width, written in place: a reader sees the old or the new number (a
        # half-written one does not parse, and an unknown deadline means "still waiting").
        os.pwrite(self.fd, f"{deadline:<40.6f}\n".encode(), 0)
        self.published = deadline

    def position(self) -> int:
        assert self.name is not None
        now = time.monotonic()
        return sum(1 for n in _entries(self.qdir) if n < self.name and not _stale(_deadline_of(self.qdir, n), now)) + 1

    def _predecessor(self, now: float) -> tuple[str, float | None] | None:
        """The nearest entry ahead whose waiter is still within its deadline."""
        assert self.name is not None
        for name in reversed([n for n in _entries(self.qdir) if n < self.name]):
            d = _deadline_of(self.qdir, name)
            if not _stale(d, now):
                return name, d
        return None

    def wait(self, lock_fd: int, deadline: Callable[[], float], head: Head | None = None) -> bool:
        """Block until this waiter holds ``lock_fd`` (True) or ``deadline()`` passes.

        ``deadline`` is asked again whenever it runs out, so a heartbeat that
        extends a waiting ticket keeps its place in line. ``head``: what the head of the
        line waits for instead of ``lock_fd`` (a free one of a lock's slots).
        """
        assert self.name is not None
        while True:
            mine = deadline()
            now = time.monotonic()
            if now >= mine:
                return False
            if mine != self.published:
                self._publish(mine)
            pred = self._predecessor(now)
            if pred is None:
                if head.until(mine) if head is not None else flock_until(lock_fd, mine):
                    if time.monotonic() > deadline():
                        # Resumed after our deadline (a ^Z, a frozen VM): the lock is not ours to take.
                        if head is not None:
                            head.undo()
                        else:
                            fcntl.flock(lock_fd, fcntl.LOCK_UN)
                        return False
                    return True
                continue
            name, theirs = pred
            try:
                fd = self.qdir.open(name, os.O_RDWR)
            except FileNotFoundError:
                continue
            try:
                if flock_until(fd, min(mine, theirs if theirs is not None else mine)):
                    # Its waiter is gone; a live one unlinks before closing,
                    # so a name still here belongs to a killed waiter.
                    self.qdir.unlink(name)
            finally:
                os.close(fd)

    def leave(self) -> None:
        if self.name is not None:
            self.qdir.unlink(self.name)
            self.name = None
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1


def flocked_now(d: Dir, names: list[str]) -> set[str]:
    """Which of ``names`` (flock files in ``d``) someone holds a flock on now, as /proc/locks
    lists them: read, never probed (a probe of the lock's flock would turn an arrival that finds
    the lock free into a waiter for that instant). Unreadable: none."""
    ids = {}
    for name in names:
        st = d.lstat(name)
        if st is not None:
            ids[f"{os.major(st.st_dev):02x}:{os.minor(st.st_dev):02x}:{st.st_ino}"] = name
    if not ids:
        return set()
    try:
        with open("/proc/locks", "rb") as f:
            listed = f.read().decode("ascii", "replace").splitlines()
    except OSError:
        return set()
    # "N: FLOCK ADVISORY WRITE PID MAJ:MIN:INODE 0 EOF"; a blocked waiter's line has "->" too.
    return {ids[f[5]] for f in (line.split() for line in listed) if len(f) >= 6 and f[1] == "FLOCK" and f[5] in ids}
