"""Event-driven concurrency on etcd: ``--queue latest`` and ``--cancel-in-progress``.

A ``latest`` arrival takes the place of the older ``latest`` waiters. On etcd a place in
line is the create revision of a queue key, and a put keeps a key's create revision:
so the newcomer takes over the key of the earliest of them (one transaction: a
compare-and-swap on each one's mod revision, its ticket put in the key on the
newcomer's waiting lease, the others' keys deleted, an end record ``superseded by
NEW`` written for each). ``a/NEW`` names the key it now sits in. Each superseded
waiter watches its own key while it waits and leaves busy at once.

A cancel-in-progress request travels through the cluster alone: a compare-and-swap
sets ``superseded_by`` in the holder's own key, which an opted-in holder watches
(``EtcdLease``), and another one clears it (a withdrawal). When the holder acts on it,
its token dies in a txn over the revision it judged (``ending.end_judged``); then it stops
as on any loss: COMMAND stopped, lock released, and its run exits busy. Who may be asked,
and when a request stands, is rules/events.py's.
"""

from __future__ import annotations

import time

from singleflight.core.const import ENDED_TICKET_RETENTION, QUEUE_LATEST, TYPE_CHECKING
from singleflight.core.ticket import Ticket
from singleflight.etcd.client import Refused, cmp, op_delete, op_put, op_range, ranged, revision
from singleflight.etcd.lock import Mutex
from singleflight.etcd.records import margin_of, parse, ticket_id_of, value

if TYPE_CHECKING:
    from typing import Any


def join_latest(
    mutex: Mutex, t: Ticket, lease: int, alias_lease: int, own: dict[str, Any] | None
) -> tuple[dict[str, Any] | None, int]:
    """Queue ``t`` (a ``latest`` ticket) on the waiting ``lease``, in the place of the older
    ``latest`` waiters, whom it supersedes; at the end of the line if there are none.

    ``own``: the key a CLI ticket has had since it was created (None: a new one is made).
    ``a/TICKET`` rides on ``alias_lease`` (the holder's). Returns (our kv, how many are
    ahead); kv None when our own key was cancelled or taken over before we got here.
    """
    keep = 0
    try:
        while True:
            line, at = mutex.queue()
            me = t
            if own is not None:
                own = next((kv for kv in line if kv["key"] == own["key"]), None)
                found = parse(own["value"]) if own is not None else None
                if found is None or found.ticket_id != t.ticket_id:
                    return None, 0
                me = found  # as its owner last heartbeated it
            victims = [(i, kv) for i, kv in enumerate(line) if i > 0 and _older_latest(kv, t.ticket_id)]
            if not victims:
                if own is not None:
                    # Our key is in line already: a newer `latest` arrival will see it.
                    return mutex.rehome(own, lease)
                # Only if nobody joined since we looked: a `latest` one would have to be superseded.
                joined = mutex.join_if_no_arrival(t, lease, at)
                if joined is not None:
                    return joined
                continue
            keep = keep or mutex.cluster.grant(int(ENDED_TICKET_RETENTION))
            taken = _take_over(mutex, me, line, victims, lease=lease, alias_lease=alias_lease, own=own, keep=keep)
            if taken is not None:
                keep = 0  # it holds their end records now
                return taken
    finally:
        if keep:
            mutex.cluster.revoke(keep)


def _older_latest(kv: dict[str, Any], me: str) -> bool:
    t = parse(kv["value"])
    return t is not None and t.live and t.queue_mode == QUEUE_LATEST and t.ticket_id != me


def _take_over(
    mutex: Mutex,
    me: Ticket,
    line: list[dict[str, Any]],
    victims: list[tuple[int, dict[str, Any]]],
    *,
    lease: int,
    alias_lease: int,
    own: dict[str, Any] | None,
    keep: int,
) -> tuple[dict[str, Any] | None, int] | None:
    """One transaction: the earliest place among the victims' keys (and our own) becomes ours.
    None when the line changed under us (a heartbeat, a promotion): look again. Our kv is None
    when our takeover was done already and we are gone since (``_taken_already``)."""
    first_i, target = victims[0]
    pred = line[first_i - 1]
    if own is not None and own["create_revision"] < target["create_revision"]:
        target = own
    me.promoted = True  # if it is ever held, it waited behind another holder
    body = value(me, lease)
    # Someone is still ahead of the earliest victim: it is waiting, not being promoted.
    checks = [cmp(pred["key"], "CREATE", "EQUAL", pred["create_revision"])]
    checks += [cmp(kv["key"], "MOD", "EQUAL", kv["mod_revision"]) for _, kv in victims]
    if own is not None:
        checks.append(cmp(own["key"], "MOD", "EQUAL", own["mod_revision"]))
    ops = [
        mutex.keys_before(target["create_revision"]),
        op_put(target["key"], body, lease),  # a put keeps the create revision: the place in line
    ]
    now, ends = time.time(), []
    for _, kv in victims:
        old = parse(kv["value"])
        assert old is not None
        old.supersede(me.ticket_id, now)
        ends.append(mutex.e + old.ticket_id)
        ops += [op_put(ends[-1], value(old, kv["lease"]), keep), op_delete(mutex.a + old.ticket_id)]
        if kv["key"] != target["key"]:
            ops.append(op_delete(kv["key"]))
    if own is not None and own["key"] != target["key"]:
        ops.append(op_delete(own["key"]))
    if target["key"] != mutex.q + me.ticket_id:
        ops.append(op_put(mutex.a + me.ticket_id, target["key"].encode(), alias_lease))
    r = mutex.cluster.txn(checks, ops, [op_range(target["key"]), op_range(ends[0])])
    if not r.get("succeeded"):
        return _taken_already(mutex, me, lease, r)
    kv = dict(target, value=body, mod_revision=revision(r), lease=lease)
    return kv, len(ranged(r, 0)[0])


def _taken_already(mutex: Mutex, me: Ticket, lease: int, r: dict[str, Any]) -> tuple[dict[str, Any] | None, int] | None:
    """Our takeover, if the txn that failed had been applied already: a member that applied it
    and died before answering makes the client send it to the next one (``Cluster.post``),
    whose compares then fail on our own writes. Looking again would find no older ``latest``
    waiter and join a second key for us behind the one we took over. Only our takeover ends
    the first victim as superseded by us; then our key is the target while it carries our
    ticket on our lease (else: superseded or cancelled since, and gone). None: look again."""
    (now, _), (ended, _) = ranged(r, 0), ranged(r, 1)
    victim = parse(ended[0]["value"]) if ended else None
    if victim is None or victim.superseded_by != me.ticket_id:
        return None
    if now and ticket_id_of(now[0]["value"]) == me.ticket_id and now[0]["lease"] == lease:
        return now[0], mutex.count_ahead(now[0]["create_revision"])
    return None, 0


def mark_superseded(mutex: Mutex, holder: Ticket, by: str | None, kv: dict[str, Any]) -> bool:
    """``superseded_by`` into the holder's key, by compare-and-swap on its mod revision (an
    opted-in holder watches its key: it is told in moments, from any host)."""
    if not holder.live:
        return False
    holder.superseded_by = by
    body = value(holder, kv["lease"], margin=margin_of(kv["value"]) or None)
    try:
        r = mutex.cluster.txn(
            [cmp(kv["key"], "MOD", "EQUAL", kv["mod_revision"])], [op_put(kv["key"], body, kv["lease"])], []
        )
    except Refused:
        return False  # its lease went meanwhile
    return bool(r.get("succeeded"))
