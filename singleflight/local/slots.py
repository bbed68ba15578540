"""``--slots N`` on the lock dir: N flocked slot files, and the FIFO line in front of them.

Slot 0 is the lock file itself (``lock``), so one slot is today's lock, file for file; slot i
is ``slot.i``. A holder keeps its slot's fd flocked exactly as a one-slot holder keeps the lock
file's (wrapper and holder share the open file description: the kernel frees the slot once both
let go, or die). Each slot has its own holder pointer (``holder``, ``holder.i``): holding a
slot's flock proves that slot's previous holder is gone, and only that one is swept.

Waiters queue in ``queue/`` as for one slot; only the head of the line waits for a slot. No
flock waits for "any of N files", so the head keeps an fd on every slot file and an inotify
watch on each: the kernel reports the last close of a slot file's open file description
(``IN_CLOSE_WRITE``: a holder letting go, or killed), and the head tries every slot again. Its
own fds stay open while it waits, so it never wakes itself; a newcomer's probe of a slot wakes
it for nothing, once.
"""

from __future__ import annotations

import fcntl
import os
import select
import signal
import time

from singleflight.core import proc
from singleflight.core.const import HELD, TYPE_CHECKING
from singleflight.core.record import is_uuid
from singleflight.core.ticket import Ticket, check_slots
from singleflight.local import queue
from singleflight.local.queue import POKES, Interrupted, try_flock
from singleflight.local.store import LockStore

if TYPE_CHECKING:
    from typing import Final

_IN_CLOSE_WRITE: Final = 0x00000008
_IN_NONBLOCK_CLOEXEC: Final = os.O_NONBLOCK | os.O_CLOEXEC
# poll() takes an int of milliseconds.
_MAX_POLL_MS: Final = 2**31 - 1


def slot_file(i: int) -> str:
    return "lock" if i == 0 else f"slot.{i}"


def pointer(i: int) -> str:
    """The pointer naming the last holder of slot ``i``."""
    return "holder" if i == 0 else f"holder.{i}"


def slot_of(name: str) -> int:
    """The slot a holder pointer is of."""
    return 0 if name == "holder" else int(name[7:])


def pointers(store: LockStore) -> list[str]:
    """Every slot's holder pointer that exists (``holder`` first)."""
    extra = sorted(
        (n for n in store.dir.listdir() if n.startswith("holder.") and n[7:].isdigit() and n[7:].isascii()),
        key=lambda n: int(n[7:]),
    )
    return ["holder", *extra]


def stopping(store: LockStore, listed: set[str]) -> list[Ticket]:
    """Holders whose ticket ended (released, its lease lost) while COMMAND is still being
    stopped: the slot's lock file is still flocked and the ticket its pointer names still has its
    process. They still hold the lock (an arrival is busy), as etcd's and PostgreSQL's lines
    show them. (``listed``: the holders found already.)"""
    named = [(slot_file(slot_of(name)), store.read_pointer(name)) for name in pointers(store)]
    held = [(lock, tid) for lock, tid in named if tid is not None and tid not in listed]
    flocked = queue.flocked_now(store.dir, [lock for lock, _ in held]) if held else set()
    out = []
    for lock, tid in held:
        t = store.read_ticket(tid) if lock in flocked and is_uuid(tid) else None
        if t is not None and t.fence is not None and proc.alive(t.holder_pid, t.holder_start):
            out.append(t)
    return out


def ever_slotted(store: LockStore) -> bool:
    """Has this lock ever had more than one slot? (One stat: a one-slot lock pays no more.)"""
    return store.dir.lstat(slot_file(1)) is not None


