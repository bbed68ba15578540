"""Stopping a test server's listening socket so that nothing accepts on it any more.

``close()`` alone does not: a thread blocked in ``accept()`` stays blocked on the socket, which
keeps listening on its port for the rest of the worker's life; and a thread that had read the
socket's fd number but not yet made the call accepts on whatever socket gets that number next
(CI: a git-over-HTTP test's request was accepted and dropped by a leftover etcd stand-in's
thread, "Empty reply from server"). So: shut down first (a blocked ``accept()`` returns), wait
for the threads, and only then close (free the fd number).
"""

from __future__ import annotations

import contextlib
import socket
import threading


def stop_listener(sock: socket.socket, *threads: threading.Thread) -> None:
    with contextlib.suppress(OSError):
        sock.shutdown(socket.SHUT_RDWR)
    for t in threads:
        if t is not threading.current_thread():
            t.join(timeout=10)
            assert not t.is_alive(), f"{t.name} still accepting after its listener was shut down"
    sock.close()
