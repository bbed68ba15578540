"""The holder a run forks as it joins the line (the standby holder), on every backend: handed the
grip once the run is first (the lock dir's flocked fd over a socketpair, SCM_RIGHTS), so no fork
lies between the previous run's release and COMMAND's start. Where its faults could differ from a
holder forked with the lock in hand: the standby dying while its run waits, and the run dying
between its flock and the hand-over."""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path

import pytest
from helpers import Gate, Procs, pid_alive, q, wait_for, wait_queued

from singleflight.core.const import ENV_FAULT, ENV_FENCE


def _child_of(parent: int) -> int | None:
    """A live child of ``parent``: a waiting run has one, its standby holder."""
    for name in os.listdir("/proc"):
        if name.isdigit():
            try:
                data = Path(f"/proc/{name}/stat").read_bytes()
            except OSError:
                continue
            fields = data[data.rindex(b")") + 2 :].split()
            if int(fields[1]) == parent and fields[0] not in (b"Z", b"X"):
                return int(name)
    return None


def _fences(log: Path) -> list[tuple[str, int]]:
    return [(tag, int(fence)) for tag, fence in (line.split() for line in log.read_text().splitlines())]


def _logged(log: Path, tag: str, then: str = "true") -> list[str]:
    return ["sh", "-c", f'echo "{tag} ${ENV_FENCE}" >> {q(log)}; {then}']


def test_a_standby_holder_killed_while_its_run_waits_is_replaced_once_the_run_is_first(
    backend: str, procs: Procs, work: Path
) -> None:
    """kill -9 of the holder B forked as it joined the line: once first, B forks a fresh holder
    with the lock in hand (the hand-over found nobody to take it) and its COMMAND runs, after
    A's, with a higher fence; the lock is free after it."""
    log, gate = work / "fences", Gate(work)
    a = procs.pr("--job", "sb", "--", *_logged(log, "A", gate.script()))
    gate.wait_ready()
    b = procs.pr("--job", "sb", "--wait-seconds", "60", "--", *_logged(log, "B"))
    wait_queued(procs, "sb", 1)
    standby = int(wait_for(lambda: _child_of(b.pid), 15, "B's standby holder"))
    os.kill(standby, signal.SIGKILL)
    wait_for(lambda: not pid_alive(standby), 15, "B's standby holder to die")
    gate.open()
    assert procs.finish(a).returncode == 0
    rb = procs.finish(b)
    assert rb.returncode == 0, rb
    assert rb.err_lines == [], rb
    (ta, fa), (tb, fb) = _fences(log)
    assert (ta, tb) == ("A", "B") and fb > fa, _fences(log)
    c = procs.pr_run("--job", "sb", "--wait-seconds", "0", "--", "true")
    assert c.returncode == 0, c


@pytest.mark.local_only("mid-promotion, right after the flock is granted, is a step of the lock dir's queue")
def test_a_run_killed_between_its_flock_and_the_hand_over_frees_the_lock_and_its_standby_holder(
    procs: Procs, work: Path, env: dict[str, str]
) -> None:
    """kill -9 of the run A right after the kernel granted it the flock, before the fd went to
    its standby holder: nobody else has the fd, so the lock is free at once and B, next in
    line, takes it; A's standby holder sees its channel close and exits without touching it."""
    log, gate = work / "fences", Gate(work)
    h = procs.pr("--job", "mp", "--", *_logged(log, "H", gate.script()))
    gate.wait_ready()
    armed = dict(env, **{ENV_FAULT: "mid-promotion"})
    a = procs.pr("--job", "mp", "--wait-seconds", "60", "--", *_logged(log, "A"), env=armed)
    wait_queued(procs, "mp", 1)
    standby = int(wait_for(lambda: _child_of(a.pid), 15, "A's standby holder"))
    b = procs.pr("--job", "mp", "--wait-seconds", "60", "--", *_logged(log, "B"))
    wait_queued(procs, "mp", 2)
    gate.open()
    released = time.monotonic()
    assert procs.finish(h).returncode == 0
    assert procs.finish(a).returncode == -signal.SIGKILL
    rb = procs.finish(b)
    served = time.monotonic() - released
    assert rb.returncode == 0, rb
    assert served < 5.0, f"B waited {served:.3f} s after H let go: the lock was not free at once"
    wait_for(lambda: not pid_alive(standby), 5, "A's standby holder to exit")
    assert [tag for tag, _ in _fences(log)] == ["H", "B"], _fences(log)
    st = procs.pr_run("--job", "mp", "--wait-seconds", "0", "--", "true")
    assert st.returncode == 0, st
