"""Acceptance tests for ``pearing-cli``: the seed walkthrough, queueing, leases, status, bad input.

Real processes only. Every wait is on a file, on command output or on a process
the test started (``wait_for`` polls every 10 ms with a hard timeout). Detached
holders (``python -m singleflight.agent``) are killed at teardown. Every test takes
``backend`` (or ``caps``, its capabilities): the same commands and JSON on the lock dir and
on etcd (where fences are the cluster's revisions, not 1, 2, 3).
"""

from __future__ import annotations

import json
import os
import pty
import re
import signal
import stat
import sys
import time
import uuid
from datetime import datetime
from pathlib import Path
from typing import Any

import pytest
from caps import Caps
from helpers import (
    PEARING_CLI,
    PEARING_RUN,
    Gate,
    Procs,
    TextResult,
    backend_url,
    forget_ticket,
    line_file,
    lock_status,
    pid_alive,
    proc_state,
    q,
    stored_blobs,
    ticket_ids,
    wait_for,
)

from singleflight import __version__
from singleflight.core.const import ENV_BACKEND, ENV_IDENTITY, ENV_LOCK_DIR, ENV_TICKET, ExitCode

# The seed walkthrough's values.
_REPO = "teams/platform/website"
_LOCK = "thread-work.42"
_UUID = "a2b6da75-a87d-44e0-b413-484354289702"
_UUID2 = "0f3c2a9e-5b7d-4c1e-9a8f-2d6b4e1c7a90"
_ACTIVITY = "Revalidating teams/platform/website thread #42 under lock thread-work.42."
_FIELDS = (
    "ticket_id",
    "request_uuid",
    "lock_name",
    "repo",
    "identity",
    "state",
    "fence",
    "lease_expires_at",
    "holder_pid",
    "queue_position",
    "activity",
    "token_file",
)
_RFC3339_UTC = re.compile(r"^\d{4}-\d{2}-\d{2}T\d{2}:\d{2}:\d{2}(\.\d+)?Z$")


def _tickets(procs: Procs, lock_dir: Path) -> set[str]:
    """Every ticket the backend recorded for the seed's lock, live or ended."""
    return ticket_ids(procs.env, lock_dir, _LOCK, _REPO)


def _first_fence(caps: Caps, fence: int) -> None:
    """A fresh lock's first fence: 1 where fences count per lock, else (a store-wide revision) at least 1."""
    assert fence == 1 if caps.contiguous_fences else fence >= 1, fence


def _holder(ticket: dict[str, object]) -> int:
    """A held CLI ticket's detached holder, which must be running."""
    pid = ticket["holder_pid"]
    assert isinstance(pid, int) and pid_alive(pid), f"the detached holder should be running: {ticket}"
    return pid


def _epoch(rfc3339: str) -> float:
    return datetime.fromisoformat(rfc3339.replace("Z", "+00:00")).timestamp()


@pytest.fixture
def env(env: dict[str, str]) -> dict[str, str]:
    """The shared environment with ``claude`` as the first responder; tests switch to ``codex`` for the second one."""
    return {**env, ENV_IDENTITY: "claude"}


def _cli(procs: Procs, *args: str, identity: str | None = None, timeout: float = 45.0) -> TextResult:
    env = None if identity is None else {**procs.env, ENV_IDENTITY: identity}
    return procs.run_text([PEARING_CLI, *args], env=env, timeout=timeout)


def _acquire(
    procs: Procs,
    request_uuid: str = _UUID,
    *,
    lease: str = "60",
    wait: str = "30",
    lock: str = _LOCK,
    repo: str = _REPO,
    identity: str | None = None,
) -> TextResult:
    return _cli(
        procs,
        "acquire-lock",
        lock,
        "--request-uuid",
        request_uuid,
        "--lease-seconds",
        lease,
        "--wait-seconds",
        wait,
        "--repo",
        repo,
        identity=identity,
    )


def _get(procs: Procs, ticket_id: str, lock: str = _LOCK, repo: str = _REPO) -> TextResult:
    return _cli(procs, "get-lock-ticket", lock, ticket_id, "--repo", repo)


def _state(procs: Procs, ticket_id: str, lock: str = _LOCK, repo: str = _REPO) -> str | None:
    r = _get(procs, ticket_id, lock, repo)
    return r.json["state"] if r.returncode == 0 else None


# -- the seed walkthrough ------------------------------------------------------


