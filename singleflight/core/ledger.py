"""A fence ledger in a file: the highest fence a target accepted, per resource.

Used by ``pearing-guard fence --ledger PATH`` on any backend, and as the lock
dir backend's default ledger (``LOCK_DIR/ledger.json``). Callers are
serialised by a flock beside the ledger, so a lower fence can never overwrite
a higher one, whatever the interleaving.
"""

from __future__ import annotations

import fcntl
import json
import os

from singleflight.core import fault
from singleflight.core.const import MAX_FENCE
from singleflight.core.errors import CorruptRecord, StaleFence
from singleflight.core.fs import Dir, check_trusted
from singleflight.core.record import loads


def _trusted(d: Dir, name: str, fd: int) -> None:
    """A ledger (or its lock file) is ours alone: a stale fence passed by a rewritten ledger
    would be accepted. Checked on the open fd, so the file cannot be swapped between check and use."""
    check_trusted(d.child_path(name), os.fstat(fd), "a ledger")


def _table(path: str, data: bytes) -> dict[str, int]:
    """The ledger's fences; an empty or unparsable ledger is corrupt (74), never "nothing seen"."""
    if not data.strip():
        raise CorruptRecord(path, "empty")
    try:
        obj = loads(data)
    except ValueError as exc:
        raise CorruptRecord(path, f"not JSON: {exc}") from None
    if not isinstance(obj, dict) or not all(
        isinstance(v, int) and not isinstance(v, bool) and 1 <= v <= MAX_FENCE for v in obj.values()
    ):
        raise CorruptRecord(path, f"not an object of fences (integers from 1 to {MAX_FENCE})")
    return obj


def accept(d: Dir, name: str, resource: str, fence: int) -> int:
    """Accept ``fence`` if it is >= the highest recorded for ``resource``; StaleFence otherwise.

    ``d`` is the ledger's directory, already checked; ``name`` the ledger file in it.
    """
    path = d.child_path(name)
    lock_name = name + ".lock"
    lock_fd = d.open(lock_name, os.O_RDWR | os.O_CREAT | os.O_NONBLOCK | os.O_NOCTTY, 0o600)
    try:
        _trusted(d, lock_name, lock_fd)
        fcntl.flock(lock_fd, fcntl.LOCK_EX)
        data = d.read(name, lambda fd: _trusted(d, name, fd))
        table = {} if data is None else _table(path, data)
        highest = table.get(resource, 0)
        if fence < highest:
            raise StaleFence(resource, fence, highest)
        if fence > highest:
            table[resource] = fence
            fault.point("mid-ledger")
            d.write_atomic(name, json.dumps(table, sort_keys=True).encode(), durable=True)
        return fence
    finally:
        os.close(lock_fd)
