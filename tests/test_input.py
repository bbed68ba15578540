"""Bad input: an empty COMMAND, a hostile $USER, control characters in status, the number grammar.

Real processes for everything a user types (``pearing-run``, ``pearing-guard``, ``pearing-cli``),
synchronised on files and exit; the table rendering and the hostname fallback are also checked
in-process, where a real process cannot be given a hostile hostname. The MCP side (schemas,
strict types, unknown arguments) is in test_mcp.py, next to the server fixture it needs.
"""

from __future__ import annotations

import json
import os
import pty
import select
import subprocess
import time
from pathlib import Path
from typing import Any

import pytest
from helpers import PEARING_CLI, PEARING_GUARD, PEARING_RUN, Gate, Procs, TextResult, q, tree, wait_line

from singleflight.cli._table import printable, render
from singleflight.core import identity, names
from singleflight.core.const import ENV_IDENTITY, MIN_LEASE_SECONDS, ExitCode
from singleflight.core.errors import BadValue

USAGE = int(ExitCode.USAGE)


def _one_usage_line(r: TextResult, *needles: str) -> str:
    assert r.returncode == USAGE, r
    line = r.one_line()
    for needle in needles:
        assert needle in line, (needle, line)
    assert "internal error" not in line and "Traceback" not in r.stderr, r
    return line


# -- 1. an empty COMMAND -------------------------------------------------------------------


def test_pearing_run_with_an_empty_command_is_usage_and_creates_nothing(
    procs: Procs, tmp_path: Path, lock_dir: Path
) -> None:
    before = tree(tmp_path)
    r = procs.run_text([PEARING_RUN, "--job", "x", "--", ""])
    _one_usage_line(r, "COMMAND", "''")
    assert r.stdout == ""
    assert not lock_dir.exists(), tree(lock_dir)
    assert tree(tmp_path) == before


def test_pearing_guard_exec_with_an_empty_command_is_usage_even_with_a_live_token(
    work_procs: Procs, work: Path
) -> None:
    # Inside a held run the token is live, so the check that refuses '' is the only thing in the way.
    alone = work_procs.run_text([PEARING_GUARD, "exec", "--", ""])
    _one_usage_line(alone, "CMD", "''")
    script = f"{q(PEARING_GUARD)} exec -- '' 2> guard.err; echo $? > guard.rc"
    r = work_procs.run_text([PEARING_RUN, "--job", "j", "--", "sh", "-c", script])
    assert r.returncode == 0, r
    assert wait_line(work / "guard.rc") == str(USAGE)
    err = (work / "guard.err").read_text().splitlines()
    assert len(err) == 1 and "CMD ''" in err[0] and "internal error" not in err[0], err


# -- 2. the identity derived from the login ------------------------------------------------


def _host() -> str:
    """The host part a derived identity uses here."""
    host = os.uname().nodename
    try:
        names.identity(host)
    except BadValue:
        return identity.FALLBACK_HOST
    return host if "@" not in host else identity.FALLBACK_HOST


FALLBACK = f"uid{os.geteuid()}@{_host()}"


def _outside(tmp_path: Path, lock_dir: Path) -> set[str]:
    """Everything under tmp_path that is neither the lock dir nor the test's work dir."""
    keep = {lock_dir.name, "work"}
    return {p for p in tree(tmp_path) if p.split(os.sep)[0] not in keep}


HOSTILE_USERS = ["../../../../tmp/evil", "../../evil", "a\nb", "-rf", "a/b", "a@b", "x" * 200, "\u212aelvin", "a b"]


def _login_env(env: dict[str, str], user: str | None, logname: str | None = None) -> dict[str, str]:
    e = {k: v for k, v in env.items() if k not in ("USER", "LOGNAME", ENV_IDENTITY)}
    if user is not None:
        e["USER"] = user
    if logname is not None:
        e["LOGNAME"] = logname
    return e


