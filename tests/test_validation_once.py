"""One bad value, one answer: every front end refuses it with exit 64 (or the same exception
class from ``Lock``) and the same words, the flag spelt as that front end spells it.

Each case runs the real front ends that take the value: pearing-run and pearing-cli as
processes, ``Lock(...)`` and ``ops.update_activity`` in a Python process of their own, and
pearing-mcp through the SDK's client (test_mcp's ``serve``). The messages are compared after
``--request-key`` is normalised to ``request_key``; nothing may be stored for a refused value.
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import anyio
import pytest
from helpers import PEARING_CLI, PEARING_RUN, Procs, backend_url, q, stored_blobs
from test_mcp import serve

from singleflight.core.const import MAX_ACTIVITY, ExitCode

_U = "11111111-2222-4333-8444-555555555555"
_FORMS = "30s, 50m, 2h, 1d, 1w, 1h30m, 1.5h, or plain seconds like 90"
_LONG = "x" * (MAX_ACTIVITY + 1)

# The exception's class and line, or "accepted": what a Python caller sees.
_LOCK_PROBE = """
import json, sys
from singleflight import Lock
from singleflight.core.errors import PearingError
try:
    Lock("J", **json.loads(sys.argv[1]))
except PearingError as exc:
    print(type(exc).__name__)
    print(exc)
else:
    print("accepted")
"""
# The layer under every front end: it checks the text itself, whoever calls it.
_OPS_PROBE = """
import os, sys
from singleflight import ops
from singleflight.backend import Opened, backend_url
from singleflight.core.errors import PearingError
from singleflight.core.fs import resolve_lock_dir
b = Opened(backend_url(None, os.environ.get("PEARING_BACKEND")), resolve_lock_dir(None))
try:
    ops.update_activity(b, "tester@ops", sys.argv[1])
except PearingError as exc:
    print(type(exc).__name__)
    print(exc)
else:
    print("accepted")
finally:
    b.close()
