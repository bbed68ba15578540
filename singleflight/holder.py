"""The detached holder: owns the lock, the lease and its TTL, on any backend.

Started by ``pearing-run`` (a fork, to keep the hot path short) or as the agent
of ``pearing-cli acquire-lock`` / ``pearing-mcp`` / ``Lock`` (an exec of
``python -m singleflight.agent``). It lives in its own session, with
stdin/stdout/stderr on /dev/null and no other inherited fd, so cron's pipe sees
EOF when the job ends and a terminal's ^C does not reach it. The lock fd lives
only here and (close-on-exec) in the wrapper: COMMAND never inherits it.
"""

from __future__ import annotations

import contextlib
import os
import select
import signal
import time

from singleflight.core import fault, group, protocol
from singleflight.core.const import EXPIRED, RELEASED, TYPE_CHECKING
from singleflight.core.errors import NotHeld, PearingError
from singleflight.core.protocol import Channel
from singleflight.core.reasons import EndReason, Loss
from singleflight.core.tokens import TokenFiles
from singleflight.core.watched import Watched
from singleflight.rules import events
from singleflight.rules.requests import prepare_end, record_end

if TYPE_CHECKING:
    from typing import NoReturn

    from singleflight.backend import Lease, LockOps, Opened

# Signals that end the lease early, as a lost lease (the run must stop).
_STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP)
# Blocked from the fork until Holder() has its handlers in place.
HOLDER_SIGNALS = frozenset({signal.SIGUSR1, *_STOP_SIGNALS})
# poll() takes an int of milliseconds: a ten-year lease must not overflow it.
_MAX_POLL_MS = 2**31 - 1
# What a SIGKILL and the reaping of COMMAND's group take, at most: a stop racing the store's
# expiry of the lease sends KILL at least this long before it.
_KILL_SLACK = 0.25


class HolderConfig:
    __slots__ = (
        "dedupe_window",
        "heartbeat_auto",
        "kill_grace",
        "max_runtime",
        "owned_by_wrapper",
        "record_success",
        "request_uuid",
    )

    def __init__(
        self,
        *,
        heartbeat_auto: bool,
        max_runtime: float | None = None,
        kill_grace: float = 0.0,
        request_uuid: str | None = None,
        dedupe_window: float = 0.0,
        owned_by_wrapper: bool = True,
        record_success: bool = False,
    ) -> None:
        self.heartbeat_auto = heartbeat_auto
        self.max_runtime = max_runtime
        self.kill_grace = kill_grace
        self.request_uuid = request_uuid
        self.dedupe_window = dedupe_window
        # pearing-run's holder: the wrapper's end of the channel closing before COMMAND
        # started means it died, so release; its COMMAND is stopped on loss. An agent's
        # owner (a CLI call) may hang up at any time; a Lock's process is never signalled.
        self.owned_by_wrapper = owned_by_wrapper
        # --min-interval: a success's start is recorded before the lock is released, so a
        # waiter promoted next sees it and is deduplicated.
        self.record_success = record_success


def detach(keep: set[int]) -> None:
    """Leave the caller's session and let go of every fd it gave us."""
    assert not keep & {0, 1, 2}, "fds the holder keeps live above 2 (ensure_std_fds first)"
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


def _renewing(cfg: HolderConfig, cmd: Watched) -> bool:
    """Auto heartbeat while the wrapper runs (pearing-run), or while the Lock's block runs."""
    if not cfg.heartbeat_auto or cmd.done:
        return False
    return cfg.owned_by_wrapper or cmd.pid is not None


