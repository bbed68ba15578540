"""Acceptance tests for ``pearing-guard``: verify, exec (with its hold-off) and the fence ledger.

Real processes only. Every wait is on a file or on a process the test started
(``_wait_for`` polls every 10 ms with a hard timeout); COMMANDs block on a
``go`` file that the test creates.
"""

from __future__ import annotations

import contextlib
import json
import os
import random
import re
import secrets
import shlex
import signal
import subprocess
import sys
import time
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from singleflight import _proc, guard
from singleflight._const import (
    ENV_FENCE,
    ENV_LOCK,
    ENV_LOCK_DIR,
    ENV_REPO,
    ENV_TICKET,
    ENV_TOKEN,
    ENV_TOKEN_FILE,
    ExitCode,
)
from singleflight.errors import StaleFence

_BIN = Path(sys.executable).parent
_RUN = str(_BIN / "pearing-run")
_GUARD = str(_BIN / "pearing-guard")
_MARK_VAR = "SINGLEFLIGHT_GUARD_TEST_MARK"
# A COMMAND body that says it started and then blocks until the test creates ``go``.
_GATE = "touch ready; while [ ! -e go ]; do sleep 0.01; done"


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
    """The stripped content of a file written by ``echo/date > path`` once it is complete."""
    try:
        text = path.read_text()
    except FileNotFoundError:
        return None
    return text.strip() if text.endswith("\n") else None


def _wait_line(path: Path, timeout: float = 10.0) -> str:
    return str(_wait_for(lambda: _line_file(path), timeout, f"{path.name} to be written"))


def _never(predicate: Callable[[], Any], seconds: float, what: str) -> None:
    """Poll ``predicate`` for ``seconds``; fail the test if it ever holds."""
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        if predicate():
            pytest.fail(what)
        time.sleep(0.01)  # the poll interval


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

    def run(self, argv: list[str], env: dict[str, str] | None = None, timeout: float = 30.0) -> Any:
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
    """os.environ without any PEARING_* variable (no token, fault, lock or repo), own lock dir."""
    e = {k: v for k, v in os.environ.items() if not k.startswith("PEARING_")}
    e[ENV_LOCK_DIR] = str(_lock_dir)
    e[_MARK_VAR] = uuid.uuid4().hex
    return e


@pytest.fixture
def _procs(_env: dict[str, str], _work: Path, _lock_dir: Path) -> Iterator[_Procs]:
    p = _Procs(_env, _work, _lock_dir)
    try:
        yield p
    finally:
        p.cleanup()


def _run_argv(job: str, script: str, *flags: str) -> list[str]:
    return [_RUN, "--job", job, *flags, "--", "sh", "-c", script]


def _one_line(stderr: str) -> str:
    lines = stderr.strip().splitlines()
    assert len(lines) == 1, f"expected one line on stderr, got {stderr!r}"
    return lines[0]


def _start_blocked_run(procs: _Procs, work: Path, job: str, prefix: str, *flags: str) -> subprocess.Popen[str]:
    """A pearing-run whose COMMAND runs ``prefix`` and then blocks on ``go``; returns once it is in."""
    p = procs.start(_run_argv(job, f"{prefix}; {_GATE}", *flags))
    _wait_for(lambda: (work / "ready").exists() or p.poll() is not None, 15, "COMMAND to start")
    assert p.poll() is None, f"pearing-run ended early: {p.returncode} {p.communicate()}"
    return p


# -- verify ----------------------------------------------------------------


def test_verify_inside_run_exits_0_and_json_has_fence(_procs: _Procs, _work: Path) -> None:
    script = (
        f"{_q(_GUARD)} verify; echo $? > v.rc; "
        f"{_q(_GUARD)} verify --json > v.json; echo $? > vj.rc; "
        f'echo "${ENV_FENCE}" > fence'
    )
    r = _procs.run(_run_argv("guard-verify", script))
    assert r.returncode == 0, r.stderr
    assert _line_file(_work / "v.rc") == "0"
    assert _line_file(_work / "vj.rc") == "0"
    verdict = json.loads((_work / "v.json").read_text())
    assert isinstance(verdict, dict)
    assert verdict["ok"] is True
    assert verdict["fence"] == int(_line_file(_work / "fence") or "0") == 1


