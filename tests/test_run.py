"""pearing-run, end to end: real processes, a private lock dir per test.

Each test blocks COMMANDs on files the test controls (``Gate``) and waits with
``wait_for`` (10 ms polls, hard timeout), never with a bare sleep. A test that takes
``backend`` (or ``caps``) runs on the lock dir and on etcd alike, and looks only at what a user sees
(exit codes, COMMAND's environment, ``pearing-cli`` output); fences are compared, since
on etcd they are the cluster's revisions, not 1, 2, 3.
"""

from __future__ import annotations

import fcntl
import itertools
import json
import os
import signal
import stat
import string
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest
from caps import Caps
from helpers import (
    PEARING_CLI,
    PEARING_GUARD,
    PEARING_RUN,
    Gate,
    Procs,
    get_ticket,
    line_file,
    lock_status,
    pid_alive,
    pipe_id,
    proc_fd_targets,
    q,
    read_json,
    signal_sets,
    signals_in,
    store_dir,
    stored_blobs,
    ticket_record,
    ticket_records,
    tree,
    wait_for,
    wait_line,
    wait_queued,
)

from singleflight.core.const import (
    ENV_FENCE,
    ENV_LOCK,
    ENV_LOCK_DIR,
    ENV_PROMOTED,
    ENV_REPO,
    ENV_TICKET,
    ENV_TOKEN,
    ENV_TOKEN_FILE,
    ExitCode,
)

BUSY = int(ExitCode.BUSY)
USAGE = int(ExitCode.USAGE)
LEASE_LOST = int(ExitCode.LEASE_LOST)
NOEXEC = int(ExitCode.NOEXEC)
NOTFOUND = int(ExitCode.NOTFOUND)

# Dump COMMAND's environment as JSON into argv[1].
DUMP_ENV = "import json, os, sys; json.dump(dict(os.environ), open(sys.argv[1], 'w'))"


def sh(script: str) -> list[str]:
    return ["sh", "-c", script]


def dump_env(path: Path) -> str:
    """sh fragment writing COMMAND's environment to ``path`` as JSON (complete before it returns)."""
    return f"{q(sys.executable)} -c {q(DUMP_ENV)} {q(path)}"


def holder_pid_of(procs: Procs, job: str, ticket_id: str, wrapper: int) -> int:
    """The detached holder of a held pearing-run ticket, as ``get-lock-ticket`` shows it once the
    holder has recorded itself: etcd names the wrapper, which waited in line, until its holder
    settles, a moment after COMMAND starts. Told apart by pid, not by session: the tests start
    every wrapper in a session of its own too (``Procs``), so a wrapper leads one as the
    holder does, and a check of that returned the wrapper once in CI."""

    def settled() -> int | None:
        t = get_ticket(procs, job, ticket_id)
        assert t["state"] == "held", t
        pid = t["holder_pid"]
        assert isinstance(pid, int) and pid > 1, t
        return pid if pid != wrapper else None

    return int(wait_for(settled, 15, "the holder to record its pid"))


def assert_next_fence(caps: Caps, before: int, after: int) -> None:
    """A later holder's fence is larger; a per-lock counter skips none (etcd's revisions may)."""
    if caps.contiguous_fences:
        assert after == before + 1, (before, after)
    else:
        assert after > before, (before, after)


# -- 1. busy skip -------------------------------------------------------------------------------


def test_busy_skip_is_fast_and_silent(backend: str, procs: Procs, work: Path) -> None:
    gate = Gate(work)
    first = procs.pr("--job", "J", "--", *sh(gate.script()))
    gate.wait_ready()

    second = procs.pr_run("--job", "J", "--", "touch", str(work / "second-ran"))
    assert second.returncode == BUSY, second
    assert second.elapsed < 1.0, second
    assert second.stdout == b"", second
    assert second.stderr == b"", second
    assert not (work / "second-ran").exists()

    for code in ("0", "3"):
        r = procs.pr_run("--job", "J", "--busy-exit-code", code, "--", "touch", str(work / f"ran-{code}"))
        assert r.returncode == int(code), r
        assert (r.stdout, r.stderr) == (b"", b""), r
        assert not (work / f"ran-{code}").exists(), "COMMAND ran although the lock was busy"

    bad = procs.pr_run("--job", "J", "--busy-exit-code", "256", "--", "touch", str(work / "ran-256"))
    assert bad.returncode == USAGE, bad
    assert len(bad.err_lines) == 1 and "256" in bad.err_lines[0], bad
    assert not (work / "ran-256").exists()

    gate.open()
    r = procs.finish(first)
    assert r.returncode == 0, r


# -- 2. environment and token file ------------------------------------------------------------


