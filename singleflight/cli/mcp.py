"""pearing-mcp: the lock operations of pearing-cli as tools of a stdio MCP server.

A front end like ``cli/main.py``: check the arguments, call one backend method,
and turn a ``PearingError`` into a tool error whose text is its one line, so a
bad call never takes the server down.

pearing-mcp [--lock-dir DIR] [--identity ID] [--backend URL] [--version]
"""

# No ``from __future__ import annotations`` in this module: the SDK (a second to
# import) is imported only once the flags are parsed, inside ``build_server``,
# and it reads the tools' annotations with ``inspect.signature(eval_str=True)``
# against module globals. The tools' annotations must therefore be real objects
# when they are defined, not strings naming locals of ``build_server``.

import functools
import json
import os
import sys
import threading
from collections.abc import Callable, Coroutine
from typing import TYPE_CHECKING, Annotated, Any, TypeVar

from singleflight import __version__
from singleflight.backend import backend_url
from singleflight.cli import mcp_errors, mcp_progress, mcp_threads
from singleflight.cli._argv import Option, parse, usage
from singleflight.cli.mcp_ops import Ops
from singleflight.cli.mcp_tools import DESCRIPTIONS, HINTS, closed_tool
from singleflight.core import identity, names, schemes
from singleflight.core.const import (
    DEFAULT_LEASE_SECONDS,
    DEFAULT_SCOPE,
    ENV_BACKEND,
    MAX_ACTIVITY,
    MAX_SECONDS,
    MAX_SLOTS,
    MAX_WAITING,
    MIN_LEASE_SECONDS,
    ExitCode,
)
from singleflight.core.errors import PearingError, UsageError
from singleflight.core.fs import resolve_lock_dir
from singleflight.core.log import Log

if TYPE_CHECKING:
    from mcp.server.mcpserver import MCPServer

PROG = "pearing-mcp"
SYNOPSIS = "[--lock-dir DIR] [--identity ID] [--backend URL] [--version]"
SUMMARY = (
    "A stdio MCP server: the lock operations of pearing-cli and its thread service as tools, for an agent's "
    "MCP client to start."
)
OPTIONS = [
    Option("--lock-dir", dest="lock_dir", metavar="DIR", help="state dir (default PEARING_LOCK_DIR)"),
    Option("--backend", dest="backend", metavar="URL", help=schemes.help_text("PEARING_BACKEND, else local")),
    Option("--identity", dest="identity", metavar="ID", help="who holds (default PEARING_IDENTITY, else user@host)"),
    Option("--version", dest="version", flag=True, help="print the version and exit"),
    Option("-h", "--help", dest="help", flag=True, help="show this help and exit"),
]
_T = TypeVar("_T")


