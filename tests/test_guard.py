"""Acceptance tests for ``pearing-guard``: verify, exec (with its hold-off) and the fence ledger.

Real processes only. Every wait is on a file or on a process the test started
(``wait_for`` polls every 10 ms with a hard timeout); COMMANDs block on a
``go`` file that the test creates. Tests that take ``backend`` (or ``caps``) run on the
lock dir and on etcd; fences are read from the run, since on etcd they are revisions.
"""

from __future__ import annotations

import json
import random
import re
import secrets
import signal
import subprocess
import time
from collections.abc import Callable
from datetime import datetime
from pathlib import Path
from typing import Any

import pytest
from caps import Caps
from helpers import (
    PEARING_GUARD,
    PEARING_RUN,
    Procs,
    TextResult,
    line_file,
    pid_alive,
    q,
    signal_sets,
    signals_in,
    wait_for,
    wait_line,
    wait_queued,
)

from singleflight import guard
from singleflight.core.const import (
    ENV_FENCE,
    ENV_LOCK,
    ENV_LOCK_DIR,
    ENV_REPO,
    ENV_TICKET,
    ENV_TOKEN,
    ENV_TOKEN_FILE,
    ExitCode,
)
from singleflight.core.errors import StaleFence

# A COMMAND body that says it started and then blocks until the test creates ``go``.
_GATE = "touch ready; while [ ! -e go ]; do sleep 0.01; done"


def _never(predicate: Callable[[], Any], seconds: float, what: str) -> None:
    """Poll ``predicate`` for ``seconds``; fail the test if it ever holds."""
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        if predicate():
            pytest.fail(what)
        time.sleep(0.01)  # the poll interval


def _epoch(rfc3339: str) -> float:
    return datetime.fromisoformat(rfc3339.replace("Z", "+00:00")).timestamp()


def _run_argv(job: str, script: str, *flags: str) -> list[str]:
    return [PEARING_RUN, "--job", job, *flags, "--", "sh", "-c", script]


def _start_blocked_run(procs: Procs, work: Path, job: str, prefix: str, *flags: str) -> subprocess.Popen[str]:
    """A pearing-run whose COMMAND runs ``prefix`` and then blocks on ``go``; returns once it is in."""
    p = procs.start(_run_argv(job, f"{prefix}; {_GATE}", *flags), text=True)
    wait_for(lambda: (work / "ready").exists() or p.poll() is not None, 15, "COMMAND to start")
    assert p.poll() is None, f"pearing-run ended early: {p.returncode} {p.communicate()}"
    return p


# -- verify ----------------------------------------------------------------


def test_verify_inside_run_exits_0_and_json_has_fence(caps: Caps, work_procs: Procs, work: Path) -> None:
    script = (
        f"{q(PEARING_GUARD)} verify; echo $? > v.rc; "
        f"{q(PEARING_GUARD)} verify --json > v.json; echo $? > vj.rc; "
        f'echo "${ENV_FENCE}" > fence'
    )
    r = work_procs.run_text(_run_argv("guard-verify", script))
    assert r.returncode == 0, r.stderr
    assert line_file(work / "v.rc") == "0"
    assert line_file(work / "vj.rc") == "0"
    verdict = json.loads((work / "v.json").read_text())
    assert isinstance(verdict, dict)
    assert verdict["ok"] is True
    assert verdict["fence"] == int(line_file(work / "fence") or "0")
    assert not caps.contiguous_fences or verdict["fence"] == 1


def test_verify_via_env_only_inside_run(backend: str, work_procs: Procs, work: Path) -> None:
    """PEARING_TOKEN + PEARING_LOCK + PEARING_REPO, no PEARING_TOKEN_FILE (nor PEARING_TICKET)."""
    script = (
        f"env -u {ENV_TOKEN_FILE} -u {ENV_TICKET} {q(PEARING_GUARD)} verify --json > v.json; echo $? > v.rc; "
        f'[ -n "${ENV_TOKEN}" ] && [ -n "${ENV_LOCK}" ] && [ -n "${ENV_REPO}" ] && echo yes > vars; '
        f'echo "${ENV_FENCE}" > fence'
    )
    r = work_procs.run_text(_run_argv("guard-env", script, "--repo", "teams/platform/website"))
    assert r.returncode == 0, r.stderr
    assert line_file(work / "vars") == "yes"
    assert line_file(work / "v.rc") == "0"
    verdict = json.loads((work / "v.json").read_text())
    assert verdict["ok"] is True
    assert verdict["fence"] == int(line_file(work / "fence") or "0")