"""


@dataclass(frozen=True)
class Case:
    id: str
    error: str  # BadValue (a value breaks its rule) or UsageError (flags that cannot go together)
    message: str  # the one line, flags spelt as Python / MCP parameters
    run: list[str] | None = None  # pearing-run flags
    cli: list[str] | None = None  # pearing-cli arguments
    lock: dict[str, Any] | None = None  # Lock(...) keyword arguments
    activity: str | None = None  # ops.update_activity's text
    # An MCP call refused, by our own check or by the input schema before it (reworded into
    # the same line: cli/mcp_errors.py).
    mcp: tuple[str, dict[str, Any]] | None = None


CASES = [
    Case(
        "request-uuid-and-key",
        "UsageError",
        "give request_uuid or request_key, not both",
        run=["--request-uuid", _U, "--request-key", "k"],
        cli=["acquire-lock", "J", "--request-uuid", _U, "--request-key", "k"],
        lock={"request_uuid": _U, "request_key": "k"},
    ),
    Case(
        "bad-request-uuid",
        "BadValue",
        "bad request_uuid 'not-a-uuid': must be a UUID like 8-4-4-4-12 hex digits",
        run=["--request-uuid", "not-a-uuid"],
        cli=["acquire-lock", "J", "--request-uuid", "not-a-uuid"],
        lock={"request_uuid": "not-a-uuid"},
        mcp=("acquire_lock", {"lock_name": "J", "request_uuid": "not-a-uuid"}),
    ),
    Case(
        "heartbeat-sometimes",
        "BadValue",
        "bad heartbeat 'sometimes': must be auto or manual",
        run=["--heartbeat", "sometimes"],
        lock={"heartbeat": "sometimes"},
    ),
    Case(
        "queue-random",
        "BadValue",
        "bad queue 'random': must be fifo or latest",
        run=["--queue", "random"],
        lock={"queue": "random"},
    ),
    Case(
        "max-waiting-x",
        "BadValue",
        "bad max_waiting 'x': must be an integer from 0 to 10000 in ASCII digits",
        run=["--max-waiting", "x"],
        cli=["acquire-lock", "J", "--request-uuid", _U, "--max-waiting", "x"],
        lock={"max_waiting": "x"},
    ),
    Case(
        "max-waiting-1.5",
        "BadValue",
        "bad max_waiting '1.5': must be an integer from 0 to 10000 in ASCII digits",
        run=["--max-waiting", "1.5"],
        cli=["acquire-lock", "J", "--request-uuid", _U, "--max-waiting", "1.5"],
        lock={"max_waiting": "1.5"},
    ),
    Case(
        "max-waiting-over",
        "BadValue",
        "bad max_waiting 10001: must be an integer from 0 to 10000 in ASCII digits",
        lock={"max_waiting": 10001},
        mcp=("acquire_lock", {"lock_name": "J", "request_uuid": _U, "max_waiting": 10001}),
    ),
    Case(
        "slots-x",
        "BadValue",
        "bad slots 'x': must be an integer from 1 to 1000 in ASCII digits",
        run=["--slots", "x"],
        cli=["acquire-lock", "J", "--request-uuid", _U, "--slots", "x"],
        lock={"slots": "x"},
    ),
    Case(
        "slots-0",
        "BadValue",
        "bad slots '0': must be an integer from 1 to 1000 in ASCII digits",
        run=["--slots", "0"],
        cli=["acquire-lock", "J", "--request-uuid", _U, "--slots", "0"],
        lock={"slots": "0"},
    ),
    Case(
        "slots-over",
        "BadValue",
        "bad slots 100000: must be an integer from 1 to 1000 in ASCII digits",
        lock={"slots": 100000},
        mcp=("acquire_lock", {"lock_name": "J", "request_uuid": _U, "slots": 100000}),
    ),
    Case(
        "activity-too-long",
        "BadValue",
        f"bad activity {'x' * 64 + '...'!r}: must be 1 to {MAX_ACTIVITY} characters, not all blank",
        cli=["update-user-activity", "--activity", _LONG],
        activity=_LONG,
        mcp=("update_user_activity", {"activity": _LONG}),
    ),
    Case(
        "activity-blank",
        "BadValue",
        f"bad activity '   ': must be 1 to {MAX_ACTIVITY} characters, not all blank",
        cli=["update-user-activity", "--activity", "   "],
        activity="   ",
        mcp=("update_user_activity", {"activity": "   "}),
    ),
    Case(
        "dedupe-window-1x",
        "BadValue",
        f"bad dedupe_window '1x': must be a duration >= 0 and at most ten years: {_FORMS}",
        run=["--dedupe-window", "1x"],
    ),
    Case(
        "min-interval-1x",
        "BadValue",
        f"bad min_interval '1x': must be a duration > 0 and at most ten years: {_FORMS}",
        run=["--min-interval", "1x"],
    ),
]


def _normal(line: str) -> str:
    """The command line's spelling of a flag as a Python / MCP parameter: --request-key -> request_key."""
    return re.sub(r"--([a-z]+(?:-[a-z]+)*)", lambda m: m.group(1).replace("-", "_"), line)


def _error_line(prog: str, stderr: str) -> str:
    lines = stderr.strip().splitlines()
    assert len(lines) == 1, f"{prog}: expected one line on stderr, got {stderr!r}"
    prefix = f"{prog}: error: "
    assert lines[0].startswith(prefix), lines[0]
    return lines[0][len(prefix) :]


def _probe(procs: Procs, code: str, arg: str) -> tuple[str, str]:
    r = procs.run_text([sys.executable, "-c", code, arg])
    assert r.returncode == 0 and r.stderr == "", r
    kind, _, message = r.stdout.rstrip("\n").partition("\n")
    return kind, message


def _nothing_stored(procs: Procs, lock_dir: Path, who: str) -> None:
    assert stored_blobs(procs.env, lock_dir) == {}, f"{who} stored something for a refused value"


async def _mcp_message(tmp_path: Path, server_args: list[str], tool: str, arguments: dict[str, Any]) -> str:
    """The tool error's text, without the SDK's framing (as ``PROG: error:`` is the commands')."""
    async with serve(tmp_path, set(), *server_args) as c:
        text = await c.error(tool, **arguments)
    return text.removeprefix(f"Error executing tool {tool}: ")


