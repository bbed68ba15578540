"""The messages between a wrapper (pearing-run, a CLI call, a ``Lock``) and its holder.

One line per message over a pair of pipes, two one-way byte streams that report EOF when the
peer dies. A holder forked as the run starts to wait hears from its owner over a socketpair
instead: ``go`` may carry the grip's fds (SCM_RIGHTS; a pipe cannot), the lock dir's flocked
fd. Through ``_socket``, not ``socket``: the module costs milliseconds to import, its C core one.

    holder -> owner   queued                    waiting in line (the agent)
                      ready {json}              lock taken: fence, token, token file, env
                      lost NAME REASON          the token is dead; COMMAND is being stopped
                                                (NAME: an EndReason member)
                      released                  the lock is free again (last message)
                      ended                     the ticket ended before it was held
                      error NAME MESSAGE        failed; NAME is an ExitCode member
    owner -> holder   go {json}                 first in line: the grip (to a holder forked
                                                as the run started to wait), with its fds
                      spawning TICKS            COMMAND is about to start (its pid comes next);
                                                TICKS: now, on the clock of /proc's start times
                      started PID STAMP         COMMAND (or the Lock's process) runs
                      exited STATUS|unknown     it ended: record, release, hand over
    owner -> agent    start {json}              on its stdin, never argv (``python -m singleflight.agent``):
                                                backend, lock_dir, repo, lock, ticket, report_fd,
                                                control_fd (-1: none), mode (auto, manual, wait;
                                                null without control_fd)
"""

from __future__ import annotations

import os
import sys

from singleflight.core import jsontext
from singleflight.core.const import TYPE_CHECKING, ExitCode
from singleflight.core.reasons import EndReason, Loss

if TYPE_CHECKING:
    from collections.abc import Collection
    from typing import Any

QUEUED = "queued"
READY = "ready"
LOST = "lost"
RELEASED = "released"
ENDED = "ended"
ERROR = "error"
STARTED = "started"
EXITED = "exited"
GO = "go"
SPAWNING = "spawning"
START = "start"


class Message:
    """One decoded line. ``kind`` is one of the names above; the other fields as it needs."""

    __slots__ = ("code", "info", "kind", "loss", "pid", "stamp", "status", "text")

    def __init__(
        self,
        kind: str,
        *,
        text: str = "",
        code: ExitCode = ExitCode.OK,
        info: dict[str, Any] | None = None,
        pid: int = 0,
        stamp: int = 0,
        status: int | None = None,
        loss: Loss | None = None,
    ) -> None:
        self.kind, self.text, self.code, self.info, self.loss = kind, text, code, info or {}, loss
        self.pid, self.stamp, self.status = pid, stamp, status

    def encode(self) -> str:
        k = self.kind
        if k in (READY, GO, START):
            return f"{k} {jsontext.dumps(self.info)}"
        if k == LOST:
            assert self.loss is not None
            return f"{LOST} {self.loss.reason.name} {self.loss.text}"
        if k == ERROR:
            return f"{ERROR} {self.code.name} {self.text}"
        if k == STARTED:
            return f"{STARTED} {self.pid} {self.stamp}"
        if k == SPAWNING:
            return f"{SPAWNING} {self.stamp}"
        if k == EXITED:
            return f"{EXITED} {'unknown' if self.status is None else self.status}"
        return k

    def __repr__(self) -> str:
        return f"Message({self.encode()!r})"


class Taken:
    """What a holder learns on taking the lock, and tells its owner in ``ready``."""

    __slots__ = ("env", "fence", "token", "token_file")

    def __init__(self, fence: int, token: str, token_file: str, env: dict[str, str]) -> None:
        self.fence, self.token, self.token_file, self.env = fence, token, token_file, env

    @classmethod
    def from_info(cls, info: dict[str, Any]) -> Taken:
        env = info.get("env")
        return cls(
            int(info["fence"]),
            str(info["token"]),
            str(info["token_file"]),
            {str(k): str(v) for k, v in env.items()} if isinstance(env, dict) else {},
        )


