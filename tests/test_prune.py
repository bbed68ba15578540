"""``pearing-cli prune``: an idle lock's state goes, a lock in use or remembered for dedupe stays,
and a lock used again never reissues a fence, even with prune racing the runs that use it."""

from __future__ import annotations

import itertools
import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import pytest
from caps import Caps
from helpers import (
    PEARING_CLI,
    PEARING_RUN,
    Gate,
    Procs,
    cli_json,
    proc_state,
    q,
    stored_blobs,
    wait_for,
    wait_queued,
)

from singleflight.core.const import ENV_FAULT, ExitCode

INTERVAL_CMD = str(Path(__file__).with_name("interval_cmd.py"))


def _prune(procs: Procs, *args: str) -> dict[str, Any]:
    out = cli_json(procs, "prune", *args)
    assert isinstance(out, dict)
    return out


def _pairs(entries: list[dict[str, str]]) -> set[tuple[str, str]]:
    return {(e["repo"], e["lock_name"]) for e in entries}


def _listed(procs: Procs) -> set[tuple[str, str]]:
    return {(x["repo"], x["lock_name"]) for x in cli_json(procs, "status", "--all", "--idle", "--json")}


def _disk(root: Path) -> int:
    """Bytes the tree takes on disk (blocks, not sizes: an empty directory costs a block too)."""
    return sum(os.lstat(p).st_blocks * 512 for p in [root, *root.rglob("*")])


def _fenced(log: Path) -> list[str]:
    """A COMMAND that appends its fence to ``log``."""
    return ["sh", "-c", f'echo "$PEARING_FENCE" >> {q(log)}']


def _fences(log: Path) -> list[int]:
    return [int(x) for x in log.read_text().split()]


def _intervals(log: Path) -> dict[str, tuple[float, float]]:
    out: dict[str, list[float]] = {}
    for line in log.read_text().splitlines():
        name, what, stamp = line.split()
        out.setdefault(name, [0.0, 0.0])[0 if what == "start" else 1] = float(stamp)
    return {k: (v[0], v[1]) for k, v in out.items()}


def _overlaps(spans: dict[str, tuple[float, float]]) -> list[tuple[str, str]]:
    ordered = sorted(spans.items(), key=lambda kv: kv[1][0])
    return [(a, b) for (a, (_, end)), (b, (start, _)) in itertools.pairwise(ordered) if start < end]


def test_prune_removes_an_idle_lock_and_keeps_a_young_one_and_those_in_use(
    backend: str, caps: Caps, procs: Procs, work: Path, lock_dir: Path
) -> None:
    """An idle lock older than --older-than goes; one used since, one held and one waited for
    stay, whatever --older-than says of their age; status --idle shows the difference, and on
    the lock dir the disk it took is given back."""
    assert procs.pr_run("--job", "old", "--repo", "teams/a", "--", "true").returncode == 0
    # Its holder gone (an etcd holder's tidying-up after the hand-over is a write to the lock,
    # which would date it "used just now" for the first prune).
    procs.wait_idle()
    gate = Gate(work)
    holder = procs.pr("--job", "held", "--repo", "teams/a", "--", "sh", "-c", gate.script())
    gate.wait_ready()
    waiter = procs.pr("--job", "held", "--repo", "teams/a", "--wait-seconds", "60", "--", "true")
    wait_queued(procs, "held", 1, repo="teams/a")
    first = _prune(procs, "--older-than", "3")
    assert first["count"] == 0 and first["pruned"] == [], first  # nothing is 3 s old yet
    time.sleep(3.2)  # the threshold under test is time itself: "old" must be older than 3 s
    assert procs.pr_run("--job", "young", "--repo", "teams/a", "--", "true").returncode == 0
    before = _listed(procs)
    assert {("teams/a", "old"), ("teams/a", "young"), ("teams/a", "held")} <= before, before
    size = _disk(lock_dir)

    dry = _prune(procs, "--older-than", "3", "--dry-run")
    assert dry["dry_run"] is True and ("teams/a", "old") in _pairs(dry["pruned"]), dry
    assert _listed(procs) == before  # a dry run removes nothing

    # Used again just now: however slow the commands above were on a busy machine, "young" is.
    assert procs.pr_run("--job", "young", "--repo", "teams/a", "--", "true").returncode == 0
    out = _prune(procs, "--older-than", "3")
    assert out["count"] == 1 and _pairs(out["pruned"]) == {("teams/a", "old")}, out
    why = {(k["repo"], k["lock_name"]): k["why"] for k in out["kept"]}
    assert why[("teams/a", "held")] == "held", why
    assert why[("teams/a", "young")] == "used within --older-than", why
    assert _listed(procs) == before - {("teams/a", "old")}
    if caps.records_in_lock_dir:
        assert not (lock_dir / "locks" / "teams" / "a" / "@old").exists()
        assert _disk(lock_dir) < size, (_disk(lock_dir), size)

    gate.open()
    assert procs.finish(holder).returncode == 0
    assert procs.finish(waiter).returncode == 0  # the waiter kept its place through the prune


