"""Process identity: a pid plus its start time, so PID reuse cannot fool us.

On Linux the start time is read straight from /proc (a few microseconds and no
import); elsewhere psutil answers. ``pearing-guard verify`` runs this on every
guarded write, which is why psutil is not imported on Linux.
"""

from __future__ import annotations

from typing import Final

_PROC_STAT: Final = "/proc/{}/stat"


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
    # The command name (field 2) may hold spaces and parens: split after the last ')'.
    fields = data[data.rindex(b")") + 2 :].split()
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


def boot_id() -> str:
    """Monotonic deadlines are only comparable within one boot."""
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            return f.read().strip()
    except OSError:
        return ""
