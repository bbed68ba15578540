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
import stat

from singleflight.core import fault
from singleflight.core.errors import CorruptRecord, NotPermitted, StaleFence
from singleflight.core.fs import Dir


def accept(d: Dir, name: str, resource: str, fence: int) -> int:
    """Accept ``fence`` if it is >= the highest recorded for ``resource``; StaleFence otherwise.

    ``d`` is the ledger's directory, already checked; ``name`` the ledger file in it.
    An empty or unparsable ledger is corrupt (74), never read as "nothing seen yet".
    """
    path = d.child_path(name)
    st = d.lstat(name)
    if st is not None and (st.st_uid != os.geteuid() or st.st_mode & 0o022 or not stat.S_ISREG(st.st_mode)):
        # In a sticky shared dir another user may own a file of this name: never trust it.
        raise NotPermitted(path, f"not a regular file of this user's, or writable by others (uid {st.st_uid})")
    lock_fd = d.open(name + ".lock", os.O_RDWR | os.O_CREAT, 0o600)
    try:
        fcntl.flock(lock_fd, fcntl.LOCK_EX)
        data = d.read(name)
        table: dict[str, int] = {}
        if data is not None:
            try:
                obj = json.loads(data)
                if not isinstance(obj, dict) or not all(
                    isinstance(v, int) and not isinstance(v, bool) and v >= 1 for v in obj.values()
                ):
                    raise ValueError("not an object of fences (integers >= 1)")
                table = obj
            except ValueError as exc:
                raise CorruptRecord(path, str(exc) or "empty") from None
        highest = int(table.get(resource, 0))
        if fence < highest:
            raise StaleFence(resource, fence, highest)
        if fence > highest:
            table[resource] = fence
            fault.point("mid-ledger")
            d.write_atomic(name, json.dumps(table, sort_keys=True).encode(), durable=True)
        return fence
    finally:
        os.close(lock_fd)
