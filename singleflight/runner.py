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

from singleflight.acquire import acquire
from singleflight.backend import open_backend
from singleflight.core import proc
from singleflight.core.const import (
    CANCELLED,
    CLAIM_BUSY,
    CLAIM_DONE,
    TYPE_CHECKING,
    WAITING,
)
from singleflight.core.errors import LineFull, PearingError
from singleflight.core.log import Log, Seconds
from singleflight.core.reasons import EndReason
from singleflight.core.record import new_uuid4
from singleflight.core.ticket import Ticket
from singleflight.rules import requests
from singleflight.runmetrics import RunMetrics

if TYPE_CHECKING:
    from singleflight.backend import Grip
    from singleflight.core.metrics import Event
    from singleflight.core.protocol import Channel
    from singleflight.runopts import RunOptions


class Runner:
    def __init__(self, opts: RunOptions) -> None:
        self.o = opts
        self.log = Log("pearing-run", opts.verbose, opts.log_format)
        self.waited = 0.0
        self.holder_pid = 0
        self.metrics = RunMetrics(opts.metrics_dir, opts.repo, opts.job, self.log)
        # The holder forked as the run started to wait, where a grip can be handed over later.
        self.standby: Channel | None = None

    # -- top level ---------------------------------------------------------

    def run(self) -> int:
        o = self.o
        self.backend = open_backend(o.backend, o.lock_dir)
        self.lk = self.backend.lock(o.repo, o.job)
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
            max_waiting=o.max_waiting,
            slots=o.slots,
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
            verdict = requests.claim(self.backend, self.ticket)
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
                    requests.unclaim(self.backend, self.ticket)
                return 0
        except BaseException:
            if claimed:
                requests.unclaim(self.backend, self.ticket)
            raise
        if grip is None:
            if claimed:
                requests.unclaim(self.backend, self.ticket)
            self._metric("busy")
            return o.busy_exit_code
        return self._hold_and_run(grip)

    def _done_recently(self) -> bool:
        """--min-interval: a run of this job that succeeded started less than that long ago."""
        if self.o.min_interval is None:
            return False
        last = requests.last_success(self.backend, self.ticket.repo, self.ticket.lock_name)
        if last is None or time.time() - last >= self.o.min_interval:
            return False
        from singleflight.core.record import rfc3339

        self.log.event("deduplicated", lock=self.o.job, last_success_start=rfc3339(last))
        self._metric("deduplicated")
        return True

    def _metric(self, event: Event) -> None:
        """--metrics-dir: best effort, never the exit status (``runmetrics``)."""
        self.metrics.record(event, holding=False)

    def _acquire(self) -> Grip | None:
        o, lk, tid = self.o, self.lk, self.ticket.ticket_id
        started = time.monotonic()

        def on_queued(position: int) -> None:
            self.ticket.promoted = True  # if it is ever held, it waited behind another run
            self.log.event("waiting", lock=o.job, position=position, max_wait=Seconds(o.wait_seconds))
            if self.standby is None:  # the holder is ready when we are first: no fork then
                from singleflight.bootstrap import fork_holder

                self.holder_pid, self.standby = fork_holder(o, self.ticket, None)
                # What holding the lock needs, loaded while we wait rather than after the hand-over.
                from singleflight import command, holding  # noqa: F401

        def ticket_deadline() -> float:
            # release-lock-ticket on our waiting ticket (or a newer `latest` run) cancels it: 0.
            from singleflight.rules import tickets  # a waiter's alone: a free lock is taken at once

            return tickets.waiting_deadline(lk, tid)

        try:
            grip = acquire(
                lk,
                self.ticket,
                until=started + o.wait_seconds,
                ticket_deadline=ticket_deadline,
                on_queued=on_queued,
                timeout_reason=EndReason.WAIT_TIMED_OUT,
            )
        except LineFull as full:
            self.log.event("busy", lock=o.job, repo=o.repo, reason=str(full))
            return None
        self.waited = time.monotonic() - started
        if grip is None:
            ended = lk.read(tid) if self.ticket.promoted else None
            if ended is not None and ended.superseded_by:
                self.log.event("superseded", lock=o.job, by=ended.superseded_by)
            elif not self.ticket.promoted:
                self.log.event("busy", lock=o.job, repo=o.repo)
            else:
                self.log.event("wait-timeout", lock=o.job, waited=Seconds(self.waited))
            return None
        return grip

    # -- holding -----------------------------------------------------------

    def _hold_and_run(self, grip: Grip) -> int:
        from singleflight.holding import HeldRun

        standby, self.standby = self.standby, None  # the held run closes it now
        held = HeldRun(self.o, self.log, self.backend, self.lk, self.ticket, metrics=self.metrics)
        return held.run(grip, waited=self.waited, standby=standby, holder_pid=self.holder_pid)


def run(opts: RunOptions) -> int:
    return Runner(opts).run()
