"""The guard's side of the etcd backend: what the cluster knows of a token (``facts``), an in-flight guarded
command (``hold_guard``). The fence ledger is a record (``EtcdBackend.write_record``), judged by
``rules.records.accept_fence``."""

from __future__ import annotations

import os

from singleflight.core import proc
from singleflight.core.const import HELD, WAITING
from singleflight.core.tokens import Facts, same_secret
from singleflight.etcd.client import Cluster, cmp, op_put, op_range, ranged
from singleflight.etcd.lock import Mutex, ttl_of
from singleflight.etcd.records import deadline_mono, lapsed, margin_of, parse, ticket_id_of


def facts(cluster: Cluster, repo: str, lock: str, ticket_id: str | None, digest: str) -> Facts:
    """What the cluster knows of a claimed ticket, in one read (two for a `latest` takeover).

    Its state comes from its place in line (the first key holds), its fence is its key's
    create revision, and the cut-off test is what the holder itself believes: its etcd
    lease further from expiry than the margin at which a holder cut off from the cluster
    gives up (asked last, and only of a ticket that is otherwise live).

    Without ``ticket_id`` (PEARING_TOKEN + PEARING_LOCK + PEARING_REPO alone) the ticket
    is the one in line whose token hash matches, found in the same single read (the whole
    line, with values). A token not in line is unknown, as the lock dir, which looks only
    among its live tickets, says too.
    """

    el = Mutex(cluster, repo, lock)
    if ticket_id:
        head = op_range(el.q, prefix=True, sort="ASCEND", limit=1, keys_only=True)
        r = cluster.txn(
            [],
            [
                head,
                op_range(el.q + ticket_id),
                op_range(el.e + ticket_id),
                op_range(el.base + "last"),
                op_range(el.a + ticket_id),
            ],
            [],
        )
        (first, _), (mine, _), (ended, _), (last, _), (alias, _) = (ranged(r, i) for i in range(5))
        mine = [kv for kv in mine if ticket_id_of(kv["value"]) == ticket_id]
        target = alias[0]["value"].decode(errors="replace") if alias and not mine else ""
        if target.startswith(el.q):
            # It took over an older `latest` waiter's key: the head and that key, at one revision.
            r = cluster.txn([], [head, op_range(target)], [])
            (first, _), (mine, _) = ranged(r, 0), ranged(r, 1)
            mine = [kv for kv in mine if ticket_id_of(kv["value"]) == ticket_id]
    else:
        line, _ = cluster.range_prefix(el.q)  # oldest first: the holder leads
        first, ended, last = line[:1], [], []
        # Constant-time compare: a forger learns nothing from timing.
        mine = [kv for kv in line if (x := parse(kv["value"])) and same_secret(x.token_hash or "", digest)]
    fence_now = first[0]["create_revision"] if first else _int(last[0]["value"]) if last else None
    if not mine:
        t = parse(ended[0]["value"]) if ended else None
        if t is None and ticket_id:
            # Not in line and never ended: it lapsed, if its holder settled (a refusal either way,
            # so this one more read is off the path of a live token).
            copy = cluster.get(el.t + ticket_id)
            t = lapsed(copy["value"]) if copy is not None else None
        return Facts(t, fence_now=fence_now)
    kv = mine[0]
    t = parse(kv["value"])
    if t is None:
        return Facts(None)
    # With --slots N the first N keys hold (a second read, for a slotted ticket only).
    if first[0]["key"] == kv["key"] or (t.slots > 1 and el.count_ahead(kv["create_revision"]) < t.slots):
        t.fence = kv["create_revision"]
        if t.live:
            t.state = HELD
    elif t.live:
        t.state, t.fence = WAITING, None
    t.lease_deadline_mono = deadline_mono(t)
    here = t.holder_host == os.uname().nodename
    alive = not here or proc.alive(t.holder_pid, t.holder_start)

    def cut_off() -> bool:
        return cluster.ttl(kv["lease"]) <= margin_of(kv["value"])  # whole seconds, rounded down

    return Facts(t, fence_now=fence_now, holder_alive=alive, cut_off=cut_off)


def _int(raw: bytes) -> int | None:
    try:
        return int(raw)
    except ValueError:
        return None


def hold_guard(cluster: Cluster, repo: str, lock: str, ticket_id: str, seconds: float) -> tuple[str, int] | None:
    """Register an in-flight guarded command, only while our ticket key exists.

    A new pearing holder waits for these keys to go (``Mutex.wait_first``), so the side
    effect lands before the next holder proceeds. etcd's own lock clients know nothing
    of them. Returns (key, lease) or None.
    """
    import uuid

    el = Mutex(cluster, repo, lock)
    lease = cluster.grant(ttl_of(seconds + 2))
    key = el.g + str(uuid.uuid4())
    guard = op_put(key, ticket_id.encode(), lease)
    r = cluster.txn([cmp(el.q + ticket_id, "CREATE", "GREATER", 0)], [guard], [])
    if not r.get("succeeded"):
        # Not under its own name: it may hold the key of a `latest` waiter it took over.
        mine = el.find(ticket_id)
        if mine is not None:
            r = cluster.txn([cmp(mine["key"], "CREATE", "EQUAL", mine["create_revision"])], [guard], [])
    if not r.get("succeeded"):
        cluster.revoke(lease)
        return None
    return key, lease