def test_seed_walkthrough(caps: Caps, work_procs: Procs) -> None:
    acq = _acquire(work_procs)
    assert acq.returncode == 0, acq
    t = acq.json
    assert isinstance(t, dict)
    for field in _FIELDS:
        assert field in t, f"ticket lacks {field}: {t}"
    assert t["state"] == "held"
    _first_fence(caps, t["fence"])
    assert t["request_uuid"] == _UUID
    assert t["lock_name"] == _LOCK
    assert t["repo"] == _REPO
    assert t["identity"] == "claude"
    assert t["queue_position"] is None
    assert t["activity"] is None
    assert _RFC3339_UTC.match(t["lease_expires_at"]), t["lease_expires_at"]
    assert 50 < _epoch(t["lease_expires_at"]) - time.time() <= 61
    uuid.UUID(t["ticket_id"])
    holder_pid = _holder(t)
    token_file = Path(t["token_file"])
    assert token_file.is_file()
    assert stat.S_IMODE(token_file.stat().st_mode) == 0o600
    tid = t["ticket_id"]

    got = _get(work_procs, tid)
    assert got.returncode == 0, got
    assert got.json["ticket_id"] == tid
    assert got.json["state"] == "held"
    assert got.json["fence"] == t["fence"]

    act = _cli(work_procs, "update-user-activity", "--activity", _ACTIVITY)
    assert act.returncode == 0, act
    assert act.json["activity"] == _ACTIVITY
    got = _get(work_procs, tid)
    assert got.returncode == 0
    assert got.json["activity"] == _ACTIVITY

    hb = _cli(work_procs, "heartbeat-lock-ticket", _LOCK, tid, "--lease-seconds", "60", "--repo", _REPO)
    assert hb.returncode == 0, hb
    assert hb.json["state"] == "held"
    assert _RFC3339_UTC.match(hb.json["lease_expires_at"])
    assert _epoch(hb.json["lease_expires_at"]) > _epoch(t["lease_expires_at"])

    rel = _cli(work_procs, "release-lock-ticket", _LOCK, tid, "--repo", _REPO)
    assert rel.returncode == 0, rel
    assert rel.json["state"] == "released"
    assert rel.json["ticket_id"] == tid
    wait_for(lambda: not pid_alive(holder_pid), 10, "the detached holder to exit after release")
    assert not token_file.exists()

    again = _cli(work_procs, "release-lock-ticket", _LOCK, tid, "--repo", _REPO)
    assert again.returncode == 0, again
    assert again.json["state"] == "released"

    late = _cli(work_procs, "heartbeat-lock-ticket", _LOCK, tid, "--lease-seconds", "60", "--repo", _REPO)
    assert late.returncode == ExitCode.REFUSED, late
    assert "released" in late.one_line()

    clear = _cli(work_procs, "update-user-activity", "--clear")
    assert clear.returncode == 0, clear
    assert clear.json["activity"] is None
    got = _get(work_procs, tid)
    assert got.returncode == 0
    assert got.json["activity"] is None
    assert got.json["state"] == "released"


# -- queueing and idempotency ------------------------------------------------


def test_second_identity_waits_then_is_promoted(caps: Caps, work_procs: Procs, lock_dir: Path) -> None:
    first = _acquire(work_procs)
    assert first.returncode == 0, first
    first_t = first.json

    waiting = _acquire(work_procs, _UUID2, wait="0.5", identity="codex")
    assert waiting.returncode == ExitCode.BUSY, waiting
    w = waiting.json
    assert w["state"] == "waiting"
    assert w["queue_position"] == 1
    assert w["identity"] == "codex"
    assert w["fence"] is None
    assert "token_file" not in w or w["token_file"] is None
    # Far enough past the queueing that a lease counted from then would fail the check below.
    queued_at = _epoch(w["lease_expires_at"]) - 60
    wait_for(lambda: time.time() > queued_at + 1.5, 10, "time to pass since codex queued")

    released_at = time.time()
    rel = _cli(work_procs, "release-lock-ticket", _LOCK, first_t["ticket_id"], "--repo", _REPO)
    assert rel.returncode == 0, rel

    retry = _acquire(work_procs, _UUID2, wait="10", identity="codex")
    assert retry.returncode == 0, retry
    r = retry.json
    assert r["ticket_id"] == w["ticket_id"]
    assert r["state"] == "held"
    assert r["fence"] > first_t["fence"]
    assert r["identity"] == "codex"
    assert r["queue_position"] is None
    # Its lease started when it was promoted, not when it queued. A store may report the expiry
    # rounded down (etcd: the lease's remaining whole seconds).
    slack = 0.05 + caps.expiry_rounding
    assert _epoch(r["lease_expires_at"]) >= released_at + 60 - slack
    # One ticket per request uuid: the first holder's and codex's, nothing else.
    assert _tickets(work_procs, lock_dir) == {first_t["ticket_id"], w["ticket_id"]}


def test_same_uuid_retry_while_held_returns_same_ticket_fast(caps: Caps, work_procs: Procs, lock_dir: Path) -> None:
    first = _acquire(work_procs)
    assert first.returncode == 0, first
    assert _tickets(work_procs, lock_dir) == {first.json["ticket_id"]}
    retry = _acquire(work_procs, wait="30")
    assert retry.returncode == 0, retry
    assert retry.elapsed < 10, f"a retry with the same uuid waited {retry.elapsed:.1f} s behind itself"
    assert retry.json["ticket_id"] == first.json["ticket_id"]
    assert retry.json["state"] == "held"
    assert retry.json["fence"] == first.json["fence"]
    _first_fence(caps, retry.json["fence"])
    assert _tickets(work_procs, lock_dir) == {first.json["ticket_id"]}


