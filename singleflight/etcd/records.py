"""A ticket as the value of its etcd key: written by pearing, read by every pearing client.

A key under the queue prefix that pearing did not write (``etcdctl lock``'s keys have an
empty value) parses as None, never as an error: another client's key cannot crash us.
"""

from __future__ import annotations

import os
import time

from singleflight.core import jsontext, proc
from singleflight.core.const import EXPIRED, HELD, TYPE_CHECKING, WAITING
from singleflight.core.errors import CorruptRecord
from singleflight.core.reasons import EndReason
from singleflight.core.record import rfc3339
from singleflight.core.ticket import Ticket
from singleflight.etcd.client import cmp, op_put, op_txn

if TYPE_CHECKING:
    from typing import Any


def value(t: Ticket, lease: int, *, margin: float | None = None) -> bytes:
    obj = {name: getattr(t, name) for name in ("ticket_id", "request_uuid", "lock_name", "repo", "identity")}
    obj.update(
        state=t.state,
        lease_seconds=t.lease_seconds,
        lease=str(lease),
        token_hash=t.token_hash,
        holder_pid=t.holder_pid,
        holder_start=t.holder_start,
        holder_host=t.holder_host or os.uname().nodename,
        promoted=t.promoted,
        created_at=t.created_at,
        acquired_at=t.acquired_at,
        ended_at=t.ended_at,
        end_reason=t.end_reason,
        fence=t.fence,
        queue_mode=t.queue_mode,
        cancel_in_progress=t.cancel_in_progress,
        kill_grace=t.kill_grace,
        max_waiting=t.max_waiting,  # checked by its agent as it joins the line (``EtcdPlace``)
        slots=t.slots,
        slot=t.slot,
        # Set by a newer opted-in run: the holder stops (``EtcdLease.check``).
        superseded_by=t.superseded_by,
        # The lease deadline, on the wall clock for other hosts and on the monotonic
        # clock of the boot that set it (immune to clock jumps on the same host).
        lease_expires_at=t.lease_expires_at,
        lease_deadline_mono=t.lease_deadline_mono,
        boot_id=t.boot_id,
        # How early a holder cut off from the cluster gives up: a guard judges the same way.
        margin=margin,
        # pearing-run's wrapper: it keeps the lease while COMMAND lives, even if the holder died.
        owner_pid=t.owner_pid,
        owner_start=t.owner_start,
    )
    return jsontext.dumps(obj).encode()


def parse(raw: bytes) -> Ticket | None:
    """The ticket in a key's value; None for a key pearing did not write (``etcdctl lock``'s
    keys have an empty value): never an error, so another client's key cannot crash us."""
    try:
        return Ticket.from_dict(jsontext.loads(raw))
    except (ValueError, TypeError, UnicodeDecodeError):
        return None


def ticket_id_of(raw: bytes) -> str | None:
    """The ticket id a queue key carries (None: another client's key)."""
    t = parse(raw)
    return None if t is None else t.ticket_id


def parse_ticket(raw: bytes) -> Ticket:
    t = parse(raw)
    if t is None:
        raise CorruptRecord("etcd", "not a ticket")
    return t


def margin_of(raw: bytes) -> float:
    try:
        m = jsontext.loads(raw).get("margin")
    except (ValueError, AttributeError):
        return 0.0
    return float(m) if isinstance(m, (int, float)) and not isinstance(m, bool) else 0.0


def stamp_lease(t: Ticket, seconds: float) -> None:
    """The ticket's lease runs ``seconds`` from now, on this host's clocks."""
    t.set_lease(seconds)
    t.boot_id = proc.boot_id()


def deadline_mono(t: Ticket) -> float | None:
    """The ticket's recorded lease deadline on this host's monotonic clock (``Ticket.deadline_here``)."""
    return t.deadline_here()


def foreign(kv: dict[str, Any], position: int, repo: str, lock: str, lease_left: float | None) -> dict[str, Any]:
    """A key another client wrote under our queue prefix (``etcdctl lock``, Go's NewMutex): shown
    as a holder or waiter of its own, named by its etcd lease."""
    holder = position == 0
    return {
        "ticket_id": None,
        "request_uuid": None,
        "lock_name": lock,
        "repo": repo,
        "identity": f"etcd-lease:{kv['lease']:x}",
        "state": HELD if holder else WAITING,
        "fence": kv["create_revision"] if holder else None,
        "lease_seconds": None,
        "lease_expires_at": rfc3339(time.time() + lease_left) if lease_left is not None else None,
        "holder_pid": None,
        "holder_host": None,
        "promoted": None,
        "created_at": None,
        "acquired_at": None,
        "ended_at": None,
        "end_reason": None,
        "queue_position": None if holder else position,
        "activity": None,
        "etcd_key": kv["key"],
        "foreign": True,
    }


def lapsed(copy: bytes) -> Ticket | None:
    """A ticket from its copy (``t/``), there being no key and no end record: it lapsed with
    nobody left to end it (its every process died): expired when its lease ran out, as the last
    write of its key recorded it (``refresh_copy``)."""
    t = parse(copy)
    if t is not None:
        t.end(EXPIRED, EndReason.LEASE_EXPIRED.text(), at=t.lease_expires_at)
    return t


def refresh_copy(copy: str, body: bytes) -> dict[str, Any]:
    """The op that writes ``body`` into the ticket's copy (key ``copy``) too, if it has one (a
    settled holder's), on the copy's own lease: in the txn of every write of the key that moves
    its deadline, so a lapsed ticket says when its lease ran out."""
    return op_txn([cmp(copy, "CREATE", "GREATER", 0)], [op_put(copy, body, keep_lease=True)], [])
