"""pearing-cli: the seed's lock commands, on the lock dir or etcd.

A thin typer layer: parse, call one of the seed's operations (ops.py), print JSON, and turn
errors into exit codes in one place (``main``).
"""

from __future__ import annotations

import json
import os
import sys
import time
from collections.abc import Callable
from typing import Annotated, Any, NoReturn, TypeVar

import typer
from typer._click.exceptions import NoArgsIsHelpError

from singleflight import __version__, ops
from singleflight.backend import Backend, backend_url, open_backend
from singleflight.cli._script import script
from singleflight.cli._typer import HelpCommand, HelpGroup
from singleflight.core import identity, names, schemes
from singleflight.core.const import (
    DEFAULT_LEASE_SECONDS,
    DEFAULT_PRUNE_AGE,
    DEFAULT_SCOPE,
    ENV_BACKEND,
    ENV_FENCE,
    ENV_LOCK,
    ENV_REPO,
    ENV_TICKET,
    ExitCode,
)
from singleflight.core.errors import PearingError, UsageError
from singleflight.core.fs import resolve_lock_dir
from singleflight.core.log import Log

PROG = "pearing-cli"
app = typer.Typer(
    name=PROG,
    help="Lock commands and the thread service of the Pearing CLI, on the lock dir or etcd. Output is JSON on stdout.",
    no_args_is_help=True,
    pretty_exceptions_enable=False,
    add_completion=True,
    context_settings={"help_option_names": ["-h", "--help"]},  # -h, as the other three commands
    rich_markup_mode=None,
    cls=HelpGroup,  # the help layout of the other three; global options after the command too
)


_F = TypeVar("_F", bound=Callable[..., Any])


def _command(name: str) -> Callable[[_F], _F]:
    decorate: Callable[[_F], _F] = app.command(name, cls=HelpCommand)
    return decorate


class _State:
    """The global options given (before or after the command), by their parameter's name."""

    def __init__(self) -> None:
        self.given: dict[str, str] = {}


_state = _State()


def _version(value: bool) -> None:
    if value:
        typer.echo(f"{PROG} {__version__}")
        raise typer.Exit(0)


def _given(ctx: typer.Context, param: typer.CallbackParam, value: str | None) -> str | None:
    """A global option reaches the commands through here, not through ``_root``: so it is
    taken after the command as well (cli/_typer.py)."""
    if value is not None and param.name:
        _state.given[param.name] = value
    return value


@app.callback()
def _root(
    lock_dir: Annotated[
        str | None,
        typer.Option("--lock-dir", metavar="DIR", callback=_given, help="state dir (default PEARING_LOCK_DIR)"),
    ] = None,
    ident: Annotated[
        str | None,
        typer.Option(
            "--identity", metavar="ID", callback=_given, help="who holds (default PEARING_IDENTITY, else user@host)"
        ),
    ] = None,
    url: Annotated[
        str | None, typer.Option("--backend", metavar="URL", callback=_given, help=schemes.help_text())
    ] = None,
    version: Annotated[
        bool, typer.Option("--version", callback=_version, is_eager=True, help="print the version and exit")
    ] = False,
) -> None:
    """Global options: each is also taken after the command, through its callback."""


def _identity() -> str:
    return identity.resolve(_state.given.get("ident"))


def _backend() -> Backend:
    url = _state.given.get("url")
    return open_backend(
        backend_url(url, os.environ.get(ENV_BACKEND) or None), resolve_lock_dir(_state.given.get("lock_dir"))
    )


def _emit(obj: Any) -> None:
    sys.stdout.write(json.dumps(obj, indent=2) + "\n")


def _from_env(value: str | None, env: str, what: str) -> str:
    """Inside a pearing-run COMMAND, NAME, TICKET_ID and --repo default from the environment."""
    if value is not None:
        return value
    found = os.environ.get(env)
    if not found:
        raise UsageError(f"missing {what} (and {env} is not set)")
    return found


