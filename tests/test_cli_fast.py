"""pearing-cli runs a well-formed command line without typer (cli/main.py ``plan``), and reads
every command line exactly as the typer app built from the same table does.

- Generated command lines (hypothesis) over every command of the table: known and unknown
  options, ``--opt=value``, values starting with ``-``, repeated options, missing and extra
  arguments, global options before and after the command. Wherever ``plan`` takes a line, typer
  calls the same command with the same values and the same global options; a line ``plan``
  declines is typer's to read (or to refuse).
- Real processes: the seed's commands run, exit as before, and never import typer; ``--help``
  and a usage error still come from typer.
"""

from __future__ import annotations

import json
import sys
from typing import Any

import pytest
from helpers import PEARING_CLI, Procs
from hypothesis import given, settings
from hypothesis import strategies as st

from singleflight.cli import app, commands
from singleflight.cli._argv import Option
from singleflight.cli.commands import GLOBALS, SPECS, Arg, Spec
from singleflight.cli.main import plan
from singleflight.core.const import ExitCode

# Values as users type them, and the awkward ones: empty, a leading "-", an "=" inside.
values = st.one_of(
    st.sampled_from(["x", "", "-", "-5", "--x", "a=b", "r/s", "60", "k:v"]),
    st.text(st.characters(codec="utf-8", exclude_characters="\x00"), max_size=6),
)


@st.composite
def command_lines(draw: st.DrawFn) -> list[str]:
    spec: Spec = draw(st.sampled_from(list(SPECS.values())))
    line: list[str] = []
    for o in draw(st.lists(st.sampled_from(GLOBALS), max_size=2)):  # before the command
        line += _given(draw, o)
    line.append(spec.name)
    args: list[Arg] = spec.args
    required = sum(a.required for a in args)
    n = draw(st.integers(max(0, required - 1), len(args) + 1))  # one missing or one extra at most
    words = [draw(values) for _ in range(n)]
    opts = draw(st.lists(st.sampled_from([*spec.options, *GLOBALS]), max_size=len(spec.options) + 2))
    parts = [[w] for w in words] + [_given(draw, o) for o in opts]
    if draw(st.booleans()):
        parts.append([draw(st.sampled_from(["--help", "-h", "--bogus", "--", "--version", "--json=1"]))])
    order = draw(st.permutations(range(len(parts))))
    for k in order:
        line += parts[k]
    return line


def _given(draw: st.DrawFn, o: Option) -> list[str]:
    name = draw(st.sampled_from(o.names))
    value = draw(values)
    if o.flag:
        return [name] if draw(st.integers(0, 4)) else [f"{name}={value}"]
    return [f"{name}={value}"] if draw(st.booleans()) else [name, value]


def _through_typer(argv: list[str], monkeypatch: pytest.MonkeyPatch) -> Any:
    """What typer calls for ``argv``: (command, values, global options), or its exit code."""
    seen: list[Any] = []

    def recorder(command: str) -> Any:
        return lambda **kw: seen.append((command, kw))

    for spec in SPECS.values():
        monkeypatch.setattr(spec, "func", recorder(spec.name))
    commands.state.given.clear()
    code = app.run(argv)
    if not seen:
        return code
    [(name, kw)] = seen
    return name, kw, dict(commands.state.given)


@settings(max_examples=600, deadline=None)
@given(command_lines())
def test_the_fast_path_reads_a_command_line_as_typer_does(argv: list[str]) -> None:
    found = plan(argv)
    with pytest.MonkeyPatch.context() as mp, _quiet(mp):
        typer_read = _through_typer(argv, mp)
    if found is not None:
        spec, vals, given_ = found
        assert typer_read == (spec.name, vals, given_), argv


class _quiet:
    """typer's help and error lines go to the real streams: swallowed here."""

    def __init__(self, mp: pytest.MonkeyPatch) -> None:
        self.mp = mp

    def __enter__(self) -> None:
        import io

        self.mp.setattr(sys, "stdout", io.StringIO())
        self.mp.setattr(sys, "stderr", io.StringIO())

    def __exit__(self, *exc: object) -> None:
        return None


def _full(spec: Spec) -> list[str]:
    """Every argument and option of ``spec`` given once, as a user would write it."""
    line = [spec.name, *(f"w{k}" for k, _ in enumerate(spec.args))]
    for o in spec.options:
        line += [o.names[-1]] if o.flag else [o.names[-1], "v"]
    return [*line, "--lock-dir", "d"]


@pytest.mark.parametrize("name", list(SPECS))
def test_every_command_given_in_full_takes_the_fast_path(name: str, monkeypatch: pytest.MonkeyPatch) -> None:
    argv = _full(SPECS[name])
    found = plan(argv)
    assert found is not None, argv
    with _quiet(monkeypatch):
        assert _through_typer(argv, monkeypatch) == (name, found[1], found[2])


START = """
import sys
from singleflight.cli.main import main
code = main(sys.argv[1:])
sys.stderr.write("typer loaded: %s\\n" % ("typer" in sys.modules))
sys.stderr.write("subprocess loaded: %s\\n" % ("subprocess" in sys.modules))
sys.exit(code)
"""


REPLY = ["create-reply", "r", "1", "--kind", "k", "--body", "b", "--link", "a:1", "--link=b:2", "--unfenced"]


@pytest.mark.parametrize(
    ("argv", "code", "typer", "spawns"),
    [
        (["status", "--json"], ExitCode.OK, False, False),
        (["--identity", "a@b", "acquire-lock", "x", "--request-key", "k"], ExitCode.OK, False, True),
        (["heartbeat-lock-ticket", "x", "--lease-seconds", "9"], ExitCode.USAGE, False, False),  # no TICKET_ID
        (REPLY, ExitCode.OK, False, False),
        (["status", "--bogus"], ExitCode.USAGE, True, None),
        (["acquire-lock"], ExitCode.USAGE, True, None),
    ],
    ids=["status", "acquire", "heartbeat-no-ticket", "reply", "unknown-option", "missing-name"],
)
def test_the_seed_commands_run_without_typer_and_usage_errors_still_come_from_it(
    procs: Procs, argv: list[str], code: int, typer: bool, spawns: bool | None
) -> None:
    """And only acquire-lock, which starts an agent, loads subprocess (with threading's kin)."""
    r = procs.run([sys.executable, "-c", START, *argv])
    *said, loaded, spawner = r.stderr.decode().splitlines()
    assert (r.returncode, loaded) == (code, f"typer loaded: {typer}"), r
    assert spawns is None or spawner == f"subprocess loaded: {spawns}", r
    assert len(said) == (0 if code == ExitCode.OK else 1), r
    if argv[0] == "create-reply":
        tree = procs.run([PEARING_CLI, "get-thread-tree", "r", "1"])
        assert [link for reply in json.loads(tree.stdout)["replies"] for link in reply["links"]] == ["a:1", "b:2"]
