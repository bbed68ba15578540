"""pearing-mcp, driven over stdio by the SDK's own client (stdio_client + ClientSession).

Each test starts the real server with its own ``--lock-dir``. Waits are bounded
polls on tool results (``_until``), never bare sleeps. Every ticket a test
leaves live is released through the session, and at teardown any detached agent
(a ticket's ``holder_pid``) still alive is killed. Tests that take ``backend`` (or ``caps``)
start the server with ``--backend`` on etcd (the SDK's client passes the server no
PEARING_* environment); fences are compared, since on etcd they are revisions.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from pathlib import Path
from typing import Any

import anyio
import pytest
from caps import Caps
from helpers import BIN_DIR, backend_url, pid_alive
from mcp import ClientSession, StdioServerParameters, stdio_client

from singleflight.core.const import MIN_LEASE_SECONDS, ExitCode

PEARING_MCP = os.path.join(BIN_DIR, "pearing-mcp")
TOOLS = {
    "acquire_lock",
    "get_lock_ticket",
    "heartbeat_lock_ticket",
    "release_lock_ticket",
    "update_user_activity",
    "list_locks",
    "verify_token",
    "get_thread_tree",
    "create_reply",
}
SEED = {  # the seed walkthrough's MCP call, verbatim but for the request uuid
    "repo": "teams/platform/website",
    "lock_name": "thread-work.42",
    "lease_seconds": 60,
    "wait_seconds": 30,
}
IDENTITY = "tester@mcp"

pytestmark = pytest.mark.anyio


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


def _is_agent(pid: int) -> bool:
    """Only kill what the backend started: a pid may have been reused since."""
    try:
        cmdline = Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return False
    return b"singleflight.agent" in cmdline and pid_alive(pid)


@pytest.fixture
def server_args(backend: str, env: dict[str, str]) -> list[str]:
    """pearing-mcp's arguments for this test's backend: the URL its commands get (``backend``
    puts it in ``env``), none for the default lock dir."""
    url = backend_url(env)
    return [] if url is None else ["--backend", url]


def _first_fence(caps: Caps, fence: int) -> None:
    """A fresh lock's first fence: 1 where fences count per lock, else (a store-wide revision) at least 1."""
    assert fence == 1 if caps.contiguous_fences else fence >= 1, fence


@pytest.fixture
def agents() -> Iterator[set[int]]:
    """holder_pid of every ticket a test saw; any still alive at teardown is killed."""
    pids: set[int] = set()
    yield pids
    for pid in pids:
        if pid != os.getpid() and _is_agent(pid):
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)


class Client:
    """A session plus bookkeeping: the tickets to release and the agents to reap."""

    def __init__(self, session: ClientSession, agents: set[int]) -> None:
        self.session, self.agents = session, agents
        self.live: dict[str, tuple[str, str]] = {}  # ticket_id -> (repo, lock_name)

    def _track(self, ticket: dict[str, Any]) -> None:
        if not isinstance(ticket, dict) or "ticket_id" not in ticket or "state" not in ticket:
            return
        if isinstance(ticket.get("holder_pid"), int):
            self.agents.add(ticket["holder_pid"])
        if ticket["state"] in ("held", "waiting"):
            self.live[ticket["ticket_id"]] = (ticket["repo"], ticket["lock_name"])
        else:
            self.live.pop(ticket["ticket_id"], None)

    async def call(self, tool: str, **arguments: Any) -> Any:
        """A call that must succeed; returns its result as JSON (the same as its structured content)."""
        result = await self.session.call_tool(tool, arguments)
        text = "".join(c.text for c in result.content if c.type == "text")
        assert not result.is_error, f"{tool}({arguments}) failed: {text}"
        value = json.loads(text)
        structured = result.structured_content
        assert structured == (value if isinstance(value, dict) else {"result": value})
        for item in value if isinstance(value, list) else [value]:
            self._track(item)
            if "waiters" in item:  # a list_locks entry: its holder and waiters are tickets
                for nested in [item["holder"], *item["waiters"]]:
                    if nested:
                        self._track(nested)
        return value

    async def error(self, tool: str, **arguments: Any) -> str:
        """A call that must come back as a tool error; returns its message."""
        result = await self.session.call_tool(tool, arguments)
        text = "".join(c.text for c in result.content if c.type == "text")
        assert result.is_error, f"{tool}({arguments}) should have failed, got {text}"
        return text

    async def acquire(self, request_uuid: str | None = None, **overrides: Any) -> dict[str, Any]:
        args = {**SEED, "request_uuid": request_uuid or str(uuid.uuid4()), **overrides}
        ticket: dict[str, Any] = await self.call("acquire_lock", **args)
        return ticket

    async def release_all(self) -> None:
        """Waiters first, so releasing a holder promotes nobody we then have to chase."""
        for state in ("waiting", "held"):
            for ticket_id, (repo, lock) in list(self.live.items()):
                ticket = await self.call("get_lock_ticket", repo=repo, lock_name=lock, ticket_id=ticket_id)
                if ticket["state"] == state:
                    await self.call("release_lock_ticket", repo=repo, lock_name=lock, ticket_id=ticket_id)


