"""Who owns a ``Lock``: the process that entered it, and only while it lives.

A forked child never releases its parent's lock; a process that dies (or is interrupted)
while it waits leaves the line, and one that dies holding frees the lock at once, whatever
its lease. Each scenario runs in a real Python process started through ``procs`` (so on the
test's backend and lock dir, and reaped at the end); intervals are CLOCK_MONOTONIC stamps
in one log shared with a ``pearing-run`` contender.
"""

from __future__ import annotations

import itertools
import json
import os
import signal
import sys
import textwrap
import time
import uuid
from pathlib import Path
from typing import Any

import pytest
from helpers import PEARING_CLI, Gate, Procs, lock_status, q, signal_disposition, wait_for

from singleflight.core.const import ExitCode

INTERVAL_CMD = str(Path(__file__).with_name("interval_cmd.py"))
# Long enough that a lock kept by an orphan would outlast every test: only its owner's
# going can free it in time.
LONG_LEASE = 3600

PRELUDE = """
import json, os, subprocess, sys, time
sys.path.insert(0, {tests!r})
from interval_cmd import note
from singleflight import Busy, LeaseLost, Lock

def say(**kw):
    print(json.dumps(kw), flush=True)
"""


def script(body: str) -> list[str]:
    code = PRELUDE.format(tests=str(Path(__file__).parent)) + textwrap.dedent(body)
    return [sys.executable, "-c", code]


def facts(out: bytes) -> list[dict[str, Any]]:
    return [json.loads(line) for line in out.decode().splitlines() if line.startswith("{")]


def intervals(log: Path) -> dict[str, tuple[float, float]]:
    """NAME -> (start, end) from interval_cmd's lines; every interval must be closed."""
    starts: dict[str, float] = {}
    out: dict[str, tuple[float, float]] = {}
    for line in log.read_text().splitlines():
        name, what, stamp = line.split()
        if what == "start":
            starts[name] = float(stamp)
        else:
            out[name] = (starts.pop(name), float(stamp))
    assert not starts, f"intervals never closed: {starts}"
    return out


def assert_no_overlap(spans: dict[str, tuple[float, float]]) -> None:
    ordered = sorted(spans.items(), key=lambda kv: kv[1][0])
    for (a, (_, a_end)), (b, (b_start, _)) in itertools.pairwise(ordered):
        assert a_end <= b_start, f"{a} and {b} held the lock at once: {spans}"


def contender(procs: Procs, work: Path, log: Path) -> Any:
    """A pearing-run that waits for the lock, records its fence, then its interval."""
    fences = work / "fences"
    record = f"exec {q(sys.executable)} {q(INTERVAL_CMD)} {q(log)} contender 0.2"
    cmd = f"echo contender $PEARING_FENCE >> {q(fences)}; {record}"
    return procs.pr("--job", "J", "--wait-seconds", "30", "--", "sh", "-c", cmd)


# -- 1. a forked child's exit is not its parent's ---------------------------------------------


@pytest.mark.parametrize("child", ["sys-exit", "os-exit", "outlives-the-block"])
def test_a_forked_child_leaving_the_block_does_not_release_the_parents_lock(
    backend: str, procs: Procs, work: Path, child: str
) -> None:
    log, fences, go = work / "log", work / "fences", work / "go"
    parent = procs.start(
        script(f"""
            child = {child!r}
            with Lock("J", lease_seconds=5, wait_seconds=30) as held:
                note({str(log)!r}, "parent", "start")
                open({str(fences)!r}, "a").write(f"parent {{held.fence}}\\n")
                say(entered=True)
                while not os.path.exists({str(go)!r}):
                    time.sleep(0.01)
                pid = os.fork()
                if pid == 0:
                    if child == "sys-exit":
                        sys.exit(0)  # unwinds the with in the child: its __exit__ runs there
                    if child == "os-exit":
                        os._exit(0)
                    time.sleep(4)  # past the parent's block
                    os._exit(0)
                if child != "outlives-the-block":
                    os.waitpid(pid, 0)
                time.sleep(2)  # the parent's own work, still inside its block
                held.heartbeat()  # still ours: the child's exit gave nothing away
                note({str(log)!r}, "parent", "end")
            say(left=True)
        """)
    )
    assert parent.stdout is not None
    assert json.loads(parent.stdout.readline()) == {"entered": True}
    rival = contender(procs, work, log)
    wait_for(lambda: lock_status(procs, "J")["waiters"], 15, "the contender to queue")
    go.touch()
    r = procs.finish(parent, timeout=60)
    assert r.returncode == 0, r
    assert facts(r.stdout) == [{"left": True}]
    assert procs.finish(rival, timeout=60).returncode == 0
    assert_no_overlap(intervals(log))
    order = [line.split() for line in fences.read_text().splitlines()]
    assert [who for who, _ in order] == ["parent", "contender"], order
    assert int(order[0][1]) < int(order[1][1]), order