def test_verify_via_env_only_inside_run(_procs: _Procs, _work: Path) -> None:
    """PEARING_TOKEN + PEARING_LOCK + PEARING_REPO, no PEARING_TOKEN_FILE (nor PEARING_TICKET)."""
    script = (
        f"env -u {ENV_TOKEN_FILE} -u {ENV_TICKET} {_q(_GUARD)} verify --json > v.json; echo $? > v.rc; "
        f'[ -n "${ENV_TOKEN}" ] && [ -n "${ENV_LOCK}" ] && [ -n "${ENV_REPO}" ] && echo yes > vars'
    )
    r = _procs.run(_run_argv("guard-env", script, "--repo", "teams/platform/website"))
    assert r.returncode == 0, r.stderr
    assert _line_file(_work / "vars") == "yes"
    assert _line_file(_work / "v.rc") == "0"
    verdict = json.loads((_work / "v.json").read_text())
    assert verdict["ok"] is True
    assert verdict["fence"] == 1


def test_verify_after_release_is_refused(_procs: _Procs, _work: Path) -> None:
    r = _procs.run(_run_argv("guard-rel", 'cp "$PEARING_TOKEN_FILE" tok.copy; echo "$PEARING_TOKEN_FILE" > tokpath'))
    assert r.returncode == 0, r.stderr
    copy = _work / "tok.copy"
    assert copy.exists()
    v = _procs.run([_GUARD, "verify", "--token-file", str(copy)])
    assert v.returncode == ExitCode.REFUSED, v
    assert re.search(r"released|superseded", _one_line(v.stderr)), v.stderr
    # --json reports the refusal too.
    vj = _procs.run([_GUARD, "verify", "--token-file", str(copy), "--json"])
    assert vj.returncode == ExitCode.REFUSED
    assert json.loads(vj.stdout)["ok"] is False
    # The run's own token file is gone: still a refusal, not a usage error.
    original = _line_file(_work / "tokpath") or ""
    assert original and not Path(original).exists()
    g = _procs.run([_GUARD, "verify"], env={**_procs.env, ENV_TOKEN_FILE: original})
    assert g.returncode == ExitCode.REFUSED, g
    _one_line(g.stderr)


def test_verify_superseded_by_newer_holder(_procs: _Procs, _work: Path) -> None:
    r = _procs.run(_run_argv("guard-sup", 'cp "$PEARING_TOKEN_FILE" old.tok'))
    assert r.returncode == 0, r.stderr
    second = _start_blocked_run(_procs, _work, "guard-sup", 'cp "$PEARING_TOKEN_FILE" new.tok')
    old = _procs.run([_GUARD, "verify", "--token-file", str(_work / "old.tok")])
    assert old.returncode == ExitCode.REFUSED, old
    assert "superseded by fence 2" in _one_line(old.stderr)
    new = _procs.run([_GUARD, "verify", "--token-file", str(_work / "new.tok"), "--json"])
    assert new.returncode == 0, new
    assert json.loads(new.stdout)["fence"] == 2
    (_work / "go").touch()
    assert second.wait(timeout=15) == 0


def test_verify_after_lease_expiry_is_refused(_procs: _Procs, _work: Path) -> None:
    script = f'cp "$PEARING_TOKEN_FILE" tok.copy; {_GATE}'
    p = _procs.start(
        _run_argv("guard-exp", script, "--heartbeat", "manual", "--lease-seconds", "1", "--kill-grace", "2")
    )
    _wait_for(lambda: (_work / "ready").exists() or p.poll() is not None, 15, "COMMAND to copy its token file")
    assert (_work / "tok.copy").is_file(), p.communicate()
    # Never heartbeated: the lease lapses and pearing-run reports the loss.
    assert p.wait(timeout=20) == ExitCode.LEASE_LOST, p.communicate()
    assert not (_work / "go").exists()
    v = _procs.run([_GUARD, "verify", "--token-file", str(_work / "tok.copy")])
    assert v.returncode == ExitCode.REFUSED, v
    assert re.search(r"expir|released|superseded", _one_line(v.stderr)), v.stderr


def test_verify_forged_token_is_refused(_procs: _Procs, _work: Path) -> None:
    p = _start_blocked_run(_procs, _work, "guard-forge", 'cp "$PEARING_TOKEN_FILE" tok.copy')
    real = json.loads((_work / "tok.copy").read_text())
    forged = dict(real)
    forged["token"] = secrets.token_hex(32)
    assert forged["token"] != real["token"] and re.fullmatch(r"[0-9a-f]{64}", forged["token"])
    (_work / "forged.tok").write_text(json.dumps(forged))
    (_work / "forged.tok").chmod(0o600)
    v = _procs.run([_GUARD, "verify", "--token-file", str(_work / "forged.tok")])
    assert v.returncode == ExitCode.REFUSED, v
    assert "unknown or forged token" in _one_line(v.stderr)
    # The genuine copy of the same live ticket passes: only the token differs.
    ok = _procs.run([_GUARD, "verify", "--token-file", str(_work / "tok.copy")])
    assert ok.returncode == 0, ok
    (_work / "go").touch()
    assert p.wait(timeout=15) == 0


