"""A storm on four slots: 40 contenders of one lock with ``--slots 4``, and a seeded nemesis that
kills wrappers, holders and COMMANDs with -9 at random moments. Checked by the nemesis campaign's
checker (tests/test_nemesis.py), slot by slot: within a slot no two COMMANDs overlap and fences
only rise; over the lock, never more than four COMMANDs at once and no fence issued twice.

The nemesis faults one process of a run, never its wrapper and its holder both (as the campaign):
with both killed nothing keeps the slot while COMMAND runs on. It did that now and then: the
likely cause of "5 at once on 4 slots" in CI (the last time, two COMMANDs of one slot overlapped
and both ran to their end, as an orphaned COMMAND does; a storm that killed both of a run on
purpose showed "5 at once" in 3 runs of 3).

A COMMAND's interval ends at its end line or, killed, when the campaign's watcher last found it
alive (its pidfd not readable): certainly alive until then. The watcher sees a death only when
it next looks, and under load that can be late enough for a successor's start to land in
between. Both counts are printed. Each COMMAND notes its pid and slot, then execs the
campaign's COMMAND: one pid, so the watcher's step and the slot meet by pid.
"""

from __future__ import annotations

import dataclasses
import json
import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path

from helpers import PEARING_CLI, Procs, q, wait_for
from test_nemesis import Step, Watcher, check

_SEED = int(os.environ.get("NEMESIS_SEED", "25"))
_SLOTS = 4
_CONTENDERS = 40
_KILLS = 12  # of the wrapper, holder or COMMAND of a run holding a slot
_ALIVE = 12
_COMMAND = str(Path(__file__).with_name("nemesis_command.py"))


def _most_at_once(steps: list[Step], *, certain: bool = False) -> tuple[int, list[Step]]:
    """The most COMMANDs alive at one moment, and which. ``certain``: a killed COMMAND counts only
    until the watcher last found it alive, not until it saw it dead (how late the watcher looks
    is not the product's)."""

    def stop(s: Step) -> int:
        return s.alive_ns if certain and s.end_ns is None and s.alive_ns is not None else s.stop_ns

    # At one instant, ends before starts: intervals that touch do not overlap. A step whose
    # interval is that one instant (killed as it started) ends before it starts, and never counts.
    events = sorted([(s.start_ns, 1, i) for i, s in enumerate(steps)] + [(stop(s), -1, i) for i, s in enumerate(steps)])
    level = [0] * len(steps)
    most: tuple[int, list[Step]] = (0, [])
    for _, step, i in events:
        level[i] += step
        alive = [j for j, n in enumerate(level) if n > 0]
        if len(alive) > most[0]:
            most = (len(alive), [steps[j] for j in alive])
    return most


def _parent(pid: int) -> int | None:
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            data = f.read()
    except FileNotFoundError:
        return None
    ppid = int(data[data.rindex(b")") + 2 :].split()[1])
    return ppid if ppid > 1 else None


def _holders(procs: Procs) -> list[tuple[int, int]]:
    """(pid, fence) of each holder ``pearing-cli status`` lists."""
    out = procs.run_text([PEARING_CLI, "status", "S", "--json"])
    locks = json.loads(out.stdout or "[]")
    held = locks[0]["holders"] if locks else []
    return [(int(h["holder_pid"]), int(h["fence"])) for h in held if h.get("holder_pid") and h.get("fence")]


