"""The pipe between owner and holder (``core.protocol.Channel``): one line is one message, even
when a signal interrupts a write larger than the pipe can take at once."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time

import pytest

from singleflight.core import protocol
from singleflight.core.const import ExitCode
from singleflight.core.protocol import Channel


def test_a_message_larger_than_the_pipe_arrives_whole_through_signals() -> None:
    """A signal whose Python handler runs in the middle of a blocking ``os.write`` of more than
    the pipe holds makes the write return short; the rest must still be sent, or the reader
    decodes a torn line as a garbled message (70)."""
    r, w = os.pipe()
    chan = Channel(-1, w)
    text = "x" * (1 << 20)  # 16 times a pipe's default capacity
    got = bytearray()

    def read_slowly() -> None:
        while True:
            chunk = os.read(r, 4096)
            if not chunk:
                return
            got.extend(chunk)
            time.sleep(0.0002)

    reader = threading.Thread(target=read_slowly)
    reader.start()
    interrupted = [0]

    def on_alarm(signum: int, frame: object) -> None:
        interrupted[0] += 1

    old = signal.signal(signal.SIGALRM, on_alarm)
    signal.setitimer(signal.ITIMER_REAL, 0.002, 0.002)
    try:
        assert chan.send(protocol.error(ExitCode.SOFTWARE, text))
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, old)
        chan.close_write()
        reader.join(30)
        os.close(r)
    assert interrupted[0] > 0, "no signal came during the write: the test proved nothing"
    lines = bytes(got).split(b"\n")
    assert lines[-1] == b"" and len(lines) == 2, [len(x) for x in lines]
    msg = protocol.decode(lines[0].decode())
    assert msg.kind == protocol.ERROR and msg.text == text


def test_an_agents_start_message_round_trips_and_bad_ones_are_refused() -> None:
    start = protocol.AgentStart(backend="local", lock_dir="/tmp/ld", repo="a/b", lock="j", ticket="t-1", report_fd=7)
    word = start.message().encode()
    back = protocol.AgentStart.from_word(word)
    assert [getattr(back, n) for n in back.__slots__] == [getattr(start, n) for n in start.__slots__]
    for bad in ("", "go {}", 'start {"backend": "local"}', word.replace('"report_fd": 7', '"report_fd": true')):
        try:
            protocol.AgentStart.from_word(bad)
        except ValueError:
            continue
        raise AssertionError(f"accepted {bad!r}")


_START = protocol.AgentStart(backend="local", lock_dir="/tmp/ld", repo="a/b", lock="j", ticket="t-1", report_fd=7)


@pytest.mark.parametrize(
    ("argv", "stdin"),
    [
        ([], ""),  # no start message
        ([], "start {not json"),
        ([], "x" * 70000),  # longer than any start message
        (["local", "/tmp", "default", "j", "t", "5"], ""),
        # The message in argv, as agents once took it: refused (argv is readable by any user).
        ([_START.message().encode()], ""),
    ],
)
def test_the_agent_started_by_hand_says_what_it_needs_and_exits_64(argv: list[str], stdin: str) -> None:
    r = subprocess.run(
        [sys.executable, "-m", "singleflight.agent", *argv],
        input=stdin,
        capture_output=True,
        text=True,
        timeout=30,
        check=False,
    )
    assert r.returncode == ExitCode.USAGE, r
    assert r.stderr.startswith("singleflight.agent: error: ") and r.stderr.count("\n") == 1, r


def test_the_agent_started_by_hand_with_stdio_closed_still_exits_64() -> None:
    """fds 0-2 closed: Python starts without sys.stderr; the refusal is the exit code alone."""
    code = "import os, sys; os.closerange(0, 3); os.execv(sys.executable, [sys.executable, '-m', 'singleflight.agent'])"
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, timeout=30, check=False)
    assert r.returncode == ExitCode.USAGE, r
