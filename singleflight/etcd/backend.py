"""The etcd backend: the lock, queue, lease and records of every (scope, lock) in a cluster.

Token files stay on the acquiring host, 0600 in the local lock dir, and name
the backend, so ``pearing-guard`` checks the cluster.
"""

from __future__ import annotations

import os
import time
from contextlib import contextmanager

from singleflight.core import names, proc
from singleflight.core.const import (
    ENDED_TICKET_RETENTION,
    ENV_BACKEND,
    ENV_SLOT,
    HELD,
    REQUEST_ACTIVE,
    REQUEST_RETENTION,
    TYPE_CHECKING,
)
from singleflight.core.request import (
    ACTIVITY_PREFIX,
    ANY_VERSION,
    FENCE_PREFIX,
    REQUEST_PREFIX,
    SUCCESS_RECORD,
    Key,
    RequestRecord,
)
from singleflight.core.ticket import Ticket
from singleflight.core.tokens import Claim, Facts, mint_token, token_hash
from singleflight.etcd import history, records, slots
from singleflight.etcd.client import (
    Cluster,
    cmp,
    nested,
    op_delete,
    op_put,
    op_range,
    op_txn,
    ranged,
)
from singleflight.etcd.grip import EtcdGrip
from singleflight.etcd.lease import EtcdLease, margin_for
from singleflight.etcd.lock import WAIT_TTL, Mutex, ttl_of
from singleflight.etcd.place import EtcdPlace
from singleflight.etcd.records import parse, parse_ticket, stamp_lease
from singleflight.etcd.tickets import EtcdTickets, refuse_ended
from singleflight.etcd.url import parse_url

if TYPE_CHECKING:
    from collections.abc import Callable, Iterator
    from typing import Any

    from singleflight.core.idle import Idle
    from singleflight.core.protocol import Taken