def test_env_only_token_guards_exec_and_is_refused_after_release(backend: str, work_procs: Procs, work: Path) -> None:
    """The same token source for exec; after the run its token is refused, and so is a forged one."""
    env_only = f"env -u {ENV_TOKEN_FILE} -u {ENV_TICKET}"
    script = (
        f"{env_only} {q(PEARING_GUARD)} exec -- sh -c 'echo \"$PEARING_TICKET\" > in_exec'; echo $? > x.rc; "
        f'echo "${ENV_TOKEN}" > token'
    )
    r = work_procs.run_text(_run_argv("guard-env-x", script, "--repo", "teams/platform/website"))
    assert r.returncode == 0, r.stderr
    assert line_file(work / "x.rc") == "0"
    assert line_file(work / "in_exec") == ""  # CMD ran, with no ticket id to go on
    after = {**work_procs.env, ENV_LOCK: "guard-env-x", ENV_REPO: "teams/platform/website"}
    for token in (line_file(work / "token") or "", secrets.token_hex(32)):
        v = work_procs.run_text([PEARING_GUARD, "verify", "--json"], env={**after, ENV_TOKEN: token})
        assert v.returncode == ExitCode.REFUSED, v
        assert json.loads(v.stdout)["ok"] is False
        v.one_line()


def test_verify_after_release_is_refused(backend: str, work_procs: Procs, work: Path) -> None:
    r = work_procs.run_text(
        _run_argv("guard-rel", 'cp "$PEARING_TOKEN_FILE" tok.copy; echo "$PEARING_TOKEN_FILE" > tokpath')
    )
    assert r.returncode == 0, r.stderr
    copy = work / "tok.copy"
    assert copy.exists()
    v = work_procs.run_text([PEARING_GUARD, "verify", "--token-file", str(copy)])
    assert v.returncode == ExitCode.REFUSED, v
    assert re.search(r"released|superseded", v.one_line()), v.stderr
    # --json reports the refusal too.
    vj = work_procs.run_text([PEARING_GUARD, "verify", "--token-file", str(copy), "--json"])
    assert vj.returncode == ExitCode.REFUSED
    assert json.loads(vj.stdout)["ok"] is False
    # The run's own token file is gone: still a refusal, not a usage error.
    original = line_file(work / "tokpath") or ""
    assert original and not Path(original).exists()
    g = work_procs.run_text([PEARING_GUARD, "verify"], env={**work_procs.env, ENV_TOKEN_FILE: original})
    assert g.returncode == ExitCode.REFUSED, g
    g.one_line()


def test_verify_superseded_by_newer_holder(caps: Caps, work_procs: Procs, work: Path) -> None:
    r = work_procs.run_text(_run_argv("guard-sup", 'cp "$PEARING_TOKEN_FILE" old.tok'))
    assert r.returncode == 0, r.stderr
    second = _start_blocked_run(work_procs, work, "guard-sup", 'cp "$PEARING_TOKEN_FILE" new.tok')
    old_fence = json.loads((work / "old.tok").read_text())["fence"]
    new_fence = json.loads((work / "new.tok").read_text())["fence"]
    assert new_fence > old_fence
    assert not caps.contiguous_fences or (old_fence, new_fence) == (1, 2)
    old = work_procs.run_text([PEARING_GUARD, "verify", "--token-file", str(work / "old.tok")])
    assert old.returncode == ExitCode.REFUSED, old
    assert f"superseded by fence {new_fence}" in old.one_line()
    new = work_procs.run_text([PEARING_GUARD, "verify", "--token-file", str(work / "new.tok"), "--json"])
    assert new.returncode == 0, new
    assert json.loads(new.stdout)["fence"] == new_fence
    (work / "go").touch()
    assert second.wait(timeout=15) == 0


