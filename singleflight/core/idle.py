"""What a store knows of one lock when ``pearing-cli prune`` asks whether it may go
(``Backend.prune``); whether it may is the rules' (``rules/prune.py``)."""

from __future__ import annotations


class Idle:
    """One lock as its store found it, with whatever keeps it out of the way.

    ``in_use``: why the lock is in use now (a holder, a waiter, a guarded command), or None.
    ``last_used``: when it was last touched, epoch seconds (the lock dir: its newest file; etcd,
    which keeps no times: when prune first found it as it is now). ``success``: the last success
    record as stored; ``requests``: every request record as stored.
    """

    __slots__ = ("in_use", "last_used", "requests", "success")

    def __init__(self, *, in_use: str | None, last_used: float, success: bytes | None, requests: list[bytes]) -> None:
        self.in_use, self.last_used, self.success, self.requests = in_use, last_used, success, requests
