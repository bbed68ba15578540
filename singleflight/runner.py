"""``pearing-run``: take the lock, hand it to a detached holder, run COMMAND.

The wrapper owns COMMAND (its parent: it gets the exit status and forwards
signals); the holder owns the lease. Either may die: the other sees EOF on
their pipe and finishes the job alone. On the lock dir both keep the lock's
fd (one open file description, so one flock): whichever dies first, the lock
is freed only once the other lets go, and the wrapper lets go only once
COMMAND is dead.

It takes the lock through ``acquire.acquire``, the one acquire path it shares
with the agent behind ``pearing-cli acquire-lock``, ``pearing-mcp`` and ``Lock``.
"""

from __future__ import annotations

import contextlib
import os
import time
from typing import TYPE_CHECKING

from singleflight.acquire import acquire
from singleflight.backend import open_backend
from singleflight.core import fault, proc, protocol
from singleflight.core.const import (
    CANCELLED,
    CLAIM_BUSY,
    CLAIM_DONE,
    EXPIRED,
    RELEASED,
    WAITING,
    ExitCode,
)
from singleflight.core.errors import PearingError
from singleflight.core.log import Log
from singleflight.core.reasons import EndReason, Loss
from singleflight.core.ticket import Ticket, new_uuid4
from singleflight.rules import requests
from singleflight.runmetrics import RunMetrics

if TYPE_CHECKING:
    from singleflight.backend import Grip
    from singleflight.command import Child
    from singleflight.core.metrics import Event
    from singleflight.core.protocol import Channel
    from singleflight.runopts import RunOptions


