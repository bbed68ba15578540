"""The etcd backend: the lock, queue, lease and records of every (scope, lock) in a cluster.

Token files stay on the acquiring host, 0600 in the local lock dir, and name
the backend, so ``pearing-guard`` checks the cluster.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import signal
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

from singleflight.core import names, proc
from singleflight.core.const import (
    ENDED_TICKET_RETENTION,
    ENV_BACKEND,
    HELD,
    REQUEST_ACTIVE,
    WAITING,
)
from singleflight.core.errors import NotHeld, UnknownLock, UnknownTicket
from singleflight.core.fs import Dir, lock_parts
from singleflight.core.line import Line
from singleflight.core.protocol import Taken
from singleflight.core.reasons import EndReason
from singleflight.core.ticket import RequestRecord, Ticket, rfc3339
from singleflight.core.tokens import Claim, Facts, TokenFiles, mint_token, token_hash
from singleflight.etcd import events, records
from singleflight.etcd import guard as recipe_guard
from singleflight.etcd.client import Cluster, Refused, cmp, op_delete, op_put, parse_url, revision
from singleflight.etcd.grip import EtcdGrip
from singleflight.etcd.lease import EtcdLease, margin_for
from singleflight.etcd.lock import Mutex, ttl_of
from singleflight.etcd.place import EtcdPlace
from singleflight.etcd.records import deadline_mono, margin_of, parse, parse_ticket, stamp_lease
from singleflight.etcd.watch import DeleteWatch

_REQUEST_RETENTION = 24 * 3600.0


class EtcdLock:
    """One (scope, lock) in the cluster."""

    def __init__(self, backend: EtcdBackend, repo: str, lock: str, *, must_exist: bool = False) -> None:
        self.backend, self.repo, self.lock = backend, repo, lock
        # Opened without ``create``: a ticket looked up in a lock with no key at all names the lock.
        self.must_exist = must_exist
        self.cluster = backend.cluster
        self.mutex = Mutex(self.cluster, repo, lock)
        self._leases: dict[str, int] = {}
        self._kept: dict[str, float] = {}
        self._adopted: dict[str, dict[str, Any]] = {}
        self._agents: set[str] = set()  # tickets adopted by their agent (pearing-cli, MCP, Lock)
        self._minted: dict[str, str] = {}
        self._tokens: TokenFiles | None = None

    holder_waits_too = True  # a grip is data: handed to a holder forked as the run starts to wait

    def grip_from(self, info: dict[str, Any]) -> EtcdGrip:
        return EtcdGrip.from_handover(self.cluster, info)

    def close(self) -> None:
        if self._tokens is not None:
            self._tokens.close()
            self._tokens.root.close()
            self._tokens = None

    @property
    def tokens(self) -> TokenFiles:
        """This host's token files of the lock, in the local lock dir."""
        if self._tokens is None:
            root = Dir.open_root(self.backend.lock_dir, create=True)
            try:
                d = root.walk(lock_parts(self.repo, self.lock))
            finally:
                root.close()
            self._tokens = TokenFiles(self.backend.lock_dir, d)
        return self._tokens

    def _lease_for(self, ticket: Ticket) -> int:
        """The holder's lease of the ticket, granted before it joins (the request claim rides on it)."""
        lease = self._leases.get(ticket.ticket_id)
        if lease is None:
            sent = time.monotonic()
            lease = self._leases[ticket.ticket_id] = self.cluster.grant(ttl_of(ticket.lease_seconds))
            self._kept[ticket.ticket_id] = sent
        return lease

    def kept_at(self, ticket_id: str) -> float:
        return self._kept.get(ticket_id, 0.0)

    def _mint(self, ticket: Ticket) -> None:
        """The run's token, minted as it joins: its hash goes into the key with it, so the
        hand-over writes nothing before COMMAND starts. Only this process knows the token
        (and, forked, its holder); nobody can show it before it is held."""
        token = self._minted[ticket.ticket_id] = mint_token()
        ticket.token_hash = token_hash(token)

    def token_of(self, ticket_id: str) -> str:
        return self._minted[ticket_id]

    def keep_hold(self, ticket: Ticket) -> bool:
        """While waiting: the holder's lease kept alive at TTL/3. False once it lapsed (frozen past it)."""
        tid = ticket.ticket_id
        lease, kept = self._leases.get(tid), self._kept.get(tid, 0.0)
        if lease is None or time.monotonic() - kept < ttl_of(ticket.lease_seconds) / 3:
            return True
        sent = time.monotonic()
        if self.cluster.keepalive(lease) <= 0:
            return False
        self._kept[tid] = sent
        return True

    # -- requests ------------------------------------------------------------------------

    def last_success(self) -> float | None:
        return self.mutex.read_last_success()

    def read_request(self, request_uuid: str) -> tuple[RequestRecord | None, Any]:
        return self.mutex.read_request_kv(request_uuid)

    def put_request(self, ticket: Ticket, record: RequestRecord | None, seen: Any) -> bool:
        """Compare-and-swap on the key's mod revision. A claim rides on the run's own lease (the
        holder's, granted here before it joins): if the run dies, its claim goes with it, and a
        replay may run again; while it lives, replays see it."""
        key = self.mutex.r + ticket.request_uuid
        check = cmp(key, "MOD", "EQUAL", seen["mod_revision"]) if seen else cmp(key, "CREATE", "EQUAL", 0)
        if record is None:
            op = op_delete(key)
        elif record.active:
            op = op_put(key, record.to_json(), self._lease_for(ticket))
        else:
            keep = self.cluster.grant(ttl_of(max(1.0, (record.expires_at or 0) - time.time())))
            op = op_put(key, record.to_json(), keep)
        return bool(self.cluster.txn([check], [op], []).get("succeeded"))

    def request_alive(self, record: RequestRecord) -> bool:
        return True  # an active record rides on its run's lease: it would be gone with the run

    # -- acquiring -------------------------------------------------------------------------

    def enter(self, ticket: Ticket) -> EtcdPlace:
        tid = ticket.ticket_id
        ttl = ttl_of(ticket.lease_seconds)
        adopted = self._adopted.pop(tid, None)
        if adopted is None:
            lease = self._lease_for(ticket)
            ticket.holder_host = ticket.holder_host or os.uname().nodename
            self._mint(ticket)
            # Nobody holds, waits or guards: our key goes straight onto the holder's lease.
            kv = self.mutex.join_free(ticket, lease)
            if kv is None:
                return EtcdPlace(self, ticket, lease, None)
            grip = EtcdGrip(self.cluster, lease, kv, ttl, kept_at=self._kept[tid], token=self._minted[tid])
            return EtcdPlace(self, ticket, lease, grip)
        # Created by pearing-cli acquire-lock, on the holder's lease: its agent takes over.
        lease = self._leases[tid] = int(adopted["lease"])
        if self.mutex.first_now(adopted):
            grip = EtcdGrip(self.cluster, lease, adopted, ttl, kept_at=self._kept[tid], token=self._minted[tid])
            return EtcdPlace(self, ticket, lease, grip)
        return EtcdPlace(self, ticket, lease, None, kv=adopted)

    # -- --cancel-in-progress (the rules: rules/events.py), through the cluster only: no signal,
    # the holder watches its key (``EtcdLease``) ------------------------------------------

    def holder_record(self) -> tuple[Ticket, Any] | None:
        return events.holder_record(self.mutex)

    def mark_superseded(self, holder: Ticket, by: str | None, seen: Any) -> bool:
        return events.mark_superseded(self.mutex, holder, by, seen)

    def end_superseded(
        self, held: Any, stands: Callable[[str], bool], keep: Callable[[], None], every: float
    ) -> str | None:
        assert isinstance(held, EtcdLease), "the lease this backend's take returned"
        return events.end_superseded(held, stands, keep, every)

    def take(self, grip: EtcdGrip, ticket: Ticket, *, promoted: bool, kill_grace: float) -> tuple[EtcdLease, Taken]:
        """The key is first in line and its token's hash is in it since it joined: nothing to
        write before COMMAND starts. The holder settles the rest (its lease, pid, deadline)
        a moment later (``EtcdLease``)."""
        ttl = ttl_of(ticket.lease_seconds)
        # A request timeout short enough that a dead member cannot hold the holder past its deadline.
        cluster = Cluster(self.backend.url, timeout=max(0.2, min(1.0, ttl / 10)))
        mutex = Mutex(cluster, self.repo, self.lock)
        kv = grip.kv
        key, fence = str(kv["key"]), int(kv["create_revision"])
        t = parse_ticket(kv["value"])
        owner = (t.holder_pid, t.holder_start)  # who waited: pearing-run's wrapper, or the agent itself
        t.state, t.fence, t.promoted = HELD, fence, promoted or t.promoted
        t.holder_pid, t.holder_start = os.getpid(), proc.start_time(os.getpid())
        t.holder_host = os.uname().nodename
        t.acquired_at = time.time()
        t.token_hash = token_hash(grip.token)
        stamp_lease(t, t.lease_seconds)  # the lease starts now
        margin = margin_for(ttl, kill_grace, cluster.timeout)
        ticket.fence, ticket.token_hash = fence, t.token_hash
        driver = EtcdLease(
            mutex,
            grip.lease,
            kv,
            t,
            self.tokens,
            margin=margin,
            kept_at=grip.kept_at,
            waiting_lease=grip.waiting_lease,
            keep_lease=grip.keep_lease,
            owner=owner,
        )
        if t.ticket_id in self._agents:
            # Its owner (pearing-cli, MCP, Lock) reads the ticket as soon as it is ready.
            driver.settle()
        token_file = self.tokens.write(t, grip.token, backend=self.backend.url, lease=str(grip.lease), key=key)
        # PEARING_BACKEND too: COMMAND's pearing-cli heartbeats and guards must reach the cluster.
        env = {"ETCD_LOCK_KEY": key, "ETCD_LOCK_REV": str(fence), ENV_BACKEND: self.backend.url}
        return driver, Taken(fence, grip.token, token_file, env)

    # -- the ticket ------------------------------------------------------------------------

    def create(self, ticket: Ticket) -> Ticket:
        mutex = self.mutex
        rec, _ = mutex.read_request_kv(ticket.request_uuid)
        if rec is not None and rec.ticket_id:
            return self._existing(rec.ticket_id)
        ticket.holder_host = os.uname().nodename
        stamp_lease(ticket, ticket.lease_seconds)  # the waiting ticket's lease: its owner heartbeats it
        # On the holder's lease until the agent has it (it moves to a waiting lease if it waits).
        lease = self.cluster.grant(ttl_of(ticket.lease_seconds))
        # A copy outlives the ticket's lease (an hour), so a lapsed ticket reads "expired", not unknown.
        keep = self.cluster.grant(int(ENDED_TICKET_RETENTION))
        # Created behind a holder, waiter or guard, it waits behind another holder (promoted),
        # even if that one is gone before the agent gets going.
        key, copy, bodies = mutex.q + ticket.ticket_id, mutex.t + ticket.ticket_id, []
        for promoted in (False, True):
            ticket.promoted = promoted
            bodies.append(records.value(ticket, lease))
        r = self.cluster.txn(
            [cmp(mutex.q, "CREATE", "EQUAL", 0, prefix=True), cmp(mutex.g, "CREATE", "EQUAL", 0, prefix=True)],
            [op_put(key, bodies[0], lease), op_put(copy, bodies[0], keep)],
            [op_put(key, bodies[1], lease), op_put(copy, bodies[1], keep)],
        )
        ticket.promoted = not r.get("succeeded")
        # Only one acquisition per uuid, even when two arrive at once: the uuid record is
        # created by compare-and-swap, and the loser withdraws its ticket for the winner's.
        retain = self.cluster.grant(int(_REQUEST_RETENTION))
        record = RequestRecord(state=REQUEST_ACTIVE, ticket_id=ticket.ticket_id, created_at=time.time())
        if not mutex.claim_request(ticket.request_uuid, record, retain, None):
            self.cluster.revoke(lease)
            self.cluster.revoke(retain)
            rec, _ = mutex.read_request_kv(ticket.request_uuid)
            return self._existing(rec.ticket_id if rec and rec.ticket_id else ticket.ticket_id)
        return ticket

    def _existing(self, ticket_id: str) -> Ticket:
        found = self.mutex.ticket(ticket_id)
        if found is None:
            self._lock_must_exist()
            raise UnknownTicket(ticket_id)
        return found[0]

    def _lock_must_exist(self) -> None:
        """After a ticket was not found: as the lock dir does, say so when its lock does not exist
        at all. Only then, so the hot paths pay no extra read."""
        if self.must_exist and not self.mutex.exists():
            raise UnknownLock(self.repo, self.lock)

    def read(self, ticket_id: str) -> Ticket | None:
        found = self.mutex.ticket(ticket_id)
        if found is None:
            self._lock_must_exist()
            return None
        return found[0]

    def adopt(self, ticket_id: str, pid: int) -> Ticket | None:
        while True:
            kv = self.mutex.find(ticket_id)
            t = parse(kv["value"]) if kv is not None else None
            if kv is None or t is None or not t.live:
                return None
            key = kv["key"]
            sent = time.monotonic()
            if self.cluster.keepalive(kv["lease"]) <= 0:
                return None
            t.holder_pid, t.holder_start, t.holder_host = pid, proc.start_time(pid), os.uname().nodename
            self._mint(t)
            body = records.value(t, kv["lease"])
            # Compare-and-swap: the owner may heartbeat the waiting ticket meanwhile.
            r = self.cluster.txn([cmp(key, "MOD", "EQUAL", kv["mod_revision"])], [op_put(key, body, kv["lease"])], [])
            if r.get("succeeded"):
                self._adopted[ticket_id] = dict(kv, value=body, mod_revision=revision(r))
                self._agents.add(ticket_id)
                self._kept[ticket_id] = sent
                return t

    def waiting_deadline(self, ticket_id: str) -> float:
        kv = self.mutex.find(ticket_id)
        t = parse(kv["value"]) if kv is not None else None
        if t is None or not t.live:
            return 0.0
        due = deadline_mono(t)
        return math.inf if due is None else due

    def end(
        self, ticket_id: str, state: str, reason: str, *, only_if_held: bool = True, release: bool = True
    ) -> Ticket | None:
        found = self.mutex.ticket(ticket_id)
        if found is None:
            return None
        t, kv = found
        if kv is None:
            return None
        if not t.live or (only_if_held and t.state != HELD):
            if release and not t.live:
                self.cluster.revoke(kv["lease"])  # its token died earlier; now the lock goes too
            return None
        self.mutex.end(t, kv, state, reason, revoke=release)
        return t

    def prepare_request(self, ticket: Ticket, window: float) -> None:
        """A cluster does not run out of disk under one run: nothing to prepare."""

    def record_request(self, ticket: Ticket, status: int | None, window: float) -> None:
        record = RequestRecord.finished(ticket, status, window)
        self.mutex.write_request(ticket.request_uuid, record, max(window, 1.0))

    def record_success(self, ticket: Ticket) -> None:
        self.mutex.write_last_success(ticket.acquired_at or time.time(), ticket.ticket_id)

    def renew(self, ticket_id: str, seconds: float) -> Ticket:
        """Heartbeat: the ticket's lease runs ``seconds`` from now, recorded in its key.

        Its holder (or waiting agent) enforces it on its own clock. A lapsed lease is
        never revived: refused once the recorded deadline has passed.
        """
        while True:
            kv = self.mutex.find(ticket_id)
            if kv is None:
                raise NotHeld(ticket_id, self._existing(ticket_id).describe_end())
            key = kv["key"]
            t = parse(kv["value"])
            if t is None:
                raise UnknownTicket(ticket_id)
            if not t.live:
                raise NotHeld(ticket_id, t.describe_end())
            before = deadline_mono(t)
            if before is not None and before <= time.monotonic():
                raise NotHeld(ticket_id, f"lease expired at {rfc3339(t.lease_expires_at)}")
            stamp_lease(t, seconds)
            body = records.value(
                t, kv["lease"], margin=margin_of(kv["value"]) or None, owner=records.owner_of(kv["value"])
            )
            try:
                r = self.cluster.txn(
                    [cmp(key, "MOD", "EQUAL", kv["mod_revision"])], [op_put(key, body, kv["lease"])], []
                )
            except Refused:
                raise NotHeld(ticket_id, EndReason.LEASE_EXPIRED) from None
            if r.get("succeeded"):
                break
        if before is not None and (t.lease_deadline_mono or 0) < before and t.holder_host == os.uname().nodename:
            # A shorter lease than before: the holder sleeps until the deadline it knows,
            # so make it look now, or the lock would outlive the lease. (Held only: a
            # waiting agent has no handler for it yet, and re-reads every second anyway.)
            first = self.mutex.holder()
            if first is not None and first["key"] == key:
                proc.signal_exact(t.holder_pid, t.holder_start, signal.SIGUSR1)
        return self.read(ticket_id) or t  # its state and fence from its place in line

    def stop(self, t: Ticket, state: str, reason: str, *, within: float) -> Ticket | None:
        """The token dies now; the key stays until its holder (or waiter) lets go.

        Deleting it here would promote the next waiter while a pearing-run COMMAND may still
        be running (it is stopped first: TERM, the grace, KILL). Its holder sees the end at its
        next look (at once on this host: poked), and a dead one's lease lapses by itself.
        """
        found = self.mutex.ticket(t.ticket_id)
        if found is None:
            return None
        t, kv = found
        if kv is None or not t.live:
            return None
        if t.state == WAITING and self.mutex.cancel(t, kv, reason):
            return self.read(t.ticket_id) or t
        stored = parse(kv["value"])
        here = t.holder_host == os.uname().nodename
        if here and not proc.alive(t.holder_pid, t.holder_start) and not proc.alive(*records.owner_of(kv["value"])):
            # Its holder (or waiter) is dead, and so is the wrapper that would keep the lease
            # while COMMAND lives: nobody else will let go of the key.
            self.mutex.end(t, kv, state, reason)
            return t
        self.mutex.end(t, kv, state, reason, revoke=False)
        if not here:
            self._await_gone(kv, within)
        elif stored is not None and stored.state == HELD:
            # Only a holder that has settled (its own pid recorded, its handler in place) is poked.
            proc.poke_and_wait(t.holder_pid, t.holder_start, signal.SIGUSR1, within)
        return t

    def _await_gone(self, kv: dict[str, Any], within: float) -> None:
        """A holder on another host lets go at its next look (a third of its TTL at most)."""
        watch = DeleteWatch(self.cluster, kv["key"], kv["mod_revision"])
        try:
            if self.cluster.get(kv["key"]) is not None:
                watch.wait(time.monotonic() + within)
        finally:
            watch.close()

    def orphaned(self, t: Ticket) -> bool:
        """On this host, its holder and the wrapper that keeps its lease while COMMAND lives are
        both dead: nobody will let go of its key."""
        if t.holder_host != os.uname().nodename or proc.alive(t.holder_pid, t.holder_start):
            return False
        kv = self.mutex.find(t.ticket_id)
        return kv is None or not proc.alive(*records.owner_of(kv["value"]))

    def position(self, t: Ticket) -> int | None:
        kv = self.mutex.find(t.ticket_id)
        if kv is None:
            return None
        keys = [k["key"] for k in self.mutex.queue(keys_only=True)[0]]
        return (keys.index(kv["key"]) or None) if kv["key"] in keys else None

    def await_turn(self, ticket_id: str, wait_seconds: float) -> None:
        kv = self.mutex.find(ticket_id)
        if kv is not None:
            end = time.monotonic() + wait_seconds
            self.mutex.wait_first(kv["key"], kv["create_revision"], lambda: end, ticket_id=ticket_id)

    @staticmethod
    def _place(t: Ticket, kv: dict[str, Any], i: int) -> None:
        """State and fence from the ticket's place in line (the first holds)."""
        if t.live:
            t.state = HELD if i == 0 else WAITING
        t.fence = kv["create_revision"] if i == 0 else None

    def line(self) -> Line:
        q, _ = self.mutex.queue()
        entries: list[Ticket | dict[str, Any]] = []
        for i, kv in enumerate(q):
            t = parse(kv["value"])
            if t is None:
                # etcdctl lock, Go's concurrency.NewMutex: a holder or waiter of another client's.
                left = self.cluster.ttl(kv["lease"]) if kv["lease"] else -1
                entry = records.foreign(kv, i, self.repo, self.lock, float(left) if left >= 0 else None)
                if i == 0:
                    entry["lease_left"] = float(left) if left >= 0 else None
                entries.append(entry)
                continue
            self._place(t, kv, i)
            t.lease_deadline_mono = deadline_mono(t)
            entries.append(t)
        if q:
            fence: int | None = q[0]["create_revision"]
        else:
            last = self.cluster.get(self.mutex.base + "last")
            fence = int(last["value"]) if last is not None and last["value"].isdigit() else None
        # The same queue for etcd's own lock clients: etcdctl lock PREFIX, concurrency.NewMutex(s, PREFIX).
        return Line(entries, held=bool(q), fence=fence, extra={"etcd_mutex_prefix": self.mutex.prefix})