def test_verify_after_lease_expiry_is_refused(backend: str, work_procs: Procs, work: Path) -> None:
    script = f'cp "$PEARING_TOKEN_FILE" tok.copy; {_GATE}'
    p = work_procs.start(
        _run_argv("guard-exp", script, "--heartbeat", "manual", "--lease-seconds", "2", "--kill-grace", "2"),
        text=True,
    )
    wait_for(lambda: (work / "ready").exists() or p.poll() is not None, 15, "COMMAND to copy its token file")
    assert (work / "tok.copy").is_file(), p.communicate()
    # Never heartbeated: the lease lapses and pearing-run reports the loss.
    assert p.wait(timeout=30) == ExitCode.LEASE_LOST, p.communicate()
    assert not (work / "go").exists()
    v = work_procs.run_text([PEARING_GUARD, "verify", "--token-file", str(work / "tok.copy")])
    assert v.returncode == ExitCode.REFUSED, v
    assert re.search(r"expir|released|superseded", v.one_line()), v.stderr


def test_verify_forged_token_is_refused(backend: str, work_procs: Procs, work: Path) -> None:
    p = _start_blocked_run(work_procs, work, "guard-forge", 'cp "$PEARING_TOKEN_FILE" tok.copy')
    real = json.loads((work / "tok.copy").read_text())
    forged = dict(real)
    forged["token"] = secrets.token_hex(32)
    assert forged["token"] != real["token"] and re.fullmatch(r"[0-9a-f]{64}", forged["token"])
    (work / "forged.tok").write_text(json.dumps(forged))
    (work / "forged.tok").chmod(0o600)
    v = work_procs.run_text([PEARING_GUARD, "verify", "--token-file", str(work / "forged.tok")])
    assert v.returncode == ExitCode.REFUSED, v
    assert "unknown or forged token" in v.one_line()
    # The genuine copy of the same live ticket passes: only the token differs.
    ok = work_procs.run_text([PEARING_GUARD, "verify", "--token-file", str(work / "tok.copy")])
    assert ok.returncode == 0, ok
    (work / "go").touch()
    assert p.wait(timeout=15) == 0


def test_verify_missing_token_file_is_refusal_not_usage(backend: str, work_procs: Procs, work: Path) -> None:
    v = work_procs.run_text([PEARING_GUARD, "verify", "--token-file", str(work / "no-such.token")])
    assert v.returncode == ExitCode.REFUSED, v
    v.one_line()


def test_verify_without_any_token_source_is_usage(backend: str, work_procs: Procs) -> None:
    assert not any(k.startswith("PEARING_TOKEN") for k in work_procs.env)
    v = work_procs.run_text([PEARING_GUARD, "verify"])
    assert v.returncode == ExitCode.USAGE, v
    v.one_line()


def test_verify_token_file_that_is_a_directory_is_one_clean_line(backend: str, work_procs: Procs, work: Path) -> None:
    """A bad token-file path is a refusal (1) or a usage error (64), never a traceback."""
    v = work_procs.run_text([PEARING_GUARD, "verify", "--token-file", str(work)])
    assert v.returncode in (ExitCode.REFUSED, ExitCode.USAGE), v
    assert "Traceback" not in v.stderr, v.stderr
    v.one_line()


@pytest.mark.local_only("the state it wipes is the lock dir's")
def test_verify_when_the_lock_dir_is_gone_is_a_refusal(work_procs: Procs, tmp_path: Path) -> None:
    """A token whose lock dir no longer exists (state wiped) is not live: exit 1, not 73."""
    env = {
        **work_procs.env,
        ENV_LOCK_DIR: str(tmp_path / "wiped"),
        ENV_TOKEN: secrets.token_hex(32),
        ENV_LOCK: "guard-wiped",
        ENV_REPO: "default",
    }
    v = work_procs.run_text([PEARING_GUARD, "verify"], env=env)
    assert v.returncode == ExitCode.REFUSED, v
    v.one_line()
    assert not (tmp_path / "wiped").exists()


# -- exec ------------------------------------------------------------------


def test_exec_inside_run_runs_cmd(backend: str, work_procs: Procs, work: Path) -> None:
    script = f"{q(PEARING_GUARD)} exec -- sh -c 'echo hi > f'; echo $? > exec.rc"
    r = work_procs.run_text(_run_argv("guard-exec", script))
    assert r.returncode == 0, r.stderr
    assert line_file(work / "exec.rc") == "0"
    assert (work / "f").read_text() == "hi\n"


