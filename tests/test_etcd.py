"""The etcd backend against a real 3-member cluster: the same behaviour as the lock dir,
and the faults only a distributed lock has (dead member, dead leader, partition)."""

from __future__ import annotations

import itertools
import json
import os
import stat
import time
import uuid
from pathlib import Path

import pytest
from etcd_cluster import Cluster
from helpers import PEARING_CLI, PEARING_GUARD, Gate, Procs, q, wait_for

from singleflight.core.const import ENV_BACKEND, ExitCode
from singleflight.etcd.client import Cluster as Client
from singleflight.etcd.lock import Mutex


@pytest.fixture
def job() -> str:
    """A lock name of its own: the cluster is shared by the whole session."""
    return f"job-{uuid.uuid4().hex[:12]}"


def _queued(url: str, job: str) -> int:
    kvs, _ = Mutex(Client(url), "default", job).queue()
    return len(kvs)


def _wait_queued(env: dict[str, str], lock_dir: Path, job: str, n: int) -> None:
    """Wait until n runs hold or wait on the lock (the holder counts on etcd)."""
    if ENV_BACKEND in env:
        wait_for(lambda: _queued(env[ENV_BACKEND], job) >= n + 1, 15, f"{n} waiters on etcd")
    else:
        qdir = lock_dir / "locks/default" / f"@{job}" / "queue"
        wait_for(lambda: qdir.exists() and len([x for x in os.listdir(qdir) if x[0].isdigit()]) >= n, 15, "queue")


# -- the same contract on both backends ------------------------------------------------------


def test_env_fence_token_file_and_busy(backend: str, procs: Procs, work: Path, job: str) -> None:
    gate = Gate(work)
    script = f"env | grep -E '^(PEARING|ETCD)_' | sort > {q(work / 'env')}; {gate.script()}"
    holder = procs.pr("--job", job, "--", "sh", "-c", script)
    gate.wait_ready()
    busy = procs.pr_run("--job", job, "--", "true")
    assert busy.returncode == ExitCode.BUSY and busy.stdout == b"" and busy.stderr == b""
    assert busy.elapsed < 2.0
    gate.open()
    assert procs.finish(holder).returncode == 0
    env = dict(line.split("=", 1) for line in (work / "env").read_text().splitlines())
    assert int(env["PEARING_FENCE"]) >= 1 and env["PEARING_PROMOTED"] == "0"
    assert len(env["PEARING_TOKEN"]) >= 32
    if backend != "local":
        assert env["ETCD_LOCK_KEY"].endswith(env["PEARING_TICKET"])
        assert env["ETCD_LOCK_REV"] == env["PEARING_FENCE"]
    assert not Path(env["PEARING_TOKEN_FILE"]).exists()  # removed after the run


def test_fifo_five_waiters_in_order(backend: str, procs: Procs, work: Path, job: str, env: dict[str, str]) -> None:
    gate = Gate(work)
    log = work / "order"
    holder = procs.pr("--job", job, "--", "sh", "-c", gate.script())
    gate.wait_ready()
    waiters = []
    for i in range(5):
        cmd = f"echo {i} $PEARING_FENCE $PEARING_PROMOTED >> {q(log)}"
        waiters.append(procs.pr("--job", job, "--wait-seconds", "60", "--", "sh", "-c", cmd))
        _wait_queued(env, procs.lock_dir, job, i + 1)
    gate.open()
    assert procs.finish(holder).returncode == 0
    assert [procs.finish(w).returncode for w in waiters] == [0] * 5
    rows = [line.split() for line in log.read_text().splitlines()]
    assert [r[0] for r in rows] == ["0", "1", "2", "3", "4"]
    fences = [int(r[1]) for r in rows]
    assert fences == sorted(fences) and len(set(fences)) == 5
    assert {r[2] for r in rows} == {"1"}


def test_contenders_never_overlap(backend: str, procs: Procs, work: Path, job: str) -> None:
    n = 12
    cmd = "echo start $PEARING_FENCE $(date +%s%N) >> {f}; echo end $PEARING_FENCE $(date +%s%N) >> {f}"
    runs = [
        procs.pr("--job", job, "--wait-seconds", "120", "--", "sh", "-c", cmd.format(f=q(work / f"c{i}")))
        for i in range(n)
    ]
    assert [procs.finish(p, timeout=120).returncode for p in runs] == [0] * n
    spans = []
    for i in range(n):
        (s, f1, t1), (e, f2, t2) = (line.split() for line in (work / f"c{i}").read_text().splitlines())
        assert (s, e, f1) == ("start", "end", f2)
        spans.append((int(t1), int(t2), int(f1)))
    spans.sort()
    for a, b in itertools.pairwise(spans):
        assert a[1] <= b[0], "two holders at once"
        assert a[2] < b[2], "fence not increasing in start order"


