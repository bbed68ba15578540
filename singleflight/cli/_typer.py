"""pearing-cli's typer app, shaped like the other three commands.

- Help: typer draws its own panels (rich) or click's ``Usage:``/``Options:`` text;
  ``HelpGroup`` and ``HelpCommand`` hand their parameters to ``_argv.render`` instead, the
  layout of ``pearing-run --help``, and the man pages and completions read the same
  parameters through ``options`` / ``arguments`` / ``synopsis``.
- Global options after the command: each option of the group's callback (``--lock-dir``,
  ``--identity``, ``--backend``, ``--version``) is also an option of every command, the same
  parameter with the same callback (``pearing-cli status --lock-dir X`` is
  ``pearing-cli --lock-dir X status``; given twice, the later one counts). So a global option
  acts through its callback, never through the group callback's arguments.
- Values as given: typer checks each value through a pydantic ``TypeAdapter`` it builds on
  first use. Importing pydantic and building those was three quarters of pearing-cli's start
  (260 of 330 ms, every heartbeat an agent sends). Every parameter here is a ``str``, a
  ``bool`` flag or a ``list[str]``, which click hands over as such, and ``core/names.py``
  checks the values; so they pass as they are (``_Given``), and anything else still goes
  through typer's own coercion.
"""

from __future__ import annotations

import copy
from collections.abc import Sequence
from typing import Any

from typer import _click
from typer._coercion import RuntimeParam, build_runtime_param
from typer.core import TyperArgument, TyperCommand, TyperGroup, TyperOption, _TyperParameter

from singleflight.cli._argv import Option, Rows, render, rows

HELP = "show this help and exit"


def _style(text: str) -> str:
    """typer's own texts ("Show completion for the current shell.") in the help's style:
    lowercase start, no closing full stop. One line: the renderer wraps."""
    text = " ".join(text.split()).removesuffix(".")
    first = text.split(" ", 1)[0]
    return text[:1].lower() + text[1:] if first[1:].islower() else text


def options(params: Sequence[_click.Parameter]) -> list[Option]:
    """The options among ``params``, as the hot commands' option tables hold them."""
    out = []
    for p in params:
        if not isinstance(p, TyperOption) or p.hidden:
            continue
        flag = bool(p.is_flag)
        help_text = HELP if p.name == "help" else _style(p.help or "")
        names = sorted([*p.opts, *p.secondary_opts], key=lambda n: (n.startswith("--"), n))
        out.append(
            Option(*names, dest=p.name or "", flag=flag, help=help_text, metavar="" if flag else p.metavar or "")
        )
    return out


def arguments(params: Sequence[_click.Parameter]) -> list[tuple[str, str, bool]]:
    """The positional arguments among ``params``: (metavar, help, required)."""
    return [
        (p.metavar or (p.name or "").upper(), _style(p.help or ""), bool(p.required))
        for p in params
        if isinstance(p, TyperArgument)
    ]


def synopsis(command: _click.Command, ctx: _click.Context) -> str:
    """What the usage line says after the command's name: its required options, then
    ``[options]``, then its arguments (``[NAME]`` when optional)."""
    params = command.get_params(ctx)
    required = [p for p in params if isinstance(p, TyperOption) and p.required]
    words = [o.label for o in options(required)]
    words.append("[options]")
    words += [m if needed else f"[{m}]" for m, _, needed in arguments(params)]
    if isinstance(command, TyperGroup):
        words.append("COMMAND [ARG...]")
    return " ".join(words)


def summary(command: _click.Command) -> str:
    return " ".join((command.help or "").split())


def _sections(command: _click.Command, ctx: _click.Context) -> list[tuple[str, Rows]]:
    params = command.get_params(ctx)
    commands: Rows = []
    if isinstance(command, TyperGroup):
        commands = [(name, summary(sub)) for name, sub in command.commands.items() if not sub.hidden]
    return [
        ("commands", commands),
        ("arguments", [(m, h) for m, h, _ in arguments(params)]),
        ("options", rows(options(params))),
    ]


def _page(command: _click.Command, ctx: _click.Context) -> str:
    return render(ctx.command_path, synopsis(command, ctx), summary(command), _sections(command, ctx))


class _Given(RuntimeParam):
    """A ``str`` or a list of them passes as click parsed it; any other value (none comes from
    our parameters) goes through typer's own coercion, built only then."""

    def _coerce_value(self, value: Any, param: _TyperParameter, ctx: _click.Context) -> Any:
        if isinstance(value, str):
            return value
        if isinstance(value, (list, tuple)) and all(isinstance(v, str) for v in value):
            return list(value)
        return build_runtime_param(param.type_descriptor)._coerce_value(value, param=param, ctx=ctx)


_PLAIN = (str, bool, list[str])


def _as_given(params: Sequence[_click.Parameter]) -> None:
    for p in params:
        if isinstance(p, _TyperParameter) and p._runtime_param is None and p.type_descriptor.annotation in _PLAIN:
            p._runtime_param = _Given(parameter_info=p.type_descriptor.parameter_info, annotation=str)


class HelpCommand(TyperCommand):
    def get_params(self, ctx: _click.Context) -> list[_click.Parameter]:
        params = super().get_params(ctx)  # with click's --help, made here
        _as_given(params)
        return params

    def format_help(self, ctx: _click.Context, formatter: _click.HelpFormatter) -> None:
        formatter.write(_page(self, ctx))


class HelpGroup(TyperGroup):
    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        # Only the callback's parameters are here yet: typer adds --install-completion and
        # --show-completion after, to the group alone.
        shared = list(self.params)
        for command in self.commands.values():
            taken = {n for p in command.params for n in p.opts}
            clash = taken.intersection(n for p in shared for n in p.opts)
            if clash:
                raise TypeError(f"{command.name} has an option of the group's own: {sorted(clash)}")
            command.params.extend(_after_the_command(p) for p in shared)

    def get_params(self, ctx: _click.Context) -> list[_click.Parameter]:
        params = super().get_params(ctx)  # with typer's completion options, added after __init__
        _as_given(params)
        return params

    def format_help(self, ctx: _click.Context, formatter: _click.HelpFormatter) -> None:
        formatter.write(_page(self, ctx))


def _after_the_command(param: _click.Parameter) -> _click.Parameter:
    """A global option as an option of a command: same names and callback, and no argument of
    the command's function."""
    if param.callback is None and not param.is_eager:
        raise TypeError(f"global option {param.name} must act through a callback to be taken after the command")
    twin = copy.copy(param)
    twin.expose_value = False
    return twin
