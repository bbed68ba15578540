"""The etcd backend against a real 3-member cluster: what only etcd has (ETCD_LOCK_KEY /
ETCD_LOCK_REV), and the faults only a distributed lock has (dead member, dead leader,
a member dying between applying a request and answering it, partition, a lease lapsing in
the cluster). The behaviour both backends share is tested on
both by the other files, through the `backend` fixture."""

from __future__ import annotations

import json
import os
import signal
import time
import uuid
from pathlib import Path

import pytest
from etcd_cluster import Cluster
from etcd_proxy import DyingMember, dying_first, puts_under
from helpers import (
    PEARING_CLI,
    PEARING_GUARD,
    Gate,
    Procs,
    Result,
    lock_status,
    proc_state,
    q,
    stubborn_command,
    ticket_ids,
    wait_for,
)

from singleflight.core.const import ENV_BACKEND, ExitCode
from singleflight.etcd.client import Cluster as Client
from singleflight.etcd.lock import Mutex


def _queued(url: str, job: str) -> int:
    kvs, _ = Mutex(Client(url), "default", job).queue()
    return len(kvs)


def _wait_queued(url: str, job: str, n: int) -> None:
    """Wait until n runs wait on the lock behind its holder (whose key counts too)."""
    wait_for(lambda: _queued(url, job) >= n + 1, 15, f"{n} waiters on etcd")


# -- what only etcd has -------------------------------------------------------------------
# The behaviour both backends share runs on both from the other test files (the `backend`
# fixture); here: etcd's own exports, and the faults only a cluster has.


@pytest.fixture
def cluster(etcd: Cluster, env: dict[str, str]) -> Cluster:
    env[ENV_BACKEND] = etcd.url
    yield etcd
    etcd.heal()


def test_etcd_lock_key_and_rev_are_exported(cluster: Cluster, procs: Procs, work: Path, job: str) -> None:
    """As `etcdctl lock` does: ETCD_LOCK_KEY is the holder's key, ETCD_LOCK_REV its revision (the fence)."""
    out = work / "env"
    r = procs.pr_run("--job", job, "--", "sh", "-c", f"env | grep -E '^(PEARING|ETCD)_' | sort > {q(out)}")
    assert r.returncode == 0, r
    seen = dict(line.split("=", 1) for line in out.read_text().splitlines())
    assert seen["ETCD_LOCK_KEY"].endswith(f"/@{job}/q/{seen['PEARING_TICKET']}"), seen
    assert seen["ETCD_LOCK_REV"] == seen["PEARING_FENCE"]


def test_the_end_record_stands_when_its_hour_long_lease_ran_out_under_a_long_run(
    cluster: Cluster, procs: Procs, work: Path, job: str
) -> None:
    """A run longer than the hour the end record's lease lasts (granted as its holder settled, for
    the ticket's copy): its end is recorded all the same, and its ticket reads released. (The end
    was sent on that lease, refused, and lost: the ticket read unknown.)"""
    gate = Gate(work)
    p = procs.pr("--job", job, "--", "sh", "-c", f"echo $PEARING_TICKET > {q(work / 'tid')}; {gate.script()}")
    gate.wait_ready()
    client = Client(cluster.url)
    copy_key = Mutex(client, "default", job).t + (work / "tid").read_text().strip()
    wait_for(lambda: client.get(copy_key) is not None, 15, "the holder to settle (its ticket's copy)")
    copy = client.get(copy_key)
    assert copy is not None
    client.revoke(int(copy["lease"]))  # as an hour passing would
    gate.open()
    assert procs.finish(p).returncode == 0
    got = procs.run([PEARING_CLI, "get-lock-ticket", job, (work / "tid").read_text().strip()])
    assert got.returncode == 0, got
    t = json.loads(got.stdout)
    assert (t["state"], t["end_reason"]) == ("released", "command exited 0"), t


def _hour_long_leases(client: Client) -> list[int]:
    """Every lease granted for an hour or more: an end record's, a ticket copy's."""
    ids = [int(x["ID"]) for x in client.post("kv/lease/leases", {}).get("leases", [])]
    return [lease for lease in ids if client.ttl(lease) > 600]