def test_same_uuid_at_once_makes_one_ticket(backend: str, work_procs: Procs) -> None:
    """Two agents retry one acquisition at the same moment: one ticket, both see it."""
    argv = [PEARING_CLI, "acquire-lock", _LOCK, "--request-uuid", _UUID, "--lease-seconds", "30", "--repo", _REPO]
    calls = [work_procs.start(argv, text=True) for _ in range(4)]
    results = [work_procs.finish(p) for p in calls]
    assert [r.returncode for r in results] == [0] * 4, results
    tickets = {json.loads(r.stdout)["ticket_id"] for r in results}
    assert len(tickets) == 1, results
    st = _cli(work_procs, "status", _LOCK, "--repo", _REPO).json
    assert [(x["holder"]["ticket_id"], x["waiters"]) for x in st] == [(tickets.pop(), [])], st


def test_a_retry_whose_ticket_is_gone_gets_a_new_one(backend: str, work_procs: Procs, lock_dir: Path) -> None:
    """A retry with the uuid of a released ticket is told of that ticket while the store knows it
    (an hour: exit 1, the ticket, released); once it is gone, a new ticket, on every store (etcd
    said "unknown ticket" for the rest of the request record's day)."""
    first = _acquire(work_procs)
    assert first.returncode == 0, first
    tid = first.json["ticket_id"]
    assert _cli(work_procs, "release-lock-ticket", _LOCK, tid, "--repo", _REPO).returncode == 0
    again = _acquire(work_procs)
    assert again.returncode == 1 and (again.json["ticket_id"], again.json["state"]) == (tid, "released"), again
    forget_ticket(work_procs.env, lock_dir, _LOCK, tid, _REPO)
    new = _acquire(work_procs)
    assert new.returncode == 0 and new.json["ticket_id"] != tid and new.json["state"] == "held", new
    assert new.json["fence"] > first.json["fence"]
    assert _cli(work_procs, "release-lock-ticket", _LOCK, new.json["ticket_id"], "--repo", _REPO).returncode == 0


def test_a_ticket_of_a_lock_that_does_not_exist_is_unknown_naming_it(backend: str, work_procs: Procs) -> None:
    """get / heartbeat / release of a ticket in a lock the store has no record of: one line naming
    the ticket asked for and the lock, exit 1, on every store; nothing made."""
    tid = str(uuid.uuid4())
    want = f"pearing-cli: error: ticket {tid}: unknown ticket: no lock 'never-made' in scope {_REPO!r}"
    for command in (["get-lock-ticket"], ["release-lock-ticket"], ["heartbeat-lock-ticket", "--lease-seconds", "30"]):
        r = _cli(work_procs, command[0], "never-made", tid, *command[1:], "--repo", _REPO)
        assert (r.returncode, r.stdout, r.stderr) == (1, "", want + "\n"), r
    assert _cli(work_procs, "status", "never-made", "--repo", _REPO).json == []


def test_lease_expiry_without_heartbeat_frees_the_lock(caps: Caps, work_procs: Procs) -> None:
    started = time.monotonic()
    acq = _acquire(work_procs, lease="2", wait="0")  # etcd's shortest lease
    assert acq.returncode == 0, acq
    tid, holder_pid = acq.json["ticket_id"], _holder(acq.json)
    wait_for(lambda: _state(work_procs, tid) == "expired", 15, "the unheartbeated ticket to expire")
    assert time.monotonic() - started >= 1.9
    wait_for(lambda: not pid_alive(holder_pid), 10, "the holder to exit after expiry")
    hb = _cli(work_procs, "heartbeat-lock-ticket", _LOCK, tid, "--lease-seconds", "60", "--repo", _REPO)
    assert hb.returncode == ExitCode.REFUSED, hb
    assert "expired" in hb.one_line()
    rel = _cli(work_procs, "release-lock-ticket", _LOCK, tid, "--repo", _REPO)
    assert rel.returncode == ExitCode.REFUSED, rel
    assert "expired" in rel.one_line()
    nxt = _acquire(work_procs, _UUID2, wait="0", identity="codex")
    assert nxt.returncode == 0, nxt
    assert nxt.json["state"] == "held"
    assert nxt.json["fence"] > acq.json["fence"]
    assert not caps.contiguous_fences or nxt.json["fence"] == 2


def test_a_held_ticket_always_shows_its_lease_expiry(backend: str, work_procs: Procs, lock_dir: Path) -> None:
    """Sampled densely through ``ops.get``, the very function get-lock-ticket prints, in-process:
    a process per read would step over the lease's last second."""
    from singleflight import ops
    from singleflight.backend import Opened

    # 4 s: under a load of 8 on 2 cores acquire-lock took 3.9 s, and a 2 s lease had run out
    # before the call could print it held.
    acq = _acquire(work_procs, lease="4", wait="0")
    assert acq.returncode == 0, acq
    tid = acq.json["ticket_id"]
    held: list[object] = []

    def ended() -> bool:
        t = ops.get(b, _LOCK, _REPO, tid)
        if t["state"] == "held":
            held.append(t["lease_expires_at"])
        return t["state"] != "held"

    b = Opened(work_procs.env.get(ENV_BACKEND), str(lock_dir))
    try:
        wait_for(ended, 15, "the unheartbeated lease to run out")
    finally:
        b.close()
    assert len(held) > 10, held
    assert all(isinstance(x, str) and _RFC3339_UTC.match(x) for x in held), held