class Holder:
    """The lease loop. ``serve`` never returns: the holder exits when the lease ends."""

    def __init__(self, at: Opened, lk: LockOps, lease: Lease, cfg: HolderConfig, chan: Channel | None) -> None:
        self.backend, self.lk, self.lease, self.cfg, self.chan = at.backend, lk, lease, cfg, chan
        self.tokens = TokenFiles.at(at.lock_dir, lease.ticket.repo, lease.ticket.lock_name)
        self.tokens.ready()  # its file goes between the token's end and the release: no opens then
        self.cmd = Watched()
        self._first_lease = False  # renew once, as COMMAND starts (manual heartbeat)
        self._taken_expiry = lease.ticket.lease_expires_at  # as taken: no beat has moved it yet
        self.wake_r, wake_w = os.pipe2(os.O_NONBLOCK | os.O_CLOEXEC)
        signal.set_wakeup_fd(wake_w)
        for sig in HOLDER_SIGNALS:
            signal.signal(sig, _ignore)
        signal.signal(signal.SIGPIPE, signal.SIG_IGN)
        signal.pthread_sigmask(signal.SIG_UNBLOCK, HOLDER_SIGNALS)  # what came meanwhile is handled now

    # -- the loop ----------------------------------------------------------

    def serve(self) -> NoReturn:
        try:
            self._serve()
        except PearingError as exc:
            # A renewal refused (a frozen holder woken after its lease), a corrupt record:
            # whatever it is, the way out is the loss sequence, never a bare exit.
            self.lose(Loss(EndReason.REFUSED, text=str(exc)))
        except BaseException as exc:  # noqa: BLE001 - never leave without stopping COMMAND first
            self.lose(Loss(EndReason.INTERNAL, repr(exc)))

    def _serve(self) -> NoReturn:
        if self.cfg.request_uuid:
            prepare_end(self.backend, self.lease.ticket, self.cfg.dedupe_window)
        started = time.monotonic()
        max_deadline = started + self.cfg.max_runtime if self.cfg.max_runtime else None
        renew_every = max(self.lease.ticket.lease_seconds / 3.0, 0.05)
        renew_at = started + renew_every
        poller = select.poll()
        poller.register(self.wake_r, select.POLLIN)
        if self.chan is not None and self.chan.rfd >= 0:
            poller.register(self.chan.rfd, select.POLLIN)
        while True:
            now = time.monotonic()
            deadlines = [self.lease.ticket.lease_deadline_mono or now]
            if max_deadline is not None:
                deadlines.append(max_deadline)
            if _renewing(self.cfg, self.cmd):
                deadlines.append(renew_at)
            timeout_ms = min(_MAX_POLL_MS, max(0, int((min(deadlines) - now) * 1000) + 1))
            # The backend's news for the lease (an etcd holder's key changed: a cancel request).
            # Registered for this poll only: ``check`` may close it, and its number be reused.
            news = self.lease.wake_fd()
            if news is not None:
                poller.register(news, select.POLLIN)
            try:
                ready = poller.poll(timeout_ms)
            finally:
                if news is not None:
                    poller.unregister(news)
            # COMMAND's end first: a cancel request (a poke, the watch) that came in the same
            # wake-up must find it ended, and a run whose COMMAND already exited is not cancelled.
            ready.sort(key=lambda r: r[0] in (self.wake_r, news))
            for fd, _ev in ready:
                if fd == self.wake_r:
                    self._on_signals(os.read(self.wake_r, 64))
                elif self.chan is not None and fd == self.chan.rfd:
                    self.chan.fill()
                    if self.chan.eof:
                        poller.unregister(fd)
                    self._on_messages(poller)
                elif fd == self.cmd.fd:
                    poller.unregister(fd)
                    self.cmd.done = True
                    if self.chan is None or self.chan.eof:
                        # The wrapper was killed (or the Lock's process died): status unknown.
                        self.finish(None)
                    if not self.cfg.owned_by_wrapper:
                        # The Lock's process died, and a child it forked may keep a copy of its
                        # end of the pipe open: no EOF to wait for. An 'exited' it sent first counts.
                        self._drain(poller)
                        self.finish(None)
                elif fd == news:
                    self._check_lease()
            now = time.monotonic()
            # A deadline is checked before any renewal: a holder frozen past its lease
            # (SIGSTOP, a paused VM) must lose it, never renew a lapsed lease.
            if (self.lease.ticket.lease_deadline_mono or 0) <= now:
                self._check_lease()
            if max_deadline is not None and now >= max_deadline:
                self.lose(Loss(EndReason.MAX_RUNTIME, self.cfg.max_runtime))
            if self._first_lease:
                self._first_lease = False
                # Unless COMMAND has beaten already (its pearing-cli can land before we hear it
                # started): its beat stands, length and deadline (SPEC: the lease now runs N s).
                # (An etcd line's record shows no expiry until its holder settles: no beat yet.)
                self._check_lease()
                if self.lease.ticket.lease_expires_at in (None, self._taken_expiry):
                    self.lease.renew()
            elif _renewing(self.cfg, self.cmd) and now >= renew_at:
                self.lease.renew()
                renew_at = now + renew_every

    def _on_signals(self, sigs: bytes) -> None:
        for sig in sigs:
            if sig in _STOP_SIGNALS:
                self.lose(Loss(EndReason.STOPPED, signal.Signals(sig).name))
        if signal.SIGUSR1 in sigs:
            self._check_lease()

    def _on_messages(self, poller: select.poll) -> None:
        assert self.chan is not None
        for msg in self.chan.messages():
            if msg.kind == protocol.SPAWNING:
                self.cmd.spawning = msg.stamp
            elif msg.kind == protocol.STARTED:
                self.cmd.started(msg.pid, msg.stamp, poller)
                # --heartbeat manual: COMMAND's first lease period is its own, from its start;
                # the spawn (slow on a busy machine) does not eat the slack of its first beat.
                self._first_lease = not self.cfg.heartbeat_auto
            elif msg.kind == protocol.EXITED:
                self.cmd.done = True
                self.finish(msg.status)
        if self.chan.eof and self.cmd.spawning is not None:
            self._find_spawned(poller)
        if self.chan.eof and (self.cmd.pid is None or self.cmd.done):
            # The owner is gone and so is what it ran: pearing-run died before COMMAND started
            # or after it ended; a Lock's process died inside its block, or before it began
            # (an agent reads a channel only from an owner that answers for the ticket).
            self.finish(None)

    def _drain(self, poller: select.poll) -> None:
        """What the owner sent before it went, without blocking."""
        chan = self.chan
        if chan is not None and chan.rfd >= 0 and not chan.eof and select.select([chan.rfd], [], [], 0)[0]:
            chan.fill()
            self._on_messages(poller)

    def _find_spawned(self, poller: select.poll | None) -> None:
        self.cmd.find_spawned(self.lease.ticket.token_hash, self.lease.keep, poller)

    def _check_lease(self) -> None:
        """At the deadline, or when poked: still ours? A heartbeat may have extended it."""
        lost = self.lease.check()
        if lost is not None and lost.superseded:
            lost = self._superseded()
        if lost is not None and lost.released and (self.cmd.pid is None or not self.cfg.owned_by_wrapper):
            self.finish_released()  # pearing-cli release-lock-ticket
        if lost is not None:
            self.lose(lost)

    def _superseded(self) -> Loss | None:
        """A newer run that opted in asked us to stop: the loss, or None when no request stands
        once our guarded commands are done (``rules.events.act``: its newcomer left or died,
        or our COMMAND has ended, and then the run ends as it would have: a success is one)."""
        by = events.act(self.lk, self.lease, command_ended=self.cmd.ended, keep=self._keep_guarded)
        if by is None:
            # Cleared in the store: a renewal must not write our copy of the request back.
            self.lease.ticket.superseded_by = None
            return None
        return Loss(EndReason.SUPERSEDED, by)

    def _keep_guarded(self) -> None:
        """While a cancel waits for our guarded commands: the lease as the loop would keep it."""
        if _renewing(self.cfg, self.cmd):
            self.lease.renew()
        else:
            self.lease.keep()

    # -- endings -----------------------------------------------------------

    def lose(self, loss: Loss) -> NoReturn:
        """Ownership lost: token dead first, then COMMAND stopped, then the lock freed."""
        with contextlib.suppress(PearingError):
            self.lease.end(EXPIRED, loss.text)
        if self.chan is not None:
            self.chan.send(protocol.lost(loss))
        with contextlib.suppress(PearingError):
            self.tokens.remove(self.lease.ticket.ticket_id)
        if self.cfg.owned_by_wrapper and self.cmd.pid is None:
            self._await_command()
        self._stop_command(loss.lapse_at)
        self._release_lock_and_exit()

    def _await_command(self) -> None:
        """Lost before COMMAND started: the wrapper may be spawning it right now. Hear which it
        is, COMMAND started (then it is stopped) or never will be, before the lock goes."""
        chan = self.chan
        while chan is not None and not chan.eof:
            msg = chan.recv_until(time.monotonic() + group.KEEP_EVERY)
            self.lease.keep()
            if msg is None:
                continue
            if msg.kind == protocol.SPAWNING:
                self.cmd.spawning = msg.stamp
            elif msg.kind == protocol.STARTED:
                self.cmd.started(msg.pid, msg.stamp, None)
                return
            elif msg.kind == protocol.EXITED:
                return
        if self.cmd.spawning is not None:
            self._find_spawned(None)

    def finish(self, status: int | None) -> NoReturn:
        """COMMAND ended (or the CLI owner released): record, release, hand over."""
        fault.point("before-finish")
        fault.pause("pause-before-finish")
        failed: PearingError | None = None
        try:
            window = self.cfg.dedupe_window if self.cfg.request_uuid else None
            record_end(self.backend, self.lease.ticket, status, window=window, success=self.cfg.record_success)
        except PearingError as exc:
            failed = exc
        reason = EndReason.COMMAND_ENDED.text() if status is None else EndReason.COMMAND_EXITED.text(status)
        try:
            self.lease.end(RELEASED, reason)
        except NotHeld:
            raise  # the lease went before COMMAND's end was recorded: a loss (124), as ever
        except PearingError as exc:
            # The store took no write (a full disk, a read-only lock dir): COMMAND has ended
            # all the same, so this is no lost lease (124) but the store's error. The token dies
            # with this holder (the guard judges a dead holder's ticket dead) and is removed.
            failed = failed or exc
        if failed is not None and status == 0 and self.chan is not None:
            # A failed run is retried anyway; a success whose end could not be recorded must
            # not pass for one that was: pearing-run exits with this error, naming the path.
            self.chan.send(protocol.error(failed.exit_code, str(failed)))
        fault.point("mid-release")
        self.finish_released()

    def finish_released(self) -> NoReturn:
        with contextlib.suppress(PearingError):
            self.tokens.remove(self.lease.ticket.ticket_id)
        self._release_lock_and_exit()

    def _stop_command(self, lapse_at: float | None = None) -> None:
        """SIGTERM, SIGKILL after the grace (``_grace``), and wait until the group is gone: only
        then may the lock change hands. The lock is kept ours meanwhile (a lease kept alive)."""
        if self.cmd.pid is not None and self.cfg.owned_by_wrapper:
            grace = _grace(self.cfg.kill_grace, lapse_at)
            group.stop(self.cmd.pid, self.cmd.fd, grace, self.lease.keep, leader_done=self.cmd.done)

    def _release_lock_and_exit(self) -> NoReturn:
        try:
            self.lease.release(self._announce_released)
        finally:
            os._exit(0)

    def _announce_released(self) -> None:
        if self.chan is not None:
            self.chan.send(protocol.Message(protocol.RELEASED))
            self.chan.close()


def _grace(kill_grace: float, lapse_at: float | None) -> float:
    """The kill grace, or less: a store out of reach may expire the lease at ``lapse_at`` and
    promote the next, so COMMAND's group is killed before then (a lease under 3 x (grace + 1.5 s)
    leaves less than the whole grace)."""
    if lapse_at is None:
        return kill_grace
    return max(0.0, min(kill_grace, lapse_at - _KILL_SLACK - time.monotonic()))


def _ignore(signum: int, frame: object) -> None:
    """Handled only through the wakeup fd."""