def test_a_run_that_waited_over_an_hour_settles_and_ends_as_any(
    cluster: Cluster, procs: Procs, work: Path, job: str
) -> None:
    """A waiter's hour-long lease for its end record is granted as it joins the line; a wait of
    over an hour outlives it. Promoted, it settles all the same (without the ticket's copy, which
    would have gone on that lease: the settle was refused, and the run stopped as one that lost
    its lease) and its end is recorded."""
    first, then = Gate(work, "a"), Gate(work, "b")
    a = procs.pr("--job", job, "--", "sh", "-c", first.script())
    first.wait_ready()
    script = f"echo $PEARING_TICKET > {q(work / 'tid')}; {then.script()}"
    b = procs.pr("--job", job, "--wait-seconds", "60", "--", "sh", "-c", script)
    _wait_queued(cluster.url, job, 1)
    client = Client(cluster.url)
    # The holder's (its copy's, granted as it settled) and the waiter's (granted as it joined).
    wait_for(lambda: len(_hour_long_leases(client)) >= 2, 15, "both runs' hour-long leases")
    for lease in _hour_long_leases(client):
        client.revoke(lease)  # as an hour passing would
    first.open()
    assert procs.finish(a).returncode == 0
    then.wait_ready()

    def settled() -> bool:  # B's own holder named in the store, or B gave up
        out = procs.run([PEARING_CLI, "status", job, "--json"])
        locks = json.loads(out.stdout or b"[]")
        holders = locks[0]["holders"] if locks else []
        return b.poll() is not None or any(h.get("holder_pid") not in (None, b.pid) for h in holders)

    wait_for(settled, 15, "the promoted run to settle")
    then.open()
    assert procs.finish(b).returncode == 0
    got = procs.run([PEARING_CLI, "get-lock-ticket", job, (work / "tid").read_text().strip()])
    assert got.returncode == 0, got
    assert json.loads(got.stdout)["state"] == "released", got


# -- faults only a cluster has -----------------------------------------------------------


def test_killing_the_member_the_holder_talks_to(cluster: Cluster, procs: Procs, work: Path, job: str) -> None:
    """Keepalives fail over to the next member: the run finishes normally."""
    gate = Gate(work)
    run = procs.pr("--job", job, "--lease-seconds", "3", "--", "sh", "-c", gate.script())
    gate.wait_ready()
    first = cluster.members[0]  # the first endpoint of the URL: where the holder started
    cluster.kill(first)
    deadline = time.monotonic() + 4.5  # longer than the lease: keepalives must have gone elsewhere
    wait_for(lambda: time.monotonic() > deadline, 10, "a lease period to pass")
    gate.open()
    assert procs.finish(run).returncode == 0


def test_killing_the_leader(cluster: Cluster, procs: Procs, work: Path, job: str) -> None:
    gate = Gate(work)
    run = procs.pr("--job", job, "--lease-seconds", "3", "--", "sh", "-c", gate.script())
    gate.wait_ready()
    leader = cluster.leader()
    cluster.kill(leader)
    survivors = [m for m in cluster.members if m is not leader]
    wait_for(lambda: any(m.is_leader() for m in survivors), 15, "a new leader")
    deadline = time.monotonic() + 4.5
    wait_for(lambda: time.monotonic() > deadline, 10, "a lease period to pass")
    gate.open()
    assert procs.finish(run).returncode == 0
    # The lock still works on the survivors.
    assert procs.pr_run("--job", job, "--", "true").returncode == 0


def _url_dying_first(cluster: Cluster, job: str) -> tuple[DyingMember, str]:
    """The URL with a stand-in for its first member, which dies once it has applied a key put
    into the lock's line: the client, not told, asks the next member the same."""
    return dying_first([m.endpoint for m in cluster.members], puts_under(Mutex(Client(cluster.url), "default", job).q))


def test_a_waiter_keeps_its_place_when_its_member_dies_before_answering_its_join(
    cluster: Cluster, procs: Procs, work: Path, job: str, env: dict[str, str]
) -> None:
    """A member killed (or restarted) right after it applied a waiter's join, before answering:
    asked again on the next member, the join finds the waiter's key and keeps that place. It
    used to exit 70 ('internal error ... ticket key ... already exists'), as the member restart
    test did once in a while."""
    gate = Gate(work)
    holder = procs.pr("--job", job, "--", "sh", "-c", f"{gate.script()}; date +%s%N > {q(work / 'h_end')}")
    gate.wait_ready()
    dying, url = _url_dying_first(cluster, job)
    try:
        waiter_env = dict(env, **{ENV_BACKEND: url})
        waiter = procs.pr("--job", job, "--wait-seconds", "60", "--", "sh", "-c",
                          f"date +%s%N > {q(work / 'w_start')}", env=waiter_env)  # fmt: skip
        wait_for(dying.died.is_set, 15, "the member to apply the waiter's key and die")
    finally:
        dying.die()
    gate.open()
    assert procs.finish(holder).returncode == 0
    w = procs.finish(waiter, timeout=60)
    assert w.returncode == 0, w
    assert int((work / "w_start").read_text()) > int((work / "h_end").read_text())
    assert _queued(cluster.url, job) == 0


