"""The lock operations behind pearing-cli and pearing-mcp (the seed's commands).

``Backend`` is the interface a second backend (etcd) implements; ``LocalBackend``
is the kernel-flock lock dir. Every method returns plain JSON-ready dicts: the
ticket objects of SPEC.md.
"""

from __future__ import annotations

import os
import select
import signal
import subprocess
import sys
import time
from typing import Any, Protocol

from singleflight import lease, queue
from singleflight.core import names
from singleflight.core import proc as _proc
from singleflight.core.const import CANCELLED, EXPIRED, HELD, RELEASED, WAITING, ExitCode
from singleflight.core.errors import NotHeld, PearingError, UnknownTicket
from singleflight.core.protocol import Channel
from singleflight.core.ticket import Ticket, new_uuid4
from singleflight.store import LockDir, LockStore

# How long acquire-lock waits for its agent to start and report, beyond --wait-seconds.
_AGENT_START_SECONDS = 15.0


class Outcome:
    """A ticket to print and the exit code that goes with it."""

    __slots__ = ("code", "reason", "ticket")

    def __init__(self, ticket: dict[str, Any], code: int = 0, reason: str | None = None) -> None:
        self.ticket, self.code, self.reason = ticket, code, reason


class AgentFailed(PearingError):
    """The detached agent reported an error (a corrupt record, a planted symlink): its line and code."""

    def __init__(self, code: str, message: str) -> None:
        super().__init__(message)
        try:
            self.exit_code = ExitCode(int(code))
        except ValueError:
            self.exit_code = ExitCode.SOFTWARE


class Backend(Protocol):
    def close(self) -> None: ...

    def acquire(
        self, lock: str, repo: str, *, request_uuid: str, lease_seconds: float, wait_seconds: float, identity: str
    ) -> Outcome: ...
    def get(self, lock: str, repo: str, ticket_id: str) -> dict[str, Any]: ...
    def heartbeat(self, lock: str, repo: str, ticket_id: str, lease_seconds: float) -> dict[str, Any]: ...
    def release(self, lock: str, repo: str, ticket_id: str) -> dict[str, Any]: ...
    def update_activity(self, identity: str, activity: str | None) -> dict[str, Any]: ...
    def status(self, repo: str, lock: str | None) -> list[dict[str, Any]]: ...


