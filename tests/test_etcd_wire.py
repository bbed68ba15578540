"""The etcd client's HTTP/1.1 (``singleflight.etcd.wire``) against answers cut at every byte,
a real loopback server that closes a kept-alive connection while it is idle (the client asks
again on a fresh one, and never on the closed one), and a peer that
drips its answer; and the client's decoder (``client.decode``) against answers not etcd's."""

from __future__ import annotations

import json
import select
import socket
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

import pytest
from hostile_peer import HostilePeer
from listener import stop_listener

from singleflight.etcd.client import NotEtcd, decode, op_delete, op_put, op_range
from singleflight.etcd.wire import Answer, Conn, Stream, WireError

SIZED = b'HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: 11\r\n\r\n{"a": "b"}\n'
CHUNKED = (
    b'HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n8\r\n{"x": 1}\r\n1\r\n\n\r\na\r\n{"y": 2}\n\n\r\n0\r\n\r\n'
)


def fed_byte_by_byte(raw: bytes) -> Answer:
    a = Answer()
    for i in range(len(raw)):
        a.feed(raw[i : i + 1])
    return a


def test_a_sized_answer_cut_anywhere() -> None:
    a = fed_byte_by_byte(SIZED)
    assert (a.status, a.done, bytes(a.body), a.close) == (200, True, b'{"a": "b"}\n', False)


def test_a_chunked_answer_cut_anywhere_gives_its_lines() -> None:
    a = fed_byte_by_byte(CHUNKED)
    assert a.done and a.chunked
    assert a.lines() == [b'{"x": 1}', b'{"y": 2}']


def test_a_stream_gives_lines_as_they_complete() -> None:
    a = Answer()
    a.feed(CHUNKED[:60])
    first = a.lines()
    a.feed(CHUNKED[60:])
    assert first + a.lines() == [b'{"x": 1}', b'{"y": 2}']


@pytest.mark.parametrize("raw", [b"SSH-2.0-OpenSSH\r\n\r\n", b"HTTP/1.1 abc\r\n\r\n", b"x" * 20000])
def test_what_is_not_an_http_answer_is_a_wire_error(raw: bytes) -> None:
    with pytest.raises(WireError):
        Answer().feed(raw)


