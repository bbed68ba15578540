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

    def spawn(self, argv: list[str], env: dict[str, str], sigdef: tuple[int, ...]) -> int:
        """COMMAND in a process group of its own that owns the terminal before COMMAND's first
        instruction, as a shell's child does (both it and the shell call setpgid and tcsetpgrp,
        so whichever runs first, it is so). Handed the terminal after posix_spawn returned, a
        COMMAND quick to read did so as a background group: where SIGTTIN is ignored (a caller
        may leave it so to its children) the read failed (EIO) instead of waiting. posix_spawn
        runs no code of ours in the child, so this path forks; it is the terminal's only. The
        child's exec error (its errno) comes back over a close-on-exec pipe, raised here as
        posix_spawnp raises it: 126/127 and their one line as before."""
        report_r, report_w = os.pipe2(os.O_CLOEXEC)
        try:
            pid = os.fork()
            if pid == 0:
                _exec_in_foreground(self.fd, argv, env, sigdef, report_w)
            os.close(report_w)
            report_w = -1
            with contextlib.suppress(OSError):  # whichever of us comes first; EACCES once it exec'd
                os.setpgid(pid, pid)
            report = _read_to_eof(report_r)  # EOF: it exec'd COMMAND (or died)
        finally:
            os.close(report_r)
            if report_w >= 0:
                os.close(report_w)
        if report:
            os.waitpid(pid, 0)
            errno = int.from_bytes(report[:4], "little")
            raise OSError(errno, os.strerror(errno))  # FileNotFoundError for ENOENT, as posix_spawnp
        return pid

    def give(self, pgid: int) -> None:
        """Back to COMMAND's group, stopped with us (^Z), as ``fg`` continues us: it continues too."""
        if self.fd < 0:
            return
        with contextlib.suppress(OSError):
            os.tcsetpgrp(self.fd, pgid)
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


def _exec_in_foreground(tty: int, argv: list[str], env: dict[str, str], sigdef: tuple[int, ...], report: int) -> None:
    """In the forked child; never returns. The wrapper has one thread, so its child may run
    Python after the fork; it keeps to a few system calls. PATH is searched as COMMAND's
    environment has it (ours, with PEARING_* added), the errors as posix_spawnp's."""
    code = 127
    try:
        os.setpgid(0, 0)
        # A background group asking for the foreground gets SIGTTOU unless it is blocked.
        mask = signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGTTOU})
        with contextlib.suppress(OSError):  # a terminal hung up meanwhile: COMMAND runs anyway
            os.tcsetpgrp(tty, os.getpid())
        signal.pthread_sigmask(signal.SIG_SETMASK, mask)
        for sig in sigdef:
            signal.signal(sig, signal.SIG_DFL)
        os.execvpe(argv[0], argv, env)
    except OSError as exc:
        code = 127 if isinstance(exc, FileNotFoundError) else 126
        with contextlib.suppress(OSError):
            os.write(report, (exc.errno or 0).to_bytes(4, "little"))
    finally:
        os._exit(code)


def _read_to_eof(fd: int) -> bytes:
    data = b""
    while chunk := os.read(fd, 64):
        data += chunk
    return data