@pytest.mark.parametrize("user", HOSTILE_USERS, ids=lambda u: repr(u)[:24])
def test_a_hostile_user_falls_back_to_the_uid_and_writes_only_in_the_lock_dir(
    work_procs: Procs, tmp_path: Path, lock_dir: Path, work: Path, user: str
) -> None:
    env = _login_env(work_procs.env, user, user)

    r = work_procs.run_text([PEARING_CLI, "update-user-activity", "--activity", "checking in"], env=env)
    assert r.returncode == 0, r
    assert r.json == {"identity": FALLBACK, "activity": "checking in"}
    assert sorted(os.listdir(lock_dir / "activity")) == [FALLBACK]

    gate = Gate(work)
    script = f"{q(PEARING_CLI)} get-lock-ticket > ticket.json; {gate.script()}"
    run = work_procs.start([PEARING_RUN, "--job", "j", "--", "sh", "-c", script], env=env)
    gate.wait_ready()
    ticket = json.loads((work / "ticket.json").read_text())
    assert (ticket["identity"], ticket["activity"]) == (FALLBACK, "checking in")

    status = work_procs.run_text([PEARING_CLI, "status", "j"], env=env)
    assert status.returncode == 0, status
    (lock,) = status.json
    assert (lock["holder"]["identity"], lock["holder"]["activity"]) == (FALLBACK, "checking in")

    gate.open()
    assert work_procs.finish(run).returncode == 0
    assert _outside(tmp_path, lock_dir) == set()
    for path in tree(lock_dir):
        assert ".." not in Path(path).parts and "\n" not in path, path


def test_a_bad_user_is_not_replaced_by_logname_but_an_empty_one_is(procs: Procs) -> None:
    def who(env: dict[str, str]) -> Any:
        r = procs.run_text([PEARING_CLI, "update-user-activity", "--clear"], env=env)
        assert r.returncode == 0, r
        return r.json["identity"]

    assert who(_login_env(procs.env, "../x", "alice")) == FALLBACK
    assert who(_login_env(procs.env, "", "alice")) == f"alice@{_host()}"
    assert who(_login_env(procs.env, "bob", "alice")) == f"bob@{_host()}"


@pytest.mark.parametrize("bad", ["../x", "a\nb", "-x", ""])
def test_an_explicit_bad_identity_is_still_usage(procs: Procs, tmp_path: Path, lock_dir: Path, bad: str) -> None:
    env = {**_login_env(procs.env, "alice"), ENV_IDENTITY: bad}
    r = procs.run_text([PEARING_CLI, "update-user-activity", "--activity", "x"], env=env)
    _one_usage_line(r, "identity", repr(bad))
    r = procs.run_text([PEARING_RUN, "--job", "j", "--identity", bad, "--", "true"], env=_login_env(procs.env, "alice"))
    _one_usage_line(r, "identity", repr(bad))
    assert _outside(tmp_path, lock_dir) == set()
    assert not (lock_dir / "activity").exists() or os.listdir(lock_dir / "activity") == []


@pytest.mark.parametrize("nodename", ["", "(none)", "a@b", "-x", "h" * 200, "h\nx"])
def test_a_bad_hostname_falls_back_to_localhost(monkeypatch: pytest.MonkeyPatch, nodename: str) -> None:
    real = os.uname()
    fake = os.uname_result((real.sysname, nodename, real.release, real.version, real.machine))
    monkeypatch.setattr(os, "uname", lambda: fake)
    monkeypatch.delenv(ENV_IDENTITY, raising=False)
    monkeypatch.setenv("USER", "alice")
    assert identity.resolve() == "alice@localhost"
    monkeypatch.setenv("USER", "../alice")
    assert identity.resolve() == f"uid{os.geteuid()}@localhost"


