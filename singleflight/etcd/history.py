"""The request records a ticket of pearing-cli is created with (--request-uuid / --request-key):
one ticket per request, even when two arrive at once. The rest of a lock's records are read and
written as ``EtcdBackend.read_record`` / ``write_record``."""

from __future__ import annotations

from singleflight.core.const import TYPE_CHECKING
from singleflight.core.errors import CorruptRecord
from singleflight.core.request import RequestRecord
from singleflight.etcd.client import cmp, op_put, op_range, ranged
from singleflight.etcd.lock import Mutex

if TYPE_CHECKING:
    from typing import Any


def read_request_kv(mutex: Mutex, uuid: str) -> tuple[RequestRecord | None, dict[str, Any] | None]:
    """The request record and its kv (for a compare-and-swap on its mod revision)."""
    kv = mutex.cluster.get(mutex.r + uuid)
    if kv is None:
        return None, None
    try:
        return RequestRecord.from_json(kv["value"]), kv
    except (ValueError, TypeError) as exc:
        raise CorruptRecord(f"etcd:{mutex.r}{uuid}", f"not a request record: {exc}") from None


def claim_request(mutex: Mutex, uuid: str, record: RequestRecord, lease: int, seen: dict[str, Any] | None) -> bool:
    """Write ``record`` only if the request key is still as ``seen`` (compare-and-swap).

    The claim rides on the claimant's ticket lease: if the claimant dies, its claim
    goes with it, and a replay may run again; while it lives, replays see it.

    True also when the key holds our very claim already: a member that applied it and died
    before answering makes the client send it to the next one (``Cluster.post``), where the
    compare fails on our own write. Ours: our ticket's active record, on the lease we gave it.
    """
    key = mutex.r + uuid
    check = cmp(key, "MOD", "EQUAL", seen["mod_revision"]) if seen else cmp(key, "CREATE", "EQUAL", 0)
    r = mutex.cluster.txn([check], [op_put(key, record.to_json(), lease)], [op_range(key)])
    if r.get("succeeded"):
        return True
    kvs = ranged(r, 0)[0]
    try:
        found = RequestRecord.from_json(kvs[0]["value"]) if kvs else None
    except (ValueError, TypeError):
        return False  # not ours, whatever it is: the caller reads it as the record it is
    return found is not None and found.active and found.ticket_id == record.ticket_id and kvs[0]["lease"] == lease
