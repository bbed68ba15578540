"""pearing-cli's commands without typer: what each one takes (``SPECS``) and what it does.

typer costs about 80 ms to import, half of every pearing-cli call, and an agent makes one on
every heartbeat. So the table here is the one definition of each command: ``cli/main.py`` runs
a well-formed command line straight from it, and ``cli/app.py`` builds the typer app from it
for everything else (help, completion, and the wording of a usage error).
"""

from __future__ import annotations

import json
import os
import sys
import time
from collections.abc import Callable
from typing import Any, NoReturn

from singleflight import ops
from singleflight.backend import Opened, backend_url
from singleflight.cli._argv import Option
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
from singleflight.core.errors import UsageError
from singleflight.core.fs import resolve_lock_dir
from singleflight.core.log import Log

PROG = "pearing-cli"
SUMMARY = "Lock commands and the thread service of the Pearing CLI, on the lock dir or etcd. Output is JSON on stdout."


class Arg:
    """A positional argument of a command."""

    __slots__ = ("dest", "help", "metavar", "required")

    def __init__(self, dest: str, metavar: str, help: str, *, required: bool = False) -> None:
        self.dest, self.metavar, self.help, self.required = dest, metavar, help, required


class Spec:
    """One command: its name, its parameters in the order its help lists them, and its body,
    called with one keyword per parameter (a string, None when not given, a bool for a flag,
    a list for a repeatable option)."""

    __slots__ = ("func", "name", "params")

    def __init__(self, name: str, func: Callable[..., None], params: tuple[Arg | Option, ...]) -> None:
        self.name, self.func, self.params = name, func, params

    @property
    def args(self) -> list[Arg]:
        return [p for p in self.params if isinstance(p, Arg)]

    @property
    def options(self) -> list[Option]:
        return [p for p in self.params if isinstance(p, Option)]


SPECS: dict[str, Spec] = {}

# The global options: before the command or after it, the later one counting.
GLOBALS = [
    Option("--lock-dir", dest="lock_dir", metavar="DIR", help="state dir (default PEARING_LOCK_DIR)"),
    Option("--identity", dest="ident", metavar="ID", help="who holds (default PEARING_IDENTITY, else user@host)"),
    Option("--backend", dest="url", metavar="URL", help=schemes.help_text()),
]


class CliExit(Exception):
    """A command's own exit status, given with its JSON already printed."""

    def __init__(self, code: int) -> None:
        super().__init__(code)
        self.code = code


class _State:
    """The global options given, by their ``dest``."""

    def __init__(self) -> None:
        self.given: dict[str, str] = {}


state = _State()


def command(name: str, *params: Arg | Option) -> Callable[[Callable[..., None]], Callable[..., None]]:
    def register(func: Callable[..., None]) -> Callable[..., None]:
        SPECS[name] = Spec(name, func, params)
        return func

    return register


def _identity() -> str:
    return identity.resolve(state.given.get("ident"))


def _opened() -> Opened:
    url = state.given.get("url")
    return Opened(backend_url(url, os.environ.get(ENV_BACKEND) or None), resolve_lock_dir(state.given.get("lock_dir")))


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
    raise CliExit(code)


LEASE = f"{DEFAULT_LEASE_SECONDS:g}"
REPO = Option("--repo", dest="repo", metavar="SCOPE", help=f"scope (default {ENV_REPO}, else '{DEFAULT_SCOPE}')")
LOCK = Arg("name", "NAME", f"lock name (default {ENV_LOCK})")
TICKET = Arg("ticket_id", "TICKET_ID", f"ticket id (default {ENV_TICKET})")
JSON = Option("--json", dest="as_json", flag=True, help="JSON even on a terminal")
SCOPE = Arg("repo", "REPO", "scope, e.g. teams/platform/website", required=True)
THREAD = Arg("thread", "THREAD", "thread number, e.g. 42", required=True)