def _repo(value: str | None) -> str:
    return names.scope(value if value is not None else os.environ.get(ENV_REPO) or DEFAULT_SCOPE)


def _exit(code: int, reason: str | None) -> NoReturn:
    if reason and code != ExitCode.BUSY:  # still waiting: the JSON says so, stay quiet
        Log(PROG).error(reason)
    raise typer.Exit(code)


RepoOpt = Annotated[
    str | None, typer.Option("--repo", metavar="SCOPE", help=f"scope (default {ENV_REPO}, else '{DEFAULT_SCOPE}')")
]
LockArg = Annotated[str | None, typer.Argument(metavar="NAME", help=f"lock name (default {ENV_LOCK})")]
TicketArg = Annotated[str | None, typer.Argument(metavar="TICKET_ID", help=f"ticket id (default {ENV_TICKET})")]
LEASE = f"{DEFAULT_LEASE_SECONDS:g}"
JsonOpt = Annotated[bool, typer.Option("--json", help="JSON even on a terminal")]


@_command("acquire-lock")
def acquire_lock(  # noqa: PLR0917 - typer maps each parameter to one flag of the seed's command
    name: Annotated[str, typer.Argument(metavar="NAME", help="lock name, e.g. thread-work.42")],
    request_uuid: Annotated[
        str | None, typer.Option("--request-uuid", metavar="UUID", help="idempotency key of this acquisition")
    ] = None,
    lease_seconds: Annotated[
        str, typer.Option("--lease-seconds", metavar="SECONDS", help=f"lease length (default {LEASE})")
    ] = LEASE,
    wait_seconds: Annotated[
        str, typer.Option("--wait-seconds", metavar="SECONDS", help="wait in FIFO order up to SECONDS (default 0)")
    ] = "0",
    repo: RepoOpt = None,
    request_key: Annotated[
        str | None,
        typer.Option("--request-key", metavar="KEY", help="any event id: the request uuid is its UUIDv5"),
    ] = None,
    max_waiting: Annotated[
        str | None, typer.Option("--max-waiting", metavar="N", help="busy at once if N already wait (0-10000)")
    ] = None,
    slots: Annotated[str, typer.Option("--slots", metavar="N", help="at most N holders at once (1-1000)")] = "1",
) -> None:
    """Take the lock or queue for it. Exit 0 held, 75 still waiting (the ticket keeps its place)."""
    lock, scope = names.lock_name(name), _repo(repo)
    uuid = names.request(request_uuid, request_key, required=True)
    lease = names.lease_seconds(lease_seconds, "--lease-seconds")
    wait = names.seconds(wait_seconds, "--wait-seconds")
    bound = None if max_waiting is None else names.max_waiting(max_waiting)
    n = names.slots(slots)
    who = _identity()
    out, _ = ops.acquire(
        _backend(),
        lock,
        scope,
        request_uuid=uuid,
        lease_seconds=lease,
        wait_seconds=wait,
        identity=who,
        max_waiting=bound,
        slots=n,
    )
    _emit(out.ticket)
    _exit(out.code, out.reason)


@_command("get-lock-ticket")
def get_lock_ticket(name: LockArg = None, ticket_id: TicketArg = None, repo: RepoOpt = None) -> None:
    """Show one ticket."""
    lock, scope, tid = _from_env(name, ENV_LOCK, "NAME"), _repo(repo), _from_env(ticket_id, ENV_TICKET, "TICKET_ID")
    _emit(ops.get(_backend(), lock, scope, tid))


@_command("heartbeat-lock-ticket")
def heartbeat_lock_ticket(
    name: LockArg = None,
    ticket_id: TicketArg = None,
    lease_seconds: Annotated[
        str, typer.Option("--lease-seconds", metavar="SECONDS", help=f"new lease, from now (default {LEASE})")
    ] = LEASE,
    repo: RepoOpt = None,
) -> None:
    """Renew the lease of a held (or waiting) ticket. Exit 1 if it is no longer live: stop."""
    lock, scope, tid = _from_env(name, ENV_LOCK, "NAME"), _repo(repo), _from_env(ticket_id, ENV_TICKET, "TICKET_ID")
    lease = names.lease_seconds(lease_seconds, "--lease-seconds")
    _emit(ops.heartbeat(_backend(), lock, scope, tid, lease))