class LocalBackend:
    def __init__(self, lock_dir: str) -> None:
        self.lock_dir_path = lock_dir
        self.dir = LockDir(lock_dir)

    def close(self) -> None:
        self.dir.close()

    def __enter__(self) -> LocalBackend:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _store(self, lock: str, repo: str, *, ticket_id: str | None = None) -> LockStore:
        """The lock's files; created for an acquisition, required for a ticket lookup."""
        names.lock_name(lock)
        names.scope(repo)
        try:
            return self.dir.lock_store(repo, lock, create=ticket_id is None)
        except FileNotFoundError:
            raise NotHeld(ticket_id or "-", f"unknown ticket: no lock {lock!r} in scope {repo!r}") from None

    # -- views -------------------------------------------------------------

    def view(self, store: LockStore, t: Ticket) -> dict[str, Any]:
        position = None
        if t.state == WAITING:
            live = queue.live_entries(store)
            mine = [i for i, n in enumerate(live) if n.endswith("." + t.ticket_id)]
            position = mine[0] + 1 if mine else None
        token_file = None
        if t.state == HELD:
            path = store.token_file_path(t.ticket_id)
            token_file = path if store.sub("tokens").lstat(f"{t.ticket_id}.token") else None
        return t.public(activity=self.dir.read_activity(t.identity), queue_position=position, token_file=token_file)

    # -- operations ----------------------------------------------------------

    def acquire(
        self, lock: str, repo: str, *, request_uuid: str, lease_seconds: float, wait_seconds: float, identity: str
    ) -> Outcome:
        request_uuid = names.request_uuid(request_uuid)
        with self._store(lock, repo) as store:
            return self._acquire(store, request_uuid, lease_seconds, wait_seconds, identity)

    def _acquire(
        self, store: LockStore, request_uuid: str, lease_seconds: float, wait_seconds: float, identity: str
    ) -> Outcome:
        lock, repo = store.lock, store.repo
        with store.mutex():
            rec = store.read_request(request_uuid)
            existing = store.read_ticket(str(rec["ticket_id"])) if rec and rec.get("ticket_id") else None
            if existing is None:
                t = Ticket(
                    ticket_id=new_uuid4(),
                    request_uuid=request_uuid,
                    lock_name=lock,
                    repo=repo,
                    identity=identity,
                    state=WAITING,
                    created_at=time.time(),
                    holder_pid=os.getpid(),
                    holder_start=_proc.start_time(os.getpid()),
                )
                t.set_lease(lease_seconds)
                store.write_ticket(t)
                store.write_request(request_uuid, {"state": "active", "ticket_id": t.ticket_id})
        if existing is not None:
            return self._await_existing(store, existing, wait_seconds)
        return self._start_agent(store, t, wait_seconds)

    def _start_agent(self, store: LockStore, t: Ticket, wait_seconds: float) -> Outcome:
        r, w = os.pipe()
        argv = [sys.executable, "-m", "singleflight.agent", self.lock_dir_path, t.repo, t.lock_name, t.ticket_id]
        proc = subprocess.Popen(
            [*argv, str(w)],
            stdin=subprocess.DEVNULL,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
            pass_fds=(w,),
            start_new_session=True,
        )
        os.close(w)
        proc.wait()  # the agent daemonises at once; its child keeps the pipe
        chan = Channel(r, -1)
        deadline = time.monotonic() + _AGENT_START_SECONDS
        state = None
        gone = False
        try:
            while True:
                line = _recv_until(chan, deadline)
                if line is None:
                    gone = chan.eof  # every write end closed: the agent died without a word
                    break
                if line.startswith("error "):
                    code, _, message = line[6:].partition(" ")
                    cur = store.read_ticket(t.ticket_id) or t
                    if cur.live:
                        self._end_orphan(store, cur)
                    raise AgentFailed(code, message)
                state = line
                if line == "queued":
                    deadline = time.monotonic() + wait_seconds
                    continue
                break
        finally:
            chan.close()
        cur = store.read_ticket(t.ticket_id) or t
        if gone and cur.live:
            cur = self._end_orphan(store, cur)
        return self._outcome(store, cur, timed_out=state == "queued")

    def _await_existing(self, store: LockStore, t: Ticket, wait_seconds: float) -> Outcome:
        """Same request uuid again: never a second ticket, never behind itself."""
        if t.state == WAITING and wait_seconds <= 0:
            # Even without a wait: an agent that is not in line yet is still starting (or
            # taking a free lock) and settles in moments; only a ticket in line is "waiting".
            t = _settle(store, t.ticket_id)
        elif t.state == WAITING:
            entry = next((n for n in queue.live_entries(store) if n.endswith("." + t.ticket_id)), None)
            # No entry: the agent has just left the line and is taking the lock (or is not
            # in line yet): its state changes in moments, so wait for that, not 75 at once.
            got = entry is None
            if entry is not None:
                try:
                    fd = store.sub("queue").open(entry, os.O_RDWR)
                except FileNotFoundError:
                    fd, got = -1, True
                if fd >= 0:
                    # The agent keeps this entry flocked until it leaves the line.
                    got = queue.flock_until(fd, time.monotonic() + wait_seconds)
                    os.close(fd)
            if got:
                t = _await_state_change(store, t.ticket_id, min(wait_seconds, 5.0) if entry is None else 5.0)
        cur = store.read_ticket(t.ticket_id) or t
        return self._outcome(store, cur, timed_out=cur.state == WAITING)

    def _end_orphan(self, store: LockStore, t: Ticket) -> Ticket:
        """End a ticket whose agent is dead (killed): nobody holds or waits for it any more."""
        final = EXPIRED if t.state == HELD else CANCELLED
        ended = lease.end(store, t.ticket_id, final, "holder gone", only_if_held=False)
        store.remove_token_file(t.ticket_id)
        return store.read_ticket(t.ticket_id) or ended or t

    def _outcome(self, store: LockStore, t: Ticket, *, timed_out: bool) -> Outcome:
        if t.state == HELD and not _proc.alive(t.holder_pid, t.holder_start):
            # Never report a lock held whose holder is already gone: the kernel has freed it.
            t = self._end_orphan(store, t)
        view = self.view(store, t)
        if t.state == HELD:
            return Outcome(view)
        if t.state == WAITING:
            return Outcome(view, 75, "still waiting in line" if timed_out else None)
        return Outcome(view, 1, f"ticket {t.ticket_id}: {lease.describe_end(t)}")

    def get(self, lock: str, repo: str, ticket_id: str) -> dict[str, Any]:
        ticket_id = names.ticket_id(ticket_id)
        with self._store(lock, repo, ticket_id=ticket_id) as store:
            t = store.read_ticket(ticket_id)
            if t is None:
                raise UnknownTicket(ticket_id)
            return self.view(store, t)

    def heartbeat(self, lock: str, repo: str, ticket_id: str, lease_seconds: float) -> dict[str, Any]:
        ticket_id = names.ticket_id(ticket_id)
        with self._store(lock, repo, ticket_id=ticket_id) as store:
            return self.view(store, lease.renew(store, ticket_id, lease_seconds))

    def release(self, lock: str, repo: str, ticket_id: str) -> dict[str, Any]:
        """Release (held) or cancel (waiting). Idempotent; a lost lease is an error."""
        ticket_id = names.ticket_id(ticket_id)
        with self._store(lock, repo, ticket_id=ticket_id) as store:
            return self._release(store, ticket_id)

    def _release(self, store: LockStore, ticket_id: str) -> dict[str, Any]:
        t = store.read_ticket(ticket_id)
        if t is None:
            raise UnknownTicket(ticket_id)
        if t.state in (RELEASED, CANCELLED):
            return self.view(store, t)
        if t.state not in (HELD, WAITING):
            raise NotHeld(ticket_id, lease.describe_end(t))
        final = RELEASED if t.state == HELD else CANCELLED
        ended = lease.end(store, ticket_id, final, "released by owner", only_if_held=False)
        if ended is None:  # it ended on its own meanwhile
            cur = store.read_ticket(ticket_id) or t
            if cur.state in (RELEASED, CANCELLED):
                return self.view(store, cur)
            raise NotHeld(ticket_id, lease.describe_end(cur))
        _poke_and_wait(t)
        return self.view(store, store.read_ticket(ticket_id) or ended)

    def update_activity(self, identity: str, activity: str | None) -> dict[str, Any]:
        names.identity(identity)
        self.dir.write_activity(identity, activity)
        return {"identity": identity, "activity": activity}

    def status(self, repo: str, lock: str | None) -> list[dict[str, Any]]:
        names.scope(repo)
        if lock is not None:
            names.lock_name(lock)
        now = time.monotonic()
        out = []
        for store in self.dir.iter_locks(repo):
            with store:
                if lock is not None and store.lock != lock:
                    continue
                out.append(self._lock_status(store, now))
        return out

    def _lock_status(self, store: LockStore, now: float) -> dict[str, Any]:
        holder = None
        waiters = []
        for t in store.tickets():
            alive = _proc.alive(t.holder_pid, t.holder_start)
            left = t.lease_left(now)
            if t.state == HELD and alive and (left is None or left > 0):
                holder = self.view(store, t)
                holder["lease_left"] = None if left is None else round(left, 3)
            elif t.state == WAITING and alive:
                waiters.append(self.view(store, t))
        waiters.sort(key=lambda w: w["queue_position"] or 0)
        return {
            "lock_name": store.lock,
            "repo": store.repo,
            "state": "held" if holder else "free",
            "fence": store.read_fence(),
            "holder": holder,
            "waiters": waiters,
        }


