"""HTTP/1.1 to etcd's grpc-gateway on a plain socket: unary JSON requests and the watch stream.

Only what the gateway speaks: POST with a JSON body; answers with a Content-Length or
chunked, kept alive unless the member says otherwise. The standard library's
http.client would do, but it imports the ``email`` package (27 ms and 2.4 MB in every
etcd process: pearing-run, each pearing-cli heartbeat, each pearing-guard verify), and a
waiter is forked at every hand-over: the smaller it is, the sooner its holder starts.
"""

from __future__ import annotations

import socket
import time  # loaded at interpreter start-up anyway: no import cost

from singleflight.core import jsontext

# An answer's head larger than this is not the gateway's.
_MAX_HEAD = 16384
_READ = 65536


class WireError(OSError):
    """Not an HTTP answer we understand, or the connection ended inside one: the member failed."""


class Answer:
    """An HTTP answer, parsed as its bytes arrive (``feed``): status, then the body."""

    def __init__(self) -> None:
        self.status = 0
        self.length: int | None = None  # Content-Length, when not chunked
        self.chunked = False
        self.close = False  # the member closes the connection after this answer
        self.done = False
        self._raw = bytearray()
        self._head = False
        self.body = bytearray()

    def feed(self, data: bytes) -> None:
        self._raw += data
        if not self._head:
            end = self._raw.find(b"\r\n\r\n")
            if end < 0:
                if len(self._raw) > _MAX_HEAD:
                    raise WireError("no HTTP answer")
                return
            self._parse_head(bytes(self._raw[:end]).decode("latin-1"))
            del self._raw[: end + 4]
            self._head = True
        if self.chunked:
            self._dechunk()
        elif self.length is not None:
            take = min(len(self._raw), self.length - len(self.body))
            self.body += self._raw[:take]
            del self._raw[:take]
            self.done = len(self.body) >= self.length
        else:  # until the member closes the connection
            self.body += self._raw
            self._raw.clear()

    def _parse_head(self, head: str) -> None:
        lines = head.split("\r\n")
        parts = lines[0].split(" ", 2)
        if len(parts) < 2 or not parts[0].startswith("HTTP/1.") or not parts[1].isdigit():
            raise WireError(f"not an HTTP answer: {lines[0][:80]!r}")
        self.status = int(parts[1])
        for line in lines[1:]:
            name, _, val = line.partition(":")
            name, val = name.strip().lower(), val.strip().lower()
            if name == "content-length" and val.isdigit():
                self.length = int(val)
            elif name == "transfer-encoding" and "chunked" in val:
                self.chunked = True
            elif name == "connection" and val == "close":
                self.close = True
        if self.chunked:
            self.length = None
        elif self.length is None:
            self.close = True

    def _dechunk(self) -> None:
        while not self.done:
            nl = self._raw.find(b"\r\n")
            if nl < 0:
                return
            try:
                size = int(bytes(self._raw[:nl]).split(b";")[0], 16)
            except ValueError:
                raise WireError("bad chunk") from None
            if size == 0:
                self.done = True  # (trailers, if any, are not used by the gateway)
                return
            if len(self._raw) < nl + 2 + size + 2:
                return
            self.body += self._raw[nl + 2 : nl + 2 + size]
            del self._raw[: nl + 2 + size + 2]

    def lines(self) -> list[bytes]:
        """Complete lines of the body so far (a stream: one JSON message per line), taken out."""
        out = []
        while (nl := self.body.find(b"\n")) >= 0:
            line = bytes(self.body[:nl]).strip()
            del self.body[: nl + 1]
            if line:
                out.append(line)
        return out


def request_bytes(host: str, port: int, path: str, payload: bytes) -> bytes:
    head = (
        f"POST {path} HTTP/1.1\r\nHost: {host}:{port}\r\nContent-Type: application/json\r\n"
        f"Content-Length: {len(payload)}\r\n\r\n"
    )
    return head.encode() + payload


def connect(host: str, port: int, timeout: float) -> socket.socket:
    # (getaddrinfo, under it, takes bytes; typeshed names str only.)
    sock = socket.create_connection((_idna(host), port), timeout=timeout)  # type: ignore[arg-type]
    # One send per request, and the answer is awaited: no reason to let Nagle hold either.
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    return sock


def _idna(host: str) -> str | bytes:
    """``host`` as the idna codec hands it to getaddrinfo, where that is its own ASCII bytes (every
    label but the last 1 to 63 characters, the last under 64): the codec, given the str, loads
    unicodedata and stringprep (about 1.5 ms of every etcd process's start) to change nothing.
    Any other name goes as it is, to the codec, and fails or resolves as it did."""
    labels = host.split(".")
    if host.isascii() and all(0 < len(x) < 64 for x in labels[:-1]) and len(labels[-1]) < 64:
        return host.encode("ascii")
    return host