def test_command_environment_and_token_file(
    caps: Caps, procs: Procs, work: Path, lock_dir: Path, env: dict[str, str]
) -> None:
    gate = Gate(work)
    envfile = work / "env.json"
    p = procs.pr("--job", "J", "--repo", "teams/web", "--", *sh(f"{dump_env(envfile)}; {gate.script()}"))
    gate.wait_ready()
    seen = read_json(envfile)
    assert seen is not None

    assert seen[ENV_LOCK] == "J"
    assert seen[ENV_REPO] == "teams/web"
    assert seen[ENV_LOCK_DIR] == str(lock_dir)
    assert stat.S_IMODE(lock_dir.stat().st_mode) == 0o700, "the lock dir must be created 0700"
    assert seen[ENV_PROMOTED] == "0"
    fence = int(seen[ENV_FENCE])
    assert fence == 1 if caps.contiguous_fences else fence >= 1, fence  # etcd: the key's create revision
    ticket = seen[ENV_TICKET]
    assert str(uuid.UUID(ticket)) == ticket.lower()
    token = seen[ENV_TOKEN]
    assert len(token) >= 32 and set(token.lower()) <= set(string.hexdigits.lower()), token

    token_file = Path(seen[ENV_TOKEN_FILE])
    st = token_file.lstat()
    assert stat.S_ISREG(st.st_mode)
    assert stat.S_IMODE(st.st_mode) == 0o600, oct(st.st_mode)
    body = json.loads(token_file.read_text())
    assert body["lock"] == "J"
    assert body["repo"] == "teams/web"
    assert body["ticket"] == ticket
    assert body["fence"] == fence
    assert body["token"] == token
    assert isinstance(body["lease_expires_at"], str) and body["lease_expires_at"], body

    # While held: the raw token is in the token file and nowhere else the backend keeps state.
    others = {name: data for name, data in stored_blobs(env, lock_dir).items() if name != str(token_file)}
    assert others, "expected the ticket's records in the backend"
    leaks = [name for name, data in others.items() if token.encode() in data]
    assert leaks == [], f"raw token stored in {leaks}"

    gate.open()
    r = procs.finish(p)
    assert r.returncode == 0, r
    assert not token_file.exists(), "token file left behind after the run"
    procs.wait_idle()  # its holder tidies up (housekeeping) after pearing-run returned
    leaks = [name for name, data in stored_blobs(env, lock_dir).items() if token.encode() in data]
    assert leaks == [], f"raw token stored in {leaks} after the run"


# -- 3. fences --------------------------------------------------------------------------------


def test_fences_strictly_increase_and_persist(caps: Caps, procs: Procs, work: Path) -> None:
    def fence_of_run(job: str, name: str) -> int:
        out = work / name
        r = procs.pr_run("--job", job, "--", *sh(f"echo ${ENV_FENCE} > {q(out)}"))
        assert r.returncode == 0, r
        return int(out.read_text())

    fences = [fence_of_run("J", f"f{i}") for i in range(4)]
    other = fence_of_run("K", "k0")
    fences.append(fence_of_run("J", "f4"))
    assert fences == sorted(set(fences)), fences
    assert other >= 1
    if caps.contiguous_fences:
        # The lock dir counts per lock, from 1, on disk: another job starts its own sequence.
        assert (fences, other) == ([1, 2, 3, 4, 5], 1)


def test_everything_released_before_the_wrapper_exits(caps: Caps, procs: Procs, work: Path, lock_dir: Path) -> None:
    """SPEC 6: ticket released, token file removed, lock free, and only then pearing-run exits."""
    lock_file = store_dir(lock_dir, "J") / "lock"
    for i in range(5):
        envfile = work / f"env{i}.json"
        r = procs.pr_run("--job", "J", "--", *sh(dump_env(envfile)))
        if caps.lock_is_flock:
            # Checked the moment the wrapper is gone: the kernel lock is free already.
            fd = os.open(lock_file, os.O_RDWR)
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)  # raises BlockingIOError while held
            finally:
                os.close(fd)
        assert r.returncode == 0, r
        seen = read_json(envfile)
        assert seen is not None
        assert not Path(seen[ENV_TOKEN_FILE]).exists(), "token file still there after pearing-run exited"
        if caps.records_in_lock_dir:  # read-only, before status could sweep a record left behind
            assert ticket_records(lock_dir, "J") == [], "a live ticket left after the run"
        st = lock_status(procs, "J")
        assert (st["state"], st["holder"], st["waiters"]) == ("free", None, []), st
        assert get_ticket(procs, "J", seen[ENV_TICKET])["state"] == "released"
        # A run started right after never sees a stale "busy".
        assert procs.pr_run("--job", "J", "--", "true").returncode == 0


def test_wrapper_waits_for_a_slow_release(backend: str, procs: Procs, work: Path) -> None:
    """Release is held up by a guarded side effect still in flight (COMMAND left a
    ``pearing-guard exec`` running behind it): pearing-run must not return before the
    release is done, so a run started right after it returns gets the lock."""
    envfile, g_ready, go = work / "env.json", work / "g_ready", work / "go"
    guarded = f"touch {q(g_ready)}; while [ ! -e {q(go)} ]; do sleep 0.01; done"
    script = (
        f"{dump_env(envfile)}; {q(PEARING_GUARD)} exec --max-seconds 30 -- sh -c {q(guarded)} & "
        f"while [ ! -e {q(g_ready)} ]; do sleep 0.01; done; exit 0"
    )
    p = procs.pr("--job", "J", "--", *sh(script))
    wait_for(g_ready.exists, 15, "the guarded side effect to start")
    # COMMAND has ended; with the release held up the wrapper has to keep waiting.
    with pytest.raises(subprocess.TimeoutExpired):
        p.wait(timeout=1.0)
    go.touch()
    r = procs.finish(p)
    assert r.returncode == 0, r
    seen = read_json(envfile)
    assert seen is not None
    assert get_ticket(procs, "J", seen[ENV_TICKET])["state"] == "released"
    assert procs.pr_run("--job", "J", "--", "true").returncode == 0


# -- 4. exit status passthrough -----------------------------------------------------------------


