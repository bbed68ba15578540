"""Process identity: a pid plus its start time, so PID reuse cannot fool us.

On Linux the start time is read straight from /proc (a few microseconds and no
import); elsewhere psutil answers. ``pearing-guard verify`` runs this on every
guarded write, which is why psutil is not imported on Linux.
"""

from __future__ import annotations

import os

from singleflight.core.const import TYPE_CHECKING

if TYPE_CHECKING:
    from collections.abc import Callable
    from typing import Final

_PROC_STAT: Final = "/proc/{}/stat"


def _stat_fields(data: bytes) -> list[bytes]:
    """The fields of a /proc/PID/stat line from the state on (state, ppid, pgrp, ...). The
    command name (field 2) may hold spaces and parens: split after the last ')'."""
    return data[data.rindex(b")") + 2 :].split()


def start_time(pid: int) -> int | None:
    """An opaque start stamp of ``pid``, or None when no such process exists."""
    if pid <= 0:
        return None
    try:
        with open(_PROC_STAT.format(pid), "rb") as f:
            data = f.read()
    except FileNotFoundError:
        return None
    except OSError:
        return _psutil_start(pid)
    fields = _stat_fields(data)
    if fields[0] in (b"Z", b"X"):
        return None  # a zombie has finished; it only waits to be reaped
    return int(fields[19])


def _psutil_start(pid: int) -> int | None:
    import psutil

    try:
        proc = psutil.Process(pid)
        if proc.status() == psutil.STATUS_ZOMBIE:
            return None
        return int(proc.create_time() * 100)
    except psutil.Error:
        return None


def alive(pid: int | None, stamp: int | None) -> bool:
    """True when ``pid`` runs and is the very process that was recorded."""
    return pid is not None and stamp is not None and start_time(pid) == stamp


_boot_id: str | None = None


def boot_id() -> str:
    """Monotonic deadlines are only comparable within one boot (read once: a process lives in one)."""
    global _boot_id
    if _boot_id is None:
        try:
            with open("/proc/sys/kernel/random/boot_id") as f:
                _boot_id = f.read().strip()
        except OSError:
            _boot_id = ""
    return _boot_id


def signal_exact(pid: int | None, stamp: int | None, sig: int) -> bool:
    """Send ``sig`` to ``pid`` only if it is still the process recorded with ``stamp``.

    The check and the signal go through one pidfd, so a pid reused in between
    is never signalled. True if the signal was sent.
    """
    import signal

    if pid is None or stamp is None or pid <= 0 or pid == os.getpid():
        return False
    try:
        fd = os.pidfd_open(pid)
    except OSError:
        return False
    try:
        if start_time(pid) != stamp:
            return False
        signal.pidfd_send_signal(fd, sig)
        return True
    except OSError:
        return False
    finally:
        os.close(fd)


def poke_and_wait(pid: int | None, stamp: int | None, sig: int | None, within: float) -> None:
    """Signal the process recorded as (``pid``, ``stamp``) (None: no signal, it has been told)
    and wait until it exits, at most ``within`` seconds: a holder told its ticket ended lets go
    of the lock, then exits."""
    import select

    if pid is None or not alive(pid, stamp):
        return
    try:
        pidfd = os.pidfd_open(pid)
    except OSError:
        return
    try:
        if sig is None or signal_exact(pid, stamp, sig):
            select.select([pidfd], [], [], within)
    finally:
        os.close(pidfd)


def ensure_std_fds() -> None:
    """Open /dev/null on any of fds 0-2 that is closed, so no fd of ours ever lands there.

    Started with stdio closed (a daemon, a supervisor), the lock file would be
    opened as fd 0, and detaching (dup2 of /dev/null onto 0-2) would close it:
    the flock gone while the ticket still reads held.
    """
    for fd in (0, 1, 2):
        try:
            os.fstat(fd)
        except OSError:
            null = os.open(os.devnull, os.O_RDWR)  # the lowest free fd: this one
            if null != fd:
                os.dup2(null, fd, inheritable=True)
                os.close(null)


