"""A line protocol over a pair of pipes between pearing-run and its holder.

Pipes rather than a socketpair: ``socket`` costs milliseconds to import and
we only need two one-way byte streams that report EOF when the peer dies.
"""

from __future__ import annotations

import os


class Channel:
    def __init__(self, rfd: int, wfd: int) -> None:
        self.rfd, self.wfd = rfd, wfd
        self._buf = b""
        self.eof = False

    def send(self, line: str) -> bool:
        """False when the peer is gone (EPIPE); the caller decides what that means."""
        if self.wfd < 0:
            return False
        try:
            os.write(self.wfd, line.encode() + b"\n")
        except (BrokenPipeError, OSError):
            self.close_write()
            return False
        return True

    def fill(self) -> None:
        """Read what is available (call when poll says rfd is readable)."""
        chunk = os.read(self.rfd, 65536)
        if chunk:
            self._buf += chunk
        else:
            self.eof = True

    def lines(self) -> list[str]:
        *complete, self._buf = self._buf.split(b"\n")
        return [c.decode() for c in complete]

    def recv(self) -> str | None:
        """Block for the next line; None on EOF."""
        while b"\n" not in self._buf:
            if self.eof:
                return None
            self.fill()
        line, self._buf = self._buf.split(b"\n", 1)
        return line.decode()

    def close_write(self) -> None:
        if self.wfd >= 0:
            os.close(self.wfd)
            self.wfd = -1

    def close(self) -> None:
        self.close_write()
        if self.rfd >= 0:
            os.close(self.rfd)
            self.rfd = -1
