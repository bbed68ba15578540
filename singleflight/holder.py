"""The detached holder: owns the lock fd, the lease and its TTL.

Started by ``pearing-run`` (a fork, to keep the hot path short) or by
``pearing-cli acquire-lock`` (an exec of ``python -m singleflight.agent``). It
lives in its own session, with stdin/stdout/stderr on /dev/null and no other
inherited fd, so cron's pipe sees EOF when the job ends and a terminal's ^C
does not reach it. The lock fd lives only here: COMMAND never inherits it.
"""

from __future__ import annotations

import contextlib
import os
import select
import signal
import time
from typing import NoReturn, Protocol

from singleflight import lease
from singleflight.core import fault as _fault
from singleflight.core import proc as _proc
from singleflight.core.const import EXPIRED, HELD, RELEASED
from singleflight.core.protocol import Channel
from singleflight.core.ticket import Ticket
from singleflight.store import LockStore

# Signals that end the lease early, as a lost lease (the run must stop).
_STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP)


class HolderConfig:
    __slots__ = ("dedupe_window", "heartbeat_auto", "kill_grace", "max_runtime", "request_uuid")

    def __init__(
        self,
        *,
        heartbeat_auto: bool,
        max_runtime: float | None,
        kill_grace: float,
        request_uuid: str | None,
        dedupe_window: float,
    ) -> None:
        self.heartbeat_auto = heartbeat_auto
        self.max_runtime = max_runtime
        self.kill_grace = kill_grace
        self.request_uuid = request_uuid
        self.dedupe_window = dedupe_window


def detach(keep: set[int]) -> None:
    """Leave the caller's session and let go of every fd it gave us."""
    os.setsid()
    devnull = os.open(os.devnull, os.O_RDWR)
    for fd in (0, 1, 2):
        os.dup2(devnull, fd)
    os.close(devnull)
    max_fd = os.sysconf("SC_OPEN_MAX") if hasattr(os, "sysconf") else 1024
    low = 3
    for fd in sorted(keep):
        os.closerange(low, fd)
        low = fd + 1
    os.closerange(low, max_fd if max_fd > 0 else 1024)


def _pidfd(pid: int, stamp: int | None) -> int | None:
    """A pidfd on COMMAND, or None if it is already gone (or the pid was reused)."""
    try:
        fd = os.pidfd_open(pid)
    except ProcessLookupError:
        return None
    if _proc.start_time(pid) != stamp:
        os.close(fd)
        return None
    return fd


class LeaseDriver(Protocol):
    """What the holder needs of a backend: the lease, the token's liveness, the lock."""

    ticket: Ticket

    def renew(self) -> None:
        """Extend the lease by ``ticket.lease_seconds`` (auto heartbeat)."""

    def check(self) -> str | None:
        """At the deadline or when poked: None if still ours (deadline updated), RELEASED if
        its owner released it, else why it was lost."""

    def end(self, state: str, reason: str) -> None:
        """The token stops being live (after in-flight guarded commands)."""

    def record_request(self, request_uuid: str, status: int | None, window: float) -> None: ...

    def remove_token_file(self) -> None: ...

    def release(self) -> None:
        """Let go of the lock: the next waiter is promoted now."""

    def housekeeping(self) -> None: ...


class LocalLease:
    """The kernel-flock backend: the lock fd, and the ticket records in the lock dir."""

    def __init__(self, store: LockStore, lock_fd: int, ticket: Ticket) -> None:
        self.store, self.lock_fd, self.ticket = store, lock_fd, ticket

    def renew(self) -> None:
        self.ticket = lease.renew(self.store, self.ticket.ticket_id, self.ticket.lease_seconds)

    def check(self) -> str | None:
        with self.store.mutex():
            t = self.store.read_ticket(self.ticket.ticket_id)
        if t is None or t.state != HELD:
            return RELEASED if t is not None and t.state == RELEASED else f"ticket {t.state if t else 'vanished'}"
        self.ticket = t
        return "lease expired" if (t.lease_deadline_mono or 0) <= time.monotonic() else None

    def end(self, state: str, reason: str) -> None:
        lease.end(self.store, self.ticket.ticket_id, state, reason)

    def record_request(self, request_uuid: str, status: int | None, window: float) -> None:
        lease.record_request(self.store, request_uuid, self.ticket, status, window)

    def remove_token_file(self) -> None:
        self.store.remove_token_file(self.ticket.ticket_id)

    def release(self) -> None:
        os.close(self.lock_fd)  # the kernel hands the lock to the head waiter now

    def housekeeping(self) -> None:
        self.store.housekeeping()


