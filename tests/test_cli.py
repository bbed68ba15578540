"""Acceptance tests for ``pearing-cli``: the seed walkthrough, queueing, leases, status, bad input.

Real processes only. Every wait is on a file, on command output or on a process
the test started (``_wait_for`` polls every 10 ms with a hard timeout). Detached
holders (``python -m singleflight.agent``) are killed at teardown.
"""

from __future__ import annotations

import contextlib
import json
import os
import pty
import re
import shlex
import signal
import stat
import subprocess
import sys
import time
import uuid
from collections.abc import Callable, Iterator
from datetime import datetime
from pathlib import Path
from typing import Any

import pytest

from singleflight import _proc
from singleflight._const import ENV_IDENTITY, ENV_LOCK_DIR, ENV_TICKET, ExitCode

_BIN = Path(sys.executable).parent
_RUN = str(_BIN / "pearing-run")
_CLI = str(_BIN / "pearing-cli")
_MARK_VAR = "SINGLEFLIGHT_CLI_TEST_MARK"

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


def _q(value: object) -> str:
    return shlex.quote(str(value))


def _wait_for(predicate: Callable[[], Any], timeout: float = 10.0, what: str = "condition") -> Any:
    """Poll ``predicate`` every 10 ms; return its first truthy value or fail the test."""
    deadline = time.monotonic() + timeout
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() >= deadline:
            pytest.fail(f"timed out after {timeout:g} s waiting for {what}")
        time.sleep(0.01)  # the poll interval, not a wait on its own


def _line_file(path: Path) -> str | None:
    try:
        text = path.read_text()
    except FileNotFoundError:
        return None
    return text.strip() if text.endswith("\n") else None


def _proc_state(pid: int) -> str | None:
    try:
        data = Path(f"/proc/{pid}/stat").read_bytes()
    except OSError:
        return None
    return data[data.rindex(b")") + 2 :].split()[0].decode()


def _alive(pid: int) -> bool:
    return _proc_state(pid) not in (None, "Z", "X")


def _tickets(lock_dir: Path, sub: str = "tickets") -> list[dict[str, Any]]:
    """Ticket records under ``locks/**/{sub}/*.json`` (live ones by default)."""
    out = []
    for path in sorted(lock_dir.glob(f"locks/**/{sub}/*.json")):
        with contextlib.suppress(OSError, ValueError):
            out.append(json.loads(path.read_text()))
    return out


def _ticket_files(lock_dir: Path) -> list[Path]:
    return sorted(lock_dir.glob("locks/**/tickets/*.json")) + sorted(lock_dir.glob("locks/**/ended/*.json"))


def _epoch(rfc3339: str) -> float:
    return datetime.fromisoformat(rfc3339.replace("Z", "+00:00")).timestamp()


