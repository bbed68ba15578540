"""The public Python API: the same lock, fences and backends as the commands, in-process.

    from singleflight import Busy, LeaseLost, Lock

    with Lock("thread-work.42", repo="teams/platform/website", request_uuid=event_id,
              lease_seconds=60, wait_seconds=30) as held:
        held.fence, held.ticket_id, held.token_file, held.promoted
        held.heartbeat()              # renews; raises LeaseLost if the lease is gone
        with held.guarded(): post()   # pearing-guard exec's hold-off, in-process

The lease is kept by a detached agent (the one behind ``pearing-cli
acquire-lock``), so a process that forks or blocks in C code cannot lose the
lock by accident; with ``heartbeat="auto"`` it renews while this process lives
and the block runs. Leaving the block releases, and returns only once the lock
is free again; only the process that entered it releases (a forked child that
leaves the block, ``sys.exit`` in it, does nothing to the lock). A process that
dies or is interrupted while it waits leaves the line, and one that dies holding
frees the lock at once, whatever the lease.
"""

from __future__ import annotations

import contextlib
import os
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

from singleflight import guard, ops
from singleflight.backend import Opened, backend_url, open_backend
from singleflight.core import identity as identities
from singleflight.core import names, proc, protocol
from singleflight.core.const import (
    DEFAULT_GUARD_MAX_SECONDS,
    DEFAULT_LEASE_SECONDS,
    DEFAULT_SCOPE,
    ENV_BACKEND,
    HEARTBEAT_AUTO,
    HEARTBEAT_MODES,
    QUEUE_FIFO,
    QUEUE_MODES,
    WAITING,
    ExitCode,
)
from singleflight.core.errors import NotHeld, PearingError, UsageError
from singleflight.core.fs import resolve_lock_dir
from singleflight.core.protocol import Channel
from singleflight.core.reasons import EndReason
from singleflight.core.record import new_uuid4
from singleflight.core.tokens import Verdict

# How long leaving the block waits for the agent to hand the lock over.
_RELEASE_WAIT = 30.0


class Busy(PearingError):
    """The wait ran out. ``ticket`` is the ticket as it stands: ``waiting`` when kept, else
    ``cancelled`` (its ``end_reason`` ``line full`` when ``max_waiting`` turned it away).

    With a ``request_uuid`` of the caller's, it keeps its FIFO place for its lease, as
    ``pearing-cli acquire-lock``'s exit 75 does: a retry with the same uuid resumes it
    (``kept`` is True). Without one nobody could ever resume it, so it is cancelled.
    """

    exit_code = ExitCode.BUSY

    def __init__(self, ticket: dict[str, Any], *, kept: bool) -> None:
        self.ticket, self.kept = ticket, kept
        super().__init__(f"lock {ticket.get('lock_name')!r} is busy")


class LeaseLost(PearingError):
    """The lease is gone (expired, released, holder killed): stop, and write nothing more."""

    exit_code = ExitCode.LEASE_LOST

    def __init__(self, ticket_id: str, reason: str) -> None:
        self.ticket_id, self.reason = ticket_id, reason
        super().__init__(f"lease lost for ticket {ticket_id}: {reason}")


class Held:
    """The lock, held: what the block of ``with Lock(...) as held`` gets."""

    def __init__(self, lock: Lock, ticket: dict[str, Any], chan: Channel, token_file: str) -> None:
        self._lock, self._chan = lock, chan
        self.ticket_id: str = ticket["ticket_id"]
        self.fence: int = ticket["fence"]
        self.promoted: bool = bool(ticket.get("promoted"))
        self.token_file = token_file
        self.lost: str | None = None

    def _poll(self) -> None:
        """Read what the agent said meanwhile (never blocks): a lost lease shows here."""
        while self.lost is None:
            msg = self._chan.recv_until(0.0)
            if msg is None:
                if self._chan.eof:
                    self.lost = EndReason.HOLDER_GONE.text()
                return
            if msg.kind == protocol.LOST:
                self.lost = msg.text

    def heartbeat(self, lease_seconds: float | None = None) -> None:
        """Renew the lease (by ``lease_seconds``, default the Lock's); LeaseLost if it is gone."""
        self._poll()
        if self.lost is not None:
            raise LeaseLost(self.ticket_id, self.lost)
        lk = self._lock
        seconds = lk.lease_seconds if lease_seconds is None else names.lease_seconds(lease_seconds, "lease_seconds")
        b = Opened(lk.backend, lk.lock_dir)
        try:
            ops.heartbeat(b, lk.name, lk.repo, self.ticket_id, seconds)
        except NotHeld as exc:
            self.lost = exc.reason
            raise LeaseLost(self.ticket_id, exc.reason) from None
        finally:
            b.close()

    @contextmanager
    def guarded(self, seconds: float = DEFAULT_GUARD_MAX_SECONDS) -> Iterator[Verdict]:
        """No expiry and no hand-over while the block runs (at most ``seconds``); LeaseLost if not live."""
        try:
            with guard.guarded(self.token_file, env={}, hold_seconds=seconds) as verdict:
                yield verdict
        except NotHeld as exc:
            raise LeaseLost(self.ticket_id, exc.reason) from None