def test_a_bad_chunk_size_is_a_wire_error() -> None:
    with pytest.raises(WireError):
        Answer().feed(b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\nzz\r\n")


class OneShotServer:
    """Answers each connection's first request, then closes it: a member dropping idle connections."""

    def __init__(self) -> None:
        self.sock = socket.create_server(("127.0.0.1", 0))
        self.port = self.sock.getsockname()[1]
        self.requests = 0
        self.thread = threading.Thread(target=self._serve, daemon=True)
        self.thread.start()

    def _serve(self) -> None:
        while True:
            try:
                conn, _ = self.sock.accept()
            except OSError:
                return
            with conn:
                data = b""
                while b"\r\n\r\n" not in data:
                    data += conn.recv(4096)
                head, _, body = data.partition(b"\r\n\r\n")
                length = int(
                    next(h for h in head.split(b"\r\n") if h.lower().startswith(b"content-length")).split(b":")[1]
                )
                while len(body) < length:
                    body += conn.recv(4096)
                self.requests += 1
                conn.sendall(SIZED)

    def close(self) -> None:
        stop_listener(self.sock, self.thread)


@pytest.fixture
def server() -> Iterator[OneShotServer]:
    s = OneShotServer()
    yield s
    s.close()


def test_a_connection_closed_while_idle_is_opened_again(server: OneShotServer) -> None:
    conn = Conn("127.0.0.1", server.port, 2.0)
    try:
        for _ in range(3):
            assert conn.request("/v3/kv/range", b"{}") == (200, b'{"a": "b"}\n')
    finally:
        conn.close()
    assert server.requests == 3


def _refused(port: int) -> bool:
    try:
        socket.create_connection(("127.0.0.1", port), timeout=5).close()
    except ConnectionRefusedError:
        return True
    return False


def test_a_stopped_stand_in_accepts_nothing_more() -> None:
    """A stand-in server, once stopped after serving, has no thread left accepting and its port
    refuses: a leftover one took a later test's connection and dropped it."""
    for server in (OneShotServer(), EndingServer()):
        conn = Conn("127.0.0.1", server.port, 2.0)
        try:
            assert conn.request("/v3/kv/range", b"{}") == (200, b'{"a": "b"}\n')
        finally:
            conn.close()
        server.close()
        assert not server.thread.is_alive() and _refused(server.port), type(server).__name__


class EndingServer:
    """Answers each connection's first request, then ends its side of it (a member closing an
    idle connection) and keeps reading: what arrives after that, the member never answers."""

    def __init__(self) -> None:
        self.sock = socket.create_server(("127.0.0.1", 0))
        self.port = self.sock.getsockname()[1]
        self.answered, self.unanswered = 0, 0
        self.ended = threading.Event()
        self.thread = threading.Thread(target=self._serve, daemon=True)
        self.thread.start()

    def _serve(self) -> None:
        while True:
            try:
                conn, _ = self.sock.accept()
            except OSError:
                return
            with conn:
                data = b""
                while not data.endswith(b"{}"):
                    data += conn.recv(4096)
                self.answered += 1
                conn.sendall(SIZED)
                conn.shutdown(socket.SHUT_WR)
                self.ended.set()
                if conn.recv(4096):
                    self.unanswered += 1

    def close(self) -> None:
        stop_listener(self.sock, self.thread)


def test_a_connection_closed_while_idle_is_not_asked_again() -> None:
    """The request goes out on a fresh connection, never onto the one the member closed: there a
    member may read it and still not answer, and the client could not tell whether it was applied."""
    server = EndingServer()
    conn = Conn("127.0.0.1", server.port, 2.0)
    try:
        assert conn.request("/v3/kv/range", b"{}") == (200, b'{"a": "b"}\n')
        assert server.ended.wait(5)
        assert conn.sock is not None and select.select([conn.sock], [], [], 5)[0]  # its end has arrived
        assert conn.request("/v3/kv/range", b"{}") == (200, b'{"a": "b"}\n')
    finally:
        conn.close()
        server.close()
    assert (server.answered, server.unanswered) == (2, 0)


def test_no_member_is_an_os_error() -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]  # bound, never listening: refused
        with pytest.raises(OSError):
            Conn("127.0.0.1", port, 1.0).request("/v3/kv/range", b"{}")


# -- a hostile peer: a deadline on the whole exchange ------------------------------------------


def in_thread(fn: Callable[[], object], bound: float) -> tuple[object, float]:
    """(what ``fn`` returned or raised, seconds it took); fails the test past ``bound`` seconds.
    A thread, so that the test fails instead of hanging on the code it tests."""
    out: list[object] = []

    def run() -> None:
        try:
            out.append(fn())
        except Exception as exc:  # handed to the test to assert on
            out.append(exc)

    start = time.monotonic()
    t = threading.Thread(target=run, daemon=True)
    t.start()
    t.join(bound)
    if t.is_alive():
        pytest.fail(f"still running after {bound:g} s")
    return out[0], time.monotonic() - start


def test_a_member_that_drips_its_answer_times_out_within_the_request_timeout(peer: HostilePeer) -> None:
    """A byte every second never trips a 2 s timeout on each read: the deadline is the whole request's."""
    conn = Conn("127.0.0.1", peer.start("drip"), 2.0)
    result, took = in_thread(lambda: conn.request("/v3/kv/range", b"{}"), 10.0)
    assert isinstance(result, TimeoutError), result
    assert 1.5 < took < 4.0, took
    assert conn.sock is None  # a connection in the middle of an answer is never reused


