"""The controlling terminal of an interactive pearing-run, handed to COMMAND and back."""

from __future__ import annotations

import contextlib
import os
import signal

# How often a wrapper on a terminal looks for a stopped COMMAND (^Z).
JOB_CONTROL_POLL = 0.1


class Terminal:
    """The controlling terminal, when pearing-run runs in its foreground (typed in a shell).

    COMMAND runs in a process group of its own (so signals reach all of it), which a
    terminal treats as a background job: reading would stop it (SIGTTIN). So, as a shell
    does, the terminal's foreground goes to COMMAND's group and comes back afterwards;
    ^C and ^Z then reach COMMAND, as with flock(1).
    """

    def __init__(self) -> None:
        self.fd = -1
        try:
            if os.isatty(0) and os.tcgetpgrp(0) == os.getpgrp():
                self.fd = 0
        except OSError:
            pass

    def give(self, pgid: int) -> None:
        if self.fd < 0:
            return
        with contextlib.suppress(OSError):
            os.tcsetpgrp(self.fd, pgid)
        # It may have tried the terminal before it was its own (and been stopped for it).
        _killpg(pgid, signal.SIGCONT)

    def take_back(self) -> None:
        if self.fd < 0:
            return
        # We are a background group of this terminal now: tcsetpgrp would stop us (SIGTTOU).
        old = signal.signal(signal.SIGTTOU, signal.SIG_IGN)
        try:
            with contextlib.suppress(OSError):
                os.tcsetpgrp(self.fd, os.getpgrp())
        finally:
            signal.signal(signal.SIGTTOU, old)


def _killpg(pgid: int, sig: int) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pgid, sig)
