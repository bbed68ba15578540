"""A lock's tickets in the cluster, as any process sees them: read one (its state from its place
in line), renew it, end it, the line as it stands. Taking the lock (leases,
tokens, joining) is ``EtcdLock``'s, which adds it."""

from __future__ import annotations

import contextlib
import os
import time

from singleflight.core import fault, proc
from singleflight.core.const import CANCELLED, ENDED_TICKET_RETENTION, HELD, TYPE_CHECKING, WAITING
from singleflight.core.errors import BackendUnavailable, NotHeld, UnknownLock, UnknownTicket
from singleflight.core.reasons import EndReason
from singleflight.core.ticket import Ticket
from singleflight.core.tokens import TokenFiles
from singleflight.etcd import records, slots
from singleflight.etcd.client import Cluster, Refused, cmp, op_delete, op_put, op_range, ranged, revision
from singleflight.etcd.lock import Mutex
from singleflight.etcd.records import deadline_mono, lapsed, margin_of, parse, refresh_copy, ticket_id_of, value

if TYPE_CHECKING:
    from collections.abc import Callable
    from typing import Any

    from singleflight.core.line import Line


# Ends over a key that changed since it was read (a holder settling, a heartbeat): read again this
# many times, then written over as it is.
_END_TRIES = 5


class EtcdTickets:
    def __init__(self, cluster: Cluster, lock_dir: str, repo: str, lock: str, *, must_exist: bool = False) -> None:
        self.cluster, self.lock_dir, self.repo, self.lock = cluster, lock_dir, repo, lock
        # Opened without ``create``: a ticket looked up in a lock with no key at all names the lock.
        self.must_exist = must_exist
        self.mutex = Mutex(cluster, repo, lock)
        self._tokens: TokenFiles | None = None

    def close(self) -> None:
        if self._tokens is not None:
            self._tokens.close()
            self._tokens = None

    @property
    def tokens(self) -> TokenFiles:
        """This host's token files of the lock, in the local lock dir (the holder writes its own)."""
        if self._tokens is None:
            self._tokens = TokenFiles.at(self.lock_dir, self.repo, self.lock)
        return self._tokens

    def _existing(self, ticket_id: str) -> Ticket:
        found = ticket_of(self.mutex, ticket_id)
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
        found = ticket_of(self.mutex, ticket_id)
        if found is None:
            self._lock_must_exist()
            return None
        return found[0]

    def end(
        self, ticket_id: str, state: str, reason: str, *, only_if_held: bool = True, release: bool = True
    ) -> Ticket | None:
        # Over the key as read: its holder settling (pid, since when) or a heartbeat in between is
        # read again, never written over (a release then saw an unsettled holder, did not poke it,
        # and its next look was a third of its lease away). The last try writes whatever came.
        for tries_left in range(_END_TRIES - 1, -1, -1):
            ended, done = self._end_once(ticket_id, state, reason, only_if_held, release, exact=tries_left > 0)
            if done:
                return ended
        return None

    def _end_once(
        self, ticket_id: str, state: str, reason: str, only_if_held: bool, release: bool, *, exact: bool
    ) -> tuple[Ticket | None, bool]:
        """``end`` once: (the ticket ended or None, whether that is the answer)."""
        found = ticket_of(self.mutex, ticket_id)
        fault.pause("pause-etcd-end-read")
        if found is None:
            return None, True
        t, kv = found
        if kv is None:
            return None, True
        if not t.live or (only_if_held and t.state != HELD):
            if release and not t.live:
                self.cluster.revoke(kv["lease"])  # its token died earlier; now the lock goes too
            return None, True
        if t.state == WAITING and not release:  # (released: nobody's process is left to start)
            if cancel_waiting(self.mutex, t, kv, reason):
                return self.read(ticket_id) or t, True  # out of the line: its waiter's watch sees the key go
            found = ticket_of(self.mutex, ticket_id)  # its turn came meanwhile: it ends as a holder
            if found is None or found[1] is None or not found[0].live:
                return None, True
            t, kv = found[0], found[1]
        return t, end_ticket(self.mutex, t, kv, state, reason, revoke=release, exact=exact)

    def update(self, ticket_id: str, change: Callable[[Ticket], bool]) -> Ticket | None:
        """Compare-and-swap on the ticket's key (its mod revision), read again whenever another
        write came in between (a heartbeat, a cancel request)."""
        while True:
            kv = self.mutex.find(ticket_id)
            if kv is None:
                change(self._existing(ticket_id))  # ended or lapsed: the change says why, if it asks
                return None
            key = kv["key"]
            t = parse(kv["value"])
            if t is None:
                raise UnknownTicket(ticket_id)
            was_mine = _is_me(t.holder_pid, t.holder_start)
            if not change(t) or not t.live:
                return None
            sent = time.monotonic()
            mine = t.state == WAITING and t.holder_host == os.uname().nodename and _is_me(t.holder_pid, t.holder_start)
            if mine:
                # Ours: we created it and answer for it until its agent starts (a busy machine
                # may start it late), or we are that agent; our heartbeat keeps its key too.
                # Only ours: anyone else's heartbeat must not keep a dead waiter's key in line.
                self.cluster.keepalive(kv["lease"])
            if mine and not was_mine:
                self._taking_over(t)
            body = records.value(t, kv["lease"], margin=margin_of(kv["value"]) or None)
            try:
                puts = [op_put(key, body, kv["lease"]), refresh_copy(self.mutex.t + ticket_id, body)]
                r = self.cluster.txn([cmp(key, "MOD", "EQUAL", kv["mod_revision"])], puts, [])
            except Refused:
                raise NotHeld(ticket_id, EndReason.LEASE_EXPIRED) from None
            if r.get("succeeded"):
                if mine and not was_mine:
                    self._taken_over(t, dict(kv, value=body, mod_revision=revision(r)), sent)
                return t

    def _taking_over(self, t: Ticket) -> None:
        """This process is about to answer for the waiting ticket ``t`` (an agent adopting the
        ticket its CLI call created): what goes into its key with that write."""

    def _taken_over(self, t: Ticket, kv: dict[str, Any], kept_at: float) -> None:
        """... and now does: its key as written, and when its lease was last kept."""

    @staticmethod
    def _place(t: Ticket, kv: dict[str, Any], i: int, holders: int) -> None:
        """State and fence from the ticket's place in line (the first ``holders`` hold)."""
        if t.live:
            t.state = HELD if i < holders else WAITING
        t.fence = kv["create_revision"] if i < holders else None

    def line(self) -> Line:
        from singleflight.core.line import Line  # status's and a waiter's, not a free lock's

        q, _ = self.mutex.queue()
        held = slots.holders(self.mutex, q)
        entries: list[Ticket | dict[str, Any]] = []
        for i, kv in enumerate(q):
            t = parse(kv["value"])
            if t is None:
                # etcdctl lock, Go's concurrency.NewMutex: a holder or waiter of another client's.
                left = self.cluster.ttl(kv["lease"]) if kv["lease"] else -1
                entry = records.foreign(kv, i, self.repo, self.lock, float(left) if left >= 0 else None)
                if i < held:
                    entry["lease_left"] = float(left) if left >= 0 else None
                entries.append(entry)
                continue
            self._place(t, kv, i, held)
            t.lease_deadline_mono = deadline_mono(t)
            entries.append(t)
        if q:
            fence: int | None = q[0]["create_revision"]
        else:
            last = self.cluster.get(self.mutex.base + "last")
            fence = int(last["value"]) if last is not None and last["value"].isdigit() else None
        # The same queue for etcd's own lock clients: etcdctl lock PREFIX, concurrency.NewMutex(s, PREFIX).
        n = max([t.slots for t in entries if not isinstance(t, dict)], default=1)
        extra = {"etcd_mutex_prefix": self.mutex.prefix}
        return Line(entries, held=bool(q), fence=fence, extra=extra, holders=held, slots=n)


