"""etcd for real fleets, on a real 3-member cluster: waits that last (through a member
restart), etcd's own lock clients (``etcdctl lock``) in the same queue, tenants kept
apart, dead waiters gone in seconds.

Every run and every ``etcdctl lock`` writes start / end stamps (``date +%s%N``) from its
COMMAND; the assertions are on those stamps, on exit codes and on the cluster's keys.
"""

from __future__ import annotations

import contextlib
import itertools
import json
import os
import shutil
import signal
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from etcd_cluster import Cluster
from helpers import PEARING_CLI, Gate, Procs, holder_pid, pid_alive, q, wait_for

from singleflight.core.const import ENV_BACKEND, ExitCode
from singleflight.etcd.client import Cluster as Client
from singleflight.etcd.client import b64, unb64
from singleflight.etcd.lock import Mutex
from singleflight.etcd.url import parse_url

ETCDCTL = shutil.which("etcdctl")
needs_etcdctl = pytest.mark.skipif(
    ETCDCTL is None and os.environ.get("CI") != "true", reason="etcdctl not installed (apt-get install etcd-client)"
)


@pytest.fixture
def cluster(etcd: Cluster, env: dict[str, str]) -> Iterator[Cluster]:
    """The session's cluster, for tests that kill or restart members: healed afterwards."""
    env[ENV_BACKEND] = etcd.url
    yield etcd
    etcd.heal()


def queue_keys(url: str, job: str, repo: str = "default") -> list[dict[str, object]]:
    kvs, _ = Mutex(Client(url), repo, job).queue()
    return kvs


def wait_queued(url: str, job: str, n: int) -> None:
    """Until ``n`` keys (holder included) are in the lock's line."""
    wait_for(lambda: len(queue_keys(url, job)) >= n, 15, f"{n} keys in line on etcd")


def etcdctl_lock(url: str, job: str, script: str, *, repo: str = "default") -> list[str]:
    """``etcdctl lock`` on the lock's queue: the etcd concurrency-mutex prefix /PREFIX/SCOPE/@LOCK/q."""
    endpoints, prefix = parse_url(url)
    eps = ",".join(f"{h}:{p}" for h, p in endpoints)
    return [str(ETCDCTL), "--endpoints", eps, "lock", f"/{prefix}/{repo}/@{job}/q", "--", "sh", "-c", script]


def stamp(path: Path, word: str) -> str:
    """An sh fragment appending ``WORD NANOSECONDS`` to ``path``."""
    return f"echo {word} $(date +%s%N) >> {q(path)}"


def stamps(path: Path) -> dict[str, int]:
    return {w: int(t) for w, t in (line.split() for line in path.read_text().splitlines())}


def ctl_env(env: dict[str, str]) -> dict[str, str]:
    return dict(env, ETCDCTL_API="3")


# -- 1. waits that last ---------------------------------------------------------------------


def test_a_waiter_waits_its_whole_wait_whatever_its_lease(procs: Procs, work: Path, job: str, etcd: Cluster) -> None:
    """The issue's reproduction: a waiter with a 6 s lease behind an 8 s holder used to give up as
    'unreachable' after 2.2 s. It waits the 20 s it was given, and runs."""
    procs.env[ENV_BACKEND] = etcd.url
    log = work / "log"
    holder = procs.pr("--job", job, "--", "sh", "-c", f"{stamp(log, 'h-start')}; sleep 8; {stamp(log, 'h-end')}")
    wait_for(log.exists, 15, "the holder's COMMAND")
    waiter = procs.pr(
        "--job", job, "--wait-seconds", "20", "--lease-seconds", "6", "--", "sh", "-c", stamp(log, "w-start")
    )  # fmt: skip
    w = procs.finish(waiter, timeout=60)
    assert w.returncode == 0, w
    assert procs.finish(holder).returncode == 0
    s = stamps(log)
    assert s["w-start"] > s["h-end"]
    assert w.elapsed > 5.0


