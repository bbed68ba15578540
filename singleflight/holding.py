"""A run that holds the lock: its holder forked (or handed the grip), COMMAND run with the run's
environment, and the run finished, whichever of wrapper and holder lives to do it. The lock is
released only once COMMAND is dead."""

from __future__ import annotations

import contextlib
import os
import time

from singleflight.core import fault, protocol
from singleflight.core.const import CANCELLED, EXPIRED, RELEASED, TYPE_CHECKING, ExitCode
from singleflight.core.errors import PearingError
from singleflight.core.log import Seconds
from singleflight.core.reasons import EndReason, Loss
from singleflight.core.tokens import TokenFiles

if TYPE_CHECKING:
    from singleflight.backend import Backend, Grip, LockOps
    from singleflight.command import Child
    from singleflight.core.log import Log
    from singleflight.core.protocol import Channel
    from singleflight.core.ticket import Ticket
    from singleflight.runmetrics import RunMetrics
    from singleflight.runopts import RunOptions


class HeldRun:
    def __init__(
        self, o: RunOptions, log: Log, backend: Backend, lk: LockOps, ticket: Ticket, *, metrics: RunMetrics
    ) -> None:
        self.o, self.log, self.backend, self.lk, self.ticket, self.metrics = o, log, backend, lk, ticket, metrics
        self.child: Child | None = None
        self.lost: Loss | None = None
        self.grip: Grip | None = None
        self.started_mono = 0.0
        self.waited = 0.0
        self.standby: Channel | None = None
        self.holder_pid = 0

    def run(self, grip: Grip, *, waited: float, standby: Channel | None, holder_pid: int) -> int:
        o = self.o
        self.waited, self.standby, self.holder_pid = waited, standby, holder_pid
        # Not on the busy path's imports: only a run that holds the lock needs them.
        from singleflight.bootstrap import fork_holder
        from singleflight.command import Child, command_env

        child = self.child = Child(self.log)
        child.trap_signals()
        self.grip = grip
        chan = self._hand_over(grip)
        if chan is None:
            self.holder_pid, chan = fork_holder(o, self.ticket, grip)
        fault.point("after-holder-spawn")
        msg = self._await_ready(chan, grip)
        if msg is not None and msg.loss is not None:
            # Its owner released the ticket as its turn came (``LockOps.take``): COMMAND never
            # starts, and the lock is let go of here (the holder has left without it).
            self._lost(msg.loss)
            return self._finish(chan, 1, self._lost_code(), ran=False)
        if msg is None or msg.kind != protocol.READY:
            return self._holder_failed(msg)
        taken = protocol.Taken.from_info(msg.info)
        self.ticket.fence, self.ticket.acquired_at = taken.fence, time.time()
        self.log.event(
            "acquired",
            lock=o.job,
            repo=o.repo,
            fence=taken.fence,
            ticket=self.ticket.ticket_id,
            waited=Seconds(self.waited),
            promoted=int(self.ticket.promoted),
        )
        env = command_env(o, self.ticket, taken)
        if o.skip_if is not None and not self._heard_lost(chan):
            check = child.spawn(["/bin/sh", "-c", o.skip_if], env, chan)
            status = self._wait_child(check, chan) if check > 0 else None
            if self.lost:
                return self._finish(chan, 1, self._lost_code(), ran=False)
            if status == 0:
                self.log.event("skipped", lock=o.job, reason="skip-if said done")
                self.metrics.record("deduplicated", holding=True)
                return self._finish(chan, 0, 0, ran=False)
        if not self._heard_lost(chan) and not grip.still_ours():
            # Wrapper and holder both frozen past an etcd lease's TTL: it may have lapsed, and
            # the next waiter be running. The holder finds out at its next look.
            self._lost(Loss(EndReason.LAPSED_BEFORE_START))
        if self._heard_lost(chan):
            # The lease was lost before COMMAND could start (a stop signal at the holder's
            # start, a lease shorter than our start-up): never start it.
            return self._finish(chan, 1, self._lost_code(), ran=False)
        self.started_mono = time.monotonic()
        self.metrics.record("start", holding=True)
        pid = child.spawn(o.command, env, chan)
        if pid < 0:
            return self._finish(chan, -pid, -pid)
        status = self._wait_child(pid, chan)
        code = status if status is not None else int(ExitCode.LEASE_LOST)
        return self._finish(chan, code, self._lost_code() if self.lost else code)

    def _await_ready(self, chan: Channel, grip: Grip) -> protocol.Message | None:
        """The holder's first word, keeping the lock meanwhile: a holder frozen right after the
        fork must not let an etcd lease lapse into the next waiter's run before ours starts."""
        while (every := grip.keep()) is not None:
            if (msg := chan.recv_until(time.monotonic() + every)) is not None or chan.eof:
                return msg
        return chan.recv()

    def _hand_over(self, grip: Grip) -> Channel | None:
        """The grip to the holder forked as we started to wait; None if there is none (or it died)."""
        chan, self.standby = self.standby, None
        info, fds = grip.handover() if chan is not None else ({}, set())
        if chan is None or chan.send(protocol.go(info), fds):
            return chan
        chan.close()
        _reap(self.holder_pid)
        return None

    def _wait_child(self, pid: int, chan: Channel) -> int | None:
        assert self.child is not None
        return self.child.wait(pid, chan, self.grip, self._heard, self._holder_vanished)

    def _heard(self, loss: Loss) -> None:
        if self.lost is None:
            self._lost(loss)

    def _heard_lost(self, chan: Channel) -> bool:
        """Has the holder said the lease is lost? Reads what is there, without blocking."""
        import select

        while self.lost is None and not chan.eof and select.select([chan.rfd], [], [], 0)[0]:
            chan.fill()
            for msg in chan.messages():
                if msg.loss is not None:
                    self._lost(msg.loss)
        return self.lost is not None

    def _lost(self, loss: Loss) -> None:
        self.lost = loss
        if loss.superseded:
            # A newer run that opted in to cancel-in-progress asked us to stop: we exit busy.
            by = self.lk.read(self.ticket.ticket_id)
            self.log.event("superseded", lock=self.o.job, by=by.superseded_by if by else None)
            return
        if not self.o.heartbeat_auto and loss.expired:
            # The usual cause with --heartbeat manual: COMMAND stopped heartbeating (hung?).
            self.log.event("heartbeat-missed", lock=self.o.job, lease=Seconds(self.o.lease_seconds))
        self.log.event("lease-lost", lock=self.o.job, reason=loss.text)
        self.metrics.record("lease_lost", holding=True)

    def _lost_code(self) -> int:
        """124, or the busy code when a newer opted-in run cancelled us."""
        if self.lost is not None and self.lost.superseded:
            return self.o.busy_exit_code
        return int(ExitCode.LEASE_LOST)

    def _holder_vanished(self, pid: int) -> None:
        """The holder died (kill -9): the token dies first, then COMMAND is stopped; our grip
        keeps the lock meanwhile and is released only once COMMAND's group is gone (_finish)."""
        if self.lost is not None:
            return  # it said so first: it was stopping COMMAND itself
        self._lost(Loss(EndReason.HOLDER_GONE))
        with contextlib.suppress(PearingError):
            self.lk.end(self.ticket.ticket_id, EXPIRED, EndReason.HOLDER_GONE, release=False)
            self._remove_token(self.ticket.ticket_id)
        from singleflight.core import group

        pidfd = os.pidfd_open(pid)
        try:
            group.stop(pid, pidfd, self.o.kill_grace, self.grip.keep if self.grip is not None else _nothing)
        finally:
            os.close(pidfd)

    def _finish(self, chan: Channel, status: int, exit_code: int, *, ran: bool = True) -> int:
        """Tell the holder COMMAND ended; exit only once the lock is free again."""
        self._let_go()  # COMMAND is dead: only the holder's copy of the lock remains
        # A holder that lost the lease says so before it stops COMMAND: that word is in the
        # pipe already when COMMAND's death is seen first, and the end recorded must agree.
        self._heard_lost(chan)
        ended, duration = time.time(), time.monotonic() - self.started_mono
        chan.send(protocol.exited(status))
        while (msg := chan.recv()) is not None and msg.kind != protocol.RELEASED:
            if msg.loss is not None and self.lost is None:
                self._lost(msg.loss)
                exit_code = self._lost_code()
            elif msg.kind == protocol.ERROR:
                self.log.error(msg.text)
                exit_code = int(msg.code)
        if msg is None and self.lost is None:
            # The holder died after COMMAND ended: finish its bookkeeping here.
            self._release_without_holder(status)
        if msg is None and self.grip is not None:
            self.grip.release()  # no holder to do it, and COMMAND is dead
        chan.close()
        _reap(self.holder_pid)
        code = self._lost_code() if self.lost else exit_code
        if not self.lost:
            self.log.event("released", lock=self.o.job, ticket=self.ticket.ticket_id, status=status)
        # The outcome is settled (request recorded, lock released): a metrics write that waits
        # for its lock now can no longer let the lease lapse into a 124 (SPEC 14).
        self.metrics.after_release((ended, duration, code) if ran else None)
        return code

    def _let_go(self) -> None:
        """COMMAND is dead: our share of the lock goes; the holder's share hands it over."""
        if self.grip is not None:
            self.grip.close()

    def _release_without_holder(self, status: int) -> None:
        """The holder died after COMMAND ended: its end-of-run record, here, the one way."""
        from singleflight.rules.requests import record_end

        tid, o = self.ticket.ticket_id, self.o
        try:
            window = o.dedupe_window if o.request_uuid else None
            record_end(self.backend, self.ticket, status, window=window, success=o.min_interval is not None)
            self.lk.end(tid, RELEASED, EndReason.COMMAND_EXITED.text(status))
            self._remove_token(tid)
        except PearingError as exc:
            self.log.error(str(exc))

    def _remove_token(self, ticket_id: str) -> None:
        """The holder would have removed the token file; it cannot (the paths above: it died)."""
        tokens = TokenFiles.at(self.o.lock_dir, self.o.repo, self.o.job)
        try:
            tokens.remove(ticket_id)
        finally:
            tokens.close()

    def _holder_failed(self, msg: protocol.Message | None) -> int:
        """The holder died or failed before reporting ready: it may have recorded our ticket
        held (its fence issued) and written the token file. It never served the lease, so end
        the ticket and remove the token file now rather than leave them to the next run."""
        tid = self.ticket.ticket_id
        for state, only_if_held in ((EXPIRED, True), (CANCELLED, False)):
            with contextlib.suppress(PearingError):
                self.lk.end(tid, state, EndReason.HOLDER_GONE, only_if_held=only_if_held)
        with contextlib.suppress(PearingError):
            self._remove_token(tid)
        if self.grip is not None:
            self.grip.release()
        if msg is not None and msg.kind == protocol.ERROR:
            self.log.error(msg.text)
            return int(msg.code)
        self.log.error("internal error: the lock holder died before taking the lease (killed?)")
        return int(ExitCode.SOFTWARE)


def _nothing() -> None:
    pass


def _reap(pid: int) -> None:
    with contextlib.suppress(ChildProcessError):
        os.waitpid(pid, os.WNOHANG)