def test_a_run_keeps_the_free_lock_when_its_member_dies_before_answering(
    cluster: Cluster, procs: Procs, work: Path, job: str, env: dict[str, str]
) -> None:
    """The same for an arrival at a free lock: asked again, its take finds its own key first in
    line, and runs once. It used to find the lock busy with its own key (exit 75; with a wait,
    it queued behind that key and exited 70)."""
    dying, url = _url_dying_first(cluster, job)
    try:
        r = procs.pr_run("--job", job, "--", "sh", "-c", f"echo ran >> {q(work / 'log')}",
                         env=dict(env, **{ENV_BACKEND: url}), timeout=60)  # fmt: skip
    finally:
        dying.die()
    assert r.returncode == 0, r
    assert dying.died.is_set()
    assert (work / "log").read_text() == "ran\n"
    assert _queued(cluster.url, job) == 0


def _acquire_dying(cluster: Cluster, procs: Procs, env: dict[str, str], job: str, sub: str) -> tuple[Result, str]:
    """``pearing-cli acquire-lock`` through a first member that dies once it has applied a txn
    putting a key under the lock's ``sub`` ("t/": the ticket's creation, "r/": its request
    claim): the CLI's result, and the request uuid."""
    mutex = Mutex(Client(cluster.url), "default", job)
    dying, url = dying_first([m.endpoint for m in cluster.members], puts_under(mutex.base + sub))
    request = str(uuid.uuid4())
    try:
        argv = [PEARING_CLI, "acquire-lock", job, "--request-uuid", request, "--wait-seconds", "0"]
        r = procs.run(argv, env=dict(env, **{ENV_BACKEND: url}), timeout=60)
    finally:
        dying.die()
    assert dying.died.is_set()
    return r, request


def _release(procs: Procs, job: str, ticket_id: str) -> None:
    assert procs.run([PEARING_CLI, "release-lock-ticket", job, ticket_id]).returncode == 0


def test_a_ticket_created_again_at_a_free_lock_is_one_ticket_not_promoted(
    cluster: Cluster, procs: Procs, job: str, env: dict[str, str]
) -> None:
    """acquire-lock at a free lock, its ticket's creation applied by a member that died before
    answering, and sent again: the compare "nobody in line" fails on the ticket's own key. It
    used to take the other branch and put the ticket back as promoted (waited behind another
    holder, when nobody held the lock); now it keeps what the first attempt wrote."""
    r, _ = _acquire_dying(cluster, procs, env, job, "t/")
    assert r.returncode == 0, r
    t = json.loads(r.stdout)
    assert (t["state"], t["promoted"]) == ("held", False), t
    assert ticket_ids(env, procs.lock_dir, job) == {t["ticket_id"]}
    assert _queued(cluster.url, job) == 1
    _release(procs, job, t["ticket_id"])


def test_a_request_claimed_again_by_acquire_lock_is_its_own_claim(
    cluster: Cluster, procs: Procs, job: str, env: dict[str, str]
) -> None:
    """acquire-lock's claim of its request uuid applied by a member that died before answering,
    and sent again: the claim fails on the record it wrote itself. It used to take that for
    another acquisition's claim and withdraw its own ticket (revoked its lease: the key gone)
    for "the winner's", itself; now the claim is its own and the ticket is held."""
    r, request = _acquire_dying(cluster, procs, env, job, "r/")
    assert r.returncode == 0, r
    t = json.loads(r.stdout)
    assert (t["state"], t["promoted"], t["request_uuid"]) == ("held", False, request), t
    assert ticket_ids(env, procs.lock_dir, job) == {t["ticket_id"]}
    assert _queued(cluster.url, job) == 1
    again = procs.run([PEARING_CLI, "acquire-lock", job, "--request-uuid", request, "--wait-seconds", "0"])
    assert again.returncode == 0 and json.loads(again.stdout)["ticket_id"] == t["ticket_id"], again
    _release(procs, job, t["ticket_id"])