def test_a_wait_lasts_through_a_member_restart(cluster: Cluster, procs: Procs, work: Path, job: str) -> None:
    """The member the waiter watches on is killed and restarted mid-wait: the watch moves to
    another member and back; the waiter runs as soon as the holder ends."""
    log = work / "log"
    gate = Gate(work)
    holder = procs.pr("--job", job, "--", "sh", "-c", f"{gate.script()}; {stamp(log, 'h-end')}")
    gate.wait_ready()
    waiter = procs.pr(
        "--job", job, "--wait-seconds", "60", "--lease-seconds", "6", "--", "sh", "-c", stamp(log, "w-start")
    )  # fmt: skip
    wait_queued(cluster.url, job, 2)
    first = cluster.members[0]  # the URL's first member: where every process starts
    cluster.kill(first)
    later = time.monotonic() + 3.0  # past a waiting lease's renewal or two, on the others
    wait_for(lambda: time.monotonic() > later, 10, "the wait to go on without the member")
    cluster.restart(first)
    if waiter.poll() is not None:
        pytest.fail(f"the waiter gave up while the cluster was healthy: {procs.finish(waiter)!r}")
    gate.open()
    assert procs.finish(holder).returncode == 0
    w = procs.finish(waiter, timeout=60)
    assert w.returncode == 0, w
    s = stamps(log)
    assert s["w-start"] > s["h-end"]


def test_cli_acquire_waits_its_whole_wait(procs: Procs, work: Path, job: str, etcd: Cluster) -> None:
    """pearing-cli acquire-lock --wait-seconds (and MCP's wait_seconds, the same agent) behind a
    holder longer than a third of its lease: held once the holder ends."""
    procs.env[ENV_BACKEND] = etcd.url
    log = work / "log"
    holder = procs.pr("--job", job, "--", "sh", "-c", f"sleep 5; {stamp(log, 'h-end')}")
    wait_queued(etcd.url, job, 1)
    argv = [PEARING_CLI, "acquire-lock", job, "--request-uuid", str(uuid.uuid4())]
    got = procs.run([*argv, "--lease-seconds", "3", "--wait-seconds", "20"], timeout=60)
    assert got.returncode == 0, got
    t = json.loads(got.stdout)
    assert t["state"] == "held" and t["promoted"] is True
    assert procs.finish(holder).returncode == 0
    assert log.exists()
    procs.run([PEARING_CLI, "release-lock-ticket", job, t["ticket_id"]])


# -- 2. etcd's own lock clients in the same queue ------------------------------------------------


@needs_etcdctl
def test_etcdctl_holder_makes_pearing_busy_and_status_shows_it(
    procs: Procs, work: Path, job: str, env: dict[str, str], etcd: Cluster
) -> None:
    procs.env[ENV_BACKEND] = etcd.url
    log = work / "log"
    gate = Gate(work)
    # etcdctl's COMMAND holds until the test has looked (a fixed sleep raced a loaded machine).
    script = f"{stamp(log, 'ctl-start')}; {gate.script()}; {stamp(log, 'ctl-end')}"
    ctl = procs.start(etcdctl_lock(etcd.url, job, script), env=ctl_env(env))
    wait_for(log.exists, 15, "etcdctl's COMMAND")
    busy = procs.pr_run("--job", job, "--", "touch", str(work / "never"))
    assert busy.returncode == ExitCode.BUSY, busy
    assert not (work / "never").exists()
    status = procs.run_text([PEARING_CLI, "status", "--json"])
    assert status.returncode == 0, status
    (mine,) = [lk for lk in status.json if lk["lock_name"] == job]
    assert mine["state"] == "held"
    assert mine["etcd_mutex_prefix"] == f"/pearing/default/@{job}/q"
    holder = mine["holder"]
    (key,) = queue_keys(etcd.url, job)
    assert holder["identity"] == f"etcd-lease:{key['lease']:x}"
    assert holder["foreign"] is True and holder["etcd_key"] == key["key"]
    assert mine["fence"] == key["create_revision"]
    table = procs.run_text([PEARING_CLI, "status", job, "--json"])
    assert table.returncode == 0 and table.json[0]["holder"]["identity"].startswith("etcd-lease:")
    # A waiting pearing-run starts only after etcdctl's command ended.
    waiter = procs.pr("--job", job, "--wait-seconds", "30", "--", "sh", "-c", stamp(log, "pr-start"))
    wait_queued(etcd.url, job, 2)  # etcdctl's key and the waiter's
    gate.open()
    w = procs.finish(waiter, timeout=60)
    assert w.returncode == 0, w
    assert procs.finish(ctl).returncode == 0
    s = stamps(log)
    assert s["pr-start"] > s["ctl-end"]