def check(store: LockStore, ticket: Ticket) -> None:
    """``ticket``'s slots against the live tickets' (caller holds the mutex): a lock has one
    number of slots at a time. A ticket whose process is gone does not count."""
    if ticket.slots == 1 and not ever_slotted(store):
        return
    live = [t for t in store.tickets() if t.live and proc.alive(t.holder_pid, t.holder_start)]
    order = {name.rpartition(".")[2]: i for i, name in enumerate(queue.live_entries(store))}
    # Line order: the holders by fence, then the waiters as they queue (one not in line yet, last).
    live.sort(key=lambda t: (0, t.fence or 0) if t.state == HELD else (1, order.get(t.ticket_id, len(order))))
    check_slots(ticket, live)


class _Inotify:
    """inotify(7) through libc: Python's standard library has no binding."""

    def __init__(self) -> None:
        import ctypes  # here: only a head of the line waiting on --slots needs it (libffi, ~8 ms)

        self._ctypes = ctypes
        self.libc = ctypes.CDLL(None, use_errno=True)
        fd = self.libc.inotify_init1(_IN_NONBLOCK_CLOEXEC)
        if fd < 0:
            err = self._ctypes.get_errno()
            raise OSError(err, os.strerror(err))
        self.fd: int = fd

    def watch(self, fd: int) -> None:
        """Watch the file ``fd`` is open on (its inode: the path through /proc follows no link
        in the lock dir)."""
        if self.libc.inotify_add_watch(self.fd, f"/proc/self/fd/{fd}".encode(), _IN_CLOSE_WRITE) < 0:
            err = self._ctypes.get_errno()
            raise OSError(err, os.strerror(err))

    def drain(self) -> None:
        try:
            while os.read(self.fd, 65536):
                pass
        except BlockingIOError:
            pass

    def close(self) -> None:
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1


class SlotSet:
    """An fd on each of a lock's ``n`` slot files; ``taken``: the slot whose flock is ours."""

    def __init__(self, store: LockStore, n: int) -> None:
        self.fds: list[int] = []
        self.taken: int | None = None
        self._watch: _Inotify | None = None
        try:
            for i in range(n):
                self.fds.append(store.open_lock_file(slot_file(i)))
        except BaseException:
            self.close()
            raise

    def try_any(self) -> int | None:
        """The first free slot, flocked now (None: every slot is held)."""
        for i, fd in enumerate(self.fds):
            if try_flock(fd):
                self.taken = i
                return i
        return None

    def until(self, deadline: float) -> bool:
        """Block until a slot is ours (True) or ``deadline`` (monotonic) passes, or a poke (the
        waiter's signal: re-read the ticket) cuts the wait short (False)."""
        if self._watch is None:
            self._watch = _Inotify()
            for fd in self.fds:
                self._watch.watch(fd)
        poller = select.poll()
        poller.register(self._watch.fd, select.POLLIN)
        while True:
            # Watches first, then the look: a release between the two still wakes the poll.
            self._watch.drain()
            if self.try_any() is not None:
                return True
            left = deadline - time.monotonic()
            if left <= 0:
                return False
            mask = signal.pthread_sigmask(signal.SIG_BLOCK, ())
            try:
                # As in ``queue.flock_until``: a poke is let in only during the kernel wait.
                signal.pthread_sigmask(signal.SIG_UNBLOCK, POKES)
                poller.poll(min(_MAX_POLL_MS, int(left * 1000) + 1))
            except Interrupted:
                return False
            finally:
                signal.pthread_sigmask(signal.SIG_SETMASK, mask)

    def undo(self) -> None:
        """Give back the slot taken (resumed past its deadline: not ours to use)."""
        if self.taken is not None:
            fcntl.flock(self.fds[self.taken], fcntl.LOCK_UN)
            self.taken = None

    def keep_taken(self) -> int:
        """The taken slot's fd, handed to the grip; every other fd is closed."""
        assert self.taken is not None
        fd = self.fds[self.taken]
        self.fds[self.taken] = -1
        self.close()
        return fd

    def close(self) -> None:
        for fd in self.fds:
            if fd >= 0:
                os.close(fd)
        self.fds = []
        if self._watch is not None:
            self._watch.close()
            self._watch = None
