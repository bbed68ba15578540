"""pearing-cli: the seed's lock commands and the thread service, on the lock dir or etcd.

A command line that names a command, its arguments and known options (and no ``--help``) runs
straight from the command table (cli/commands.py), without importing typer: about half of
every call, and an agent makes one on every heartbeat. Anything else goes to the typer app
built from the same table (cli/app.py): help, ``--version``, completion, and usage errors in
click's words. Errors become exit codes in one place (``main``).
"""

from __future__ import annotations

import os
import sys
from typing import Any, NoReturn

from singleflight.cli._argv import Option
from singleflight.cli._script import script
from singleflight.cli.commands import GLOBALS, PROG, SPECS, Arg, CliExit, Spec, state
from singleflight.core.const import ExitCode
from singleflight.core.errors import PearingError
from singleflight.core.log import Log

# typer's shell completion calls the command with this set: typer's, always.
_COMPLETE_VAR = "_PEARING_CLI_COMPLETE"

Plan = tuple[Spec, dict[str, Any], dict[str, str]]


def plan(argv: list[str]) -> Plan | None:
    """The command, its values and the global options a command line gives; None when typer
    should read it: an unknown word or option, ``-h``, ``--version``, ``--``, a flag given a
    value, an option's value that starts with ``-``, a missing or extra argument, a missing
    required option. None is always safe: typer reads every command line correctly, only
    slower."""
    if _COMPLETE_VAR in os.environ:
        return None
    known = {n: o for o in GLOBALS for n in o.names}
    spec: Spec | None = None
    given: dict[str, str] = {}
    values: dict[str, Any] = {}
    words: list[str] = []
    i = 0
    while i < len(argv):
        arg = argv[i]
        i += 1
        if not arg.startswith("-") or arg == "-":
            if spec is None:
                spec = SPECS.get(arg)
                if spec is None:
                    return None
                known.update({n: o for o in spec.options for n in o.names})
            else:
                words.append(arg)
            continue
        name, eq, inline = arg.partition("=")
        opt = known.get(name)
        if opt is None or (opt.flag and eq):
            return None
        value: str | bool = True
        if not opt.flag:
            if not eq and (i >= len(argv) or argv[i].startswith("-")):
                return None
            value = inline if eq else argv[i]
            i += 0 if eq else 1
        _take(opt, value, given, values)
    if spec is None:
        return None
    return _fill(spec, words, values, given)


def _take(opt: Option, value: str | bool, given: dict[str, str], values: dict[str, Any]) -> None:
    if opt in GLOBALS:
        given[opt.dest] = str(value)
    elif opt.multiple:
        values.setdefault(opt.dest, []).append(value)
    else:
        values[opt.dest] = value  # given twice: the later one counts, as click has it


def _fill(spec: Spec, words: list[str], values: dict[str, Any], given: dict[str, str]) -> Plan | None:
    args: list[Arg] = spec.args
    if len(words) > len(args):
        return None
    for k, a in enumerate(args):
        values[a.dest] = words[k] if k < len(words) else None
        if a.required and values[a.dest] is None:
            return None
    for o in spec.options:
        if o.dest in values:
            continue
        if o.required:
            return None
        values[o.dest] = False if o.flag else None if o.multiple else o.default
    return spec, values, given


def main(argv: list[str] | None = None) -> int:
    log = Log(PROG)
    state.given.clear()  # a second call in one process starts from nothing given
    args = list(sys.argv[1:] if argv is None else argv)
    try:
        found = plan(args)
        if found is None:
            from singleflight.cli import app

            return app.run(args)
        spec, values, given = found
        state.given.update(given)
        spec.func(**values)
    except CliExit as done:
        return done.code
    except KeyboardInterrupt:  # as typer's Abort: a new line after the ^C, and 130
        if sys.stderr is not None:
            sys.stderr.write("\n")
        return int(ExitCode.INTERRUPTED)
    except PearingError as exc:
        log.error(str(exc))
        return int(exc.exit_code)
    except Exception as exc:  # noqa: BLE001 - a bug still gets one line and exit 70
        log.error(f"internal error (a bug, please report it): {exc!r}")
        return int(ExitCode.SOFTWARE)
    return 0


def entry() -> NoReturn:
    """The ``pearing-cli`` command."""
    script(main)


if __name__ == "__main__":
    entry()
