"""A small option parser for the hot commands (pearing-run, pearing-guard), and the one help
layout of all four commands.

typer costs ~60 ms to import, more than the whole budget of a cron tick's
``pearing-run``; this covers what those two commands need: ``--opt VALUE``,
``--opt=VALUE``, flags, ``--`` and a usage error that exits 64.

``render`` lays out every ``--help``: pearing-run's, pearing-guard's and pearing-mcp's from
their option tables, pearing-cli's from its typer app (cli/_typer.py). The man pages and the
shell completions are generated from the same tables (cli/_docs.py). A metavar is a word of
cli/_pages.py's ``METAVARS`` (a test holds all four to it): SECONDS, DURATION, N, NAME...
"""

from __future__ import annotations

from singleflight.core.errors import UsageError

WIDTH = 79  # a help line never runs past this column (an 80-column terminal wraps at 80)
NAMES_WIDTH = 28  # "  --names METAVAR" is padded to here; the help starts two columns right of it


class Option:
    """One option. ``default``, ``required`` and ``multiple`` (given again: one more value) are
    pearing-cli's; the hot commands' parser takes the last value given."""

    __slots__ = ("default", "dest", "flag", "help", "metavar", "multiple", "names", "required")

    def __init__(
        self,
        *names: str,
        dest: str,
        flag: bool = False,
        help: str = "",
        metavar: str = "",
        default: str | None = None,
        required: bool = False,
        multiple: bool = False,
    ) -> None:
        self.names, self.dest, self.flag, self.help, self.metavar = names, dest, flag, help, metavar
        self.default, self.required, self.multiple = default, required, multiple

    @property
    def label(self) -> str:
        """The option's cell in a help table: ``-v, --verbose`` or ``--lease-seconds SECONDS``."""
        return ", ".join(self.names) + (f" {self.metavar}" if self.metavar else "")


class Command:
    """A subcommand of a hot command: what its usage line says after its name, one sentence of
    what it does, its options, and (``label``) its cell in the command list."""

    __slots__ = ("label", "name", "options", "summary", "synopsis")

    def __init__(self, name: str, synopsis: str, summary: str, options: list[Option], *, label: str = "") -> None:
        self.name, self.synopsis, self.summary, self.options = name, synopsis, summary, options
        self.label = label or name


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


Rows = list[tuple[str, str]]


def wrap(text: str, width: int) -> list[str]:
    """``text``'s words in lines of at most ``width`` (a longer word alone on its line)."""
    lines: list[str] = []
    line = ""
    for word in text.split():
        if line and len(line) + 1 + len(word) > width:
            lines.append(line)
            line = word
        else:
            line = f"{line} {word}" if line else word
    return [*lines, line] if line else lines


def render(prog: str, synopsis: str, summary: str, sections: list[tuple[str, Rows]]) -> str:
    """A help page: the usage line, what the command does, then each non-empty section
    (``commands``, ``arguments``, ``options``) as a two-column table."""
    lines = [f"usage: {prog} {synopsis}"]
    if summary:
        lines += ["", *wrap(summary, WIDTH)]
    indent = " " * (NAMES_WIDTH + 3)
    for title, rows in sections:
        if not rows:
            continue
        lines += ["", f"{title}:"]
        for left, text in rows:
            body = wrap(text, WIDTH - len(indent)) or [""]
            if len(left) > NAMES_WIDTH:
                lines.append(f"  {left}")
            else:
                lines.append(f"  {left:<{NAMES_WIDTH}} {body.pop(0)}".rstrip())
            lines += [indent + b for b in body]
    return "\n".join(lines) + "\n"


def rows(options: list[Option]) -> Rows:
    return [(o.label, o.help) for o in options]


def usage(prog: str, synopsis: str, options: list[Option], summary: str = "") -> str:
    return render(prog, synopsis, summary, [("options", rows(options))])