def test_request_uuid_replay_runs_once(backend: str, procs: Procs, work: Path, job: str) -> None:
    u = str(uuid.uuid4())
    cmd = ["--job", job, "--request-uuid", u, "--", "sh", "-c", f"echo x >> {q(work / 'ran')}"]
    assert procs.pr_run(*cmd).returncode == 0
    assert procs.pr_run(*cmd).returncode == 0
    assert (work / "ran").read_text() == "x\n"


def test_guard_verify_and_superseded(backend: str, procs: Procs, work: Path, job: str) -> None:
    copy = work / "old.token"
    inside = (
        f"{PEARING_GUARD} verify && {PEARING_GUARD} exec -- touch {q(work / 'wrote')}"
        f" && cp $PEARING_TOKEN_FILE {q(copy)}"
    )
    assert procs.pr_run("--job", job, "--", "sh", "-c", inside).returncode == 0
    assert (work / "wrote").exists()
    assert stat.S_IMODE(copy.stat().st_mode) == 0o600
    assert procs.pr_run("--job", job, "--", "true").returncode == 0
    r = procs.run([PEARING_GUARD, "verify", "--token-file", str(copy)])
    assert r.returncode == ExitCode.REFUSED and "superseded by fence" in r.stderr.decode()
    r = procs.run([PEARING_GUARD, "exec", "--token-file", str(copy), "--", "touch", str(work / "late")])
    assert r.returncode == ExitCode.REFUSED and not (work / "late").exists()


def test_fence_ledger(backend: str, procs: Procs, job: str) -> None:
    res = f"branch:{job}"
    codes = [procs.run([PEARING_GUARD, "fence", "--resource", res, "--fence", f]).returncode for f in "54565"]
    assert codes == [0, 1, 0, 0, 1]


def test_cli_queue_and_promotion(backend: str, procs: Procs, job: str, env: dict[str, str]) -> None:
    u1, u2 = str(uuid.uuid4()), str(uuid.uuid4())
    base = [PEARING_CLI, "acquire-lock", job, "--lease-seconds", "30"]
    first = procs.run([*base, "--request-uuid", u1])
    assert first.returncode == 0, first
    t1 = json.loads(first.stdout)
    assert t1["state"] == "held" and Path(t1["token_file"]).exists()
    second = procs.run([*base, "--request-uuid", u2, "--wait-seconds", "0.3"], env=dict(env, PEARING_IDENTITY="codex"))
    t2 = json.loads(second.stdout)
    assert second.returncode == ExitCode.BUSY and t2["state"] == "waiting" and t2["queue_position"] == 1
    rel = procs.run([PEARING_CLI, "release-lock-ticket", job, t1["ticket_id"]])
    assert rel.returncode == 0 and json.loads(rel.stdout)["state"] == "released"
    again = procs.run([*base, "--request-uuid", u2, "--wait-seconds", "10"], env=dict(env, PEARING_IDENTITY="codex"))
    t3 = json.loads(again.stdout)
    assert again.returncode == 0 and t3["ticket_id"] == t2["ticket_id"] and t3["state"] == "held"
    assert t3["fence"] > t1["fence"]
    assert procs.run([PEARING_CLI, "release-lock-ticket", job, t3["ticket_id"]]).returncode == 0


# -- faults only a cluster has -----------------------------------------------------------


@pytest.fixture
def cluster(etcd: Cluster, env: dict[str, str]) -> Cluster:
    env[ENV_BACKEND] = etcd.url
    yield etcd
    etcd.heal()


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


def test_partitioned_holder_loses_its_lease(
    cluster: Cluster, procs: Procs, work: Path, job: str, env: dict[str, str]
) -> None:
    """The holder talks only to a member we freeze: its lease lapses in the cluster, the
    waiter (on the other members) is promoted with a larger fence, the holder stops its
    COMMAND and exits 124, and the guard refuses the stale token. The holder gives up
    early enough that its COMMAND (which ignores SIGTERM) is dead before the waiter starts."""
    lonely, *others = cluster.members
    gate = Gate(work)
    holder_env = dict(env, **{ENV_BACKEND: cluster.url_of(lonely)})
    waiter_env = dict(env, **{ENV_BACKEND: cluster.url_of(*others)})
    alive = q(work / "alive")
    script = (
        f"cp $PEARING_TOKEN_FILE {q(work / 'old.token')}; echo $PEARING_FENCE > {q(work / 'f1')}; "
        f"trap 'date +%s%N > {q(work / 'term')}' TERM; touch {q(gate.ready)}; "
        f"while :; do date +%s%N > {alive}.tmp && mv {alive}.tmp {alive}; sleep 0.01; done"
    )
    holder = procs.pr(
        "--job", job, "--lease-seconds", "6", "--kill-grace", "1", "--", "sh", "-c", script, env=holder_env
    )  # fmt: skip
    gate.wait_ready()
    waiter = procs.pr(
        "--job", job, "--wait-seconds", "30", "--", "sh", "-c",
        f"date +%s%N > {q(work / 'w_start')}; echo $PEARING_FENCE > {q(work / 'f2')}",
        env=waiter_env,
    )  # fmt: skip
    _wait_queued(waiter_env, procs.lock_dir, job, 1)
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


