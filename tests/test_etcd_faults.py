"""Faults of one process on etcd, on a real 3-member cluster: heartbeats on the holder's own
clock, a frozen or killed holder (the wrapper keeps the lease while COMMAND lives), a frozen
waiter, a guard judging an env-only token, and leases longer than 2^31 ms.

COMMANDs write ``WORD NANOSECONDS`` lines; "never two COMMANDs" is asserted on those stamps.
"""

from __future__ import annotations

import json
import os
import signal
import time
import uuid
from pathlib import Path

from helpers import PEARING_CLI, PEARING_GUARD, Gate, Procs, holder_pid, lock_status, q, wait_for

from singleflight.core.const import ExitCode
from singleflight.etcd.client import Cluster as Client
from singleflight.etcd.lock import WAIT_TTL, Mutex


def stamp(path: Path, word: str) -> str:
    return f"echo {word} $(date +%s%N) >> {q(path)}"


def stamps(path: Path) -> dict[str, int]:
    return {w: int(t) for w, t in (line.split() for line in path.read_text().splitlines())}


def in_line(url: str, job: str) -> int:
    kvs, _ = Mutex(Client(url), "default", job).queue(keys_only=True)
    return len(kvs)


def time_passes(seconds: float, what: str) -> None:
    until = time.monotonic() + seconds
    wait_for(lambda: time.monotonic() >= until, seconds + 10, what)


# -- A. manual heartbeats on the holder's own clock ------------------------------------------


def test_a_heartbeat_within_every_lease_period_is_enough(procs: Procs, work: Path, job: str, on_etcd: str) -> None:
    """Heartbeats 5.5 s apart (plus the CLI's own start-up) with an 8 s lease: inside every lease
    period, but later than the etcd lease's TTL minus the holder's old give-up margin (a third of
    it: 5.3 s). 2.5 s are left for the heartbeat's own process (with a 5 s lease and beats 3.5 s
    apart it had 1.5 s, and a loaded machine took longer: 124). Two beats: the first inside the
    first lease, the second inside the lease it renewed."""
    beat = f"{PEARING_CLI} heartbeat-lock-ticket --lease-seconds 8 >/dev/null || exit 9"
    script = f"for i in 1 2; do sleep 5.5; {beat}; done; {stamp(work / 'log', 'done')}"
    r = procs.pr_run(
        "--job", job, "--heartbeat", "manual", "--lease-seconds", "8", "--", "sh", "-c", script, timeout=60
    )
    assert r.returncode == 0, r
    assert (work / "log").exists()


def test_without_heartbeats_the_lease_ends_on_the_holders_clock(
    procs: Procs, work: Path, job: str, on_etcd: str
) -> None:
    """No heartbeat: lost once the lease (not the etcd TTL, which holder and wrapper keep
    renewing) has run out; the token is dead before COMMAND gets SIGTERM, whether it is shown
    as the token file or as PEARING_TOKEN + PEARING_LOCK + PEARING_REPO alone (the holder's
    give-up margin included), and live before."""
    by_file = f"{PEARING_GUARD} verify >/dev/null 2>&1; echo $?"
    env_only = f"env -u PEARING_TOKEN_FILE -u PEARING_TICKET {by_file}"
    script = (
        f"trap '{by_file} > {q(work / 'in-trap')}; {env_only} > {q(work / 'in-trap-env')}; exit 0' TERM; "
        f"{env_only} > {q(work / 'before-env')}; {stamp(work / 'log', 'start')}; while :; do sleep 0.05; done"
    )
    r = procs.pr_run(
        "--job", job, "--heartbeat", "manual", "--lease-seconds", "3", "--kill-grace", "5", "--", "sh", "-c", script,
        timeout=60,
    )  # fmt: skip
    assert r.returncode == ExitCode.LEASE_LOST, r
    assert 2.5 < r.elapsed < 15
    assert (work / "before-env").read_text().strip() == "0"
    assert (work / "in-trap").read_text().strip() == "1"
    assert (work / "in-trap-env").read_text().strip() == "1"


# -- B. a release from the CLI while COMMAND lives (frozen and killed holders: test_hardening, test_nemesis) --


def _trapping_command(log: Path, ready: Path) -> str:
    """COMMAND that takes 2 s to stop on SIGTERM, writing its end line last."""
    return (
        f"trap 'sleep 2; {stamp(log, 'end1')}; exit 0' TERM; {stamp(log, 'start1')}; touch {q(ready)}; "
        "while :; do sleep 0.05; done"
    )


