"""The etcd hand-over, stage by stage: pearing-run's and ``etcdctl lock``'s, on one loopback member
in the same run, so the two read side by side (a section of ``python -m bench.stages``).

The shape of the lock dir's hand-over trace: a first run holds (its COMMAND blocks on a gate, a
FIFO), the next one is queued behind it, the gate opens, and the stamps split "gate opened ->
next COMMAND exec" into stages. Both runs are traced, on the same clock, so the old holder's
release is stamped too. There is no flock on etcd: each stage ends at the call that marks it,

- pearing-run: the old wrapper reaping COMMAND (wait4) and telling its holder (``exited``, a
  pipe write), the holder's read of it and its release txn (``sendto`` of ``POST /v3/kv/txn``);
  the next wrapper's watch returning (``recvfrom``), its one read (``sendto``, the answer's
  ``recvfrom``), the grip handed to its standby holder (``go``), the holder's recvmsg of it and
  its ``ready``, the wrapper's ``spawning`` (it read ``ready``), the spawn and the exec;
- ``etcdctl lock`` (one Go process, gRPC): COMMAND reaped, the unlock's HTTP/2 HEADERS frame
  written, the next one's watch DATA frame read, its Get written and answered, the spawn
  (clone, CLONE_VFORK) and the exec.

Traced with ``-xx`` (strings as bytes in hex) so the messages and the HTTP/2 frames can be told
apart; ``--seccomp-bpf`` with this short call list keeps the processes at nearly full speed
between the calls. Each call traced still stops its process until strace has written it: a
fraction of a ms on a quiet machine, more on a busy one, so a stage with more calls in it is
inflated more (pearing-run's more than etcdctl's). Compare within one run.
"""

from __future__ import annotations

import contextlib
import os
import shlex
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, NamedTuple

from bench import trace
from bench.chain import ETCD, ETCDCTL, endpoints, env, etcd_member, etcd_queued, mutex_prefix, wait_for

RUN = str(Path(sys.executable).parent / "pearing-run")
# Python reads a socket with recvfrom or recvmsg, a pipe or a file with read; Go reads all with
# read. The next pearing-run is not stopped at its reads: its holder's take reads /proc (each
# stop costs a round of scheduling through strace on a busy machine); the old holder's read of
# ``exited`` is a stage of its own.
CALLS = "execve,clone,clone3,vfork,exit_group,wait4,sendto,recvfrom,sendmsg,recvmsg,write"
READS = CALLS + ",read"
OPTS = ("-xx", "-s", "160")
# After the next run is in line: its watch is opened and its standby holder forked and blocked
# in recvmsg a few ms after its key is; what is timed starts at the gate.
SETTLE = 0.3
PEARING, ETCDCTL_LOCK = "pearing-run", "etcdctl lock"
# A count, not ms: HTTP requests (pearing-run), HTTP/2 HEADERS frames written, each a new call
# (etcdctl lock).
REQUESTS = "(aside) requests to etcd, gate opened to COMMAND's exec (a count)"
# The phases both have, in the order of a hand-over; each ends at the stamp named.
PHASES = (
    ("gate opened to the old COMMAND's exit", "exit"),
    ("old COMMAND's exit to the release sent", "release sent"),
    ("release sent to the next waiter's watch returning", "woken"),
    ("watch returned to the waiter's read sent", "read sent"),
    ("the read's round trip", "read answered"),
    ("answer to COMMAND spawned", "spawned"),
    ("spawned to COMMAND's exec", "exec"),
)


class Call(NamedTuple):
    """A traced call, stamped (``ms``) as ``trace.events`` stamps it."""

    pid: int
    ms: float
    name: str
    data: bytes
    ret: int | None
    text: str


def calls(path: Path) -> list[Call]:
    return [
        Call(pid, ms, text.split("(", 1)[0], trace.data(text), trace.result(text), text)
        for pid, ms, text in trace.events(path)
    ]


def _at(cs: list[Call], what: str, pred: Any, after: float) -> Call:
    for c in cs:
        if c.ms >= after and pred(c):
            return c
    raise SystemExit(f"bench.stages: the etcd trace has no {what}")


