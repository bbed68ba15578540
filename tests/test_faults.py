"""Fault injection: ``PEARING_FAULT=POINT`` makes a process SIGKILL itself at a named step.

For every point the suite checks what SPEC "Bad input and faults" promises after a kill -9
at that step:

- the lock is usable again within a bounded time (a plain ``pearing-run --wait-seconds 10``
  exits 0 within a few seconds; the time is printed as ``RECOVERY ...``, run with ``-s``);
- no fence was issued twice or went down: every COMMAND appends its ``PEARING_FENCE`` to one
  log, runs are serialised by the lock, so the log must be strictly increasing, and the
  ``fence`` file must equal the last fence handed out;
- never two tickets ``held`` at once, and a ticket recorded ``held`` has a live holder
  (tickets/ is read under the lock's record mutex, so the scan is one consistent moment);
- a completed request-uuid record survives (replay exits 0 without running), and a run the
  fault cut short does not block its retry (the replay runs);
- no token file outlives its holder.

``PEARING_FAULT`` is read at import and inherited by the forked holder, so it is set only in
the environment of the one process that is meant to die.

``after-holder-spawn`` (the wrapper) and ``mid-release`` (the holder) are steps of the
runner and the holder that every backend shares: those tests take ``caps`` (so ``backend``)
and run on etcd too. Where the records are not files in the lock dir they check through
``pearing-cli status``; the token files stay in the local lock dir on either backend.
The other points are steps of the lock dir's own code (flock, fence file, token file write,
queue, ledger file): those tests are local_only.
"""

from __future__ import annotations

import fcntl
import json
import os
import signal
import subprocess
import time
import uuid
from pathlib import Path
from typing import Any

import pytest
from caps import LOCAL, Caps
from helpers import (
    PEARING_CLI,
    PEARING_GUARD,
    Gate,
    Procs,
    Result,
    assert_one_live_holder_at_most,
    fence_on_disk,
    held_records,
    lock_status,
    pid_alive,
    q,
    read_json,
    store_dir,
    wait_for,
    wait_queued,
)

from singleflight.core.const import ENV_FAULT, ENV_FENCE, ExitCode

SOFTWARE = int(ExitCode.SOFTWARE)
REFUSED = int(ExitCode.REFUSED)
SIGKILLED = -9
HOLDER_POINTS = ["after-flock", "after-fence-bump", "after-token-file"]
# A recovery run waits up to 10 s; it must actually get the lock well within that.
RECOVERY_BOUND = 5.0


def sh(script: str) -> list[str]:
    return ["sh", "-c", script]


def armed(env: dict[str, str], point: str) -> dict[str, str]:
    e = dict(env)
    e[ENV_FAULT] = point
    return e


class FenceLog:
    """One file every COMMAND of a test appends ``TAG FENCE`` to."""

    def __init__(self, work: Path) -> None:
        self.path = work / "fences.log"

    def command(self, tag: str) -> list[str]:
        return sh(f'echo "{tag} ${ENV_FENCE}" >> {q(self.path)}')

    def rows(self) -> list[tuple[str, int]]:
        if not self.path.exists():
            return []
        return [(tag, int(f)) for tag, f in (line.split() for line in self.path.read_text().splitlines())]

    def tags(self) -> list[str]:
        return [tag for tag, _ in self.rows()]

    def fence(self, tag: str) -> int:
        found = [f for t, f in self.rows() if t == tag]
        assert len(found) == 1, (tag, self.rows())
        return found[0]


def token_files(lock_dir: Path, job: str = "J") -> list[str]:
    d = store_dir(lock_dir, job) / "tokens"
    return sorted(p.name for p in d.iterdir() if not p.name.startswith(".")) if d.is_dir() else []