class AgentStart:
    """Where an agent's ticket is and which of its fds are its pipes: the ``start`` message."""

    __slots__ = ("backend", "control_fd", "lock", "lock_dir", "mode", "repo", "report_fd", "ticket")

    def __init__(
        self,
        *,
        backend: str,
        lock_dir: str,
        repo: str,
        lock: str,
        ticket: str,
        report_fd: int,
        control_fd: int = -1,
        mode: str | None = None,
    ) -> None:
        self.backend, self.lock_dir, self.repo, self.lock, self.ticket = backend, lock_dir, repo, lock, ticket
        self.report_fd, self.control_fd, self.mode = report_fd, control_fd, mode

    def message(self) -> Message:
        return Message(START, info={name: getattr(self, name) for name in self.__slots__})

    @classmethod
    def from_word(cls, word: str) -> AgentStart:
        """The ``start`` message an agent read on its stdin; ValueError naming what is wrong."""
        msg = decode(word)
        if msg.kind != START:
            raise ValueError(f"not a start message: {word[:80]!r}")
        info = msg.info
        strings = ("backend", "lock_dir", "repo", "lock", "ticket")
        if not all(isinstance(info.get(k), str) for k in strings):
            raise ValueError(f"start needs {', '.join(strings)} as strings")
        report, control = info.get("report_fd"), info.get("control_fd", -1)
        fds = [fd for fd in (report, control) if isinstance(fd, int) and not isinstance(fd, bool) and fd >= -1]
        if len(fds) != 2:
            raise ValueError("start needs report_fd and control_fd as fd numbers")
        mode = info.get("mode")
        if mode not in (None, "auto", "manual", "wait"):
            raise ValueError(f"start's mode is auto, manual, wait or null, not {mode!r}")
        b, d, r, lk, t = (str(info[k]) for k in strings)
        return cls(backend=b, lock_dir=d, repo=r, lock=lk, ticket=t, report_fd=fds[0], control_fd=fds[1], mode=mode)


def ready(taken: Taken) -> Message:
    info = {"fence": taken.fence, "token": taken.token, "token_file": taken.token_file, "env": taken.env}
    return Message(READY, info=info)


def go(grip: dict[str, Any]) -> Message:
    return Message(GO, info=grip)


def lost(loss: Loss) -> Message:
    return Message(LOST, text=loss.text.replace("\n", " "), loss=loss)


def error(code: ExitCode, text: str) -> Message:
    return Message(ERROR, code=code, text=text.replace("\n", " "))


def spawning(stamp: int) -> Message:
    return Message(SPAWNING, stamp=stamp)


def started(pid: int, stamp: int) -> Message:
    return Message(STARTED, pid=pid, stamp=stamp)


def exited(status: int | None) -> Message:
    return Message(EXITED, status=status)


def decode(line: str) -> Message:
    """The message of one line; an unknown or garbled line is an ERROR (a bug), never a crash."""
    word, _, rest = line.partition(" ")
    try:
        if word in (READY, GO, START):
            info = jsontext.loads(rest)
            if not isinstance(info, dict):
                raise ValueError(rest)
            return Message(word, info=info)
        if word == LOST:
            name, _, text = rest.partition(" ")
            return Message(LOST, text=text, loss=Loss(EndReason[name], text=text))
        if word == ERROR:
            name, _, text = rest.partition(" ")
            return Message(ERROR, code=ExitCode[name], text=text)
        if word == STARTED:
            pid, stamp = rest.split()
            return Message(STARTED, pid=int(pid), stamp=int(stamp))
        if word == EXITED:
            return Message(EXITED, status=None if rest == "unknown" else int(rest))
        if word == SPAWNING and rest.isascii() and rest.isdigit():
            return Message(SPAWNING, stamp=int(rest))
        if word in (QUEUED, RELEASED, ENDED) and not rest:
            return Message(word)
    except (ValueError, KeyError):
        pass
    return Message(ERROR, code=ExitCode.SOFTWARE, text=f"internal error: garbled message {line[:80]!r}")


_MAX_FDS = 4  # a grip's fds that one message carries at most; more are refused, never leaked
_FD_BYTES = 4  # an int, as SCM_RIGHTS carries it


def socketpair() -> tuple[int, int]:
    """Two connected stream sockets' fds (close-on-exec): the one way a message can carry fds."""
    import _socket

    a, b = _socket.socketpair(_socket.AF_UNIX, _socket.SOCK_STREAM)
    return a.detach(), b.detach()


