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
from typing import Any

from singleflight.core import fault
from singleflight.core.const import MAX_FENCE
from singleflight.core.errors import CorruptRecord
from singleflight.core.fs import Dir, check_trusted
from singleflight.core.record import loads
from singleflight.core.request import ANY_VERSION, FENCE_PREFIX, Key


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


class FileLedger:
    """A ledger file's fence records (``core.request.fence_record``), for the rule that judges
    them (``rules.records.accept_fence``): one JSON table of resource -> highest fence.

    ``d`` is the ledger's directory, already checked; ``name`` the ledger file in it. A write
    compares and sets under a flock beside the ledger, and is fsynced before it returns.
    """

    def __init__(self, d: Dir, name: str) -> None:
        self.d, self.name = d, name

    def _resource(self, key: Key) -> str:
        if key.lock is not None or not key.name.startswith(FENCE_PREFIX):
            raise ValueError(f"not a fence record: {key!r}")
        return key.name[len(FENCE_PREFIX) :]

    def _read(self) -> dict[str, int]:
        d, name = self.d, self.name
        data = d.read(name, lambda fd: _trusted(d, name, fd))
        return {} if data is None else _table(d.child_path(name), data)

    def _lock(self) -> int:
        """The lock file beside the ledger, open and checked (a read checks it too: a ledger whose
        lock another user can take is refused before any fence is judged by it)."""
        d, lock_name = self.d, self.name + ".lock"
        fd = d.open(lock_name, os.O_RDWR | os.O_CREAT | os.O_NONBLOCK | os.O_NOCTTY, 0o600)
        try:
            _trusted(d, lock_name, fd)
        except BaseException:
            os.close(fd)
            raise
        return fd

    def read_record(self, key: Key) -> tuple[bytes | None, Any, str]:
        os.close(self._lock())
        highest = self._read().get(self._resource(key))
        return (None if highest is None else str(highest).encode()), highest, self.d.child_path(self.name)

    def write_record(self, key: Key, body: bytes | None, seen: Any) -> bool:
        resource, d, name = self._resource(key), self.d, self.name
        lock_fd = self._lock()
        try:
            fcntl.flock(lock_fd, fcntl.LOCK_EX)
            table = self._read()
            if seen is not ANY_VERSION and table.get(resource) != seen:
                return False
            if body is None:
                table.pop(resource, None)
            else:
                table[resource] = int(body)
            fault.point("mid-ledger")
            d.write_atomic(name, json.dumps(table, sort_keys=True).encode(), durable=True)
            return True
        finally:
            os.close(lock_fd)