def _sole(exc: BaseException) -> BaseException:
    """The one exception inside the task groups' ExceptionGroup wrappers, if there is just one."""
    while True:
        inner = getattr(exc, "exceptions", None)
        if not (isinstance(inner, tuple) and len(inner) == 1):
            return exc
        exc = inner[0]


@contextlib.asynccontextmanager
async def serve(tmp_path: Path, agents: set[int], *extra: str) -> AsyncIterator[Client]:
    try:
        async with _serve(tmp_path, agents, *extra) as client:
            yield client
    except BaseException as exc:
        # A failed assertion reads as itself (and pytest.raises / xfail(raises=) match it),
        # not as two levels of "unhandled errors in a TaskGroup".
        inner = _sole(exc)
        if inner is exc:
            raise
        raise inner from None


@contextlib.asynccontextmanager
async def _serve(tmp_path: Path, agents: set[int], *extra: str) -> AsyncIterator[Client]:
    lock_dir = tmp_path / "lockdir"
    params = StdioServerParameters(
        command=PEARING_MCP, args=["--lock-dir", str(lock_dir), "--identity", IDENTITY, *extra], cwd=str(tmp_path)
    )
    with (tmp_path / "server.stderr").open("w") as errlog:
        async with stdio_client(params, errlog=errlog) as (read, write), ClientSession(read, write) as session:
            await session.initialize()
            client = Client(session, agents)
            try:
                yield client
            except BaseException:
                # Best effort on the way out of a failed test; the agents fixture kills the rest.
                with anyio.move_on_after(20, shield=True), contextlib.suppress(Exception):
                    await client.release_all()
                raise
            with anyio.fail_after(20):
                await client.release_all()


async def _until(probe: Callable[[], Awaitable[Any]], what: str, timeout: float = 10.0) -> Any:
    """Poll ``probe`` every 10 ms until it returns something truthy, or fail."""
    deadline = time.monotonic() + timeout
    while True:
        value = await probe()
        if value:
            return value
        if time.monotonic() >= deadline:
            pytest.fail(f"timed out after {timeout:g} s waiting for {what}")
        await anyio.sleep(0.01)  # the poll interval, never a wait on its own


async def _in_line(c: Client, ref: dict[str, str]) -> bool:
    """One waiter, in its place in the FIFO line: list_locks numbers a waiting ticket whose
    agent is still starting too, get_lock_ticket only once the agent has queued."""
    (lock,) = await c.call("list_locks", **ref)
    if [w["queue_position"] for w in lock["waiters"]] != [1]:
        return False
    ticket = await c.call("get_lock_ticket", **ref, ticket_id=lock["waiters"][0]["ticket_id"])
    return ticket["queue_position"] == 1


# -- the tool list ---------------------------------------------------------------------------