class EtcdBackend:
    def __init__(self, url: str, lock_dir: str) -> None:
        parse_url(url)
        self.url, self.lock_dir = url, lock_dir
        self.cluster = Cluster(url)

    def close(self) -> None:
        """Close the connections to the members now: a server (pearing-mcp) opens a backend per
        call, and one kept alive by an exception's traceback would hold its sockets until the
        garbage collector runs."""
        self.cluster.close()

    def __enter__(self) -> EtcdBackend:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def lock(self, repo: str, lock: str, *, create: bool = True) -> EtcdLock:
        return EtcdLock(self, names.scope(repo), names.lock_name(lock), must_exist=not create)

    def read_activity(self, identity: str) -> str | None:
        kv = self.cluster.get(f"{self.cluster.root}activity/{identity}")
        if kv is None:
            return None
        with contextlib.suppress(ValueError, AttributeError):
            text = json.loads(kv["value"]).get("activity")
            return str(text) if text is not None else None
        return None

    def update_activity(self, identity: str, activity: str | None) -> None:
        key = f"{self.cluster.root}activity/{identity}"
        if activity is None:
            self.cluster.delete(key)
        else:
            self.cluster.put(key, json.dumps({"activity": activity, "at": time.time()}).encode())

    def locks(self, repo: str) -> list[str]:
        prefix = f"{self.cluster.root}{repo}/@"
        kvs, _ = self.cluster.range_prefix(prefix, keys_only=True)
        found = set()
        for kv in kvs:
            name, _, kind = kv["key"][len(prefix) :].partition("/")
            if kind.startswith("q/"):
                found.add(name)
        return sorted(found)

    def guard_facts(self, claim: Claim, digest: str) -> Facts:
        return recipe_guard.facts(self.cluster, claim.repo, claim.lock, claim.ticket_id, digest)

    @contextmanager
    def hold_guard(self, claim: Claim, seconds: float) -> Iterator[bool]:
        held = recipe_guard.hold_guard(self.cluster, claim.repo, claim.lock, claim.ticket_id or "", seconds)
        try:
            yield held is not None
        finally:
            if held is not None:
                self.cluster.revoke(held[1])

    def accept_fence(self, resource: str, fence: int) -> int:
        return recipe_guard.accept_fence(self.cluster, resource, fence)