@pytest.mark.parametrize(("lease", "grace"), [("6", "1"), ("3", "2")])
def test_partitioned_holder_loses_its_lease(
    cluster: Cluster, procs: Procs, work: Path, job: str, env: dict[str, str], lease: str, grace: str
) -> None:
    """The holder talks only to a member we freeze: its lease lapses in the cluster, the
    waiter (on the other members) is promoted with a larger fence, the holder stops its
    COMMAND and exits 124, and the guard refuses the stale token. The holder gives up
    early enough that its COMMAND (which ignores SIGTERM) is dead before the waiter starts.
    With a lease under 3 x (grace + 1.5 s) that leaves less than the whole grace: the grace is
    cut to what is left of the lease (it used to run whole, past the lease: two COMMANDs)."""
    lonely, *others = cluster.members
    gate = Gate(work)
    holder_env = dict(env, **{ENV_BACKEND: cluster.url_of(lonely)})
    waiter_env = dict(env, **{ENV_BACKEND: cluster.url_of(*others)})
    script = stubborn_command(work, gate.ready)
    holder = procs.pr(
        "--job", job, "--lease-seconds", lease, "--kill-grace", grace, "--", "sh", "-c", script, env=holder_env
    )  # fmt: skip
    gate.wait_ready()
    waiter = procs.pr(
        "--job", job, "--wait-seconds", "30", "--", "sh", "-c",
        f"date +%s%N > {q(work / 'w_start')}; echo $PEARING_FENCE > {q(work / 'f2')}",
        env=waiter_env,
    )  # fmt: skip
    _wait_queued(waiter_env[ENV_BACKEND], job, 1)
    cluster.pause(lonely)
    h = procs.finish(holder, timeout=30)
    w = procs.finish(waiter, timeout=30)
    assert h.returncode == ExitCode.LEASE_LOST, h
    assert w.returncode == 0, w
    assert int((work / "f2").read_text()) > int((work / "f1").read_text())
    assert (work / "term").exists()  # stopped as on the local backend: SIGTERM first
    assert int((work / "w_start").read_text()) > int((work / "alive").read_text()), "two COMMANDs at once"
    r = procs.run([PEARING_GUARD, "verify", "--token-file", str(work / "old.token")], env=waiter_env)
    assert r.returncode == ExitCode.REFUSED


def test_commands_pearing_cli_reaches_the_cluster_given_on_the_command_line_only(
    procs: Procs, work: Path, job: str, env: dict[str, str], etcd: Cluster
) -> None:
    """With --backend on pearing-run's command line only (no PEARING_BACKEND), COMMAND's
    pearing-cli heartbeats and reads its ticket on the cluster: the backend is in COMMAND's
    environment. (That a heartbeat within every lease period keeps the lease, and its absence
    loses it, is SPEC 4 on every backend: test_nemesis.py's every-third-of-the-lease test and
    test_run.py's missed-heartbeat test.)"""
    env.pop(ENV_BACKEND, None)
    seen = work / "seen.json"
    cli = q(PEARING_CLI)
    script = f"{cli} heartbeat-lock-ticket --lease-seconds 9 >/dev/null && {cli} get-lock-ticket > {q(seen)}"
    flags = ["--backend", etcd.url, "--job", job, "--heartbeat", "manual", "--lease-seconds", "9"]
    r = procs.pr_run(*flags, "--", "sh", "-c", script)
    assert r.returncode == 0, r
    ticket = json.loads(seen.read_text())
    assert ticket["state"] == "held" and ticket["lock_name"] == job and ticket["lease_seconds"] == 9, ticket


def test_a_release_read_before_its_holder_settled_still_stops_the_command_at_once(
    on_etcd: str, procs: Procs, work: Path, job: str
) -> None:
    """release-lock-ticket reads the holder's key before the holder has recorded itself in it
    (settled: its first 0.1 s), and writes after it did. The end must not write the unsettled
    ticket over the settled one: it then saw no settled holder to poke, and COMMAND was stopped
    only at the holder's next look, a third of its 60 s lease later (CI saw it once)."""
    gate = Gate(work)
    settling = dict(procs.env, PEARING_FAULT="pause-etcd-settle")  # the holder stops itself there
    run = procs.pr("--job", job, "--lease-seconds", "60", "--", "sh", "-c", gate.script(), env=settling)
    gate.wait_ready()
    holder = wait_for(
        lambda: next((p for p in procs._marked_pids() if proc_state(p) == "T"), None), 15, "the holder to stop"
    )
    ticket = lock_status(procs, job)["holder"]["ticket_id"]
    go = work / "release.go"
    reading = dict(procs.env, PEARING_FAULT="pause-etcd-end-read", PEARING_FAULT_GATE=str(go))
    release = procs.start([PEARING_CLI, "release-lock-ticket", job, ticket], env=reading, text=True)
    wait_for(lambda: any(p.name.startswith("release.go.") for p in work.iterdir()), 15, "the release to read the key")
    os.kill(holder, signal.SIGCONT)
    wait_for(lambda: lock_status(procs, job)["holder"]["holder_pid"] == holder, 15, "the holder to settle")
    go.touch()
    started = time.monotonic()
    assert procs.finish(release).returncode == 0
    assert procs.finish(run).returncode == ExitCode.LEASE_LOST
    assert time.monotonic() - started < 10, "COMMAND was stopped at the holder's next look, not when released"
