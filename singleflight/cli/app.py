"""pearing-cli's typer app, built from the command table (cli/commands.py).

It serves what a well-formed command line does not need: ``--help``, ``--version``, shell
completion, and the wording of a usage error (a bad flag, a missing argument). cli/main.py
hands a command line here only when it cannot run it straight from the table.
"""

from __future__ import annotations

import inspect
import sys
from typing import Annotated, Any

import typer
from typer._click.exceptions import NoArgsIsHelpError

from singleflight import __version__
from singleflight.cli._argv import Option
from singleflight.cli._typer import HelpCommand, HelpGroup
from singleflight.cli.commands import GLOBALS, PROG, SPECS, SUMMARY, Arg, Spec, state
from singleflight.core.const import ExitCode
from singleflight.core.log import Log

app = typer.Typer(
    name=PROG,
    help=SUMMARY,
    no_args_is_help=True,
    pretty_exceptions_enable=False,
    add_completion=True,
    context_settings={"help_option_names": ["-h", "--help"]},  # -h, as the other three commands
    rich_markup_mode=None,
    cls=HelpGroup,  # the help layout of the other three; global options after the command too
)


def _version(value: bool) -> None:
    if value:
        typer.echo(f"{PROG} {__version__}")
        raise typer.Exit(0)


def _given(ctx: typer.Context, param: typer.CallbackParam, value: str | None) -> str | None:
    """A global option reaches the commands through here, not through ``_root``: so it is
    taken after the command as well (cli/_typer.py)."""
    if value is not None and param.name:
        state.given[param.name] = value
    return value


def _global(o: Option) -> Any:
    return typer.Option(*o.names, metavar=o.metavar, callback=_given, help=o.help)


_LOCK_DIR, _IDENTITY, _BACKEND = GLOBALS


@app.callback()
def _root(
    lock_dir: Annotated[str | None, _global(_LOCK_DIR)] = None,
    ident: Annotated[str | None, _global(_IDENTITY)] = None,
    url: Annotated[str | None, _global(_BACKEND)] = None,
    version: Annotated[
        bool, typer.Option("--version", callback=_version, is_eager=True, help="print the version and exit")
    ] = False,
) -> None:
    """Global options: each is also taken after the command, through its callback."""


def _param(p: Arg | Option) -> inspect.Parameter:
    """One parameter of a command as typer reads it from a signature."""
    kind, empty = inspect.Parameter.KEYWORD_ONLY, inspect.Parameter.empty
    annotation: Any
    default: Any
    if isinstance(p, Arg):
        info = typer.Argument(metavar=p.metavar, help=p.help)
        annotation, default = (Annotated[str, info], empty) if p.required else (Annotated[str | None, info], None)
    elif p.flag:
        annotation, default = Annotated[bool, typer.Option(*p.names, help=p.help)], False
    else:
        info = typer.Option(*p.names, metavar=p.metavar, help=p.help)
        if p.multiple:
            annotation, default = Annotated[list[str] | None, info], None
        elif p.required:
            annotation, default = Annotated[str, info], empty
        elif p.default is not None:
            annotation, default = Annotated[str, info], p.default
        else:
            annotation, default = Annotated[str | None, info], None
    return inspect.Parameter(p.dest, kind, default=default, annotation=annotation)


def _register(spec: Spec) -> None:
    def call(**values: Any) -> None:
        spec.func(**values)

    params = [_param(p) for p in spec.params]
    call.__signature__ = inspect.Signature(params)  # type: ignore[attr-defined]
    call.__annotations__ = {p.name: p.annotation for p in params}
    call.__doc__, call.__name__ = spec.func.__doc__, spec.func.__name__
    app.command(spec.name, cls=HelpCommand)(call)


for _spec in SPECS.values():
    _register(_spec)


def run(argv: list[str]) -> int:
    """The command line through typer. Our own errors (``PearingError``, ``CliExit``) pass
    through to the caller, which maps every exit in one place."""
    try:
        rv = app(args=argv, prog_name=PROG, standalone_mode=False)
    except typer.Abort:
        return int(ExitCode.INTERRUPTED)
    except NoArgsIsHelpError as exc:  # a bare pearing-cli: the help, and 64 (no command given)
        sys.stdout.write(exc.message + "\n")
        return int(ExitCode.USAGE)
    except typer.TyperException as exc:
        # typer's (vendored click's) usage errors: a bad flag, a missing argument.
        format_message = getattr(exc, "format_message", None)
        message = str(format_message() if callable(format_message) else exc).replace("\n", " ").strip()
        Log(PROG).error(message)
        return int(ExitCode.USAGE)
    return rv if isinstance(rv, int) else 0
