"""When a lock's keepalive is due: the wrapper keeps an etcd or PostgreSQL lease alive beside
its holder (``Grip.keep``), a third of the shortest lease after its last try, and says how long
until the next; one rule for every store that has a lease to keep."""

from __future__ import annotations

import time

# The longest wait between two keepalives of the wrapper's, whatever the lease: a ten-year
# lease's third would overflow the wrapper's poll() (int ms).
_AT_MOST_EVERY = 3600.0


class Cadence:
    """A keepalive every third of the shortest of ``leases`` (seconds), counted from ``at``
    (monotonic), the last try."""

    __slots__ = ("at", "every")

    def __init__(self, *leases: float, at: float) -> None:
        self.every = min(_AT_MOST_EVERY, *(lease / 3 for lease in leases))
        self.at = at

    def due(self) -> float:
        """0 when due now (counted as tried from now on), else the seconds until it is."""
        now = time.monotonic()
        if (left := self.at + self.every - now) > 0:
            return left
        self.at = now
        return 0.0


def guarded_every(lease_seconds: float) -> float:
    """How often a holder waiting for its guarded commands to end keeps its lease meanwhile
    (``Lease.end``): a third of it, at least every second, at most 20 times a second."""
    return max(0.05, min(1.0, lease_seconds / 3))
