"""A COMMAND that logs its interval for the hardening tests.

    python interval_cmd.py LOG NAME SECONDS [TRAP [UNTIL]]

Appends "NAME start T" at once and "NAME end T" when it exits (T: CLOCK_MONOTONIC, shared by
every process of the host), one O_APPEND write per line. It runs SECONDS, or until the file
UNTIL exists (the test's gate: a run held until the test has set up what it needs, however
slow the machine); on SIGTERM it takes TRAP more seconds before it exits: the window where a
second COMMAND could slip in.
"""

from __future__ import annotations

import os
import signal
import sys
import time


def note(log: str, name: str, what: str) -> None:
    fd = os.open(log, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    try:
        os.write(fd, f"{name} {what} {time.monotonic()}\n".encode())
    finally:
        os.close(fd)


def main() -> None:
    log, name, seconds = sys.argv[1], sys.argv[2], float(sys.argv[3])
    trap = float(sys.argv[4]) if len(sys.argv) > 4 else 0.0
    until = sys.argv[5] if len(sys.argv) > 5 else None

    def on_term(signum: int, frame: object) -> None:
        time.sleep(trap)
        note(log, name, "end")
        os._exit(0)

    if trap:
        signal.signal(signal.SIGTERM, on_term)
    note(log, name, "start")
    end = time.monotonic() + seconds
    while until is not None and not os.path.exists(until) and time.monotonic() < end:
        time.sleep(0.01)
    time.sleep(0 if until is not None else seconds)
    note(log, name, "end")


if __name__ == "__main__":
    main()