def test_cli_lease_expires_without_heartbeat(procs: Procs, job: str, env: dict[str, str], etcd: Cluster) -> None:
    """On etcd the ticket's lease is the holder: no heartbeat, and it lapses in the cluster."""
    env[ENV_BACKEND] = etcd.url
    got = procs.run([PEARING_CLI, "acquire-lock", job, "--request-uuid", str(uuid.uuid4()), "--lease-seconds", "2"])
    t = json.loads(got.stdout)
    assert got.returncode == 0 and t["state"] == "held"

    def state() -> str:
        out = procs.run([PEARING_CLI, "get-lock-ticket", job, t["ticket_id"]])
        return str(json.loads(out.stdout)["state"])

    wait_for(lambda: state() == "expired", 15, "the lease to lapse")
    hb = procs.run([PEARING_CLI, "heartbeat-lock-ticket", job, t["ticket_id"], "--lease-seconds", "2"])
    assert hb.returncode == ExitCode.REFUSED and len(hb.err_lines) == 1
    nxt = procs.run([PEARING_CLI, "acquire-lock", job, "--request-uuid", str(uuid.uuid4()), "--lease-seconds", "5"])
    assert nxt.returncode == 0 and json.loads(nxt.stdout)["fence"] > t["fence"]
    procs.run([PEARING_CLI, "release-lock-ticket", job, json.loads(nxt.stdout)["ticket_id"]])


def test_manual_heartbeat_keeps_the_lease_and_its_absence_loses_it(
    procs: Procs, work: Path, job: str, env: dict[str, str], etcd: Cluster
) -> None:
    """With --backend on the command line only, COMMAND's pearing-cli still reaches the cluster.

    The holder keeps the etcd lease alive itself and judges heartbeats on its own clock, so a
    heartbeat within every lease period is enough. The lease leaves room for pearing-cli's own
    start-up on a loaded machine (up to 1.7 s measured with a busy loop on 2 cores)."""
    env.pop(ENV_BACKEND, None)
    beat = (
        f"for i in 1 2 3 4 5 6 7 8; do {PEARING_CLI} heartbeat-lock-ticket --lease-seconds 4 >/dev/null || exit 9;"
        " sleep 0.5; done"
    )
    flags = ["--backend", etcd.url, "--job", job, "--heartbeat", "manual", "--lease-seconds", "4"]
    r = procs.pr_run(*flags, "--", "sh", "-c", beat, timeout=60)
    assert r.returncode == 0, r
    assert r.elapsed >= 4.5  # lived past its first lease period on heartbeats alone
    silent = procs.pr_run(*flags, "--kill-grace", "1", "--", "sh", "-c", f"touch {q(work / 'up')}; sleep 30")
    assert silent.returncode == ExitCode.LEASE_LOST, silent
    assert silent.elapsed < 15


def test_simultaneous_replays_run_once(backend: str, procs: Procs, work: Path, job: str) -> None:
    """The webhook and its replay arrive at once, several times over: COMMAND runs exactly once."""
    u = str(uuid.uuid4())
    cmd = f"echo x >> {q(work / 'ran')}; sleep 0.3"
    runs = [
        procs.pr("--job", job, "--request-uuid", u, "--wait-seconds", "30", "--", "sh", "-c", cmd) for _ in range(6)
    ]
    codes = sorted(procs.finish(p, timeout=60).returncode for p in runs)
    assert (work / "ran").read_text() == "x\n", codes
    assert set(codes) <= {0, ExitCode.BUSY} and 0 in codes
    # And a later replay is deduplicated.
    assert procs.pr_run("--job", job, "--request-uuid", u, "--", "sh", "-c", cmd).returncode == 0
    assert (work / "ran").read_text() == "x\n"


def test_cli_same_uuid_at_once_makes_one_ticket(backend: str, procs: Procs, job: str) -> None:
    """Two agents retry one acquisition at the same moment: one ticket, both see it."""
    u = str(uuid.uuid4())
    argv = [PEARING_CLI, "acquire-lock", job, "--request-uuid", u, "--lease-seconds", "30"]
    calls = [procs.start(argv) for _ in range(4)]
    results = [procs.finish(p) for p in calls]
    tickets = {json.loads(r.stdout)["ticket_id"] for r in results}
    assert len(tickets) == 1, results
    assert [r.returncode for r in results] == [0] * 4
    procs.run([PEARING_CLI, "release-lock-ticket", job, tickets.pop()])
