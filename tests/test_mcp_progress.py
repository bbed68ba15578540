"""pearing-mcp: acquire_lock sends progress notifications while it waits in line, and none after (issue 26).

The SDK's client asks for progress with ``call_tool(progress_callback=...)`` (its request id as
the progressToken). Every progress notification the session receives is also seen by its
``message_handler``, including one that would come after the result (the callback stops with
the request), so that is where "none after the result" is counted.
"""

from __future__ import annotations

import contextlib
import json
import re
import time
import uuid
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import anyio
import pytest
import test_mcp
from mcp import ClientSession, StdioServerParameters, stdio_client, types
from test_mcp import IDENTITY, PEARING_MCP, SEED, Client, _until

from singleflight.cli.mcp_progress import PROGRESS_SECONDS

pytestmark = pytest.mark.anyio
anyio_backend = test_mcp.anyio_backend
agents = test_mcp.agents
server_args = test_mcp.server_args

WAITING = re.compile(r"^waiting: (position 1 in line|joining the line), \d+ s of (\d+) s$")


class Seen:
    """Every progress notification the session received, and how many had come when a result did."""

    def __init__(self) -> None:
        self.notes: list[types.ProgressNotificationParams] = []

    async def handler(self, message: Any) -> None:
        if isinstance(message, types.ProgressNotification):
            self.notes.append(message.params)


@contextlib.asynccontextmanager
async def serve_seeing(tmp_path: Path, agents: set[int], seen: Seen, *extra: str) -> AsyncIterator[Client]:
    """test_mcp's ``serve`` with a session whose message handler records progress."""
    params = StdioServerParameters(
        command=PEARING_MCP,
        args=["--lock-dir", str(tmp_path / "lockdir"), "--identity", IDENTITY, *extra],
        cwd=str(tmp_path),
    )
    with (tmp_path / "server.stderr").open("w") as errlog:
        async with (
            stdio_client(params, errlog=errlog) as (read, write),
            ClientSession(read, write, message_handler=seen.handler) as session,
        ):
            await session.initialize()
            client = Client(session, agents)
            try:
                yield client
            finally:
                with anyio.move_on_after(20, shield=True), contextlib.suppress(Exception):
                    await client.release_all()


async def _wait_with_progress(c: Client, seen: Seen, wait_seconds: float) -> tuple[dict[str, Any], list[Any], int]:
    """acquire_lock with a progressToken: its ticket, the (progress, total, message) its callback got,
    and how many notifications the session had seen when the result came."""
    got: list[tuple[float, float | None, str | None]] = []

    async def on_progress(progress: float, total: float | None, message: str | None) -> None:
        got.append((progress, total, message))

    args = {**SEED, "request_uuid": str(uuid.uuid4()), "wait_seconds": wait_seconds}
    result = await c.session.call_tool("acquire_lock", args, progress_callback=on_progress)
    at_result = len(seen.notes)
    assert not result.is_error, result
    ticket: dict[str, Any] = json.loads("".join(b.text for b in result.content if b.type == "text"))
    c._track(ticket)
    return ticket, got, at_result


def _check_notes(got: list[Any], wait_seconds: float) -> None:
    """Readable, on the cadence's clock, with a progress that only grows and never passes the total."""
    progress = [p for p, _, _ in got]
    assert progress == sorted(progress) and len(set(progress)) == len(progress), progress
    for p, total, message in got:
        match = WAITING.match(message or "")
        assert match, message
        assert total == wait_seconds and int(match[2]) == wait_seconds, (total, message)
        assert 0 < p < wait_seconds, p
    assert any("position 1 in line" in (m or "") for _, _, m in got), got


async def _nothing_more(seen: Seen, at_result: int) -> None:
    """No notification after the result: a reporter left running would send the next one within
    PROGRESS_SECONDS, so the session is watched for more than two of them. The absence of a
    message can only be shown by waiting; this waits for nothing else."""
    await anyio.sleep(2.5 * PROGRESS_SECONDS)
    assert len(seen.notes) == at_result, seen.notes[at_result:]


async def test_a_wait_reports_progress_until_it_gets_the_lock_and_none_after(
    server_args: list[str], tmp_path: Path, agents: set[int]
) -> None:
    seen = Seen()
    async with serve_seeing(tmp_path, agents, seen, *server_args) as c:
        held = await c.acquire()
        ref = {"repo": SEED["repo"], "lock_name": SEED["lock_name"], "ticket_id": held["ticket_id"]}
        out: dict[str, Any] = {}

        async def wait_in_line() -> None:
            out["ticket"], out["got"], out["at_result"] = await _wait_with_progress(c, seen, 60)

        async def two_notes() -> bool:
            return len(seen.notes) >= 2

        with anyio.fail_after(60):
            async with anyio.create_task_group() as tg:
                tg.start_soon(wait_in_line)
                await _until(two_notes, "two progress notifications", timeout=30)
                assert not out, "the acquire returned before the lock was released"
                await c.call("release_lock_ticket", **ref)
        assert out["ticket"]["state"] == "held" and out["ticket"]["fence"] > held["fence"]
        # None after the result: the reporter is cancelled as the wait returns, whatever it returns
        # (the next test watches for a late one after a wait that ran out).
        assert len(seen.notes) == out["at_result"], seen.notes[out["at_result"] :]
        assert len(out["got"]) >= 2  # the callback's, all of them before the result (it ends with the request)
        _check_notes(out["got"], 60)


async def test_a_wait_that_runs_out_reports_within_it_and_none_after(
    server_args: list[str], tmp_path: Path, agents: set[int]
) -> None:
    seen = Seen()
    async with serve_seeing(tmp_path, agents, seen, *server_args) as c:
        await c.acquire()
        wait = 3 * PROGRESS_SECONDS - 1  # room for two notifications, not for a third
        started = time.monotonic()
        ticket, got, at_result = await _wait_with_progress(c, seen, wait)
        assert ticket["state"] == "waiting" and time.monotonic() - started >= wait
        await _nothing_more(seen, at_result)
        assert len(got) == 2, got
        _check_notes(got, wait)