async def test_lists_the_nine_tools_with_the_seed_arguments(tmp_path: Path, agents: set[int]) -> None:
    async with serve(tmp_path, agents) as c:
        tools = {t.name: t for t in (await c.session.list_tools()).tools}
    assert set(tools) == TOOLS
    for tool in tools.values():
        assert tool.description and "\n" not in tool.description.strip(), tool.name
    schema = tools["acquire_lock"].input_schema
    props = schema["properties"]
    # The seed's arguments, and the optional slots and bound on the line (SPEC: optional slots,
    # max_waiting).
    seed = {"repo", "lock_name", "request_uuid", "lease_seconds", "wait_seconds"}
    assert set(props) == seed | {"slots", "max_waiting"}
    assert not {"slots", "max_waiting"} & set(schema.get("required", []))
    for name in ("repo", "lock_name", "request_uuid"):
        assert props[name]["type"] == "string", name
    for name in ("lease_seconds", "wait_seconds"):
        assert props[name]["type"] in ("number", "integer"), name
    assert {"lock_name", "request_uuid"} <= set(schema.get("required", []))
    assert set(tools["get_lock_ticket"].input_schema["properties"]) == {"repo", "lock_name", "ticket_id"}
    assert set(tools["heartbeat_lock_ticket"].input_schema["properties"]) == {
        "repo",
        "lock_name",
        "ticket_id",
        "lease_seconds",
    }
    assert set(tools["release_lock_ticket"].input_schema["properties"]) == {"repo", "lock_name", "ticket_id"}
    assert set(tools["update_user_activity"].input_schema["properties"]) == {"activity", "clear"}
    assert set(tools["list_locks"].input_schema["properties"]) == {"repo", "lock_name"}
    assert set(tools["verify_token"].input_schema["properties"]) == {"token_file"}
    assert set(tools["get_thread_tree"].input_schema["properties"]) == {"repo", "thread"}
    # The protocol in the descriptions a model reads, and hints a client can act on.
    acquire = tools["acquire_lock"].description or ""
    assert all(w in acquire for w in ("'waiting' is not an error", "'held'", "heartbeat", "release", "fence"))
    hints = {name: t.annotations for name, t in tools.items()}
    assert all(h is not None for h in hints.values()), hints
    read_only = {name for name, h in hints.items() if h and h.read_only_hint}
    assert read_only == {"get_lock_ticket", "list_locks", "verify_token", "get_thread_tree"}
    assert {name for name, h in hints.items() if h and h.destructive_hint} == {"release_lock_ticket"}
    assert {name for name, h in hints.items() if h and not h.idempotent_hint} == {"create_reply"}
    reply = tools["create_reply"].input_schema
    assert set(reply["properties"]) == {"repo", "thread", "kind", "body", "links", "parent_id", "fence", "unfenced"}
    assert set(reply["required"]) == {"repo", "thread", "kind", "body"} and reply["additionalProperties"] is False


# -- one ticket's life -----------------------------------------------------------------------


