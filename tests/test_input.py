"""Bad input: an empty COMMAND, a hostile $USER, control characters in status, the number grammar.

Real processes for everything a user types (``pearing-run``, ``pearing-guard``, ``pearing-cli``),
synchronised on files and exit; the table rendering and the hostname fallback are also checked
in-process, where a real process cannot be given a hostile hostname. The MCP side (schemas,
strict types, unknown arguments) is in test_mcp.py, next to the server fixture it needs.
"""

from __future__ import annotations

from pathlib import Path

from helpers import PEARING_GUARD, PEARING_RUN, Procs, TextResult, q, tree, wait_line

from singleflight.core.const import ExitCode

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