class Runner:
    def __init__(self, opts: RunOptions) -> None:
        self.o = opts
        self.log = Log("pearing-run", opts.verbose, opts.log_format)
        self.child: Child | None = None  # COMMAND's side: imported once the lock is ours
        self.waited = 0.0
        self.lost: Loss | None = None
        self.holder_pid = 0
        self.grip: Grip | None = None
        self.started_mono = 0.0
        self.metrics = RunMetrics(opts.metrics_dir, opts.repo, opts.job, self.log)
        # The holder forked as the run started to wait, where a grip can be handed over later.
        self.standby: Channel | None = None

    # -- top level ---------------------------------------------------------

    def run(self) -> int:
        o = self.o
        self.lk = open_backend(o.backend, o.lock_dir).lock(o.repo, o.job)
        self.ticket = Ticket(
            ticket_id=new_uuid4(),
            request_uuid=o.request_uuid or new_uuid4(),
            lock_name=o.job,
            repo=o.repo,
            identity=o.identity,
            state=WAITING,
            lease_seconds=o.lease_seconds,
            holder_pid=os.getpid(),
            holder_start=proc.start_time(os.getpid()),
            queue_mode=o.queue,
            cancel_in_progress=o.cancel_in_progress,
            kill_grace=o.kill_grace,
        )
        try:
            return self._run()
        finally:
            if self.standby is not None:  # the run ended without the lock: the holder goes (EOF)
                self.standby.close()
                self.standby = None

    def _run(self) -> int:
        o = self.o
        if self._done_recently():
            return 0
        claimed = False
        if o.request_uuid:
            verdict = requests.claim(self.lk, self.ticket)
            if verdict == CLAIM_DONE:
                self.log.event("deduplicated", lock=o.job, request=o.request_uuid)
                self._metric("deduplicated")
                return 0
            if verdict == CLAIM_BUSY:
                self.log.event("busy", lock=o.job, request=o.request_uuid, reason="request in flight")
                self._metric("busy")
                return o.busy_exit_code
            claimed = True
        try:
            grip = self._acquire()
            # A run that waited behind a success sees it now, before taking the lease.
            if grip is not None and self._done_recently():
                with contextlib.suppress(PearingError):
                    self.lk.end(self.ticket.ticket_id, CANCELLED, EndReason.DEDUPLICATED, only_if_held=False)
                grip.close()
                grip = None
                if claimed:
                    requests.unclaim(self.lk, self.ticket)
                return 0
        except BaseException:
            if claimed:
                requests.unclaim(self.lk, self.ticket)
            raise
        if grip is None:
            if claimed:
                requests.unclaim(self.lk, self.ticket)
            self._metric("busy")
            return o.busy_exit_code
        return self._hold_and_run(grip)

    def _done_recently(self) -> bool:
        """--min-interval: a run of this job that succeeded started less than that long ago."""
        if self.o.min_interval is None:
            return False
        last = self.lk.last_success()
        if last is None or time.time() - last >= self.o.min_interval:
            return False
        from singleflight.core.ticket import rfc3339

        self.log.event("deduplicated", lock=self.o.job, last_success_start=rfc3339(last))
        self._metric("deduplicated")
        return True

    def _metric(self, event: Event) -> None:
        """--metrics-dir: best effort, never the exit status (``runmetrics``; the end: ``_finish``)."""
        self.metrics.record(event, holding=self.grip is not None)

    def _acquire(self) -> Grip | None:
        o, lk, tid = self.o, self.lk, self.ticket.ticket_id
        started = time.monotonic()

        def on_queued(position: int) -> None:
            self.ticket.promoted = True  # if it is ever held, it waited behind another run
            self.log.event("waiting", lock=o.job, position=position, max_wait=f"{o.wait_seconds:g}s")
            if lk.holder_waits_too and self.standby is None:
                from singleflight.bootstrap import fork_holder

                self.holder_pid, self.standby = fork_holder(o, self.ticket, None)

        grip = acquire(
            lk,
            self.ticket,
            until=started + o.wait_seconds,
            # release-lock-ticket on our waiting ticket (or a newer `latest` run) cancels it: 0.
            ticket_deadline=lambda: lk.waiting_deadline(tid),
            on_queued=on_queued,
            timeout_reason=EndReason.WAIT_TIMED_OUT,
        )
        self.waited = time.monotonic() - started
        if grip is None:
            ended = lk.read(tid) if self.ticket.promoted else None
            if ended is not None and ended.superseded_by:
                self.log.event("superseded", lock=o.job, by=ended.superseded_by)
            elif not self.ticket.promoted:
                self.log.event("busy", lock=o.job, repo=o.repo)
            else:
                self.log.event("wait-timeout", lock=o.job, waited=f"{self.waited:.3f}s")
            return None
        return grip

    # -- holding -----------------------------------------------------------

    def _hold_and_run(self, grip: Grip) -> int:
        o = self.o
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
            waited=f"{self.waited:.3f}s",
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
                self._metric("deduplicated")
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
        self._metric("start")
        pid = child.spawn(o.command, env, chan)
        if pid < 0:
            return self._finish(chan, -pid, -pid)
        status = self._wait_child(pid, chan)
        code = status if status is not None else int(ExitCode.LEASE_LOST)
        return self._finish(chan, code, self._lost_code() if self.lost else code)

    def _await_ready(self, chan: Channel, grip: Grip) -> protocol.Message | None:
        """The holder's first word, keeping the lock meanwhile: a holder frozen right after the
        fork must not let an etcd lease lapse into the next waiter's run before ours starts."""
        if grip.keep_every is None:
            return chan.recv()
        while (msg := chan.recv_until(time.monotonic() + grip.keep_every)) is None and not chan.eof:
            grip.keep()
        return msg

    def _hand_over(self, grip: Grip) -> Channel | None:
        """The grip to the holder forked as we started to wait; None if there is none (or it died)."""
        chan, self.standby = self.standby, None
        if chan is None or chan.send(protocol.go(grip.handover())):
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
            self.log.event("heartbeat-missed", lock=self.o.job, lease=f"{self.o.lease_seconds:g}s")
        self.log.event("lease-lost", lock=self.o.job, reason=loss.text)
        self._metric("lease_lost")

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
            self.lk.tokens.remove(self.ticket.ticket_id)
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
            record_end(self.lk, self.ticket, status, window=window, success=o.min_interval is not None)
            self.lk.end(tid, RELEASED, EndReason.COMMAND_EXITED.text(status))
            self.lk.tokens.remove(tid)
        except PearingError as exc:
            self.log.error(str(exc))

    def _holder_failed(self, msg: protocol.Message | None) -> int:
        """The holder died or failed before reporting ready: it may have recorded our ticket
        held (its fence issued) and written the token file. It never served the lease, so end
        the ticket and remove the token file now rather than leave them to the next run."""
        tid = self.ticket.ticket_id
        for state, only_if_held in ((EXPIRED, True), (CANCELLED, False)):
            with contextlib.suppress(PearingError):
                self.lk.end(tid, state, EndReason.HOLDER_GONE, only_if_held=only_if_held)
        with contextlib.suppress(PearingError):
            self.lk.tokens.remove(tid)
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


def run(opts: RunOptions) -> int:
    return Runner(opts).run()
