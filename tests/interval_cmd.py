"""A COMMAND that logs its interval for the hardening tests.

    python interval_cmd.py LOG NAME SECONDS [TRAP]

Appends "NAME start T" at once and "NAME end T" when it exits (T: CLOCK_MONOTONIC, shared by
every process of the host), one O_APPEND write per line. It runs SECONDS; on SIGTERM it takes
TRAP more seconds before it exits: the window where a second COMMAND could slip in.
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

    def on_term(signum: int, frame: object) -> None:
        time.sleep(trap)
        note(log, name, "end")
        os._exit(0)

    if trap:
        signal.signal(signal.SIGTERM, on_term)
    note(log, name, "start")
    time.sleep(seconds)
    note(log, name, "end")


if __name__ == "__main__":
    main()
