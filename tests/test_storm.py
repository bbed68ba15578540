"""Mutual exclusion under contention: storms of pearing-run, with and without kill -9.

Every contender runs its contested step inside ``pearing-guard exec`` and records
``start FENCE NS`` / ``end FENCE NS`` (``date +%s%N``) in its own file. Afterwards the
recorded intervals must not overlap and the fences must strictly increase in start order.
While a storm runs, tickets/ is sampled under the lock's record mutex: never two tickets
held at once. Counts are printed (``STORM ...``, run with ``-s``).

Both storms are local_only: they read the lock dir's ticket records while they run, and
a 50-run storm takes about three times as long on etcd. Mutual exclusion under
contention on both backends is test_run's ``test_concurrent_contenders_never_overlap``.
"""

from __future__ import annotations

import itertools
import os
import random
import signal
import time
import uuid
from pathlib import Path
from typing import Any

import pytest
from helpers import (
    PEARING_GUARD,
    Procs,
    fence_on_disk,
    held_records,
    kill_exact,
    q,
    record_alive,
    ticket_records,
    wait_for,
)

from singleflight.core.const import ENV_FENCE, ExitCode

LEASE_LOST = int(ExitCode.LEASE_LOST)
SOFTWARE = int(ExitCode.SOFTWARE)
SEED = int(os.environ.get("STORM_SEED", "20261130"))


def guarded_step(out: Path, hold: str) -> list[str]:
    """COMMAND: the contested step inside pearing-guard exec, recording its interval.

    A TERM (the holder was killed: pearing-run stops COMMAND, pearing-guard passes the
    signal on) still records the end, so every start has an end.
    """

    def rec(word: str) -> str:
        return f'echo "{word} ${ENV_FENCE} $(date +%s%N)" >> {q(out)}'

    inner = f"trap {q(rec('end') + '; exit 143')} TERM; {rec('start')}; sleep {hold}; {rec('end')}"
    return ["sh", "-c", f"{q(PEARING_GUARD)} exec -- sh -c {q(inner)}"]


def intervals(outs: list[Path]) -> tuple[list[tuple[int, int, int, int]], list[str]]:
    """(start_ns, end_ns, fence, contender) for each recorded step; problems found on the way."""
    found, problems = [], []
    for i, out in enumerate(outs):
        if not out.exists():
            continue
        rows = [line.split() for line in out.read_text().splitlines()]
        words = [r[0] for r in rows]
        if words != ["start", "end"]:
            problems.append(f"contender {i}: records {rows}")
            continue
        if rows[0][1] != rows[1][1]:
            problems.append(f"contender {i}: fence changed inside one step: {rows}")
            continue
        found.append((int(rows[0][2]), int(rows[1][2]), int(rows[0][1]), i))
    found.sort()
    return found, problems


def overlaps(found: list[tuple[int, int, int, int]]) -> list[str]:
    bad = []
    for a, b in itertools.combinations(found, 2):
        if a[0] <= b[1] and b[0] <= a[1]:
            bad.append(f"contender {a[3]} (fence {a[2]}) and {b[3]} (fence {b[2]}) overlapped")
    return bad


class Sampler:
    """Checks, every time it is called, that at most one ticket is held (read under the mutex)."""

    def __init__(self, lock_dir: Path) -> None:
        self.lock_dir = lock_dir
        self.samples = 0
        self.max_held = 0

    def __call__(self) -> None:
        held = held_records(self.lock_dir, "J")
        live = [rec for rec in held if record_alive(rec)]
        assert len(held) <= 1, f"{len(held)} tickets held at once: {held}"
        assert len(live) <= 1, live
        self.samples += 1
        self.max_held = max(self.max_held, len(held))


def drain(procs: Procs, ps: list[Any], sample: Sampler, timeout: float) -> list[int]:
    def done() -> bool:
        sample()
        return all(p.poll() is not None for p in ps)

    wait_for(done, timeout, "every contender to exit")
    return [procs.finish(p, timeout=10).returncode for p in ps]


@pytest.mark.slow
@pytest.mark.local_only("samples the lock dir's ticket records under state.lock while the storm runs")
def test_storm_of_50_guarded_contenders(procs: Procs, work: Path, lock_dir: Path) -> None:
    n = 50
    outs = [work / f"c{i}.log" for i in range(n)]
    started = time.monotonic()
    ps = [procs.pr("--job", "J", "--wait-seconds", "120", "--", *guarded_step(out, "0.01")) for out in outs]
    sample = Sampler(lock_dir)
    codes = drain(procs, ps, sample, 150)
    elapsed = time.monotonic() - started
    assert codes == [0] * n, [(i, c, procs.finish(p)) for i, (c, p) in enumerate(zip(codes, ps, strict=True)) if c]

    found, problems = intervals(outs)
    assert problems == [], problems
    assert len(found) == n, f"only {len(found)} of {n} contenders recorded their step"
    bad = overlaps(found)
    fences = [f for _s, _e, f, _i in found]
    dups = len(fences) - len(set(fences))
    print(
        f"STORM plain: runs={n} ok={codes.count(0)} overlaps={len(bad)} duplicate_fences={dups} "
        f"samples={sample.samples} max_held={sample.max_held} drained_in={elapsed:.2f}s"
    )
    assert bad == [], bad
    assert fences == sorted(set(fences)), f"fences not strictly increasing in start order: {fences}"
    assert fences == list(range(1, n + 1)), fences
    assert fence_on_disk(lock_dir, "J") == n


