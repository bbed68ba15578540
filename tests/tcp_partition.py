"""A loopback TCP relay to one port that can be cut, as a network partition looks to both ends:
once cut, every byte either way is dropped and every connection stays open (no FIN, no RST),
and a new connection is accepted but never answered. Only the clients' own timeouts tell them.

Its threads are daemons and ``close`` ends them: nothing outlives the test.
"""

from __future__ import annotations

import contextlib
import socket
import threading

from listener import stop_listener


class Partition:
    def __init__(self, target_port: int) -> None:
        self.target_port = target_port
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.port: int = self.listener.getsockname()[1]
        self._cut = threading.Event()
        self._closed = threading.Event()
        self._socks: list[socket.socket] = []
        self._mutex = threading.Lock()
        self._acceptor = threading.Thread(target=self._accept, name="partition-accept", daemon=True)
        self._acceptor.start()

    def cut(self) -> None:
        self._cut.set()

    def close(self) -> None:
        self._closed.set()
        with self._mutex:
            socks, self._socks = self._socks, []
        stop_listener(self.listener, self._acceptor)
        for s in socks:
            with contextlib.suppress(OSError):
                s.shutdown(socket.SHUT_RDWR)
            s.close()

    def _keep(self, s: socket.socket) -> None:
        with self._mutex:
            self._socks.append(s)

    def _accept(self) -> None:
        while not self._closed.is_set():
            try:
                client, _ = self.listener.accept()
            except OSError:
                return
            self._keep(client)
            if self._cut.is_set():
                threading.Thread(target=self._drain, args=(client,), daemon=True).start()
                continue
            try:
                server = socket.create_connection(("127.0.0.1", self.target_port), timeout=5)
            except OSError:
                client.close()
                continue
            server.settimeout(None)
            self._keep(server)
            threading.Thread(target=self._relay, args=(client, server), daemon=True).start()
            threading.Thread(target=self._relay, args=(server, client), daemon=True).start()

    def _relay(self, src: socket.socket, dst: socket.socket) -> None:
        """Bytes from ``src`` to ``dst`` until either closes; once cut, read and dropped."""
        with contextlib.suppress(OSError):
            while data := src.recv(65536):
                if not self._cut.is_set():
                    dst.sendall(data)
            if not self._cut.is_set():
                dst.shutdown(socket.SHUT_WR)  # a close passes on, until the cut

    def _drain(self, src: socket.socket) -> None:
        with contextlib.suppress(OSError):
            while src.recv(65536):
                pass
