"""Event-driven concurrency: --queue latest replaces older pending runs; --cancel-in-progress
stops an opted-in holder the safe way (token dead, TERM/KILL, then a larger fence)."""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

from helpers import PEARING_CLI, PEARING_GUARD, Gate, Procs, q, wait_for
from test_hardening import intervals, logged, started

from singleflight.core.const import ExitCode
from singleflight.core.errors import BackendUnavailable


def waiters(procs: Procs, job: str) -> list[dict[str, object]]:
    out = procs.run_text([PEARING_CLI, "status", job, "--json"])
    locks = json.loads(out.stdout or "[]")
    return list(locks[0]["waiters"]) if locks else []


def test_a_newer_latest_waiter_replaces_the_older_and_fifo_waiters_keep_their_order(
    backend: str, procs: Procs, work: Path
) -> None:
    log = work / "log"
    gate = Gate(work)
    holder = procs.pr("--job", "t42", "--", "sh", "-c", gate.script())
    gate.wait_ready()
    f1 = procs.pr("--job", "t42", "--wait-seconds", "60", "--", *logged(log, "F1", seconds=0))
    wait_for(lambda: len(waiters(procs, "t42")) == 1, 15, "F1 to queue")
    latest = ("--job", "t42", "--queue", "latest", "--wait-seconds", "60", "--")
    l1 = procs.pr("-v", *latest, *logged(log, "L1", seconds=0))
    wait_for(lambda: len(waiters(procs, "t42")) == 2, 15, "L1 to queue")
    assert [w["queue_mode"] for w in waiters(procs, "t42")] == ["fifo", "latest"]
    f2 = procs.pr("--job", "t42", "--wait-seconds", "60", "--", *logged(log, "F2", seconds=0))
    wait_for(lambda: len(waiters(procs, "t42")) == 3, 15, "F2 to queue")
    half = time.monotonic() + 0.5
    wait_for(lambda: time.monotonic() >= half, 5, "half a second between the two events")
    arrived = time.monotonic()
    l2 = procs.pr(*latest, *logged(log, "L2", seconds=0))
    r1 = procs.finish(l1, timeout=30)
    assert r1.returncode == ExitCode.BUSY, r1
    assert time.monotonic() - arrived < 5.0  # at once, not after the holder: generous on a loaded VM
    assert any(line.startswith("pearing-run: superseded lock=t42 by=") for line in r1.err_lines), r1
    gate.open()
    for p in (holder, f1, f2, l2):
        assert procs.finish(p, timeout=60).returncode == 0
    spans = intervals(log)
    assert "L1" not in spans, "a superseded waiter ran"
    # FIFO waiters in their order; L2 took L1's place (between F1 and F2).
    order = sorted(spans, key=lambda name: spans[name][0])
    assert order == ["F1", "L2", "F2"], order


def test_cancel_in_progress_stops_an_opted_in_holder_safely(backend: str, procs: Procs, work: Path) -> None:
    log = work / "log"
    old = procs.pr(
        "-v", "--job", "c42", "--cancel-in-progress", "--kill-grace", "5", "--",
        "sh", "-c", f"echo $PEARING_FENCE > {q(work / 'old.fence')}; echo $PEARING_TOKEN_FILE > {q(work / 'old.tf')}; "
        f"exec {sys.executable} {Path(__file__).with_name('interval_cmd.py')} {q(log)} OLD 60 0.5",
    )  # fmt: skip
    wait_for(lambda: started(log, "OLD"), 15, "the old run to start")
    token_file = (work / "old.tf").read_text().strip()
    new = procs.pr(
        "--job", "c42", "--cancel-in-progress", "--", "sh", "-c",
        f"echo $PEARING_FENCE > {q(work / 'new.fence')}; exec {sys.executable} "
        f"{Path(__file__).with_name('interval_cmd.py')} {q(log)} NEW 0",
    )  # fmt: skip
    r_old = procs.finish(old, timeout=60)
    assert r_old.returncode == ExitCode.BUSY, r_old
    assert any("superseded lock=c42 by=" in line for line in r_old.err_lines), r_old
    assert procs.finish(new, timeout=60).returncode == 0
    spans = intervals(log)
    old_end = spans["OLD"][1]
    assert old_end is not None and spans["NEW"][0] >= old_end, spans
    assert int((work / "new.fence").read_text()) > int((work / "old.fence").read_text())
    verdict = procs.run([PEARING_GUARD, "verify", "--token-file", token_file])
    assert verdict.returncode == ExitCode.REFUSED, verdict


def test_a_holder_that_did_not_opt_in_is_never_cancelled(backend: str, procs: Procs, work: Path) -> None:
    gate = Gate(work)
    holder = procs.pr("--job", "n42", "--", "sh", "-c", gate.script())
    gate.wait_ready()
    new = procs.pr_run("--job", "n42", "--cancel-in-progress", "--", "true")
    assert new.returncode == ExitCode.BUSY, new
    gate.open()
    assert procs.finish(holder).returncode == 0


def test_status_shows_queue_mode_and_a_holder_being_cancelled(backend: str, procs: Procs, work: Path) -> None:
    gate = Gate(work)
    holder = procs.pr("--job", "s42", "--queue", "latest", "--cancel-in-progress", "--", "sh", "-c", gate.script())
    gate.wait_ready()
    status = procs.run_text([PEARING_CLI, "status", "s42", "--json"]).json[0]
    assert status["holder"]["cancel_in_progress"] is True and status["holder"]["superseded_by"] is None
    waiter = procs.pr("--job", "s42", "--queue", "latest", "--wait-seconds", "30", "--", "true")
    wait_for(lambda: waiters(procs, "s42"), 15, "the waiter to queue")
    assert waiters(procs, "s42")[0]["queue_mode"] == "latest"
    gate.open()
    assert procs.finish(holder).returncode == 0
    assert procs.finish(waiter).returncode == 0