def test_verify_missing_token_file_is_refusal_not_usage(_procs: _Procs, _work: Path) -> None:
    v = _procs.run([_GUARD, "verify", "--token-file", str(_work / "no-such.token")])
    assert v.returncode == ExitCode.REFUSED, v
    _one_line(v.stderr)


def test_verify_without_any_token_source_is_usage(_procs: _Procs) -> None:
    assert not any(k.startswith("PEARING_TOKEN") for k in _procs.env)
    v = _procs.run([_GUARD, "verify"])
    assert v.returncode == ExitCode.USAGE, v
    _one_line(v.stderr)


def test_verify_token_file_that_is_a_directory_is_one_clean_line(_procs: _Procs, _work: Path) -> None:
    """A bad token-file path is a refusal (1) or a usage error (64), never a traceback."""
    v = _procs.run([_GUARD, "verify", "--token-file", str(_work)])
    assert v.returncode in (ExitCode.REFUSED, ExitCode.USAGE), v
    assert "Traceback" not in v.stderr, v.stderr
    _one_line(v.stderr)


def test_verify_when_the_lock_dir_is_gone_is_a_refusal(_procs: _Procs, tmp_path: Path) -> None:
    """A token whose lock dir no longer exists (state wiped) is not live: exit 1, not 73."""
    env = {
        **_procs.env,
        ENV_LOCK_DIR: str(tmp_path / "wiped"),
        ENV_TOKEN: secrets.token_hex(32),
        ENV_LOCK: "guard-wiped",
        ENV_REPO: "default",
    }
    v = _procs.run([_GUARD, "verify"], env=env)
    assert v.returncode == ExitCode.REFUSED, v
    _one_line(v.stderr)
    assert not (tmp_path / "wiped").exists()


# -- exec ------------------------------------------------------------------


def test_exec_inside_run_runs_cmd(_procs: _Procs, _work: Path) -> None:
    script = f"{_q(_GUARD)} exec -- sh -c 'echo hi > f'; echo $? > exec.rc"
    r = _procs.run(_run_argv("guard-exec", script))
    assert r.returncode == 0, r.stderr
    assert _line_file(_work / "exec.rc") == "0"
    assert (_work / "f").read_text() == "hi\n"


def test_exec_passes_cmd_status_through(_procs: _Procs, _work: Path) -> None:
    script = f"{_q(_GUARD)} exec -- sh -c 'exit 7'"
    r = _procs.run(_run_argv("guard-exec7", script))
    assert r.returncode == 7, r.stderr


def test_exec_outside_live_run_refuses_and_never_starts_cmd(_procs: _Procs, _work: Path) -> None:
    r = _procs.run(
        _run_argv("guard-exec-out", 'cp "$PEARING_TOKEN_FILE" tok.copy; echo "$PEARING_TOKEN_FILE" > tokpath')
    )
    assert r.returncode == 0, r.stderr
    original = _line_file(_work / "tokpath") or ""
    assert original
    via_env = _procs.run(
        [_GUARD, "exec", "--", "sh", "-c", "touch marker1"], env={**_procs.env, ENV_TOKEN_FILE: original}
    )
    assert via_env.returncode == ExitCode.REFUSED, via_env
    _one_line(via_env.stderr)
    via_copy = _procs.run([_GUARD, "exec", "--token-file", str(_work / "tok.copy"), "--", "sh", "-c", "touch marker2"])
    assert via_copy.returncode == ExitCode.REFUSED, via_copy
    _one_line(via_copy.stderr)
    assert not (_work / "marker1").exists()
    assert not (_work / "marker2").exists()


def test_exec_max_seconds_kills_long_cmd(_procs: _Procs, _work: Path) -> None:
    inner = "echo $$ > cmd.pid; while [ ! -e go ]; do sleep 0.01; done; touch finished"
    script = f"{_q(_GUARD)} exec --max-seconds 1 -- sh -c {_q(inner)}; echo $? > exec.rc"
    started = time.monotonic()
    p = _procs.start(_run_argv("guard-maxs", script))
    rc = _wait_line(_work / "exec.rc", timeout=15)
    elapsed = time.monotonic() - started
    assert rc == str(int(ExitCode.LEASE_LOST))
    assert 0.9 <= elapsed < 8.0, elapsed
    assert not (_work / "finished").exists()
    cmd_pid = int(_line_file(_work / "cmd.pid") or "0")
    assert cmd_pid > 0
    _wait_for(lambda: not _alive(cmd_pid), 5, "the guarded CMD to be gone")
    assert p.wait(timeout=15) == 0


