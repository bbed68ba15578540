"""How a holder's token dies on etcd: after the guarded commands of its ticket have ended.

``pearing-guard exec`` registers each guarded command as a key of its own under the lock's
``g/`` prefix, on a lease of its --max-seconds; a holder's end waits for those of its ticket,
keeping its own lease alive meanwhile, so a side effect in flight lands before the token dies
and the next holder proceeds (as the lock dir's guard lock does).
"""

from __future__ import annotations

import contextlib
import math
import time

from singleflight.core.cadence import guarded_every
from singleflight.core.const import RELEASED, TYPE_CHECKING
from singleflight.core.errors import BackendUnavailable
from singleflight.core.ticket import Ticket
from singleflight.etcd.client import Cluster, Refused, cmp, op_delete, op_put, op_range, ranged
from singleflight.etcd.lock import Mutex
from singleflight.etcd.records import parse
from singleflight.etcd.watch import DeleteWatch

if TYPE_CHECKING:
    from collections.abc import Callable
    from typing import Any, Protocol
else:
    Protocol = object  # the checker's Protocols are plain classes at run time

# How often ``end`` tries its txn (a heartbeat or a new guarded command may come in between),
# and how often of these it waits for guarded commands of its ticket before the token dies
# regardless (a COMMAND starting pearing-guard exec after exec, each racing the end).
_END_TRIES = 8
_END_GUARD_ROUNDS = 4
# While ``end`` waits for a guarded command, the lease is kept alive at least this often.
_GUARD_KEEP_EVERY = 1.0


class _Held(Protocol):
    """What of a holder's lease (``EtcdLease``) its end reads and sets."""

    ticket: Ticket
    mutex: Mutex
    key: str
    fence: int
    mod: int
    lease: int
    keep_lease: int
    ttl: int
    unreachable: bool
    lapsed: bool
    key_gone: bool
    ended: bytes | None

    @property
    def cluster(self) -> Cluster: ...

    def _body(self) -> bytes: ...

    def _cut_off(self) -> float: ...

    def _keepalive(self) -> None: ...


def end(
    self: _Held, state: str, reason: str | Callable[[Ticket], str | None], keep: Callable[[], None] | None = None
) -> bool:
    """``Lease.end`` on etcd: ``reason`` as given (``_end``), or as a judgement (``end_judged``)."""
    if isinstance(reason, str):
        return _end(self, state, reason)
    return end_judged(self, state, reason, keep or self._keepalive, guarded_every(self.ticket.lease_seconds))


def _end_ops(self: _Held, body: bytes, *, leave: bool) -> list[dict[str, Any]]:
    """An end's writes: the end record (kept an hour), the newest fence, the key (gone with
    ``leave``, else kept, ended, on our lease) and the settled copy gone (the end record says it now)."""
    m, tid = self.mutex, self.ticket.ticket_id
    return [
        op_put(m.e + tid, body, self.keep_lease or self.lease),
        op_put(m.base + "last", str(self.fence).encode()),
        op_delete(self.key) if leave else op_put(self.key, body, self.lease),
        op_delete(m.t + tid),
    ]


def _end(self: _Held, state: str, reason: str) -> bool:
    """The token dies, after the guarded commands of its ticket (``pearing-guard exec``, each a
    key of its own, on a lease of its --max-seconds) have ended: expiry and release wait for
    them, as on the lock dir, with our lease kept alive meanwhile. Released (COMMAND has
    ended): the key goes in the same txn, and the next waiter is woken one round trip after
    COMMAND's end. Otherwise the key stays, marked ended, until ``release``: the lock is ours
    while COMMAND is being stopped."""
    if self.unreachable:
        return False  # stopping COMMAND must not wait on a cluster we cannot reach
    t, g = self.ticket, self.mutex.g
    # No guard key at all, the usual case: one txn, as without guards. Else: none of ours
    # since the revision at which we saw the last one go.
    guarded: dict[str, Any] | None = cmp(g, "CREATE", "EQUAL", 0, prefix=True)
    rounds = 0
    with contextlib.suppress(BackendUnavailable, Refused):
        for _ in range(_END_TRIES):
            t.end(state, reason)
            body = self._body()
            ops = _end_ops(self, body, leave=state == RELEASED)
            mine = [cmp(self.key, "CREATE", "EQUAL", self.fence), cmp(self.key, "MOD", "EQUAL", self.mod)]
            try:
                r = self.cluster.txn(
                    mine + ([guarded] if guarded else []),
                    ops,
                    [op_range(self.key), op_range(g, prefix=True, limit=1, keys_only=True)],
                )
            except Refused:
                if not self.keep_lease:
                    raise  # our own lease is gone
                # The end record's hour-long lease ran out under a run longer than that: the record
                # goes on our lease, and housekeeping moves it onto a new hour's.
                self.keep_lease = 0
                continue
            if r.get("succeeded"):
                self.ended = body
                self.key_gone = state == RELEASED
                return True
            now = ranged(r, 0)[0]
            cur = parse(now[0]["value"]) if now and now[0]["create_revision"] == self.fence else None
            if cur is None or not cur.live:
                return False  # gone, or ended by its owner (release-lock-ticket): that end record stands
            if now[0]["mod_revision"] != self.mod:
                self.mod = now[0]["mod_revision"]  # a heartbeat came in between
            elif guarded is not None and ranged(r, 1)[0]:
                rounds += 1
                at = _await_guards(self) if rounds <= _END_GUARD_ROUNDS else None
                guarded = None if at is None else cmp(g, "CREATE", "LESS", at + 1, prefix=True)
            else:
                return False  # not ours to end any more (the next check says why)
    return False