def test_exit_status_passthrough(backend: str, procs: Procs) -> None:
    cases = [("exit 3", 3), ("kill -9 $$", 128 + signal.SIGKILL), ("kill -TERM $$", 128 + signal.SIGTERM)]
    for script, want in cases:
        r = procs.pr_run("--job", "J", "--", *sh(script))
        assert r.returncode == want, (script, r)
        assert r.stderr == b"", (script, r)


def test_signals_are_forwarded_to_command(backend: str, procs: Procs, work: Path) -> None:
    gate, sigs = Gate(work), work / "sigs"
    traps = "; ".join(f"trap 'echo {name} >> {q(sigs)}' {name}" for name in ("HUP", "INT", "QUIT", "USR1", "USR2"))
    script = f"{traps}; trap 'echo TERM >> {q(sigs)}; exit 7' TERM; {gate.script()}"
    p = procs.pr("--job", "J", "--", *sh(script))
    gate.wait_ready()
    got: list[str] = []
    for sig in (signal.SIGHUP, signal.SIGINT, signal.SIGQUIT, signal.SIGUSR1, signal.SIGUSR2):
        p.send_signal(sig)
        got.append(sig.name[3:])
        wait_for(lambda: sigs.exists() and sigs.read_text().split() == got, 10, f"COMMAND to trap {sig.name}")
    p.send_signal(signal.SIGTERM)
    r = procs.finish(p)
    assert r.returncode == 7, r  # COMMAND's own status: the wrapper survived and passed TERM on
    assert sigs.read_text().split() == [*got, "TERM"]
    assert procs.pr_run("--job", "J", "--", "true").returncode == 0


@pytest.mark.parametrize("ignored", ["HUP", "INT"])
def test_a_signal_ignored_when_pearing_run_starts_stays_ignored_in_command(
    backend: str, procs: Procs, work: Path, ignored: str
) -> None:
    """``nohup pearing-run ...`` (SIGHUP ignored) and a shell's background job (SIGINT and SIGQUIT
    ignored) keep those ignored in COMMAND, as ``nohup COMMAND`` would, and pearing-run passes none
    of them on: a hangup leaves the job running. (Inherited by exec, as nohup and ``trap ''`` do.)"""
    gate, masks = Gate(work), work / "sigign"
    sig = signal.Signals[f"SIG{ignored}"]
    command = f"grep SigIgn /proc/self/status > {q(masks)}; {gate.script()}"
    ignoring = ["sh", "-c", f'trap \'\' {ignored}; exec "$0" "$@"']  # then exec'd: as nohup does
    p = procs.start([*ignoring, PEARING_RUN, "--job", "J", "--", *sh(command)])
    gate.wait_ready()
    ignored = signals_in(signal_sets(masks.read_text())["SigIgn"])
    assert sig in ignored, f"COMMAND ignores {sorted(s.name for s in ignored)}, not {sig.name}"
    os.killpg(p.pid, sig)  # as a terminal's hangup or ^C reaches its foreground group
    gate.open()
    r = procs.finish(p)
    assert r.returncode == 0, r  # neither pearing-run nor COMMAND died of it


def test_command_not_found_releases_lock(backend: str, procs: Procs, work: Path) -> None:
    for missing in ("/nonexistent/pearing-no-such-command", "pearing-no-such-command-xyz"):
        r = procs.pr_run("--job", "J", "--", missing, "arg")
        assert r.returncode == NOTFOUND, r
        assert len(r.err_lines) == 1, r
        assert missing in r.err_lines[0], r
        assert r.stdout == b"", r
        after = procs.pr_run("--job", "J", "--", "touch", str(work / "after"))
        assert after.returncode == 0, after
        assert (work / "after").exists()
        (work / "after").unlink()


def test_command_not_executable_releases_lock(backend: str, procs: Procs, work: Path) -> None:
    script = work / "not-executable.sh"
    script.write_text("#!/bin/sh\ntouch ran\n")
    script.chmod(0o644)
    r = procs.pr_run("--job", "J", "--", str(script))
    assert r.returncode == NOEXEC, r
    assert len(r.err_lines) == 1 and str(script) in r.err_lines[0], r
    after = procs.pr_run("--job", "J", "--", "true")
    assert after.returncode == 0, after


# -- 5. quiet by default ------------------------------------------------------------------------


def test_quiet_by_default_and_verbose_lifecycle(backend: str, procs: Procs, work: Path) -> None:
    r = procs.pr_run("--job", "J", "--", *sh("echo out-line; echo err-line >&2"))
    assert r.returncode == 0, r
    assert r.stdout == b"out-line\n", r
    assert r.stderr == b"err-line\n", r

    fence_out = work / "fence"
    v = procs.pr_run("-v", "--job", "J", "--", *sh(f"echo out-line; echo ${ENV_FENCE} > {q(fence_out)}"))
    assert v.returncode == 0, v
    assert v.stdout == b"out-line\n", v
    fence = fence_out.read_text().strip()
    acquired = [line for line in v.err_lines if line.startswith("pearing-run: acquired")]
    released = [line for line in v.err_lines if line.startswith("pearing-run: released")]
    assert len(acquired) == 1, v
    assert f"fence={fence}" in acquired[0].split(), v
    assert len(released) == 1, v
    assert v.err_lines.index(acquired[0]) < v.err_lines.index(released[0]), v
    assert all(line.startswith("pearing-run: ") for line in v.err_lines), v


# -- 6. bad input -----------------------------------------------------------------------------