def test_exec_holds_off_expiry_and_handover(_procs: _Procs, _work: Path, _lock_dir: Path) -> None:
    """Lease expiry waits for an in-flight guarded CMD; the next holder starts only after it."""
    guarded = "date +%s%N > g_start; while [ ! -e go ]; do sleep 0.01; done; date +%s%N > g_end"
    holder = _procs.start(
        [
            _RUN,
            "--job",
            "J",
            "--heartbeat",
            "manual",
            "--lease-seconds",
            "1",
            "--kill-grace",
            "2",
            "--",
            _GUARD,
            "exec",
            "--max-seconds",
            "20",
            "--",
            "sh",
            "-c",
            guarded,
        ]
    )
    _wait_for(lambda: _line_file(_work / "g_start") or holder.poll() is not None, 15, "the guarded CMD to start")
    assert holder.poll() is None, holder.communicate()
    held = [t for t in _tickets(_lock_dir) if t["state"] == "held"]
    assert len(held) == 1, held
    lease_expires_at = float(held[0]["lease_expires_at"])

    waiter = _procs.start([_RUN, "--wait-seconds", "30", "--job", "J", "--", "sh", "-c", "date +%s%N > w_start"])
    _wait_for(
        lambda: any(t["state"] == "waiting" for t in _tickets(_lock_dir)) or waiter.poll() is not None,
        15,
        "the waiter to queue",
    )
    # The holder's lease deadline passes (plus a generous margin) while the guarded CMD is in flight.
    _wait_for(lambda: time.time() > lease_expires_at + 1.5, 15, "the holder's lease deadline to pass")
    assert not (_work / "w_start").exists(), "the waiter started while a guarded CMD was in flight"
    assert waiter.poll() is None, waiter.communicate()
    assert not (_work / "g_end").exists()

    (_work / "go").touch()
    assert waiter.wait(timeout=20) == 0, waiter.communicate()
    assert holder.wait(timeout=20) == ExitCode.LEASE_LOST, holder.communicate()
    g_end = int(_wait_line(_work / "g_end"))
    w_start = int(_wait_line(_work / "w_start"))
    assert w_start > g_end, (w_start, g_end)


def test_exec_holds_off_handover_after_command_ends(_procs: _Procs, _work: Path, _lock_dir: Path) -> None:
    """COMMAND ends while a background guarded CMD is in flight: the next holder waits for it."""
    guarded = "date +%s%N > g_start; while [ ! -e go ]; do sleep 0.01; done; date +%s%N > g_end"
    script = (
        f"{_q(_GUARD)} exec --max-seconds 20 -- sh -c {_q(guarded)} & "
        "while [ ! -e g_start ]; do sleep 0.01; done; touch cmd_done; exit 0"
    )
    holder = _procs.start(_run_argv("H", script))
    _wait_for(lambda: (_work / "cmd_done").exists() or holder.poll() is not None, 15, "COMMAND to end")
    waiter = _procs.start([_RUN, "--wait-seconds", "30", "--job", "H", "--", "sh", "-c", "date +%s%N > w_start"])
    _never(
        (_work / "w_start").exists,
        2.0,
        "the lock changed hands while a guarded CMD was in flight",
    )
    assert waiter.poll() is None, waiter.communicate()
    assert not (_work / "g_end").exists()
    (_work / "go").touch()
    assert waiter.wait(timeout=20) == 0, waiter.communicate()
    assert holder.wait(timeout=20) == 0
    assert int(_wait_line(_work / "w_start")) > int(_wait_line(_work / "g_end"))


# -- fence ledger ------------------------------------------------------------


def test_fence_ledger_sequence(_procs: _Procs) -> None:
    def fence(n: str) -> Any:
        return _procs.run([_GUARD, "fence", "--resource", "R", "--fence", n])

    assert fence("5").returncode == 0
    r = fence("4")
    assert r.returncode == ExitCode.REFUSED
    assert "stale fence 4 < 5" in _one_line(r.stderr)
    assert fence("5").returncode == 0
    assert fence("6").returncode == 0
    r = fence("5")
    assert r.returncode == ExitCode.REFUSED
    assert "stale fence 5 < 6" in _one_line(r.stderr)


