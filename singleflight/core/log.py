"""Lifecycle lines: part of the interface, asserted by tests.

One line per event on stderr, only with ``-v``; errors always:

    text:  PROG: EVENT key=value ...        PROG: error: MESSAGE
    json:  {"ts": ..., "level": ..., "prog": ..., "event": ..., "key": value, ...}

A duration (``Seconds``) reads ``24.615s`` in text and is a number of seconds in JSON; ``level``
is the event's syslog level (error, warning, notice, info), the same one journald gets.

Under systemd (JOURNAL_STREAM names our stderr) each line starts with a
``<N>`` priority prefix, so journald files errors and lost leases at the
right level.
"""

from __future__ import annotations

import contextlib
import os
import time

# sd-daemon(3) priorities.
_ERR, _WARNING, _NOTICE, _INFO = 3, 4, 5, 6
_PRIORITY = {"lease-lost": _WARNING, "wait-timeout": _NOTICE, "heartbeat-missed": _WARNING}
_LEVEL = {_ERR: "error", _WARNING: "warning", _NOTICE: "notice", _INFO: "info"}
FORMATS = ("text", "json")


def _journald_stderr() -> bool:
    stream = os.environ.get("JOURNAL_STREAM", "")
    dev, _, ino = stream.partition(":")
    if not (dev.isdigit() and ino.isdigit()):
        return False
    try:
        st = os.fstat(2)
    except OSError:
        return False
    return st.st_dev == int(dev) and st.st_ino == int(ino)


class Seconds(float):
    """A duration in a log line: ``24.615s`` as text, ``24.615`` in JSON."""

    __slots__ = ()

    def __str__(self) -> str:
        return f"{round(float(self), 3):g}s"


class Log:
    def __init__(self, prog: str, verbose: bool = False, fmt: str = "text") -> None:
        self.prog, self.verbose, self.fmt = prog, verbose, fmt
        self.journald = "JOURNAL_STREAM" in os.environ and _journald_stderr()

    def event(self, name: str, **fields: object) -> None:
        if self.verbose:
            self._emit(_PRIORITY.get(name, _INFO), name, fields)

    def error(self, message: str) -> None:
        self._emit(_ERR, "error", {"message": message})

    def refused(self, reason: str) -> None:
        """A refusal is an answer, not an error: ``PROG: refused: REASON``."""
        self._emit(_NOTICE, "refused", {"reason": reason})

    def _emit(self, priority: int, name: str, fields: dict[str, object]) -> None:
        if self.fmt == "json":
            import json

            shown = {k: round(float(v), 3) if isinstance(v, Seconds) else v for k, v in fields.items() if v is not None}
            obj = {"ts": _now(), "level": _LEVEL[priority], "prog": self.prog, "event": name, **shown}
            line = json.dumps(obj)
        elif name in ("error", "refused"):
            line = f"{self.prog}: {name}: {next(iter(fields.values()))}"
        else:
            tail = "".join(f" {k}={v}" for k, v in fields.items() if v is not None)
            line = f"{self.prog}: {name}{tail}"
        if self.journald:
            line = f"<{priority}>{line}"
        with contextlib.suppress(OSError, ValueError):
            # fd 2, not sys.stderr: started with stderr closed, Python sets sys.stderr to None
            # (and pearing-run puts /dev/null on fd 2 before anything else).
            os.write(2, (line + "\n").encode(errors="replace"))


def _now() -> str:
    t = time.time()
    return time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(t)) + f".{int(t % 1 * 1000):03d}Z"