def _frames(b: bytes) -> list[int]:
    """The types of the HTTP/2 frames that begin in ``b`` (as far as strace showed it)."""
    types, i = [], 0
    while i + 9 <= len(b):
        types.append(b[i + 3])
        i += 9 + int.from_bytes(b[i : i + 3], "big")
    return types


_DATA, _HEADERS = 0, 1


def _got(c: Call) -> bool:
    """A read of a socket that brought bytes (not a peek at an idle connection)."""
    return c.name in ("recvfrom", "read") and (c.ret or 0) > 0 and "MSG_PEEK" not in c.text


def _exec_true(c: Call) -> bool:
    return c.name == "execve" and c.data == b"/bin/true" and c.ret == 0


def _spawn(c: Call) -> bool:
    return c.name in ("clone3", "vfork") or (c.name == "clone" and "CLONE_VFORK" in c.text)


def _txn(c: Call) -> bool:
    return c.name == "sendto" and c.data.startswith(b"POST /v3/kv/txn")


def _said(name: str, word: bytes) -> Any:
    return lambda c: c.name == name and c.data.startswith(word)


def _hand_over(
    tmp: Path, e: dict[str, str], runs: tuple[list[str], list[str]], queued: Any, calls: tuple[str, str]
) -> float:
    """When the gate opened (ms): the first of ``runs`` holds until then, the next one waits in
    line meanwhile; their traces are left in ``tmp`` (first.trace, next.trace), of the ``calls``
    given for each."""
    holder, waiter = runs
    gate, ready = tmp / "gate", tmp / "ready"
    os.mkfifo(gate)
    hold = f"touch {shlex.quote(str(ready))}; read x < {shlex.quote(str(gate))}; exit 0"
    first = trace.strace([*holder, "sh", "-c", hold], tmp / "first.trace", e, calls[0], *OPTS)
    nxt = None
    try:
        wait_for(ready.exists, 20, "the first run's COMMAND")
        nxt = trace.strace([*waiter, "/bin/true"], tmp / "next.trace", e, calls[1], *OPTS)
        wait_for(queued, 20, "the next run in line")
        time.sleep(SETTLE)
        opened = time.time() * 1000
        os.close(os.open(gate, os.O_WRONLY))  # the COMMAND's read returns at our close: end of file
        if first.wait(60) != 0 or nxt.wait(60) != 0:
            raise SystemExit("bench.stages: an etcd hand-over run failed")
    except BaseException:
        # Whatever went wrong, no run is left waiting: the gate opens (if its COMMAND still reads
        # it), and both runs end.
        with contextlib.suppress(OSError):
            os.close(os.open(gate, os.O_WRONLY | os.O_NONBLOCK))
        for p in (first, nxt):
            if p is not None and p.poll() is None:
                p.terminate()
                p.wait(10)
        raise
    return opened