# -- 2. an owner that is gone takes its ticket with it ----------------------------------------


def _held_gate(procs: Procs, work: Path) -> tuple[Gate, Any]:
    gate = Gate(work)
    holder = procs.pr("--job", "J", "--", "sh", "-c", gate.script())
    gate.wait_ready()
    return gate, holder


def _waiter(procs: Procs) -> Any:
    return procs.start(
        script(f"""
            import signal
            # ^C as in a terminal: started from a shell's background job (no job control), as a
            # test run may be, a process inherits SIGINT ignored and Python leaves it so.
            signal.signal(signal.SIGINT, signal.default_int_handler)
            try:
                with Lock("J", lease_seconds={LONG_LEASE}, wait_seconds=30):
                    say(ran=True)
            except KeyboardInterrupt:
                say(interrupted=True)
        """)
    )


def _free_soon(procs: Procs) -> None:
    """Nobody holds the lock within a couple of seconds: a run that does not wait gets it."""
    wait_for(lambda: lock_status(procs, "J")["holder"] is None, 5, "the lock to be free")
    r = procs.pr_run("--job", "J", "--", "true")
    assert r.returncode == 0, r


@pytest.mark.parametrize("how", ["kill-9", "keyboard-interrupt"])
def test_a_waiter_that_dies_or_is_interrupted_leaves_the_line(backend: str, procs: Procs, work: Path, how: str) -> None:
    gate, holder = _held_gate(procs, work)
    waiter = _waiter(procs)

    # In line and its agent's: an owner gone before its agent is spawned is another test's
    # subject (test_mcp_owners.py, test_an_owner_gone_before_its_agent_starts_leaves_no_ticket_behind).
    def adopted() -> bool:
        waiters = lock_status(procs, "J")["waiters"]
        return bool(waiters) and waiters[0].get("holder_pid") not in (None, waiter.pid)

    wait_for(adopted, 15, "the Lock's agent to queue")
    if how == "keyboard-interrupt":
        assert signal_disposition(waiter.pid, signal.SIGINT) == "caught"
    os.kill(waiter.pid, signal.SIGKILL if how == "kill-9" else signal.SIGINT)
    r = procs.finish(waiter, timeout=30)
    if how == "kill-9":
        assert r.returncode == -signal.SIGKILL, r
    else:
        assert r.returncode == 0 and facts(r.stdout) == [{"interrupted": True}], r
    # Its agent leaves the line within a second or so, long before any lease would lapse.
    wait_for(lambda: not lock_status(procs, "J")["waiters"], 5, "the orphaned waiter to leave the line")
    gate.open()
    assert procs.finish(holder).returncode == 0
    _free_soon(procs)


def test_a_holder_killed_inside_its_block_frees_the_lock_at_once(backend: str, procs: Procs, work: Path) -> None:
    p = procs.start(
        script(f"""
            with Lock("J", lease_seconds={LONG_LEASE}) as held:
                say(entered=True)
                time.sleep(600)
        """)
    )
    assert p.stdout is not None
    assert json.loads(p.stdout.readline()) == {"entered": True}
    p.kill()
    assert procs.finish(p).returncode == -signal.SIGKILL
    _free_soon(procs)


# -- 3. back to back ----------------------------------------------------------------------------


def test_back_to_back_blocks_all_hold_with_rising_fences(backend: str, procs: Procs) -> None:
    r = procs.run(
        script("""
            for _ in range(15):
                with Lock("J", lease_seconds=30) as held:
                    say(fence=held.fence)
        """),
        timeout=240,
    )
    assert r.returncode == 0, r
    fences = [f["fence"] for f in facts(r.stdout)]
    assert len(fences) == 15
    assert all(a < b for a, b in itertools.pairwise(fences)), fences


def test_a_block_right_after_a_locks_first_hand_over_holds(backend: str, procs: Procs) -> None:
    # A lock's first release tidies up at once (later ones once a minute): a new ticket that
    # read as its creator's dead (no start time) was cancelled then, before its agent took it.
    r = procs.run(
        script("""
            for i in range(20):
                for _ in range(2):
                    with Lock(f"J-{i}", lease_seconds=30) as held:
                        say(round=i, fence=held.fence)
        """),
        timeout=240,
    )
    assert r.returncode == 0, r
    seen = facts(r.stdout)
    assert [f["round"] for f in seen] == [i for i in range(20) for _ in range(2)]
    assert all(a["fence"] < b["fence"] for a, b in zip(seen[::2], seen[1::2], strict=True)), seen