def test_prune_takes_one_scope_with_repo_and_every_scope_without(backend: str, procs: Procs) -> None:
    for repo in ("teams/a", "teams/b"):
        assert procs.pr_run("--job", "j", "--repo", repo, "--", "true").returncode == 0
    # Every holder gone: an etcd holder tidies up a moment after the hand-over (a write to the
    # lock's keys), and prune rightly keeps a lock written to while it judged it ("busy").
    procs.wait_idle()
    one = _prune(procs, "--older-than", "0", "--repo", "teams/b")
    assert _pairs(one["pruned"]) == {("teams/b", "j")}, one["kept"]
    assert ("teams/a", "j") in _listed(procs)
    rest = _prune(procs, "--older-than", "0")
    assert _pairs(rest["pruned"]) == {("teams/a", "j")} and rest["kept"] == [], rest
    assert _listed(procs) == set()


def test_a_pruned_lock_used_again_continues_above_its_last_fence(
    backend: str, caps: Caps, procs: Procs, work: Path, lock_dir: Path
) -> None:
    log = work / "fences"
    for _ in range(3):
        assert procs.pr_run("--job", "f", "--", *_fenced(log)).returncode == 0
    last = _fences(log)[-1]
    procs.wait_idle()  # as above: the last holder's tidying up is a write to the lock
    out = _prune(procs, "--older-than", "0")
    assert ("default", "f") in _pairs(out["pruned"]), out
    assert ("default", "f") not in _listed(procs)
    if caps.records_in_lock_dir:
        assert not (lock_dir / "locks" / "default" / "@f").exists()
    for _ in range(2):
        assert procs.pr_run("--job", "f", "--", *_fenced(log)).returncode == 0
    again = _fences(log)[3:]
    assert again[0] > last and again[1] > again[0], (last, again)


def test_a_request_inside_its_dedupe_window_keeps_its_lock_and_the_replay_is_deduplicated(
    backend: str, procs: Procs, work: Path
) -> None:
    marker = work / "ran"
    run = [
        "--job",
        "d",
        "--request-key",
        "event-1",
        "--dedupe-window",
        "1h",
        "--",
        "sh",
        "-c",
        f"echo x >> {q(marker)}",
    ]
    assert procs.pr_run(*run).returncode == 0
    out = _prune(procs, "--older-than", "0")
    assert out["count"] == 0, out
    assert out["kept"] == [{"repo": "default", "lock_name": "d", "why": "a request inside its dedupe window"}], out
    assert procs.pr_run(*run).returncode == 0
    assert marker.read_text() == "x\n"  # the replay did no work twice


@pytest.mark.parametrize("value", ["x", "-1", "1.5x", "11y", "999999999999", "1d1d", ""])
def test_a_bad_older_than_is_64_with_one_line_and_nothing_removed(
    value: str, backend: str, procs: Procs, lock_dir: Path
) -> None:
    assert procs.pr_run("--job", "keep", "--", "true").returncode == 0
    procs.wait_idle()  # its holder tidies up (housekeeping) after pearing-run returned
    before = stored_blobs(procs.env, lock_dir)
    r = procs.run_text([PEARING_CLI, "prune", "--older-than", value])
    assert r.returncode == ExitCode.USAGE, r
    assert "--older-than" in r.one_line() and r.stdout == "", r
    assert stored_blobs(procs.env, lock_dir) == before
    bad = procs.run_text([PEARING_CLI, "prune", "--older-than", "0", "--repo", "/bad//scope"])
    assert bad.returncode == ExitCode.USAGE and "scope" in bad.one_line(), bad
    assert stored_blobs(procs.env, lock_dir) == before