def _is_me(pid: int | None, start: int | None) -> bool:
    """Is this process the one a ticket names (its pid and start time)?"""
    return pid == os.getpid() and start == proc.start_time(pid)


def ticket_of(mutex: Mutex, ticket_id: str) -> tuple[Ticket, dict[str, Any] | None] | None:
    """The ticket as it stands now (state from the queue), and its queue key."""
    kv = mutex.find(ticket_id)
    if kv is not None:
        t = parse(kv["value"])
        if t is None:
            return None  # not a ticket (``find`` returns ours only)
        if not t.live:  # its token is dead; its COMMAND is being stopped, the lock still taken
            return t, kv
        if t.slots > 1:  # the first N keys hold
            held = mutex.count_ahead(kv["create_revision"]) < t.slots
        else:
            first = mutex.holder()
            held = first is not None and first["key"] == kv["key"]
        t.state = HELD if held else WAITING
        t.fence = kv["create_revision"] if held else None
        return t, kv
    ended = mutex.cluster.get(mutex.e + ticket_id)
    if ended and (t := parse(ended["value"])) is not None:
        return t, None
    copy = mutex.cluster.get(mutex.t + ticket_id)
    t = lapsed(copy["value"]) if copy is not None else None
    return None if t is None else (t, None)


def end_ticket(
    mutex: Mutex, t: Ticket, kv: dict[str, Any], state: str, reason: str, *, revoke: bool = True, exact: bool = False
) -> bool:
    """Record the ticket's end (kept an hour); then revoke its lease: the key goes, the next is
    promoted. Without ``revoke`` the key stays, marked ended: the token is dead, the lock still ours.
    ``exact``: only over the key's value as read; False (nothing written) when it changed since."""
    t.end(state, reason)
    lease = int(kv["lease"])
    body = value(t, lease)
    mine = [cmp(kv["key"], "CREATE", "EQUAL", kv["create_revision"])]
    if exact:
        mine.append(cmp(kv["key"], "MOD", "EQUAL", kv["mod_revision"]))
    keep = mutex.cluster.grant(int(ENDED_TICKET_RETENTION))
    ended = op_put(mutex.e + t.ticket_id, body, keep)
    # Only over the very key we read: a put on a key that lapsed meanwhile would make a new one.
    r = mutex.cluster.txn(
        mine,
        [ended] if revoke else [ended, op_put(kv["key"], body, lease)],
        [op_range(kv["key"])],
    )
    if not r.get("succeeded"):
        now = ranged(r, 0)[0]
        if now and now[0]["create_revision"] == kv["create_revision"]:
            mutex.cluster.revoke(keep)
            return False  # changed since it was read: read it again
        mutex.cluster.put(mutex.e + t.ticket_id, body, keep)  # the key went meanwhile: its end stands
    if revoke:
        mutex.cluster.revoke(lease)
    return True