@_command("release-lock-ticket")
def release_lock_ticket(name: LockArg = None, ticket_id: TicketArg = None, repo: RepoOpt = None) -> None:
    """Release a held ticket or leave the queue. Idempotent."""
    lock, scope, tid = _from_env(name, ENV_LOCK, "NAME"), _repo(repo), _from_env(ticket_id, ENV_TICKET, "TICKET_ID")
    _emit(ops.release(_backend(), lock, scope, tid))


@_command("update-user-activity")
def update_user_activity(
    activity: Annotated[
        str | None, typer.Option("--activity", metavar="TEXT", help="what this identity is doing")
    ] = None,
    clear: Annotated[bool, typer.Option("--clear", help="clear the activity")] = False,
) -> None:
    """Set (or clear) this identity's activity, shown on its tickets and in status."""
    if (activity is None) == (not clear):
        raise UsageError("give exactly one of --activity TEXT or --clear")
    if activity is not None:
        names.activity(activity, "--activity")
    _emit(ops.update_activity(_backend(), _identity(), activity))


@_command("status")
def status(  # noqa: PLR0917 - typer maps each parameter to one flag
    name: Annotated[str | None, typer.Argument(metavar="NAME", help="only this lock")] = None,
    repo: RepoOpt = None,
    as_json: JsonOpt = False,
    watch: Annotated[bool, typer.Option("--watch", help="redraw every --interval seconds until ^C")] = False,
    interval: Annotated[
        str, typer.Option("--interval", metavar="SECONDS", help="between redraws with --watch (default 2)")
    ] = "2",
    every_scope: Annotated[bool, typer.Option("--all", help="every scope, not one")] = False,
    idle: Annotated[bool, typer.Option("--idle", help="idle locks too (no holder, nobody waiting)")] = False,
) -> None:
    """Locks with a holder or waiters: who holds, who waits, activity, lease left. A table on a
    terminal, JSON otherwise."""
    if every_scope and (repo is not None or name is not None):
        raise UsageError("--all spans every scope: give no --repo and no NAME with it")
    b, scope = _backend(), None if every_scope else _repo(repo)
    only = None if name is None else names.lock_name(name)
    every = names.seconds(interval, "--interval", allow_zero=False)
    table = sys.stdout.isatty() and not as_json
    while True:
        locks = ops.status(b, scope, only, idle=idle)
        if table:
            from singleflight.cli._table import render

            if watch:
                sys.stdout.write("\x1b[H\x1b[2J")  # home + clear: redraw in place
            sys.stdout.write(render(locks))
        elif watch:
            sys.stdout.write(json.dumps(locks) + "\n")  # one JSON document per line
        else:
            _emit(locks)
        sys.stdout.flush()
        if not watch:
            return
        time.sleep(every)


@_command("prune")
def prune_locks(
    older_than: Annotated[
        str,
        typer.Option(
            "--older-than", metavar="DURATION", help=f"unused at least this long (default {DEFAULT_PRUNE_AGE})"
        ),
    ] = DEFAULT_PRUNE_AGE,
    repo: Annotated[
        str | None, typer.Option("--repo", metavar="SCOPE", help="only this scope (default: every scope)")
    ] = None,
    dry_run: Annotated[bool, typer.Option("--dry-run", help="list what would go, remove nothing")] = False,
) -> None:
    """Remove the state of idle locks: unused for --older-than, nobody holding or waiting, no request
    in flight or inside its dedupe window. A lock used again continues above its last fence."""
    age = names.duration(older_than, "--older-than", allow_zero=True)
    scope = None if repo is None else names.scope(repo)
    from singleflight.rules import prune

    _emit(prune.prune(_backend(), scope, older_than=age, dry_run=dry_run))