async def test_acquire_get_heartbeat_release(
    caps: Caps, server_args: list[str], tmp_path: Path, agents: set[int]
) -> None:
    request = str(uuid.uuid4())
    async with serve(tmp_path, agents, *server_args) as c:
        held = await c.acquire(request)
        assert held["state"] == "held"
        _first_fence(caps, held["fence"])
        assert held["request_uuid"] == request
        assert (held["repo"], held["lock_name"], held["identity"]) == (SEED["repo"], SEED["lock_name"], IDENTITY)
        assert isinstance(held["holder_pid"], int) and _is_agent(held["holder_pid"])
        assert held["queue_position"] is None
        assert Path(held["token_file"]).is_file()
        ref = {"repo": SEED["repo"], "lock_name": SEED["lock_name"], "ticket_id": held["ticket_id"]}

        got = await c.call("get_lock_ticket", **ref)
        assert {k: got[k] for k in ("ticket_id", "state", "fence", "holder_pid")} == {
            k: held[k] for k in ("ticket_id", "state", "fence", "holder_pid")
        }

        beat = await c.call("heartbeat_lock_ticket", **ref, lease_seconds=60)
        assert beat["state"] == "held" and beat["fence"] == held["fence"]
        assert beat["lease_seconds"] == 60
        assert beat["lease_expires_at"] > held["lease_expires_at"]  # RFC 3339 UTC sorts as text

        text = "Revalidating teams/platform/website thread #42 under lock thread-work.42."
        assert await c.call("update_user_activity", activity=text) == {"identity": IDENTITY, "activity": text}
        assert (await c.call("get_lock_ticket", **ref))["activity"] == text

        (lock,) = await c.call("list_locks", repo=SEED["repo"])
        assert lock["state"] == "held" and lock["fence"] == held["fence"]
        assert lock["holder"]["ticket_id"] == held["ticket_id"] and lock["waiters"] == []
        assert await c.call("list_locks") == []  # default scope: nothing there

        released = await c.call("release_lock_ticket", **ref)
        assert released["state"] == "released"
        assert (await c.call("release_lock_ticket", **ref))["state"] == "released"  # idempotent
        assert (await c.call("get_lock_ticket", **ref))["state"] == "released"
        assert not _is_agent(held["holder_pid"])  # release returns once the holder let go

        message = await c.error("heartbeat_lock_ticket", **ref, lease_seconds=60)
        assert held["ticket_id"] in message and "released" in message

        assert await c.call("update_user_activity", clear=True) == {"identity": IDENTITY, "activity": None}


async def test_heartbeat_sets_the_new_lease_length(server_args: list[str], tmp_path: Path, agents: set[int]) -> None:
    async with serve(tmp_path, agents, *server_args) as c:
        held = await c.acquire()
        ref = {"repo": SEED["repo"], "lock_name": SEED["lock_name"], "ticket_id": held["ticket_id"]}
        beat = await c.call("heartbeat_lock_ticket", **ref, lease_seconds=120)
        assert beat["lease_seconds"] == 120, beat
        assert (await c.call("get_lock_ticket", **ref))["lease_seconds"] == 120


async def test_a_second_request_waits_and_a_retry_never_makes_a_second_ticket(
    server_args: list[str], tmp_path: Path, agents: set[int]
) -> None:
    first, second = str(uuid.uuid4()), str(uuid.uuid4())
    async with serve(tmp_path, agents, *server_args) as c:
        held = await c.acquire(first)
        assert held["state"] == "held"

        waiting = await c.acquire(second, wait_seconds=0)
        assert waiting["state"] == "waiting"
        assert waiting["queue_position"] == 1 and waiting["fence"] is None
        assert waiting["ticket_id"] != held["ticket_id"]

        again = await c.acquire(first)  # a replay of the holder's own request: no wait behind itself
        assert (again["ticket_id"], again["state"], again["fence"]) == (held["ticket_id"], "held", held["fence"])
        again = await c.acquire(second, wait_seconds=0)
        assert (again["ticket_id"], again["state"]) == (waiting["ticket_id"], "waiting")

        (lock,) = await c.call("list_locks", repo=SEED["repo"], lock_name=SEED["lock_name"])
        assert lock["holder"]["ticket_id"] == held["ticket_id"]
        assert [w["ticket_id"] for w in lock["waiters"]] == [waiting["ticket_id"]]

        ref = {"repo": SEED["repo"], "lock_name": SEED["lock_name"]}
        assert (await c.call("release_lock_ticket", **ref, ticket_id=waiting["ticket_id"]))["state"] == "cancelled"
        assert (await c.call("release_lock_ticket", **ref, ticket_id=held["ticket_id"]))["state"] == "released"


async def test_a_blocked_acquire_leaves_the_server_serving_and_is_promoted(
    caps: Caps, server_args: list[str], tmp_path: Path, agents: set[int]
) -> None:
    async with serve(tmp_path, agents, *server_args) as c:
        held = await c.acquire()
        ref = {"repo": SEED["repo"], "lock_name": SEED["lock_name"]}
        promoted: dict[str, Any] = {}

        async def wait_in_line() -> None:
            promoted.update(await c.acquire(wait_seconds=30))

        async def waiter_queued() -> bool:
            return await _in_line(c, ref)

        with anyio.fail_after(30):
            async with anyio.create_task_group() as tg:
                tg.start_soon(wait_in_line)
                # list_locks answers while acquire_lock blocks in its worker thread.
                await _until(waiter_queued, "the second acquire to queue")
                assert (await c.call("heartbeat_lock_ticket", **ref, ticket_id=held["ticket_id"]))["state"] == "held"
                await c.call("release_lock_ticket", **ref, ticket_id=held["ticket_id"])
        assert promoted["state"] == "held"
        assert promoted["fence"] > held["fence"]
        assert not caps.contiguous_fences or promoted["fence"] == 2