def test_waiting_ticket_without_heartbeat_leaves_the_queue(backend: str, work_procs: Procs) -> None:
    holder = _acquire(work_procs)
    assert holder.returncode == 0, holder
    w = _acquire(work_procs, _UUID2, lease="2", wait="0.2", identity="codex")
    assert w.returncode == ExitCode.BUSY, w
    assert w.json["state"] == "waiting"
    tid = w.json["ticket_id"]
    wait_for(lambda: _state(work_procs, tid) == "cancelled", 8, "the abandoned waiting ticket to be cancelled")
    got = _get(work_procs, tid).json
    assert got["queue_position"] is None
    st = _cli(work_procs, "status", "--repo", _REPO)
    assert st.returncode == 0, st
    (entry,) = st.json
    assert entry["waiters"] == []
    assert entry["holder"]["ticket_id"] == holder.json["ticket_id"]


def test_heartbeat_keeps_a_waiting_ticket_in_line(backend: str, work_procs: Procs) -> None:
    holder = _acquire(work_procs)
    assert holder.returncode == 0, holder
    # A waiting lease long enough for the heartbeat's own start-up on a loaded machine (at a
    # load of 8 on 2 cores pearing-cli took 2.8 s, and a 3 s lease lapsed before it renewed).
    w = _acquire(work_procs, _UUID2, lease="8", wait="0.2", identity="codex")
    assert w.returncode == ExitCode.BUSY, w
    tid = w.json["ticket_id"]
    first_deadline = _epoch(w.json["lease_expires_at"])
    hb = _cli(work_procs, "heartbeat-lock-ticket", _LOCK, tid, "--lease-seconds", "30", "--repo", _REPO)
    assert hb.returncode == 0, hb
    assert hb.json["state"] == "waiting"
    wait_for(lambda: time.time() > first_deadline + 1.0, 10, "the first waiting lease to pass")
    got = _get(work_procs, tid)
    assert got.json["state"] == "waiting", got
    assert got.json["queue_position"] == 1


def test_waiters_are_served_in_fifo_order(caps: Caps, work_procs: Procs) -> None:
    holder = _acquire(work_procs)
    assert holder.returncode == 0, holder
    uuid_a, uuid_b = "3c1d2e4f-5a6b-4c7d-8e9f-0a1b2c3d4e5f", "4d2e3f5a-6b7c-4d8e-9f0a-1b2c3d4e5f60"
    a = _acquire(work_procs, uuid_a, wait="0.2", identity="codex")
    b = _acquire(work_procs, uuid_b, wait="0.2", identity="gemini")
    assert (a.returncode, b.returncode) == (ExitCode.BUSY, ExitCode.BUSY), (a, b)
    assert (a.json["queue_position"], b.json["queue_position"]) == (1, 2)
    assert _cli(work_procs, "release-lock-ticket", _LOCK, holder.json["ticket_id"], "--repo", _REPO).returncode == 0
    a_held = _acquire(work_procs, uuid_a, wait="10", identity="codex")
    assert a_held.returncode == 0, a_held
    assert a_held.json["state"] == "held"
    assert a_held.json["fence"] > holder.json["fence"]
    b_still = _acquire(work_procs, uuid_b, wait="0.2", identity="gemini")
    assert b_still.returncode == ExitCode.BUSY, b_still
    assert b_still.json["ticket_id"] == b.json["ticket_id"]
    assert b_still.json["queue_position"] == 1
    assert _cli(work_procs, "release-lock-ticket", _LOCK, a_held.json["ticket_id"], "--repo", _REPO).returncode == 0
    b_held = _acquire(work_procs, uuid_b, wait="10", identity="gemini")
    assert b_held.returncode == 0, b_held
    assert b_held.json["fence"] > a_held.json["fence"]
    if caps.contiguous_fences:
        assert [t.json["fence"] for t in (holder, a_held, b_held)] == [1, 2, 3]


# -- status ------------------------------------------------------------------


def test_status_lists_holder_and_waiters(backend: str, work_procs: Procs) -> None:
    holder = _acquire(work_procs)
    assert holder.returncode == 0, holder
    assert _cli(work_procs, "update-user-activity", "--activity", _ACTIVITY).returncode == 0
    waiter = _acquire(work_procs, _UUID2, wait="0.2", identity="codex")
    assert waiter.returncode == ExitCode.BUSY, waiter
    other = _acquire(work_procs, "5a0e8c1d-3f4b-4d2a-8e6f-7b9c0d1e2f3a", lock="checkin", repo="default", wait="0")
    assert other.returncode == 0, other

    st = _cli(work_procs, "status", "--repo", _REPO)
    assert st.returncode == 0, st
    locks = st.json
    assert isinstance(locks, list)
    assert len(locks) == 1, locks
    (entry,) = locks
    assert entry["lock_name"] == _LOCK
    assert entry["repo"] == _REPO
    assert entry["holder"]["ticket_id"] == holder.json["ticket_id"]
    assert entry["holder"]["identity"] == "claude"
    assert entry["holder"]["activity"] == _ACTIVITY
    assert [w["ticket_id"] for w in entry["waiters"]] == [waiter.json["ticket_id"]]
    assert entry["waiters"][0]["identity"] == "codex"
    assert entry["waiters"][0]["queue_position"] == 1

    one = _cli(work_procs, "status", _LOCK, "--repo", _REPO)
    assert one.returncode == 0, one
    assert [x["lock_name"] for x in one.json] == [_LOCK]
    # The tests' own reading of a lock's status (helpers.lock_status, in-process) is what this
    # prints, but for the lease left, read a moment later.
    mine, printed = lock_status(work_procs, _LOCK, _REPO), one.json[0]
    for a, b in zip([mine["holder"], *mine["holders"]], [printed["holder"], *printed["holders"]], strict=True):
        assert 0 <= b.pop("lease_left") - a.pop("lease_left") < 30, (mine, printed)
    assert mine == printed

    # Without --repo: the default scope, like every other command.
    default = _cli(work_procs, "status")
    assert default.returncode == 0, default
    assert [(x["lock_name"], x["repo"]) for x in default.json] == [("checkin", "default")]