def build_server(ops: Ops) -> "MCPServer[Any]":
    import anyio
    import anyio.to_thread
    from mcp.server.mcpserver import Context, MCPServer
    from mcp.server.mcpserver.exceptions import ToolError
    from mcp.types import CallToolResult, TextContent
    from pydantic import Field, Strict

    async def run(work: Callable[..., _T], *args: Any) -> _T:
        # The backend blocks (acquire up to wait_seconds): a worker thread keeps the
        # event loop serving other calls, a heartbeat of another ticket included.
        try:
            return await anyio.to_thread.run_sync(functools.partial(work, *args))
        except PearingError as exc:
            # A ToolError is the SDK's anticipated failure: is_error=True with this text.
            raise ToolError(str(exc)) from exc

    async def run_stoppable(
        work: Callable[..., _T], *args: Any, beside: Callable[[], Coroutine[Any, Any, None]] | None = None
    ) -> _T:
        # The SDK cancels the calls in flight when the client goes (EOF on stdin), but a worker
        # thread cannot be: the server stayed up, waiting for a gone client. The thread is told
        # and returns; the server exits, and the ticket's agent, seeing it go, leaves the line.
        # ``beside`` (progress) runs while the thread works and is cancelled once it returns.
        stop = threading.Event()
        done: list[_T | PearingError] = []

        async def on_cancel() -> None:
            try:
                await anyio.sleep_forever()
            finally:
                stop.set()

        async with anyio.create_task_group() as tg:
            tg.start_soon(on_cancel)
            if beside is not None:
                tg.start_soon(beside)
            try:
                done.append(await anyio.to_thread.run_sync(functools.partial(work, *args, stopped=stop.is_set)))
            except PearingError as exc:
                done.append(exc)  # raised below: from inside the group it would come wrapped
            finally:
                tg.cancel_scope.cancel()
        if isinstance(done[0], PearingError):
            raise ToolError(str(done[0])) from done[0]
        return done[0]

    # The input schemas carry the rules of singleflight.core.names, so a client sees them in
    # tools/list and the SDK refuses a bad call before it runs; the tools check again (a
    # '..' segment, say, is beyond a JSON-schema pattern without lookahead). Strict(): a
    # number is a JSON number, never true or "60" (pydantic's lax mode takes both).
    Repo = Annotated[
        str,
        Strict(),
        Field(
            min_length=1,
            max_length=names.MAX_SCOPE,
            pattern=names.SCOPE_PATTERN,
            description="Scope of lock names, e.g. teams/platform/website.",
        ),
    ]
    LockName = Annotated[
        str,
        Strict(),
        Field(
            max_length=names.MAX_LOCK_NAME,
            pattern=names.LOCK_NAME_PATTERN,
            description="Lock name, e.g. thread-work.42 for thread #42.",
        ),
    ]
    TicketId = Annotated[
        str, Strict(), Field(pattern=names.UUID_PATTERN, description="Ticket id returned by acquire_lock.")
    ]
    Lease = Annotated[
        float,
        Strict(),
        Field(
            ge=MIN_LEASE_SECONDS,
            le=MAX_SECONDS,
            allow_inf_nan=False,
            description="Lease length in seconds; heartbeat within it or lose the lock.",
        ),
    ]

    async def acquire_lock(
        repo: Repo = DEFAULT_SCOPE,
        *,
        lock_name: LockName,
        request_uuid: Annotated[
            str,
            Strict(),
            Field(
                pattern=names.UUID_PATTERN,
                description="Idempotency key: reuse it for every retry of this one acquisition.",
            ),
        ],
        lease_seconds: Lease = DEFAULT_LEASE_SECONDS,
        wait_seconds: Annotated[
            float,
            Strict(),
            Field(
                ge=0,
                le=MAX_SECONDS,
                allow_inf_nan=False,
                description="Wait in line up to this many seconds; 0 returns at once.",
            ),
        ] = 0.0,
        max_waiting: Annotated[
            int,
            Strict(),
            Field(ge=0, le=MAX_WAITING, description="Busy at once, never queued, if this many already wait."),
        ]
        | None = None,
        slots: Annotated[
            int,
            Strict(),
            Field(ge=1, le=MAX_SLOTS, description="How many may hold the lock at once; every holder agrees."),
        ] = 1,
        ctx: Context,
    ) -> dict[str, Any]:
        beside = None
        if wait_seconds > 0 and mcp_progress.asked(ctx):
            where = functools.partial(mcp_progress.place, ops._call, repo, lock_name, request_uuid)
            beside = functools.partial(mcp_progress.report, ctx.report_progress, where, wait_seconds)
        args = (repo, lock_name, request_uuid, lease_seconds, wait_seconds)
        work = functools.partial(ops.acquire, max_waiting=max_waiting, slots=slots)
        return await run_stoppable(work, *args, beside=beside)

    async def get_lock_ticket(repo: Repo, lock_name: LockName, ticket_id: TicketId) -> dict[str, Any]:
        return await run(ops.get, repo, lock_name, ticket_id)

    async def heartbeat_lock_ticket(
        repo: Repo, lock_name: LockName, ticket_id: TicketId, lease_seconds: Lease = DEFAULT_LEASE_SECONDS
    ) -> dict[str, Any]:
        return await run(ops.heartbeat, repo, lock_name, ticket_id, lease_seconds)

    async def release_lock_ticket(repo: Repo, lock_name: LockName, ticket_id: TicketId) -> dict[str, Any]:
        return await run(ops.release, repo, lock_name, ticket_id)

    async def update_user_activity(
        activity: Annotated[
            str,
            Strict(),
            Field(
                min_length=1,
                max_length=MAX_ACTIVITY,
                description=f"What you are doing, 1 to {MAX_ACTIVITY} characters.",
            ),
        ]
        | None = None,
        clear: Annotated[bool, Strict(), Field(description="Clear the activity instead.")] = False,
    ) -> dict[str, Any]:
        return await run(ops.update_activity, activity, clear)

    async def list_locks(
        repo: Repo = DEFAULT_SCOPE,
        lock_name: Annotated[
            str,
            Strict(),
            Field(max_length=names.MAX_LOCK_NAME, pattern=names.LOCK_NAME_PATTERN, description="Only this lock."),
        ]
        | None = None,
    ) -> Annotated[CallToolResult, list[dict[str, Any]]]:
        locks = await run(ops.status, repo, lock_name)
        # One JSON list, as pearing-cli status prints it (the SDK's default splits a list
        # into one text block per item, and none at all for an empty list).
        return CallToolResult(
            content=[TextContent(type="text", text=json.dumps(locks, indent=2))],
            structured_content={"result": locks},
        )

    async def verify_token(
        token_file: Annotated[
            str,
            Strict(),
            Field(
                min_length=1,
                max_length=mcp_errors.MAX_PATH,
                description="Path of the token file (token_file of a held ticket).",
            ),
        ],
    ) -> dict[str, Any]:
        return await run(ops.verify, token_file)

    own: list[Callable[..., Any]] = [
        acquire_lock,
        get_lock_ticket,
        heartbeat_lock_ticket,
        release_lock_ticket,
        update_user_activity,
        list_locks,
        verify_token,
    ]
    tools = [(fn, DESCRIPTIONS[fn.__name__]) for fn in own]
    tools += mcp_threads.tools(ops._call, ops.identity, run, Repo)
    return MCPServer(
        name=PROG,
        version=__version__,
        # Quiet like the other front ends: a refused call is the caller's answer, not a log line.
        log_level="WARNING",
        instructions=(
            "Single-flight locks: acquire_lock before a contested step, heartbeat while working, "
            "release_lock_ticket when done. A ticket in state 'waiting' keeps its FIFO place while "
            "you retry acquire_lock with the same request_uuid or heartbeat it."
        ),
        tools=[closed_tool(fn, description, HINTS[fn.__name__]) for fn, description in tools],
    )


