"""Event-driven concurrency on etcd, on a real 3-member cluster: what only etcd has. A
`latest` arrival takes over the older waiter's queue key (its create revision is the place
in line and, once held, the fence); a cancel-in-progress request travels through the
cluster alone. The behaviour both backends share is in test_events.py."""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path
from typing import Any

from etcd_cluster import Cluster
from etcd_proxy import dying_first, puts_under
from helpers import PEARING_CLI, PEARING_GUARD, Gate, Procs, get_ticket, lock_status, q, wait_for

from singleflight.core.const import ENV_BACKEND, ExitCode
from singleflight.etcd.client import Cluster as Client
from singleflight.etcd.client import cmp, op_put
from singleflight.etcd.lock import WAIT_TTL, Mutex
from singleflight.etcd.records import margin_of, parse, value


def line(url: str, job: str) -> list[dict[str, Any]]:
    kvs, _ = Mutex(Client(url), "default", job).queue()
    return kvs


def carried(kv: dict[str, Any]) -> str | None:
    """The ticket id a queue key carries."""
    t = parse(kv["value"])
    return None if t is None else t.ticket_id


def superseded_by(err_lines: list[str], job: str) -> str:
    (by,) = [ln.rpartition("by=")[2] for ln in err_lines if ln.startswith(f"pearing-run: superseded lock={job} by=")]
    return by


def test_a_latest_arrival_takes_over_the_older_waiters_key(procs: Procs, work: Path, job: str, on_etcd: str) -> None:
    """The newcomer's ticket goes into the older waiter's key: same key, same create revision,
    so the same place; a foreign waiter (``etcdctl lock``'s empty key) is untouched; both
    tickets are found by id; and a newcomer killed with -9 still leaves the line in seconds."""
    client = Client(on_etcd)
    mutex = Mutex(client, "default", job)
    gate = Gate(work)
    holder = procs.pr("--job", job, "--", "sh", "-c", gate.script())
    gate.wait_ready()
    f1 = procs.pr("--job", job, "--wait-seconds", "120", "--", "true")
    wait_for(lambda: len(line(on_etcd, job)) == 2, 15, "F1 in line")
    l1 = procs.pr("-v", "--job", job, "--queue", "latest", "--wait-seconds", "120", "--", "touch", str(work / "l1"))
    wait_for(lambda: len(line(on_etcd, job)) == 3, 15, "L1 in line")
    # A foreign waiter, as etcdctl lock writes it: q/LEASEHEX with an empty value, on its session's lease.
    foreign_lease = client.grant(60)
    client.put(f"{mutex.q}{foreign_lease:x}", b"", foreign_lease)
    before = line(on_etcd, job)
    l1_id, foreign = carried(before[2]), before[3]
    assert l1_id is not None and foreign["value"] == b""
    l2 = procs.pr("--job", job, "--queue", "latest", "--wait-seconds", "120", "--", "touch", str(work / "l2"))
    r1 = procs.finish(l1, timeout=30)
    assert r1.returncode == ExitCode.BUSY, r1
    l2_id = superseded_by(r1.err_lines, job)
    after = line(on_etcd, job)
    assert [kv["key"] for kv in after] == [kv["key"] for kv in before]
    assert after[2]["create_revision"] == before[2]["create_revision"] and carried(after[2]) == l2_id
    assert after[3] == foreign
    newer = get_ticket(procs, job, l2_id)
    assert (newer["state"], newer["queue_position"], newer["queue_mode"]) == ("waiting", 2, "latest"), newer
    older = get_ticket(procs, job, l1_id)
    assert (older["state"], older["superseded_by"]) == ("cancelled", l2_id), older
    # The key rides on the newcomer's waiting lease now: killed, it leaves the line in seconds.
    os.kill(l2.pid, signal.SIGKILL)
    killed = time.monotonic()
    wait_for(lambda: before[2]["key"] not in [kv["key"] for kv in line(on_etcd, job)], 10, "L2's place to go")
    assert time.monotonic() - killed < WAIT_TTL + 2.0
    client.revoke(foreign_lease)
    gate.open()
    assert procs.finish(holder).returncode == 0
    assert procs.finish(f1, timeout=60).returncode == 0
    assert not (work / "l1").exists() and not (work / "l2").exists()


def test_the_run_that_took_a_place_holds_with_that_keys_revision(
    procs: Procs, work: Path, job: str, on_etcd: str
) -> None:
    """Promoted, it holds the key it took over: ETCD_LOCK_KEY names it, its create revision is
    the fence (larger than the previous holder's), and the guard, a guarded command and a
    heartbeat all find the ticket there."""
    gate = Gate(work)
    holder = procs.pr("--job", job, "--", "sh", "-c", f"echo $PEARING_FENCE > {q(work / 'h.fence')}; {gate.script()}")
    gate.wait_ready()
    l1 = procs.pr("--job", job, "--queue", "latest", "--wait-seconds", "120", "--", "true")
    wait_for(lambda: len(line(on_etcd, job)) == 2, 15, "L1 in line")
    taken = line(on_etcd, job)[1]
    out = work / "out"
    script = (
        f"{PEARING_GUARD} verify && {PEARING_GUARD} exec -- true && "
        f"{PEARING_CLI} heartbeat-lock-ticket --lease-seconds 30 >/dev/null && "
        f"echo $ETCD_LOCK_KEY $PEARING_FENCE $PEARING_TICKET > {q(out)}"
    )
    l2 = procs.pr("--job", job, "--queue", "latest", "--wait-seconds", "120", "--", "sh", "-c", script)
    assert procs.finish(l1, timeout=30).returncode == ExitCode.BUSY
    gate.open()
    assert procs.finish(holder).returncode == 0
    r2 = procs.finish(l2, timeout=60)
    assert r2.returncode == 0, r2
    key, fence, ticket = out.read_text().split()
    assert key == taken["key"] and int(fence) == taken["create_revision"]
    assert int(fence) > int((work / "h.fence").read_text())
    assert ticket != carried(taken)
    assert get_ticket(procs, job, ticket)["state"] == "released"