def test_release_from_the_cli_lets_the_holder_stop_command_first(
    procs: Procs, work: Path, job: str, on_etcd: str
) -> None:
    """pearing-cli release-lock-ticket of a running pearing-run's ticket: its token dies at once,
    but the key stays until the holder has stopped COMMAND (2 s in its TERM trap)."""
    log, ready = work / "log", work / "ready"
    first = procs.pr("--job", job, "--kill-grace", "5", "--", "sh", "-c", _trapping_command(log, ready))
    wait_for(ready.exists, 15, "the first COMMAND")
    holder_pid(procs, job, first.pid)
    waiter = procs.pr("--job", job, "--wait-seconds", "60", "--", "sh", "-c", stamp(log, "start2"))
    wait_for(lambda: in_line(on_etcd, job) >= 2, 15, "the waiter in line")
    ticket = procs.run_text([PEARING_CLI, "status", job, "--json"]).json[0]["holder"]["ticket_id"]
    rel = procs.run_text([PEARING_CLI, "release-lock-ticket", job, ticket])
    assert rel.returncode == 0 and rel.json["state"] == "released", rel
    f = procs.finish(first, timeout=30)
    w = procs.finish(waiter, timeout=30)
    assert f.returncode == ExitCode.LEASE_LOST, f
    assert w.returncode == 0, w
    s = stamps(log)
    assert s["start1"] < s["end1"] < s["start2"]
    got = procs.run_text([PEARING_CLI, "get-lock-ticket", job, ticket])
    assert got.json["state"] == "released" and got.json["end_reason"] == "released by owner", got


# -- C. a frozen waiter ------------------------------------------------------------------------


def test_a_frozen_waiter_resumed_after_its_deadline_never_takes_the_lock(
    procs: Procs, work: Path, job: str, on_etcd: str
) -> None:
    """^Z on a waiter at the head of the line: it leaves the line within its waiting lease (the
    one behind it runs), and resumed after its deadline it exits busy without running."""
    log = work / "log"
    gate = Gate(work)
    holder = procs.pr("--job", job, "--", "sh", "-c", gate.script())
    gate.wait_ready()
    frozen = procs.pr("--job", job, "--wait-seconds", "1", "--", "touch", str(work / "never"))
    wait_for(lambda: in_line(on_etcd, job) >= 2, 15, "the first waiter in line")
    os.kill(frozen.pid, signal.SIGSTOP)
    stopped = time.time_ns()
    behind = procs.pr("--job", job, "--wait-seconds", "60", "--", "sh", "-c", stamp(log, "behind"))
    try:
        wait_for(lambda: in_line(on_etcd, job) >= 3, 15, "the second waiter in line")
        gate.open()
        assert procs.finish(holder).returncode == 0
        b = procs.finish(behind, timeout=30)
        assert b.returncode == 0, b
        # Its place lasted at most its waiting lease after it stopped renewing (+ etcd's expiry tick).
        assert (stamps(log)["behind"] - stopped) / 1e9 < WAIT_TTL + 3.0
    finally:
        os.kill(frozen.pid, signal.SIGCONT)
    r = procs.finish(frozen, timeout=30)
    assert r.returncode == ExitCode.BUSY, r
    assert not (work / "never").exists()


def test_a_waiter_resumed_just_past_its_deadline_exits_busy(procs: Procs, work: Path, job: str, on_etcd: str) -> None:
    """Frozen at the head of the line and resumed just after its deadline: its key may still be
    first (its waiting lease not yet lapsed) or gone; either way it must not take the lock."""
    log = work / "log"
    gate = Gate(work)
    holder = procs.pr("--job", job, "--", "sh", "-c", gate.script())
    gate.wait_ready()
    frozen = procs.pr("--job", job, "--wait-seconds", "3", "--", "touch", str(work / "never"))
    wait_for(lambda: in_line(on_etcd, job) >= 2, 15, "the first waiter in line")
    deadline = time.monotonic() + 3.0  # its wait began before its key was in line: no earlier
    behind = procs.pr("--job", job, "--wait-seconds", "60", "--", "sh", "-c", stamp(log, "behind"))
    wait_for(lambda: in_line(on_etcd, job) >= 3, 15, "the second waiter in line")
    os.kill(frozen.pid, signal.SIGSTOP)
    try:
        gate.open()
        assert procs.finish(holder).returncode == 0
        wait_for(lambda: time.monotonic() > deadline + 0.3, 15, "the frozen waiter's deadline to pass")
    finally:
        os.kill(frozen.pid, signal.SIGCONT)
    r = procs.finish(frozen, timeout=30)
    assert r.returncode == ExitCode.BUSY, r
    assert not (work / "never").exists()
    assert procs.finish(behind, timeout=30).returncode == 0


