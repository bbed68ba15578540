"""``pearing-run``: take the lock, hand it to a detached holder, run COMMAND.

The wrapper owns COMMAND (its parent: it gets the exit status and forwards
signals); the holder owns the lock and the lease. Either may die: the other
sees EOF on their pipe and finishes the job alone.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import signal
import time
from typing import TYPE_CHECKING

from singleflight import queue
from singleflight.core import fault as _fault
from singleflight.core import proc as _proc
from singleflight.core.const import (
    CANCELLED,
    ENV_FENCE,
    ENV_LOCK,
    ENV_LOCK_DIR,
    ENV_PROMOTED,
    ENV_REPO,
    ENV_TICKET,
    ENV_TOKEN,
    ENV_TOKEN_FILE,
    EXPIRED,
    HELD,
    WAITING,
    ExitCode,
)
from singleflight.core.errors import PearingError
from singleflight.core.log import Log
from singleflight.core.ticket import Ticket, new_uuid4
from singleflight.store import LockDir, LockStore

if TYPE_CHECKING:
    from singleflight.core.protocol import Channel
    from singleflight.holder import HolderConfig

# The busy skip is the hot path: it imports only what it needs. Holding (lease,
# holder, channel) is imported once the lock is ours.

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


class RunOptions:
    __slots__ = (
        "busy_exit_code",
        "command",
        "dedupe_window",
        "heartbeat_auto",
        "identity",
        "job",
        "kill_grace",
        "lease_seconds",
        "lock_dir",
        "log_format",
        "max_runtime",
        "repo",
        "request_uuid",
        "skip_if",
        "verbose",
        "wait_seconds",
    )

    def __init__(self, **values: object) -> None:
        for name in self.__slots__:
            setattr(self, name, values[name])

    job: str
    repo: str
    lease_seconds: float
    wait_seconds: float
    heartbeat_auto: bool
    max_runtime: float | None
    kill_grace: float
    request_uuid: str | None
    dedupe_window: float
    skip_if: str | None
    busy_exit_code: int
    identity: str
    lock_dir: str
    verbose: bool
    log_format: str
    command: list[str]


class Runner:
    def __init__(self, opts: RunOptions) -> None:
        self.o = opts
        self.log = Log("pearing-run", opts.verbose, opts.log_format)
        self.cmd_pid: int | None = None
        self.pending: list[int] = []
        self.request_claimed = False
        self.waited = 0.0
        self.lost: str | None = None
        self.holder_pid = 0

    # -- top level ---------------------------------------------------------

    # Backend hooks: this class is the kernel-flock backend; etcd overrides these.

    def _open(self) -> None:
        self.store = LockDir(self.o.lock_dir).lock_store(self.o.repo, self.o.job)

    def _drop_grip(self, grip: int) -> None:
        os.close(grip)  # only the holder may keep the lock open now

    def _grip_fds(self, grip: int) -> set[int]:
        """The fds the holder must keep (the lock fd); every other one is closed."""
        return {grip}

    def _serve(self, grip: int, cfg: HolderConfig, chan: Channel) -> int:
        """In the forked holder: take ownership, report ``ready``, serve the lease."""
        return _holder_child(self.o, self.ticket, grip, cfg, chan)

    # -- top level ---------------------------------------------------------

    def run(self) -> int:
        o = self.o
        self._open()
        now = time.time()
        self.ticket = Ticket(
            ticket_id=new_uuid4(),
            request_uuid=o.request_uuid or new_uuid4(),
            lock_name=o.job,
            repo=o.repo,
            identity=o.identity,
            state=WAITING,
            lease_seconds=o.lease_seconds,
            created_at=now,
            holder_pid=os.getpid(),
            holder_start=_proc.start_time(os.getpid()),
        )
        if o.request_uuid:
            verdict = self._claim_request(o.request_uuid)
            if verdict == "done":
                self.log.event("deduplicated", lock=o.job, request=o.request_uuid)
                return 0
            if verdict == "busy":
                self.log.event("busy", lock=o.job, request=o.request_uuid, reason="request in flight")
                return o.busy_exit_code
        try:
            grip = self._acquire()
        except BaseException:
            self._unclaim_request()
            raise
        if grip is None:
            self._unclaim_request()
            return o.busy_exit_code
        return self._hold_and_run(grip)

    # -- acquiring ---------------------------------------------------------

    def _acquire(self) -> int | None:
        """The lock fd, flocked by us; None when busy (or the wait ran out)."""
        o, store = self.o, self.store
        fd = store.open_lock_file()
        if queue.try_flock(fd):
            if not queue.live_entries(store):
                return fd
            # Free for a moment, but others are in line: they go first.
            fcntl.flock(fd, fcntl.LOCK_UN)
        if o.wait_seconds <= 0:
            os.close(fd)
            self.log.event("busy", lock=o.job, repo=o.repo)
            return None
        # Import what holding needs now, while we wait, not after the hand-over.
        import json  # noqa: F401
        import secrets  # noqa: F401
        import select  # noqa: F401

        from singleflight import holder, lease  # noqa: F401

        started = time.monotonic()
        deadline = started + o.wait_seconds
        waiter = queue.Waiter(store, self.ticket.ticket_id)
        try:
            with store.mutex():
                self.ticket.queue_seq = waiter.enqueue()
                store.write_ticket(self.ticket)
            self.log.event("waiting", lock=o.job, position=waiter.position(), max_wait=f"{o.wait_seconds:g}s")
            # release-lock-ticket on a waiting ticket pokes us with SIGUSR1.
            signal.signal(signal.SIGUSR1, _interrupt)
            got = waiter.wait(fd, lambda: deadline if self._still_waiting() else 0.0)
            if got:
                _fault.point("mid-promotion")
        finally:
            signal.signal(signal.SIGUSR1, signal.SIG_DFL)
            waiter.leave()
        self.waited = time.monotonic() - started
        if not got:
            from singleflight import lease

            os.close(fd)
            lease.end(store, self.ticket.ticket_id, CANCELLED, "wait timed out", only_if_held=False)
            self.log.event("wait-timeout", lock=o.job, waited=f"{self.waited:.3f}s")
            return None
        self.ticket.promoted = True
        return fd

    def _still_waiting(self) -> bool:
        t = self.store.read_ticket(self.ticket.ticket_id)
        return t is not None and t.state == WAITING

    def _claim_request(self, request_uuid: str) -> str:
        """'run', 'done' (succeeded within the window) or 'busy' (in flight)."""
        store, now = self.store, time.time()
        with store.mutex():
            rec = store.read_request(request_uuid)
            if rec is not None:
                state = rec.get("state")
                if state == "succeeded" and float(rec.get("expires_at") or 0) > now:
                    return "done"
                if state == "active" and _request_alive(store, rec):
                    return "busy"
            store.write_request(
                request_uuid,
                {
                    "state": "active",
                    "ticket_id": self.ticket.ticket_id,
                    "pid": os.getpid(),
                    "start": self.ticket.holder_start,
                    "created_at": now,
                    "previous": rec,
                },
            )
        self.request_claimed = True
        return "run"

    def _unclaim_request(self) -> None:
        """We did not run: put back what the record said before us."""
        uuid = self.o.request_uuid
        if not (self.request_claimed and uuid):
            return
        with self.store.mutex():
            rec = self.store.read_request(uuid)
            if rec and rec.get("ticket_id") == self.ticket.ticket_id:
                previous = rec.get("previous")
                if isinstance(previous, dict):
                    self.store.write_request(uuid, previous)
                else:
                    self.store.sub("requests").unlink(f"{uuid}.json")
        self.request_claimed = False

    # -- holding -----------------------------------------------------------

    def _hold_and_run(self, grip: int) -> int:
        import json

        from singleflight.holder import HolderConfig

        o = self.o
        cfg = HolderConfig(
            heartbeat_auto=o.heartbeat_auto,
            max_runtime=o.max_runtime,
            kill_grace=o.kill_grace,
            request_uuid=o.request_uuid,
            dedupe_window=o.dedupe_window,
        )
        for sig in FORWARDED_SIGNALS:
            signal.signal(sig, self._forward)
        chan = self._fork_holder(grip, cfg)
        self._drop_grip(grip)
        _fault.point("after-holder-spawn")
        line = chan.recv()
        if line is None or not line.startswith("ready "):
            return self._holder_failed(line)
        info = json.loads(line[6:])
        self.log.event(
            "acquired",
            lock=o.job,
            repo=o.repo,
            fence=info["fence"],
            ticket=self.ticket.ticket_id,
            waited=f"{self.waited:.3f}s",
            promoted=int(self.ticket.promoted),
        )
        env = self._command_env(info)
        if o.skip_if is not None:
            check = self._spawn(["/bin/sh", "-c", o.skip_if], env, chan)
            status = self._wait_child(check, chan) if check > 0 else None
            if self.lost:
                return self._finish(chan, 1, int(ExitCode.LEASE_LOST))
            if status == 0:
                self.log.event("skipped", lock=o.job, reason="skip-if said done")
                return self._finish(chan, 0, 0)
        pid = self._spawn(o.command, env, chan)
        if pid < 0:
            return self._finish(chan, -pid, -pid)
        status = self._wait_child(pid, chan)
        code = status if status is not None else int(ExitCode.LEASE_LOST)
        return self._finish(chan, code, int(ExitCode.LEASE_LOST) if self.lost else code)

    def _fork_holder(self, grip: int, cfg: HolderConfig) -> Channel:
        from singleflight.core.protocol import Channel
        from singleflight.holder import detach

        to_r, to_w = os.pipe()
        from_r, from_w = os.pipe()
        pid = os.fork()
        if pid == 0:  # the holder
            code = 70
            try:
                os.close(to_w)
                os.close(from_r)
                detach({*self._grip_fds(grip), to_r, from_w})
                code = self._serve(grip, cfg, Channel(to_r, from_w))
            finally:
                os._exit(code)
        os.close(to_r)
        os.close(from_w)
        self.holder_pid = pid
        return Channel(from_r, to_w)

    def _command_env(self, info: dict[str, object]) -> dict[str, str]:
        env = dict(os.environ)
        env.update(
            {
                ENV_LOCK: self.o.job,
                ENV_REPO: self.o.repo,
                ENV_TICKET: self.ticket.ticket_id,
                ENV_FENCE: str(info["fence"]),
                ENV_TOKEN: str(info["token"]),
                ENV_TOKEN_FILE: str(info["token_file"]),
                ENV_LOCK_DIR: self.o.lock_dir,
                ENV_PROMOTED: "1" if self.ticket.promoted else "0",
            }
        )
        extra = info.get("env")
        if isinstance(extra, dict):
            env.update({str(k): str(v) for k, v in extra.items()})
        return env

    def _spawn(self, argv: list[str], env: dict[str, str], chan: Channel) -> int:
        """COMMAND in its own process group; -126/-127 when it cannot be started."""
        try:
            pid = os.posix_spawnp(argv[0], argv, env, setpgroup=0, setsigdef=_DEFAULT_IN_CHILD)
        except OSError as exc:
            code = ExitCode.NOTFOUND if isinstance(exc, FileNotFoundError) else ExitCode.NOEXEC
            what = "not found" if code == ExitCode.NOTFOUND else "not executable"
            self.log.error(f"command {what}: {argv[0]}: {exc.strerror}")
            return -int(code)
        self.cmd_pid = pid
        chan.send(f"started {pid} {_proc.start_time(pid) or 0}")
        for sig in self.pending:
            _killpg(pid, sig)
        self.pending.clear()
        return pid

    def _forward(self, signum: int, frame: object) -> None:
        if self.cmd_pid is not None:
            _killpg(self.cmd_pid, signum)
        else:
            self.pending.append(signum)

    def _wait_child(self, pid: int, chan: Channel) -> int | None:
        """Wait for COMMAND while listening to the holder; its exit code (128+N for signal N)."""
        import select

        pidfd = os.pidfd_open(pid)
        poller = select.poll()
        poller.register(pidfd, select.POLLIN)
        poller.register(chan.rfd, select.POLLIN)
        try:
            while True:
                for fd, _ev in poller.poll():
                    if fd == pidfd:
                        _, status = os.waitpid(pid, 0)
                        self.cmd_pid = None
                        code = os.waitstatus_to_exitcode(status)
                        return 128 - code if code < 0 else code
                    chan.fill()
                    for line in chan.lines():
                        if line.startswith("lost ") and self.lost is None:
                            self._lost(line[5:])
                    if chan.eof:
                        poller.unregister(chan.rfd)
                        if self.lost is None:
                            self._holder_vanished(pid)
        finally:
            os.close(pidfd)

    def _lost(self, reason: str) -> None:
        self.lost = reason
        if not self.o.heartbeat_auto and "expire" in reason:
            # The usual cause with --heartbeat manual: COMMAND stopped heartbeating (hung?).
            self.log.event("heartbeat-missed", lock=self.o.job, lease=f"{self.o.lease_seconds:g}s")
        self.log.event("lease-lost", lock=self.o.job, reason=reason)

    def _end_after_holder_death(self) -> None:
        """Bookkeeping for a holder killed while COMMAND runs (the kernel freed the lock)."""
        from singleflight import lease

        with contextlib.suppress(PearingError):
            lease.end(self.store, self.ticket.ticket_id, EXPIRED, "holder gone")
            self.store.remove_token_file(self.ticket.ticket_id)

    def _holder_vanished(self, pid: int) -> None:
        """The holder died (kill -9): the lock is free; the token is dead. Stop COMMAND."""
        import select

        self._lost("holder gone")
        self._end_after_holder_death()
        _killpg(pid, signal.SIGTERM)
        deadline = time.monotonic() + self.o.kill_grace
        pidfd = os.pidfd_open(pid)
        try:
            select.select([pidfd], [], [], max(0.0, deadline - time.monotonic()))
        finally:
            os.close(pidfd)
        _killpg(pid, signal.SIGKILL)

    def _finish(self, chan: Channel, status: int, exit_code: int) -> int:
        """Tell the holder COMMAND ended; exit only once the lock is free again."""
        chan.send(f"exited {status}")
        while (line := chan.recv()) is not None and line != "released":
            if line.startswith("lost ") and self.lost is None:
                self._lost(line[5:])
                exit_code = int(ExitCode.LEASE_LOST)
        if line is None and self.lost is None:
            # The holder died after COMMAND ended: finish its bookkeeping here.
            self._release_without_holder(status)
        chan.close()
        _reap(self.holder_pid)
        if self.lost:
            return int(ExitCode.LEASE_LOST)
        self.log.event("released", lock=self.o.job, ticket=self.ticket.ticket_id, status=status)
        return exit_code

    def _release_without_holder(self, status: int) -> None:
        from singleflight import lease

        t = self.ticket
        try:
            if self.o.request_uuid:
                cur = self.store.read_ticket(t.ticket_id) or t
                lease.record_request(self.store, self.o.request_uuid, cur, status, self.o.dedupe_window)
            lease.end(self.store, t.ticket_id, "released", f"command exited {status}")
            self.store.remove_token_file(t.ticket_id)
        except PearingError as exc:
            self.log.error(str(exc))

    def _holder_failed(self, line: str | None) -> int:
        self._clean_up_after_holder()
        if line and line.startswith("error "):
            code_s, _, msg = line[6:].partition(" ")
            self.log.error(msg)
            return int(code_s)
        self.log.error("internal error: the lock holder died before taking the lease (killed?)")
        return int(ExitCode.SOFTWARE)

    def _clean_up_after_holder(self) -> None:
        """The holder died or failed before reporting ready: it may have recorded our ticket
        held (its fence issued) and written the token file. It never served the lease, so end
        the ticket and remove the token file now rather than leave them to the next run."""
        from singleflight import lease

        tid = self.ticket.ticket_id
        for state, only_if_held in ((EXPIRED, True), (CANCELLED, False)):
            with contextlib.suppress(PearingError):
                lease.end(self.store, tid, state, "holder gone", only_if_held=only_if_held)
        with contextlib.suppress(PearingError):
            self.store.remove_token_file(tid)


def _holder_child(o: RunOptions, ticket: Ticket, lock_fd: int, cfg: HolderConfig, chan: Channel) -> int:
    """In the forked holder: take ownership, report, and serve the lease."""
    import json

    from singleflight import lease
    from singleflight.holder import Holder, LocalLease

    try:
        store = LockDir(o.lock_dir, create=False).lock_store(o.repo, o.job, create=False)
        token = lease.take_ownership(store, ticket, promoted=bool(ticket.promoted))
        info = {"fence": ticket.fence, "token": token, "token_file": store.token_file_path(ticket.ticket_id)}
        chan.send("ready " + json.dumps(info))
        Holder(LocalLease(store, lock_fd, ticket), cfg, chan).serve()
    except PearingError as exc:
        chan.send(f"error {int(exc.exit_code)} {exc}")
        return int(exc.exit_code)
    except BaseException as exc:  # noqa: BLE001 - the holder must report, never vanish silently
        chan.send(f"error {int(ExitCode.SOFTWARE)} internal error in holder (a bug): {exc!r}")
        return int(ExitCode.SOFTWARE)
    return 0


def _request_alive(store: LockStore, rec: dict[str, object]) -> bool:
    """Is the run that claimed this request still waiting or holding?"""
    pid, start = rec.get("pid"), rec.get("start")
    if isinstance(pid, int) and isinstance(start, int) and _proc.alive(pid, start):
        return True
    tid = rec.get("ticket_id")
    t = store.read_ticket(tid) if isinstance(tid, str) else None
    return t is not None and t.state in (HELD, WAITING) and _proc.alive(t.holder_pid, t.holder_start)


def _interrupt(signum: int, frame: object) -> None:
    raise queue.Interrupted


def _killpg(pgid: int, sig: int) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pgid, sig)


def _reap(pid: int) -> None:
    with contextlib.suppress(ChildProcessError):
        os.waitpid(pid, os.WNOHANG)


def run(opts: RunOptions) -> int:
    return Runner(opts).run()