def test_fence_with_ledger_path_records_it(_procs: _Procs, tmp_path: Path) -> None:
    ledger = tmp_path / "target" / "ledger.json"
    ledger.parent.mkdir()
    r = _procs.run([_GUARD, "fence", "--resource", "branch:thread-42", "--fence", "3", "--ledger", str(ledger)])
    assert r.returncode == 0, r
    assert json.loads(ledger.read_text())["branch:thread-42"] == 3
    r = _procs.run([_GUARD, "fence", "--resource", "branch:thread-42", "--fence", "9", "--ledger", str(ledger)])
    assert r.returncode == 0, r
    assert json.loads(ledger.read_text())["branch:thread-42"] == 9
    r = _procs.run([_GUARD, "fence", "--resource", "branch:thread-42", "--fence", "8", "--ledger", str(ledger)])
    assert r.returncode == ExitCode.REFUSED
    assert json.loads(ledger.read_text())["branch:thread-42"] == 9


def test_fence_concurrent_callers(_procs: _Procs, _work: Path, tmp_path: Path) -> None:
    ledger = tmp_path / "concurrent.json"
    fences = list(range(1, 21))
    random.Random(20240611).shuffle(fences)
    gate = 'while [ ! -e go ]; do sleep 0.01; done; exec "$@"'
    procs = {
        n: _procs.start(
            ["sh", "-c", gate, "sh", _GUARD, "fence", "--resource", "R", "--fence", str(n), "--ledger", str(ledger)]
        )
        for n in fences
    }
    (_work / "go").touch()
    results = {}
    for n, p in procs.items():
        _out, err = p.communicate(timeout=30)
        results[n] = (p.returncode, err)
    codes = {rc for rc, _ in results.values()}
    assert codes <= {0, 1}, results
    assert json.loads(ledger.read_text())["R"] == 20
    accepted = {n for n, (rc, _) in results.items() if rc == 0}
    assert 20 in accepted
    for n, (rc, err) in results.items():
        if rc == 1:
            m = re.search(r"stale fence (\d+) < (\d+)", err)
            assert m, err
            assert int(m.group(1)) == n
            # Refused only because of a higher fence that really was accepted.
            assert int(m.group(2)) > n and int(m.group(2)) in accepted, (n, err, accepted)


@pytest.mark.parametrize(
    "args",
    [
        ["--resource", "R", "--fence", "0"],
        ["--resource", "R", "--fence", "abc"],
        ["--resource", "R", "--fence", "-3"],
        ["--fence", "5"],
        ["--resource", "R"],
    ],
    ids=["fence-0", "fence-abc", "fence-negative", "no-resource", "no-fence"],
)
def test_fence_bad_arguments_are_usage(_procs: _Procs, args: list[str]) -> None:
    r = _procs.run([_GUARD, "fence", *args])
    assert r.returncode == ExitCode.USAGE, r
    _one_line(r.stderr)


def test_fence_ledger_in_a_missing_directory_is_not_a_stale_fence(_procs: _Procs, tmp_path: Path) -> None:
    """A bad --ledger path must not look like a refusal (1 = stale fence) nor crash with a traceback."""
    ledger = tmp_path / "missing" / "ledger.json"
    r = _procs.run([_GUARD, "fence", "--resource", "R", "--fence", "3", "--ledger", str(ledger)])
    assert r.returncode in (ExitCode.USAGE, ExitCode.CANTCREAT), r
    assert "Traceback" not in r.stderr, r.stderr
    assert str(ledger.parent) in _one_line(r.stderr)


@pytest.mark.parametrize(
    "args",
    [
        ["exec"],
        ["exec", "--"],
        ["exec", "--max-seconds", "0", "--", "true"],
        ["exec", "--max-seconds", "abc", "--", "true"],
        ["verify", "--token-file"],
        ["verify", "extra"],
        ["verify", "--bogus"],
        ["frobnicate"],
    ],
    ids=[
        "exec-no-cmd",
        "exec-empty-cmd",
        "max-seconds-zero",
        "max-seconds-abc",
        "token-file-no-value",
        "verify-extra-arg",
        "verify-unknown-flag",
        "unknown-command",
    ],
)
def test_guard_bad_arguments_are_usage(_procs: _Procs, args: list[str]) -> None:
    r = _procs.run([_GUARD, *args])
    assert r.returncode == ExitCode.USAGE, r
    _one_line(r.stderr)


def test_python_api_accept_fence(tmp_path: Path) -> None:
    ledger = str(tmp_path / "api-ledger.json")
    assert guard.accept_fence("r2", 3, ledger=ledger) == 3
    with pytest.raises(StaleFence) as info:
        guard.accept_fence("r2", 2, ledger=ledger)
    assert info.value.exit_code == ExitCode.REFUSED
    assert "stale fence 2 < 3" in str(info.value)
    assert json.loads(Path(ledger).read_text())["r2"] == 3
    assert guard.accept_fence("r2", 3, ledger=ledger) == 3