class EtcdLock(EtcdTickets):
    """One (scope, lock) in the cluster: its tickets, and taking it (leases, tokens, the line)."""

    def __init__(self, backend: EtcdBackend, repo: str, lock: str, *, must_exist: bool = False) -> None:
        super().__init__(backend.cluster, backend.lock_dir, repo, lock, must_exist=must_exist)
        self.backend = backend
        # The holder's lease of each ticket this process joined, and when it was last kept: the
        # backend's, as a run's request claim rides on it (``EtcdBackend.write_record``).
        self._leases, self._kept = backend.leases, backend.kept
        self._adopted: dict[str, tuple[dict[str, Any], float]] = {}  # its key, when its lease was kept
        self._agents: set[str] = set()  # tickets adopted by their agent (pearing-cli, MCP, Lock)
        self._minted: dict[str, str] = {}

    def _lease_for(self, ticket: Ticket) -> int:
        return self.backend.lease_for(ticket)

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

    # -- acquiring -------------------------------------------------------------------------

    def enter(self, ticket: Ticket) -> tuple[EtcdGrip | None, EtcdPlace]:
        place = self._arrive(ticket)
        return place.grip, place

    def _arrive(self, ticket: Ticket) -> EtcdPlace:
        adopted = self._adopted.pop(ticket.ticket_id, None)
        if ticket.slots > 1:
            slots.check(self.mutex, ticket)  # a wrong --slots is 64, busy or not
        if adopted is None and ticket.slots > 1:
            return self._enter_slots(ticket)
        if adopted is None:
            lease = self._lease_for(ticket)
            ticket.holder_host = ticket.holder_host or os.uname().nodename
            self._mint(ticket)
            # Nobody holds, waits or guards: our key goes straight onto the holder's lease.
            kv = self.mutex.join_free(ticket, lease)
            if kv is None:
                slots.check(self.mutex, ticket)  # not free: a slotted run may hold it
                return EtcdPlace(self, ticket, lease, None)
            return EtcdPlace(self, ticket, lease, self._grip(ticket, lease, kv))
        # Made by acquire-lock on a waiting lease its owner kept: its agent takes the key over with
        # a holder's lease of its own. First, it holds there (the key moves onto the holder's lease
        # as it settles); else ``queue`` moves the key to a waiting lease of its own.
        kv, waiting_kept = adopted
        lease = self._lease_for(ticket)
        if self.mutex.first_now(kv) if ticket.slots == 1 else self._holds_now(kv, ticket.slots):
            return EtcdPlace(self, ticket, lease, self._grip(ticket, lease, kv, (int(kv["lease"]), waiting_kept)))
        return EtcdPlace(self, ticket, lease, None, kv=kv)

    def _grip(self, t: Ticket, lease: int, kv: dict[str, Any], w: tuple[int, float] = (0, 0.0)) -> EtcdGrip:
        """Our key holds: on the holder's lease, or still on a waiting one ``w`` (which, kept when)."""
        kept, token, ttl = self._kept[t.ticket_id], self._minted[t.ticket_id], ttl_of(t.lease_seconds)
        return EtcdGrip(
            self.cluster, lease, kv, ttl, kept_at=kept, token=token, waiting_lease=w[0], waiting_kept_at=w[1]
        )

    def _holds_now(self, kv: dict[str, Any], n: int) -> bool:
        """Is our (existing) key among the first ``n`` with no guard in flight? (``first_now``)"""
        return self.mutex.count_ahead(kv["create_revision"]) < n and not slots.guarded(self.mutex)

    def _enter_slots(self, ticket: Ticket) -> EtcdPlace:
        """The semaphore: our key joins the line on the holder's lease at once, counting the keys
        ahead in the same transaction; fewer than N ahead (and no guard in flight), it holds.
        Else it waits as a CLI ticket's key does: ``queue`` moves it onto a waiting lease."""
        lease = self._lease_for(ticket)
        ticket.holder_host = ticket.holder_host or os.uname().nodename
        self._mint(ticket)
        kv, ahead = self.mutex.join(ticket, lease, promoted=False)
        if ahead < ticket.slots and not slots.guarded(self.mutex):
            return EtcdPlace(self, ticket, lease, self._grip(ticket, lease, kv))
        return EtcdPlace(self, ticket, lease, None, kv=kv)

    # -- --cancel-in-progress (the rules: rules/events.py), through the cluster only: no signal,
    # the holder watches its key (``EtcdLease``) ------------------------------------------

    def take(
        self, grip: EtcdGrip | dict[str, Any], ticket: Ticket, *, promoted: bool, kill_grace: float
    ) -> tuple[EtcdLease, Taken]:
        """The key is first in line and its token's hash is in it since it joined: nothing to
        write before COMMAND starts. The holder settles the rest (its lease, pid, deadline)
        a moment later (``EtcdLease``). A holder forked as its run started to wait is handed
        the grip as data (``EtcdGrip.handover``)."""
        if isinstance(grip, dict):
            grip = EtcdGrip.from_handover(self.cluster, grip)
        ttl = ttl_of(ticket.lease_seconds)
        # A request timeout short enough that a dead member cannot hold the holder past its deadline.
        cluster = Cluster(self.backend.url, timeout=max(0.2, min(1.0, ttl / 10)))
        mutex = Mutex(cluster, self.repo, self.lock)
        kv = grip.kv
        key, fence = str(kv["key"]), int(kv["create_revision"])
        t = parse_ticket(kv["value"])
        refuse_ended(cluster, key, t.ticket_id)
        t.slot = 0 if t.slots == 1 else slots.claim(self.mutex, t, kv, grip.lease)
        t.owner_pid, t.owner_start = t.holder_pid, t.holder_start  # who waited: pearing-run's wrapper, or the agent
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
        )
        if t.ticket_id in self._agents:
            # Its owner (pearing-cli, MCP, Lock) reads the ticket as soon as it is ready.
            driver.settle()
        token_file = self.tokens.write(t, grip.token, backend=self.backend.url, lease=str(grip.lease), key=key)
        # PEARING_BACKEND too: COMMAND's pearing-cli heartbeats and guards must reach the cluster.
        env = {"ETCD_LOCK_KEY": key, "ETCD_LOCK_REV": str(fence), ENV_BACKEND: self.backend.url, ENV_SLOT: str(t.slot)}
        # (The pipe protocol's, loaded by every process that takes a lock: not by pearing-guard.)
        from singleflight.core.protocol import Taken

        return driver, Taken(fence, grip.token, token_file, env)

    # -- the ticket ------------------------------------------------------------------------

    def create(self, ticket: Ticket) -> Ticket:
        mutex = self.mutex
        rec, seen = history.read_request_kv(mutex, ticket.request_uuid)
        if rec is not None and rec.ticket_id and (found := self.read(rec.ticket_id)) is not None:
            return found
        # No record, or one whose ticket is gone (ended an hour ago): a new ticket, and the record
        # set over the one read (as the lock dir and PostgreSQL do).
        ticket.holder_host = os.uname().nodename
        stamp_lease(ticket, ticket.lease_seconds)  # the waiting ticket's lease: its owner heartbeats it
        # On a waiting lease its owner keeps until its agent starts (and takes it over with a
        # holder's lease of its own): an owner killed before that leaves the line within WAIT_TTL.
        lease = self.cluster.grant(WAIT_TTL)
        # A copy outlives the ticket's lease (an hour), so a lapsed ticket reads "expired", not unknown.
        keep = self.cluster.grant(int(ENDED_TICKET_RETENTION))
        # Created behind a holder, waiter or guard, it waits behind another holder (promoted),
        # even if that one is gone before the agent gets going.
        key, copy, puts = mutex.q + ticket.ticket_id, mutex.t + ticket.ticket_id, []
        for promoted in (False, True):
            ticket.promoted = promoted
            body = records.value(ticket, lease)
            puts.append([op_put(key, body, lease), op_put(copy, body, keep)])
        free = [cmp(mutex.q, "CREATE", "EQUAL", 0, prefix=True), cmp(mutex.g, "CREATE", "EQUAL", 0, prefix=True)]
        # Only if our key is not there yet: sent again to the next member after the first applied
        # it (``Cluster.post``), the line is not free any more, but because of our own key.
        r = self.cluster.txn([cmp(key, "CREATE", "EQUAL", 0)], [op_txn(free, *puts)], [op_range(key)])
        if r.get("succeeded"):
            ticket.promoted = not nested(r, 0).get("succeeded")
        else:
            # What our first attempt wrote says; only we name a key by our ticket (a newer
            # `latest` one that took it over since found it behind someone: promoted).
            kvs = ranged(r, 0)[0]
            found = parse(kvs[0]["value"]) if kvs else None
            ticket.promoted = found.promoted if found is not None and found.ticket_id == ticket.ticket_id else True
        # Only one acquisition per uuid, even when two arrive at once: the uuid record is
        # created by compare-and-swap, and the loser withdraws its ticket for the winner's.
        retain = self.cluster.grant(int(REQUEST_RETENTION))
        record = RequestRecord(state=REQUEST_ACTIVE, ticket_id=ticket.ticket_id, created_at=time.time())
        if not history.claim_request(mutex, ticket.request_uuid, record, retain, seen):
            self.cluster.revoke(lease)
            self.cluster.revoke(retain)
            rec, _ = history.read_request_kv(mutex, ticket.request_uuid)
            return self._existing(rec.ticket_id if rec and rec.ticket_id else ticket.ticket_id)
        return ticket

    def _taking_over(self, t: Ticket) -> None:
        """An agent adopting the ticket its CLI call created (``rules.tickets.adopt``): its token
        is minted now, so its hash goes into the key with the agent's pid, as a joined one's does."""
        self._mint(t)

    def _taken_over(self, t: Ticket, kv: dict[str, Any], kept_at: float) -> None:
        # ``enter`` finds the key here, on its waiting lease: the agent takes it where it stands.
        self._adopted[t.ticket_id] = (kv, kept_at)
        self._agents.add(t.ticket_id)