LONG_JOB = "j" * 129
LONG_REPO = "r" * 201
BAD_INPUTS = [
    # (arguments, substrings the one error line must contain)
    (["--job", "../x", "--", "true"], ["../x"]),
    (["--job", "", "--", "true"], ["--job"]),
    (["--job=-x", "--", "true"], ["-x"]),
    (["--job", "a/b", "--", "true"], ["a/b"]),
    (["--job", LONG_JOB, "--", "true"], [LONG_JOB]),
    (["--job", "J", "--repo", "a//b", "--", "true"], ["a//b"]),
    (["--job", "J", "--repo", "../x", "--", "true"], ["../x"]),
    (["--job", "J", "--repo", "/abs", "--", "true"], ["/abs"]),
    (["--job", "J", "--repo", "a/./b", "--", "true"], ["a/./b"]),
    (["--job", "J", "--repo", LONG_REPO, "--", "true"], [LONG_REPO]),
    (["--job", "J", "--lease-seconds", "0", "--", "true"], ["--lease-seconds", "0"]),
    (["--job", "J", "--lease-seconds", "-1", "--", "true"], ["--lease-seconds", "-1"]),
    (["--job", "J", "--lease-seconds", "abc", "--", "true"], ["--lease-seconds", "abc"]),
    (["--job", "J", "--lease-seconds", "nan", "--", "true"], ["--lease-seconds", "nan"]),
    (["--job", "J", "--wait-seconds", "-1", "--", "true"], ["--wait-seconds", "-1"]),
    (["--job", "J", "--request-uuid", "not-a-uuid", "--", "true"], ["not-a-uuid"]),
    (["--job", "J", "--heartbeat", "sometimes", "--", "true"], ["sometimes"]),
    (["--job", "J", "--busy-exit-code", "300", "--", "true"], ["300"]),
    (["--job", "J", "--frobnicate", "--", "true"], ["--frobnicate"]),
    (["--job", "J"], ["COMMAND"]),
    (["--job", "J", "--"], ["COMMAND"]),
    (["--", "true"], ["--job"]),
]


# Not in the list, but the same rule (SPEC: "every bad ... number ... exit 64"):
# an empty value must not silently mean "the default".
EMPTY_VALUES = [
    (["--job", "J", f"{flag}=", "--", "true"], [flag])
    for flag in (
        "--repo",
        "--lease-seconds",
        "--wait-seconds",
        "--busy-exit-code",
        "--kill-grace",
        "--dedupe-window",
        "--heartbeat",
    )
]


def _case_id(args: list[str]) -> str:
    return " ".join(("''" if not a else a if len(a) <= 20 else f"{a[0]}*{len(a)}") for a in args)


@pytest.mark.parametrize(
    ("args", "needles"), [pytest.param(a, n, id=_case_id(a)) for a, n in BAD_INPUTS + EMPTY_VALUES]
)
def test_bad_input_exits_64_with_one_line_and_creates_nothing(
    backend: str, procs: Procs, tmp_path: Path, lock_dir: Path, args: list[str], needles: list[str]
) -> None:
    before = tree(tmp_path)
    r = procs.pr_run("--lock-dir", str(lock_dir), *args)
    assert r.returncode == USAGE, r
    assert len(r.err_lines) == 1, r
    assert all(n.lower() in r.err_lines[0].lower() for n in needles), (needles, r)
    assert r.stdout == b"", r
    assert not lock_dir.exists(), "the lock dir was created"
    assert tree(tmp_path) == before, f"created {sorted(tree(tmp_path) - before)}"


# -- 7. heartbeats ------------------------------------------------------------------------------


# That heartbeats keep a manual lease (SPEC 4) is test_nemesis.py's
# test_heartbeat_every_third_of_the_lease_keeps_it, at the README's cadence, on every backend.


def test_a_shorter_heartbeat_makes_the_holder_look_now(backend: str, procs: Procs, work: Path) -> None:
    """A heartbeat that shortens the lease (60 s -> 3 s) pokes the holder (rules.tickets.heartbeat):
    the lock does not outlive the new lease, though the holder slept towards the old deadline
    (the lock dir) or its next keepalive, a third of the TTL away (etcd: 20 s)."""
    beat = work / "beat.rc"
    script = f"{q(PEARING_CLI)} heartbeat-lock-ticket --lease-seconds 3 >/dev/null; echo $? > {q(beat)}; sleep 60"
    r = procs.pr_run("--job", "J", "--heartbeat", "manual", "--lease-seconds", "60", "--", *sh(script), timeout=60)
    assert line_file(beat) == "0", r
    assert r.returncode == LEASE_LOST, r
    assert r.elapsed < 15.0, r


def test_missed_heartbeat_expires_before_sigterm(backend: str, procs: Procs, work: Path) -> None:
    """When SIGTERM reaches COMMAND its token is dead already: the ticket reads expired, the
    guard refuses, the token file is gone."""
    gate = Gate(work)
    ticket, at_term = work / "ticket.json", work / "at-term"
    trap = (
        f"{q(PEARING_CLI)} get-lock-ticket > {q(ticket)}; "
        f"{q(PEARING_GUARD)} verify 2>/dev/null; verify=$?; "
        f'[ -e "${ENV_TOKEN_FILE}" ] && tf=present || tf=gone; '
        f'echo "$verify $tf" > {q(at_term)}; exit 0'
    )
    script = f"trap {q(trap)} TERM; {gate.script()}"
    p = procs.pr("--job", "J", "--heartbeat", "manual", "--lease-seconds", "2", "--", *sh(script))
    gate.wait_ready()
    r = procs.finish(p, timeout=30)
    assert r.returncode == LEASE_LOST, r
    assert 1.0 <= r.elapsed < 8.0, r
    assert line_file(at_term) is not None, "COMMAND got no SIGTERM (its trap did not run)"
    assert line_file(at_term) == f"{int(ExitCode.REFUSED)} gone", line_file(at_term)
    shown = read_json(ticket)
    assert shown is not None and shown["state"] == "expired", shown
    after = procs.pr_run("--job", "J", "--", "true")
    assert after.returncode == 0, after