class Lock:
    """One lock, entered with ``with``; see the module's docstring.

    A Lock may be entered again once it was left: each ``with`` is a new acquisition (a new
    ticket, a larger fence) under a new request uuid. With a ``request_uuid`` or
    ``request_key`` of the caller's, every ``with`` is that one request again: after
    ``Busy`` (kept) it resumes the waiting ticket; once its ticket has ended (its block
    ran) it raises ``NotHeld`` saying how that ticket ended, as a retry of a finished
    request does anywhere: a request runs at most once. New work takes a new uuid.
    Entering it while it is held (nesting) is a ``UsageError``.
    """

    def __init__(
        self,
        name: str,
        *,
        repo: str = DEFAULT_SCOPE,
        request_uuid: str | None = None,
        request_key: str | None = None,
        lease_seconds: float = DEFAULT_LEASE_SECONDS,
        wait_seconds: float = 0.0,
        heartbeat: str = HEARTBEAT_AUTO,
        lock_dir: str | None = None,
        backend: str | None = None,
        identity: str | None = None,
        queue: str = QUEUE_FIFO,
        cancel_in_progress: bool = False,
        max_waiting: int | None = None,
        slots: int = 1,
    ) -> None:
        self.name = names.lock_name(name)
        self.repo = names.scope(repo)
        own = names.request(request_uuid, request_key, uuid_what="request_uuid", key_what="request_key")
        self._own_uuid = own is not None
        self.request_uuid = own if own is not None else new_uuid4()
        self.lease_seconds = names.lease_seconds(lease_seconds, "lease_seconds")
        self.wait_seconds = names.seconds(wait_seconds, "wait_seconds")
        self.heartbeat = names.choice(heartbeat, "heartbeat", HEARTBEAT_MODES)
        self.queue = names.choice(queue, "queue", QUEUE_MODES)
        self.cancel_in_progress = bool(cancel_in_progress)
        self.max_waiting = None if max_waiting is None else names.max_waiting(max_waiting, "max_waiting")
        self.slots = names.slots(slots, "slots")
        self.lock_dir = resolve_lock_dir(lock_dir)
        self.backend = backend_url(backend, os.environ.get(ENV_BACKEND))
        self.identity = identities.resolve(identity)
        self._held: Held | None = None
        self._entered_by = 0  # the pid that entered: only it releases
        self._used = False

    def __enter__(self) -> Held:
        return self._enter(None)

    def _enter(self, stopped: Callable[[], bool] | None) -> Held:
        """``stopped``: asked while waiting; once true the wait ends as if it ran out (Busy)."""
        if self._held is not None:
            if self._entered_by == os.getpid():
                raise UsageError(f"lock {self.name!r} is already held by this Lock object")
            self._held = None  # a forked child's copy of its parent's block: not the child's
        if self._used and not self._own_uuid:
            self.request_uuid = new_uuid4()  # a new acquisition, not a replay of the last one
        self._used = True
        backend = Opened(self.backend, self.lock_dir)
        try:
            out, chan = ops.acquire(
                backend,
                self.name,
                self.repo,
                request_uuid=self.request_uuid,
                lease_seconds=self.lease_seconds,
                wait_seconds=self.wait_seconds,
                identity=self.identity,
                control=self.heartbeat,
                queue_mode=self.queue,
                cancel_in_progress=self.cancel_in_progress,
                max_waiting=self.max_waiting,
                slots=self.slots,
                stopped=stopped,
            )
            if out.code == ExitCode.BUSY:
                ticket = out.ticket
                if not self._own_uuid:
                    # Nobody could resume it: cancelled, and Busy shows it so (not "waiting").
                    with contextlib.suppress(PearingError):
                        ticket = ops.release(backend, self.name, self.repo, out.ticket["ticket_id"])
                # Turned away (max_waiting) or superseded, the ticket has ended: nothing is kept.
                raise Busy(ticket, kept=self._own_uuid and ticket.get("state") == WAITING)
        finally:
            backend.close()
        if out.code != ExitCode.OK or chan is None:
            if chan is not None:
                chan.close()
            raise NotHeld(out.ticket["ticket_id"], out.why or out.ticket["state"])
        # From here the agent renews (auto) while this process lives, and releases if it dies.
        chan.send(protocol.started(os.getpid(), proc.start_time(os.getpid()) or 0))
        self._entered_by = os.getpid()
        self._held = Held(self, out.ticket, chan, out.ticket.get("token_file") or "")
        return self._held

    def __exit__(self, exc_type: object, exc: object, tb: object) -> None:
        held, self._held = self._held, None
        if held is None or self._entered_by != os.getpid():
            # A forked child leaving its copy of the block (sys.exit unwinds it there): the lock
            # is its parent's. Its copies of the channel were closed at the fork (ops).
            return
        chan = held._chan
        chan.send(protocol.exited(0 if exc_type is None else 1))
        deadline = time.monotonic() + _RELEASE_WAIT
        try:
            while (msg := chan.recv_until(deadline)) is not None and msg.kind != protocol.RELEASED:
                pass
        finally:
            chan.close()

    # -- without a ``with`` (as threading.Lock and filelock offer) ---------------------------

    def acquire(self, timeout: float | None = None) -> Held:
        """Take the lock as ``with`` does, waiting up to ``timeout`` seconds (None: the Lock's
        ``wait_seconds``); ``Busy`` when the wait runs out. Pair it with ``release``."""
        if timeout is None:
            return self.__enter__()
        wait, self.wait_seconds = self.wait_seconds, names.seconds(timeout, "timeout")
        try:
            return self.__enter__()
        finally:
            self.wait_seconds = wait

    def release(self) -> None:
        """Let the lock go (as leaving the ``with`` block does), in the process that took it."""
        if self._held is None or self._entered_by != os.getpid():
            raise UsageError(f"lock {self.name!r} is not held by this Lock object in this process")
        self.__exit__(None, None, None)

    def _leave(self, ticket: dict[str, Any]) -> None:
        """Give up a kept waiting ticket (an AsyncLock's wait that was cancelled)."""
        backend = Opened(self.backend, self.lock_dir)
        try:
            with contextlib.suppress(PearingError):
                ops.release(backend, self.name, self.repo, ticket["ticket_id"])
        finally:
            backend.close()

    @property
    def held(self) -> bool:
        """Is the lock held by this object, in this process, right now?"""
        return self._held is not None and self._entered_by == os.getpid()