def test_exec_passes_cmd_status_through(backend: str, work_procs: Procs, work: Path) -> None:
    script = f"{q(PEARING_GUARD)} exec -- sh -c 'exit 7'"
    r = work_procs.run_text(_run_argv("guard-exec7", script))
    assert r.returncode == 7, r.stderr


def test_exec_keeps_a_signal_ignored_when_it_started_ignored_in_cmd(
    backend: str, work_procs: Procs, work: Path
) -> None:
    """``nohup`` (SIGHUP ignored) around pearing-guard exec: CMD ignores SIGHUP too, as it
    would without the guard (and SIGINT and SIGQUIT, which the guard ignores itself, start at
    their default in CMD only where they were not ignored before)."""
    cmd = "grep SigIgn /proc/self/status > sigign"
    script = f"trap '' HUP; {q(PEARING_GUARD)} exec -- sh -c {q(cmd)}"
    r = work_procs.run_text(_run_argv("guard-exec-hup", script))
    assert r.returncode == 0, r.stderr
    ignored = signals_in(signal_sets((work / "sigign").read_text())["SigIgn"])
    assert signal.SIGHUP in ignored and signal.SIGINT not in ignored, sorted(s.name for s in ignored)


def test_exec_outside_live_run_refuses_and_never_starts_cmd(backend: str, work_procs: Procs, work: Path) -> None:
    r = work_procs.run_text(
        _run_argv("guard-exec-out", 'cp "$PEARING_TOKEN_FILE" tok.copy; echo "$PEARING_TOKEN_FILE" > tokpath')
    )
    assert r.returncode == 0, r.stderr
    original = line_file(work / "tokpath") or ""
    assert original
    via_env = work_procs.run_text(
        [PEARING_GUARD, "exec", "--", "sh", "-c", "touch marker1"], env={**work_procs.env, ENV_TOKEN_FILE: original}
    )
    assert via_env.returncode == ExitCode.REFUSED, via_env
    via_env.one_line()
    via_copy = work_procs.run_text(
        [PEARING_GUARD, "exec", "--token-file", str(work / "tok.copy"), "--", "sh", "-c", "touch marker2"]
    )
    assert via_copy.returncode == ExitCode.REFUSED, via_copy
    via_copy.one_line()
    assert not (work / "marker1").exists()
    assert not (work / "marker2").exists()


def test_exec_max_seconds_kills_long_cmd(backend: str, work_procs: Procs, work: Path) -> None:
    # CMD and what it started (a grandchild in the background) are stopped: CMD shares the
    # caller's process group, so the guard signals the tree, not a group of its own.
    inner = "sleep 60 & echo $! > child.pid; echo $$ > cmd.pid; while [ ! -e go ]; do sleep 0.01; done; touch finished"
    script = f"{q(PEARING_GUARD)} exec --max-seconds 1 -- sh -c {q(inner)}; echo $? > exec.rc"
    started = time.monotonic()
    p = work_procs.start(_run_argv("guard-maxs", script), text=True)
    rc = wait_line(work / "exec.rc", timeout=15)
    elapsed = time.monotonic() - started
    assert rc == str(int(ExitCode.LEASE_LOST))
    assert 0.9 <= elapsed < 8.0, elapsed
    assert not (work / "finished").exists()
    cmd_pid = int(line_file(work / "cmd.pid") or "0")
    assert cmd_pid > 0
    wait_for(lambda: not pid_alive(cmd_pid), 5, "the guarded CMD to be gone")
    child = int(line_file(work / "child.pid") or "0")
    wait_for(lambda: not pid_alive(child), 5, "what the guarded CMD started to be gone")
    assert p.wait(timeout=15) == 0


