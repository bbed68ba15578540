"""A hostile or wrong peer on 127.0.0.1, for a test to put in an ``etcd://`` member list.

API::

    peer = HostilePeer()
    port = peer.start("drip")   # any of KINDS; call again for more peers
    ...                         # etcd://127.0.0.1:{port},GOOD ...
    peer.stop()                 # closes every listener and connection, joins every thread

Kinds:

- ``drip``: accepts, reads nothing, and sends ``HTTP/1.1 200 OK\\r\\n`` and then header
  lines one byte every DRIP_EVERY seconds, never ending the head: each ``recv`` gets a byte
  well within any per-read timeout, so only a deadline on the whole exchange ends it.
- ``hello``, ``{}``, ``[]``, ``{"header": {}}``: answers every request with HTTP 200 and that
  body (kept alive, Content-Length): a wrong port, something that is not etcd.
- ``proxy-502``: answers HTTP 502 with a proxy's HTML page, several lines long.
- ``not-capable``, ``behind``: answer HTTP 400 with the gateway's error body of an etcd member
  that cannot serve yet (gRPC 9, ``etcdserver: not capable``) or is behind the revision asked
  (gRPC 11, a future revision): codes that otherwise say the request itself is refused.
- ``lease-not-found``: HTTP 404, gRPC 5 ``etcdserver: requested lease not found``: a genuine
  refusal, the same on every member.
- ``electing``: HTTP 503, gRPC 14 ``etcdserver: leader changed``: a member during an election.

Threads, one per listener and one per connection, all daemons: nothing here outlives
``stop()`` (or, at worst, the test session), and no connection lasts longer than LIFETIME.
"""

from __future__ import annotations

import contextlib
import socket
import threading
import time

DRIP_EVERY = 1.0
LIFETIME = 120.0  # a ceiling on any one connection, whatever the client does
_PAGE = b"<html>\r\n<head><title>502 Bad Gateway</title></head>\r\n<body>nginx</body>\r\n</html>\r\n"
ANSWERS = {body: (200, body.encode()) for body in ("hello", "{}", "[]", '{"header": {}}')}
ANSWERS["proxy-502"] = (502, _PAGE)


def _grpc_error(code: int, message: str) -> bytes:
    """The body of etcd's grpc-gateway for a unary call that failed with ``code``."""
    return b'{"error": "%s", "code": %d, "message": "%s"}' % (message.encode(), code, message.encode())


ANSWERS["not-capable"] = (400, _grpc_error(9, "etcdserver: not capable"))
ANSWERS["behind"] = (400, _grpc_error(11, "etcdserver: mvcc: required revision is a future revision"))
# Hostile kinds, each a member that failed. Not the genuine refusal: it answers for the cluster.
KINDS = ("drip", *ANSWERS)
ANSWERS["lease-not-found"] = (404, _grpc_error(5, "etcdserver: requested lease not found"))
# A member in an election (HTTP 503, gRPC 14): what every member answers for a moment when the
# leader changed. Not hostile: the client asks again for a while.
ANSWERS["electing"] = (503, _grpc_error(14, "etcdserver: leader changed"))


class HostilePeer:
    def __init__(self) -> None:
        self._stop = threading.Event()
        self._listeners: list[socket.socket] = []
        self._conns: list[socket.socket] = []
        self._threads: list[threading.Thread] = []
        self._lock = threading.Lock()
        self.connections = 0  # accepted so far, over every listener
        self.requests = 0  # answered so far, over every connection

    def start(self, kind: str) -> int:
        """A new listener of ``kind`` (see KINDS, or ``lease-not-found``); its port."""
        if kind not in KINDS and kind not in ANSWERS:
            raise ValueError(f"unknown hostile peer kind {kind!r}: one of {KINDS}, lease-not-found or electing")
        sock = socket.create_server(("127.0.0.1", 0))
        self._listeners.append(sock)
        self._spawn(self._accept, sock, kind)
        return int(sock.getsockname()[1])

    def stop(self) -> None:
        self._stop.set()
        with self._lock:
            socks = self._listeners + self._conns
            for s in socks:
                with contextlib.suppress(OSError):
                    s.shutdown(socket.SHUT_RDWR)
            threads = list(self._threads)
        for t in threads:
            t.join(timeout=5)
        # Closed once no thread can be about to use one: a freed fd number is the next socket's
        # (tests/listener.py).
        for s in socks:
            s.close()

    def _spawn(self, target: object, *args: object) -> None:
        t = threading.Thread(target=target, args=args, daemon=True)  # type: ignore[arg-type]
        with self._lock:
            self._threads.append(t)
        t.start()

    def _accept(self, sock: socket.socket, kind: str) -> None:
        while not self._stop.is_set():
            try:
                conn, _ = sock.accept()
            except OSError:
                return
            with self._lock:
                if self._stop.is_set():
                    conn.close()
                    return
                self._conns.append(conn)
                self.connections += 1
            self._spawn(self._drip if kind == "drip" else self._answer, conn, kind)

    def _drip(self, conn: socket.socket, _kind: str) -> None:
        data = b"HTTP/1.1 200 OK\r\n" + b"X-Drip: x\r\n" * 1000
        until = time.monotonic() + LIFETIME
        with conn:
            for i in range(len(data)):
                if time.monotonic() > until:
                    return
                try:
                    conn.sendall(data[i : i + 1])
                except OSError:
                    return  # the client gave up: what it should do
                if self._stop.wait(DRIP_EVERY):
                    return

    def _answer(self, conn: socket.socket, kind: str) -> None:
        status, body = ANSWERS[kind]
        answer = b"HTTP/1.1 %d Whatever\r\nContent-Type: text/html\r\nContent-Length: %d\r\n\r\n%s" % (
            status,
            len(body),
            body,
        )
        conn.settimeout(LIFETIME)
        buf = b""
        with conn:
            while not self._stop.is_set():
                try:
                    while b"\r\n\r\n" not in buf:
                        chunk = conn.recv(65536)
                        if not chunk:
                            return
                        buf += chunk
                    head, _, buf = buf.partition(b"\r\n\r\n")
                    length = 0
                    for line in head.split(b"\r\n")[1:]:
                        name, _, value = line.partition(b":")
                        if name.strip().lower() == b"content-length":
                            length = int(value)
                    while len(buf) < length:
                        chunk = conn.recv(65536)
                        if not chunk:
                            return
                        buf += chunk
                    buf = buf[length:]
                    with self._lock:
                        self.requests += 1
                    conn.sendall(answer)
                except OSError:
                    return