ScopeArg = Annotated[str, typer.Argument(metavar="REPO", help="scope, e.g. teams/platform/website")]
ThreadArg = Annotated[str, typer.Argument(metavar="THREAD", help="thread number, e.g. 42")]


@_command("get-thread-tree")
def get_thread_tree(
    repo: ScopeArg,
    thread: ThreadArg,
    as_json: JsonOpt = False,
) -> None:
    """Show a thread's replies, nested, and the highest fence it accepted. A tree on a terminal, JSON otherwise."""
    from singleflight.rules import threads

    found = threads.tree(_backend(), names.scope(repo, "REPO"), names.thread(thread, "THREAD"))
    if sys.stdout.isatty() and not as_json:
        from singleflight.cli._table import render_thread

        sys.stdout.write(render_thread(found))
    else:
        _emit(found)


@_command("create-reply")
def create_reply(  # noqa: PLR0917 - typer maps each parameter to one flag of the seed's command
    repo: ScopeArg,
    thread: ThreadArg,
    kind: Annotated[str, typer.Option("--kind", metavar="KIND", help="what the reply is, e.g. implementation")],
    body: Annotated[str, typer.Option("--body", metavar="TEXT", help="the reply's text (at most 64 KiB)")],
    link: Annotated[
        list[str] | None,
        typer.Option("--link", metavar="KIND:TARGET", help="a link, e.g. branch:codex/thread-42 (repeatable)"),
    ] = None,
    parent: Annotated[
        str | None, typer.Option("--parent", metavar="REPLY_ID", help="reply to answer (default: the thread)")
    ] = None,
    fence: Annotated[
        str | None,
        typer.Option("--fence", metavar="N", help=f"fence to carry (default {ENV_FENCE}, else the held ticket's)"),
    ] = None,
    unfenced: Annotated[bool, typer.Option("--unfenced", help="a note with no fence (a person's)")] = False,
) -> None:
    """Add a reply, only under the newest fence: exit 1 'stale fence N < M' and nothing written otherwise."""
    from singleflight.rules import threads

    stored = threads.reply(
        _backend(),
        names.scope(repo, "REPO"),
        names.thread(thread, "THREAD"),
        kind=kind,
        body=body,
        links=link or [],
        parent=parent,
        fence=fence,
        unfenced=unfenced,
        identity=_identity(),
        env=os.environ,
        spelling={"kind": "--kind", "body": "--body", "link": "--link", "parent": "--parent", "fence": "--fence"},
    )
    _emit(stored)


def main(argv: list[str] | None = None) -> int:
    log = Log(PROG)
    _state.given.clear()  # a second call in one process starts from nothing given
    try:
        rv = app(args=argv, prog_name=PROG, standalone_mode=False)
    except typer.Abort:
        return int(ExitCode.INTERRUPTED)
    except PearingError as exc:
        log.error(str(exc))
        return int(exc.exit_code)
    except NoArgsIsHelpError as exc:  # a bare pearing-cli: the help, and 64 (no command given)
        sys.stdout.write(exc.message + "\n")
        return int(ExitCode.USAGE)
    except typer.TyperException as exc:
        # typer's (vendored click's) usage errors: a bad flag, a missing argument.
        format_message = getattr(exc, "format_message", None)
        message = str(format_message() if callable(format_message) else exc).replace("\n", " ").strip()
        log.error(message)
        return int(ExitCode.USAGE)
    except Exception as exc:  # noqa: BLE001 - a bug still gets one line and exit 70
        log.error(f"internal error (a bug, please report it): {exc!r}")
        return int(ExitCode.SOFTWARE)
    return rv if isinstance(rv, int) else 0


def entry() -> NoReturn:
    """The ``pearing-cli`` command."""
    script(main)


if __name__ == "__main__":
    entry()