async def test_a_promoted_ticket_says_it_waited(server_args: list[str], tmp_path: Path, agents: set[int]) -> None:
    async with serve(tmp_path, agents, *server_args) as c:
        held = await c.acquire()
        assert held["promoted"] is False
        ref = {"repo": SEED["repo"], "lock_name": SEED["lock_name"]}
        promoted: dict[str, Any] = {}

        async def wait_in_line() -> None:
            promoted.update(await c.acquire(wait_seconds=30))

        async def waiter_queued() -> bool:
            return await _in_line(c, ref)

        with anyio.fail_after(30):
            async with anyio.create_task_group() as tg:
                tg.start_soon(wait_in_line)
                await _until(waiter_queued, "the second acquire to queue")
                await c.call("release_lock_ticket", **ref, ticket_id=held["ticket_id"])
        assert promoted["state"] == "held", promoted
        assert promoted["promoted"] is True, promoted


async def test_a_retry_of_a_waiting_request_may_wait_again(
    server_args: list[str], tmp_path: Path, agents: set[int]
) -> None:
    second = str(uuid.uuid4())
    async with serve(tmp_path, agents, *server_args) as c:
        await c.acquire()
        waiting = await c.acquire(second, wait_seconds=0)
        again = await c.acquire(second, wait_seconds=0.2)
        assert (again["ticket_id"], again["state"]) == (waiting["ticket_id"], "waiting")


# -- bad calls -------------------------------------------------------------------------------


async def test_bad_arguments_are_tool_errors_and_the_session_goes_on(
    server_args: list[str], tmp_path: Path, agents: set[int]
) -> None:
    async with serve(tmp_path, agents, *server_args) as c:
        message = await c.error("acquire_lock", **{**SEED, "lock_name": "../x", "request_uuid": str(uuid.uuid4())})
        assert "'../x'" in message and "lock_name" in message  # the input schema's pattern

        held = await c.acquire()  # the same session still works
        assert held["state"] == "held"
        ref = {"repo": SEED["repo"], "lock_name": SEED["lock_name"]}

        cases: list[tuple[str, dict[str, Any], list[str]]] = [
            ("acquire_lock", {**SEED, "repo": "../etc", "request_uuid": str(uuid.uuid4())}, ["repo", "'../etc'"]),
            ("acquire_lock", {**SEED, "repo": "/abs", "request_uuid": str(uuid.uuid4())}, ["repo", "'/abs'"]),
            ("acquire_lock", {**SEED, "request_uuid": "not-a-uuid"}, ["request_uuid", "'not-a-uuid'"]),
            ("acquire_lock", {**SEED, "request_uuid": str(uuid.uuid4()), "lease_seconds": 0}, ["lease_seconds"]),
            ("acquire_lock", {**SEED, "request_uuid": str(uuid.uuid4()), "wait_seconds": -1}, ["wait_seconds"]),
            ("acquire_lock", {**SEED, "request_uuid": str(uuid.uuid4()), "lease_seconds": "soon"}, ["lease_seconds"]),
            ("acquire_lock", {"lock_name": "x"}, ["request_uuid"]),
            ("get_lock_ticket", {**ref, "ticket_id": "nope"}, ["ticket_id", "'nope'"]),
            ("get_lock_ticket", {**ref, "ticket_id": (unknown := str(uuid.uuid4()))}, [unknown, "unknown ticket"]),
            ("heartbeat_lock_ticket", {**ref, "ticket_id": held["ticket_id"], "lease_seconds": -5}, ["lease_seconds"]),
            ("release_lock_ticket", {**ref, "ticket_id": unknown}, [unknown, "unknown ticket"]),
            ("update_user_activity", {}, ["activity", "clear"]),
            ("update_user_activity", {"activity": "x", "clear": True}, ["activity", "clear"]),
            ("update_user_activity", {"activity": "   "}, ["activity"]),
            ("list_locks", {"lock_name": "../x"}, ["'../x'"]),
            ("list_locks", {"repo": "a//b"}, ["'a//b'"]),
            ("verify_token", {"token_file": ""}, ["token_file"]),
            ("no_such_tool", {}, ["no_such_tool"]),
        ]
        for tool, arguments, needles in cases:
            message = await c.error(tool, **arguments)
            for needle in needles:
                assert needle in message, (tool, arguments, message)
            assert "\n" not in message.strip(), f"one line expected: {message!r}"

        got = await c.call("get_lock_ticket", **ref, ticket_id=held["ticket_id"])
        assert got["state"] == "held" and got["fence"] == held["fence"]
        assert (await c.call("release_lock_ticket", **ref, ticket_id=held["ticket_id"]))["state"] == "released"
        message = await c.error("heartbeat_lock_ticket", **ref, ticket_id=held["ticket_id"], lease_seconds=60)
        assert held["ticket_id"] in message and "released" in message

    # Nothing was created outside the lock dir, and the server logged no crash.
    assert sorted(p.name for p in tmp_path.iterdir()) == ["lockdir", "server.stderr"]
    assert not (tmp_path / "lockdir" / "locks" / "default").exists()
    assert "Traceback" not in (tmp_path / "server.stderr").read_text()