def test_status_shows_a_holder_still_stopping_its_command_as_holding(backend: str, procs: Procs, work: Path) -> None:
    """Released while COMMAND runs its TERM handler: until COMMAND is gone the lock is still taken
    (an arrival is busy), and status says so on every store, naming the released ticket. The lock
    dir's said "free" meanwhile, with no holder, while the arrival beside it got 75."""
    gate = Gate(work)
    stopping, done = work / "stopping", work / "may-exit"
    handler = f"trap 'touch {stopping}; while [ ! -e {done} ]; do sleep 0.05; done; exit 0' TERM"
    run = procs.pr("--job", "st", "--kill-grace", "30", "--", "sh", "-c", f"{handler}; {gate.script()}")
    gate.wait_ready()
    ticket = lock_status(procs, "st")["holder"]["ticket_id"]
    release = procs.start([PEARING_CLI, "release-lock-ticket", "st", ticket], text=True)
    wait_for(stopping.exists, 15, "COMMAND to be in its TERM handler")
    st = lock_status(procs, "st")
    assert st["state"] == "held", st
    assert (st["holder"]["ticket_id"], st["holder"]["state"]) == (ticket, "released"), st
    assert procs.pr_run("--job", "st", "--wait-seconds", "0", "--", "true").returncode == ExitCode.BUSY
    done.touch()
    assert procs.finish(release).returncode == 0
    assert procs.finish(run).returncode == ExitCode.LEASE_LOST
    st = lock_status(procs, "st")
    assert st["state"] == "free" and st["holder"] is None, st


def test_status_is_json_off_a_terminal_and_a_table_on_one(backend: str, work_procs: Procs) -> None:
    acq = _acquire(work_procs)
    assert acq.returncode == 0, acq
    piped = _cli(work_procs, "status", "--repo", _REPO)
    assert piped.returncode == 0, piped
    assert isinstance(piped.json, list)
    assert piped.json[0]["lock_name"] == _LOCK

    controller, terminal = pty.openpty()
    try:
        p = work_procs.start([PEARING_CLI, "status", "--repo", _REPO], stdout=terminal)
        os.close(terminal)
        terminal = -1
        chunks = []
        while True:
            try:
                chunk = os.read(controller, 65536)
            except OSError:  # EIO once the child closed the terminal
                break
            if not chunk:
                break
            chunks.append(chunk)
        assert p.wait(timeout=30) == 0
    finally:
        os.close(controller)
        if terminal >= 0:
            os.close(terminal)
    table = b"".join(chunks).decode()
    assert _LOCK in table
    assert "claude" in table
    with pytest.raises(ValueError):
        json.loads(table)


# -- bad input -----------------------------------------------------------------

_U = "11111111-2222-4333-8444-555555555555"


# Refused before the backend is opened (the command's names.* checks, or its parser, come first:
# cli/commands.py): run on the lock dir, which also shows nothing was created. A value checked on
# an open backend (a ticket id, by ops.get) runs on every backend.
_BAD_ARGS = [
    pytest.param(["acquire-lock", "bad name!", "--request-uuid", _U], "bad name!", id="bad-lock-name"),
    pytest.param(["acquire-lock", "-lead", "--request-uuid", _U], None, id="lock-name-leading-dash"),
    pytest.param(["acquire-lock", "ok", "--request-uuid", _U, "--repo", "a//b"], "a//b", id="scope-empty-segment"),
    pytest.param(["acquire-lock", "ok", "--request-uuid", _U, "--repo", "../escape"], "../escape", id="scope-dotdot"),
    pytest.param(["acquire-lock", "ok", "--request-uuid", _U, "--repo", "/abs"], "/abs", id="scope-absolute"),
    pytest.param(["acquire-lock", "ok", "--request-uuid", "not-a-uuid"], "not-a-uuid", id="bad-uuid"),
    pytest.param(
        ["acquire-lock", "ok", "--request-uuid", _U, "--lease-seconds", "0"], "--lease-seconds", id="lease-zero"
    ),
    pytest.param(["acquire-lock", "ok", "--request-uuid", _U, "--wait-seconds", "-1"], "-1", id="wait-negative"),
    pytest.param(
        ["acquire-lock", "ok", "--request-uuid", _U, "--wait-seconds", "soon"], "soon", id="wait-not-a-number"
    ),
    pytest.param(["frobnicate"], "frobnicate", id="unknown-subcommand"),
    pytest.param(["acquire-lock", "--request-uuid", _U], None, id="missing-name"),
    pytest.param(["get-lock-ticket"], None, id="get-missing-name"),
    pytest.param(["get-lock-ticket", "ok", "not-a-ticket"], "not-a-ticket", id="bad-ticket-id"),
    pytest.param(["update-user-activity", "--activity", "x", "--clear"], None, id="activity-and-clear"),
    pytest.param(["update-user-activity"], None, id="neither-activity-nor-clear"),
]
_CHECKED_ON_THE_BACKEND = {"bad-ticket-id"}