def test_a_storm_with_kills_on_four_slots(backend: str, procs: Procs, work: Path) -> None:
    rng = random.Random(_SEED)
    log, slots = work / "log", work / "slots"
    watcher = Watcher(log)
    watcher.start()
    ps: list[subprocess.Popen[bytes]] = []

    def spawn() -> None:
        cid = len(ps)
        hold = rng.choice(["0.3", "0.6", "1.0"])
        command = (
            f'echo "$$ $PEARING_SLOT $PEARING_FENCE" >> {q(slots)}; '
            f"exec {q(sys.executable)} {q(_COMMAND)} run {q(log)} {cid} hold={hold}"
        )
        flags = ("--job", "S", "--slots", str(_SLOTS), "--lease-seconds", "3", "--kill-grace", "1")
        ps.append(procs.pr(*flags, "--wait-seconds", "120", "--", "sh", "-c", command))

    kills: list[tuple[str, int]] = []
    # The runs (by fence) whose wrapper or holder was killed: the other one is spared. SPEC's
    # promise is for a fault of one process, as the campaign's (tests/test_nemesis.py): with both
    # killed, nothing is left to keep the slot while COMMAND runs on, and the next run takes it
    # (a storm that killed both of one run on purpose showed "5 at once" 3 times in 3; the random
    # one did now and then, in CI). Fencing still holds then: tests/test_hardening.py.
    faulted: set[int] = set()
    deadline = time.monotonic() + 180
    while (len(ps) < _CONTENDERS or any(p.poll() is None for p in ps)) and time.monotonic() < deadline:
        # A steady storm, as the campaign's rounds are: up to 12 runs alive, 40 in all.
        while len(ps) < _CONTENDERS and sum(p.poll() is None for p in ps) < _ALIVE:
            spawn()
        time.sleep(rng.uniform(0.2, 0.6))
        kind = rng.choice(["wrapper", "holder", "command", "none"]) if len(kills) < _KILLS else "none"
        if kind == "wrapper":  # the pearing-run of a run whose COMMAND is running
            found = [(p, s.fence) for s in watcher.live() if s.fence not in faulted and (p := _parent(s.pid))]
            victims = found[:1]
        elif kind == "holder":
            found = [h for h in _holders(procs) if h[1] not in faulted]
            victims = [rng.choice(found)] if found else []
        elif kind == "command":
            victims = [(rng.choice(live_steps).pid, 0)] if (live_steps := watcher.live()) else []
        else:
            victims = []
        for pid, fence in victims:
            try:
                os.kill(pid, signal.SIGKILL)
                kills.append((kind, pid))
            except ProcessLookupError:
                continue
            if kind != "command":
                faulted.add(fence)
    for p in ps:
        procs.finish(p, timeout=60)
    # Killed wrappers leave their holders to end their runs: every COMMAND goes in time.
    wait_for(lambda: not watcher.live(), 60, "every COMMAND to end")
    watcher.finish(30)
    assert not watcher.problems, watcher.problems
    assert kills, "the nemesis killed nothing"

    slot_of = {}
    for line in slots.read_text().splitlines():
        pid, slot, fence = line.split()
        slot_of[int(pid)] = (int(slot), int(fence))
    steps = watcher.steps
    assert len(steps) >= _CONTENDERS - _KILLS, f"only {len(steps)} COMMANDs ran"
    assert all(s.pid in slot_of and slot_of[s.pid][1] == s.fence for s in steps)
    assert {slot_of[s.pid][0] for s in steps} <= set(range(_SLOTS))
    summary = f"seed {_SEED}: {len(steps)} COMMANDs, {len(kills)} kills {kills}"
    t0 = min(s.start_ns for s in steps)
    # Counted while each COMMAND was certainly alive: a killed one until the watcher last found
    # it alive. Until it saw it dead, it may be more by the watcher's own lateness under load.
    most, which = _most_at_once(steps, certain=True)
    seen = "\n".join(f"slot {slot_of[s.pid][0]}: {s.describe(t0)}" for s in which)
    print(f"{summary}: at most {_most_at_once(steps)[0]} at once, {most} certainly:\n{seen}")
    assert most <= _SLOTS, f"{summary}: {most} at once:\n{seen}"
    fences = [s.fence for s in steps]
    assert len(fences) == len(set(fences)), f"{summary}: a fence issued twice"
    for slot in range(_SLOTS):
        verdict = check([_certain(s) for s in steps if slot_of[s.pid][0] == slot], [])
        assert not verdict.violations(), f"{summary}, slot {slot}: {verdict.violations()}"


def _certain(s: Step) -> Step:
    """``s`` as certainly alive: a killed COMMAND until the watcher last found it alive."""
    if s.end_ns is None and s.alive_ns is not None:
        return dataclasses.replace(s, dead_ns=s.alive_ns, dead_seen="pidfd (alive until)")
    return s


def test_the_count_is_of_commands_certainly_alive_at_once() -> None:
    """A killed COMMAND counts until the watcher last found it alive; one that started before
    then overlaps it for certain, one that started after may have started after its death."""
    killed = Step(fence=1, start_ns=0, pid=1, stime=0, cid=0, dead_ns=200, dead_seen="pidfd", alive_ns=100)
    after = Step(fence=2, start_ns=150, pid=2, stime=0, cid=1, end_ns=400)
    before = Step(fence=3, start_ns=50, pid=3, stime=0, cid=2, end_ns=400)
    assert _most_at_once([killed, after])[0] == 2
    assert _most_at_once([killed, after], certain=True)[0] == 1
    assert _most_at_once([killed, before], certain=True)[0] == 2
    assert check([_certain(killed), after], []).overlaps == []
    assert check([_certain(killed), before], []).overlaps != []
    # Killed as it started (the watcher never found it alive after its start line): a point.
    instant = Step(fence=4, start_ns=300, pid=4, stime=0, cid=3, dead_ns=320, dead_seen="pidfd", alive_ns=300)
    assert _most_at_once([instant, after], certain=True)[0] == 1
    assert _most_at_once([instant], certain=True)[0] == 0