def _recv_until(chan: Channel, deadline: float) -> str | None:
    while True:
        lines = chan.lines()
        if lines:
            return lines[0]
        if chan.eof:
            return None
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            return None
        ready, _, _ = select.select([chan.rfd], [], [], remaining)
        if ready:
            chan.fill()


def _settle(store: LockStore, ticket_id: str, timeout: float = 2.0) -> Ticket:
    """A waiting ticket once its agent is either in line or past waiting (polled, 5 ms)."""
    deadline = time.monotonic() + timeout
    while True:
        t = store.read_ticket(ticket_id)
        if t is None:
            raise UnknownTicket(ticket_id)
        in_line = any(n.endswith("." + ticket_id) for n in queue.live_entries(store))
        if t.state != WAITING or in_line or time.monotonic() > deadline:
            return t
        time.sleep(0.005)


def _await_state_change(store: LockStore, ticket_id: str, timeout: float = 5.0) -> Ticket:
    """The agent left the line: it is taking the lock (or gave up). Moments at most."""
    deadline = time.monotonic() + timeout
    while True:
        t = store.read_ticket(ticket_id)
        if t is None:
            raise UnknownTicket(ticket_id)
        if t.state != WAITING or time.monotonic() > deadline:
            return t
        time.sleep(0.005)


def _poke_and_wait(t: Ticket) -> None:
    """Tell the holder its ticket ended and wait until it has let the lock go."""
    pid = t.holder_pid
    if pid is None or not _proc.alive(pid, t.holder_start):
        return
    try:
        pidfd = os.pidfd_open(pid)
    except ProcessLookupError:
        return
    try:
        if _proc.start_time(pid) != t.holder_start:
            return
        os.kill(pid, signal.SIGUSR1)
        select.select([pidfd], [], [], 10.0)
    finally:
        os.close(pidfd)


def backend(lock_dir: str, url: str | None = None) -> Backend:
    """The local lock dir, or etcd when ``url`` (``--backend`` / PEARING_BACKEND) names it."""
    if url and url != "local":
        if not url.startswith("etcd://"):
            from singleflight.core.errors import BadValue

            raise BadValue("backend", url, "must be local or etcd://HOST:PORT[,HOST:PORT...]")
        from singleflight.etcd.api import EtcdBackend

        return EtcdBackend(url, lock_dir)
    return LocalBackend(lock_dir)


__all__ = ["Backend", "LocalBackend", "Outcome", "PearingError", "backend"]
