"""Never two COMMANDs, never a stuck lock, under the faults a real machine or a hostile user produces.

Each COMMAND logs ``start`` and ``end`` lines with CLOCK_MONOTONIC stamps (shared by every process
of the host), so overlaps are measured, not argued.
"""

from __future__ import annotations

import contextlib
import json
import os
import pty
import select
import signal
import subprocess
import sys
import time
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
from caps import Caps
from helpers import (
    PEARING_CLI,
    PEARING_GUARD,
    PEARING_RUN,
    Gate,
    Procs,
    holder_pid,
    lock_status,
    proc_state,
    q,
    ticket_records,
    wait_for,
    wait_queued,
)

from singleflight.core.const import ExitCode

INTERVAL_CMD = str(Path(__file__).with_name("interval_cmd.py"))


def logged(log: Path, name: str, *, seconds: float = 30.0, trap: float = 0.0) -> list[str]:
    """A COMMAND logging "NAME start T" / "NAME end T"; on SIGTERM it takes ``trap`` s to exit."""
    return [sys.executable, INTERVAL_CMD, str(log), name, str(seconds), str(trap)]


# Runs its arguments with fds 0-2 closed, as a daemon or a supervisor may.
CLOSED_STDIO = ["sh", "-c", 'exec "$0" "$@" <&- >&- 2>&-']


def intervals(log: Path) -> dict[str, tuple[float, float | None]]:
    out: dict[str, list[float | None]] = {}
    for line in log.read_text().splitlines():
        name, what, stamp = line.split()
        out.setdefault(name, [None, None])[0 if what == "start" else 1] = float(stamp)
    return {k: (v[0] or 0.0, v[1]) for k, v in out.items()}


def started(log: Path, name: str) -> bool:
    return log.exists() and f"{name} start" in log.read_text()


