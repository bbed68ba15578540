"""--max-waiting N: a bounded line. A newcomer that would make more than N waiters is turned away
at once (busy), on every front end; the ones already in line keep their places and run."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path

import anyio
import pytest
from helpers import PEARING_CLI, Gate, Procs, proc_state, q, wait_for, wait_queued
from test_mcp import serve, server_args  # noqa: F401 - server_args is a fixture

from singleflight.core.const import ENV_FAULT, ExitCode


def _ran(path: Path) -> list[str]:
    return path.read_text().split() if path.exists() else []


def _mark(path: Path, name: str) -> list[str]:
    return ["sh", "-c", f"echo {name} >> {q(path)}"]


def test_the_next_newcomer_past_the_bound_is_busy_at_once_and_the_waiter_still_runs(
    backend: str, procs: Procs, work: Path
) -> None:
    ran = work / "ran"
    gate = Gate(work)
    holder = procs.pr("--job", "J", "--", "sh", "-c", gate.script())
    gate.wait_ready()
    waiter = procs.pr("--job", "J", "--wait-seconds", "60", "--max-waiting", "1", "--", *_mark(ran, "waiter"))
    wait_queued(procs, "J", 1)
    late = procs.pr_run("-v", "--job", "J", "--wait-seconds", "60", "--max-waiting", "1", "--", *_mark(ran, "late"))
    assert late.returncode == ExitCode.BUSY, late
    assert late.elapsed < 2.0, late
    [line] = [x for x in late.err_lines if " busy " in x]
    assert "reason=line full: 1 waiting, at most 1 may wait" in line, late
    # --busy-exit-code holds for a full line as for any busy skip.
    other = procs.pr_run(
        "--job", "J", "--wait-seconds", "60", "--max-waiting", "1", "--busy-exit-code", "3", "--", "true"
    )
    assert other.returncode == 3, other
    assert [w["queue_position"] for w in _status(procs, "J")["waiters"]] == [1]
    gate.open()
    assert procs.finish(holder).returncode == 0
    assert procs.finish(waiter, timeout=60).returncode == 0
    assert _ran(ran) == ["waiter"]


def test_zero_waits_for_nobody_and_a_free_lock_is_still_taken(backend: str, procs: Procs, work: Path) -> None:
    ran = work / "ran"
    free = procs.pr_run("--job", "J", "--wait-seconds", "60", "--max-waiting", "0", "--", *_mark(ran, "free"))
    assert free.returncode == 0, free
    gate = Gate(work)
    holder = procs.pr("--job", "J", "--", "sh", "-c", gate.script())
    gate.wait_ready()
    held = procs.pr_run("--job", "J", "--wait-seconds", "60", "--max-waiting", "0", "--", *_mark(ran, "held"))
    assert held.returncode == ExitCode.BUSY and held.elapsed < 2.0, held
    # Without a bound the same run waits, so the bound is what turned it away.
    waiter = procs.pr("--job", "J", "--wait-seconds", "60", "--", *_mark(ran, "unbounded"))
    wait_queued(procs, "J", 1)
    gate.open()
    assert procs.finish(holder).returncode == 0
    assert procs.finish(waiter, timeout=60).returncode == 0
    assert _ran(ran) == ["free", "unbounded"]


@pytest.mark.parametrize("bound", [1, 3])
def test_newcomers_arriving_together_never_pass_the_bound(backend: str, procs: Procs, work: Path, bound: int) -> None:
    """Eight runs start at once behind a holder: exactly ``bound`` of them wait (and run), the
    others are busy at once. (A newcomer's key may show in line for a moment on etcd, joined
    and counted before it leaves: what counts is who stays, and who runs.)"""
    ran = work / "ran"
    gate = Gate(work)
    holder = procs.pr("--job", "J", "--", "sh", "-c", gate.script())
    gate.wait_ready()
    flags = ("-v", "--job", "J", "--wait-seconds", "60", "--max-waiting", str(bound), "--")
    runs = [procs.pr(*flags, *_mark(ran, f"r{i}")) for i in range(8)]

    def settled() -> bool:
        return sum(p.poll() is not None for p in runs) >= len(runs) - bound

    why = ""
    try:
        wait_for(settled, 30, f"{len(runs) - bound} turned away")
    except pytest.fail.Exception as exc:
        why = f"{exc}\n{_what_they_do(procs, runs)}"  # one more waiter than the bound, or one stuck?
    if why:
        pytest.fail(why)
    assert len(_status(procs, "J")["waiters"]) == bound  # type: ignore[arg-type]
    busy = [r for r in runs if r.poll() is not None]
    assert all(r.returncode == ExitCode.BUSY for r in busy), [r.returncode for r in busy]
    gate.open()
    assert procs.finish(holder).returncode == 0
    for r in runs:
        procs.finish(r, timeout=60)
    assert len(_ran(ran)) == bound, _ran(ran)


@pytest.mark.local_only("a queue entry's deadline is the lock dir's (an etcd key in line lives on its lease)")
def test_a_run_just_in_line_counts_and_keeps_its_turn_before_its_wait_begins(procs: Procs, work: Path) -> None:
    """A run stopped right after it joined the line (``pause-queued``), before its wait's first
    pass: newcomers count it against --max-waiting, and it keeps its place. (Its entry was once
    published with the deadline of a ticket not yet written, 0: stale to everyone until that
    first pass, so under load a newcomer got in past the bound, or ahead of it.)"""
    ran = work / "ran"
    gate = Gate(work)
    holder = procs.pr("--job", "J", "--", "sh", "-c", gate.script())
    gate.wait_ready()
    flags = ("--job", "J", "--wait-seconds", "60")
    first = procs.pr(
        *flags, "--max-waiting", "1", "--", *_mark(ran, "first"), env={**procs.env, ENV_FAULT: "pause-queued"}
    )
    wait_for(lambda: proc_state(first.pid) == "T", 15, "the first run to stop just in line")
    late = procs.pr_run("-v", *flags, "--max-waiting", "1", "--", *_mark(ran, "late"))
    assert late.returncode == ExitCode.BUSY and late.elapsed < 2.0, late
    assert any("reason=line full: 1 waiting, at most 1 may wait" in x for x in late.err_lines), late
    later = procs.pr(*flags, "--", *_mark(ran, "later"))  # no bound: it waits behind the first
    wait_queued(procs, "J", 2)
    os.kill(first.pid, signal.SIGCONT)
    gate.open()
    assert procs.finish(holder).returncode == 0
    assert procs.finish(first, timeout=60).returncode == 0
    assert procs.finish(later, timeout=60).returncode == 0
    assert _ran(ran) == ["first", "later"]


def test_acquire_lock_and_lock_are_turned_away_with_the_ticket_saying_why(
    backend: str, procs: Procs, work: Path
) -> None:
    gate = Gate(work)
    holder = procs.pr("--job", "J", "--", "sh", "-c", gate.script())
    gate.wait_ready()
    waiter = procs.pr("--job", "J", "--wait-seconds", "60", "--", "true")
    wait_queued(procs, "J", 1)
    acquire = [PEARING_CLI, "acquire-lock", "J", "--wait-seconds", "30", "--max-waiting", "1"]
    cli = procs.run_text([*acquire, "--request-uuid", str(uuid.uuid4())])
    assert cli.returncode == ExitCode.BUSY and cli.elapsed < 5.0, cli
    assert (cli.json["state"], cli.json["end_reason"]) == ("cancelled", "line full"), cli
    # A bound the line is within: the ticket queues as without one.
    roomy = procs.run_text(
        [PEARING_CLI, "acquire-lock", "J", "--max-waiting", "2", "--request-uuid", str(uuid.uuid4())]
    )
    assert roomy.returncode == ExitCode.BUSY and roomy.json["state"] == "waiting", roomy
    procs.run_text([PEARING_CLI, "release-lock-ticket", "J", roomy.json["ticket_id"]])
    code = (
        "from singleflight import Busy, Lock\n"
        "try:\n"
        "    with Lock('J', wait_seconds=30, max_waiting=1):\n"
        "        print('entered')\n"
        "except Busy as exc:\n"
        "    print('busy', exc.ticket['state'], exc.ticket['end_reason'].replace(' ', '-'), exc.kept)\n"
    )
    lock = procs.run([sys.executable, "-c", code])
    assert lock.stdout.split() == [b"busy", b"cancelled", b"line-full", b"False"], lock
    assert lock.elapsed < 5.0, lock
    gate.open()
    assert procs.finish(holder).returncode == 0
    assert procs.finish(waiter, timeout=60).returncode == 0


@pytest.mark.anyio
@pytest.mark.parametrize("anyio_backend", ["asyncio"])
async def test_mcp_acquire_lock_takes_max_waiting(
    backend: str,
    procs: Procs,
    work: Path,
    server_args: list[str],  # noqa: F811
    tmp_path: Path,
) -> None:
    gate = Gate(work)
    holder = procs.pr("--job", "J", "--", "sh", "-c", gate.script())
    gate.wait_ready()
    agents: set[int] = set()
    async with serve(tmp_path, agents, *server_args) as c:
        args = {"repo": "default", "lock_name": "J", "wait_seconds": 30}
        first = await c.call("acquire_lock", request_uuid=str(uuid.uuid4()), max_waiting=0, **args)
        assert (first["state"], first["end_reason"]) == ("cancelled", "line full"), first
        with anyio.fail_after(10):
            message = await c.error("acquire_lock", request_uuid=str(uuid.uuid4()), max_waiting=-1, **args)
        assert "bad max_waiting -1: must be an integer from 0 to 10000 in ASCII digits" in message, message
    gate.open()
    assert procs.finish(holder).returncode == 0


def _what_they_do(procs: Procs, runs: list[subprocess.Popen[bytes]]) -> str:
    """Why a line did not settle (a waiter past the bound, or a run that never left): each run's
    state and what it said so far, the queue dir's entries with the deadlines in them (lock dir),
    and the waiters ``status`` lists."""
    lines = []
    for i, r in enumerate(runs):
        said = b""
        if r.stderr is not None:  # what it said so far, without waiting for more
            os.set_blocking(r.stderr.fileno(), False)
            with contextlib.suppress(OSError, TypeError):
                said = r.stderr.read() or b""
            os.set_blocking(r.stderr.fileno(), True)
        where = ""
        if r.poll() is None:
            with contextlib.suppress(OSError):
                where = f" state={proc_state(r.pid)} wchan={Path(f'/proc/{r.pid}/wchan').read_text()}"
        lines.append(f"r{i} pid={r.pid} exit={r.poll()}{where} stderr={said.decode(errors='replace').strip()!r}")
    qdir = procs.lock_dir / "locks" / "default" / "@J" / "queue"
    if qdir.is_dir():
        lines.append(f"queue dir at monotonic {time.monotonic():.6f}:")
        for entry in sorted(qdir.iterdir()):
            with contextlib.suppress(OSError):
                lines.append(f"  {entry.name}: {entry.read_text().strip()!r}")
    with contextlib.suppress(Exception):
        waiters: list[dict[str, object]] = _status(procs, "J")["waiters"]  # type: ignore[assignment]
        lines.append(f"status waiters (pid, position): {[(w['holder_pid'], w['queue_position']) for w in waiters]}")
    return "\n".join(lines)


def _status(procs: Procs, job: str) -> dict[str, object]:
    out = procs.run_text([PEARING_CLI, "status", job, "--json"])
    locks = json.loads(out.stdout or "[]")
    return dict(locks[0]) if locks else {"waiters": []}
