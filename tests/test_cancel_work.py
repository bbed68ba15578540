"""--cancel-in-progress never loses the work (SPEC 15): a cancel is withdrawn when its newcomer
leaves before taking the lock (its wait ran out, it was killed), and a run whose COMMAND had
already succeeded when the cancel came exits 0 with its request recorded.

The old run's holder is kept from acting on the cancel in time in the two ways it happens in
the field: its COMMAND inside a ``pearing-guard exec`` (the end of a lease waits for guarded
commands) and the holder frozen (SIGSTOP)."""

from __future__ import annotations

import os
import signal
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from helpers import PEARING_GUARD, Gate, Procs, lock_status, pid_alive, q, wait_for, wait_line

from singleflight.core.const import ExitCode

# The old run's kill grace: a newcomer waits for it and 5 s more (6 s), however long the old
# run's guarded command lasts.
GRACE = "1"


def settled_holder(procs: Procs, job: str, wrapper: int) -> dict[str, Any]:
    """The lock's holder as status shows it, once it names the holder process (on etcd the
    holder records its own pid a moment after COMMAND started; until then the wrapper's)."""

    def found() -> dict[str, Any] | None:
        h = lock_status(procs, job)["holder"]
        return h if h and h.get("holder_pid") and h["holder_pid"] != wrapper else None

    holder = wait_for(found, 15, "the holder to settle")
    assert isinstance(holder, dict)
    return holder


def cancel_asked(procs: Procs, job: str) -> str:
    """Wait until the holder's ticket names the newcomer that asked it to stop."""

    def asked() -> str | None:
        h = lock_status(procs, job)["holder"]
        return h["superseded_by"] if h and h.get("superseded_by") else None

    return str(wait_for(asked, 15, "the cancel request to be recorded"))


@contextmanager
def frozen(pid: int) -> Iterator[None]:
    os.kill(pid, signal.SIGSTOP)
    try:
        yield
    finally:
        os.kill(pid, signal.SIGCONT)


def old_run(procs: Procs, job: str, script: str, *extra: str) -> Any:
    return procs.pr("-v", "--job", job, "--cancel-in-progress", "--kill-grace", GRACE, *extra, "--", "sh", "-c", script)


def newcomer(procs: Procs, job: str, work: Path, *, wait: str) -> Any:
    return procs.pr(
        "--job", job, "--cancel-in-progress", "--kill-grace", GRACE, "--wait-seconds", wait,
        "--", "touch", str(work / "newcomer.ran"),
    )  # fmt: skip


def guarded_script(work: Path) -> str:
    """COMMAND: inside pearing-guard exec until the test opens ``guard.go``, then its work (a
    marker), exit 0."""
    inside, go = q(work / "inside"), q(work / "guard.go")
    wait = f"touch {inside}; while [ ! -e {go} ]; do sleep 0.02; done"
    return f"{PEARING_GUARD} exec -- sh -c {q(wait)} && echo done > {q(work / 'work.done')}"


def assert_old_run_did_its_work(procs: Procs, old: Any, work: Path) -> None:
    r_old = procs.finish(old, timeout=60)
    assert r_old.returncode == 0, r_old
    assert not any("superseded" in line for line in r_old.err_lines), r_old
    assert wait_line(work / "work.done") == "done"


def test_a_newcomer_whose_wait_runs_out_during_a_guarded_command_withdraws_its_cancel(
    backend: str, procs: Procs, work: Path
) -> None:
    old = old_run(procs, "cw1", guarded_script(work))
    wait_for((work / "inside").exists, 15, "the old COMMAND to be inside pearing-guard exec")
    new = newcomer(procs, "cw1", work, wait="1")
    # Its wait (1 s), the old run's kill grace and 5 s more: it gives up while the guarded command
    # still runs (on the lock dir it once waited for that command, however long, to end its own
    # waiting ticket).
    r_new = procs.finish(new, timeout=30)
    assert r_new.returncode == ExitCode.BUSY, r_new
    assert r_new.elapsed < 20, r_new
    assert (work / "inside").exists() and not (work / "work.done").exists()
    (work / "guard.go").touch()
    assert_old_run_did_its_work(procs, old, work)
    assert not (work / "newcomer.ran").exists()


def test_a_newcomer_whose_wait_runs_out_while_the_holder_is_frozen_withdraws_its_cancel(
    backend: str, procs: Procs, work: Path
) -> None:
    gate = Gate(work)
    old = old_run(procs, "cw2", f"{gate.script()}; echo done > {q(work / 'work.done')}")
    gate.wait_ready()
    holder = settled_holder(procs, "cw2", old.pid)
    with frozen(int(holder["holder_pid"])):
        new = newcomer(procs, "cw2", work, wait="1")
        r_new = procs.finish(new, timeout=60)  # its kill grace and 5 s: the holder is frozen throughout
        assert r_new.returncode == ExitCode.BUSY, r_new
    gate.open()
    assert_old_run_did_its_work(procs, old, work)
    assert not (work / "newcomer.ran").exists()


def test_a_cancel_whose_newcomer_was_killed_is_not_acted_on(backend: str, procs: Procs, work: Path) -> None:
    old = old_run(procs, "cw3", guarded_script(work))
    wait_for((work / "inside").exists, 15, "the old COMMAND to be inside pearing-guard exec")
    new = newcomer(procs, "cw3", work, wait="60")
    cancel_asked(procs, "cw3")
    new.kill()
    new.wait(10)
    (work / "guard.go").touch()
    assert_old_run_did_its_work(procs, old, work)
    assert not (work / "newcomer.ran").exists()
    wait_for(lambda: lock_status(procs, "cw3")["state"] == "free", 15, "the lock to be free")


def test_a_cancel_that_comes_after_command_succeeded_leaves_the_run_a_success(
    backend: str, procs: Procs, work: Path
) -> None:
    """The holder frozen while COMMAND exits 0 and a newcomer asks it to stop: once resumed, it
    finds COMMAND ended, so the run exits 0 and its request is recorded (a replay is done)."""
    gate = Gate(work)
    runs, pid_file = work / "runs", work / "command.pid"
    script = f"echo $$ > {q(pid_file)}; echo run >> {q(runs)}; {gate.script()}"
    old = old_run(procs, "cw5", script, "--request-key", "event-5")
    gate.wait_ready()
    command = int(wait_line(pid_file))
    holder = settled_holder(procs, "cw5", old.pid)
    with frozen(int(holder["holder_pid"])):
        gate.open()
        wait_for(lambda: not pid_alive(command), 15, "COMMAND to exit")
        new = procs.pr("--job", "cw5", "--cancel-in-progress", "--wait-seconds", "60", "--", "true")
        cancel_asked(procs, "cw5")
    r_old = procs.finish(old, timeout=60)
    assert r_old.returncode == 0, r_old
    assert procs.finish(new, timeout=60).returncode == 0
    replay = procs.pr_run("--job", "cw5", "--request-key", "event-5", "--", "sh", "-c", f"echo run >> {q(runs)}")
    assert replay.returncode == 0, replay
    assert runs.read_text().splitlines() == ["run"]
