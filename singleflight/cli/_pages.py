"""The four commands as their man pages and shell completions read them: the very option
tables ``--help`` renders (pearing-run's, pearing-guard's, pearing-mcp's) and pearing-cli's
typer app, through the same functions its help uses (cli/_typer.py). Nothing here restates an
option; what only a man page says (what each metavar takes, the exit statuses) is here.
"""

from __future__ import annotations

from typing import Final

from singleflight.cli._argv import Command, Option
from singleflight.core import schemes
from singleflight.core.const import ExitCode
from singleflight.core.keys import MAX_REQUEST_KEY
from singleflight.core.names import MAX_LOCK_NAME, MAX_SCOPE

# The one vocabulary of metavars, in all four commands (tests/test_docs.py holds them to it):
# what a value is, and what a shell may complete it with ("" nothing, "dir", "file",
# "command"). A metavar with a "|" is a choice of its words (auto|manual).
METAVARS: Final[dict[str, tuple[str, str]]] = {
    "SECONDS": ("seconds in ASCII digits with an optional fraction: 60, 0.5", ""),
    "DURATION": ("seconds, or with units s m h d w from the largest down: 90, 30s, 50m, 1h30m, 1d", ""),
    "N": ("a whole number in ASCII digits", ""),
    "NAME": (
        f"a lock (or resource) name: a letter or digit, then letters, digits, '.', '_', '-' ({MAX_LOCK_NAME} at most)",
        "",
    ),
    "SCOPE": (
        f"a scope: segments of letters, digits, '.', '_', '-' joined by '/' ({MAX_SCOPE} at most): teams/web",
        "",
    ),
    "REPO": ("the scope a thread lives in, as SCOPE", ""),
    "THREAD": ("a thread number, a positive decimal: 42", ""),
    "TICKET_ID": ("a ticket id (a UUID) as acquire-lock printed it", ""),
    "REPLY_ID": ("a reply id as create-reply or get-thread-tree printed it", ""),
    "UUID": ("a UUID: 8-4-4-4-12 hex digits", ""),
    "KEY": (f"any printable text of 1 to {MAX_REQUEST_KEY} characters, e.g. a webhook event id", ""),
    "ID": ("an identity: a letter or digit, then letters, digits, '.', '_', '@', '+', ':', '-': ci@host1", ""),
    "TEXT": ("free text", ""),
    "KIND": ("a reply kind: a lowercase letter, then lowercase letters, digits, '-'", ""),
    "KIND:TARGET": ("a link: its kind, a colon, its target: branch:fix/42", ""),
    "URL": (f"a backend: {schemes.forms()}", ""),
    "DIR": ("a directory", "dir"),
    "PATH": ("a file", "file"),
    "CMD": ("a shell command line, run by /bin/sh -c", "command"),
}

_EXIT: Final[dict[ExitCode, str]] = {
    ExitCode.OK: "success",
    ExitCode.REFUSED: "refused: token not live, ticket not held, stale fence",
    ExitCode.USAGE: "usage: a bad flag, name, scope, uuid or number (one line says which)",
    ExitCode.UNAVAILABLE: "a part of the install is missing (the mcp extra)",
    ExitCode.SOFTWARE: "internal error (a bug: please report it)",
    ExitCode.CANTCREAT: "the lock dir cannot be created",
    ExitCode.IOERR: "a corrupt record (its path printed; never reset)",
    ExitCode.BUSY: "busy, or the wait timed out",
    ExitCode.NOPERM: "the lock dir (or a ledger) is not permitted",
    ExitCode.LEASE_LOST: "lease lost: COMMAND was stopped",
    ExitCode.NOEXEC: "COMMAND is not executable",
    ExitCode.NOTFOUND: "COMMAND was not found",
    ExitCode.INTERRUPTED: "interrupted (^C)",
}
_CORE = (ExitCode.USAGE, ExitCode.SOFTWARE, ExitCode.CANTCREAT, ExitCode.IOERR, ExitCode.NOPERM)


def _exits(*codes: ExitCode, **said: str) -> list[tuple[str, str]]:
    """(status, meaning) rows: ``said`` rewords a code for this command (``c0=...``)."""
    return [(str(int(c)), said.get(f"c{int(c)}", _EXIT[c])) for c in sorted(codes)]