def end_judged(
    self: _Held, state: str, judge: Callable[[Ticket], str | None], keep: Callable[[], None], every: float
) -> bool:
    """The token dies for the reason ``judge`` gives the key's ticket as stored (None: it stays
    live), once no guarded command of its ticket is in flight (``keep`` called every ``every`` s
    meanwhile), only over the revision it judged (compared in the txn that ends it): a
    withdrawal or a new guarded command in between makes it judge again.

    This is ``end``'s transaction with one difference: a change of the key is judged again
    instead of being followed (a withdrawn cancel request must not end the token)."""
    t, mutex, cluster = self.ticket, self.mutex, self.cluster

    def until() -> float:  # not past the cut-off, nor once the lease lapsed
        return -math.inf if self.lapsed else self._cut_off()

    for _ in range(_END_TRIES):
        try:
            at = wait_guards_of(mutex, t.ticket_id, until, keep, every)
            if at is None:
                return False  # lapsed, or cut off from the cluster: the next check says so
            kv = cluster.get(self.key)
        except BackendUnavailable:
            return False
        if kv is None or kv["create_revision"] != self.fence:
            return False  # lost meanwhile: the next check says why
        cur = parse(kv["value"])
        if cur is None or not cur.live:
            return False  # ended or released meanwhile: the next check says why
        was = t.state, t.end_reason, t.ended_at, t.superseded_by
        try:
            why = judge(cur)
        except BackendUnavailable:
            return False  # judged again at the next look
        if why is None:
            return False
        t.end(state, why)
        body = self._body()
        ops = _end_ops(self, body, leave=False)  # the key stays: the lock is ours until COMMAND is dead
        mine = [cmp(self.key, "CREATE", "EQUAL", self.fence), cmp(self.key, "MOD", "EQUAL", kv["mod_revision"])]
        try:
            r = cluster.txn([*mine, cmp(mutex.g, "CREATE", "LESS", at + 1, prefix=True)], ops, [])
        except (BackendUnavailable, Refused) as exc:
            r = {}
            if isinstance(exc, Refused):
                self.keep_lease = 0  # the hour's lease ran out under a long run: ours, as ``end``
        if r.get("succeeded"):
            self.ended = body  # a later ``end`` finds it ended and leaves that record
            return True
        t.state, t.end_reason, t.ended_at, t.superseded_by = was
    return False


def _await_guards(self: _Held) -> int | None:
    """Until no guarded command of our ticket is in flight, our lease kept alive meanwhile;
    the revision at which none was. None: our lease lapsed, or the cluster was out of reach
    until the cut-off (COMMAND must be stopped now, while the lease is still ours)."""

    def until() -> float:
        return -math.inf if self.lapsed else self._cut_off()

    every = min(_GUARD_KEEP_EVERY, self.ttl / 4)
    return wait_guards_of(self.mutex, self.ticket.ticket_id, until, self._keepalive, every)


def wait_guards_of(
    mutex: Mutex, ticket_id: str, until: Callable[[], float], tick: Callable[[], None], every: float
) -> int | None:
    """Until no guarded command of ``ticket_id`` is in flight (its ``pearing-guard exec`` keys
    gone, revoked or lapsed): the revision at which none was; None once ``until()`` passed
    first. ``tick()`` runs every ``every`` seconds meanwhile (the holder's keepalive)."""
    owner = ticket_id.encode()
    while True:
        guards, at = mutex.cluster.range_prefix(mutex.g)
        mine = [kv for kv in guards if kv["value"] == owner]
        if not mine:
            return at
        watch = DeleteWatch(mutex.cluster, mine[0]["key"], at)
        try:
            while not watch.deleted:
                end = until()
                if time.monotonic() >= end:
                    return None
                if not watch.wait(min(end, time.monotonic() + every)):
                    tick()
                    break  # look again: it may have lapsed unseen on a dead member
        finally:
            watch.close()