@needs_etcdctl
def test_etcdctl_waits_behind_pearing_and_shows_as_a_waiter(
    procs: Procs, work: Path, job: str, env: dict[str, str], etcd: Cluster
) -> None:
    """etcd's client waits its turn behind a pearing holder (it watches our key), shows in
    status as a foreign waiter, and a pearing waiter that came later queues behind it."""
    procs.env[ENV_BACKEND] = etcd.url
    log = work / "log"
    gate = Gate(work)
    holder = procs.pr("--job", job, "--", "sh", "-c", f"{gate.script()}; {stamp(log, 'pr1-end')}")
    gate.wait_ready()
    ctl = procs.start(
        etcdctl_lock(etcd.url, job, f"{stamp(log, 'ctl-start')}; {stamp(log, 'ctl-end')}"), env=ctl_env(env)
    )
    wait_queued(etcd.url, job, 2)
    late = procs.pr("--job", job, "--wait-seconds", "30", "--", "sh", "-c", stamp(log, "pr2-start"))
    wait_queued(etcd.url, job, 3)
    (lk,) = procs.run_text([PEARING_CLI, "status", job, "--json"]).json
    first, second = lk["waiters"]
    assert first["identity"].startswith("etcd-lease:") and first["queue_position"] == 1
    assert second["identity"] != first["identity"] and second["queue_position"] == 2
    assert not lk["holder"].get("foreign")
    gate.open()
    assert procs.finish(holder).returncode == 0
    assert procs.finish(ctl).returncode == 0
    assert procs.finish(late, timeout=60).returncode == 0
    s = stamps(log)
    assert s["pr1-end"] < s["ctl-start"] <= s["ctl-end"] < s["pr2-start"]


@needs_etcdctl
def test_a_mixed_chain_of_etcdctl_and_pearing_never_overlaps(
    procs: Procs, work: Path, job: str, env: dict[str, str], etcd: Cluster
) -> None:
    procs.env[ENV_BACKEND] = etcd.url
    n = 8
    runs = []
    for i in range(n):
        body = f"{stamp(work / f'c{i}', 'start')}; sleep 0.05; {stamp(work / f'c{i}', 'end')}"
        if i % 2:
            runs.append(procs.start(etcdctl_lock(etcd.url, job, body), env=ctl_env(env)))
        else:
            runs.append(procs.pr("--job", job, "--wait-seconds", "120", "--", "sh", "-c", body))
    assert [procs.finish(p, timeout=120).returncode for p in runs] == [0] * n
    spans = sorted((stamps(work / f"c{i}")["start"], stamps(work / f"c{i}")["end"]) for i in range(n))
    for (_, end), (start, _) in itertools.pairwise(spans):
        assert end <= start, "two holders at once"


# -- 3. tenants ----------------------------------------------------------------------------------


def test_two_prefixes_keep_same_named_locks_apart(procs: Procs, work: Path, env: dict[str, str], etcd: Cluster) -> None:
    job = "shared-name"
    tag = uuid.uuid4().hex[:8]
    a, b = f"{etcd.url}/team-a-{tag}", f"{etcd.url}/team-b-{tag}"
    gate = Gate(work)
    held = procs.pr("--job", job, "--", "sh", "-c", gate.script(), env=dict(env, **{ENV_BACKEND: a}))
    gate.wait_ready()
    other = procs.pr_run("--job", job, "--", "touch", str(work / "b-ran"), env=dict(env, **{ENV_BACKEND: b}))
    assert other.returncode == 0 and (work / "b-ran").exists()
    busy = procs.pr_run("--job", job, "--", "true", env=dict(env, **{ENV_BACKEND: a}))
    assert busy.returncode == ExitCode.BUSY
    gate.open()
    assert procs.finish(held).returncode == 0
    # Every key in the cluster: from the first key on ("\0" as the range end means "to the end").
    everything = Client(etcd.url).post("kv/range", {"key": b64("\0"), "range_end": b64("\0"), "keys_only": True})
    ours = [unb64(kv["key"]).decode() for kv in everything.get("kvs", [])]
    ours = [k for k in ours if tag in k]
    assert ours, "the runs left their records"
    assert all(k.startswith((f"/team-a-{tag}/", f"/team-b-{tag}/")) for k in ours), ours


# -- 4. dead waiters gone in seconds ------------------------------------------------------------