def group_alive(pgid: int) -> bool:
    """Does process group ``pgid`` still have a member that is not a zombie?

    Scans /proc (a rare path: after a SIGKILL of the group). killpg(pgid, 0) is not
    enough: it succeeds for a group of zombies, which an init that does not reap
    (some containers) leaves forever.
    """
    try:
        names = os.listdir("/proc")
    except OSError:
        return False
    for name in names:
        if not name.isdigit():
            continue
        try:
            with open(_PROC_STAT.format(name), "rb") as f:
                data = f.read()
        except OSError:
            continue
        fields = _stat_fields(data)
        if int(fields[2]) == pgid and fields[0] not in (b"Z", b"X"):
            return True
    return False


def boot_ticks() -> int:
    """Now, on the clock of a process's start time in /proc/PID/stat: clock ticks since boot
    (CLOCK_BOOTTIME, floored as the kernel floors a start). 0 where there is no such clock."""
    import time

    if not hasattr(time, "CLOCK_BOOTTIME"):
        return 0
    return time.clock_gettime_ns(time.CLOCK_BOOTTIME) * os.sysconf("SC_CLK_TCK") // 1_000_000_000


def spawned_with_env(name: str, matches: Callable[[bytes], bool], since: int) -> tuple[int, int] | None:
    """(pid, start time) of the root of what a dead parent spawned: a process started at ``since``
    (``boot_ticks``) or later, leading its own process group, whose environment as it was exec'd
    holds ``name`` with a value ``matches`` accepts (the first ``name=``, as getenv reads it),
    and whose parent's does not; the oldest such, or None.

    Only the caller's own processes are read (their /proc directory is ours), each through a
    descriptor of that directory, so a pid reused meanwhile is never read as the process that
    had it, and no link is followed: for rare paths only."""
    prefix = name.encode() + b"="
    me = os.geteuid()
    found: dict[int, tuple[int, int, int]] = {}  # pid: (parent, group, start time)
    for d in os.listdir("/proc"):
        if not d.isdigit():
            continue
        try:
            at = os.open(f"/proc/{d}", os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC)
        except OSError:  # gone
            continue
        try:
            if os.fstat(at).st_uid != me:
                continue  # another user's: not ours to read, and never what we spawned
            fields = _stat_fields(_read_at(at, "stat"))
            start = int(fields[19])
            if fields[0] in (b"Z", b"X") or start < since:
                continue
            env = _read_at(at, "environ")
        except (OSError, ValueError, IndexError):  # gone, or not ours to read after all
            continue
        finally:
            os.close(at)
        value = next((e[len(prefix) :] for e in env.split(b"\0") if e.startswith(prefix)), None)
        if value is not None and matches(value):
            found[int(d)] = (int(fields[1]), int(fields[2]), start)
    roots = [(start, pid) for pid, (parent, group, start) in found.items() if parent not in found and group == pid]
    return (min(roots)[1], min(roots)[0]) if roots else None


def _read_at(directory: int, name: str) -> bytes:
    fd = os.open(name, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=directory)
    try:
        chunks = []
        while chunk := os.read(fd, 65536):
            chunks.append(chunk)
        return b"".join(chunks)
    finally:
        os.close(fd)


def ignored_at_start(signals: tuple[int, ...]) -> frozenset[int]:
    """Which of ``signals`` this process was started with ignored (nohup's SIGHUP; SIGINT and
    SIGQUIT in a shell's background job), asked before anything here handles them. A wrapper
    keeps those ignored, in itself and in what it starts, as they would be without it."""
    import signal  # the wrappers' (pearing-run, pearing-guard exec), not pearing-guard verify's

    return frozenset(sig for sig in signals if signal.getsignal(sig) == signal.SIG_IGN)
