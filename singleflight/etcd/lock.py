"""The lock recipe on etcd: etcd's own ``client/v3/concurrency/mutex.go``, on its prefix.

Every key lives under ``/PREFIX/`` (the URL's tenant, default ``pearing``):

    /PREFIX/SCOPE/@LOCK/q/...        the queue: the etcd concurrency-mutex prefix
                                     ``/PREFIX/SCOPE/@LOCK/q`` (what ``etcdctl lock`` and
                                     Go's ``concurrency.NewMutex`` take). The holder is the
                                     key with the lowest create revision, FIFO for free, and
                                     that revision is its fence. Ours are ``q/TICKET`` (the
                                     ticket as JSON); etcd's clients write ``q/LEASEHEX``
                                     with an empty value: foreign holders and waiters.
                                     A ``--queue latest`` arrival takes over the key of
                                     the older ``latest`` waiter it supersedes (a put with
                                     its own ticket: the create revision, so the place in
                                     line, stays), so a key ``q/OLD`` may carry ticket NEW.
    /PREFIX/SCOPE/@LOCK/a/TICKET     such a ticket's key name (``q/OLD``), on its holder's lease
    /PREFIX/SCOPE/@LOCK/g/ID         an in-flight pearing-guard exec; a new pearing holder
                                     waits for these to go before it proceeds
    /PREFIX/SCOPE/@LOCK/e/TICKET     an ended ticket, kept an hour on a lease of its own
    /PREFIX/SCOPE/@LOCK/t/TICKET     a ticket as created (CLI) or settled (a holder), kept an
                                     hour until it ends: a lapsed lease reads expired
    /PREFIX/SCOPE/@LOCK/r/UUID       request-uuid record (dedupe), on a retention lease
    /PREFIX/SCOPE/@LOCK/s            the last successful start (--min-interval)
    /PREFIX/SCOPE/@LOCK/last         the newest fence (tells an old token it was superseded)
    /PREFIX/SCOPE/@LOCK/sl/I         --slots N: holder I of N (the first N keys of the line
                                     hold), naming its queue key, on its lease (``slots.py``)
    /PREFIX/activity/IDENTITY        update-user-activity
    /PREFIX/ledger/RESOURCE          pearing-guard fence, updated by compare-and-swap

A ticket's key has two leases in its life. While it waits it rides on a short
waiting lease (``WAIT_TTL``) that its waiter keeps alive, so a waiter killed with -9
leaves the line within seconds. The holder's lease (the run's ``--lease-seconds``) is
granted before joining and kept alive meanwhile; on promotion the key is put again on
it (a put keeps the create revision: the fence does not change). An arrival that
finds nobody in line joins straight on the holder's lease: one grant and one txn, as
``etcdctl lock`` does.

The ticket's lease *deadline* (``--lease-seconds`` since the last renewal or
heartbeat) is not the etcd lease's TTL: it is recorded in the key's value and
enforced by the holder on its own clock, while the etcd lease only proves that the
holder (or its wrapper) is alive and reaches the cluster.
"""

from __future__ import annotations

import math
import time

from singleflight.core.const import PLACE_TTL, TYPE_CHECKING
from singleflight.core.ticket import Ticket
from singleflight.etcd.client import Cluster, cmp, op_put, op_range, ranged, revision
from singleflight.etcd.records import parse, ticket_id_of, value
from singleflight.etcd.watch import DeleteWatch, KeyWatch, wait_any

if TYPE_CHECKING:
    from collections.abc import Callable
    from typing import Any

# A waiter's key lives this long after its waiter (or owner) stops renewing it (killed, frozen).
WAIT_TTL = PLACE_TTL
# How often a waiter renews its leases and re-asks its deadline.
WAIT_TICK = 1.0

FIRST, GONE, TIMEOUT = "first", "gone", "timeout"


def ttl_of(seconds: float) -> int:
    """etcd leases count whole seconds; round up so a lease is never shorter than asked."""
    return max(2, math.ceil(seconds))


