"""pearing-mcp: a bad tool argument is one sentence naming the argument and what it must be (issue 26).

One test per kind of bad argument, each a real call through the SDK's client (``serve`` of
test_mcp.py). A value pearing-cli can be given too is refused in pearing-cli's words: the rule
after the value is the same line, run through the real ``pearing-cli``. Never pydantic's dump
(several lines, ``[type=...]``, a link per error).
"""

from __future__ import annotations

import os
import subprocess
import uuid
from pathlib import Path
from typing import Any

import pytest
import test_mcp
from helpers import BIN_DIR
from test_mcp import SEED, Client, serve

from singleflight.core.const import ExitCode

PEARING_CLI = os.path.join(BIN_DIR, "pearing-cli")

pytestmark = pytest.mark.anyio
anyio_backend = test_mcp.anyio_backend
agents = test_mcp.agents


async def _sentence(c: Client, tool: str, **arguments: Any) -> str:
    """The error of a refused call, checked to be one sentence; without the SDK's tool prefix."""
    message = await c.error(tool, **arguments)
    assert "\n" not in message, f"one line expected: {message!r}"
    for dump in ("pydantic", "https://", "validation error", "[type=", "input_value", "Arguments"):
        assert dump not in message, message
    prefix = f"Error executing tool {tool}: "  # the SDK's, on every tool error
    assert message.startswith(prefix), message
    return message[len(prefix) :]


def _cli_rule(env: dict[str, str], *argv: str) -> str:
    """What pearing-cli says a bad value must be: its error line after the value."""
    r = subprocess.run(
        [PEARING_CLI, *argv], check=False, capture_output=True, text=True, timeout=30, env=env, stdin=subprocess.DEVNULL
    )
    assert r.returncode == ExitCode.USAGE, r
    (line,) = r.stderr.splitlines()
    return line.split("': ", 1)[1]


def _fresh(**overrides: Any) -> dict[str, Any]:
    return {**SEED, "request_uuid": str(uuid.uuid4()), "wait_seconds": 0, **overrides}


async def test_a_value_of_the_wrong_json_type_says_the_type_it_must_be(tmp_path: Path, agents: set[int]) -> None:
    cases: list[tuple[str, dict[str, Any], str]] = [
        (
            "acquire_lock",
            _fresh(lease_seconds="60"),
            "bad lease_seconds '60': must be a JSON number of seconds, at least 0.5, not a string",
        ),
        (
            "acquire_lock",
            _fresh(wait_seconds=True),
            "bad wait_seconds true: must be a JSON number of seconds, 0 or more, not a boolean",
        ),
        (
            "acquire_lock",
            _fresh(lock_name=42),
            "bad lock_name 42: must be a lock name matching ^[A-Za-z0-9][A-Za-z0-9._-]{0,127}$, not a number",
        ),
        ("update_user_activity", {"clear": "true"}, "bad clear 'true': must be true or false, not a string"),
        (
            "get_thread_tree",
            {"repo": "r", "thread": "42"},
            "bad thread '42': must be a JSON integer, the thread number, like 42, not a string",
        ),
        (
            "create_reply",
            {"repo": "r", "thread": 1, "kind": "note", "body": "x", "links": "branch:b"},
            "bad links 'branch:b': must be a JSON array of KIND:TARGET strings, "
            'like ["branch:codex/thread-42"], not a string',
        ),
        (
            "heartbeat_lock_ticket",
            {"repo": "r", "lock_name": "L", "ticket_id": str(uuid.uuid4()), "lease_seconds": None},
            "bad lease_seconds null: must be a JSON number of seconds, at least 0.5, not null",
        ),
    ]
    async with serve(tmp_path, agents) as c:
        for tool, arguments, said in cases:
            assert await _sentence(c, tool, **arguments) == said


async def test_a_number_out_of_range_is_refused_in_pearing_cli_words(
    tmp_path: Path, agents: set[int], env: dict[str, str]
) -> None:
    u = str(uuid.uuid4())
    cases: list[tuple[str, dict[str, Any], str, list[str]]] = [
        (
            "acquire_lock",
            _fresh(lease_seconds=0.4),
            "lease_seconds 0.4",
            f"acquire-lock L --request-uuid {u} --lease-seconds 0.4".split(),
        ),
        (
            "acquire_lock",
            _fresh(wait_seconds=10**12),
            "wait_seconds 1000000000000",
            f"acquire-lock L --request-uuid {u} --wait-seconds {10**12}".split(),
        ),
        (
            "heartbeat_lock_ticket",
            {"repo": "r", "lock_name": "L", "ticket_id": u, "lease_seconds": 0},
            "lease_seconds 0",
            f"heartbeat-lock-ticket L {u} --lease-seconds 0".split(),
        ),
        ("get_thread_tree", {"repo": "r", "thread": 0}, "thread 0", ["get-thread-tree", "r", "0"]),
        (
            "create_reply",
            {"repo": "r", "thread": 1, "kind": "note", "body": "x", "fence": 0},
            "fence 0",
            ["create-reply", "r", "1", "--kind", "note", "--body", "x", "--fence", "0"],
        ),
    ]
    async with serve(tmp_path, agents) as c:
        for tool, arguments, named, argv in cases:
            assert await _sentence(c, tool, **arguments) == f"bad {named}: {_cli_rule(env, *argv)}"