def _bad_args_backends() -> list[Any]:
    out = []
    for p in _BAD_ARGS:
        out.append(pytest.param("local", *p.values, id=f"local-{p.id}"))
        if p.id in _CHECKED_ON_THE_BACKEND:
            out.append(pytest.param("etcd", *p.values, id=f"etcd-{p.id}", marks=pytest.mark.etcd))
    return out


@pytest.mark.parametrize(("backend", "args", "named"), _bad_args_backends(), indirect=["backend"])
def test_bad_arguments_exit_64_with_one_line(
    backend: str, work_procs: Procs, tmp_path: Path, lock_dir: Path, args: list[str], named: str | None
) -> None:
    def outside() -> list[str]:
        return sorted(p.name for p in tmp_path.iterdir() if p != lock_dir)

    before = outside()
    r = _cli(work_procs, *args)
    assert r.returncode == ExitCode.USAGE, r
    line = r.one_line()
    if named is not None:
        assert named in line, line
    # Nothing outside the lock dir, and no lock inside it.
    assert outside() == before, "a bad argument created files outside the lock dir"
    assert not list(lock_dir.glob("locks/**/@*")), "a bad argument created a lock"
    assert not [k for k in stored_blobs(work_procs.env, lock_dir) if "/@" in k], "a bad argument created a lock"


# -- inside a pearing-run COMMAND --------------------------------------------


def test_defaults_from_environment_inside_pearing_run(caps: Caps, work_procs: Procs, work: Path) -> None:
    script = (
        f'echo "${ENV_TICKET}" > ticket; echo "$PEARING_FENCE" > fence; '
        f"{q(PEARING_CLI)} heartbeat-lock-ticket --lease-seconds 30 > hb.json; echo $? > hb.rc; "
        f"{q(PEARING_CLI)} get-lock-ticket > get.json; echo $? > get.rc"
    )
    r = work_procs.run_text(
        [
            PEARING_RUN,
            "--job",
            "thread-work.7",
            "--repo",
            "teams/platform/api",
            "--heartbeat",
            "manual",
            "--lease-seconds",
            "30",
            "--",
            "sh",
            "-c",
            script,
        ],
        timeout=45.0,
    )
    assert r.returncode == 0, r.stderr
    assert line_file(work / "hb.rc") == "0"
    assert line_file(work / "get.rc") == "0"
    ticket = line_file(work / "ticket")
    hb = json.loads((work / "hb.json").read_text())
    got = json.loads((work / "get.json").read_text())
    for t in (hb, got):
        assert t["ticket_id"] == ticket
        assert t["lock_name"] == "thread-work.7"
        assert t["repo"] == "teams/platform/api"
        assert t["state"] == "held"
        assert t["fence"] == int(line_file(work / "fence") or "0")
    _first_fence(caps, hb["fence"])
    assert hb["lease_seconds"] == 30


def test_heartbeat_sets_the_new_lease_length(backend: str, work_procs: Procs, work: Path) -> None:
    """SPEC: heartbeat-lock-ticket NAME TICKET_ID --lease-seconds N: the lease now runs N seconds."""
    script = (
        f"{q(PEARING_CLI)} heartbeat-lock-ticket --lease-seconds 5 > hb.json; echo $? > hb.rc; "
        f"{q(PEARING_CLI)} get-lock-ticket > get.json"
    )
    argv = [PEARING_RUN, "--job", "thread-work.7", "--heartbeat", "manual", "--lease-seconds", "30"]
    r = work_procs.run_text([*argv, "--", "sh", "-c", script], timeout=45.0)
    assert r.returncode == 0, r.stderr
    assert line_file(work / "hb.rc") == "0"
    hb = json.loads((work / "hb.json").read_text())
    got = json.loads((work / "get.json").read_text())
    assert hb["lease_seconds"] == got["lease_seconds"] == 5, (hb, got)
    assert _epoch(hb["lease_expires_at"]) - time.time() < 6, hb


def _forks_of(procs: Procs, wrapper: int) -> list[int]:
    """The test's other pearing-run processes with the wrapper's command line: its holder."""
    want = Path(f"/proc/{wrapper}/cmdline").read_bytes()
    out = []
    for d in Path("/proc").iterdir():
        if d.name.isdigit() and int(d.name) != wrapper:
            try:
                if (d / "cmdline").read_bytes() == want and procs.marker in (d / "environ").read_bytes().split(b"\0"):
                    out.append(int(d.name))
            except OSError:
                continue
    return out