def main(argv: list[str] | None = None) -> int:
    log = Log(PROG)
    try:
        values, rest = parse(sys.argv[1:] if argv is None else argv, OPTIONS, positional=True)
        if rest:
            raise UsageError(f"unexpected argument {rest[0]!r} (see --help)")
        if values.get("help"):
            sys.stdout.write(usage(PROG, SYNOPSIS, OPTIONS, SUMMARY))
            return 0
        if values.get("version"):
            sys.stdout.write(f"{PROG} {__version__}\n")
            return 0
        lock_dir, ident, url = values.get("lock_dir"), values.get("identity"), values.get("backend")
        ops = Ops(
            resolve_lock_dir(None if lock_dir is None else str(lock_dir)),
            identity.resolve(None if ident is None else str(ident)),
            backend_url(None if url is None else str(url), os.environ.get(ENV_BACKEND)),
        )
        ops.check()
    except PearingError as exc:
        log.error(str(exc))
        return int(exc.exit_code)
    import importlib.util

    try:
        sdk = importlib.util.find_spec("mcp")
    except (ImportError, ValueError):  # a finder that refuses it, a broken install
        sdk = None
    if sdk is None:
        log.error("the MCP SDK is not installed: pip install 'pearing-singleflight[mcp]'")
        return int(ExitCode.UNAVAILABLE)
    try:
        build_server(ops).run("stdio")
    except KeyboardInterrupt:
        return 130
    return 0


if __name__ == "__main__":
    sys.exit(main())