async def test_input_schemas_carry_the_validation(tmp_path: Path, agents: set[int]) -> None:
    async with serve(tmp_path, agents) as c:
        tools = {t.name: t.input_schema for t in (await c.session.list_tools()).tools}
    uuid_pattern = "^[0-9A-Fa-f]{8}-[0-9A-Fa-f]{4}-[0-9A-Fa-f]{4}-[0-9A-Fa-f]{4}-[0-9A-Fa-f]{12}$"
    for name, schema in tools.items():
        assert schema["additionalProperties"] is False, name
        props = schema["properties"]
        if "repo" in props:
            assert props["repo"]["maxLength"] == 200 and props["repo"]["minLength"] == 1, name
            assert props["repo"]["type"] == "string" and props["repo"]["pattern"], name
        if "lock_name" in props:
            lock = next((s for s in props["lock_name"].get("anyOf", []) if s["type"] == "string"), props["lock_name"])
            assert lock["pattern"] == "^[A-Za-z0-9][A-Za-z0-9._-]{0,127}$" and lock["maxLength"] == 128, name
        for key in ("request_uuid", "ticket_id"):
            if key in props:
                assert props[key]["pattern"] == uuid_pattern, (name, key)
        if "lease_seconds" in props:
            lease = props["lease_seconds"]
            assert lease["type"] == "number" and lease["minimum"] == MIN_LEASE_SECONDS, name
            assert lease["maximum"] == 10 * 365 * 86400, name
    wait = tools["acquire_lock"]["properties"]["wait_seconds"]
    assert wait["type"] == "number" and wait["minimum"] == 0
    (activity,) = [s for s in tools["update_user_activity"]["properties"]["activity"]["anyOf"] if s["type"] == "string"]
    assert activity["maxLength"] == 1000 and activity["minLength"] == 1
    assert tools["update_user_activity"]["properties"]["clear"]["type"] == "boolean"
    assert tools["verify_token"]["properties"]["token_file"]["minLength"] == 1


