"""Bad input: an empty COMMAND, a hostile $USER, control characters in status, the number grammar.

Real processes for everything a user types (``pearing-run``, ``pearing-guard``, ``pearing-cli``),
synchronised on files and exit; the table rendering and the hostname fallback are also checked
in-process, where a real process cannot be given a hostile hostname. The MCP side (schemas,
strict types, unknown arguments) is in test_mcp.py, next to the server fixture it needs.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from helpers import PEARING_CLI, PEARING_GUARD, PEARING_RUN, Procs, TextResult, q, tree, wait_line

from singleflight.core import names
from singleflight.core.const import MIN_LEASE_SECONDS, ExitCode
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