def test_a_watch_whose_head_drips_in_is_a_wire_error(peer: HostilePeer) -> None:
    stream = Stream("127.0.0.1", peer.start("drip"), "/v3/watch", b"{}", 1.0)

    def read_until_broken() -> object:
        while True:
            select.select([stream], [], [], 1.0)
            stream.read()

    try:
        result, took = in_thread(read_until_broken, 10.0)
    finally:
        stream.close()
    assert isinstance(result, WireError), result
    assert took < 4.0, took


# -- answers that are not etcd's ---------------------------------------------------------------

HEADER = {"header": {"cluster_id": "1", "member_id": "2", "revision": "7", "raft_term": "2"}}
KV = {"key": "eA==", "create_revision": "2", "mod_revision": "3", "version": "1"}
TXN = {"compare": [], "success": [op_range("a"), op_put("b", b"1")], "failure": [op_delete("c")]}
AT_7 = {"header": {"revision": "7"}}


def test_etcd_answers_decode_as_they_are() -> None:
    """Answers as etcd 3.4's gateway writes them (zero values left out)."""
    for path, request, answer in [
        ("kv/range", {}, {**HEADER, "kvs": [KV], "count": "1"}),
        ("kv/range", {}, HEADER),
        ("kv/put", {}, HEADER),
        ("kv/txn", TXN, {**HEADER, "succeeded": True, "responses": [{"response_range": AT_7}, {"response_put": AT_7}]}),
        ("kv/txn", TXN, {**HEADER, "responses": [{"response_delete_range": AT_7}]}),
        ("kv/txn", {"compare": [], "success": [], "failure": []}, {**HEADER, "succeeded": True}),
        ("lease/grant", {}, {**HEADER, "ID": "81806088640968971", "TTL": "5"}),
        ("lease/keepalive", {}, {"result": {**HEADER, "ID": "81806088640968971"}}),
        ("kv/lease/timetolive", {}, {**HEADER, "ID": "8", "TTL": "-1"}),
    ]:  # fmt: skip
        assert decode(path, request, json.dumps(answer).encode()) == answer


@pytest.mark.parametrize(
    ("path", "request_", "answer"),
    [
        ("kv/range", {}, b"hello"),
        ("kv/range", {}, b"\xff\xfe"),
        ("kv/range", {}, b"[]"),
        ("kv/range", {}, b"{}"),
        ("kv/range", {}, b'{"header": {}}'),
        ("kv/range", {}, b'{"header": []}'),
        ("kv/range", {}, b"[" * 100000),
        ("kv/range", {}, b'{"header": ' * 900 + b"{}" + b"}" * 900),
        ("kv/range", {}, json.dumps({**HEADER, "kvs": [{}]}).encode()),
        ("kv/range", {}, json.dumps({**HEADER, "kvs": {"key": "eA=="}}).encode()),
        ("kv/range", {}, json.dumps({**HEADER, "kvs": [{**KV, "key": "not base64!"}]}).encode()),
        ("kv/range", {}, json.dumps({**HEADER, "kvs": [{**KV, "mod_revision": "3e2"}]}).encode()),
        ("kv/range", {}, json.dumps({**HEADER, "kvs": [{**KV, "mod_revision": "\u0663"}]}).encode()),
        ("kv/range", {}, json.dumps({**HEADER, "count": 1.5}).encode()),
        ("kv/put", {}, json.dumps({"header": {"revision": None}}).encode()),
        ("kv/txn", TXN, json.dumps({**HEADER, "succeeded": True}).encode()),
        ("kv/txn", TXN, json.dumps({**HEADER, "succeeded": "yes"}).encode()),
        ("kv/txn", TXN, json.dumps({**HEADER, "responses": [{"response_range": {}}]}).encode()),
        ("kv/txn", TXN, json.dumps({**HEADER, "responses": [{"response_delete_range": []}]}).encode()),
        ("lease/grant", {}, json.dumps(HEADER).encode()),
        ("lease/keepalive", {}, json.dumps(HEADER).encode()),
    ],
)
def test_what_is_not_etcds_answer_is_refused(path: str, request_: dict[str, Any], answer: bytes) -> None:
    with pytest.raises(NotEtcd):
        decode(path, request_, answer)