@command(
    "acquire-lock",
    Arg("name", "NAME", "lock name, e.g. thread-work.42", required=True),
    Option("--request-uuid", dest="request_uuid", metavar="UUID", help="idempotency key of this acquisition"),
    Option(
        "--lease-seconds",
        dest="lease_seconds",
        metavar="SECONDS",
        help=f"lease length (default {LEASE})",
        default=LEASE,
    ),
    Option(
        "--wait-seconds",
        dest="wait_seconds",
        metavar="SECONDS",
        help="wait in FIFO order up to SECONDS (default 0)",
        default="0",
    ),
    REPO,
    Option("--request-key", dest="request_key", metavar="KEY", help="any event id: the request uuid is its UUIDv5"),
    Option("--max-waiting", dest="max_waiting", metavar="N", help="busy at once if N already wait (0-10000)"),
    Option("--slots", dest="slots", metavar="N", help="at most N holders at once (1-1000)", default="1"),
)
def acquire_lock(  # noqa: PLR0917 - one parameter per flag of the seed's command
    name: str,
    request_uuid: str | None,
    lease_seconds: str,
    wait_seconds: str,
    repo: str | None,
    request_key: str | None,
    max_waiting: str | None,
    slots: str,
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
        _opened(),
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


@command("get-lock-ticket", LOCK, TICKET, REPO)
def get_lock_ticket(name: str | None, ticket_id: str | None, repo: str | None) -> None:
    """Show one ticket."""
    lock, scope, tid = _from_env(name, ENV_LOCK, "NAME"), _repo(repo), _from_env(ticket_id, ENV_TICKET, "TICKET_ID")
    _emit(ops.get(_opened(), lock, scope, tid))


@command(
    "heartbeat-lock-ticket",
    LOCK,
    TICKET,
    Option(
        "--lease-seconds",
        dest="lease_seconds",
        metavar="SECONDS",
        help=f"new lease, from now (default {LEASE})",
        default=LEASE,
    ),
    REPO,
)
def heartbeat_lock_ticket(name: str | None, ticket_id: str | None, lease_seconds: str, repo: str | None) -> None:
    """Renew the lease of a held (or waiting) ticket. Exit 1 if it is no longer live: stop."""
    lock, scope, tid = _from_env(name, ENV_LOCK, "NAME"), _repo(repo), _from_env(ticket_id, ENV_TICKET, "TICKET_ID")
    lease = names.lease_seconds(lease_seconds, "--lease-seconds")
    _emit(ops.heartbeat(_opened(), lock, scope, tid, lease))


@command("release-lock-ticket", LOCK, TICKET, REPO)
def release_lock_ticket(name: str | None, ticket_id: str | None, repo: str | None) -> None:
    """Release a held ticket or leave the queue. Idempotent."""
    lock, scope, tid = _from_env(name, ENV_LOCK, "NAME"), _repo(repo), _from_env(ticket_id, ENV_TICKET, "TICKET_ID")
    _emit(ops.release(_opened(), lock, scope, tid))


@command(
    "update-user-activity",
    Option("--activity", dest="activity", metavar="TEXT", help="what this identity is doing"),
    Option("--clear", dest="clear", flag=True, help="clear the activity"),
)
def update_user_activity(activity: str | None, clear: bool) -> None:
    """Set (or clear) this identity's activity, shown on its tickets and in status."""
    if (activity is None) == (not clear):
        raise UsageError("give exactly one of --activity TEXT or --clear")
    if activity is not None:
        names.activity(activity, "--activity")
    _emit(ops.update_activity(_opened(), _identity(), activity))


@command(
    "status",
    Arg("name", "NAME", "only this lock"),
    REPO,
    JSON,
    Option("--watch", dest="watch", flag=True, help="redraw every --interval seconds until ^C"),
    Option(
        "--interval", dest="interval", metavar="SECONDS", help="between redraws with --watch (default 2)", default="2"
    ),
    Option("--all", dest="every_scope", flag=True, help="every scope, not one"),
    Option("--idle", dest="idle", flag=True, help="idle locks too (no holder, nobody waiting)"),
)
def status(  # noqa: PLR0917 - one parameter per flag
    name: str | None, repo: str | None, as_json: bool, watch: bool, interval: str, every_scope: bool, idle: bool
) -> None:
    """Locks with a holder or waiters: who holds, who waits, activity, lease left. A table on a
    terminal, JSON otherwise."""
    if every_scope and (repo is not None or name is not None):
        raise UsageError("--all spans every scope: give no --repo and no NAME with it")
    b, scope = _opened(), None if every_scope else _repo(repo)
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


@command(
    "prune",
    Option(
        "--older-than",
        dest="older_than",
        metavar="DURATION",
        help=f"unused at least this long (default {DEFAULT_PRUNE_AGE})",
        default=DEFAULT_PRUNE_AGE,
    ),
    Option("--repo", dest="repo", metavar="SCOPE", help="only this scope (default: every scope)"),
    Option("--dry-run", dest="dry_run", flag=True, help="list what would go, remove nothing"),
)
def prune_locks(older_than: str, repo: str | None, dry_run: bool) -> None:
    """Remove the state of idle locks: unused for --older-than, nobody holding or waiting, no request
    in flight or inside its dedupe window. A lock used again continues above its last fence."""
    age = names.duration(older_than, "--older-than", allow_zero=True)
    scope = None if repo is None else names.scope(repo)
    from singleflight.rules import prune

    _emit(prune.prune(_opened().backend, scope, older_than=age, dry_run=dry_run))


@command(
    "init-db",
    Option("--print-sql", dest="print_sql", flag=True, help="print the statements for a DBA; run nothing"),
)
def init_db(print_sql: bool) -> None:
    """Create the backend's tables now (a database backend: PostgreSQL), as its first use would;
    with --print-sql, print the statements instead, for a DBA to run when pearing's role may not
    create. The lock dir and etcd need no set-up."""
    url = backend_url(state.given.get("url"), os.environ.get(ENV_BACKEND) or None)
    scheme = schemes.scheme_of(url)
    assert scheme is not None
    # The store's own set-up, named in the scheme table (the CLI imports no backend).
    sql = scheme.setup_sql(url)
    if sql is None:
        raise UsageError(f"the {scheme.name} backend needs no set-up: init-db is for a database backend")
    if print_sql:
        sys.stdout.write(sql)
        return
    backend = _opened().backend
    try:
        backend.locks(None, idle=True)  # the first request creates the tables (or says why not: 77)
    finally:
        backend.close()
    _emit({"backend": scheme.name, "ready": True})


@command("get-thread-tree", SCOPE, THREAD, JSON)
def get_thread_tree(repo: str, thread: str, as_json: bool) -> None:
    """Show a thread's replies, nested, and the highest fence it accepted. A tree on a terminal, JSON otherwise."""
    from singleflight.rules import threads

    found = threads.tree(_opened().backend, names.scope(repo, "REPO"), names.thread(thread, "THREAD"))
    if sys.stdout.isatty() and not as_json:
        from singleflight.cli._table import render_thread

        sys.stdout.write(render_thread(found))
    else:
        _emit(found)


@command(
    "create-reply",
    SCOPE,
    THREAD,
    Option("--kind", dest="kind", metavar="KIND", help="what the reply is, e.g. implementation", required=True),
    Option("--body", dest="body", metavar="TEXT", help="the reply's text (at most 64 KiB)", required=True),
    Option(
        "--link",
        dest="link",
        metavar="KIND:TARGET",
        help="a link, e.g. branch:codex/thread-42 (repeatable)",
        multiple=True,
    ),
    Option("--parent", dest="parent", metavar="REPLY_ID", help="reply to answer (default: the thread)"),
    Option("--fence", dest="fence", metavar="N", help=f"fence to carry (default {ENV_FENCE}, else the held ticket's)"),
    Option("--unfenced", dest="unfenced", flag=True, help="a note with no fence (a person's)"),
)
def create_reply(  # noqa: PLR0917 - one parameter per flag of the seed's command
    repo: str,
    thread: str,
    kind: str,
    body: str,
    link: list[str] | None,
    parent: str | None,
    fence: str | None,
    unfenced: bool,
) -> None:
    """Add a reply, only under the newest fence: exit 1 'stale fence N < M' and nothing written otherwise."""
    from singleflight.rules import threads

    stored = threads.reply(
        _opened().backend,
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