def test_prune_in_a_loop_beside_contenders_never_lets_two_commands_run_nor_a_fence_go_back(
    backend: str, procs: Procs, work: Path
) -> None:
    """Contenders take turns on three locks while prune runs in a loop with --older-than 0, so
    each lock is removed whenever it is idle for a moment: never two COMMANDs at once, fences
    only rising on every lock, every run 0 (it waited its turn), and prune did remove them."""
    locks, rounds, per_lock = ("r1", "r2", "r3"), 4, 2
    contenders = []
    for lock in locks:
        for c in range(per_lock):
            name = f"{lock}-{c}"
            loop = (
                f"for i in $(seq {rounds}); do "
                f"{q(PEARING_RUN)} --job {lock} --wait-seconds 60 -- sh -c "
                f'\'echo "$PEARING_FENCE" >> {q(work / ("fences." + lock))}; '
                f"exec {q(sys.executable)} {q(INTERVAL_CMD)} {q(work / ('log.' + lock))} {name}-$0 0.05' $i; "
                f"echo $? >> {q(work / 'codes')}; done 2>> {q(work / 'errors')}"
            )
            contenders.append(procs.start(["sh", "-c", loop]))
    removed = 0
    prunes = 0

    def pruning() -> None:
        nonlocal removed, prunes
        while any(p.poll() is None for p in contenders):
            r = subprocess.run(
                [PEARING_CLI, "prune", "--older-than", "0"], env=procs.env, capture_output=True, check=False
            )
            assert r.returncode == 0, r
            removed += json.loads(r.stdout)["count"]
            prunes += 1

    t = threading.Thread(target=pruning)
    t.start()
    for p in contenders:
        assert p.wait(120) == 0
    t.join(60)
    codes = (work / "codes").read_text().split()
    errors = (work / "errors").read_text() if (work / "errors").exists() else ""
    assert codes == ["0"] * (len(locks) * per_lock * rounds), (codes, errors)
    for lock in locks:
        spans = _intervals(work / f"log.{lock}")
        assert len(spans) == per_lock * rounds and all(end for _, end in spans.values()), spans
        assert _overlaps(spans) == [], spans
        fences = _fences(work / f"fences.{lock}")
        assert fences == sorted(set(fences)), fences  # strictly rising, in the order the runs held
    assert prunes > 1 and removed > 0, (prunes, removed)


@pytest.mark.local_only("an acquirer's open file of the lock is the lock dir's inode (etcd has no file)")
def test_an_acquirer_that_opened_the_lock_file_before_prune_never_holds_beside_a_newcomer(
    procs: Procs, work: Path
) -> None:
    """A run stopped between opening the lock's file and its flock (``pause-lock-open``) while
    prune removes the idle lock: once continued, its flock lands on the unlinked file. It must
    see that the path now names the newcomer's file, and wait its turn there, not run beside it."""
    log = work / "log"
    assert procs.pr_run("--job", "j", "--", "true").returncode == 0
    late_run = ["--job", "j", "--wait-seconds", "60", "--", sys.executable, INTERVAL_CMD, str(log), "late", "0"]
    late = procs.pr(*late_run, env={**procs.env, ENV_FAULT: "pause-lock-open"})
    wait_for(lambda: proc_state(late.pid) == "T", 15, "the late run to stop with the lock's file open")
    out = _prune(procs, "--older-than", "0")
    assert _pairs(out["pruned"]) == {("default", "j")}, out
    gate = Gate(work)
    newcomer = procs.pr(
        "--job", "j", "--", "sh", "-c", f"{gate.script()}; {q(sys.executable)} {q(INTERVAL_CMD)} {q(log)} new 0"
    )
    gate.wait_ready()
    os.kill(late.pid, signal.SIGCONT)
    wait_queued(procs, "j", 1)  # the late run waits behind the newcomer, in line on the new file
    assert not log.exists()
    gate.open()
    assert procs.finish(newcomer).returncode == 0
    assert procs.finish(late).returncode == 0
    spans = _intervals(log)
    assert set(spans) == {"new", "late"} and spans["late"][0] >= spans["new"][1], spans


@pytest.mark.local_only("the record mutex is a flock on a file in the lock dir")
def test_an_owner_whose_lock_dir_was_pruned_takes_the_mutex_of_the_lock_made_afresh(
    procs: Procs, lock_dir: Path
) -> None:
    """A store opened before prune removed the lock's directory: its mutex is the one on the
    path now, which a newcomer holds, never one of its own on the removed directory."""
    from singleflight.local.store import LockDir

    assert procs.pr_run("--job", "m", "--", "true").returncode == 0
    with LockDir(str(lock_dir)) as ld:
        stale = ld.lock_store("default", "m")
        assert _pairs(_prune(procs, "--older-than", "0")["pruned"]) == {("default", "m")}
        fresh = ld.lock_store("default", "m")
        entered = threading.Event()

        def take() -> None:
            with stale.mutex():
                entered.set()

        with fresh.mutex():
            t = threading.Thread(target=take)
            t.start()
            assert not entered.wait(0.5)  # it waits for the newcomer's mutex
        t.join(10)
        assert entered.is_set()
        assert os.fstat(stale.dir.fd).st_ino == os.fstat(fresh.dir.fd).st_ino
        stale.close()
        fresh.close()


@pytest.mark.local_only("slot files are flock files in the lock dir, taken without prune's same-file check")
def test_a_lock_that_had_slots_is_never_pruned_on_the_lock_dir(procs: Procs, lock_dir: Path) -> None:
    assert procs.pr_run("--job", "s", "--slots", "2", "--", "true").returncode == 0
    procs.wait_idle()
    out = _prune(procs, "--older-than", "0")
    assert out["pruned"] == [] and out["kept"] == [
        {"repo": "default", "lock_name": "s", "why": "a lock with --slots (not pruned)"}
    ], out
    assert (lock_dir / "locks" / "default" / "@s" / "slot.1").exists()