def check_recovery(caps: Caps, procs: Procs, lock_dir: Path, log: FenceLog, label: str, faulted_at: float) -> float:
    """The invariants right after a fault, then a plain run gets the lock, then the invariants again."""
    if caps.records_in_lock_dir:
        # The records, read-only: status would sweep a dead holder's record before the recovery run meets it.
        assert_one_live_holder_at_most(lock_dir, "J")
    else:
        # Right after a kill the line may still name the dead wrapper (a holder forked as it
        # died has not recorded its own pid, or is letting go of the key): for moments, never for
        # longer than that holder takes to see its wrapper gone.
        def no_dead_holder() -> bool:
            holder = lock_status(procs, "J")["holder"]
            return holder is None or pid_alive(holder["holder_pid"])

        wait_for(no_dead_holder, 5, "status to show no dead holder")
    r = procs.pr_run("--wait-seconds", "10", "--job", "J", "--", *log.command("recover"), timeout=20)
    recovered = time.monotonic() - faulted_at
    assert r.returncode == 0, r
    assert r.elapsed < RECOVERY_BOUND, f"the lock was not usable again for {r.elapsed:.3f} s: {r!r}"
    print(f"RECOVERY {label}: lock usable {recovered:.3f} s after the fault (recovery run took {r.elapsed:.3f} s)")

    fences = [f for _tag, f in log.rows()]
    assert fences == sorted(set(fences)), f"a fence was reissued or went down: {log.rows()}"
    if caps.records_in_lock_dir:
        assert fence_on_disk(lock_dir, "J") == fences[-1], (fence_on_disk(lock_dir, "J"), log.rows())
        assert held_records(lock_dir, "J") == [], "a ticket is still held after every run ended"
    st = lock_status(procs, "J")
    assert (st["state"], st["holder"], st["waiters"]) == ("free", None, []), st
    assert token_files(lock_dir) == [], "a token file outlived its holder"
    return recovered


def replay(procs: Procs, log: FenceLog, request_uuid: str) -> Result:
    return procs.pr_run("--job", "J", "--request-uuid", request_uuid, "--", *log.command("replay"))


def contend_behind(
    procs: Procs, work: Path, lock_dir: Path, log: FenceLog, faulty: list[str], env: dict[str, str]
) -> tuple[Gate, subprocess.Popen[bytes], subprocess.Popen[bytes], subprocess.Popen[bytes]]:
    """A holder ``H`` blocks on a gate; the run ``faulty`` (armed) queues first, a clean run ``B`` second.

    Returns (gate, holder, faulty run, clean run); the caller opens the gate.
    """
    gate = Gate(work)
    holder = procs.pr("--job", "J", "--", *sh(f'echo "H ${ENV_FENCE}" >> {q(log.path)}; {gate.script()}'))
    gate.wait_ready()
    a = procs.pr("--job", "J", "--wait-seconds", "30", *faulty, env=env)
    wait_queued(procs, "J", 1)
    b = procs.pr("--job", "J", "--wait-seconds", "30", "--", *log.command("B"))
    wait_queued(procs, "J", 2)
    return gate, holder, a, b


# -- the holder dies while taking ownership ------------------------------------------------------


@pytest.mark.local_only("after-flock, after-fence-bump and after-token-file are steps of the lock dir's code")
@pytest.mark.parametrize("promoted", [False, True], ids=["free", "promoted"])
@pytest.mark.parametrize("point", HOLDER_POINTS)
def test_holder_killed_while_taking_ownership(
    procs: Procs, work: Path, lock_dir: Path, env: dict[str, str], point: str, promoted: bool
) -> None:
    log = FenceLog(work)
    assert procs.pr_run("--job", "J", "--", *log.command("first")).returncode == 0
    u = str(uuid.uuid4())
    faulty = ["--request-uuid", u, "--", *log.command("fault")]
    if not promoted:
        r = procs.pr_run("--job", "J", *faulty, env=armed(env, point))
        faulted_at = time.monotonic()
    else:
        gate, holder, a, b = contend_behind(procs, work, lock_dir, log, faulty, armed(env, point))
        gate.open()
        assert procs.finish(holder).returncode == 0
        r = procs.finish(a)
        faulted_at = time.monotonic()
        served = procs.finish(b)
        assert served.returncode == 0, f"the waiter behind the killed holder was not served: {served!r}"
        assert log.fence("B") > log.fence("H")
        print(f"SERVED {point}/promoted: next waiter done {time.monotonic() - faulted_at:.3f} s after the fault")

    assert r.returncode == SOFTWARE, r
    assert len(r.err_lines) == 1 and "holder" in r.err_lines[0], r
    assert "fault" not in log.tags(), "COMMAND ran although its holder died before taking the lease"
    check_recovery(LOCAL, procs, lock_dir, log, f"{point}/{'promoted' if promoted else 'free'}", faulted_at)

    # The killed run never completed: its request uuid neither blocks nor deduplicates a retry.
    again = replay(procs, log, u)
    assert again.returncode == 0, again
    assert "replay" in log.tags(), "a retry of a request whose run was killed did not run"
    fences = [f for _tag, f in log.rows()]
    assert fences == sorted(set(fences)), log.rows()