def test_lost_lease_slow_to_stop_frees_the_lock(backend: str, procs: Procs, work: Path) -> None:
    """A holder that lost its lease and took longer to stop COMMAND than its lease has left
    (its grace) frees the lock as the wrapper exits: the next run, started then, is not busy."""
    gate = Gate(work)
    script = f"trap 'sleep 2.5; exit 0' TERM; {gate.script()}"
    p = procs.pr("--job", "J", "--heartbeat", "manual", "--lease-seconds", "2", "--kill-grace", "5", "--", *sh(script))
    gate.wait_ready()
    r = procs.finish(p, timeout=30)
    assert r.returncode == LEASE_LOST, r
    after = procs.pr_run("--job", "J", "--", "true")
    assert after.returncode == 0, after


# -- 8. max runtime and kill grace ------------------------------------------------------------


def test_max_runtime_stops_command(backend: str, procs: Procs, work: Path) -> None:
    gate = Gate(work)
    r = procs.pr_run("--job", "J", "--max-runtime", "1", "--", *sh(gate.script()))
    assert r.returncode == LEASE_LOST, r
    assert 1.0 <= r.elapsed <= 4.0, r
    assert gate.ready.exists()
    after = procs.pr_run("--job", "J", "--", "true")
    assert after.returncode == 0, after


def test_kill_grace_then_sigkill(backend: str, procs: Procs, work: Path) -> None:
    gate = Gate(work)
    pid_file, term_file = work / "pid", work / "term"
    # The trap notes when TERM arrived and carries on: only SIGKILL can stop it.
    script = f"trap 'date +%s.%N > {q(term_file)}' TERM; echo $$ > {q(pid_file)}; {gate.script()}"
    p = procs.pr("--job", "J", "--max-runtime", "1", "--kill-grace", "1", "--", *sh(script))
    gate.wait_ready()
    cmd_pid = int(wait_line(pid_file))
    r = procs.finish(p, timeout=20)
    ended = time.time()
    assert r.returncode == LEASE_LOST, r
    term_at = float(wait_line(term_file))
    assert 0.8 <= ended - term_at <= 5.0, f"exit {ended - term_at:.3f} s after SIGTERM; {r!r}"
    assert 2.0 <= r.elapsed <= 7.0, r
    assert not pid_alive(cmd_pid), "COMMAND survived"


# -- 9. wrapper killed -------------------------------------------------------------------------


def test_wrapper_killed_holder_keeps_lock_until_command_ends(caps: Caps, procs: Procs, work: Path) -> None:
    gate = Gate(work)
    envfile = work / "env.json"
    p = procs.pr("--job", "J", "--", *sh(f"{dump_env(envfile)}; {gate.script()}"))
    gate.wait_ready()
    seen = read_json(envfile)
    assert seen is not None
    ticket = seen[ENV_TICKET]
    holder = holder_pid_of(procs, "J", ticket, p.pid)
    assert holder != p.pid

    p.kill()
    p.wait(timeout=10)

    # Held for a whole second after the wrapper died: a waiter times out.
    busy = procs.pr_run("--job", "J", "--wait-seconds", "1", "--", "touch", str(work / "busy-ran"))
    assert busy.returncode == BUSY, busy
    assert busy.elapsed >= 1.0, busy
    assert not (work / "busy-ran").exists()
    assert pid_alive(holder)
    assert get_ticket(procs, "J", ticket)["state"] == "held"

    gate.open()
    wait_for(lambda: not pid_alive(holder), 10, "the holder to release and exit after COMMAND ended")
    assert get_ticket(procs, "J", ticket)["state"] == "released"
    fence_out = work / "next-fence"
    nxt = procs.pr_run("--job", "J", "--", *sh(f"echo ${ENV_FENCE} > {q(fence_out)}"))
    assert nxt.returncode == 0, nxt
    assert_next_fence(caps, int(seen[ENV_FENCE]), int(fence_out.read_text()))


# -- 10. holder killed -------------------------------------------------------------------------


def test_holder_killed_stops_command(caps: Caps, procs: Procs, work: Path, lock_dir: Path) -> None:
    gate = Gate(work)
    envfile, termed = work / "env.json", work / "termed"
    script = f"trap 'touch {q(termed)}; exit 143' TERM; {dump_env(envfile)}; {gate.script()}"
    p = procs.pr("--job", "J", "--", *sh(script))
    gate.wait_ready()
    seen = read_json(envfile)
    assert seen is not None
    ticket = seen[ENV_TICKET]
    holder = holder_pid_of(procs, "J", ticket, p.pid)
    assert holder != p.pid

    os.kill(holder, signal.SIGKILL)
    r = procs.finish(p, timeout=20)
    assert r.returncode == LEASE_LOST, r
    assert r.elapsed < 10.0, r
    assert termed.exists(), "COMMAND got no SIGTERM"
    assert not Path(seen[ENV_TOKEN_FILE]).exists(), "token file of a dead holder left behind"
    if caps.records_in_lock_dir:  # read-only, before get-lock-ticket could sweep a record left held
        found = ticket_record(lock_dir, "J", ticket)
        assert found is not None and found[1]["state"] != "held", found
    assert get_ticket(procs, "J", ticket)["state"] != "held"

    fence_out = work / "next-fence"
    nxt = procs.pr_run("--job", "J", "--", *sh(f"echo ${ENV_FENCE} > {q(fence_out)}"))
    assert nxt.returncode == 0, nxt
    assert int(fence_out.read_text()) > int(seen[ENV_FENCE])