def test_cli_acquire_right_after_a_release_holds(backend: str, procs: Procs) -> None:
    for i in range(5):  # the race (11 of 40 rounds on the old code) shows within a few
        last = 0
        for _ in range(2):
            args = ["acquire-lock", f"J-{i}", "--request-uuid", str(uuid.uuid4()), "--lease-seconds", "30"]
            r = procs.run_text([PEARING_CLI, *args])
            assert r.returncode == 0, r
            ticket = r.json
            assert ticket["state"] == "held" and ticket["fence"] > last, ticket
            last = ticket["fence"]
            rel = procs.run_text([PEARING_CLI, "release-lock-ticket", f"J-{i}", ticket["ticket_id"]])
            assert rel.returncode == 0 and rel.json["state"] == "released", rel


# -- a Lock object, entered again ---------------------------------------------------------------


def test_a_lock_object_can_be_entered_again(backend: str, procs: Procs) -> None:
    r = procs.run(
        script("""
            lock = Lock("J", lease_seconds=30)
            for _ in range(3):
                with lock as held:
                    say(fence=held.fence, ticket=held.ticket_id, uuid=lock.request_uuid)
        """),
        timeout=60,
    )
    assert r.returncode == 0, r
    seen = facts(r.stdout)
    assert len(seen) == 3
    assert seen[0]["fence"] < seen[1]["fence"] < seen[2]["fence"]
    assert len({f["ticket"] for f in seen}) == len({f["uuid"] for f in seen}) == 3


def test_a_second_block_of_the_same_request_never_runs_and_says_why_once(backend: str, procs: Procs) -> None:
    r = procs.run(
        script(f"""
            from singleflight.core.errors import NotHeld
            lock = Lock("J", request_uuid={str(uuid.uuid4())!r}, lease_seconds=30)
            with lock as held:
                say(ran=held.ticket_id)
            try:
                with lock:
                    say(ran_again=True)
            except NotHeld as exc:
                say(refused=str(exc), code=int(exc.exit_code))
        """),
        timeout=60,
    )
    assert r.returncode == 0, r
    ran, refused = facts(r.stdout)
    ticket = ran["ran"]
    assert refused["code"] == ExitCode.REFUSED
    assert refused["refused"].startswith(f"ticket {ticket}: released"), refused
    assert refused["refused"].count(f"ticket {ticket}") == 1, refused


def test_an_ended_request_is_named_once_by_the_cli(backend: str, procs: Procs) -> None:
    request = str(uuid.uuid4())
    args = [PEARING_CLI, "acquire-lock", "J", "--request-uuid", request, "--lease-seconds", "30"]
    ticket = procs.run_text(args).json
    assert procs.run_text([PEARING_CLI, "release-lock-ticket", "J", ticket["ticket_id"]]).returncode == 0
    r = procs.run_text(args)
    assert r.returncode == ExitCode.REFUSED, r
    line = r.one_line()
    assert line.count(f"ticket {ticket['ticket_id']}") == 1, line
    assert f"ticket {ticket['ticket_id']}: released" in line, line


def test_a_retry_after_busy_resumes_the_kept_ticket_and_enters_once_promoted(
    backend: str, procs: Procs, work: Path
) -> None:
    gate, holder = _held_gate(procs, work)
    go = work / "go"
    p = procs.start(
        script(f"""
            lock = Lock("J", request_uuid={str(uuid.uuid4())!r}, lease_seconds=30, wait_seconds=0.5)
            try:
                with lock:
                    say(ran_early=True)
            except Busy as exc:
                say(busy=exc.ticket["ticket_id"], kept=exc.kept)
            while not os.path.exists({str(go)!r}):
                time.sleep(0.01)
            lock.wait_seconds = 30
            with lock as held:
                say(held=held.ticket_id, promoted=held.promoted)
        """)
    )
    assert p.stdout is not None
    busy = json.loads(p.stdout.readline())
    assert busy["kept"] is True, busy
    # Kept in line while its owner lives, past the wait that ran out.
    assert [w["ticket_id"] for w in lock_status(procs, "J")["waiters"]] == [busy["busy"]]
    go.touch()
    gate.open()
    assert procs.finish(holder).returncode == 0
    r = procs.finish(p, timeout=60)
    assert r.returncode == 0, r
    assert facts(r.stdout) == [{"held": busy["busy"], "promoted": True}]


# -- 4. an agent that starts late -------------------------------------------------------------