class AsyncLock:
    """``Lock`` for asyncio: ``async with AsyncLock(name, ...) as held``, the same arguments.

    The wait runs in a worker thread, so the event loop serves other tasks meanwhile. A task
    cancelled while it waits leaves the line (within a fraction of a second) before the
    CancelledError goes on; one cancelled just as the lock came releases it first. Leaving the
    block releases, as ``with`` does.
    """

    def __init__(self, name: str, **options: Any) -> None:
        self._lock = Lock(name, **options)

    @property
    def held(self) -> bool:
        return self._lock.held

    async def __aenter__(self) -> Held:
        import asyncio
        import threading

        stop = threading.Event()
        work = asyncio.get_running_loop().run_in_executor(None, self._lock._enter, stop.is_set)
        try:
            return await asyncio.shield(work)
        except asyncio.CancelledError:
            stop.set()
            while not work.done():  # the wait ends within a poll; nothing is left in line
                with contextlib.suppress(asyncio.CancelledError):
                    await asyncio.wait([work])
            failed = None if work.cancelled() else work.exception()
            if failed is None and not work.cancelled():
                await asyncio.get_running_loop().run_in_executor(None, self._lock.release)
            elif isinstance(failed, Busy) and failed.kept:
                # A request uuid of the caller's keeps a place after Busy; a cancel gives it up.
                await asyncio.get_running_loop().run_in_executor(None, self._lock._leave, failed.ticket)
            raise

    async def __aexit__(self, exc_type: object, exc: object, tb: object) -> None:
        import asyncio

        await asyncio.get_running_loop().run_in_executor(None, self._lock.__exit__, exc_type, exc, tb)


class Thread:
    """Thread ``number`` of a scope, as a fenced target (the seed's thread service)::

        with Lock("thread-work.42", repo="teams/platform/website") as held:
            t = Thread("teams/platform/website", 42)
            if not any(r["kind"] == "implementation" for r in t.tree()["replies"]):
                t.reply("implementation", "Done.", links=["branch:codex/thread-42"], fence=held.fence)

    ``reply`` is stored only if its fence is >= the highest the thread has accepted (else
    ``StaleFence``); without ``fence`` it takes ``PEARING_FENCE`` inside a pearing-run of
    ``thread-work.N``, else the fence of a ticket this identity holds on it (else ``NotHeld``
    subclass ``NoFence``); ``unfenced=True`` stores a note with none.
    """

    def __init__(
        self,
        repo: str,
        number: int,
        *,
        lock_dir: str | None = None,
        backend: str | None = None,
        identity: str | None = None,
    ) -> None:
        self.repo, self.number = names.scope(repo, "repo"), names.thread(number, "number")
        self.lock_dir = resolve_lock_dir(lock_dir)
        self.backend = backend_url(backend, os.environ.get(ENV_BACKEND))
        self.identity = identities.resolve(identity)

    def tree(self) -> dict[str, Any]:
        from singleflight.rules import threads

        b = open_backend(self.backend, self.lock_dir)
        try:
            return threads.tree(b, self.repo, self.number)
        finally:
            b.close()

    def reply(
        self,
        kind: str,
        body: str,
        links: tuple[str, ...] | list[str] = (),
        parent: str | None = None,
        fence: int | None = None,
        *,
        unfenced: bool = False,
    ) -> dict[str, Any]:
        from singleflight.rules import threads

        b = open_backend(self.backend, self.lock_dir)
        try:
            return threads.reply(
                b,
                self.repo,
                self.number,
                kind=kind,
                body=body,
                links=list(links),
                parent=parent,
                fence=fence,
                unfenced=unfenced,
                identity=self.identity,
                env=os.environ,
            )
        finally:
            b.close()
