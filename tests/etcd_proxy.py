"""A loopback stand-in for one etcd member that passes unary requests on to it and dies the
moment it has applied a chosen one, before its answer goes back: the client cannot know
whether that request took effect (a member killed between its apply and its answer).

Dying is closing every connection and the listening socket: the request's sender sees
its connection cut, and any new connection is refused, as with a killed member.
"""

from __future__ import annotations

import base64
import json
import socket
import threading
from collections.abc import Callable
from typing import Any

from listener import stop_listener

from singleflight.etcd.wire import Answer

# (path, request body, body of the member's answer 200) -> die instead of answering?
Verdict = Callable[[str, bytes, bytes], bool]


def puts_under(prefix: str) -> Verdict:
    """A txn that succeeded and put a key starting with ``prefix`` (in either branch of a txn
    nested in it: a nested txn's puts are one of its branches)."""

    def hit(path: str, body: bytes, answer: bytes) -> bool:
        if not path.endswith("/kv/txn") or not json.loads(answer).get("succeeded"):
            return False
        return any(key.startswith(prefix) for key in _put_keys(json.loads(body).get("success", [])))

    return hit


def _put_keys(ops: list[dict[str, Any]]) -> list[str]:
    keys = []
    for op in ops:
        if "request_put" in op:
            keys.append(base64.b64decode(op["request_put"]["key"]).decode())
        elif "request_txn" in op:
            nested = op["request_txn"]
            keys += _put_keys(nested.get("success", []) + nested.get("failure", []))
    return keys


class DyingMember:
    def __init__(self, upstream: tuple[str, int], die_after: Verdict) -> None:
        self.upstream, self.die_after = upstream, die_after
        self.sock = socket.create_server(("127.0.0.1", 0))
        self.endpoint = f"127.0.0.1:{self.sock.getsockname()[1]}"
        self.died = threading.Event()
        self._conns: list[socket.socket] = []
        self._lock = threading.Lock()
        self._acceptor = threading.Thread(target=self._accept, daemon=True)
        self._acceptor.start()

    def die(self) -> None:
        with self._lock:
            self.died.set()
            conns = list(self._conns)
        stop_listener(self.sock, self._acceptor)  # (one accepted meanwhile is closed by _accept)
        for c in conns:
            c.close()

    def _accept(self) -> None:
        while True:
            try:
                conn, _ = self.sock.accept()
            except OSError:
                return
            with self._lock:
                if self.died.is_set():
                    conn.close()
                    return
                self._conns.append(conn)
            threading.Thread(target=self._serve, args=(conn,), daemon=True).start()

    def _serve(self, conn: socket.socket) -> None:
        up = socket.create_connection(self.upstream)
        try:
            while (request := _read_request(conn)) is not None:
                path, raw, body = request
                up.sendall(raw)
                answer, answer_raw = _read_answer(up)
                if answer.status == 200 and self.die_after(path, body, bytes(answer.body)):
                    self.die()  # applied by the member, never answered
                    return
                conn.sendall(answer_raw)
        except OSError:
            return
        finally:
            up.close()


def dying_first(members: list[str], die_after: Verdict) -> tuple[DyingMember, str]:
    """An etcd URL of the ``members`` (HOST:PORT) whose first is a stand-in for it that dies once
    it has applied a request ``die_after`` names: the client, not told, asks the next member the same."""
    host, _, port = members[0].rpartition(":")
    dying = DyingMember((host, int(port)), die_after)
    return dying, "etcd://" + ",".join([dying.endpoint, *members[1:]])


def _read_request(conn: socket.socket) -> tuple[str, bytes, bytes] | None:
    """(path, the request as sent, its body); None once the client closed the connection."""
    data = b""
    while b"\r\n\r\n" not in data:
        chunk = conn.recv(65536)
        if not chunk:
            return None
        data += chunk
    head, _, body = data.partition(b"\r\n\r\n")
    lines = head.decode("latin-1").split("\r\n")
    length = next(int(v) for n, _, v in (h.partition(":") for h in lines[1:]) if n.strip().lower() == "content-length")
    while len(body) < length:
        chunk = conn.recv(65536)
        if not chunk:
            return None
        body += chunk
    return lines[0].split(" ")[1], head + b"\r\n\r\n" + body, body


def _read_answer(up: socket.socket) -> tuple[Answer, bytes]:
    answer, raw = Answer(), b""
    while not answer.done:
        chunk = up.recv(65536)
        if not chunk:
            raise OSError("the member closed the connection")
        raw += chunk
        answer.feed(chunk)
    return answer, raw
