"""A watch that lasts: the gateway's event stream read from a plain socket (``wire.py``), with failover.

The grpc-gateway answers ``POST /v3/watch`` with a chunked HTTP response that never
ends, one JSON message per line. Read through ``requests``, a pause longer than the
read timeout surfaced as a ConnectionError, which looked like a dead member: a waiter
gave up as "unreachable" after a third of its lease while the cluster was healthy.
Here the socket is only read when ``select`` says so, so a quiet stream is just a
quiet stream, however long the wait; a stream that breaks (the member died or was
restarted) is re-opened on the next member from the revision it started at, so no
event is lost; and only a full round of members that all refuse is "unreachable".

No threads: the waiter forks its holder right after the wait, and a process that
forks must not have other threads.
"""

from __future__ import annotations

import base64
import contextlib
import select
import time

from singleflight.core import jsontext
from singleflight.core.const import TYPE_CHECKING
from singleflight.core.errors import BackendUnavailable
from singleflight.etcd.wire import Stream

if TYPE_CHECKING:
    from typing import Any, Protocol
else:
    Protocol = object  # the checker's Protocols are plain classes at run time


class Members(Protocol):
    """What a watch needs of the cluster client (``client.Cluster``)."""

    url: str
    endpoints: list[tuple[str, int]]
    api_path: str
    timeout: float
    current: int  # the member that answered last


class StreamBroken(Exception):
    """The stream ended or failed: re-open it (on another member)."""


def _messages(stream: Stream) -> list[dict[str, Any]]:
    """The watch results that arrived on ``stream``; StreamBroken when it ended or failed."""
    try:
        lines = stream.read()
    except OSError as exc:
        raise StreamBroken(str(exc)) from None
    out = []
    for line in lines:
        try:
            msg = jsontext.loads(line)
        except ValueError:
            raise StreamBroken(f"not a watch message: {line[:80]!r}") from None
        if "error" in msg or not isinstance(msg.get("result"), dict):
            raise StreamBroken(f"watch failed: {str(msg.get('error'))[:120]}")
        out.append(msg["result"])
    return out


class KeyWatch:
    """Changes of one key after a revision, on whichever member answers.

    ``wait(until)`` blocks until the key changes (True) or ``until`` (monotonic)
    passes (False); ``poll()`` reads what has arrived, for a caller that selects on
    ``fileno()`` itself. ``follow(i)`` moves the stream to member ``i`` (the one the
    unary requests found alive), resuming from the last revision seen.
    """

    # What the member leaves out of the stream (``NOPUT``: deletions only).
    filters: tuple[str, ...] = ()

    def __init__(self, cluster: Members, key: str, after_revision: int) -> None:
        self.cluster, self.key = cluster, key
        self._key64 = base64.b64encode(key.encode()).decode()
        # A re-opened stream starts here again: events seen twice are harmless (they only
        # wake the caller to look again), and one missed would be a lost wake-up.
        self.revision = after_revision
        self.stream: Stream | None = None
        self.member = -1
        self.fired = False
        self._broken_in_a_row = 0

    def close(self) -> None:
        if self.stream is not None:
            self.stream.close()
            self.stream = None

    def start(self) -> None:
        """Open the stream (on the member that answered last) unless it is open."""
        if self.stream is None:
            self._open(self.cluster.current)

    def fileno(self) -> int:
        assert self.stream is not None, "start() first"
        return self.stream.fileno()

    def _open(self, first: int) -> None:
        """Open the stream on ``first`` or the next member that answers."""
        self.close()
        cluster = self.cluster
        n = len(cluster.endpoints)
        errors = []
        request: dict[str, Any] = {"key": self._key64, "start_revision": str(self.revision + 1)}
        if self.filters:
            request["filters"] = list(self.filters)
        body = {"create_request": request}
        for i in range(n):
            k = (first + i) % n
            host, port = cluster.endpoints[k]
            try:
                self.stream = Stream(
                    host, port, cluster.api_path + "watch", jsontext.dumps(body).encode(), cluster.timeout
                )
            except OSError as exc:
                errors.append(f"{host}:{port}: {exc.strerror or exc}")
                continue
            self.member = k
            return
        raise BackendUnavailable(cluster.url, "no member answered the watch (" + "; ".join(errors) + ")")

    def follow(self, member: int) -> None:
        if self.stream is not None and member != self.member:
            self._open(member)

    def _counts(self, ev: dict[str, Any]) -> bool:
        return True

    def poll(self, until: float = 0.0) -> bool:
        """Read what arrived (the stream is readable): True once the key changed, or its history
        was compacted past our revision (then the caller re-reads the key; the stream is closed,
        and ``start`` opens a new one). A broken stream is re-opened on the next member."""
        assert self.stream is not None
        try:
            messages = _messages(self.stream)
        except StreamBroken:
            # The member died, restarted or lost its leader: resume elsewhere. A member
            # that accepts and hangs up at once is skipped after a full round.
            self._broken_in_a_row += 1
            if self._broken_in_a_row > len(self.cluster.endpoints):
                with contextlib.suppress(OSError):
                    time.sleep(min(0.2, max(0.0, until - time.monotonic())))
                self._broken_in_a_row = 0
            self._open(self.member + 1)
            return False
        news = False
        for msg in messages:
            self._broken_in_a_row = 0
            if msg.get("canceled") or msg.get("compact_revision", "0") != "0":
                self.close()
                news = True
                break
            for ev in msg.get("events", []):
                kv = ev.get("kv", {})
                if kv.get("key") == self._key64 and self._counts(ev):
                    self.revision = max(self.revision, int(kv.get("mod_revision", 0) or 0))
                    news = True
        self.fired = self.fired or news
        return news

    def wait(self, until: float) -> bool:
        return wait_any([self], until)


class DeleteWatch(KeyWatch):
    """Deletions of one key after a revision: ``wait`` is True once it is gone (or its history
    was compacted past the revision: the caller re-reads it)."""

    filters = ("NOPUT",)

    def _counts(self, ev: dict[str, Any]) -> bool:
        return ev.get("type") == "DELETE"

    @property
    def deleted(self) -> bool:
        return self.fired


def wait_any(watches: list[KeyWatch], until: float) -> bool:
    """Block until one of ``watches`` fires (True) or ``until`` (monotonic) passes (False)."""
    if any(w.fired for w in watches):
        return True
    for w in watches:
        w.start()
    while True:
        left = until - time.monotonic()
        if left <= 0:
            return False
        try:
            ready, _, _ = select.select(watches, [], [], left)
        except InterruptedError:
            continue
        if not ready:
            return False
        for w in ready:
            if w.poll(until):
                return True