def cancel_waiting(mutex: Mutex, t: Ticket, kv: dict[str, Any], reason: str) -> bool:
    """Take a waiting ticket out of the line now, only while someone is still ahead of it:
    one that reached the head may be starting its COMMAND. False: it is first (or gone).
    Never a key a newer ``latest`` ticket took over meanwhile (compare-and-swap)."""
    keep = 0
    for _ in range(5):
        preds, mine, _, _ = mutex.ahead(kv["key"], kv["create_revision"], t.slots)
        if mine is None or ticket_id_of(mine["value"]) != t.ticket_id:
            return True  # gone from the line (superseded: its end record says so)
        if len(preds) < t.slots:
            return False
        keep = keep or mutex.cluster.grant(int(ENDED_TICKET_RETENTION))
        t.end(CANCELLED, reason)
        r = mutex.cluster.txn(
            [
                *(cmp(p["key"], "CREATE", "EQUAL", p["create_revision"]) for p in preds),
                cmp(kv["key"], "MOD", "EQUAL", mine["mod_revision"]),
            ],
            [op_put(mutex.e + t.ticket_id, value(t, int(kv["lease"])), keep), op_delete(kv["key"])],
            [],
        )
        if r.get("succeeded"):
            return True
    return False


def refuse_ended(cluster: Cluster, key: str, ticket_id: str) -> None:
    """In the holder's take: its owner may have released the ticket as its turn came, before the
    holder's first word. That end stands (NotHeld). One read; unanswered, the holder's first look
    finds out instead."""
    with contextlib.suppress(BackendUnavailable):
        now = cluster.get(key)
        stored = parse(now["value"]) if now is not None else None
        if stored is not None and not stored.live:
            raise NotHeld(ticket_id, stored.describe_end())