class Conn:
    """One kept-alive connection to a member, for unary requests. Not shared across fork."""

    def __init__(self, host: str, port: int, timeout: float) -> None:
        self.host, self.port, self.timeout = host, port, timeout
        self.sock: socket.socket | None = None

    def close(self) -> None:
        if self.sock is not None:
            self.sock.close()
            self.sock = None

    def request(self, path: str, payload: bytes) -> tuple[int, bytes]:
        """(HTTP status, body). OSError (WireError included) when the member did not answer
        within ``timeout``: the whole exchange, connect to the answer's last byte.

        A timeout on each read alone is no bound: a peer that sends one byte a second never
        trips it, and the head may take 16 kB of them (hours). One deadline for the request
        keeps ``timeout`` what the caller budgets a member at (the holder's renewal margin).

        A kept-alive connection that the member closed while it was idle (a restart closes
        them all) is seen closed before the request goes out, and replaced: nothing was sent.
        One that fails before any answer all the same (the member's close crossed our request)
        is tried once more on a fresh connection, within the same deadline. That member may
        have read and applied the request before the connection broke: this resend, like
        ``Cluster.post``'s to the next member, is safe only because every write is."""
        data = request_bytes(self.host, self.port, path, payload)
        deadline = time.monotonic() + self.timeout
        for attempt in range(2):
            if self.sock is not None and _closed(self.sock):
                self.close()
            reused = self.sock is not None
            answer = Answer()
            try:
                if self.sock is None:
                    self.sock = connect(self.host, self.port, _left(deadline))
                sock = self.sock
                sock.settimeout(_left(deadline))
                sock.sendall(data)
                while not answer.done:
                    sock.settimeout(_left(deadline))
                    chunk = sock.recv(_READ)
                    if not chunk:
                        if answer.status and answer.length is None and not answer.chunked:
                            break  # an answer that ends with the connection
                        raise WireError("connection closed by the member")
                    answer.feed(chunk)
            except OSError:
                self.close()
                if reused and attempt == 0 and not answer.status:
                    continue
                raise
            if answer.close:
                self.close()
            return answer.status, bytes(answer.body)
        raise WireError("no answer")  # not reached: the second attempt returns or raises


def _closed(sock: socket.socket) -> bool:
    """Has the member closed this idle connection (or reset it, or sent what nobody asked for)?
    A peek that does not wait: an idle connection has nothing to read until the member ends it."""
    # Non-blocking: with a timeout set, recv first waits that long for a byte (the request
    # sets its own timeout again before it sends).
    sock.setblocking(False)
    try:
        sock.recv(1, socket.MSG_PEEK)
    except (BlockingIOError, InterruptedError):
        return False
    except OSError:
        return True
    return True  # its end (b""), or bytes that answer nothing we asked: not a connection to ask on


def _left(deadline: float) -> float:
    """Seconds to the request's deadline; TimeoutError once it has passed."""
    left = deadline - time.monotonic()
    if left <= 0:
        raise TimeoutError("no answer within the request timeout")
    return left


class Stream:
    """One watch request on one member: its answer read without blocking, message by message."""

    def __init__(self, host: str, port: int, path: str, payload: bytes, connect_timeout: float) -> None:
        # The stream may then be quiet for as long as the wait lasts, but etcd writes its head
        # in one piece, with the watch's first message: a head that trickles in past the
        # timeout is not etcd's, and would hold the watch (and miss its wake-up) forever.
        self._head_due = time.monotonic() + connect_timeout
        self.sock = connect(host, port, connect_timeout)
        try:
            self.sock.settimeout(_left(self._head_due))
            self.sock.sendall(request_bytes(host, port, path, payload))
            self.sock.setblocking(False)
        except OSError:
            self.sock.close()
            raise
        self._answer = Answer()
        self._ended = False

    def fileno(self) -> int:
        return self.sock.fileno()

    def close(self) -> None:
        self.sock.close()

    def read(self) -> list[bytes]:
        """The lines that arrived (call when the socket is readable); WireError at the stream's end
        (after the lines that came with it)."""
        if self._ended:
            raise WireError("stream ended")
        try:
            data = self.sock.recv(_READ)
        except (BlockingIOError, InterruptedError):
            return []
        if not data:
            raise WireError("closed by the member")
        self._answer.feed(data)
        if not self._answer.status and time.monotonic() > self._head_due:
            raise WireError("no answer head within the request timeout")
        if self._answer.status and self._answer.status != 200:
            raise WireError(f"watch refused: HTTP {self._answer.status}")
        if self._answer.status and not self._answer.chunked:
            raise WireError("watch answer is not a stream")
        self._ended = self._answer.done
        return self._answer.lines()


# An election's answers: over in moments (one election timeout or two). When every member gives
# one, ``Cluster.post`` asks again for one more request timeout before the cluster counts as out
# of reach: a waiter or a holder must not give up on a leader change (every write of ours is safe
# to send twice).
_ELECTION = frozenset(
    {
        "etcdserver: leader changed",
        "etcdserver: no leader",
        "etcdserver: request timed out, possibly due to previous leader failure",
    }
)
ELECTION_PAUSE = 0.05


def election_answer(detail: str) -> bool:
    """Is a member's error answer one an election gives?"""
    try:
        body = jsontext.loads(detail)
        return isinstance(body, dict) and str(body.get("message") or body.get("error") or "") in _ELECTION
    except (ValueError, RecursionError):
        return False