# The tenant's keys that are not scopes (``PREFIX/activity/...``, ``PREFIX/ledger/...``).
_NOT_SCOPES = frozenset({"activity", "ledger"})


class EtcdBackend:
    def __init__(self, url: str, lock_dir: str, *, create: bool = True) -> None:
        parse_url(url)
        self.url, self.lock_dir = url, lock_dir
        self.cluster = Cluster(url)
        self.leases: dict[str, int] = {}
        self.kept: dict[str, float] = {}

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

    # -- records (what they hold: rules/requests.py, rules/records.py) ------------------------

    def _record_key(self, key: Key) -> str:
        root, name = self.cluster.root, key.name
        if key.lock is None:
            if name.startswith(ACTIVITY_PREFIX):
                return f"{root}activity/{name[len(ACTIVITY_PREFIX) :]}"
            if name.startswith(FENCE_PREFIX):
                return f"{root}ledger/{name[len(FENCE_PREFIX) :]}"
        else:
            base = Mutex(self.cluster, *key.lock).base
            if name == SUCCESS_RECORD:
                return base + "s"
            if name.startswith(REQUEST_PREFIX):
                return base + "r/" + name[len(REQUEST_PREFIX) :]
        raise ValueError(f"no such record: {key!r}")

    def read_record(self, key: Key) -> tuple[bytes | None, Any, str]:
        at = self._record_key(key)
        kv = self.cluster.get(at)
        return (None, None, f"etcd:{at}") if kv is None else (kv["value"], kv, f"etcd:{at}")

    def write_record(
        self, key: Key, body: bytes | None, seen: Any, *, run: Ticket | None = None, keep: float | None = None
    ) -> bool:
        """Compare-and-swap on the key's mod revision. A record of a run rides on the run's own
        lease (the holder's, granted before it joins): if the run dies, it goes with it."""
        at = self._record_key(key)
        if seen is ANY_VERSION:
            check = []
        else:
            check = [cmp(at, "MOD", "EQUAL", seen["mod_revision"]) if seen else cmp(at, "CREATE", "EQUAL", 0)]
        if body is None:
            op = op_delete(at)
        elif run is not None:
            op = op_put(at, body, self.lease_for(run))
        elif keep is not None:
            op = op_put(at, body, self.cluster.grant(ttl_of(max(1.0, keep))))
        else:
            op = op_put(at, body)
        return bool(self.cluster.txn(check, [op], []).get("succeeded"))

    def prepare_record(self, key: Key, body: bytes) -> None:
        """A cluster does not run out of disk under one run: nothing to prepare."""

    def lease_for(self, ticket: Ticket) -> int:
        """The holder's lease of the ticket, granted before it joins (the request claim rides on it)."""
        lease = self.leases.get(ticket.ticket_id)
        if lease is None:
            sent = time.monotonic()
            lease = self.leases[ticket.ticket_id] = self.cluster.grant(ttl_of(ticket.lease_seconds))
            self.kept[ticket.ticket_id] = sent
        return lease

    def locks(self, repo: str | None, *, idle: bool = False) -> list[tuple[str, str]]:
        root = self.cluster.root
        kvs, _ = self.cluster.range_prefix(root if repo is None else f"{root}{repo}/@", keys_only=True)
        found = set()
        for kv in kvs:
            # SCOPE/@LOCK/KIND...: a scope has no '@' (names.scope), so the first "/@" ends it.
            scope, at, rest = kv["key"][len(root) :].partition("/@")
            name, _, kind = rest.partition("/")
            if not at or (repo is not None and scope != repo) or scope.split("/", 1)[0] in _NOT_SCOPES:
                continue
            if kind.startswith("q/") or idle:
                found.add((scope, name))
        return sorted(found)

    def prune(self, repo: str, lock: str, keep: Callable[[Idle], str | None], *, dry_run: bool) -> str | None:
        from singleflight.etcd import prune  # pearing-cli prune's, not pearing-run's

        return prune.prune(self.cluster, repo, lock, keep, dry_run=dry_run)

    @contextmanager
    def guard(self, claim: Claim, digest: str, hold: float | None) -> Iterator[Facts]:
        from singleflight.etcd import guard as recipe_guard  # pearing-guard's, not pearing-run's

        if hold is None:
            yield recipe_guard.facts(self.cluster, claim.repo, claim.lock, claim.ticket_id, digest)
            return
        held = recipe_guard.hold_guard(self.cluster, claim.repo, claim.lock, claim.ticket_id or "", hold)
        try:
            if held is None:
                yield Facts(None)
            else:
                yield recipe_guard.facts(self.cluster, claim.repo, claim.lock, claim.ticket_id, digest)
        finally:
            if held is not None:
                self.cluster.revoke(held[1])

    def read_thread(self, repo: str, thread: int) -> tuple[list[dict[str, Any]], int | None]:
        from singleflight.etcd.threads import Threads

        return Threads(self.cluster).read(repo, thread)

    def add_reply(self, repo: str, thread: int, reply: dict[str, Any], *, highest: int | None) -> bool:
        from singleflight.etcd.threads import Threads

        return Threads(self.cluster).add(repo, thread, reply, highest=highest)