def pearing(tmp: Path, e: dict[str, str], url: str, job: str) -> dict[str, float]:
    e = dict(e, PEARING_BACKEND=url)
    opened = _hand_over(
        tmp,
        e,
        ([RUN, "--job", job, "--"], [RUN, "--job", job, "--wait-seconds", "30", "--"]),
        lambda: etcd_queued(url, job) >= 2,
        (READS, CALLS),
    )
    old, new = calls(tmp / "first.trace"), calls(tmp / "next.trace")
    ended = _at(old, "old COMMAND's exit", lambda c: c.name == "exit_group", opened)
    reaped = _at(old, "reaping of the old COMMAND", lambda c: c.name == "wait4" and c.ret == ended.pid, ended.ms)
    told = _at(old, "`exited` to the old holder", _said("write", b"exited"), reaped.ms)
    heard = _at(old, "old holder's read of `exited`", _said("read", b"exited"), told.ms)
    sent = _at(old, "release txn", _txn, heard.ms)
    acked = _at(old, "release's answer", lambda c: _got(c) and c.pid == sent.pid, sent.ms)
    woken = _at(new, "watch event", _got, sent.ms)
    asked = _at(new, "waiter's read", _txn, woken.ms)
    answered = _at(new, "read's answer", lambda c: _got(c) and c.pid == asked.pid, asked.ms)
    go = _at(
        new, "`go` to the holder", lambda c: c.name in ("write", "sendmsg") and c.data.startswith(b"go "), answered.ms
    )
    if go.ret is not None and go.ret < 0:
        # The standby holder was gone before the grip came: the run forked a holder with it instead
        # (a correct run, but not the hand-over this measures). Say what the standby last said.
        said = [c.data[:120] for c in new if c.name == "write" and c.data.startswith(b"error ")]
        raise SystemExit(f"bench.stages: the standby holder was gone before `go` ({go.text[-40:]!r}); it said {said}")
    got = _at(new, "holder's recvmsg of `go`", _said("recvmsg", b"go "), go.ms)
    readied = _at(new, "`ready`", _said("write", b"ready"), got.ms)
    spawning = _at(new, "`spawning` to the holder", _said("write", b"spawning"), readied.ms)
    spawned = _at(new, "spawn", _spawn, spawning.ms)
    execd = _at(new, "COMMAND's exec", _exec_true, spawned.ms)
    stamps = [
        ("gate opened to the old COMMAND's exit", ended),
        ("old wrapper reaps it (pidfd, wait4)", reaped),
        ("old wrapper writes `exited` to its holder", told),
        ("old holder reads `exited` (a wake-up)", heard),
        ("old holder sends its release txn (end record, key deleted)", sent),
        ("next wrapper's watch returns (etcd: fsync, apply, notify; a wake-up)", woken),
        ("it sends its read (first in line? ticket live? guards?)", asked),
        ("the read's round trip", answered),
        ("it writes `go` (the grip) to its standby holder", go),
        ("the holder's recvmsg returns (a wake-up)", got),
        ("the holder takes the lease (ticket, token hash, token file), writes `ready`", readied),
        ("the wrapper reads it (a wake-up), makes COMMAND's environment, writes `spawning`", spawning),
        ("it spawns COMMAND (clone3)", spawned),
        ("COMMAND's exec", execd),
    ]
    out = _stages(opened, stamps)
    out["(aside) the old holder's release txn, round trip"] = acked.ms - sent.ms
    out[REQUESTS] = _count(old + new, lambda c: c.name == "sendto" and c.data.startswith(b"POST /v3/"), opened, execd)
    marks = {"exit": ended, "release sent": sent, "woken": woken, "read sent": asked, "read answered": answered}
    return out | _phases(opened, marks | {"spawned": spawned, "exec": execd})


def etcdctl(tmp: Path, e: dict[str, str], url: str, job: str) -> dict[str, float]:
    e = dict(e, ETCDCTL_API="3")
    lock = [str(ETCDCTL), "--endpoints", endpoints(url), "lock", mutex_prefix(url, job), "--"]
    opened = _hand_over(tmp, e, (lock, lock), lambda: etcd_queued(url, job) >= 2, (READS, READS))
    old, new = calls(tmp / "first.trace"), calls(tmp / "next.trace")

    def frame(name: str, kind: int) -> Any:
        return lambda c: c.name == name and (c.ret or 0) > 0 and kind in _frames(c.data)

    ended = _at(old, "old COMMAND's exit", lambda c: c.name == "exit_group", opened)
    reaped = _at(old, "reaping of the old COMMAND", lambda c: c.name == "wait4" and c.ret == ended.pid, ended.ms)
    sent = _at(old, "unlock (HTTP/2 HEADERS written)", frame("write", _HEADERS), reaped.ms)
    woken = _at(new, "watch event (HTTP/2 DATA read)", frame("read", _DATA), sent.ms)
    asked = _at(new, "waiter's Get (HTTP/2 HEADERS written)", frame("write", _HEADERS), woken.ms)
    answered = _at(new, "Get's answer (HTTP/2 HEADERS read)", frame("read", _HEADERS), asked.ms)
    spawned = _at(new, "spawn", _spawn, answered.ms)
    execd = _at(new, "COMMAND's exec", _exec_true, spawned.ms)
    stamps = [
        ("gate opened to the old COMMAND's exit", ended),
        ("old etcdctl reaps it (wait4)", reaped),
        ("old etcdctl sends its unlock (Delete)", sent),
        ("next etcdctl's watch returns (etcd: fsync, apply, notify; a wake-up)", woken),
        ("it sends its Get (anyone left ahead?)", asked),
        ("the Get's round trip", answered),
        ("it spawns COMMAND (clone, CLONE_VFORK)", spawned),
        ("COMMAND's exec", execd),
    ]
    marks = {"exit": ended, "release sent": sent, "woken": woken, "read sent": asked, "read answered": answered}
    out = _stages(opened, stamps)
    out[REQUESTS] = _count(old + new, frame("write", _HEADERS), opened, execd)
    return out | _phases(opened, marks | {"spawned": spawned, "exec": execd})