def test_a_takeover_sent_again_leaves_one_key_for_the_newcomer(
    procs: Procs, work: Path, job: str, on_etcd: str, etcd: Cluster
) -> None:
    """A member that applied a `latest` arrival's takeover and died before answering makes the
    client send it to the next member, where its compares fail on its own writes. The takeover
    finds it was done and keeps that key. It used to look again, find nobody left to supersede
    and join a second key of its own behind the first: one ticket twice in line, waiting behind
    itself until its wait ran out."""
    gate = Gate(work)
    holder = procs.pr("--job", job, "--", "sh", "-c", gate.script())
    gate.wait_ready()
    l1 = procs.pr("-v", "--job", job, "--queue", "latest", "--wait-seconds", "120", "--", "true")
    wait_for(lambda: len(line(on_etcd, job)) == 2, 15, "L1 in line")
    taken = line(on_etcd, job)[1]
    # The takeover is the one txn that names a key by alias (a/NEW).
    dying, url = dying_first([m.endpoint for m in etcd.members], puts_under(Mutex(Client(on_etcd), "default", job).a))
    log = work / "l2.err"
    try:
        with log.open("wb") as err:
            l2 = procs.pr("-v", "--job", job, "--queue", "latest", "--wait-seconds", "120", "--",
                          "touch", str(work / "l2"), env=dict(procs.env, **{ENV_BACKEND: url}), stderr=err)  # fmt: skip
        wait_for(dying.died.is_set, 15, "the member to apply the takeover and die")
        wait_for(lambda: "pearing-run: waiting " in log.read_text(), 15, "L2 in line")
    finally:
        dying.die()
    r1 = procs.finish(l1, timeout=30)
    assert r1.returncode == ExitCode.BUSY, r1
    l2_id = superseded_by(r1.err_lines, job)
    after = line(on_etcd, job)
    assert [(kv["key"], carried(kv)) for kv in after[1:]] == [(taken["key"], l2_id)], after
    assert [w["ticket_id"] for w in lock_status(procs, job)["waiters"]] == [l2_id]
    gate.open()
    assert procs.finish(holder).returncode == 0
    assert procs.finish(l2, timeout=60).returncode == 0
    assert (work / "l2").exists()
    assert line(on_etcd, job) == []


def test_a_cancel_request_reaches_the_holder_through_the_cluster_alone(
    procs: Procs, work: Path, job: str, on_etcd: str
) -> None:
    """What a newcomer on another host does, from a process that signals nothing: a
    compare-and-swap of ``superseded_by`` into the holder's key, naming a run that waits in
    line (the request stands). The holder watches its key,
    so it stops long before its own next look (a third of its 300 s lease): token dead first
    (the guard refuses it inside COMMAND's TERM trap), COMMAND stopped, run exits busy."""
    client = Client(on_etcd)
    verdict = work / "verdict"
    gate = Gate(work)
    token = q(work / "token")
    script = (
        f"cp $PEARING_TOKEN_FILE {token}; "
        f"trap '{PEARING_GUARD} verify --token-file {token} >/dev/null 2>&1; echo $? > {q(verdict)}; exit 0' TERM; "
        f"{gate.script()}"
    )
    old = procs.pr(
        "-v", "--job", job, "--cancel-in-progress", "--lease-seconds", "300", "--kill-grace", "5",
        "--", "sh", "-c", script,
    )  # fmt: skip
    gate.wait_ready()

    def settled() -> dict[str, Any] | None:
        holder = lock_status(procs, job)["holder"]
        return holder if holder and holder["holder_pid"] != old.pid else None

    assert wait_for(settled, 15, "the holder to settle")["cancel_in_progress"] is True
    # The newcomer the request names waits in line: a holder acts only on a request that stands.
    newcomer = procs.pr("--job", job, "--wait-seconds", "120", "--", "true")
    wait_for(lambda: len(line(on_etcd, job)) == 2, 15, "the newcomer in line")
    kv, waiting = line(on_etcd, job)
    key, raw, lease = kv["key"], kv["value"], kv["lease"]
    t = parse(raw)
    assert t is not None
    by = t.superseded_by = carried(waiting)
    body = value(t, lease, margin=margin_of(raw) or None)  # the owner rides in the ticket
    r = client.txn([cmp(key, "MOD", "EQUAL", kv["mod_revision"])], [op_put(key, body, lease)], [])
    assert r.get("succeeded"), r
    asked = time.monotonic()
    r_old = procs.finish(old, timeout=60)
    assert time.monotonic() - asked < 30.0, "noticed at its next look, not through the watch"
    assert r_old.returncode == ExitCode.BUSY, r_old
    assert superseded_by(r_old.err_lines, job) == by
    assert verdict.read_text().strip() == str(int(ExitCode.REFUSED))
    assert procs.finish(newcomer, timeout=60).returncode == 0
    assert lock_status(procs, job)["state"] == "free"