@pytest.mark.slow
@pytest.mark.local_only("finds the holders and waiters it kills in the lock dir's ticket records")
def test_seeded_storm_with_kills(procs: Procs, work: Path, lock_dir: Path) -> None:
    rng = random.Random(SEED)
    n = 30
    outs = [work / f"c{i}.log" for i in range(n)]
    uuids = [str(uuid.uuid4()) for _ in range(n)]
    by_uuid = {u: i for i, u in enumerate(uuids)}
    started = time.monotonic()
    ps = [
        procs.pr(
            "--job",
            "J",
            "--wait-seconds",
            "120",
            "--kill-grace",
            "2",
            "--request-uuid",
            u,
            "--",
            *guarded_step(out, "0.05"),
        )
        for out, u in zip(outs, uuids, strict=True)
    ]
    sample = Sampler(lock_dir)
    holder_killed: set[int] = set()  # contenders whose holder we killed
    wrapper_killed: set[int] = set()  # contenders whose (waiting) pearing-run we killed
    targeted: set[str] = set()

    def all_done() -> bool:
        return all(p.poll() is not None for p in ps)

    def live(state: str) -> list[dict[str, Any]]:
        return [
            rec
            for rec in ticket_records(lock_dir, "J")
            if rec.get("state") == state and rec["ticket_id"] not in targeted and record_alive(rec)
        ]

    last_kill = started
    for _step in range(20):
        if all_done():
            break
        action = rng.choice(["holder", "holder-in-step", "holder-after-step", "waiter", "waiter"])
        if action.startswith("holder"):
            got = wait_for(lambda: (sample(), live("held") or all_done())[1], 60, "a live holder to kill")
            if got is True:
                break
            rec = got[0]
            who = by_uuid.get(rec["request_uuid"])
            if who is None:
                continue
            if action != "holder":
                # Kill it while its guarded step is in flight, or just after the step ended (while
                # the run is being released); give up waiting once the holder is gone anyway.
                word = "start" if action == "holder-in-step" else "end"
                wait_for(
                    lambda out=outs[who], rec=rec, word=word: (
                        (out.exists() and word in out.read_text()) or not record_alive(rec)
                    ),
                    20,
                    f"the holder's guarded step to {word}",
                )
            targeted.add(rec["ticket_id"])
            if kill_exact(rec["holder_pid"], rec["holder_start"]):
                holder_killed.add(who)
                last_kill = time.monotonic()
        else:
            waiting = live("waiting")
            ours = [rec for rec in waiting if rec["request_uuid"] in by_uuid]
            if not ours:
                continue
            rec = rng.choice(ours)
            targeted.add(rec["ticket_id"])
            if kill_exact(rec["holder_pid"], rec["holder_start"]):
                wrapper_killed.add(by_uuid[rec["request_uuid"]])
                last_kill = time.monotonic()
        sample()

    codes = drain(procs, ps, sample, 90)
    drained = time.monotonic() - last_kill
    total = time.monotonic() - started

    found, problems = intervals(outs)
    bad = overlaps(found)
    fences = [f for _s, _e, f, _i in found]
    dups = len(fences) - len(set(fences))
    print(
        f"STORM seed={SEED}: runs={n} ok={codes.count(0)} lease_lost={codes.count(LEASE_LOST)} "
        f"holder_died_before_ready={codes.count(SOFTWARE)} holder_kills={len(holder_killed)} "
        f"waiter_kills={len(wrapper_killed)} steps_recorded={len(found)} overlaps={len(bad)} "
        f"duplicate_fences={dups} samples={sample.samples} max_held={sample.max_held} "
        f"drained_in={drained:.2f}s_after_last_kill total={total:.2f}s"
    )
    assert problems == [], problems
    assert bad == [], bad
    assert fences == sorted(set(fences)), f"fences not strictly increasing in start order: {fences}"
    assert holder_killed or wrapper_killed, "the storm killed nothing: the seed chose no victims"

    recorded = {i for _s, _e, _f, i in found}
    for i, code in enumerate(codes):
        if i in wrapper_killed:
            assert code == -signal.SIGKILL, (i, code)
        elif i in holder_killed:
            # Lease lost (124); or the kill landed before the holder reported ready (70, and
            # COMMAND never ran); or after COMMAND had ended (its status, 0).
            assert code in (0, LEASE_LOST, SOFTWARE), (i, code, procs.finish(ps[i]))
            if code == SOFTWARE:
                assert i not in recorded, f"contender {i}: COMMAND ran although the wrapper said 70"
        else:
            assert code == 0, (i, code, procs.finish(ps[i]))
            assert i in recorded, f"contender {i} exited 0 without doing its step"

    # The lock is usable afterwards, with a fence above every one issued during the storm.
    after = work / "after"
    r = procs.pr_run("--job", "J", "--wait-seconds", "10", "--", "sh", "-c", f"echo ${ENV_FENCE} > {q(after)}")
    assert r.returncode == 0, r
    assert r.elapsed < 5.0, r
    assert int(after.read_text()) > max(fences, default=0)
    assert int(after.read_text()) == fence_on_disk(lock_dir, "J")
    assert held_records(lock_dir, "J") == []