# -- the wrapper dies right after forking the holder ----------------------------------------------


@pytest.mark.parametrize("promoted", [False, True], ids=["free", "promoted"])
def test_wrapper_killed_after_holder_spawn(
    caps: Caps, procs: Procs, work: Path, lock_dir: Path, env: dict[str, str], promoted: bool
) -> None:
    log = FenceLog(work)
    assert procs.pr_run("--job", "J", "--", *log.command("first")).returncode == 0
    u = str(uuid.uuid4())
    faulty = ["--request-uuid", u, "--", *log.command("fault")]
    if not promoted:
        r = procs.pr_run("--job", "J", *faulty, env=armed(env, "after-holder-spawn"))
        faulted_at = time.monotonic()
    else:
        gate, holder, a, b = contend_behind(procs, work, lock_dir, log, faulty, armed(env, "after-holder-spawn"))
        gate.open()
        assert procs.finish(holder).returncode == 0
        r = procs.finish(a)
        faulted_at = time.monotonic()
        served = procs.finish(b)
        assert served.returncode == 0, served
        assert log.fence("B") > log.fence("H")
    assert r.returncode == SIGKILLED, r
    assert "fault" not in log.tags(), "COMMAND ran although its wrapper died before starting it"
    # The orphaned holder sees EOF and lets go: no waiting out a 60 s lease.
    label = f"after-holder-spawn/{'promoted' if promoted else 'free'}"
    check_recovery(caps, procs, lock_dir, log, label, faulted_at)
    if caps.records_in_lock_dir:
        rec = read_json(store_dir(lock_dir, "J") / "requests" / f"{u}.json")
        assert rec is not None and rec["state"] != "succeeded", rec
    again = replay(procs, log, u)
    assert again.returncode == 0, again
    assert "replay" in log.tags(), "a retry of a request that never ran was deduplicated"


# -- the holder dies between marking the ticket released and freeing the lock -------------------


@pytest.mark.parametrize("promoted", [False, True], ids=["free", "promoted"])
def test_holder_killed_mid_release(
    caps: Caps, procs: Procs, work: Path, lock_dir: Path, env: dict[str, str], promoted: bool
) -> None:
    log = FenceLog(work)
    assert procs.pr_run("--job", "J", "--", *log.command("first")).returncode == 0
    u = str(uuid.uuid4())
    faulty = ["--request-uuid", u, "--", *log.command("fault")]
    if not promoted:
        r = procs.pr_run("--job", "J", *faulty, env=armed(env, "mid-release"))
        faulted_at = time.monotonic()
    else:
        gate, holder, a, b = contend_behind(procs, work, lock_dir, log, faulty, armed(env, "mid-release"))
        gate.open()
        assert procs.finish(holder).returncode == 0
        r = procs.finish(a)
        faulted_at = time.monotonic()
        served = procs.finish(b)
        assert served.returncode == 0, served
        assert log.fence("H") < log.fence("fault") < log.fence("B")
    # COMMAND ran and succeeded; the wrapper finishes the holder's bookkeeping and passes the status on.
    assert r.returncode == 0, r
    assert r.stderr == b"", r
    assert "fault" in log.tags()
    check_recovery(caps, procs, lock_dir, log, f"mid-release/{'promoted' if promoted else 'free'}", faulted_at)

    # holder.finish writes the request record BEFORE it marks the ticket released, and the
    # fault point is after that: the success must be remembered, so the replay does no work.
    if caps.records_in_lock_dir:
        rec = read_json(store_dir(lock_dir, "J") / "requests" / f"{u}.json")
        assert rec is not None and rec["state"] == "succeeded", rec
    again = replay(procs, log, u)
    assert again.returncode == 0, again
    assert "replay" not in log.tags(), "a replay of a completed request ran COMMAND again"