def test_a_beat_command_sends_before_its_holder_hears_it_started_stands(
    backend: str, work_procs: Procs, work: Path
) -> None:
    """--heartbeat manual: the holder gives COMMAND a fresh first lease when it hears COMMAND
    started, and a fast pearing-cli can beat before that. The holder is frozen until COMMAND has
    beaten (5 s on a 30 s lease): the beat stands, its length and deadline, never the holder's 30 s
    over it (it once did: a shorter beat, or a longer one, silently undone)."""
    gate = Gate(work)
    beat = f"{q(PEARING_CLI)} heartbeat-lock-ticket --lease-seconds 5 > hb.json && touch beaten"
    argv = [PEARING_RUN, "--job", "thread-work.8", "--heartbeat", "manual", "--lease-seconds", "30"]
    env = {**work_procs.env, "PEARING_FAULT": "pause-command-spawn"}
    run = work_procs.start([*argv, "--", "sh", "-c", f"{beat}; {gate.script()}"], env=env)
    wait_for(lambda: proc_state(run.pid) == "T", 15, "the wrapper to pause right before COMMAND's spawn")
    [holder] = wait_for(lambda: _forks_of(work_procs, run.pid), 15, "the holder")
    os.kill(holder, signal.SIGSTOP)
    os.kill(run.pid, signal.SIGCONT)
    gate.wait_ready(timeout=15)
    os.kill(holder, signal.SIGCONT)
    hb = json.loads((work / "hb.json").read_text())
    assert hb["lease_seconds"] == 5, hb

    def settled() -> dict[str, Any] | None:
        t = lock_status(work_procs, "thread-work.8")["holder"]
        return t if t and t["holder_pid"] == holder else None

    got = wait_for(settled, 15, "the holder to look at its lease")  # it has heard COMMAND started
    time.sleep(0.5)  # what a holder that renews on hearing it would have written by now
    got = lock_status(work_procs, "thread-work.8")["holder"]
    assert (got["lease_seconds"], got["lease_expires_at"]) == (5, hb["lease_expires_at"]), (hb, got)
    gate.open()
    assert work_procs.finish(run).returncode == 0


def test_get_shows_the_expiry_the_last_heartbeat_set(backend: str, work_procs: Procs) -> None:
    acq = _acquire(work_procs)
    assert acq.returncode == 0, acq
    tid = acq.json["ticket_id"]
    hb = _cli(work_procs, "heartbeat-lock-ticket", _LOCK, tid, "--lease-seconds", "60", "--repo", _REPO)
    assert hb.returncode == 0, hb
    seen = [_get(work_procs, tid).json["lease_expires_at"] for _ in range(3)]
    assert seen == [hb.json["lease_expires_at"]] * 3, (hb.json["lease_expires_at"], seen)


def test_status_lists_locks_in_use_and_idle_ones_only_when_asked(backend: str, procs: Procs, work: Path) -> None:
    """After many short runs (thread-work.1..N), status lists only the locks someone holds or
    waits for; --idle adds the free ones; --all spans every scope; a lock named is shown free."""
    for n in range(1, 6):
        assert procs.pr_run("--job", f"thread-work.{n}", "--repo", "teams/a", "--", "true").returncode == 0
    gate = Gate(work)
    holder = procs.pr("--job", "held", "--repo", "teams/b", "--", "sh", "-c", gate.script())
    gate.wait_ready()

    def listed(*args: str) -> list[tuple[str, str, str]]:
        out = procs.run_text([PEARING_CLI, "status", "--json", *args])
        assert out.returncode == 0, out
        return [(x["repo"], x["lock_name"], x["state"]) for x in out.json]

    assert listed("--repo", "teams/a") == []
    idle = listed("--repo", "teams/a", "--idle")
    assert idle == [("teams/a", f"thread-work.{n}", "free") for n in range(1, 6)], idle
    assert listed("--all") == [("teams/b", "held", "held")]
    assert len(listed("--all", "--idle")) == 6
    assert listed("thread-work.3", "--repo", "teams/a") == [("teams/a", "thread-work.3", "free")]
    bad = procs.run_text([PEARING_CLI, "status", "--all", "--repo", "teams/a"])
    assert bad.returncode == ExitCode.USAGE and "--all" in bad.one_line(), bad
    gate.open()
    assert procs.finish(holder).returncode == 0