def test_a_long_user_that_fits_alone_but_not_with_the_host_falls_back(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(ENV_IDENTITY, raising=False)
    host = _host()
    monkeypatch.setenv("USER", "u" * (128 - len(host) - 1))
    assert identity.resolve() == "u" * (128 - len(host) - 1) + "@" + host
    monkeypatch.setenv("USER", "u" * (128 - len(host)))
    assert identity.resolve() == FALLBACK


# -- 3. control characters in the status table ---------------------------------------------

NASTY = "\x1b]0;pwned\x07\x1b[2J\rFORGED  row\n\tnext\x9b31m\x85\u202eevil\u2028\x00end\\n"


def _lock(activity: str | None, ident: str = "codex") -> dict[str, Any]:
    holder = {"identity": ident, "lease_left": 12.0, "activity": activity}
    return {"lock_name": "j", "repo": "default", "state": "held", "fence": 3, "holder": holder, "waiters": []}


def test_printable_escapes_every_non_printable_character() -> None:
    shown = printable(NASTY)
    assert shown == ("\\x1b]0;pwned\\x07\\x1b[2J\\rFORGED  row\\n\\tnext\\x9b31m\\x85\\u202eevil\\u2028\\x00end\\n")
    assert shown.isprintable()
    assert (
        printable("caf\u00e9 \u2014 \u65e5\u672c, a\\b") == "caf\u00e9 \u2014 \u65e5\u672c, a\\b"
    )  # printable text is kept


def test_render_cannot_be_made_to_forge_rows_or_send_escapes() -> None:
    out = render([_lock(NASTY, ident="co\x1bdex"), _lock("plain text, ok")])
    lines = out.split("\n")[:-1]
    assert len(lines) == 3, out  # the header and one row per lock: nothing forged
    assert all(line.isprintable() for line in lines), out
    row = lines[1]
    assert "co\\x1bdex" in row
    start = row.index("\\x1b]0;pwned\\x07\\x1b[2J\\rFORGED")
    assert len(row) - start == 60  # the activity column keeps its width, escapes counted
    assert lines[2].endswith("plain text, ok")


def test_status_on_a_terminal_escapes_activity_and_json_keeps_it(work_procs: Procs, work: Path, lock_dir: Path) -> None:
    env = {**work_procs.env, ENV_IDENTITY: "codex"}
    activity = NASTY.replace("\x00", "")  # argv cannot carry NUL
    r = work_procs.run_text([PEARING_CLI, "update-user-activity", "--activity", activity], env=env)
    assert r.returncode == 0, r
    gate = Gate(work)
    run = work_procs.start([PEARING_RUN, "--job", "j", "--", "sh", "-c", gate.script()], env=env)
    gate.wait_ready()

    out = _tty_output([PEARING_CLI, "status"], env)
    text = out.decode()
    lines = text.replace("\r\n", "\n").splitlines()
    assert len(lines) == 2, text  # header + the one lock
    assert b"\x1b" not in out and b"\x07" not in out and b"\r" not in out.replace(b"\r\n", b"")
    assert all(c.isprintable() for line in lines for c in line), text
    assert "\\x1b]0;pwned\\x07" in lines[1] and "codex" in lines[1]

    as_json = work_procs.run_text([PEARING_CLI, "status", "j"], env=env)
    (lock,) = as_json.json
    assert lock["holder"]["activity"] == activity  # JSON is the raw text

    gate.open()
    assert work_procs.finish(run).returncode == 0
    assert lock_dir.exists()


def _tty_output(argv: list[str], env: dict[str, str], timeout: float = 15.0) -> bytes:
    """Run argv with stdout on a pseudo-terminal and return everything it wrote, up to EOF."""
    leader, follower = pty.openpty()
    p = subprocess.Popen(argv, env=env, stdin=subprocess.DEVNULL, stdout=follower, stderr=subprocess.PIPE)
    os.close(follower)
    chunks: list[bytes] = []
    deadline = time.monotonic() + timeout
    try:
        while True:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                pytest.fail(f"{argv} did not finish: {b''.join(chunks)!r}")
            if not select.select([leader], [], [], remaining)[0]:
                continue
            try:
                chunk = os.read(leader, 65536)
            except OSError:  # EIO: every writer closed the terminal
                break
            if not chunk:
                break
            chunks.append(chunk)
        assert p.wait(timeout=10) == 0
    finally:
        if p.poll() is None:
            p.kill()
            p.wait()
        if p.stderr is not None:
            p.stderr.close()
        os.close(leader)
    return b"".join(chunks)


# -- 4. one grammar for numbers ------------------------------------------------------------

NOT_SECONDS = [
    " 5",
    "5 ",
    "1_0",
    "\uff15",
    "\u0663",
    "1e-300",
    "1e3",
    "inf",
    "nan",
    "0x10",
    "+5",
    "-1",
    "-0",
    ".5",
    "5.",
    "1.2.3",
    "",
    "315360001",
]


@pytest.mark.parametrize("value", NOT_SECONDS, ids=repr)
@pytest.mark.parametrize("flag", ["--lease-seconds", "--wait-seconds", "--kill-grace"])
def test_pearing_run_refuses_numbers_outside_the_grammar(
    procs: Procs, tmp_path: Path, lock_dir: Path, work: Path, flag: str, value: str
) -> None:
    r = procs.run_text([PEARING_RUN, "--job", "j", f"{flag}={value}", "--", "touch", str(work / "ran")])
    _one_usage_line(r, flag, repr(value))
    assert not (work / "ran").exists()
    assert not lock_dir.exists()


@pytest.mark.parametrize("value", ["0.4", "0.49", "0.0001", "0"])
def test_a_lease_below_the_minimum_is_usage(procs: Procs, lock_dir: Path, value: str) -> None:
    r = procs.run_text([PEARING_RUN, "--job", "j", "--lease-seconds", value, "--", "true"])
    _one_usage_line(r, "--lease-seconds", repr(value))
    assert not lock_dir.exists()


def test_numbers_in_the_grammar_are_honoured(procs: Procs, work: Path) -> None:
    for n, (lease, wait) in enumerate([(f"{MIN_LEASE_SECONDS}", "0"), ("5", "0.25"), ("007", "00.5"), ("60.125", "1")]):
        marker = work / f"ran-{n}"
        r = procs.run_text(
            [PEARING_RUN, "--job", "j", "--lease-seconds", lease, "--wait-seconds", wait, "--", "touch", str(marker)]
        )
        assert r.returncode == 0 and marker.exists(), (lease, wait, r)


@pytest.mark.parametrize("value", [" 3", "3 ", "+3", "-3", "\uff13", "3.0", "0x3", "1_0", "", "256"], ids=repr)
def test_busy_exit_code_is_digits_only(procs: Procs, lock_dir: Path, value: str) -> None:
    r = procs.run_text([PEARING_RUN, "--job", "j", f"--busy-exit-code={value}", "--", "true"])
    _one_usage_line(r, "--busy-exit-code", repr(value))
    assert not lock_dir.exists()


@pytest.mark.parametrize(
    "value", ["9223372036854775808", "1" * 5000, " 3", "3.0", "+3", "\u0663", "1e3", "0", "00"], ids=lambda v: v[:24]
)
def test_fence_is_digits_only_up_to_int64(work_procs: Procs, work: Path, value: str) -> None:
    ledger = work / "ledger.json"
    r = work_procs.run_text([PEARING_GUARD, "fence", "--resource", "R", "--fence", value, "--ledger", str(ledger)])
    _one_usage_line(r, "fence")
    assert not ledger.exists()


def test_the_largest_fence_is_accepted(work_procs: Procs, work: Path) -> None:
    ledger = work / "ledger.json"
    top = str(2**63 - 1)
    r = work_procs.run_text([PEARING_GUARD, "fence", "--resource", "R", "--fence", "0" + top, "--ledger", str(ledger)])
    assert r.returncode == 0, r
    assert json.loads(ledger.read_text()) == {"R": 2**63 - 1}


@pytest.mark.parametrize("value", ["", " 1", "1e1", "-1", "0"], ids=repr)
def test_guard_max_seconds_follows_the_grammar(work_procs: Procs, value: str) -> None:
    r = work_procs.run_text([PEARING_GUARD, "exec", f"--max-seconds={value}", "--", "true"])
    _one_usage_line(r, "--max-seconds", repr(value))


@pytest.mark.parametrize("value", ["1_0", " 5", "\uff15", "1e-300", "-1"], ids=repr)
def test_pearing_cli_numbers_follow_the_grammar(procs: Procs, value: str) -> None:
    args = [PEARING_CLI, "acquire-lock", "j", "--request-uuid", "a2b6da75-a87d-44e0-b413-484354289702"]
    r = procs.run_text([*args, f"--wait-seconds={value}"])
    _one_usage_line(r, "--wait-seconds", repr(value))
    r = procs.run_text([*args, f"--lease-seconds={value}"])
    _one_usage_line(r, "--lease-seconds", repr(value))


def test_json_numbers_must_be_real_numbers() -> None:
    """What MCP and the Python API hand over: ints and finite floats, never a bool or a string's lookalike."""
    assert names.seconds(60, "lease_seconds") == 60.0
    assert names.seconds(0.5, "lease_seconds") == 0.5
    assert names.lease_seconds(MIN_LEASE_SECONDS) == MIN_LEASE_SECONDS
    for bad in (True, False, float("inf"), float("nan"), -1, -0.5, 10**400, None, [5], b"5"):
        with pytest.raises(BadValue):
            names.seconds(bad, "lease_seconds")  # type: ignore[arg-type]
    for low in (0.49, 1e-300, 0):
        with pytest.raises(BadValue, match="lease_seconds"):
            names.lease_seconds(low, "lease_seconds")
    assert names.fence(2**63 - 1) == 2**63 - 1
    assert names.exit_status(0) == 0
    for bad_fence in (True, 2.0, 0, 2**63, -1, None):
        with pytest.raises(BadValue):
            names.fence(bad_fence)  # type: ignore[arg-type]
    for bad_code in (True, False, 2.0, 256, -1, None):
        with pytest.raises(BadValue):
            names.exit_status(bad_code)  # type: ignore[arg-type]