# -- D. a guard judges an env-only token by the holder's own deadline ------------------------


def test_an_env_only_token_dies_at_its_deadline_even_if_the_holder_is_frozen(
    procs: Procs, work: Path, job: str, on_etcd: str
) -> None:
    """The holder is frozen past the lease (the wrapper keeps the etcd lease alive): a guard
    judges by the deadline recorded in the cluster, not by the holder's say-so."""
    ready = work / "ready"
    keep = "PEARING_TOKEN PEARING_LOCK PEARING_TICKET PEARING_REPO PEARING_BACKEND"
    dump = f"for v in {keep}; do eval echo $v=\\$$v; done > {q(work / 'env')}"
    run = procs.pr(
        "--job", job, "--heartbeat", "manual", "--lease-seconds", "4", "--kill-grace", "1", "--",
        "sh", "-c", f"{dump}; touch {q(ready)}; while :; do sleep 0.05; done",
    )  # fmt: skip
    wait_for(ready.exists, 15, "COMMAND")
    holder = holder_pid(procs, job, run.pid)
    token_env = dict(line.split("=", 1) for line in (work / "env").read_text().splitlines())
    verify_env = {k: v for k, v in procs.env.items() if not k.startswith("PEARING_")} | token_env
    live = procs.run_text([PEARING_GUARD, "verify"], env=verify_env)
    os.kill(holder, signal.SIGSTOP)
    try:
        time_passes(5.0, "the lease to run out with its holder frozen")
        late = procs.run_text([PEARING_GUARD, "verify"], env=verify_env)
    finally:
        os.kill(holder, signal.SIGCONT)
    assert procs.finish(run, timeout=30).returncode == ExitCode.LEASE_LOST
    assert live.returncode == 0, live
    assert late.returncode == ExitCode.REFUSED and "lease expired" in late.stderr, late


# -- E. leases longer than 2^31 ms -----------------------------------------------------------


def test_a_thirty_day_lease_is_honoured(procs: Procs, work: Path, job: str, on_etcd: str) -> None:
    month = "2592000"
    r = procs.pr_run("--job", job, "--lease-seconds", month, "--heartbeat", "manual", "--", "sleep", "1")
    assert r.returncode == 0, r
    # Ten years, the longest lease validation accepts: the wrapper's keepalive timer must not overflow.
    for mode in ("manual", "auto"):
        r = procs.pr_run("--job", job, "--lease-seconds", "315360000", "--heartbeat", mode, "--", "true")
        assert r.returncode == 0, r
    # The same lease handed to a holder forked while its run waited (the grip goes by message).
    gate = Gate(work)
    ahead = procs.pr("--job", job, "--", "sh", "-c", gate.script())
    gate.wait_ready()
    behind = procs.pr("--job", job, "--lease-seconds", "315360000", "--wait-seconds", "60", "--", "true")
    wait_for(lambda: len(lock_status(procs, job)["waiters"]) == 1, 15, "the ten-year run to queue")
    gate.open()
    assert procs.finish(ahead).returncode == 0
    r = procs.finish(behind)
    assert r.returncode == 0, r
    got = procs.run([PEARING_CLI, "acquire-lock", job, "--request-uuid", str(uuid.uuid4()), "--lease-seconds", month])
    assert got.returncode == 0, got
    t = json.loads(got.stdout)
    again = procs.run_text([PEARING_CLI, "get-lock-ticket", job, t["ticket_id"]])
    assert again.returncode == 0 and again.json["state"] == "held", again
    busy = procs.run([PEARING_CLI, "acquire-lock", job, "--request-uuid", str(uuid.uuid4()), "--lease-seconds", "5"])
    assert busy.returncode == ExitCode.BUSY, busy
    assert procs.run([PEARING_CLI, "release-lock-ticket", job, t["ticket_id"]]).returncode == 0