@pytest.mark.parametrize("body", [b"\x00not json", b'{"activity": 7}', b"[]"])
def test_a_corrupt_activity_record_is_74_naming_where_on_every_backend(
    body: bytes, backend: str, work_procs: Procs, lock_dir: Path
) -> None:
    """An activity record written by some other hand is the same 74 on every backend, naming
    where it is (etcd once read it as no activity at all), and the record is left for a person."""
    from singleflight.backend import open_backend
    from singleflight.core.request import ANY_VERSION, activity_record

    t = _acquire(work_procs, identity="ops@host").json
    assert t["state"] == "held", t
    b = open_backend(work_procs.env.get(ENV_BACKEND), str(lock_dir))
    try:
        assert b.write_record(activity_record("ops@host"), body, ANY_VERSION)
        got = _get(work_procs, t["ticket_id"])
        assert got.returncode == ExitCode.IOERR, got
        assert "not an activity record" in got.one_line() and "activity/ops@host" in got.one_line(), got
        assert b.read_record(activity_record("ops@host"))[0] == body
        assert b.write_record(activity_record("ops@host"), None, ANY_VERSION)  # the person's fix
    finally:
        b.close()
    assert _cli(work_procs, "release-lock-ticket", _LOCK, t["ticket_id"], "--repo", _REPO).returncode == 0


def test_global_options_mean_the_same_after_the_command(backend: str, procs: Procs) -> None:
    """``pearing-cli status --lock-dir X`` is ``pearing-cli --lock-dir X status`` (issue 26): each
    option of the top level (--lock-dir, --identity, --backend, --version) is taken after the
    command too; given on both sides, the later one counts. Here only the flags say where the
    state is: neither PEARING_LOCK_DIR nor PEARING_BACKEND is set."""
    env = {k: v for k, v in procs.env.items() if k not in (ENV_LOCK_DIR, ENV_BACKEND, ENV_IDENTITY)}
    url = backend_url(procs.env)
    where = ["--lock-dir", str(procs.lock_dir), *([] if url is None else ["--backend", url])]

    def cli(*args: str) -> Any:
        r = procs.run_text([PEARING_CLI, *args], env=env)
        assert r.returncode == 0 and r.stderr == "", r
        return r.json

    held = cli("acquire-lock", "L", "--request-uuid", _UUID, *where, "--identity", "alice@h1")
    assert held["state"] == "held" and held["identity"] == "alice@h1", held
    for listed in (cli(*where, "status", "L"), cli("status", "L", *where)):
        assert [(lk["lock_name"], lk["holder"]["ticket_id"]) for lk in listed] == [("L", held["ticket_id"])], listed
    assert cli("--identity", "bob@h1", "update-user-activity", "--clear", *where, "--identity", "carol@h1") == {
        "identity": "carol@h1",
        "activity": None,
    }
    assert cli("release-lock-ticket", "L", held["ticket_id"], *where)["state"] == "released"

    version = procs.run_text([PEARING_CLI, "status", "--version"], env=env)
    assert (version.returncode, version.stdout) == (0, f"pearing-cli {__version__}\n"), version
    before = procs.run_text([PEARING_CLI, "--backend", "bogus://x", "status"], env=env)
    after = procs.run_text([PEARING_CLI, "status", "--backend", "bogus://x"], env=env)
    assert before.returncode == after.returncode == ExitCode.USAGE and before.one_line() == after.one_line(), after
    unknown = procs.run_text([PEARING_CLI, "status", "--lock-dirs", "x"], env=env)
    assert unknown.returncode == ExitCode.USAGE and "--lock-dirs" in unknown.one_line(), unknown


PLAIN_START = """
import sys
from singleflight.cli import main as cli_main
from singleflight.cli.main import main
cli_main.plan = lambda argv: None  # through typer, as a command line the fast path leaves to it
try:
    code = main(sys.argv[1:])
finally:
    sys.stderr.write("pydantic loaded: %s\\n" % any(m.split(".")[0] == "pydantic" for m in sys.modules))
sys.exit(code)
"""


@pytest.mark.parametrize(
    ("argv", "code"),
    [
        (["status"], ExitCode.OK),
        (["acquire-lock", "x", "--lease-seconds", "9", "--repo", "r", "--request-key", "k"], ExitCode.OK),
        (["create-reply", "r", "1", "--kind", "k", "--body", "b", "--link", "a:1", "--link", "b:2", "--unfenced"], 0),
        (["acquire-lock", "x", "--lease-seconds", "9x"], ExitCode.USAGE),
        (["create-reply", "r", "1", "--kind", "k", "--body", "b", "--fence", "x"], ExitCode.USAGE),
    ],
    ids=["status", "acquire", "links", "bad-seconds", "bad-fence"],
)
def test_the_cli_takes_its_values_as_given_without_loading_pydantic(procs: Procs, argv: list[str], code: int) -> None:
    """typer would check every value through pydantic, three quarters of pearing-cli's start;
    ours are strings, lists of them and flags that names.py checks, so pydantic is never
    loaded, and a bad value is still one line and 64 (cli/_typer.py). Through typer, which
    these command lines reach only when the fast path declines them (test_cli_fast.py)."""
    r = procs.run([sys.executable, "-c", PLAIN_START, *argv])
    *said, loaded = r.stderr.decode().splitlines()
    assert loaded == "pydantic loaded: False", r
    assert r.returncode == code, r
    assert len(said) == (0 if code == ExitCode.OK else 1), r
    if argv[0] == "create-reply" and code == ExitCode.OK:
        tree = procs.run([sys.executable, "-m", "singleflight.cli.main", "get-thread-tree", "r", "1"])
        assert [link for reply in json.loads(tree.stdout)["replies"] for link in reply["links"]] == [
            "a:1",
            "b:2",
        ], tree