def _backends(case: Case) -> list[Any]:
    """The lock dir alone for a value every front end refuses before it opens a backend (names.*
    first, then open_backend, the same code on every backend); every backend for an activity,
    which ops.update_activity checks on a backend already open."""
    local = pytest.param("local", case, id=f"local-{case.id}")
    if case.activity is None:
        return [local]
    return [local, pytest.param("etcd", case, id=f"etcd-{case.id}", marks=pytest.mark.etcd)]


@pytest.mark.parametrize(("backend", "case"), [p for c in CASES for p in _backends(c)], indirect=["backend"])
def test_a_bad_value_gets_one_answer_from_every_front_end(
    backend: str, procs: Procs, tmp_path: Path, lock_dir: Path, case: Case
) -> None:
    seen: dict[str, str] = {}
    if case.run is not None:
        r = procs.run_text([PEARING_RUN, "--job", "J", *case.run, "--", "true"])
        assert r.returncode == ExitCode.USAGE, r
        seen["pearing-run"] = _normal(_error_line("pearing-run", r.stderr))
    if case.cli is not None:
        r = procs.run_text([PEARING_CLI, *case.cli])
        assert r.returncode == ExitCode.USAGE, r
        assert r.stdout == "", r
        seen["pearing-cli"] = _normal(_error_line("pearing-cli", r.stderr))
    if case.lock is not None:
        kind, message = _probe(procs, _LOCK_PROBE, json.dumps(case.lock))
        assert kind == case.error, (kind, message)
        seen["Lock"] = message
    # The commands and Lock check before they touch the backend: not even the lock dir exists.
    assert not lock_dir.exists(), "a refused value created the lock dir"
    _nothing_stored(procs, lock_dir, "a command")

    if case.activity is not None:
        kind, message = _probe(procs, _OPS_PROBE, case.activity)
        assert kind == case.error, (kind, message)
        seen["ops.update_activity"] = message
        _nothing_stored(procs, lock_dir, "ops.update_activity")
    url = backend_url(procs.env)
    server_args = [] if url is None else ["--backend", url]
    if case.mcp is not None:
        seen["pearing-mcp"] = anyio.run(_mcp_message, tmp_path, server_args, *case.mcp)
        _nothing_stored(procs, lock_dir, "pearing-mcp")

    assert seen, case
    assert set(seen.values()) == {case.message}, seen


def test_dedupe_window_takes_days_like_min_interval(backend: str, procs: Procs, work: Path) -> None:
    """--dedupe-window 1d is the grammar of --min-interval 1d: accepted, and honoured."""

    def run(*flags: str) -> None:
        r = procs.run_text([PEARING_RUN, "--job", "J", *flags, "--", "sh", "-c", f"echo x >> {q(work / 'ran')}"])
        assert r.returncode == 0 and r.stderr == "", r

    request = str(uuid.uuid4())
    run("--request-uuid", request, "--dedupe-window", "1d")
    run("--request-uuid", request, "--dedupe-window", "1d")  # a replay within the day: done already
    run("--min-interval", "1d")
    run("--min-interval", "1d")  # a success started less than a day ago: skipped
    assert (work / "ran").read_text() == "x\nx\n"


@pytest.mark.parametrize("command", ["pearing-run", "pearing-cli", "pearing-guard", "pearing-mcp"])
def test_every_front_end_names_every_backend_form_in_its_help(command: str) -> None:
    """``--backend``'s help comes from the scheme table: a new backend shows up in all four."""
    from singleflight.core import schemes

    exe = Path(sys.executable).with_name(command)
    out = subprocess.run(
        [str(exe), "--help"], check=False, capture_output=True, text=True, timeout=30, env={"COLUMNS": "400"}
    )
    assert out.returncode == 0, out
    flat = " ".join(out.stdout.replace("│", " ").split())
    for s in schemes.SCHEMES:
        assert s.form in flat, (s.form, out.stdout)


@pytest.mark.parametrize("command", ["pearing-run", "pearing-cli", "pearing-guard", "pearing-mcp"])
def test_dash_h_is_help_on_every_command(command: str) -> None:
    exe = Path(sys.executable).with_name(command)
    out = subprocess.run([str(exe), "-h"], check=False, capture_output=True, text=True, timeout=30)
    assert out.returncode == 0 and "usage" in out.stdout.lower() and out.stderr == "", out