async def test_a_malformed_name_is_refused_in_pearing_cli_words(
    tmp_path: Path, agents: set[int], env: dict[str, str]
) -> None:
    u = str(uuid.uuid4())
    cases: list[tuple[str, dict[str, Any], str, list[str]]] = [
        ("acquire_lock", _fresh(lock_name="../x"), "lock_name '../x'", ["get-lock-ticket", "../x", u]),
        (
            "acquire_lock",
            _fresh(request_uuid="nope"),
            "request_uuid 'nope'",
            ["acquire-lock", "L", "--request-uuid", "nope"],
        ),
        (
            "get_lock_ticket",
            {"repo": "r", "lock_name": "L", "ticket_id": "nope"},
            "ticket_id 'nope'",
            ["acquire-lock", "L", "--request-uuid", "nope"],
        ),
        # '..' passes the schema's pattern and is refused by the tool itself: the same words.
        (
            "acquire_lock",
            _fresh(repo="../etc"),
            "repo '../etc'",
            f"acquire-lock L --request-uuid {u} --repo ../etc".split(),
        ),
        ("list_locks", {"repo": "/abs"}, "repo '/abs'", ["status", "--repo", "/abs"]),
        (
            "create_reply",
            {"repo": "r", "thread": 1, "kind": "Bad", "body": "x"},
            "kind 'Bad'",
            ["create-reply", "r", "1", "--kind", "Bad", "--body", "x"],
        ),
        ("update_user_activity", {"activity": ""}, "activity ''", ["update-user-activity", "--activity", "   "]),
    ]
    async with serve(tmp_path, agents) as c:
        for tool, arguments, named, argv in cases:
            assert await _sentence(c, tool, **arguments) == f"bad {named}: {_cli_rule(env, *argv)}"


async def test_an_overlong_value_is_echoed_cut_short(tmp_path: Path, agents: set[int]) -> None:
    async with serve(tmp_path, agents) as c:
        said = await _sentence(c, "acquire_lock", **_fresh(lock_name="a" * 10_000))
        assert said == f"bad lock_name '{'a' * 64}...': must match ^[A-Za-z0-9][A-Za-z0-9._-]{{0,127}}$"
        said = await _sentence(c, "update_user_activity", activity="x" * 1001)
        assert said == f"bad activity '{'x' * 64}...': must be 1 to 1000 characters, not all blank"
        said = await _sentence(c, "create_reply", repo="r", thread=1, kind="note", body="x", links=["a:b"] * 33)
        assert said.startswith('bad links ["a:b", ') and said.endswith("...: must be a list of at most 32 links")
        assert len(said) < 200


async def test_an_unknown_argument_is_named_with_the_ones_the_tool_takes(tmp_path: Path, agents: set[int]) -> None:
    async with serve(tmp_path, agents) as c:
        said = await _sentence(c, "acquire_lock", **_fresh(lease_second=5))
        assert said == (
            "unknown argument 'lease_second' "
            "(acquire_lock takes repo, lock_name, request_uuid, lease_seconds, wait_seconds, max_waiting, slots)"
        )
        said = await _sentence(c, "list_locks", scope="default")
        assert said == "unknown argument 'scope' (list_locks takes repo, lock_name)"


async def test_a_missing_argument_says_what_to_give(tmp_path: Path, agents: set[int]) -> None:
    async with serve(tmp_path, agents) as c:
        said = await _sentence(c, "acquire_lock", lock_name="L")
        assert said == "missing argument request_uuid: give a UUID like 8-4-4-4-12 hex digits"
        said = await _sentence(c, "get_lock_ticket", repo="r", lock_name="L")
        assert (
            said
            == "missing argument ticket_id: give the ticket id acquire_lock returned, a UUID like 8-4-4-4-12 hex digits"
        )


async def test_several_bad_arguments_explain_the_first_and_name_the_rest(tmp_path: Path, agents: set[int]) -> None:
    async with serve(tmp_path, agents) as c:
        said = await _sentence(c, "acquire_lock", **_fresh(lease_seconds=0.1, wait_seconds=-1, bogus=1))
        assert said == "bad lease_seconds 0.1: must be at least 0.5 seconds; also check wait_seconds, bogus"
    assert "Traceback" not in (tmp_path / "server.stderr").read_text()
