"""strace's log, read back: each traced call stamped when it returned, for ``bench.stages``.

``strace --seccomp-bpf -f -ttt -T``: the kernel stops a process only at the calls named, so it
runs at nearly full speed between them; ``-T`` is the time spent in each call, added to its start.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
from pathlib import Path
from typing import Any

STRACE = shutil.which("strace")
_LINE = re.compile(r"^(\d+) +(\d+\.\d+) (.*?)(?: <(\d+\.\d+)>)?$")
_RESUMED = re.compile(r"^<\.\.\. (\w+) resumed>(.*)$")
_UNFINISHED = " <unfinished ...>"
_RESULT = re.compile(r"\) += (-?\d+|\?)")
_STRING = re.compile(r'"((?:\\x[0-9a-f]{2})*)"')

Event = tuple[int, float, str]


def usable() -> bool:
    """strace is here, may trace (ptrace allowed) and knows --seccomp-bpf (5.3 and later)."""
    if STRACE is None:
        return False
    probe = [STRACE, "--seccomp-bpf", "-f", "-o", os.devnull, "true"]
    return subprocess.run(probe, capture_output=True, check=False).returncode == 0


def strace(argv: list[str], log: Path, env: dict[str, str], calls: str, *opts: str) -> subprocess.Popen[bytes]:
    assert STRACE is not None
    return subprocess.Popen(
        [STRACE, "--seccomp-bpf", "-f", "-ttt", "-T", *opts, "-e", f"trace={calls}", "-o", str(log), *argv], env=env
    )


def events(path: Path) -> list[Event]:
    """(pid, ms, call) of each traced call, stamped when it returned, so a blocking call (a
    flock, a read of a socket) is stamped when it was granted or answered; but a call that hands
    something on (a write, a send, a spawn) when it began: the peer may run, and return from its
    read, before the writer is back from its write, and a vfork returns only once the child has
    exec'd."""
    out = [(pid, start if hands_on(text) else end, text) for pid, start, end, text in spans(path)]
    return sorted(out, key=lambda e: e[1])


def hands_on(text: str) -> bool:
    return text.startswith(("write(", "sendto(", "sendmsg(", "clone3(", "vfork(")) or (
        text.startswith("clone(") and "CLONE_VFORK" in text
    )


def spans(path: Path) -> list[tuple[int, float, float, str]]:
    """(pid, ms at its start, ms at its return, call) of each traced call, in the log's order. A
    call that another process's call cut in two in the log (``<unfinished ...>``, later
    ``<... resumed>``) is put back together: its start from the first line, its time spent
    (``-T``) from the second."""
    out = []
    pending: dict[int, tuple[float, str]] = {}
    for line in path.read_text().splitlines():
        m = _LINE.match(line)
        if not m:
            continue
        pid, at, text = int(m.group(1)), float(m.group(2)), m.group(3)
        if text.endswith(_UNFINISHED):
            pending[pid] = (at, text[: -len(_UNFINISHED)])
            continue
        resumed = _RESUMED.match(text)
        if resumed:
            if pid not in pending:
                continue
            at, head = pending.pop(pid)
            text = head + resumed.group(2)
        spent = float(m.group(4)) if m.group(4) else 0.0
        out.append((pid, at * 1000, (at + spent) * 1000, text))
    return out


def first(ev: list[Event], pred: Any, after: float = 0.0) -> float:
    return next(t for _, t, text in ev if t >= after and pred(text))


def result(text: str) -> int | None:
    """What the call returned (None: it did not, as exit_group)."""
    m = _RESULT.search(text)
    return int(m.group(1)) if m and m.group(1) != "?" else None


def data(text: str) -> bytes:
    """The first string the call passed or got, as bytes (traced with ``-xx``: every byte in hex;
    only its first ``-s`` bytes)."""
    m = _STRING.search(text)
    return bytes.fromhex(m.group(1).replace("\\x", "")) if m else b""
