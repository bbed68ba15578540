"""A small option parser for the hot commands (pearing-run, pearing-guard).

typer costs ~60 ms to import, more than the whole budget of a cron tick's
``pearing-run``; this covers what those two commands need: ``--opt VALUE``,
``--opt=VALUE``, flags, ``--`` and a usage error that exits 64.
"""

from __future__ import annotations

from singleflight.core.errors import UsageError


class Option:
    __slots__ = ("dest", "flag", "help", "metavar", "names")

    def __init__(self, *names: str, dest: str, flag: bool = False, help: str = "", metavar: str = "") -> None:
        self.names, self.dest, self.flag, self.help, self.metavar = names, dest, flag, help, metavar


def parse(argv: list[str], options: list[Option], *, positional: bool) -> tuple[dict[str, object], list[str]]:
    """Options before ``--`` (or the first positional word); returns (values, rest)."""
    by_name = {n: o for o in options for n in o.names}
    values: dict[str, object] = {}
    i = 0
    while i < len(argv):
        arg = argv[i]
        if arg == "--":
            return values, argv[i + 1 :]
        if not arg.startswith("-") or arg == "-":
            if positional:
                return values, argv[i:]
            raise UsageError(f"unexpected argument {arg!r} (put COMMAND after --)")
        name, eq, inline = arg.partition("=")
        opt = by_name.get(name)
        if opt is None:
            raise UsageError(f"unknown option {name!r} (see --help)")
        if opt.flag:
            if eq:
                raise UsageError(f"option {name} takes no value")
            values[opt.dest] = True
        elif eq:
            values[opt.dest] = inline
        else:
            if i + 1 >= len(argv):
                raise UsageError(f"option {name} needs a value")
            i += 1
            values[opt.dest] = argv[i]
        i += 1
    return values, []


def usage(prog: str, synopsis: str, options: list[Option]) -> str:
    lines = [f"usage: {prog} {synopsis}", "", "options:"]
    for o in options:
        names = ", ".join(o.names) + (f" {o.metavar}" if o.metavar else "")
        lines.append(f"  {names:<28} {o.help}")
    return "\n".join(lines) + "\n"