def test_exec_holds_off_expiry_and_handover(backend: str, work_procs: Procs, work: Path) -> None:
    """Lease expiry waits for an in-flight guarded CMD; the next holder starts only after it."""
    guarded = (
        f'cp "${ENV_TOKEN_FILE}" tok.copy; date +%s%N > g_start; while [ ! -e go ]; do sleep 0.01; done; '
        "date +%s%N > g_end"
    )
    holder = work_procs.start(
        [
            PEARING_RUN,
            "--job",
            "J",
            "--heartbeat",
            "manual",
            "--lease-seconds",
            "2",
            "--kill-grace",
            "2",
            "--",
            PEARING_GUARD,
            "exec",
            "--max-seconds",
            "20",
            "--",
            "sh",
            "-c",
            guarded,
        ],
        text=True,
    )
    wait_for(lambda: line_file(work / "g_start") or holder.poll() is not None, 15, "the guarded CMD to start")
    assert holder.poll() is None, holder.communicate()
    # The lease as the holder took it (never heartbeated after).
    lease_expires_at = _epoch(json.loads((work / "tok.copy").read_text())["lease_expires_at"])

    waiter = work_procs.start(
        [PEARING_RUN, "--wait-seconds", "30", "--job", "J", "--", "sh", "-c", "date +%s%N > w_start"], text=True
    )
    wait_queued(work_procs, "J", 1)
    assert waiter.poll() is None, waiter.communicate()
    # The holder's lease deadline passes (plus a generous margin) while the guarded CMD is in flight.
    wait_for(lambda: time.time() > lease_expires_at + 1.5, 15, "the holder's lease deadline to pass")
    assert not (work / "w_start").exists(), "the waiter started while a guarded CMD was in flight"
    assert waiter.poll() is None, waiter.communicate()
    assert not (work / "g_end").exists()

    (work / "go").touch()
    assert waiter.wait(timeout=30) == 0, waiter.communicate()
    assert holder.wait(timeout=30) == ExitCode.LEASE_LOST, holder.communicate()
    g_end = int(wait_line(work / "g_end"))
    w_start = int(wait_line(work / "w_start"))
    assert w_start > g_end, (w_start, g_end)


def test_exec_holds_off_handover_after_command_ends(backend: str, work_procs: Procs, work: Path) -> None:
    """COMMAND ends while a background guarded CMD is in flight: the next holder waits for it."""
    guarded = "date +%s%N > g_start; while [ ! -e go ]; do sleep 0.01; done; date +%s%N > g_end"
    script = (
        f"{q(PEARING_GUARD)} exec --max-seconds 20 -- sh -c {q(guarded)} & "
        "while [ ! -e g_start ]; do sleep 0.01; done; touch cmd_done; exit 0"
    )
    holder = work_procs.start(_run_argv("H", script), text=True)
    wait_for(lambda: (work / "cmd_done").exists() or holder.poll() is not None, 15, "COMMAND to end")
    waiter = work_procs.start(
        [PEARING_RUN, "--wait-seconds", "30", "--job", "H", "--", "sh", "-c", "date +%s%N > w_start"], text=True
    )
    _never(
        (work / "w_start").exists,
        2.0,
        "the lock changed hands while a guarded CMD was in flight",
    )
    assert waiter.poll() is None, waiter.communicate()
    assert not (work / "g_end").exists()
    (work / "go").touch()
    assert waiter.wait(timeout=20) == 0, waiter.communicate()
    assert holder.wait(timeout=20) == 0
    assert int(wait_line(work / "w_start")) > int(wait_line(work / "g_end"))


# -- fence ledger ------------------------------------------------------------


def test_fence_ledger_sequence(backend: str, work_procs: Procs) -> None:
    def fence(n: str) -> TextResult:
        return work_procs.run_text([PEARING_GUARD, "fence", "--resource", "R", "--fence", n])

    assert fence("5").returncode == 0
    r = fence("4")
    assert r.returncode == ExitCode.REFUSED
    assert "stale fence 4 < 5" in r.one_line()
    assert fence("5").returncode == 0
    assert fence("6").returncode == 0
    r = fence("5")
    assert r.returncode == ExitCode.REFUSED
    assert "stale fence 5 < 6" in r.one_line()