class Channel:
    def __init__(self, rfd: int, wfd: int) -> None:
        self.rfd, self.wfd = rfd, wfd
        self._buf = b""
        self.eof = False

    def send(self, msg: Message, fds: Collection[int] = ()) -> bool:
        """False when the peer is gone (EPIPE); the caller decides what that means. ``fds`` go
        with the message's first byte (SCM_RIGHTS: ``wfd`` must be a socket); the peer gets
        copies (the same open files), ours stay open."""
        if self.wfd < 0:
            return False
        data = memoryview(msg.encode().encode() + b"\n")
        try:
            if fds:
                data = data[self._send_fds(data, sorted(fds)) :]
            # One line is one message: a write that a signal cut short is finished, never left
            # torn (a torn line decodes as a garbled message, 70). Lines under PIPE_BUF are
            # written whole anyway; a larger one (a long environment) may not be.
            while data:
                data = data[os.write(self.wfd, data) :]
        except OSError:
            self.close_write()
            return False
        return True

    def _send_fds(self, data: memoryview, fds: list[int]) -> int:
        import _socket

        assert len(fds) <= _MAX_FDS, fds
        rights = b"".join(fd.to_bytes(_FD_BYTES, sys.byteorder, signed=True) for fd in fds)
        sock = _socket.socket(_socket.AF_UNIX, _socket.SOCK_STREAM, 0, self.wfd)
        try:
            # MSG_NOSIGNAL: a peer gone is EPIPE here, as on a pipe where SIGPIPE is ignored.
            ancillary = [(_socket.SOL_SOCKET, _socket.SCM_RIGHTS, rights)]
            sent: int = sock.sendmsg([data], ancillary, _socket.MSG_NOSIGNAL)
        finally:
            sock.detach()  # the fd stays ours: the socket object only lent its methods
        return sent

    def recv_fds(self) -> tuple[Message | None, list[int]]:
        """Block for the next message and the fds that came with it (close-on-exec, ours to
        close); None on EOF. A plain read would drop them: the wait for ``go`` reads this way."""
        import _socket

        fds: list[int] = []
        sock = _socket.socket(_socket.AF_UNIX, _socket.SOCK_STREAM, 0, self.rfd)
        try:
            while b"\n" not in self._buf and not self.eof:
                space = _socket.CMSG_SPACE(_MAX_FDS * _FD_BYTES)
                try:
                    chunk, ancillary, _, _ = sock.recvmsg(65536, space, _socket.MSG_CMSG_CLOEXEC)
                except OSError:
                    chunk, ancillary = b"", []  # as a pipe's reader sees its writer gone: EOF
                for level, kind, blob in ancillary:
                    if level == _socket.SOL_SOCKET and kind == _socket.SCM_RIGHTS:
                        usable = len(blob) - len(blob) % _FD_BYTES
                        fds += [
                            int.from_bytes(blob[i : i + _FD_BYTES], sys.byteorder, signed=True)
                            for i in range(0, usable, _FD_BYTES)
                        ]
                self._buf += chunk
                self.eof = not chunk
        finally:
            sock.detach()
        if b"\n" not in self._buf:
            return None, fds
        line, self._buf = self._buf.split(b"\n", 1)
        return decode(line.decode(errors="replace")), fds

    def fill(self) -> None:
        """Read what is available (call when poll says rfd is readable)."""
        try:
            chunk = os.read(self.rfd, 65536)
        except BlockingIOError:
            return
        if chunk:
            self._buf += chunk
        else:
            self.eof = True

    def messages(self) -> list[Message]:
        *complete, self._buf = self._buf.split(b"\n")
        return [decode(c.decode(errors="replace")) for c in complete]

    def recv(self) -> Message | None:
        """Block for the next message; None on EOF."""
        while b"\n" not in self._buf:
            if self.eof:
                return None
            self.fill()
        line, self._buf = self._buf.split(b"\n", 1)
        return decode(line.decode(errors="replace"))

    def recv_until(self, deadline: float) -> Message | None:
        """The next message, or None on EOF or once ``deadline`` (monotonic) passes."""
        import select
        import time

        while b"\n" not in self._buf:
            if self.eof:
                return None
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                return None
            if select.select([self.rfd], [], [], remaining)[0]:
                self.fill()
        line, self._buf = self._buf.split(b"\n", 1)
        return decode(line.decode(errors="replace"))

    def close_write(self) -> None:
        if self.wfd >= 0:
            os.close(self.wfd)
            self.wfd = -1

    def close(self) -> None:
        self.close_write()
        if self.rfd >= 0:
            os.close(self.rfd)
            self.rfd = -1