class _Procs:
    """Starts real processes and kills every leftover at teardown.

    Leftovers are found three ways: the Popen objects started here, every
    process carrying this test's marker in its environment (COMMANDs, their
    children, detached holders), and the holder_pid of every live ticket record.
    """

    def __init__(self, env: dict[str, str], cwd: Path, lock_dir: Path) -> None:
        self.env, self.cwd, self.lock_dir = env, cwd, lock_dir
        self.popens: list[subprocess.Popen[str]] = []

    def start(self, argv: list[str], env: dict[str, str] | None = None) -> subprocess.Popen[str]:
        p = subprocess.Popen(
            argv,
            env=self.env if env is None else env,
            cwd=self.cwd,
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        self.popens.append(p)
        return p

    def run(self, argv: list[str], env: dict[str, str] | None = None, timeout: float = 45.0) -> Any:
        return subprocess.run(
            argv,
            env=self.env if env is None else env,
            cwd=self.cwd,
            stdin=subprocess.DEVNULL,
            capture_output=True,
            text=True,
            timeout=timeout,
            check=False,
        )

    def _marked(self) -> set[int]:
        needle = f"{_MARK_VAR}={self.env[_MARK_VAR]}".encode()
        found = set()
        for entry in Path("/proc").iterdir():
            if not entry.name.isdigit() or int(entry.name) == os.getpid():
                continue
            try:
                environ = (entry / "environ").read_bytes()
            except OSError:
                continue
            if needle in environ.split(b"\0"):
                found.add(int(entry.name))
        return found

    def _holders(self) -> set[int]:
        found = set()
        for t in _tickets(self.lock_dir):
            pid, start = t.get("holder_pid"), t.get("holder_start")
            if isinstance(pid, int) and _proc.alive(pid, start):
                found.add(pid)
        return found

    def cleanup(self) -> None:
        for _ in range(50):
            victims = {p.pid for p in self.popens if p.poll() is None} | self._marked() | self._holders()
            victims = {pid for pid in victims if _alive(pid)}
            if not victims:
                break
            for pid in victims:
                with contextlib.suppress(ProcessLookupError, PermissionError):
                    os.kill(pid, signal.SIGKILL)
            for p in self.popens:
                if p.poll() is None:
                    with contextlib.suppress(subprocess.TimeoutExpired):
                        p.wait(timeout=0.5)
        for p in self.popens:
            with contextlib.suppress(subprocess.TimeoutExpired):
                p.communicate(timeout=5)


@pytest.fixture
def _lock_dir(tmp_path: Path) -> Path:
    return tmp_path / "lockdir"


@pytest.fixture
def _work(tmp_path: Path) -> Path:
    d = tmp_path / "work"
    d.mkdir()
    return d


@pytest.fixture
def _env(_lock_dir: Path) -> dict[str, str]:
    """os.environ without any PEARING_* variable (no token, fault, lock or repo), own lock dir.

    The first responder is ``claude``; tests switch to ``codex`` for the second one.
    """
    e = {k: v for k, v in os.environ.items() if not k.startswith("PEARING_")}
    e[ENV_LOCK_DIR] = str(_lock_dir)
    e[ENV_IDENTITY] = "claude"
    e[_MARK_VAR] = uuid.uuid4().hex
    return e


@pytest.fixture
def _procs(_env: dict[str, str], _work: Path, _lock_dir: Path) -> Iterator[_Procs]:
    p = _Procs(_env, _work, _lock_dir)
    try:
        yield p
    finally:
        p.cleanup()


class _Result:
    def __init__(self, completed: Any, elapsed: float) -> None:
        self.code: int = completed.returncode
        self.stdout: str = completed.stdout
        self.stderr: str = completed.stderr
        self.elapsed = elapsed

    @property
    def json(self) -> Any:
        return json.loads(self.stdout)

    def one_line(self) -> str:
        lines = self.stderr.strip().splitlines()
        assert len(lines) == 1, f"expected one line on stderr, got {self.stderr!r}"
        return lines[0]

    def __repr__(self) -> str:
        return f"<exit {self.code} stdout={self.stdout!r} stderr={self.stderr!r}>"


def _cli(procs: _Procs, *args: str, identity: str | None = None, timeout: float = 45.0) -> _Result:
    env = None if identity is None else {**procs.env, ENV_IDENTITY: identity}
    started = time.monotonic()
    completed = procs.run([_CLI, *args], env=env, timeout=timeout)
    return _Result(completed, time.monotonic() - started)


def _acquire(
    procs: _Procs,
    request_uuid: str = _UUID,
    *,
    lease: str = "60",
    wait: str = "30",
    lock: str = _LOCK,
    repo: str = _REPO,
    identity: str | None = None,
) -> _Result:
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


def _get(procs: _Procs, ticket_id: str, lock: str = _LOCK, repo: str = _REPO) -> _Result:
    return _cli(procs, "get-lock-ticket", lock, ticket_id, "--repo", repo)


def _state(procs: _Procs, ticket_id: str, lock: str = _LOCK, repo: str = _REPO) -> str | None:
    r = _get(procs, ticket_id, lock, repo)
    return r.json["state"] if r.code == 0 else None


# -- the seed walkthrough ------------------------------------------------------


def test_seed_walkthrough(_procs: _Procs) -> None:
    acq = _acquire(_procs)
    assert acq.code == 0, acq
    t = acq.json
    assert isinstance(t, dict)
    for field in _FIELDS:
        assert field in t, f"ticket lacks {field}: {t}"
    assert t["state"] == "held"
    assert t["fence"] == 1
    assert t["request_uuid"] == _UUID
    assert t["lock_name"] == _LOCK
    assert t["repo"] == _REPO
    assert t["identity"] == "claude"
    assert t["queue_position"] is None
    assert t["activity"] is None
    assert _RFC3339_UTC.match(t["lease_expires_at"]), t["lease_expires_at"]
    assert 50 < _epoch(t["lease_expires_at"]) - time.time() <= 61
    uuid.UUID(t["ticket_id"])
    holder_pid = t["holder_pid"]
    assert isinstance(holder_pid, int) and _alive(holder_pid), "the detached holder should be running"
    token_file = Path(t["token_file"])
    assert token_file.is_file()
    assert stat.S_IMODE(token_file.stat().st_mode) == 0o600
    tid = t["ticket_id"]

    got = _get(_procs, tid)
    assert got.code == 0, got
    assert got.json["ticket_id"] == tid
    assert got.json["state"] == "held"
    assert got.json["fence"] == 1

    act = _cli(_procs, "update-user-activity", "--activity", _ACTIVITY)
    assert act.code == 0, act
    assert act.json["activity"] == _ACTIVITY
    got = _get(_procs, tid)
    assert got.code == 0
    assert got.json["activity"] == _ACTIVITY

    hb = _cli(_procs, "heartbeat-lock-ticket", _LOCK, tid, "--lease-seconds", "60", "--repo", _REPO)
    assert hb.code == 0, hb
    assert hb.json["state"] == "held"
    assert _RFC3339_UTC.match(hb.json["lease_expires_at"])
    assert _epoch(hb.json["lease_expires_at"]) > _epoch(t["lease_expires_at"])
    assert _get(_procs, tid).json["lease_expires_at"] == hb.json["lease_expires_at"]

    rel = _cli(_procs, "release-lock-ticket", _LOCK, tid, "--repo", _REPO)
    assert rel.code == 0, rel
    assert rel.json["state"] == "released"
    assert rel.json["ticket_id"] == tid
    _wait_for(lambda: not _alive(holder_pid), 10, "the detached holder to exit after release")
    assert not token_file.exists()

    again = _cli(_procs, "release-lock-ticket", _LOCK, tid, "--repo", _REPO)
    assert again.code == 0, again
    assert again.json["state"] == "released"

    late = _cli(_procs, "heartbeat-lock-ticket", _LOCK, tid, "--lease-seconds", "60", "--repo", _REPO)
    assert late.code == ExitCode.REFUSED, late
    assert "released" in late.one_line()

    clear = _cli(_procs, "update-user-activity", "--clear")
    assert clear.code == 0, clear
    assert clear.json["activity"] is None
    got = _get(_procs, tid)
    assert got.code == 0
    assert got.json["activity"] is None
    assert got.json["state"] == "released"


# -- queueing and idempotency ------------------------------------------------


def test_second_identity_waits_then_is_promoted(_procs: _Procs, _lock_dir: Path) -> None:
    first = _acquire(_procs)
    assert first.code == 0, first
    first_t = first.json

    waiting = _acquire(_procs, _UUID2, wait="0.5", identity="codex")
    assert waiting.code == ExitCode.BUSY, waiting
    w = waiting.json
    assert w["state"] == "waiting"
    assert w["queue_position"] == 1
    assert w["identity"] == "codex"
    assert w["fence"] is None
    assert "token_file" not in w or w["token_file"] is None

    released_at = time.time()
    rel = _cli(_procs, "release-lock-ticket", _LOCK, first_t["ticket_id"], "--repo", _REPO)
    assert rel.code == 0, rel

    retry = _acquire(_procs, _UUID2, wait="10", identity="codex")
    assert retry.code == 0, retry
    r = retry.json
    assert r["ticket_id"] == w["ticket_id"]
    assert r["state"] == "held"
    assert r["fence"] > first_t["fence"]
    assert r["identity"] == "codex"
    assert r["queue_position"] is None
    # Its lease started when it was promoted, not when it queued.
    assert _epoch(r["lease_expires_at"]) >= released_at + 60 - 0.05
    # One ticket per request uuid: the first holder's and codex's, nothing else.
    assert len(_ticket_files(_lock_dir)) == 2


def test_same_uuid_retry_while_held_returns_same_ticket_fast(_procs: _Procs, _lock_dir: Path) -> None:
    first = _acquire(_procs)
    assert first.code == 0, first
    files = _ticket_files(_lock_dir)
    assert len(files) == 1
    retry = _acquire(_procs, wait="30")
    assert retry.code == 0, retry
    assert retry.elapsed < 10, f"a retry with the same uuid waited {retry.elapsed:.1f} s behind itself"
    assert retry.json["ticket_id"] == first.json["ticket_id"]
    assert retry.json["state"] == "held"
    assert retry.json["fence"] == first.json["fence"] == 1
    assert _ticket_files(_lock_dir) == files


def test_lease_expiry_without_heartbeat_frees_the_lock(_procs: _Procs) -> None:
    started = time.monotonic()
    acq = _acquire(_procs, lease="1", wait="0")
    assert acq.code == 0, acq
    tid, holder_pid = acq.json["ticket_id"], acq.json["holder_pid"]
    _wait_for(lambda: _state(_procs, tid) == "expired", 15, "the unheartbeated ticket to expire")
    assert time.monotonic() - started >= 0.9
    _wait_for(lambda: not _alive(holder_pid), 10, "the holder to exit after expiry")
    hb = _cli(_procs, "heartbeat-lock-ticket", _LOCK, tid, "--lease-seconds", "60", "--repo", _REPO)
    assert hb.code == ExitCode.REFUSED, hb
    assert "expired" in hb.one_line()
    rel = _cli(_procs, "release-lock-ticket", _LOCK, tid, "--repo", _REPO)
    assert rel.code == ExitCode.REFUSED, rel
    assert "expired" in rel.one_line()
    nxt = _acquire(_procs, _UUID2, wait="0", identity="codex")
    assert nxt.code == 0, nxt
    assert nxt.json["state"] == "held"
    assert nxt.json["fence"] == 2


def test_waiting_ticket_without_heartbeat_leaves_the_queue(_procs: _Procs) -> None:
    holder = _acquire(_procs)
    assert holder.code == 0, holder
    w = _acquire(_procs, _UUID2, lease="2", wait="0.2", identity="codex")
    assert w.code == ExitCode.BUSY, w
    assert w.json["state"] == "waiting"
    tid = w.json["ticket_id"]
    _wait_for(lambda: _state(_procs, tid) == "cancelled", 15, "the abandoned waiting ticket to be cancelled")
    got = _get(_procs, tid).json
    assert got["queue_position"] is None
    st = _cli(_procs, "status", "--repo", _REPO)
    assert st.code == 0, st
    (entry,) = st.json
    assert entry["waiters"] == []
    assert entry["holder"]["ticket_id"] == holder.json["ticket_id"]


def test_heartbeat_keeps_a_waiting_ticket_in_line(_procs: _Procs) -> None:
    holder = _acquire(_procs)
    assert holder.code == 0, holder
    w = _acquire(_procs, _UUID2, lease="3", wait="0.2", identity="codex")
    assert w.code == ExitCode.BUSY, w
    tid = w.json["ticket_id"]
    first_deadline = _epoch(w.json["lease_expires_at"])
    hb = _cli(_procs, "heartbeat-lock-ticket", _LOCK, tid, "--lease-seconds", "30", "--repo", _REPO)
    assert hb.code == 0, hb
    assert hb.json["state"] == "waiting"
    _wait_for(lambda: time.time() > first_deadline + 1.0, 10, "the first waiting lease to pass")
    got = _get(_procs, tid)
    assert got.json["state"] == "waiting", got
    assert got.json["queue_position"] == 1


def test_waiters_are_served_in_fifo_order(_procs: _Procs) -> None:
    holder = _acquire(_procs)
    assert holder.code == 0, holder
    uuid_a, uuid_b = "3c1d2e4f-5a6b-4c7d-8e9f-0a1b2c3d4e5f", "4d2e3f5a-6b7c-4d8e-9f0a-1b2c3d4e5f60"
    a = _acquire(_procs, uuid_a, wait="0.2", identity="codex")
    b = _acquire(_procs, uuid_b, wait="0.2", identity="gemini")
    assert (a.code, b.code) == (ExitCode.BUSY, ExitCode.BUSY), (a, b)
    assert (a.json["queue_position"], b.json["queue_position"]) == (1, 2)
    assert _cli(_procs, "release-lock-ticket", _LOCK, holder.json["ticket_id"], "--repo", _REPO).code == 0
    a_held = _acquire(_procs, uuid_a, wait="10", identity="codex")
    assert a_held.code == 0, a_held
    assert a_held.json["state"] == "held"
    assert a_held.json["fence"] == 2
    b_still = _acquire(_procs, uuid_b, wait="0.2", identity="gemini")
    assert b_still.code == ExitCode.BUSY, b_still
    assert b_still.json["ticket_id"] == b.json["ticket_id"]
    assert b_still.json["queue_position"] == 1
    assert _cli(_procs, "release-lock-ticket", _LOCK, a_held.json["ticket_id"], "--repo", _REPO).code == 0
    b_held = _acquire(_procs, uuid_b, wait="10", identity="gemini")
    assert b_held.code == 0, b_held
    assert b_held.json["fence"] == 3


# -- status ------------------------------------------------------------------


def test_status_lists_holder_and_waiters(_procs: _Procs) -> None:
    holder = _acquire(_procs)
    assert holder.code == 0, holder
    assert _cli(_procs, "update-user-activity", "--activity", _ACTIVITY).code == 0
    waiter = _acquire(_procs, _UUID2, wait="0.2", identity="codex")
    assert waiter.code == ExitCode.BUSY, waiter
    other = _acquire(_procs, "5a0e8c1d-3f4b-4d2a-8e6f-7b9c0d1e2f3a", lock="checkin", repo="default", wait="0")
    assert other.code == 0, other

    st = _cli(_procs, "status", "--repo", _REPO)
    assert st.code == 0, st
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

    one = _cli(_procs, "status", _LOCK, "--repo", _REPO)
    assert one.code == 0, one
    assert [x["lock_name"] for x in one.json] == [_LOCK]

    # Without --repo: the default scope, like every other command.
    default = _cli(_procs, "status")
    assert default.code == 0, default
    assert [(x["lock_name"], x["repo"]) for x in default.json] == [("checkin", "default")]


def test_status_is_json_off_a_terminal_and_a_table_on_one(_procs: _Procs) -> None:
    acq = _acquire(_procs)
    assert acq.code == 0, acq
    piped = _cli(_procs, "status", "--repo", _REPO)
    assert piped.code == 0, piped
    assert isinstance(piped.json, list)
    assert piped.json[0]["lock_name"] == _LOCK

    controller, terminal = pty.openpty()
    try:
        p = subprocess.Popen(
            [_CLI, "status", "--repo", _REPO],
            env=_procs.env,
            cwd=_procs.cwd,
            stdin=subprocess.DEVNULL,
            stdout=terminal,
            stderr=subprocess.PIPE,
        )
        _procs.popens.append(p)  # type: ignore[arg-type]
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


@pytest.mark.parametrize(
    ("args", "named"),
    [
        (["acquire-lock", "bad name!", "--request-uuid", _U], "bad name!"),
        (["acquire-lock", "-lead", "--request-uuid", _U], None),
        (["acquire-lock", "ok", "--request-uuid", _U, "--repo", "a//b"], "a//b"),
        (["acquire-lock", "ok", "--request-uuid", _U, "--repo", "../escape"], "../escape"),
        (["acquire-lock", "ok", "--request-uuid", _U, "--repo", "/abs"], "/abs"),
        (["acquire-lock", "ok", "--request-uuid", "not-a-uuid"], "not-a-uuid"),
        (["acquire-lock", "ok", "--request-uuid", _U, "--lease-seconds", "0"], "--lease-seconds"),
        (["acquire-lock", "ok", "--request-uuid", _U, "--wait-seconds", "-1"], "-1"),
        (["acquire-lock", "ok", "--request-uuid", _U, "--wait-seconds", "soon"], "soon"),
        (["frobnicate"], "frobnicate"),
        (["acquire-lock", "--request-uuid", _U], None),
        (["get-lock-ticket"], None),
        (["get-lock-ticket", "ok", "not-a-ticket"], "not-a-ticket"),
        (["update-user-activity", "--activity", "x", "--clear"], None),
        (["update-user-activity"], None),
    ],
    ids=[
        "bad-lock-name",
        "lock-name-leading-dash",
        "scope-empty-segment",
        "scope-dotdot",
        "scope-absolute",
        "bad-uuid",
        "lease-zero",
        "wait-negative",
        "wait-not-a-number",
        "unknown-subcommand",
        "missing-name",
        "get-missing-name",
        "bad-ticket-id",
        "activity-and-clear",
        "neither-activity-nor-clear",
    ],
)
def test_bad_arguments_exit_64_with_one_line(
    _procs: _Procs, tmp_path: Path, _lock_dir: Path, args: list[str], named: str | None
) -> None:
    def outside() -> list[str]:
        return sorted(p.name for p in tmp_path.iterdir() if p != _lock_dir)

    before = outside()
    r = _cli(_procs, *args)
    assert r.code == ExitCode.USAGE, r
    line = r.one_line()
    if named is not None:
        assert named in line, line
    # Nothing outside the lock dir, and no lock inside it.
    assert outside() == before, "a bad argument created files outside the lock dir"
    assert not list(_lock_dir.glob("locks/**/@*")), "a bad argument created a lock"


# -- inside a pearing-run COMMAND --------------------------------------------


def test_defaults_from_environment_inside_pearing_run(_procs: _Procs, _work: Path) -> None:
    script = (
        f'echo "${ENV_TICKET}" > ticket; '
        f"{_q(_CLI)} heartbeat-lock-ticket --lease-seconds 5 > hb.json; echo $? > hb.rc; "
        f"{_q(_CLI)} get-lock-ticket > get.json; echo $? > get.rc"
    )
    r = _procs.run(
        [
            _RUN,
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
        ]
    )
    assert r.returncode == 0, r.stderr
    assert _line_file(_work / "hb.rc") == "0"
    assert _line_file(_work / "get.rc") == "0"
    ticket = _line_file(_work / "ticket")
    hb = json.loads((_work / "hb.json").read_text())
    got = json.loads((_work / "get.json").read_text())
    for t in (hb, got):
        assert t["ticket_id"] == ticket
        assert t["lock_name"] == "thread-work.7"
        assert t["repo"] == "teams/platform/api"
        assert t["state"] == "held"
        assert t["fence"] == 1
    assert hb["lease_seconds"] == 5
    assert got["lease_expires_at"] == hb["lease_expires_at"]
    assert _epoch(hb["lease_expires_at"]) - time.time() < 6