def test_the_lock_api_takes_queue_and_cancel_in_progress(backend: str, procs: Procs, work: Path) -> None:
    gate = Gate(work)
    holder = procs.pr("--job", "a42", "--cancel-in-progress", "--kill-grace", "2", "--", "sh", "-c", gate.script())
    gate.wait_ready()
    code = (
        "from singleflight import Lock\n"
        "with Lock('a42', queue='latest', cancel_in_progress=True, wait_seconds=5) as held:\n"
        "    print(held.fence, held.promoted)\n"
    )
    r = procs.run([sys.executable, "-c", code], timeout=60)
    assert r.returncode == 0, r
    fence, promoted = r.stdout.split()
    assert int(fence) >= 2 and promoted == b"True"
    assert procs.finish(holder).returncode == ExitCode.BUSY


def test_a_latest_lock_waiter_is_superseded_by_a_newer_latest_run(backend: str, procs: Procs, work: Path) -> None:
    """A ticket of the agent's (``Lock``, pearing-cli) is in line from its creation: a newer
    `latest` run takes its place all the same, and the ``Lock`` is Busy without entering."""
    log = work / "log"
    gate = Gate(work)
    holder = procs.pr("--job", "w42", "--", "sh", "-c", gate.script())
    gate.wait_ready()
    code = (
        "from singleflight import Busy, Lock\n"
        "try:\n"
        "    with Lock('w42', queue='latest', wait_seconds=60):\n"
        "        print('entered')\n"
        "except Busy as exc:\n"
        "    print('busy', exc.ticket['state'], exc.ticket['superseded_by'])\n"
    )
    old = procs.start([sys.executable, "-c", code])
    wait_for(lambda: [w["queue_mode"] for w in waiters(procs, "w42")] == ["latest"], 15, "the Lock to queue")
    (before,) = waiters(procs, "w42")
    new = procs.pr("--job", "w42", "--queue", "latest", "--wait-seconds", "60", "--", *logged(log, "NEW", seconds=0))
    r = procs.finish(old, timeout=30)
    assert r.returncode == 0, r
    word, state, by = r.stdout.decode().split()
    assert (word, state) == ("busy", "cancelled"), r
    (after,) = waiters(procs, "w42")
    assert after["ticket_id"] == by != before["ticket_id"] and after["queue_position"] == 1
    gate.open()
    assert procs.finish(holder).returncode == 0
    assert procs.finish(new, timeout=60).returncode == 0
    assert "NEW" in intervals(log)


def test_latest_runs_arriving_at_once_leave_exactly_one_pending(backend: str, procs: Procs, work: Path) -> None:
    """Ten `latest` runs at once behind a holder: exactly one is left in line; the nine
    others exit busy, superseded, and never run. On the lock dir a superseded waiter is poked
    (with SIGUSR1 it was killed, exit -10, by a poke that landed before its handler was in
    place or after it stopped waiting); on etcd the takeovers race as compare-and-swaps."""
    log = work / "log"
    gate = Gate(work)
    holder = procs.pr("--job", "at-once", "--", "sh", "-c", gate.script())
    gate.wait_ready()
    latest = ("-v", "--job", "at-once", "--queue", "latest", "--wait-seconds", "120", "--")
    runs = [procs.pr(*latest, *logged(log, f"L{i}", seconds=0)) for i in range(10)]
    wait_for(lambda: sum(p.poll() is not None for p in runs) == 9, 60, "nine runs superseded")
    (pending,) = [p for p in runs if p.poll() is None]
    for p in runs:
        if p is not pending:
            r = procs.finish(p)
            assert r.returncode == ExitCode.BUSY, r
            assert any(ln.startswith("pearing-run: superseded lock=at-once by=") for ln in r.err_lines), r
    assert len(waiters(procs, "at-once")) == 1
    gate.open()
    assert procs.finish(holder).returncode == 0
    assert procs.finish(pending, timeout=60).returncode == 0
    assert len(intervals(log)) == 1


class _Unreachable:
    """A store out of reach as a holder acts on a cancel request: every read fails."""

    def read(self, ticket_id: str) -> None:
        raise BackendUnavailable("test://", "out of reach")

    def update(self, ticket_id: str, change: object) -> None:
        raise BackendUnavailable("test://", "out of reach")


class _NotEnded:
    """A holder's lease whose judged end could not be written (the store out of reach)."""

    def __init__(self) -> None:
        from singleflight.core.ticket import Ticket

        self.ticket = Ticket(
            ticket_id="t", request_uuid="r", lock_name="j", repo="default", identity="i", lease_seconds=3.0
        )
        self.ticket.superseded_by = "newcomer"

    def end(self, state: str, reason: object, keep: object = None) -> bool:
        return False


def test_a_cancel_acted_on_with_the_store_out_of_reach_leaves_the_request_for_the_next_look() -> None:
    """In-process, the rule alone: the holder's judged end did not happen and the store cannot be
    read to clear the request. The holder goes on (None), it does not die of the error: the
    request is judged again at its next look (before, the store's own end caught it)."""
    from singleflight.rules import events

    lease = _NotEnded()
    assert events.act(_Unreachable(), lease, command_ended=lambda: False, keep=lambda: None) is None  # type: ignore[arg-type]
