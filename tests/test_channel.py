"""The pipe between owner and holder (``core.protocol.Channel``): one line is one message, even
when a signal interrupts a write larger than the pipe can take at once."""

from __future__ import annotations

import os
import signal
import threading
import time

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