# -- 11. storm of contenders ------------------------------------------------------------------


def test_concurrent_contenders_never_overlap(caps: Caps, procs: Procs, work: Path) -> None:
    n = 24
    outs = [work / f"c{i}.log" for i in range(n)]
    ps = []
    for out in outs:
        script = (
            f'echo "start ${ENV_FENCE} $(date +%s%N)" >> {q(out)}; sleep 0.01; '
            f'echo "end ${ENV_FENCE} $(date +%s%N)" >> {q(out)}'
        )
        ps.append(procs.pr("--job", "J", "--wait-seconds", "60", "--", *sh(script)))
    results = [procs.finish(p, timeout=90) for p in ps]
    assert [r.returncode for r in results] == [0] * n, [r for r in results if r.returncode]

    intervals = []
    for out in outs:
        lines = [line.split() for line in out.read_text().splitlines()]
        assert [w[0] for w in lines] == ["start", "end"], (out, lines)
        assert lines[0][1] == lines[1][1]
        intervals.append((int(lines[0][2]), int(lines[1][2]), int(lines[0][1])))
    intervals.sort()
    for (_s1, e1, f1), (s2, _e2, f2) in itertools.pairwise(intervals):
        assert e1 < s2, f"runs with fences {f1} and {f2} overlapped"
    fences = [f for _s, _e, f in intervals]
    assert fences == sorted(set(fences)), f"fences not strictly increasing in start order: {fences}"
    if caps.contiguous_fences:
        assert fences == list(range(1, n + 1)), fences


# -- 12. waiting in FIFO order ------------------------------------------------------------------


def test_waiters_run_in_fifo_order(backend: str, procs: Procs, work: Path) -> None:
    gate = Gate(work)
    holder_fence = work / "holder-fence"
    first = procs.pr("--job", "J", "--", *sh(f"echo ${ENV_FENCE} > {q(holder_fence)}; {gate.script()}"))
    gate.wait_ready()
    order = work / "order"
    waiters = []
    for i in range(5):
        script = f'echo "{i} ${ENV_FENCE} ${ENV_PROMOTED}" >> {q(order)}'
        w = procs.pr("--job", "J", "--wait-seconds", "60", "--", *sh(script))
        wait_queued(procs, "J", i + 1)
        waiters.append(w)
    assert not order.exists(), "a waiter ran while the lock was held"

    gate.open()
    assert procs.finish(first).returncode == 0
    results = [procs.finish(w) for w in waiters]
    assert [r.returncode for r in results] == [0] * 5, results
    rows = [line.split() for line in order.read_text().splitlines()]
    assert [r[0] for r in rows] == ["0", "1", "2", "3", "4"], rows
    fences = [int(r[1]) for r in rows]
    assert fences == sorted(set(fences)) and fences[0] > int(holder_fence.read_text()), rows
    assert [r[2] for r in rows] == ["1"] * 5, rows


def test_wait_seconds_times_out_with_busy(backend: str, procs: Procs, work: Path) -> None:
    gate = Gate(work)
    first = procs.pr("--job", "J", "--", *sh(gate.script()))
    gate.wait_ready()
    r = procs.pr_run("--job", "J", "--wait-seconds", "1.5", "--", "touch", str(work / "ran"))
    assert r.returncode == BUSY, r
    assert 1.5 <= r.elapsed <= 2.5, r  # between W and W + 1 s, start-up included
    assert (r.stdout, r.stderr) == (b"", b""), r
    assert not (work / "ran").exists()
    gate.open()
    assert procs.finish(first).returncode == 0


def test_killed_waiter_does_not_stall_queue(caps: Caps, procs: Procs, work: Path) -> None:
    """SPEC Backends: a killed waiter stops blocking within 5 s. Once failed on etcd: a killed
    waiter's key lived until its lease (the default 60 s, as the doomed waiter's here) ran out.
    (That its key itself goes, for a client that cannot skip it, is test_etcd_fleet.py's
    etcdctl test.)"""
    gate, first_fence = Gate(work), work / "first-fence"
    first = procs.pr("--job", "J", "--", *sh(f"echo ${ENV_FENCE} > {q(first_fence)}; {gate.script()}"))
    gate.wait_ready()
    doomed = procs.pr("--job", "J", "--wait-seconds", "60", "--", "touch", str(work / "doomed-ran"))
    wait_queued(procs, "J", 1)
    out = work / "next"
    nxt = procs.pr("--job", "J", "--wait-seconds", "60", "--", *sh(f'echo "${ENV_FENCE} ${ENV_PROMOTED}" > {q(out)}'))
    wait_queued(procs, "J", 2)

    doomed.kill()
    doomed.wait(timeout=10)
    released_at = time.monotonic()
    # The kernel drops a dead waiter's queue entry at once; on etcd its key goes with its
    # lease, and SPEC promises a killed waiter stops blocking within 5 s.
    bound = caps.dead_waiter_bound
    gate.open()
    line = wait_line(out, timeout=bound + 3)
    served_after = time.monotonic() - released_at
    assert served_after < bound, f"next waiter served {served_after:.3f} s after the holder released"
    fence, promoted = line.split()
    assert promoted == "1", line
    assert_next_fence(caps, int(wait_line(first_fence)), int(fence))
    assert not (work / "doomed-ran").exists()
    assert procs.finish(first).returncode == 0
    assert procs.finish(nxt).returncode == 0