class Holder:
    """The lease loop. ``serve`` never returns: the holder exits when the lease ends."""

    def __init__(self, driver: LeaseDriver, cfg: HolderConfig, chan: Channel | None) -> None:
        self.driver, self.cfg, self.chan = driver, cfg, chan
        self.cmd_pid: int | None = None
        self.cmd_fd: int | None = None
        self.cmd_done = False
        self.wake_r, wake_w = os.pipe2(os.O_NONBLOCK | os.O_CLOEXEC)
        os.set_blocking(wake_w, False)
        signal.set_wakeup_fd(wake_w)
        for sig in (signal.SIGUSR1, *_STOP_SIGNALS):
            signal.signal(sig, _ignore)
        signal.signal(signal.SIGPIPE, signal.SIG_IGN)

    # -- the loop ----------------------------------------------------------

    def serve(self) -> None:
        started = time.monotonic()
        max_deadline = started + self.cfg.max_runtime if self.cfg.max_runtime else None
        renew_every = max(self.driver.ticket.lease_seconds / 3.0, 0.05)
        renew_at = started + renew_every
        poller = select.poll()
        poller.register(self.wake_r, select.POLLIN)
        if self.chan is not None and self.chan.rfd >= 0:
            poller.register(self.chan.rfd, select.POLLIN)
        while True:
            now = time.monotonic()
            deadlines = [self.driver.ticket.lease_deadline_mono or now]
            if max_deadline is not None:
                deadlines.append(max_deadline)
            if self.cfg.heartbeat_auto and not self.cmd_done:
                deadlines.append(renew_at)
            timeout_ms = max(0, int((min(deadlines) - now) * 1000) + 1)
            for fd, _ev in poller.poll(timeout_ms):
                if fd == self.wake_r:
                    self._on_signals(os.read(self.wake_r, 64))
                elif self.chan is not None and fd == self.chan.rfd:
                    self.chan.fill()
                    if self.chan.eof:
                        poller.unregister(fd)
                    self._on_messages(poller)
                elif fd == self.cmd_fd:
                    poller.unregister(fd)
                    self.cmd_done = True
                    if self.chan is None or self.chan.eof:
                        # pearing-run was killed: COMMAND's status is unknown.
                        self.finish(None)
            now = time.monotonic()
            if max_deadline is not None and now >= max_deadline:
                self.lose(f"max runtime {self.cfg.max_runtime:g} s reached")
            if self.cfg.heartbeat_auto and not self.cmd_done and now >= renew_at:
                self.driver.renew()
                renew_at = now + renew_every
            if (self.driver.ticket.lease_deadline_mono or 0) <= now:
                self._check_lease()

    def _on_signals(self, sigs: bytes) -> None:
        for sig in sigs:
            if sig in _STOP_SIGNALS:
                self.lose(f"holder stopped by signal {signal.Signals(sig).name}")
        if signal.SIGUSR1 in sigs:
            self._check_lease()

    def _on_messages(self, poller: select.poll) -> None:
        assert self.chan is not None
        for line in self.chan.lines():
            word, _, rest = line.partition(" ")
            if word == "started":
                pid, stamp = (int(x) for x in rest.split())
                if self.cmd_fd is not None:  # the --skip-if check came first
                    if not self.cmd_done:
                        poller.unregister(self.cmd_fd)
                    os.close(self.cmd_fd)
                self.cmd_pid, self.cmd_done = pid, False
                self.cmd_fd = _pidfd(pid, stamp)
                if self.cmd_fd is None:
                    self.cmd_done = True
                else:
                    poller.register(self.cmd_fd, select.POLLIN)
            elif word == "exited":
                self.cmd_done = True
                self.finish(None if rest == "unknown" else int(rest))
        if self.chan.eof and (self.cmd_pid is None or self.cmd_done):
            # pearing-run died before COMMAND started, or after it ended.
            self.finish(None)

    def _check_lease(self) -> None:
        """At the deadline, or when poked: still ours? A heartbeat may have extended it."""
        lost = self.driver.check()
        if lost == RELEASED and self.cmd_pid is None:
            self.finish_released()  # pearing-cli release-lock-ticket
        if lost is not None:
            self.lose(lost)

    # -- endings -----------------------------------------------------------

    def lose(self, reason: str) -> NoReturn:
        """Ownership lost: token dead first, then COMMAND stopped, then the lock freed."""
        self.driver.end(EXPIRED, reason)
        if self.chan is not None:
            self.chan.send(f"lost {reason}")
        self.driver.remove_token_file()
        self._stop_command()
        self._release_lock_and_exit()

    def finish(self, status: int | None) -> NoReturn:
        """COMMAND ended (or the CLI owner released): record, release, hand over."""
        if self.cfg.request_uuid:
            self.driver.record_request(self.cfg.request_uuid, status, self.cfg.dedupe_window)
        reason = "command ended" if status is None else f"command exited {status}"
        self.driver.end(RELEASED, reason)
        _fault.point("mid-release")
        self.finish_released()

    def finish_released(self) -> NoReturn:
        self.driver.remove_token_file()
        self._release_lock_and_exit()

    def _stop_command(self) -> None:
        if self.cmd_pid is None:
            return
        if not self.cmd_done:
            _killpg(self.cmd_pid, signal.SIGTERM)
            if self.cmd_fd is not None:
                select.select([self.cmd_fd], [], [], self.cfg.kill_grace)
        # Whatever is left of the group (the leader or its children) may not go on.
        _killpg(self.cmd_pid, signal.SIGKILL)

    def _release_lock_and_exit(self) -> NoReturn:
        self.driver.release()
        if self.chan is not None:
            self.chan.send("released")
            self.chan.close()
        try:
            self.driver.housekeeping()
        finally:
            os._exit(0)


def _ignore(signum: int, frame: object) -> None:
    """Handled only through the wakeup fd."""


def _killpg(pgid: int, sig: int) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pgid, sig)