def test_fence_with_ledger_path_records_it(backend: str, work_procs: Procs, tmp_path: Path) -> None:
    ledger = tmp_path / "target" / "ledger.json"
    ledger.parent.mkdir()
    r = work_procs.run_text(
        [PEARING_GUARD, "fence", "--resource", "branch:thread-42", "--fence", "3", "--ledger", str(ledger)]
    )
    assert r.returncode == 0, r
    assert json.loads(ledger.read_text())["branch:thread-42"] == 3
    r = work_procs.run_text(
        [PEARING_GUARD, "fence", "--resource", "branch:thread-42", "--fence", "9", "--ledger", str(ledger)]
    )
    assert r.returncode == 0, r
    assert json.loads(ledger.read_text())["branch:thread-42"] == 9
    r = work_procs.run_text(
        [PEARING_GUARD, "fence", "--resource", "branch:thread-42", "--fence", "8", "--ledger", str(ledger)]
    )
    assert r.returncode == ExitCode.REFUSED
    assert json.loads(ledger.read_text())["branch:thread-42"] == 9


@pytest.mark.parametrize("explicit", [False, True], ids=["backend-ledger", "ledger-file"])
def test_fence_concurrent_callers(backend: str, work_procs: Procs, work: Path, tmp_path: Path, explicit: bool) -> None:
    """The backend's own ledger (LOCK_DIR/ledger.json, or compare-and-swap in etcd) and an
    explicit --ledger file (on either backend): concurrent callers never both pass out of order."""
    ledger = tmp_path / "concurrent.json"
    extra = ["--ledger", str(ledger)] if explicit else []
    fences = list(range(1, 21))
    random.Random(20240611).shuffle(fences)
    gate = 'while [ ! -e go ]; do sleep 0.01; done; exec "$@"'
    procs = {
        n: work_procs.start(
            ["sh", "-c", gate, "sh", PEARING_GUARD, "fence", "--resource", "R", "--fence", str(n), *extra],
            text=True,
        )
        for n in fences
    }
    (work / "go").touch()
    results = {}
    for n, p in procs.items():
        _out, err = p.communicate(timeout=30)
        results[n] = (p.returncode, err)
    codes = {rc for rc, _ in results.values()}
    assert codes <= {0, 1}, results
    if explicit:
        assert json.loads(ledger.read_text())["R"] == 20
    else:
        assert not ledger.exists()
    # The ledger's highest is 20: 19 is stale now, 20 still passes.
    late = work_procs.run_text([PEARING_GUARD, "fence", "--resource", "R", "--fence", "19", *extra])
    assert late.returncode == ExitCode.REFUSED and "stale fence 19 < 20" in late.one_line(), late
    assert work_procs.run_text([PEARING_GUARD, "fence", "--resource", "R", "--fence", "20", *extra]).returncode == 0
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
def test_fence_bad_arguments_are_usage(backend: str, work_procs: Procs, args: list[str]) -> None:
    r = work_procs.run_text([PEARING_GUARD, "fence", *args])
    assert r.returncode == ExitCode.USAGE, r
    r.one_line()


def test_fence_ledger_in_a_missing_directory_is_not_a_stale_fence(
    backend: str, work_procs: Procs, tmp_path: Path
) -> None:
    """A bad --ledger path must not look like a refusal (1 = stale fence) nor crash with a traceback."""
    ledger = tmp_path / "missing" / "ledger.json"
    r = work_procs.run_text([PEARING_GUARD, "fence", "--resource", "R", "--fence", "3", "--ledger", str(ledger)])
    assert r.returncode in (ExitCode.USAGE, ExitCode.CANTCREAT), r
    assert "Traceback" not in r.stderr, r.stderr
    assert str(ledger.parent) in r.one_line()


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
def test_guard_bad_arguments_are_usage(backend: str, work_procs: Procs, args: list[str]) -> None:
    r = work_procs.run_text([PEARING_GUARD, *args])
    assert r.returncode == ExitCode.USAGE, r
    r.one_line()


def test_python_api_accept_fence(tmp_path: Path) -> None:
    ledger = str(tmp_path / "api-ledger.json")
    assert guard.accept_fence("r2", 3, ledger=ledger) == 3
    with pytest.raises(StaleFence) as info:
        guard.accept_fence("r2", 2, ledger=ledger)
    assert info.value.exit_code == ExitCode.REFUSED
    assert "stale fence 2 < 3" in str(info.value)
    assert json.loads(Path(ledger).read_text())["r2"] == 3
    assert guard.accept_fence("r2", 3, ledger=ledger) == 3