def _count(cs: list[Call], pred: Any, opened: float, execd: Call) -> float:
    """How many calls of both runs between the gate's opening and the next COMMAND's exec are
    requests to etcd (each one round trip)."""
    return float(sum(1 for c in cs if opened <= c.ms <= execd.ms and pred(c)))


def _stages(opened: float, stamps: list[tuple[str, Call]]) -> dict[str, float]:
    out, before = {}, opened
    for name, c in stamps:
        out[name] = c.ms - before
        before = c.ms
    out["total: gate opened to next COMMAND's exec"] = before - opened
    return out


def _phases(opened: float, marks: dict[str, Call]) -> dict[str, float]:
    out, before = {}, opened
    for name, mark in PHASES:
        out["phase: " + name] = marks[mark].ms - before
        before = marks[mark].ms
    return out


def etcd_stages(runs: int) -> dict[str, Any] | None:
    """Medians of ``runs`` hand-overs of each, alternating; None without etcd, etcdctl or strace."""
    if ETCD is None or ETCDCTL is None or not trace.usable():
        return None
    samples: dict[str, dict[str, list[float]]] = {PEARING: {}, ETCDCTL_LOCK: {}}
    tools = ((PEARING, pearing), (ETCDCTL_LOCK, etcdctl))
    with tempfile.TemporaryDirectory(prefix="pearing-stages-etcd-") as t, etcd_member(Path(t) / "data") as url:
        assert url is not None
        warm = 1 if runs > 1 else 0  # the cluster's first requests (and the page cache's) are slower
        for i in range(warm + runs):
            for name, fn in tools if i % 2 == 0 else tools[::-1]:
                d = Path(tempfile.mkdtemp(dir=t, prefix=f"{name[0]}{i}-"))
                stamps = fn(d, env(d / "lockdir"), url, f"st{name[0]}{i}")
                if i >= warm:
                    for stage, ms in stamps.items():
                        samples[name].setdefault(stage, []).append(ms)
    med = {name: {k: statistics.median(v) for k, v in s.items()} for name, s in samples.items()}
    side = {
        k.removeprefix("phase: "): {PEARING: med[PEARING][k], ETCDCTL_LOCK: med[ETCDCTL_LOCK][k]}
        for k in med[PEARING]
        if k.startswith("phase: ")
    }
    for v in side.values():
        v["extra"] = v[PEARING] - v[ETCDCTL_LOCK]
    strip = {name: {k: v for k, v in m.items() if not k.startswith("phase: ")} for name, m in med.items()}
    return {**strip, "side by side": side, "runs": runs}


def table(result: dict[str, Any]) -> list[str]:
    lines = [f"etcd hand-over (one member, loopback; strace, medians of {result['runs']} runs, ms):"]
    for name in (PEARING, ETCDCTL_LOCK):
        lines.append(f"  {name}:")
        lines += [f"    {ms:7.1f}  {stage}" for stage, ms in result[name].items() if stage != REQUESTS]
        lines.append(f"    {result[name][REQUESTS]:7.0f}  {REQUESTS.removeprefix('(aside) ')}")
    lines.append(f"  side by side:\n    {PEARING:>11} {ETCDCTL_LOCK:>12} {'extra':>7}  phase")
    for phase, v in result["side by side"].items():
        lines.append(f"    {v[PEARING]:11.1f} {v[ETCDCTL_LOCK]:12.1f} {v['extra']:+7.1f}  {phase}")
    return lines