# -- a waiter dies right after it got the lock, before leaving the queue -------------------------


@pytest.mark.local_only("mid-promotion is a step of the lock dir's queue")
def test_waiter_killed_mid_promotion(procs: Procs, work: Path, lock_dir: Path, env: dict[str, str]) -> None:
    log = FenceLog(work)
    u = str(uuid.uuid4())
    faulty = ["--request-uuid", u, "--", *log.command("fault")]
    gate, holder, a, b = contend_behind(procs, work, lock_dir, log, faulty, armed(env, "mid-promotion"))
    gate.open()
    released_at = time.monotonic()
    assert procs.finish(holder).returncode == 0
    r = procs.finish(a)
    assert r.returncode == SIGKILLED, r
    served = procs.finish(b)
    waited = time.monotonic() - released_at
    assert served.returncode == 0, f"the waiter behind the killed one was not served: {served!r}"
    assert "fault" not in log.tags()
    assert log.fence("B") > log.fence("H")
    assert waited < RECOVERY_BOUND, waited
    print(f"SERVED mid-promotion: second waiter done {waited:.3f} s after the holder released")
    check_recovery(LOCAL, procs, lock_dir, log, "mid-promotion", released_at)
    # The dead waiter's record may stay until the next housekeeping (at most once a minute), but
    # nothing counts it as waiting: status shows the lock free with nobody in line.
    st = procs.run([PEARING_CLI, "status", "J"])
    assert st.returncode == 0, st
    [lock] = json.loads(st.stdout)
    assert (lock["state"], lock["holder"], lock["waiters"]) == ("free", None, []), lock
    again = replay(procs, log, u)
    assert again.returncode == 0, again
    assert "replay" in log.tags()


# -- pearing-guard fence dies between reading and writing the ledger -----------------------------


@pytest.mark.local_only("mid-ledger is a step of the ledger file's write (etcd's ledger is a compare-and-swap)")
@pytest.mark.parametrize("explicit", [False, True], ids=["default-ledger", "explicit-ledger"])
def test_fence_ledger_killed_mid_write(
    procs: Procs, lock_dir: Path, work: Path, env: dict[str, str], explicit: bool
) -> None:
    ledger = work / "ledger.json" if explicit else lock_dir / "ledger.json"
    extra = ["--ledger", str(ledger)] if explicit else []

    def fence(n: int, e: dict[str, str] | None = None) -> Result:
        return procs.run([PEARING_GUARD, "fence", "--resource", "branch:x", "--fence", str(n), *extra], env=e)

    assert fence(5).returncode == 0
    before = ledger.read_bytes()
    assert json.loads(before) == {"branch:x": 5}

    r = fence(7, armed(env, "mid-ledger"))
    faulted_at = time.monotonic()
    assert r.returncode == SIGKILLED, r
    assert ledger.read_bytes() == before, "the ledger changed although the writer died before writing"
    assert [p.name for p in ledger.parent.iterdir() if p.name.startswith(".tmp")] == []

    # The ledger's flock died with the writer: the next caller is not blocked, a stale fence is
    # still refused against the old value, and a later fence is accepted.
    stale = fence(4)
    assert stale.returncode == REFUSED, stale
    assert len(stale.err_lines) == 1 and "4 < 5" in stale.err_lines[0], stale
    later = fence(6)
    recovered = time.monotonic() - faulted_at
    assert later.returncode == 0, later
    assert later.elapsed < RECOVERY_BOUND, later
    assert json.loads(ledger.read_bytes()) == {"branch:x": 6}
    print(f"RECOVERY mid-ledger/{'explicit' if explicit else 'default'}: next fence accepted {recovered:.3f} s after")
    assert fence(5).returncode == REFUSED


# -- the pearing-cli agent dies while taking ownership -----------------------------------------