# -- 13. request uuid ---------------------------------------------------------------------------


def test_request_uuid_success_is_not_replayed(backend: str, procs: Procs, work: Path) -> None:
    u = str(uuid.uuid4())
    r1 = procs.pr_run("--job", "J", "--request-uuid", u, "--", "touch", str(work / "m1"))
    assert r1.returncode == 0, r1
    assert (work / "m1").exists()
    r2 = procs.pr_run("--job", "J", "--request-uuid", u, "--", "touch", str(work / "m2"))
    assert r2.returncode == 0, r2
    assert (r2.stdout, r2.stderr) == (b"", b""), r2
    assert not (work / "m2").exists(), "a replayed request ran COMMAND again"
    # A different request still runs.
    r3 = procs.pr_run("--job", "J", "--request-uuid", str(uuid.uuid4()), "--", "touch", str(work / "m3"))
    assert r3.returncode == 0, r3
    assert (work / "m3").exists()


def test_request_uuid_failed_run_is_retried_with_larger_fence(backend: str, procs: Procs, work: Path) -> None:
    u = str(uuid.uuid4())
    f1, f2 = work / "f1", work / "f2"
    r1 = procs.pr_run("--job", "J", "--request-uuid", u, "--", *sh(f"echo ${ENV_FENCE} > {q(f1)}; exit 1"))
    assert r1.returncode == 1, r1
    r2 = procs.pr_run("--job", "J", "--request-uuid", u, "--", *sh(f"echo ${ENV_FENCE} > {q(f2)}"))
    assert r2.returncode == 0, r2
    assert f2.exists(), "the retry of a failed request did not run"
    assert int(f2.read_text()) > int(f1.read_text())


def test_request_uuid_in_flight_is_busy_and_never_waits_for_itself(backend: str, procs: Procs, work: Path) -> None:
    u = str(uuid.uuid4())
    gate = Gate(work)
    first = procs.pr("--job", "J", "--request-uuid", u, "--", *sh(gate.script()))
    gate.wait_ready()
    dup = procs.pr_run("--job", "J", "--request-uuid", u, "--", "touch", str(work / "dup"))
    assert dup.returncode == BUSY, dup
    # Even when it may wait: a request never queues behind itself.
    dup_wait = procs.pr_run(
        "--job", "J", "--request-uuid", u, "--wait-seconds", "30", "--", "touch", str(work / "dupw")
    )
    assert dup_wait.returncode == BUSY, dup_wait
    # Far below its 30 s wait: it did not queue. (2 s once ran out on postgres at a load of 6.)
    assert dup_wait.elapsed < 10.0, dup_wait
    gate.open()
    assert procs.finish(first).returncode == 0
    assert not (work / "dup").exists() and not (work / "dupw").exists()
    # And after the first one succeeded, a replay is deduplicated.
    again = procs.pr_run("--job", "J", "--request-uuid", u, "--", "touch", str(work / "again"))
    assert again.returncode == 0, again
    assert not (work / "again").exists()


def test_simultaneous_replays_run_once(backend: str, procs: Procs, work: Path) -> None:
    """The webhook and its replay arrive at once, several times over: COMMAND runs exactly once."""
    u = str(uuid.uuid4())
    cmd = f"echo x >> {q(work / 'ran')}; sleep 0.3"
    runs = [procs.pr("--job", "J", "--request-uuid", u, "--wait-seconds", "30", "--", *sh(cmd)) for _ in range(6)]
    codes = sorted(procs.finish(p, timeout=60).returncode for p in runs)
    assert (work / "ran").read_text() == "x\n", codes
    assert set(codes) <= {0, BUSY} and 0 in codes
    # And a later replay is deduplicated.
    assert procs.pr_run("--job", "J", "--request-uuid", u, "--", *sh(cmd)).returncode == 0
    assert (work / "ran").read_text() == "x\n"


def test_the_dedupe_window_counts_from_the_runs_start(backend: str, procs: Procs, work: Path) -> None:
    """docs/choices.md: a success is deduplicated for --dedupe-window from the run's start, on every backend
    (etcd counted from the end). A run of 3 s under a 2 s window leaves nothing to dedupe: the
    replay right after it runs. Within the window from the start, a replay is deduplicated."""
    u = str(uuid.uuid4())
    long_run = procs.pr_run("--job", "J", "--request-uuid", u, "--dedupe-window", "2", "--", "sleep", "3")
    assert long_run.returncode == 0, long_run
    replay = procs.pr_run("--job", "J", "--request-uuid", u, "--dedupe-window", "2", "--", "touch", str(work / "ran"))
    assert replay.returncode == 0, replay
    assert (work / "ran").exists(), "replayed as deduplicated: the window counted from the run's end"
    v = str(uuid.uuid4())
    first = procs.pr_run("--job", "J", "--request-uuid", v, "--dedupe-window", "60", "--", "true")
    again = procs.pr_run("--job", "J", "--request-uuid", v, "--dedupe-window", "60", "--", "touch", str(work / "v"))
    assert first.returncode == again.returncode == 0, (first, again)
    assert not (work / "v").exists(), "a replay within the window ran again"