@needs_etcdctl
def test_a_sigkilled_waiter_stops_blocking_within_5_s(
    procs: Procs, work: Path, job: str, env: dict[str, str], etcd: Cluster
) -> None:
    """Behind it waits etcdctl lock, which cannot skip anybody: the dead waiter's key itself
    must go, not just be ignored by pearing."""
    procs.env[ENV_BACKEND] = etcd.url
    log = work / "log"
    gate = Gate(work)
    holder = procs.pr("--job", job, "--", "sh", "-c", gate.script())
    gate.wait_ready()
    doomed = procs.pr("--job", job, "--wait-seconds", "120", "--", "touch", str(work / "never"))
    wait_queued(etcd.url, job, 2)
    ctl = procs.start(etcdctl_lock(etcd.url, job, stamp(log, "ctl-start")), env=ctl_env(env))
    wait_queued(etcd.url, job, 3)
    os.kill(doomed.pid, signal.SIGKILL)
    killed = time.time_ns()
    gate.open()
    assert procs.finish(holder).returncode == 0
    assert procs.finish(ctl, timeout=30).returncode == 0
    assert (stamps(log)["ctl-start"] - killed) / 1e9 < 5.0
    assert not (work / "never").exists()


# -- 5. hand-over: the holder is forked while the run waits ------------------------------------


def _children(pid: int) -> list[int]:
    """The live children of ``pid``."""
    out = []
    for name in os.listdir("/proc"):
        if name.isdigit():
            with contextlib.suppress(OSError, ValueError):
                data = Path(f"/proc/{name}/stat").read_bytes()
                fields = data[data.rindex(b")") + 2 :].split()
                if int(fields[1]) == pid and fields[0] not in (b"Z", b"X"):
                    out.append(int(name))
    return out


def _waiting_behind(procs: Procs, work: Path, job: str, etcd: Cluster, *cmd: str) -> tuple[Gate, Any, Any, int]:
    """A holds the lock on a gate; B waits behind it with ``cmd``: (A's gate, A, B, B's waiting holder)."""
    procs.env[ENV_BACKEND] = etcd.url
    gate = Gate(work)
    a = procs.pr("--job", job, "--", "sh", "-c", gate.script())
    gate.wait_ready()
    b = procs.pr("--job", job, *cmd)
    wait_queued(etcd.url, job, 2)
    (standby,) = wait_for(lambda: _children(b.pid), 10, "B's holder, forked as B started to wait")
    return gate, a, b, standby


def test_a_waiting_run_hands_the_lock_to_the_holder_it_forked_while_waiting(
    procs: Procs, work: Path, job: str, etcd: Cluster
) -> None:
    """No fork between A's release and B's COMMAND: the process that serves B's lease is the
    one B forked as it started to wait (it was told the grip when B was first)."""
    b_gate = Gate(work, "b-gate")
    gate, a, b, standby = _waiting_behind(
        procs, work, job, etcd, "--wait-seconds", "60", "--", "sh", "-c", b_gate.script()
    )
    gate.open()
    assert procs.finish(a).returncode == 0
    b_gate.wait_ready()
    assert holder_pid(procs, job, b.pid) == standby
    b_gate.open()
    assert procs.finish(b).returncode == 0
    wait_for(lambda: not pid_alive(standby), 10, "B's holder to exit after the release")


def test_a_run_whose_waiting_holder_was_killed_forks_another(procs: Procs, work: Path, job: str, etcd: Cluster) -> None:
    """kill -9 of the holder forked while B waited: B hears nothing until it is first, then
    finds it gone (EPIPE) and forks one the usual way; B's COMMAND runs under it."""
    done = work / "b-ran"
    gate, a, b, standby = _waiting_behind(
        procs, work, job, etcd, "--wait-seconds", "60", "--", "sh", "-c", f"echo $PEARING_FENCE > {q(done)}"
    )
    os.kill(standby, signal.SIGKILL)
    wait_for(lambda: not pid_alive(standby), 10, "the killed holder to go")
    gate.open()
    assert procs.finish(a).returncode == 0
    r = procs.finish(b)
    assert r.returncode == 0, r
    assert done.read_text().strip().isdigit()


def test_a_run_that_gives_up_waiting_leaves_no_holder_behind(procs: Procs, work: Path, job: str, etcd: Cluster) -> None:
    gate, a, b, standby = _waiting_behind(
        procs, work, job, etcd, "--wait-seconds", "2", "--", "touch", str(work / "never")
    )
    r = procs.finish(b)
    assert r.returncode == ExitCode.BUSY, r
    wait_for(lambda: not pid_alive(standby), 10, "the waiting holder to exit with its run")
    gate.open()
    assert procs.finish(a).returncode == 0
    assert not (work / "never").exists()