class Page:
    """One command: its usage line, what it does, its options, its subcommands, and for a
    command without subcommands what follows its options (``words``: "command" after --).
    ``after``: its options are taken after the subcommand too (and listed there)."""

    __slots__ = ("after", "commands", "exits", "options", "prog", "summary", "synopsis", "words")

    def __init__(
        self,
        prog: str,
        synopsis: str,
        summary: str,
        options: list[Option],
        *,
        commands: list[Sub] | None = None,
        words: str = "",
        exits: list[tuple[str, str]],
        after: bool = False,
    ) -> None:
        self.prog, self.synopsis, self.summary, self.options = prog, synopsis, summary, options
        self.commands, self.words, self.exits, self.after = commands or [], words, exits, after


class Sub:
    """A subcommand: ``arguments`` are (metavar, help, required); ``words`` as ``Page.words``."""

    __slots__ = ("arguments", "name", "options", "summary", "synopsis", "words")

    def __init__(
        self,
        name: str,
        synopsis: str,
        summary: str,
        options: list[Option],
        arguments: list[tuple[str, str, bool]],
        *,
        words: str = "",
    ) -> None:
        self.name, self.synopsis, self.summary, self.options = name, synopsis, summary, options
        self.arguments, self.words = arguments, words


def _run() -> Page:
    from singleflight.cli import run

    return Page(
        run.PROG,
        run.SYNOPSIS,
        run.SUMMARY,
        run.OPTIONS,
        words="command",
        exits=[
            ("COMMAND's", "COMMAND ran: its status (128+N when killed by signal N)"),
            *_exits(
                ExitCode.OK,
                *_CORE,
                ExitCode.BUSY,
                ExitCode.LEASE_LOST,
                ExitCode.NOEXEC,
                ExitCode.NOTFOUND,
                c0="also: a request already done (--request-uuid), --skip-if said done, within --min-interval",
                c75="busy, or the wait timed out (--busy-exit-code sets it)",
            ),
        ],
    )


def _guard() -> Page:
    from singleflight.cli import guard

    words = {"exec": "command", "git-push": "remote"}

    def sub(c: Command) -> Sub:
        return Sub(c.name, c.synopsis, c.summary, c.options, [], words=words.get(c.name, ""))

    return Page(
        guard.PROG,
        guard.SYNOPSIS,
        guard.SUMMARY,
        [guard.VERSION, guard.HELP_ALL],
        commands=[sub(c) for c in guard.SUBCOMMANDS],
        exits=[
            *_exits(
                ExitCode.OK,
                ExitCode.REFUSED,
                *_CORE,
                ExitCode.LEASE_LOST,
                c0="the token is live, the fence accepted, the push done; exec: CMD's status",
                c124="exec: CMD ran past --max-seconds and was killed",
            ),
            ("other", "exec: CMD's status; git-push: git's status"),
        ],
    )


def _mcp() -> Page:
    from singleflight.cli import mcp

    return Page(
        mcp.PROG,
        mcp.SYNOPSIS,
        mcp.SUMMARY,
        mcp.OPTIONS,
        exits=_exits(ExitCode.OK, ExitCode.UNAVAILABLE, *_CORE, c0="the client closed the server's stdin"),
    )


def _cli() -> Page:
    import typer
    from typer.core import TyperGroup

    from singleflight.cli import _typer, app
    from singleflight.cli.commands import PROG

    group = typer.main.get_command(app.app)
    root = group.make_context(PROG, [], resilient_parsing=True)
    assert isinstance(group, TyperGroup)
    subs = []
    for name, command in group.commands.items():
        ctx = command.make_context(name, [], parent=root, resilient_parsing=True)
        params = command.get_params(ctx)
        subs.append(
            Sub(
                name,
                f"{name} {_typer.synopsis(command, ctx)}",
                _typer.summary(command),
                _typer.options(params),
                _typer.arguments(params),
            )
        )
    return Page(
        PROG,
        _typer.synopsis(group, root),
        _typer.summary(group),
        _typer.options(group.get_params(root)),
        commands=subs,
        exits=_exits(
            ExitCode.OK,
            ExitCode.REFUSED,
            *_CORE,
            ExitCode.BUSY,
            ExitCode.INTERRUPTED,
            c75="acquire-lock: still waiting (the ticket keeps its place)",
        ),
        after=True,
    )


def pages() -> list[Page]:
    return [_run(), _guard(), _cli(), _mcp()]
