"""A wrapper killed between COMMAND's spawn and its ``started`` word: the holder adopts COMMAND
by what only COMMAND's environment holds, never a process that merely looks like it.

The ticket id is public (``pearing-cli status`` shows it), so a process carrying
``PEARING_TICKET=<id>`` is no proof; nor is a process the run itself left behind before
COMMAND (a --skip-if check's daemon carries the run's whole environment). Adopting either used
to let the lock go while the real COMMAND ran (a second COMMAND beside it), or keep it for a
process that was never COMMAND. Each COMMAND logs CLOCK_MONOTONIC start / end stamps
(tests/interval_cmd.py), so an overlap is measured.
"""

from __future__ import annotations

import json
import signal
import subprocess
from pathlib import Path

from helpers import PEARING_CLI, Procs, pid_alive, proc_state, q, wait_for
from test_hardening import intervals, logged, started

from singleflight.core import protocol
from singleflight.core.const import ENV_FAULT, ENV_TICKET, ExitCode

# Not through pipes: reading them to EOF would wait for COMMAND, which inherits them.
QUIET = {"stdout": subprocess.DEVNULL, "stderr": subprocess.DEVNULL}


def _held_ticket(procs: Procs, job: str) -> str:
    def find() -> str | None:
        locks = json.loads(procs.run_text([PEARING_CLI, "status", job, "--json"]).stdout or "[]")
        holder = locks[0]["holder"] if locks else None
        return str(holder["ticket_id"]) if holder else None

    return str(wait_for(find, 15, f"{job}'s holder in status"))


def _paused(pid: int) -> bool:
    return proc_state(pid) == "T"


def test_a_process_carrying_only_the_public_ticket_id_is_not_taken_for_command(
    backend: str, procs: Procs, work: Path, env: dict[str, str]
) -> None:
    """The impostor starts after the holder heard ``spawning``, before COMMAND, with the ticket id
    ``pearing-cli status`` showed. The holder used to adopt the oldest process carrying the id:
    the impostor; when it exited, the lock went to B while A's COMMAND still ran."""
    log = work / "log"
    armed = dict(env, **{ENV_FAULT: "pause-command-spawn,after-command-spawn"})
    a = procs.pr("--job", "imp", "--", *logged(log, "A", seconds=5), env=armed, **QUIET)
    wait_for(lambda: _paused(a.pid), 15, "the wrapper to pause right before COMMAND's spawn")
    ticket = _held_ticket(procs, "imp")
    impostor = procs.start(["sleep", "2"], env=dict(env, **{ENV_TICKET: ticket}), **QUIET)
    a.send_signal(signal.SIGCONT)
    assert a.wait(15) == -signal.SIGKILL  # killed right after the spawn, before ``started``
    wait_for(lambda: started(log, "A"), 15, "A's COMMAND to start")
    b = procs.pr_run("--job", "imp", "--wait-seconds", "30", "--", *logged(log, "B", seconds=0))
    assert b.returncode == 0, b
    assert impostor.wait(15) == 0
    wait_for(lambda: "A end" in log.read_text(), 15, "A's COMMAND to run to its end")
    spans = intervals(log)
    a_end = spans["A"][1] or 0.0
    assert spans["B"][0] >= a_end, f"B started {a_end - spans['B'][0]:.3f} s before A ended (the impostor was adopted)"


def test_what_the_skip_if_check_left_running_is_not_taken_for_command(
    backend: str, procs: Procs, work: Path, env: dict[str, str]
) -> None:
    """The --skip-if check starts a daemon (its own session, the run's whole environment: ticket
    and token) and says "not done"; the wrapper is killed right after telling its holder that
    COMMAND is next, before spawning it. No COMMAND ever ran, so the lock is free at once. The
    holder used to adopt the daemon, as older than any COMMAND, and keep the lock for its life."""
    pidfile = work / "daemon.pid"
    # A tenth of a second between the daemon's start and the check's end: more than a clock tick
    # of /proc's start times, so the daemon is measurably older than the ``spawning`` word.
    check = f"setsid sh -c 'echo $$ > {q(pidfile)}; exec sleep 30' </dev/null >/dev/null 2>&1 & sleep 0.1; exit 1"
    armed = dict(env, **{ENV_FAULT: "pause-command-spawn"})
    a = procs.pr("--job", "left", "--skip-if", check, "--", "touch", str(work / "ran"), env=armed, **QUIET)
    wait_for(lambda: _paused(a.pid), 15, "the wrapper to pause before the check's spawn")
    a.send_signal(signal.SIGCONT)
    daemon = int(wait_for(lambda: pidfile.exists() and pidfile.read_text().strip(), 15, "the check's daemon"))
    # The wrapper cannot pause again before the check has ended: this is the pause before COMMAND.
    wait_for(lambda: _paused(a.pid), 15, "the wrapper to pause before COMMAND's spawn")
    a.kill()
    assert a.wait(15) == -signal.SIGKILL
    b = procs.pr_run("--job", "left", "--wait-seconds", "10", "--", "true")
    assert b.returncode == 0, f"the lock was kept for the check's daemon: {b}"
    assert pid_alive(daemon), "the daemon is to outlive the wait above"
    assert not (work / "ran").exists()


def test_the_spawning_word_carries_its_stamp_and_a_garbled_one_is_an_error_never_a_crash() -> None:
    assert protocol.decode(protocol.spawning(12345).encode()).stamp == 12345
    for line in ("spawning", "spawning -1", "spawning 1.5", "spawning 1 2", "spawning \u0661", "spawning x" * 99):
        msg = protocol.decode(line)
        assert msg.kind == protocol.ERROR and msg.code == ExitCode.SOFTWARE, line