def test_dedupe_window_zero_runs_again(backend: str, procs: Procs, work: Path) -> None:
    u = str(uuid.uuid4())
    for name in ("m1", "m2"):
        r = procs.pr_run("--job", "J", "--request-uuid", u, "--dedupe-window", "0", "--", "touch", str(work / name))
        assert r.returncode == 0, r
        assert (work / name).exists(), f"{name}: COMMAND did not run with --dedupe-window 0"


# -- 14. skip-if ------------------------------------------------------------------------------


def test_skip_if(caps: Caps, procs: Procs, work: Path) -> None:
    skip_env = work / "skip-env"
    r = procs.pr_run(
        "--job",
        "J",
        "--skip-if",
        f"echo ${ENV_FENCE} ${ENV_PROMOTED} > {q(skip_env)}; true",
        "--",
        "touch",
        str(work / "m1"),
    )
    assert r.returncode == 0, r
    assert not (work / "m1").exists(), "COMMAND ran although --skip-if said done"
    fence, promoted = skip_env.read_text().split()
    assert promoted == "0" and int(fence) >= 1, "skip-if did not get the token environment"
    assert not caps.contiguous_fences or fence == "1", fence
    r = procs.pr_run("--job", "J", "--skip-if", "false", "--", "touch", str(work / "m2"))
    assert r.returncode == 0, r
    assert (work / "m2").exists()
    # The lock was released after the skip: a plain run gets it.
    assert procs.pr_run("--job", "J", "--", "true").returncode == 0


def test_skip_if_sees_promoted(backend: str, procs: Procs, work: Path) -> None:
    gate = Gate(work)
    first = procs.pr("--job", "J", "--", *sh(gate.script()))
    gate.wait_ready()
    skip_env, cmd_env = work / "skip-env", work / "cmd-env"
    w = procs.pr(
        "--job",
        "J",
        "--wait-seconds",
        "60",
        "--skip-if",
        f"echo ${ENV_PROMOTED} > {q(skip_env)}; false",
        "--",
        *sh(f"echo ${ENV_PROMOTED} > {q(cmd_env)}"),
    )
    wait_queued(procs, "J", 1)
    gate.open()
    assert procs.finish(first).returncode == 0
    r = procs.finish(w)
    assert r.returncode == 0, r
    assert skip_env.read_text().strip() == "1"
    assert cmd_env.read_text().strip() == "1"


# -- 15. no inherited fds -------------------------------------------------------------------------


def test_holder_keeps_no_caller_pipes(caps: Caps, procs: Procs, work: Path, lock_dir: Path) -> None:
    quick = procs.pr_run("--job", "J", "--", "true", stdin=subprocess.PIPE)
    assert quick.returncode == 0, quick
    assert quick.elapsed < 5.0, quick

    gate = Gate(work)
    envfile, pid_file = work / "env.json", work / "pid"
    # COMMAND lets go of the caller's pipes itself: only pearing-run and the holder may still hold them.
    script = f"exec </dev/null >/dev/null 2>&1; echo $$ > {q(pid_file)}; {dump_env(envfile)}; {gate.script()}"
    p = procs.pr("--job", "J", "--", *sh(script), stdin=subprocess.PIPE)
    gate.wait_ready()
    seen = read_json(envfile)
    assert seen is not None
    holder = holder_pid_of(procs, "J", seen[ENV_TICKET], p.pid)
    cmd_pid = int(wait_line(pid_file))

    caller_pipes = {pipe_id(p.stdin), pipe_id(p.stdout), pipe_id(p.stderr)}
    holder_fds = proc_fd_targets(holder)
    assert holder_fds, "could not read the holder's fds"
    assert caller_pipes.isdisjoint(holder_fds), f"holder keeps caller pipes open: {holder_fds}"
    if caps.lock_is_flock:
        lock_file = str(store_dir(lock_dir, "J") / "lock")
        assert lock_file in holder_fds, "the holder does not hold the lock file open"
    cmd_fds = proc_fd_targets(cmd_pid)
    assert not [t for t in cmd_fds if t.startswith(str(lock_dir))], f"COMMAND inherited lock dir fds: {cmd_fds}"

    # With the wrapper gone the caller's pipes reach EOF at once, while the holder still runs.
    p.kill()
    r = procs.finish(p, timeout=5)
    assert r.returncode == -signal.SIGKILL, r
    assert pid_alive(holder), "holder died with the wrapper"
    gate.open()
    wait_for(lambda: not pid_alive(holder), 10, "the holder to exit after COMMAND ended")


def test_background_child_keeps_neither_pipe_nor_lock(backend: str, procs: Procs, work: Path, lock_dir: Path) -> None:
    bg = work / "bg.pid"
    script = f"sleep 30 >/dev/null 2>&1 & echo $! > {q(bg)}"
    r = procs.pr_run("--job", "J", "--", *sh(script), timeout=5)
    assert r.returncode == 0, r
    assert r.elapsed < 5.0, r
    sleeper = int(wait_line(bg))
    assert pid_alive(sleeper), "the background child should still be running"
    assert not [t for t in proc_fd_targets(sleeper) if t.startswith(str(lock_dir))]
    after = procs.pr_run("--job", "J", "--", "true")
    assert after.returncode == 0, after
    assert pid_alive(sleeper)
    os.kill(sleeper, signal.SIGKILL)