def _stopped_agents(marker: bytes) -> list[int]:
    """This test's agents (its marker in their environment) stopped at a pause point."""
    out = []
    for d in Path("/proc").iterdir():
        if d.name.isdigit():
            try:
                cmd, env = (d / "cmdline").read_bytes(), (d / "environ").read_bytes()
                state = (d / "stat").read_text().rpartition(")")[2].split()[0]
            except OSError:
                continue
            if b"singleflight.agent" in cmd and marker in env.split(b"\0") and state == "T":
                out.append(int(d.name))
    return out


def test_a_waiter_whose_agent_starts_late_keeps_its_place(backend: str, procs: Procs, work: Path) -> None:
    """A busy machine may start the agent after the waiting ticket's own lease has run out (a
    3 s lease at a load of 8 lost its place that way): its owner is here and waiting, so the
    ticket is its to keep while the agent starts, not cancelled for want of a heartbeat.
    The agent is frozen right before it daemonises (a pause point) for twice the lease: its
    owner, which waited for that first process to exit, must heartbeat meanwhile."""
    gate, holder = _held_gate(procs, work)
    waiter = procs.start(
        script("""
            with Lock("J", lease_seconds=2, wait_seconds=60) as held:
                say(fence=held.fence)
        """),
        env={**procs.env, "PEARING_FAULT": "pause-agent-start"},
    )
    agent = wait_for(lambda: _stopped_agents(procs.marker)[:1], 15, "the agent to stop at its start")[0]
    stopped_at = time.monotonic()
    wait_for(lambda: time.monotonic() - stopped_at >= 4, 10, "twice the lease to pass")
    os.kill(agent, signal.SIGCONT)
    wait_for(lambda: lock_status(procs, "J")["waiters"], 15, "the late agent to queue")
    gate.open()
    assert procs.finish(holder).returncode == 0
    r = procs.finish(waiter, timeout=30)
    assert r.returncode == 0, r
    assert [f["fence"] > 0 for f in facts(r.stdout)] == [True], r


def test_an_owner_killed_before_its_agent_is_in_line_leaves_no_ticket_behind(
    backend: str, procs: Procs, work: Path
) -> None:
    """The Lock's owner dies while its agent is still starting (frozen right before it
    daemonises): once the agent runs, it finds its owner gone and ends the ticket within a
    second or so, not when a lease runs out (an hour here). It never takes the lock."""
    gate, holder = _held_gate(procs, work)
    waiter = procs.start(
        script(f"""
            with Lock("J", lease_seconds={LONG_LEASE}, wait_seconds=30):
                say(ran=True)
        """),
        env={**procs.env, "PEARING_FAULT": "pause-agent-start"},
    )
    agent = wait_for(lambda: _stopped_agents(procs.marker)[:1], 15, "the agent to stop at its start")[0]
    assert lock_status(procs, "J")["waiters"], "the ticket is in line before its agent runs"
    waiter.kill()
    assert procs.finish(waiter).returncode == -signal.SIGKILL
    os.kill(agent, signal.SIGCONT)
    resumed = time.monotonic()

    def no_ticket_left() -> bool:
        st = lock_status(procs, "J")
        return not st["waiters"] and st["holder"] is not None and st["holder"]["ticket_id"] != ""

    wait_for(no_ticket_left, 15, "the orphaned ticket to leave the line")
    took = time.monotonic() - resumed
    gate.open()
    assert procs.finish(holder).returncode == 0
    _free_soon(procs)
    assert took < 5.0, f"the agent took {took:.1f} s to end its orphaned ticket"


def test_a_waiter_promoted_as_its_wait_runs_out_holds_with_its_token(backend: str, procs: Procs, work: Path) -> None:
    """The agent took the lock right as its owner's wait ran out, and tells it a moment later
    (frozen at a pause point between the two): the block runs under its fence, never a
    ``NotHeld: held`` with the lock then let go for nobody."""
    gate, holder = _held_gate(procs, work)
    waiter = procs.start(
        script("""
            with Lock("J", lease_seconds=30, wait_seconds=2) as held:
                say(fence=held.fence, token=bool(held.token_file) and os.path.exists(held.token_file))
        """),
        env={**procs.env, "PEARING_FAULT": "pause-agent-ready"},
    )
    wait_for(lambda: lock_status(procs, "J")["waiters"], 15, "the Lock to queue")
    gate.open()
    assert procs.finish(holder).returncode == 0
    agent = wait_for(lambda: _stopped_agents(procs.marker)[:1], 15, "the agent to stop before it says ready")[0]
    stopped_at = time.monotonic()
    wait_for(lambda: time.monotonic() - stopped_at >= 3, 10, "the owner's wait to run out")
    os.kill(agent, signal.SIGCONT)
    r = procs.finish(waiter, timeout=30)
    assert r.returncode == 0, r
    out = facts(r.stdout)
    assert len(out) == 1 and out[0]["fence"] > 0 and out[0]["token"], r
