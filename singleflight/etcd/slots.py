"""``--slots N`` on etcd: the semaphore recipe on the lock's line, and a slot number per holder.

The line is the mutex's (``lock.py``): keys under ``q/`` in create-revision order. With N slots
the first N keys hold (``Mutex.wait_first``: a key holds once fewer than N are ahead of it), so
promotion stays FIFO and each holder's fence is still its key's create revision: unique, and
rising in the order runs took the lock. A holder also needs a number, 0..N-1, that no other
holder has at the same time (``PEARING_SLOT``): a key ``sl/I`` whose value is the holder's queue
key, on the holder's lease, so it goes with the holder (revoked, or lapsed after a kill -9).
It is taken by compare-and-swap: a free number, or one whose holder's queue key is gone (its
lease not yet lapsed: the holder is gone all the same).
"""

from __future__ import annotations

import time

from singleflight.core.const import TYPE_CHECKING
from singleflight.core.errors import BackendUnavailable
from singleflight.core.ticket import Ticket, check_slots
from singleflight.etcd.client import cmp, op_put, op_range, ranged
from singleflight.etcd.lock import Mutex
from singleflight.etcd.records import parse

if TYPE_CHECKING:
    from typing import Any

# Rounds of compare-and-swap lost to other holders before giving up (each loser reads again).
_TRIES = 20


def check(mutex: Mutex, ticket: Ticket, line: list[dict[str, Any]] | None = None, *, before: int = 0) -> None:
    """``ticket``'s slots against the lock's (``check_slots``, the rule on every store): the line
    read off its head, or the tickets ahead of create revision ``before`` (a holder claiming its
    slot); another client's keys say nothing."""
    if line is None:
        line = _head(mutex)
    ahead = (kv for kv in line if not before or kv["create_revision"] < before)
    check_slots(ticket, (t for kv in ahead if (t := parse(kv["value"])) is not None))


# Keys read off the head of the line by a join's check: more only when none of them is a live
# ticket of ours (another client's keys, ended tickets being let go).
_HEAD = 8


def _head(mutex: Mutex) -> list[dict[str, Any]]:
    """The line's first live ticket, and the keys ahead of it. Every live ticket in line agreed with
    those ahead of it when it joined (and a later one that did not leaves, ``claim``), so the first
    one's slots are the lock's. Reading the whole line made every join cost the line's length: a
    line of 1,000 took O(N^2) to form (bench.growth)."""
    r = mutex.cluster.txn([], [op_range(mutex.q, prefix=True, sort="ASCEND", limit=_HEAD)], [])
    head = ranged(r, 0)[0]
    for i, kv in enumerate(head):
        t = parse(kv["value"])
        if t is not None and t.live:
            return head[: i + 1]
    if len(head) < _HEAD:
        return head
    line, _ = mutex.queue()
    return line


def claim(mutex: Mutex, ticket: Ticket, mine: dict[str, Any], lease: int) -> int:
    """The lowest slot number free for the holder whose queue key is ``mine``, taken on ``lease``."""
    n, key = ticket.slots, str(mine["key"])
    for _ in range(_TRIES):
        r = mutex.cluster.txn([], [op_range(mutex.sl, prefix=True), op_range(mutex.q, prefix=True)], [])
        taken, line = ranged(r, 0)[0], ranged(r, 1)[0]
        check(mutex, ticket, line, before=mine["create_revision"])
        in_line = {kv["key"] for kv in line}
        owners = {int(kv["key"][len(mutex.sl) :]): kv for kv in taken if kv["key"][len(mutex.sl) :].isdigit()}
        for i in range(n):
            kv = owners.get(i)
            if kv is not None and kv["value"].decode(errors="replace") == key:
                return i  # ours already: the member that applied our claim died before answering
            if kv is None:
                checks = [cmp(mutex.sl + str(i), "CREATE", "EQUAL", 0)]
            elif kv["value"].decode(errors="replace") not in in_line:
                gone = kv["value"].decode(errors="replace")
                checks = [cmp(mutex.sl + str(i), "MOD", "EQUAL", kv["mod_revision"]), cmp(gone, "CREATE", "EQUAL", 0)]
            else:
                continue
            done = mutex.cluster.txn(checks, [op_put(mutex.sl + str(i), key.encode(), lease)], [])
            if done.get("succeeded"):
                return i
            break  # someone else got it: read again
        else:
            time.sleep(0.05)  # every number is a live holder's: one is letting go right now
    raise BackendUnavailable(mutex.cluster.url, f"no free slot of {n} for {key}")


def guarded(mutex: Mutex) -> bool:
    """Is a guarded side effect (pearing-guard exec) in flight? A new holder waits for it to land."""
    r = mutex.cluster.txn([], [op_range(mutex.g, prefix=True, limit=1, keys_only=True)], [])
    return bool(ranged(r, 0)[0])


def holders(mutex: Mutex, line: list[dict[str, Any]]) -> int:
    """How many keys at the head of ``line`` hold: as many as the first ticket's slots (another
    client's key holds alone, as an ``etcdctl lock`` holder)."""
    if not line:
        return 0
    first = parse(line[0]["value"])
    return min(len(line), first.slots if first is not None else 1)