@pytest.mark.local_only("after-flock, after-fence-bump and after-token-file are steps of the lock dir's code")
@pytest.mark.parametrize("point", HOLDER_POINTS)
def test_cli_agent_killed_while_taking_ownership(
    procs: Procs, work: Path, lock_dir: Path, env: dict[str, str], point: str
) -> None:
    """acquire-lock must never report a ticket held (exit 0) whose holder is already dead."""
    log = FenceLog(work)
    assert procs.pr_run("--job", "J", "--", *log.command("first")).returncode == 0
    u = str(uuid.uuid4())
    r = procs.run(
        [PEARING_CLI, "acquire-lock", "J", "--request-uuid", u, "--lease-seconds", "30"], env=armed(env, point)
    )
    faulted_at = time.monotonic()
    assert r.returncode == REFUSED, f"acquire-lock whose agent died must say so: {r!r}"
    assert len(r.err_lines) == 1 and "holder gone" in r.err_lines[0], r
    shown = json.loads(r.stdout)
    assert shown["state"] not in ("held", "waiting"), shown
    if shown.get("fence") is not None:
        log.path.write_text(log.path.read_text() + f"cli {shown['fence']}\n")
    check_recovery(LOCAL, procs, lock_dir, log, f"cli-agent/{point}", faulted_at)


@pytest.mark.local_only("lock dir fault points, and it reads the ticket records before anything sweeps them")
def test_no_stale_held_record_after_holder_faults(
    procs: Procs, work: Path, lock_dir: Path, env: dict[str, str]
) -> None:
    """Right after pearing-run reports its holder died (exit 70), nothing claims to hold the lock:
    no record in state held and no token file, before any other run has come along to sweep."""
    for point in HOLDER_POINTS:
        r = procs.pr_run("--job", "J", "--", "true", env=armed(env, point))
        assert r.returncode == SOFTWARE, (point, r)
        assert held_records(lock_dir, "J") == [], (point, held_records(lock_dir, "J"))
        assert token_files(lock_dir) == [], point
    assert os.path.isdir(store_dir(lock_dir, "J"))


@pytest.mark.local_only("holds the lock dir's hand-over window open with guard.lock and watches its queue dir")
def test_same_uuid_retry_waits_through_a_hand_over(procs: Procs, lock_dir: Path) -> None:
    """Found by the state machine in test_props: a retry of acquire-lock with the waiter's own
    request uuid and a wait, made while that waiter is between leaving the line and recording
    itself held, must wait for the hand-over instead of answering "still waiting" (75) at once.
    The window is held open by keeping guard.lock shared, as an in-flight guarded command does."""

    def acquire(u: str, wait: str) -> Any:
        return [PEARING_CLI, "acquire-lock", "J", "--request-uuid", u, "--lease-seconds", "30", "--wait-seconds", wait]

    ua, ub = str(uuid.uuid4()), str(uuid.uuid4())
    a = procs.run(acquire(ua, "0"))
    assert a.returncode == 0, a
    b = procs.run(acquire(ub, "0"))
    assert b.returncode == 75, b
    tb = json.loads(b.stdout)["ticket_id"]
    holder = json.loads(a.stdout)["holder_pid"]
    queue_dir = store_dir(lock_dir, "J") / "queue"

    guard = os.open(store_dir(lock_dir, "J") / "guard.lock", os.O_RDWR)
    try:
        fcntl.flock(guard, fcntl.LOCK_SH)
        os.kill(holder, signal.SIGKILL)  # the kernel frees the lock; B's agent leaves the line
        wait_for(lambda: not [n for n in os.listdir(queue_dir) if n.endswith(tb)], 10, "B to leave the line")
        retry = procs.start(acquire(ub, "10"))
        with pytest.raises(subprocess.TimeoutExpired):
            retry.wait(timeout=1.0)
    finally:
        os.close(guard)
    r = procs.finish(retry)
    assert r.returncode == 0, r
    shown = json.loads(r.stdout)
    assert (shown["ticket_id"], shown["state"]) == (tb, "held"), shown
    assert shown["fence"] > json.loads(a.stdout)["fence"]