async def test_wrong_types_unknown_and_overlong_arguments_are_tool_errors(tmp_path: Path, agents: set[int]) -> None:
    async with serve(tmp_path, agents) as c:
        held = await c.acquire()
        ref = {"repo": SEED["repo"], "lock_name": SEED["lock_name"], "ticket_id": held["ticket_id"]}
        fresh = {**SEED, "lock_name": "other", "request_uuid": str(uuid.uuid4()), "wait_seconds": 0}
        cases: list[tuple[str, dict[str, Any], str]] = [
            ("acquire_lock", {**fresh, "lease_seconds": True}, "lease_seconds"),
            ("acquire_lock", {**fresh, "lease_seconds": "60"}, "lease_seconds"),
            ("acquire_lock", {**fresh, "lease_seconds": 0.4}, "lease_seconds"),
            ("acquire_lock", {**fresh, "lease_seconds": 1e-300}, "lease_seconds"),
            ("acquire_lock", {**fresh, "lease_seconds": 1e12}, "lease_seconds"),
            ("acquire_lock", {**fresh, "wait_seconds": False}, "wait_seconds"),
            ("acquire_lock", {**fresh, "wait_seconds": "0"}, "wait_seconds"),
            ("acquire_lock", {**fresh, "lease_second": 5}, "lease_second"),  # a typo is not ignored
            ("acquire_lock", {**fresh, "lock_name": "a" * 129}, "lock_name"),
            ("acquire_lock", {**fresh, "repo": "r" * 201}, "repo"),
            ("acquire_lock", {**fresh, "lock_name": 42}, "lock_name"),
            ("acquire_lock", {**fresh, "request_uuid": "{" + str(uuid.uuid4()) + "}"}, "request_uuid"),
            ("heartbeat_lock_ticket", {**ref, "lease_seconds": True}, "lease_seconds"),
            ("heartbeat_lock_ticket", {**ref, "lease_seconds": "120"}, "lease_seconds"),
            ("heartbeat_lock_ticket", {**ref, "lease_seconds": 0.1}, "lease_seconds"),
            ("get_lock_ticket", {**ref, "extra": 1}, "extra"),
            ("release_lock_ticket", {**ref, "force": True}, "force"),
            ("update_user_activity", {"activity": "x" * 1001}, "activity"),
            ("update_user_activity", {"clear": "true"}, "clear"),
            ("update_user_activity", {"clear": 1}, "clear"),
            ("list_locks", {"lock_name": "a" * 129}, "lock_name"),
            ("list_locks", {"scope": "default"}, "scope"),
            ("verify_token", {"token_file": held["token_file"], "token": "x"}, "token"),
        ]
        for tool, arguments, needle in cases:
            message = await c.error(tool, **arguments)
            # Refused by the input schema, in one line naming that one argument and nothing else.
            assert needle in message and "also check" not in message, (tool, arguments, message)
            assert "\n" not in message and "pydantic" not in message and "https://" not in message, message

        # The session goes on, and nothing was taken or changed by the refused calls.
        got = await c.call("get_lock_ticket", **ref)
        assert (got["state"], got["fence"]) == ("held", 1)
        assert got["lease_expires_at"] == held["lease_expires_at"]  # no refused heartbeat renewed it
        locks = await c.call("list_locks", repo=SEED["repo"])
        assert [lk["lock_name"] for lk in locks] == [SEED["lock_name"]]
        assert (await c.call("heartbeat_lock_ticket", **ref, lease_seconds=MIN_LEASE_SECONDS + 60))["state"] == "held"
        assert (await c.call("update_user_activity", activity="a" * 1000))["activity"] == "a" * 1000
        assert (await c.call("update_user_activity", clear=True))["activity"] is None
    assert "Traceback" not in (tmp_path / "server.stderr").read_text()


async def test_an_unknown_lock_is_named_in_the_error(server_args: list[str], tmp_path: Path, agents: set[int]) -> None:
    async with serve(tmp_path, agents, *server_args) as c:
        await c.acquire()  # the seed's lock exists; 'other' does not
        ref = {"repo": SEED["repo"], "lock_name": "other", "ticket_id": str(uuid.uuid4())}
        message = await c.error("get_lock_ticket", **ref)
        assert "'other'" in message, message


# -- verify_token ----------------------------------------------------------------------------


