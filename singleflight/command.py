"""COMMAND as pearing-run's wrapper runs it: spawned in a process group of its own with the run's
environment, the wrapper's signals forwarded to the group, the terminal handed to it and back
(job control: ^Z stops the run as one job), and its end waited for while the holder's words
are heard."""

from __future__ import annotations

import os
import select
import signal

from singleflight.core import fault, proc, protocol
from singleflight.core.const import (
    ENV_FENCE,
    ENV_LOCK,
    ENV_LOCK_DIR,
    ENV_PROMOTED,
    ENV_REPO,
    ENV_TICKET,
    ENV_TOKEN,
    ENV_TOKEN_FILE,
    TYPE_CHECKING,
    ExitCode,
)
from singleflight.core.group import killpg
from singleflight.core.tty import JOB_CONTROL_POLL, Terminal

if TYPE_CHECKING:
    from collections.abc import Callable

    from singleflight.backend import Grip
    from singleflight.core.log import Log
    from singleflight.core.protocol import Channel, Taken
    from singleflight.core.reasons import Loss
    from singleflight.core.ticket import Ticket
    from singleflight.runopts import RunOptions

FORWARDED_SIGNALS = (
    signal.SIGINT,
    signal.SIGTERM,
    signal.SIGHUP,
    signal.SIGQUIT,
    signal.SIGUSR1,
    signal.SIGUSR2,
)
# Python ignores SIGPIPE (and we catch the forwarded ones); COMMAND starts with defaults.
_DEFAULT_IN_CHILD = (*FORWARDED_SIGNALS, signal.SIGPIPE, signal.SIGXFSZ, signal.SIGALRM)


def command_env(o: RunOptions, ticket: Ticket, taken: Taken) -> dict[str, str]:
    """The environment COMMAND (and --skip-if) runs with: SPEC.md's PEARING_* and the backend's own."""
    env = dict(os.environ)
    env.update(
        {
            ENV_LOCK: o.job,
            ENV_REPO: o.repo,
            ENV_TICKET: ticket.ticket_id,
            ENV_FENCE: str(taken.fence),
            ENV_TOKEN: taken.token,
            ENV_TOKEN_FILE: taken.token_file,
            ENV_LOCK_DIR: o.lock_dir,
            ENV_PROMOTED: "1" if ticket.promoted else "0",
        }
    )
    env.update(taken.env)
    return env


class Child:
    """The process the wrapper runs: COMMAND, or the --skip-if check before it."""

    def __init__(self, log: Log) -> None:
        self.log = log
        self.pid: int | None = None
        self.pending: list[int] = []  # signals that came before COMMAND existed
        self.tty = Terminal()
        self.default_in_child: tuple[int, ...] = _DEFAULT_IN_CHILD

    def trap_signals(self) -> None:
        # One ignored when we started (nohup's SIGHUP, a background job's SIGINT) stays ignored,
        # here and in COMMAND: ``nohup pearing-run ...`` survives a hangup as ``nohup COMMAND`` does.
        kept = proc.ignored_at_start(FORWARDED_SIGNALS)
        self.default_in_child = tuple(sig for sig in _DEFAULT_IN_CHILD if sig not in kept)
        for sig in FORWARDED_SIGNALS:
            if sig not in kept:
                signal.signal(sig, self.forward)

    def spawn(self, argv: list[str], env: dict[str, str], chan: Channel) -> int:
        """COMMAND in its own process group; -126/-127 when it cannot be started."""
        # Killed between the spawn and ``started``, we leave the holder a hint to find it by: that
        # COMMAND starts no earlier than now, on the clock /proc gives its start on.
        chan.send(protocol.spawning(proc.boot_ticks()))
        fault.pause("pause-command-spawn")
        try:
            if self.tty.fd >= 0:
                pid = self.tty.spawn(argv, env, self.default_in_child)
            else:  # the common path, and the faster: no fork of this process
                pid = os.posix_spawnp(argv[0], argv, env, setpgroup=0, setsigdef=self.default_in_child)
        except OSError as exc:
            code = ExitCode.NOTFOUND if isinstance(exc, FileNotFoundError) else ExitCode.NOEXEC
            what = "not found" if code == ExitCode.NOTFOUND else "not executable"
            self.log.error(f"command {what}: {argv[0]}: {exc.strerror}")
            return -int(code)
        self.pid = pid
        fault.point("after-command-spawn")
        # No tty.give here: a terminal is COMMAND's since before its exec. Given again now, with a
        # SIGCONT, it would undo what COMMAND did meanwhile: a ^Z, a job of its own in front.
        chan.send(protocol.started(pid, proc.start_time(pid) or 0))
        for sig in self.pending:
            killpg(pid, sig)
        self.pending.clear()
        return pid

    def forward(self, signum: int, frame: object) -> None:
        if self.pid is not None:
            killpg(self.pid, signum)
        else:
            self.pending.append(signum)

    def wait(
        self,
        pid: int,
        chan: Channel,
        grip: Grip | None,
        on_lost: Callable[[Loss], None],
        on_holder_gone: Callable[[int], None],
    ) -> int | None:
        """Wait for the child while listening to the holder; its exit code (128+N for signal N).

        A ``lost`` word goes to ``on_lost``; the holder's end of the pipe closing (it died) to
        ``on_holder_gone``, which stops the child.
        """
        pidfd = os.pidfd_open(pid)
        poller = select.poll()
        poller.register(pidfd, select.POLLIN)
        poller.register(chan.rfd, select.POLLIN)
        # An etcd lease is kept alive by the wrapper too, whatever the heartbeat mode (heartbeats
        # are recorded apart from it): a holder frozen (SIGSTOP, a swap storm) must not let the
        # lease lapse into a second COMMAND while ours runs.
        try:
            while True:
                every = grip.keep() if grip is not None else None  # sends only once it is due
                if self.tty.fd >= 0:
                    every = min(every or JOB_CONTROL_POLL, JOB_CONTROL_POLL)  # a pidfd says nothing of stops
                events = poller.poll(None if every is None else max(1, int(every * 1000)))
                if not events and self.tty.fd >= 0 and (code := self._relay_stop(pid)) is not None:
                    return code
                for fd, _ev in events:
                    if fd == pidfd:
                        _, status = os.waitpid(pid, 0)
                        return self._ended(status)
                    chan.fill()
                    for msg in chan.messages():
                        if msg.loss is not None:
                            on_lost(msg.loss)
                    if chan.eof:
                        poller.unregister(chan.rfd)
                        on_holder_gone(pid)
        finally:
            os.close(pidfd)

    def _ended(self, status: int) -> int:
        """The child's exit status as a shell reports it (128+N for signal N); the terminal comes back."""
        self.pid = None
        self.tty.take_back()
        code = os.waitstatus_to_exitcode(status)
        return 128 - code if code < 0 else code

    def _relay_stop(self, pid: int) -> int | None:
        """^Z stopped COMMAND: stop ourselves too, so the shell regains the terminal; on ``fg``
        give it back and continue COMMAND (as if it were one job, like flock(1)'s child)."""
        wpid, status = os.waitpid(pid, os.WUNTRACED | os.WNOHANG)
        if wpid != pid:
            return None
        if not os.WIFSTOPPED(status):
            return self._ended(status)
        self.tty.take_back()
        os.kill(os.getpid(), signal.SIGSTOP)  # the shell sees its job stopped; `fg` continues us
        self.tty.give(pid)
        return None