class Mutex:
    def __init__(self, cluster: Cluster, repo: str, lock: str) -> None:
        self.cluster, self.repo, self.lock = cluster, repo, lock
        self.base = f"{cluster.root}{repo}/@{lock}/"
        kinds = ("q/", "g/", "e/", "r/", "t/", "a/", "sl/")  # sl/: --slots, each holder's number (slots.py)
        self.q, self.g, self.e, self.r, self.t, self.a, self.sl = (self.base + s for s in kinds)

    @property
    def prefix(self) -> str:
        """The etcd concurrency-mutex prefix of this lock: ``etcdctl lock`` takes it as NAME."""
        return self.q[:-1]

    # -- joining ---------------------------------------------------------------

    def join_free(self, t: Ticket, lease: int) -> dict[str, Any] | None:
        """Our key on the holder's ``lease`` if nobody holds, waits or guards (one txn); its kv or None."""
        key, body = self.q + t.ticket_id, value(t, lease)
        r = self.cluster.txn(
            [cmp(self.q, "CREATE", "EQUAL", 0, prefix=True), cmp(self.g, "CREATE", "EQUAL", 0, prefix=True)],
            [op_put(key, body, lease)],
            [op_range(key)],
        )
        if not r.get("succeeded"):
            # Asked again (see ``_join``): our key from the first time was first in line.
            return self._own_key(ranged(r, 0)[0], t, lease)
        rev = revision(r)
        return {"key": key, "value": body, "create_revision": rev, "mod_revision": rev, "lease": lease}

    def join(self, t: Ticket, lease: int, *, promoted: bool = True) -> tuple[dict[str, Any], int]:
        """Our new key at the end of the line, on the waiting ``lease``: (kv, how many are ahead).

        Recorded as promoted: if it is ever held, it waited behind another holder. (With
        ``--slots`` a key joins before it knows: not yet, and ``rehome`` says so if it waits.)"""
        joined = self._join(t, lease, [], promoted=promoted)
        if joined is None:
            raise RuntimeError(f"ticket key {self.q}{t.ticket_id} already exists")
        return joined

    def join_if_no_arrival(self, t: Ticket, lease: int, since: int) -> tuple[dict[str, Any], int] | None:
        """``join``, only if no key joined the line after revision ``since`` (else None)."""
        return self._join(t, lease, [cmp(self.q, "CREATE", "LESS", since + 1, prefix=True)])

    def _join(
        self, t: Ticket, lease: int, checks: list[dict[str, Any]], *, promoted: bool = True
    ) -> tuple[dict[str, Any], int] | None:
        t.promoted = promoted
        key, body = self.q + t.ticket_id, value(t, lease)
        r = self.cluster.txn(
            [cmp(key, "CREATE", "EQUAL", 0), *checks],
            # The count comes first: it sees the line as it was before our key.
            [op_range(self.q, prefix=True, count_only=True), op_put(key, body, lease)],
            [op_range(key)],
        )
        if not r.get("succeeded"):
            # A member that applied our join and died before answering (killed, restarted) makes
            # the client ask the next one: our key is there already, and its place is ours, as
            # mutex.go reuses its key. Only we create a key named by our ticket (a newer
            # ``latest`` one that took it over put its own ticket in it: not ours any more).
            mine = self._own_key(ranged(r, 0)[0], t, lease)
            return None if mine is None else (mine, self.count_ahead(mine["create_revision"]))
        rev = revision(r)
        kv = {"key": key, "value": body, "create_revision": rev, "mod_revision": rev, "lease": lease}
        return kv, ranged(r, 0)[1]

    @staticmethod
    def _own_key(kvs: list[dict[str, Any]], t: Ticket, lease: int) -> dict[str, Any] | None:
        """Our key as the join we asked again put it: our ticket, on the lease we put it on."""
        if kvs and ticket_id_of(kvs[0]["value"]) == t.ticket_id and kvs[0]["lease"] == lease:
            return kvs[0]
        return None

    def count_ahead(self, rev: int) -> int:
        return len(ranged(self.cluster.txn([], [self.keys_before(rev)], []), 0)[0])

    def keys_before(self, rev: int) -> dict[str, Any]:
        """The keys ahead of ``rev``; ``len`` counts them (etcd's ``count`` ignores max_create)."""
        return op_range(self.q, prefix=True, keys_only=True, max_create=rev - 1)

    def first_now(self, kv: dict[str, Any]) -> bool:
        """Is our (existing) key first in line with no guard in flight? One txn, no write."""
        r = self.cluster.txn(
            [
                cmp(kv["key"], "MOD", "EQUAL", kv["mod_revision"]),
                cmp(self.q, "CREATE", "GREATER", kv["create_revision"] - 1, prefix=True),
                cmp(self.g, "CREATE", "EQUAL", 0, prefix=True),
            ],
            [],
            [],
        )
        return bool(r.get("succeeded"))

    def rehome(self, kv: dict[str, Any], lease: int) -> tuple[dict[str, Any] | None, int]:
        """Put our key on ``lease`` (same value, same create revision): (kv or None if gone, ahead).

        Compare-and-swap on its mod revision: an owner's heartbeat in between is kept, and a
        newer ``latest`` ticket that took the key over meanwhile keeps it (None: we are gone).
        """
        owner = ticket_id_of(kv["value"])
        while True:
            rev = kv["create_revision"]
            t = parse(kv["value"])
            if t is not None:
                t.promoted = True  # if it is ever held, it waited behind another holder
            body = value(t, lease) if t is not None else kv["value"]
            r = self.cluster.txn(
                [cmp(kv["key"], "MOD", "EQUAL", kv["mod_revision"])],
                [
                    op_put(kv["key"], body, lease),
                    self.keys_before(rev),
                ],
                [op_range(kv["key"])],
            )
            if r.get("succeeded"):
                return dict(kv, value=body, mod_revision=revision(r), lease=lease), len(ranged(r, 1)[0])
            fresh = ranged(r, 0)[0]
            if not fresh or fresh[0]["create_revision"] != rev or ticket_id_of(fresh[0]["value"]) != owner:
                return None, 0
            kv = fresh[0]

    def find(self, ticket_id: str) -> dict[str, Any] | None:
        """The ticket's key in line (None: not in line): ``q/TICKET``, or the key of an older
        ``latest`` waiter it took over (named by ``a/TICKET``). Either only while it carries
        this ticket: a newer ``latest`` arrival may have taken it over in turn."""
        r = self.cluster.txn([], [op_range(self.q + ticket_id), op_range(self.a + ticket_id)], [])
        (mine, _), (alias, _) = ranged(r, 0), ranged(r, 1)
        if mine:
            return mine[0] if ticket_id_of(mine[0]["value"]) == ticket_id else None
        target = alias[0]["value"].decode(errors="replace") if alias else ""
        if not target.startswith(self.q):
            return None
        kv = self.cluster.get(target)
        return kv if kv is not None and ticket_id_of(kv["value"]) == ticket_id else None

    # -- waiting -----------------------------------------------------------------

    def ahead(self, key: str, rev: int, n: int = 1) -> tuple[list[dict[str, Any]], dict[str, Any] | None, bool, int]:
        """(the ``n`` keys just ahead of ours, nearest first; our kv; a guard in flight?; the store
        revision): one read. With ``--slots N`` a key holds while fewer than N are ahead of it."""
        r = self.cluster.txn(
            [],
            [
                op_range(self.q, prefix=True, sort="DESCEND", limit=n, keys_only=True, max_create=rev - 1),
                op_range(key),
                op_range(self.g, prefix=True, limit=1, keys_only=True),
            ],
            [],
        )
        preds, mine, guards = ranged(r, 0)[0], ranged(r, 1)[0], ranged(r, 2)[0]
        return preds, (mine[0] if mine else None), bool(guards), revision(r)

    def wait_first(
        self,
        key: str,
        rev: int,
        until: Callable[[], float],
        tick: Callable[[], bool] | None = None,
        *,
        ticket_id: str,
        watch_mine: bool = False,
        slots: int = 1,
    ) -> tuple[str, dict[str, Any] | None]:
        """Block until our key is first in line (FIRST, its kv), gone, ended or taken over by
        another ticket (GONE), or ``until()``.

        Like mutex.go, we watch only the key just ahead of ours, from the revision we saw
        it at, and look again when it goes: that one read also says whether our own key is
        still live and ours, and whether a guarded side effect of the previous holder is in
        flight. With ``watch_mine`` (a ``latest`` waiter, whose key a newer one may take
        over) we watch our own key too, and look again when it changes. Every ``WAIT_TICK``
        ``tick()`` renews the waiter's leases (False: ours is gone) and ``until()`` is asked
        again (a heartbeat may have moved it); the watches move to the member that answered.

        With ``slots`` N (the semaphore) we hold once fewer than N are ahead, so we watch the N
        just ahead: we cannot hold before one of those goes.
        """
        end = until()
        due = time.monotonic() + WAIT_TICK
        while True:
            if tick is not None and time.monotonic() >= due:
                # A line that moves often (slots changing hands) must not starve our leases.
                if not tick():
                    return GONE, None
                end, due = until(), time.monotonic() + WAIT_TICK
            preds, mine, guarded, at = self.ahead(key, rev, slots)
            t = parse(mine["value"]) if mine is not None else None
            if mine is None or (t is not None and (not t.live or t.ticket_id != ticket_id)):
                return GONE, None
            if len(preds) < slots and not guarded:
                return FIRST, mine
            if len(preds) < slots:
                if not self.wait_guards(end, tick):
                    return TIMEOUT, None
                continue
            watches: list[KeyWatch] = [DeleteWatch(self.cluster, p["key"], at) for p in preds]
            if watch_mine:
                watches.append(KeyWatch(self.cluster, key, at))
            try:
                while not any(w.fired for w in watches):
                    now = time.monotonic()
                    if now >= end:
                        return TIMEOUT, None
                    if wait_any(watches, min(end, due)) or time.monotonic() < due:
                        continue
                    due = time.monotonic() + WAIT_TICK
                    if tick is not None:
                        if not tick():
                            return GONE, None
                    elif any(self.cluster.get(p["key"]) is None for p in preds):
                        break  # the stream's member may be cut off: we asked another
                    for w in watches:
                        w.follow(self.cluster.current)
                    end = until()
            finally:
                for w in watches:
                    w.close()

    def wait_guards(self, deadline: float, tick: Callable[[], bool] | None = None) -> bool:
        """A guarded side effect of the previous holder lands before we proceed (False: the
        deadline passed first, or ``tick`` said our place is gone)."""
        while True:
            guards, at = self.cluster.range_prefix(self.g, keys_only=True)
            if not guards:
                return True
            watch = DeleteWatch(self.cluster, guards[0]["key"], at)
            try:
                while not watch.deleted:
                    if time.monotonic() >= deadline:
                        return False
                    if not watch.wait(min(deadline, time.monotonic() + WAIT_TICK)):
                        if tick is not None and not tick():
                            return False
                        break  # look again: it may have lapsed unseen on a dead member
            finally:
                watch.close()

    # -- the queue as it stands ------------------------------------------------------

    def queue(self, *, keys_only: bool = False) -> tuple[list[dict[str, Any]], int]:
        return self.cluster.range_prefix(self.q, keys_only=keys_only)

    def holder(self) -> dict[str, Any] | None:
        """The first key in line (key and create revision only)."""
        r = self.cluster.txn([], [op_range(self.q, prefix=True, sort="ASCEND", limit=1, keys_only=True)], [])
        kvs = ranged(r, 0)[0]
        return kvs[0] if kvs else None

    def exists(self) -> bool:
        """Any key of this lock at all (its queue, a ticket or end record, a request, its last fence)?"""
        r = self.cluster.txn([], [op_range(self.base, prefix=True, limit=1, keys_only=True)], [])
        return bool(ranged(r, 0)[0])