def test_started_with_stdio_closed_the_holder_keeps_the_lock(backend: str, procs: Procs, work: Path) -> None:
    log = work / "log"
    # A daemon or supervisor that closes fds 0-2: the lock file must not land on them.
    a = procs.start(
        ["sh", "-c", 'exec "$0" "$@" <&- >&- 2>&-', PEARING_RUN, "--job", "c", "--", *logged(log, "A", seconds=3)],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    wait_for(lambda: started(log, "A"), 15, "A to start")
    b = procs.pr_run("--job", "c", "--", *logged(log, "B", seconds=0))
    assert b.returncode == ExitCode.BUSY, b
    assert procs.finish(a).returncode == 0
    assert not started(log, "B")
    # The holder's fds are above 2 and 0-2 are /dev/null.
    assert procs.pr_run("--job", "c", "--", "true").returncode == 0


def test_a_run_that_waits_with_stdio_closed_takes_its_turn_and_nobody_runs_beside_it(
    backend: str, procs: Procs, work: Path
) -> None:
    """Closed fds 0-2 on a run that has to wait: its channel to the holder it forks as it starts
    to wait (a socketpair and a pipe) must not land on 0-2, and the hand-over (on the lock dir,
    the flocked fd passed over that socketpair) must still hold."""
    log = work / "log"
    gate = Gate(work)
    a = procs.pr("--job", "cw", "--", "sh", "-c", gate.script())
    gate.wait_ready()
    b = procs.start(
        [*CLOSED_STDIO, PEARING_RUN, "--job", "cw", "--wait-seconds", "60", "--", *logged(log, "B", seconds=0.5)],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    wait_for(lambda: _waiters(procs, "cw") == 1, 15, "B to queue")
    assert procs.pr_run("--job", "cw", "--", "true").returncode == ExitCode.BUSY
    gate.open()
    assert procs.finish(a).returncode == 0
    assert b.wait(30) == 0
    assert intervals(log)["B"][1] is not None
    assert procs.pr_run("--job", "cw", "--", "true").returncode == 0


def test_holder_fds_live_above_2_when_stdio_was_closed(procs: Procs, work: Path) -> None:
    gate = Gate(work)
    p = procs.start(
        ["sh", "-c", 'exec "$0" "$@" <&- >&- 2>&-', PEARING_RUN, "--job", "c", "--", "sh", "-c", gate.script()],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    gate.wait_ready()
    pid = holder_pid(procs, "c", p.pid)
    fds = {int(n): os.readlink(f"/proc/{pid}/fd/{n}") for n in os.listdir(f"/proc/{pid}/fd")}
    assert all(fds[n] == "/dev/null" for n in (0, 1, 2)), fds
    assert any(target.endswith("/@c/lock") for n, target in fds.items() if n > 2), fds
    gate.open()
    assert procs.finish(p).returncode == 0


def test_a_frozen_holder_woken_after_its_lease_never_lets_two_commands_run(
    caps: Caps, procs: Procs, work: Path
) -> None:
    log = work / "log"
    a = procs.pr(
        "--job", "f", "--lease-seconds", "2", "--kill-grace", "5", "--",
        *logged(log, "A", seconds=8, trap=2),
    )  # fmt: skip
    wait_for(lambda: started(log, "A"), 15, "A to start")
    pid = holder_pid(procs, "f", a.pid)
    b = procs.pr("--job", "f", "--wait-seconds", "40", "--", *logged(log, "B", seconds=0))
    os.kill(pid, signal.SIGSTOP)
    try:
        frozen_until = time.monotonic() + 4.0  # twice the lease
        wait_for(lambda: time.monotonic() >= frozen_until, 10, "the holder to stay frozen past its lease")
        assert not started(log, "B"), "B started while A's holder was frozen"
    finally:
        os.kill(pid, signal.SIGCONT)
    ra, rb = procs.finish(a, timeout=60), procs.finish(b, timeout=60)
    assert rb.returncode == 0, rb
    spans = intervals(log)
    a_end = spans["A"][1]
    assert a_end is not None and spans["B"][0] >= a_end, spans
    if not caps.wrapper_renews_lease:
        # Woken past its lease, the holder loses it the proper way: TERM, grace, then release.
        assert ra.returncode == ExitCode.LEASE_LOST, ra
    else:
        # The wrapper kept the lease alive (etcd): the lease was never lost.
        assert ra.returncode in (0, ExitCode.LEASE_LOST), ra


def _paused_child(parent: int) -> int | None:
    """A child of ``parent`` that is stopped (a holder paused by PEARING_FAULT=pause-holder-start)."""
    for name in os.listdir("/proc"):
        if name.isdigit():
            with contextlib.suppress(OSError, ValueError):
                data = Path(f"/proc/{name}/stat").read_bytes()
                fields = data[data.rindex(b")") + 2 :].split()
                if int(fields[1]) == parent and fields[0] == b"T":
                    return int(name)
    return None


def _waiters(procs: Procs, job: str) -> int:
    locks = procs.run_text([PEARING_CLI, "status", job, "--json"]).json
    return len(locks[0]["waiters"]) if locks else 0


def test_a_wrapper_killed_right_after_starting_command_keeps_the_lock_until_command_ends(
    backend: str, procs: Procs, work: Path, env: dict[str, str]
) -> None:
    """kill -9 of pearing-run between COMMAND's spawn and telling its holder the pid. The holder
    used to see EOF with no COMMAND known and release at once: B ran beside A. It now finds
    COMMAND by the ticket in its environment and keeps the lock until COMMAND ends."""
    log = work / "log"
    armed = dict(env, PEARING_FAULT="after-command-spawn")
    # Not through pipes: reading them to EOF would wait for COMMAND, which inherits them.
    quiet = {"stdout": subprocess.DEVNULL, "stderr": subprocess.DEVNULL}
    a = procs.pr("--job", "k", "--", *logged(log, "A", seconds=2), env=armed, **quiet)
    assert a.wait(15) == -signal.SIGKILL
    wait_for(lambda: started(log, "A"), 15, "A to start")
    b = procs.pr_run("--job", "k", "--wait-seconds", "30", "--", *logged(log, "B", seconds=0))
    assert b.returncode == 0, b
    wait_for(lambda: "A end" in log.read_text(), 15, "A's COMMAND to run to its end")
    spans = intervals(log)
    a_end = spans["A"][1] or 0.0
    assert spans["B"][0] >= a_end, f"B started {a_end - spans['B'][0]:.3f} s before A ended"


def test_a_holder_killed_when_handed_the_lock_frees_it_and_command_never_runs(
    backend: str, procs: Procs, work: Path
) -> None:
    """kill -9 of a waiting run's holder right after its turn came, before its first word (on
    etcd the holder forked while the run waited, just handed the grip; on the lock dir the one
    forked at the hand-over): the run exits 70 with one line, its COMMAND never runs, and the
    lock is free for the next run at once, not after a lease."""
    gate = Gate(work)
    first = procs.pr("--job", "hk", "--", "sh", "-c", gate.script())
    gate.wait_ready()
    env = dict(procs.env, PEARING_FAULT="pause-holder-start")
    b = procs.pr("--job", "hk", "--wait-seconds", "60", "--", "touch", str(work / "b-ran"), env=env)
    wait_for(lambda: _waiters(procs, "hk") == 1, 15, "B to queue")
    gate.open()
    assert procs.finish(first).returncode == 0
    pid = int(wait_for(lambda: _paused_child(b.pid), 15, "B's holder to pause before its first word"))
    os.kill(pid, signal.SIGKILL)
    rb = procs.finish(b)
    assert rb.returncode == ExitCode.SOFTWARE, rb
    assert len(rb.err_lines) == 1 and "holder" in rb.err_lines[0], rb
    assert not (work / "b-ran").exists()
    c = procs.pr_run("--job", "hk", "--lease-seconds", "60", "--", "true")
    assert c.returncode == 0, c


def test_a_run_released_as_its_turn_comes_never_starts_command(backend: str, procs: Procs, work: Path) -> None:
    """release-lock-ticket of a waiting run's ticket just as its turn came, its holder not yet
    settled (paused before its first word). The three stores used to do three things: the lock
    dir answered "cancelled" and then ran COMMAND to the end, exit 0, its cancel lost; etcd
    started COMMAND and stopped it; PostgreSQL poked the wrapper, which passed SIGUSR1 on to
    COMMAND (exit 138). Now on each: the release stands, COMMAND never starts, the run exits 124
    (its lock lost), and the lock is free for the next run with a higher fence."""
    gate = Gate(work)
    first = procs.pr("--job", "rt", "--", "sh", "-c", f"echo $PEARING_FENCE > {work / 'a.fence'}; {gate.script()}")
    gate.wait_ready()
    env = dict(procs.env, PEARING_FAULT="pause-holder-start")
    ran = work / "b-ran"
    b = procs.pr("--job", "rt", "--wait-seconds", "60", "--", "sh", "-c", f"echo $$ > {ran}; sleep 5", env=env)
    wait_for(lambda: _waiters(procs, "rt") == 1, 15, "B to queue")
    ticket = lock_status(procs, "rt")["waiters"][0]["ticket_id"]
    gate.open()
    assert procs.finish(first).returncode == 0
    pid = int(wait_for(lambda: _paused_child(b.pid), 15, "B's holder to pause before its first word"))
    release = procs.start([PEARING_CLI, "release-lock-ticket", "rt", ticket], text=True)
    wait_for(lambda: _ended(procs, ticket), 15, "the release to land")
    os.kill(pid, signal.SIGCONT)
    rel = procs.finish(release)
    assert rel.returncode == 0, rel
    assert json.loads(rel.stdout)["state"] in ("released", "cancelled"), rel
    rb = procs.finish(b)
    assert rb.returncode == ExitCode.LEASE_LOST, rb
    assert not ran.exists(), "COMMAND started for a ticket its owner had released"
    c = procs.pr_run("--job", "rt", "--", "sh", "-c", f"echo $PEARING_FENCE > {work / 'c.fence'}")
    assert c.returncode == 0, c
    assert int((work / "c.fence").read_text()) > int((work / "a.fence").read_text())


def test_a_cli_ticket_released_as_its_turn_comes_frees_the_lock_at_once(backend: str, procs: Procs, work: Path) -> None:
    """The same for a pearing-cli ticket: its agent, its turn come, finds the ticket released
    before it takes the lock. It lets go of the lock then and there; on etcd and PostgreSQL it
    used to leave the key (the row) holding until its 60 s lease ran out: every run busy."""
    gate, first, owner, paused = _held_and_a_cli_owner_paused_at(procs, work, "rt", "pause-agent-take")
    wait_for(lambda: _waiters(procs, "rt") == 1, 15, "the CLI ticket to queue")
    ticket = lock_status(procs, "rt")["waiters"][0]["ticket_id"]
    gate.open()
    assert procs.finish(first).returncode == 0
    wait_for(lambda: list(work.glob("agent.go.*")), 15, "its agent to stop right before it takes the lock")
    release = procs.start([PEARING_CLI, "release-lock-ticket", "rt", ticket], text=True)
    wait_for(lambda: _ended(procs, ticket), 15, "the release to land")
    paused.touch()
    rel = procs.finish(release)
    assert rel.returncode == 0, rel
    r = procs.finish(owner)
    assert json.loads(r.stdout)["state"] in ("released", "cancelled"), r
    c = procs.pr_run("--job", "rt", "--", "true")
    assert c.returncode == 0, f"the lock stayed taken after its ticket was released: {c}"


def test_a_ticket_released_before_its_agent_starts_ends_its_owner_by_word_not_by_signal(
    backend: str, procs: Procs, work: Path
) -> None:
    """release-lock-ticket of a pearing-cli ticket whose owner has not yet spawned its agent
    (``pause-agent-spawn``): the ticket names the owner as its waiter until the agent adopts it.
    The owner is not in line, so it is neither poked (on the lock dir the waiters' signal would
    kill it: it has no handler for it) nor waited for; it answers with the ticket as it ended."""
    gate, first, owner, paused = _held_and_a_cli_owner_paused_at(procs, work, "ro", "pause-agent-spawn")
    wait_for(lambda: list(work.glob("agent.go.*")), 15, "the owner to stop before its agent's spawn")
    ticket = lock_status(procs, "ro")["waiters"][0]["ticket_id"]
    release = procs.start([PEARING_CLI, "release-lock-ticket", "ro", ticket], text=True)
    # Nor is it waited for: the release returns while the owner is still stopped.
    rel = procs.finish(release, timeout=8)
    assert rel.returncode == 0 and json.loads(rel.stdout)["state"] == "cancelled", rel
    paused.touch()
    r = procs.finish(owner)
    assert r.returncode >= 0, f"the owner died of a signal: {r}"
    assert json.loads(r.stdout)["state"] == "cancelled", r
    gate.open()
    assert procs.finish(first).returncode == 0


def _held_and_a_cli_owner_paused_at(
    procs: Procs, work: Path, job: str, point: str
) -> tuple[Gate, subprocess.Popen[bytes], subprocess.Popen[str], Path]:
    """A run holding ``job`` until its gate opens, and a pearing-cli acquire-lock (60 s lease,
    30 s wait) that stops at the fault ``point`` until ``work/agent.go`` exists (``agent.go.PID``
    says it has stopped there)."""
    gate = Gate(work)
    first = procs.pr("--job", job, "--", "sh", "-c", gate.script())
    gate.wait_ready()
    paused = work / "agent.go"
    env = dict(procs.env, PEARING_FAULT=point, PEARING_FAULT_GATE=str(paused))
    argv = [PEARING_CLI, "acquire-lock", job, "--request-uuid", str(uuid.uuid4()), "--lease-seconds", "60"]
    return gate, first, procs.start([*argv, "--wait-seconds", "30"], env=env, text=True), paused


def _ended(procs: Procs, ticket: str, job: str = "rt") -> bool:
    t = procs.run_text([PEARING_CLI, "get-lock-ticket", job, ticket]).json
    return t["state"] in ("released", "cancelled")


@pytest.mark.parametrize("frozen", ["holder", "holder-and-wrapper"])
def test_a_holder_frozen_before_it_is_ready_never_lets_two_commands_run(
    caps: Caps, frozen: str, procs: Procs, work: Path
) -> None:
    """A promoted waiter's holder frozen right after the fork, before its first word, for
    longer than its lease (and than an etcd waiting key lives unrenewed).

    Holder alone: the wrapper keeps the lock while it waits for that word, so B keeps its
    turn and C runs after it (on etcd both leases used to lapse: C ran, and B lost its turn).
    Wrapper frozen too: on etcd nobody kept the leases, C runs; B must then never start its
    COMMAND beside C's (it did when the wrapper started COMMAND before hearing the holder's
    "lost"): it asks the cluster first. The lock dir's flock outlives any freeze."""
    log = work / "log"
    gate = Gate(work)
    first = procs.pr("--job", "fr", "--", "sh", "-c", gate.script())
    gate.wait_ready()
    env = dict(procs.env, PEARING_FAULT="pause-holder-start")
    b = procs.pr(
        "--job", "fr", "--lease-seconds", "2", "--wait-seconds", "60", "--", *logged(log, "B", seconds=0.5), env=env
    )  # fmt: skip
    wait_for(lambda: _waiters(procs, "fr") == 1, 15, "B to queue")
    c = procs.pr("--job", "fr", "--wait-seconds", "60", "--", *logged(log, "C", seconds=3))
    wait_for(lambda: _waiters(procs, "fr") == 2, 15, "C to queue")
    gate.open()
    pid = int(wait_for(lambda: _paused_child(b.pid), 15, "B's holder to pause right after the fork"))
    if frozen == "holder-and-wrapper":
        os.kill(b.pid, signal.SIGSTOP)
    try:
        thaw_at = time.monotonic() + 5.0  # the fault: 2.5 leases, and past the 3 s of a waiting key
        wait_for(lambda: time.monotonic() >= thaw_at, 10, "the freeze to last")
    finally:
        os.kill(pid, signal.SIGCONT)
        os.kill(b.pid, signal.SIGCONT)
    assert procs.finish(first).returncode == 0
    rb, rc = procs.finish(b, timeout=60), procs.finish(c, timeout=60)
    assert rc.returncode == 0, rc
    spans = intervals(log)
    if "B" in spans:
        (b0, b1), (c0, c1) = spans["B"], spans["C"]
        assert b1 is not None and c1 is not None, spans
        assert b1 <= c0 or c1 <= b0, f"B and C ran at once: {spans}"
    if caps.outlives_freeze or frozen == "holder":
        assert rb.returncode == 0, rb
        assert spans["B"][1] is not None and spans["B"][1] <= spans["C"][0], f"B lost its turn: {spans}"
    else:
        assert rb.returncode in (0, ExitCode.LEASE_LOST), rb


def test_wrapper_and_holder_both_killed_is_two_faults_and_fencing_still_holds(
    backend: str, procs: Procs, work: Path
) -> None:
    """The SPEC promises no overlap under a fault of one process. kill -9 of both the wrapper
    and its holder leaves COMMAND with nobody to keep its lock (it never inherits the lock fd;
    on etcd nobody keeps the lease alive), so the next run may start beside it. What still
    holds: the orphan's token is refused, and the next fence is larger, so a target that checks
    fences (``pearing-guard fence``) rejects the orphan's late writes."""
    tf, fa, apid = work / "tf", work / "fa", work / "apid"
    script = f'echo "$PEARING_TOKEN_FILE" > {q(tf)}; echo "$PEARING_FENCE" > {q(fa)}; '
    script += f"echo $$ > {q(apid)}; exec sleep 60"
    a = procs.pr("--job", "dbl", "--lease-seconds", "2", "--", "sh", "-c", script)
    wait_for(lambda: apid.exists() and apid.read_text().strip(), 15, "A's COMMAND")
    holder = holder_pid(procs, "dbl", a.pid)
    a.kill()
    a.wait()
    os.kill(holder, signal.SIGKILL)
    orphan = int(apid.read_text())
    try:
        b = procs.pr_run(
            "--job", "dbl", "--wait-seconds", "20", "--", "sh", "-c", f'echo "$PEARING_FENCE" > {q(work / "fb")}'
        )  # fmt: skip
        assert b.returncode == 0, b
        assert proc_state(orphan) not in (None, "Z"), "the orphaned COMMAND should still run (no one stops it)"
        assert int((work / "fb").read_text()) > int(fa.read_text())
        verdict = procs.run([PEARING_GUARD, "verify", "--token-file", tf.read_text().strip()])
        assert verdict.returncode == ExitCode.REFUSED, verdict
        fenced = procs.run([PEARING_GUARD, "fence", "--resource", "r", "--fence", (work / "fb").read_text().strip()])
        assert fenced.returncode == 0, fenced
        late = procs.run([PEARING_GUARD, "fence", "--resource", "r", "--fence", fa.read_text().strip()])
        assert late.returncode != 0, late
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.kill(orphan, signal.SIGKILL)


def test_a_killed_holder_frees_the_lock_only_after_command_is_dead(backend: str, procs: Procs, work: Path) -> None:
    log = work / "log"
    a = procs.pr("--job", "k", "--kill-grace", "5", "--", *logged(log, "A", trap=2))
    wait_for(lambda: started(log, "A"), 15, "A to start")
    pid = holder_pid(procs, "k", a.pid)
    b = procs.pr("--job", "k", "--wait-seconds", "40", "--", *logged(log, "B", seconds=0))
    wait_for(lambda: lock_status(procs, "k")["waiters"], 15, "B to queue")
    os.kill(pid, signal.SIGKILL)
    assert procs.finish(a, timeout=60).returncode == ExitCode.LEASE_LOST
    assert procs.finish(b, timeout=60).returncode == 0
    spans = intervals(log)
    a_end = spans["A"][1]
    assert a_end is not None and spans["B"][0] >= a_end, spans


def test_the_longest_lease_is_honoured(backend: str, procs: Procs) -> None:
    """2592000 s (30 days) is 2^31 ms past what poll() takes: clamped timers, not a crash."""
    r = procs.pr_run("--job", "long", "--lease-seconds", "2592000", "--heartbeat", "manual", "--", "sleep", "1")
    assert r.returncode == 0, r
    ten_years = str(10 * 365 * 86400)
    t = procs.run_text([PEARING_CLI, "acquire-lock", "long", "--request-uuid", str(uuid.uuid4()),
                        "--lease-seconds", ten_years])  # fmt: skip
    assert t.returncode == 0 and t.json["state"] == "held", t
    status = procs.run_text([PEARING_CLI, "status", "long", "--json"]).json
    assert status[0]["state"] == "held" and status[0]["holder"]["ticket_id"] == t.json["ticket_id"]
    busy = procs.run_text([PEARING_CLI, "acquire-lock", "long", "--request-uuid", str(uuid.uuid4())])
    assert busy.returncode == ExitCode.BUSY, busy
    assert procs.run_text([PEARING_CLI, "release-lock-ticket", "long", busy.json["ticket_id"]]).returncode == 0
    assert procs.run_text([PEARING_CLI, "release-lock-ticket", "long", t.json["ticket_id"]]).returncode == 0


def test_a_suspended_waiter_keeps_its_place_only_until_its_own_deadline(procs: Procs, work: Path) -> None:
    log = work / "log"
    gate = Gate(work)
    holder = procs.pr("--job", "w", "--", "sh", "-c", gate.script())
    gate.wait_ready()
    w1 = procs.pr("--job", "w", "--wait-seconds", "2", "--", *logged(log, "W1", seconds=0), own_group=True)
    wait_for(lambda: len(lock_status(procs, "w")["waiters"]) == 1, 15, "W1")
    # ^Z itself: caught inside the lock dir's record mutex, it stops W1 once W1 has let go (a
    # SIGSTOP there would hold every acquirer of the lock until continued, W2's ticket too).
    os.kill(w1.pid, signal.SIGTSTP)
    wait_for(lambda: proc_state(w1.pid) == "T", 15, "W1 stopped")
    try:
        w2 = procs.pr("--job", "w", "--wait-seconds", "30", "--", *logged(log, "W2", seconds=0))
        gate.open()
        assert procs.finish(holder).returncode == 0
        # W2 runs once W1's own deadline (2 s) has passed, far before its own 30 s.
        r2 = procs.finish(w2, timeout=40)
        assert r2.returncode == 0 and r2.elapsed < 15, r2
    finally:
        os.kill(w1.pid, signal.SIGCONT)
    r1 = procs.finish(w1, timeout=30)
    assert r1.returncode == ExitCode.BUSY, r1
    assert not started(log, "W1")


def test_a_resumed_late_waiter_never_takes_a_free_lock(procs: Procs, work: Path) -> None:
    log = work / "log"
    gate = Gate(work)
    holder = procs.pr("--job", "r", "--", "sh", "-c", gate.script())
    gate.wait_ready()
    launched = time.monotonic()
    w1 = procs.pr("--job", "r", "--wait-seconds", "3", "--", *logged(log, "W1", seconds=0), own_group=True)
    wait_for(lambda: lock_status(procs, "r")["waiters"], 15, "W1 to queue")
    os.kill(w1.pid, signal.SIGTSTP)  # ^Z: stops W1 once out of the record mutex (see above)
    wait_for(lambda: proc_state(w1.pid) == "T", 15, "W1 stopped")
    try:
        gate.open()
        assert procs.finish(holder).returncode == 0
        past = launched + 4.0
        wait_for(lambda: time.monotonic() >= past, 10, "W1's deadline to pass while it is stopped")
    finally:
        os.kill(w1.pid, signal.SIGCONT)
    assert procs.finish(w1).returncode == ExitCode.BUSY
    assert not started(log, "W1")
    assert procs.pr_run("--job", "r", "--", "true").returncode == 0


@pytest.fixture
def small_fs(tmp_path: Path) -> Path:
    """A 512 KiB tmpfs: a COMMAND can fill it. Needs root (CI and this project's machines run as root)."""
    if os.geteuid() != 0:
        pytest.skip("mounting a small tmpfs needs root")
    mnt = tmp_path / "small"
    mnt.mkdir()
    subprocess.run(["mount", "-t", "tmpfs", "-o", "size=512k,mode=0755", "tmpfs", str(mnt)], check=True)
    try:
        yield mnt
    finally:
        subprocess.run(["umount", "-l", str(mnt)], check=False)


def test_a_success_is_never_replayed_even_if_the_disk_fills_during_the_run(
    procs: Procs, small_fs: Path, work: Path
) -> None:
    env = dict(procs.env, PEARING_LOCK_DIR=str(small_fs / "lockdir"))
    request = str(uuid.uuid4())
    fill = f"dd if=/dev/zero of={q(small_fs / 'filler')} bs=4k 2>/dev/null; echo ran >> {q(work / 'ran')}; exit 0"
    r = procs.pr_run("--job", "d", "--request-uuid", request, "--", "sh", "-c", fill, env=env)
    full = (small_fs / "filler").stat().st_size
    assert full > 0
    # Either the success was recorded (exit 0), or pearing-run says it could not be: never a silent 0.
    if r.returncode == 0:
        replay = procs.pr_run("--job", "d", "--request-uuid", request, "--", "sh", "-c", fill, env=env)
        assert replay.returncode == 0, replay
        assert (work / "ran").read_text() == "ran\n", "a successful run was replayed"
    else:
        assert r.returncode in (ExitCode.CANTCREAT, ExitCode.IOERR), r
        assert len(r.err_lines) == 1 and "lockdir" in r.err_lines[0], r
    with contextlib.suppress(FileNotFoundError):
        (small_fs / "filler").unlink()


def test_a_disk_full_as_command_ends_is_the_stores_error_not_a_lost_lease(procs: Procs, small_fs: Path) -> None:
    """The holder cannot end the ticket (the disk filled up after COMMAND succeeded, while the
    holder was not looking): one line naming the lock dir and its code (73/74), never 124 as if
    the lease had been lost; and once there is room again the lock is free, the next fence above.
    (No request and no --min-interval: ending the ticket is the holder's first write.)"""
    lock_dir = small_fs / "lockdir"
    env = dict(procs.env, PEARING_LOCK_DIR=str(lock_dir), PEARING_FAULT="pause-before-finish")
    run = procs.pr("--job", "full", "--", "true", env=env)
    held = wait_for(lambda: ticket_records(lock_dir, "full"), 10, "the held ticket")
    holder = int(held[0]["holder_pid"])
    wait_for(lambda: proc_state(holder) == "T", 10, "the holder paused before it finishes")
    filler = small_fs / "filler"
    subprocess.run(["dd", "if=/dev/zero", f"of={filler}", "bs=4k"], capture_output=True, check=False)
    os.kill(holder, signal.SIGCONT)
    r = procs.finish(run)
    filler.unlink()
    assert r.returncode in (ExitCode.CANTCREAT, ExitCode.IOERR), r
    assert len(r.err_lines) == 1 and str(lock_dir) in r.err_lines[0], r
    after = procs.pr_run("--job", "full", "--", "sh", "-c", 'echo "$PEARING_FENCE"', env=dict(env, PEARING_FAULT=""))
    assert after.returncode == 0 and after.stdout == b"2\n", after


def test_same_uuid_retries_keep_a_waiting_cli_ticket_in_line(procs: Procs, work: Path) -> None:
    gate = Gate(work)
    holder = procs.pr("--job", "u", "--", "sh", "-c", gate.script())
    gate.wait_ready()
    request = str(uuid.uuid4())
    # A lease with room for each retry's own start-up on a loaded machine (1.2 s was seen at a
    # load of 6 on 2 cores: with a 3 s lease, 1.5 s between retries then let it lapse).
    args = [PEARING_CLI, "acquire-lock", "u", "--request-uuid", request, "--lease-seconds", "6"]
    first = procs.run_text(args)
    assert first.returncode == ExitCode.BUSY, first
    # Retries every 1.5 s for 7.5 s, past the 6 s lease: each renews the waiting ticket (one
    # that did not would have lapsed before the last retry, which would then get a new ticket).
    for _ in range(5):
        until = time.monotonic() + 1.5
        wait_for(lambda u=until: time.monotonic() >= u, 5, "the next retry")
        retry = procs.run_text(args)
        assert retry.returncode == ExitCode.BUSY and retry.json["ticket_id"] == first.json["ticket_id"], retry
        assert retry.json["state"] == "waiting", retry
    gate.open()
    assert procs.finish(holder).returncode == 0
    held = procs.run_text([*args[:-2], "--lease-seconds", "3", "--wait-seconds", "10"])
    assert held.returncode == 0 and held.json["state"] == "held", held
    assert procs.run_text([PEARING_CLI, "release-lock-ticket", "u", held.json["ticket_id"]]).returncode == 0


class Pty:
    """pearing-run as the foreground job of a terminal, as when typed in a shell."""

    def __init__(self, procs: Procs, *args: str, argv: list[str] | None = None) -> None:
        """pearing-run ARGS, or ``argv`` (a shell that runs it, say) as the terminal's session leader."""
        argv = argv or [PEARING_RUN, *args]
        pid, self.master = pty.fork()
        if pid == 0:  # the child: a session leader whose controlling terminal is the pty
            try:
                os.execve(argv[0], argv, procs.env)
            finally:
                os._exit(127)
        self.pid, self.out = pid, b""

    def expect(self, text: bytes, timeout: float = 15.0) -> None:
        def seen() -> bool:
            if select.select([self.master], [], [], 0.05)[0]:
                with contextlib.suppress(OSError):
                    self.out += os.read(self.master, 4096)
            return text in self.out

        wait_for(seen, timeout, f"{text!r} on the terminal (so far {self.out!r})")

    def command_in_foreground(self) -> None:
        """COMMAND's group owns the terminal now (pearing-run gave it right after the spawn)."""
        wait_for(lambda: os.tcgetpgrp(self.master) != self.pid, 10, "COMMAND's group to get the terminal")

    def send(self, data: bytes) -> None:
        os.write(self.master, data)

    def wait(self, timeout: float = 15.0) -> int:
        done = wait_for(lambda: (r := os.waitpid(self.pid, os.WNOHANG))[0] and r, timeout, "pearing-run to exit")
        os.close(self.master)
        return os.waitstatus_to_exitcode(done[1])

    def close(self) -> None:
        with contextlib.suppress(ProcessLookupError, ChildProcessError):
            os.kill(self.pid, signal.SIGKILL)
            os.waitpid(self.pid, 0)
        with contextlib.suppress(OSError):
            os.close(self.master)


@pytest.fixture
def term(procs: Procs) -> Iterator[Callable[..., Pty]]:
    made: list[Pty] = []

    def start(*args: str) -> Pty:
        made.append(Pty(procs, *args))
        return made[-1]

    yield start
    for t in made:
        t.close()


def test_an_interactive_command_reads_the_terminal(term: Callable[..., Pty]) -> None:
    t = term("--job", "tty", "--", "sh", "-c", 'echo ready; read a; echo "got $a"')
    t.expect(b"ready")
    t.send(b"hello\n")
    t.expect(b"got hello")
    assert t.wait() == 0


def test_a_guarded_command_reads_the_terminal_and_gets_ctrl_c(term: Callable[..., Pty]) -> None:
    """pearing-guard exec's CMD is in COMMAND's process group, the terminal's foreground:
    it reads the terminal, and ^C reaches it (the guard itself ignores ^C, as system(3))."""
    script = 'echo ready; read a; echo "got $a"; exec sleep 30'
    t = term("--job", "tty", "--", PEARING_GUARD, "exec", "--", "sh", "-c", script)
    t.expect(b"ready")
    t.send(b"hello\n")
    t.expect(b"got hello")
    t.command_in_foreground()
    t.send(b"\x03")
    assert t.wait() == 128 + signal.SIGINT


def test_ctrl_c_reaches_the_command(term: Callable[..., Pty]) -> None:
    t = term("--job", "tty", "--", "sh", "-c", "echo ready; exec sleep 30")
    t.expect(b"ready")
    t.command_in_foreground()
    t.send(b"\x03")
    assert t.wait() == 128 + signal.SIGINT


def test_ctrl_z_stops_the_job_and_fg_continues_it(term: Callable[..., Pty], procs: Procs) -> None:
    t = term("--job", "tty", "--", "sh", "-c", 'echo ready; read a; echo "got $a"')
    t.expect(b"ready")
    t.command_in_foreground()
    t.send(b"\x1a")
    # As a shell sees it: its job (pearing-run's process group) is stopped.
    wait_for(lambda: proc_state(t.pid) == "T", 10, "pearing-run to stop with its COMMAND")
    os.kill(t.pid, signal.SIGCONT)  # what `fg` does
    wait_for(lambda: proc_state(t.pid) != "T", 10, "pearing-run to continue")
    t.send(b"again\n")
    t.expect(b"got again")
    assert t.wait() == 0
    # The lock was held throughout and is free again.
    assert procs.pr_run("--job", "tty", "--", "true").returncode == 0


def _stopped(pid: int) -> bool:
    return proc_state(pid) == "T"


def test_guard_exec_forwards_a_signal_that_lands_between_spawn_and_handlers(procs: Procs, work: Path) -> None:
    """SIGTERM while pearing-guard exec sits right after spawning CMD (paused there by a test-only
    fault point): the signal waits for the handlers and reaches CMD; it used to kill the guard
    alone and orphan CMD."""
    gate = Gate(work)
    holder = procs.pr("--job", "g", "--", "sh", "-c", f"echo $PEARING_TOKEN_FILE > {q(work / 'tf')}; {gate.script()}")
    gate.wait_ready()
    env = dict(procs.env, PEARING_TOKEN_FILE=(work / "tf").read_text().strip(), PEARING_FAULT="pause-guard-spawned")
    pidfile = work / "cmd.pid"
    guard = procs.start([PEARING_GUARD, "exec", "--", "sh", "-c", f"echo $$ > {q(pidfile)}; exec sleep 30"], env=env)
    wait_for(lambda: _stopped(guard.pid), 15, "the guard to pause right after the spawn")
    cmd = int(wait_for(lambda: pidfile.exists() and pidfile.read_text().strip(), 15, "CMD's pid"))
    os.kill(guard.pid, signal.SIGTERM)
    os.kill(guard.pid, signal.SIGCONT)
    r = procs.finish(guard)
    assert r.returncode == 128 + signal.SIGTERM, r  # CMD got the TERM and the guard reports it
    wait_for(lambda: proc_state(cmd) in (None, "Z"), 5, "CMD to be gone")
    gate.open()
    assert procs.finish(holder).returncode == 0


def test_a_stop_signal_that_lands_before_the_holder_is_ready_ends_the_lease(procs: Procs, work: Path) -> None:
    """SIGTERM to the holder right after the fork (paused there): it waits for the holder's
    handlers and ends the lease; it used to run the wrapper's inherited handler and be lost."""
    env = dict(procs.env, PEARING_FAULT="pause-holder-start")
    wrapper = procs.pr("--job", "h", "--", "sh", "-c", f"touch {q(work / 'ran')}; sleep 30", env=env)
    pid = int(wait_for(lambda: _paused_child(wrapper.pid), 15, "the forked holder to pause"))
    os.kill(pid, signal.SIGTERM)
    os.kill(pid, signal.SIGCONT)
    r = procs.finish(wrapper, timeout=60)
    assert r.returncode == ExitCode.LEASE_LOST, r
    # COMMAND (sleep 30) either never started or was stopped: it did not run to its end.
    assert r.elapsed < 20, r
    assert procs.pr_run("--job", "h", "--", "true").returncode == 0


def test_a_stop_signal_inside_the_lock_dirs_mutex_waits_until_it_is_let_go(procs: Procs, work: Path, job: str) -> None:
    """^Z (SIGTSTP) reaching a lock dir acquirer while it holds the lock's record mutex stops it
    once it has let go: stopped inside, it would hold every acquirer of that lock until continued.
    The waiter is held inside the mutex by a gate (not a SIGSTOP: continuing a stopped process
    discards the stop signals pending for it), in a process group of its own in the test's
    session: the kernel discards a terminal stop signal sent to an orphaned group."""
    gate = Gate(work)
    holder = procs.pr("--job", job, "--", "sh", "-c", gate.script())
    gate.wait_ready()
    inside = work / "inside"
    env = {**procs.env, "PEARING_FAULT": "pause-in-mutex", "PEARING_FAULT_GATE": str(inside)}
    argv = [PEARING_RUN, "--job", job, "--wait-seconds", "60", "--", "true"]
    b = subprocess.Popen(argv, env=env, cwd=work, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                         stderr=subprocess.PIPE, process_group=0)  # fmt: skip
    procs.popens.append(b)
    procs.started[b.pid] = time.monotonic()
    wait_for(lambda: any(work.glob("inside.*")), 15, "the waiter inside the mutex")
    os.kill(b.pid, signal.SIGTSTP)
    inside.touch()  # it may go on, and stop once it has let go of the mutex
    wait_for(lambda: proc_state(b.pid) == "T", 15, "the waiter stopped")
    try:
        # Stopped outside the mutex: a newcomer can still get in line behind it.
        c = procs.pr("--job", job, "--wait-seconds", "60", "--", "true")
        wait_queued(procs, job, 2, timeout=20)
    finally:
        os.kill(b.pid, signal.SIGCONT)
    gate.open()
    assert procs.finish(holder).returncode == 0
    assert procs.finish(b, timeout=60).returncode == 0
    assert procs.finish(c, timeout=60).returncode == 0