async def test_verify_token_is_live_while_held_and_refused_after_release(
    server_args: list[str], tmp_path: Path, agents: set[int]
) -> None:
    async with serve(tmp_path, agents, *server_args) as c:
        held = await c.acquire()
        verdict = await c.call("verify_token", token_file=held["token_file"])
        assert verdict["ok"] is True
        assert (verdict["ticket_id"], verdict["fence"]) == (held["ticket_id"], held["fence"])
        assert (verdict["lock_name"], verdict["repo"]) == (SEED["lock_name"], SEED["repo"])

        await c.call("release_lock_ticket", repo=SEED["repo"], lock_name=SEED["lock_name"], ticket_id=held["ticket_id"])
        verdict = await c.call("verify_token", token_file=held["token_file"])
        assert verdict["ok"] is False and "ended" in verdict["reason"]

        forged = tmp_path / "forged.token"
        forged.write_text(json.dumps({"lock": SEED["lock_name"], "repo": SEED["repo"], "token": "0" * 64}))
        forged.chmod(0o600)
        verdict = await c.call("verify_token", token_file=str(forged))
        assert verdict["ok"] is False and verdict["reason"]


# -- a long-lived server -----------------------------------------------------------------------


def _server_pid(lock_dir: Path) -> int:
    """The pearing-mcp process serving ``lock_dir`` (stdio_client does not expose it)."""
    want = str(lock_dir).encode()
    for name in os.listdir("/proc"):
        if not name.isdigit():
            continue
        try:
            argv = Path(f"/proc/{name}/cmdline").read_bytes().split(b"\0")
        except OSError:
            continue
        if any(a.endswith(b"pearing-mcp") for a in argv) and want in argv:
            return int(name)
    pytest.fail(f"no pearing-mcp process for {lock_dir}")


async def test_many_calls_do_not_leak_file_descriptors(
    server_args: list[str], tmp_path: Path, agents: set[int]
) -> None:
    async with serve(tmp_path, agents, *server_args) as c:
        held = await c.acquire()
        ref = {"repo": SEED["repo"], "lock_name": SEED["lock_name"], "ticket_id": held["ticket_id"]}
        fd_dir = f"/proc/{_server_pid(tmp_path / 'lockdir')}/fd"
        await c.call("get_lock_ticket", **ref)
        before = len(os.listdir(fd_dir))
        for _ in range(40):
            await c.call("get_lock_ticket", **ref)
            await c.call("heartbeat_lock_ticket", **ref, lease_seconds=60)
            await c.call("list_locks", repo=SEED["repo"])
            await c.error("get_lock_ticket", **{**ref, "ticket_id": str(uuid.uuid4())})
        assert len(os.listdir(fd_dir)) <= before + 2


# -- the command line ------------------------------------------------------------------------


def _run(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [PEARING_MCP, *args], check=False, capture_output=True, text=True, timeout=30, env=env, stdin=subprocess.DEVNULL
    )


def test_version_and_bad_flags() -> None:
    r = _run("--version")
    assert r.returncode == 0 and r.stdout.startswith("pearing-mcp ")
    for args, needle in [
        (["--bogus"], "--bogus"),
        (["stray"], "stray"),
        (["--lock-dir"], "--lock-dir"),
        (["--lock-dir", ""], "lock dir"),
        (["--identity", "bad id"], "'bad id'"),
    ]:
        r = _run(*args)
        assert r.returncode == ExitCode.USAGE, (args, r)
        assert r.stdout == ""
        (line,) = r.stderr.splitlines()
        assert line.startswith("pearing-mcp: error: ") and needle in line, (args, line)


def test_the_sdk_is_imported_only_by_the_server() -> None:
    code = (
        "import sys, importlib, pkgutil, singleflight\n"
        "for m in pkgutil.walk_packages(singleflight.__path__, 'singleflight.'):\n"
        "    importlib.import_module(m.name)\n"
        "bad = sorted(n for n in sys.modules if n == 'mcp' or n.startswith(('mcp.', 'mcp_types')))\n"
        "assert not bad, bad\n"
    )
    r = subprocess.run([sys.executable, "-c", code], check=False, capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
