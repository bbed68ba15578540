"""pearing-mcp: a client that goes away takes its waiting ticket with it.

The server is driven over raw JSON-RPC on its stdin/stdout (the SDK's client would close
and then terminate the server itself, hiding whether the server notices on its own). It
runs with the test's environment (``procs``), so on its backend and lock dir.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import time
import uuid
from pathlib import Path
from typing import IO, Any

import pytest
from caps import Caps
from helpers import BIN_DIR, PEARING_CLI, Gate, Procs, lock_status, wait_for

from singleflight.core.const import ExitCode

PEARING_MCP = os.path.join(BIN_DIR, "pearing-mcp")
LONG_LEASE = 3600  # a waiter left behind would be promoted and keep the lock past any test


def _send(stdin: IO[bytes], msg: dict[str, Any]) -> None:
    stdin.write(json.dumps({"jsonrpc": "2.0", **msg}).encode() + b"\n")
    stdin.flush()


def _reply(stdout: IO[bytes], request_id: int) -> dict[str, Any]:
    while True:
        line = stdout.readline()
        assert line, "the server closed its stdout"
        msg = json.loads(line)
        if msg.get("id") == request_id:
            assert "result" in msg, msg
            result: dict[str, Any] = msg["result"]
            return result


def _server_waiting_in_acquire(procs: Procs, *, queued: bool = True) -> subprocess.Popen[bytes]:
    """A pearing-mcp with one acquire_lock call in flight (wait_seconds 30) behind the holder
    (``queued``: returned once its ticket shows as waiting)."""
    server = procs.start([PEARING_MCP, "--identity", "tester@mcp"], stdin=subprocess.PIPE)
    assert server.stdin is not None and server.stdout is not None
    hello = {"protocolVersion": "2025-06-18", "capabilities": {}, "clientInfo": {"name": "t", "version": "0"}}
    _send(server.stdin, {"id": 1, "method": "initialize", "params": hello})
    _reply(server.stdout, 1)
    _send(server.stdin, {"method": "notifications/initialized"})
    args = {"lock_name": "J", "request_uuid": str(uuid.uuid4()), "lease_seconds": LONG_LEASE, "wait_seconds": 30}
    _send(server.stdin, {"id": 2, "method": "tools/call", "params": {"name": "acquire_lock", "arguments": args}})
    if queued:
        wait_for(lambda: lock_status(procs, "J")["waiters"], 15, "the MCP acquire to queue")
    return server


def _adopted(procs: Procs, server: subprocess.Popen[bytes]) -> bool:
    """The waiting ticket is its agent's: its pid in it, no longer the server's that made it."""
    waiters = lock_status(procs, "J")["waiters"]
    return bool(waiters) and waiters[0].get("holder_pid") not in (None, server.pid)


@pytest.mark.parametrize("how", ["stdin-closed", "server-killed"])
def test_a_client_that_goes_away_takes_its_waiting_ticket_with_it(
    backend: str, procs: Procs, work: Path, how: str
) -> None:
    gate = Gate(work)
    holder = procs.pr("--job", "J", "--", "sh", "-c", gate.script())
    gate.wait_ready()
    server = _server_waiting_in_acquire(procs)
    assert server.stdin is not None
    # Its agent running: an owner gone before that is test_an_owner_gone_before_its_agent_starts.
    wait_for(lambda: _adopted(procs, server), 15, "the agent to take the waiting ticket")
    if how == "stdin-closed":
        server.stdin.close()  # the client is gone: the server must notice, end the wait and exit
        server.stdin = None  # closed: nothing left for communicate() to flush
        assert procs.finish(server, timeout=10).returncode == 0
    else:
        server.send_signal(signal.SIGKILL)
        assert procs.finish(server, timeout=10).returncode == -signal.SIGKILL
    wait_for(lambda: not lock_status(procs, "J")["waiters"], 5, "the client's waiting ticket to go")
    gate.open()
    assert procs.finish(holder).returncode == 0
    # Nobody was promoted for the client that left: the lock is free for a run that does not wait.
    wait_for(lambda: lock_status(procs, "J")["holder"] is None, 5, "the lock to be free")
    r = procs.pr_run("--job", "J", "--", "true")
    assert r.returncode == 0, r


@pytest.mark.parametrize("behind", ["a holder", "nobody"])
def test_an_owner_gone_before_its_agent_starts_leaves_no_ticket_behind(
    backend: str, procs: Procs, work: Path, behind: str
) -> None:
    """The owner (here pearing-mcp; pearing-cli and ``Lock`` take the same path) dies after making
    its waiting ticket and before spawning the agent that answers for it. Its ticket leaves the
    line within the SPEC's 5 s: on etcd and PostgreSQL its place is a short lease (3 s) that the
    owner keeps until its agent takes the ticket over; the lock dir judges it by its pid.

    Once a bug there: the ticket was made on its own lease (here an hour) and, with no agent to
    move it onto a short place, waited that long, holding the line once at its head. Seen as a
    flaky CI failure of the test above (the server killed as soon as its ticket showed)."""
    gate = Gate(work)
    holder = procs.pr("--job", "J", "--", "sh", "-c", gate.script()) if behind == "a holder" else None
    if holder is not None:
        gate.wait_ready()
    paused = work / "spawn.go"
    procs.env.update(PEARING_FAULT="pause-agent-spawn", PEARING_FAULT_GATE=str(paused))
    server = _server_waiting_in_acquire(procs, queued=holder is not None)
    del procs.env["PEARING_FAULT"], procs.env["PEARING_FAULT_GATE"]
    wait_for(lambda: list(work.glob("spawn.go.*")), 15, "the server to stop before the agent's spawn")
    # Its ticket shows; at the head of the line (behind nobody) it keeps everyone out while it stands.
    st = lock_status(procs, "J")
    assert st["waiters"] or st["holder"], st
    server.send_signal(signal.SIGKILL)
    assert procs.finish(server, timeout=10).returncode == -signal.SIGKILL
    if holder is None:
        wait_for(lambda: procs.pr_run("--job", "J", "--", "true").returncode == 0, 6, "the lock to be free")
        return
    try:
        # The SPEC's bound for a dead waiter (5 s), and a second for the look.
        wait_for(lambda: not lock_status(procs, "J")["waiters"], 6, "the ownerless ticket to go")
    finally:
        gate.open()
        assert procs.finish(holder).returncode == 0


def test_an_owner_frozen_before_its_agent_starts_loses_its_place_or_keeps_it_whole(
    backend: str, caps: Caps, procs: Procs, work: Path
) -> None:
    """An owner (pearing-cli acquire-lock here) frozen between making its ticket and spawning its
    agent, for longer than a place lasts unrenewed (3 s). On etcd and PostgreSQL its place lapses:
    resumed, it says so (exit 1, "expired") and leaves the lock free. The lock dir judges the ticket
    by its live process, which keeps it: resumed, it holds. Never stuck, never two holders."""
    paused = work / "spawn.go"
    env = dict(procs.env, PEARING_FAULT="pause-agent-spawn", PEARING_FAULT_GATE=str(paused))
    argv = [PEARING_CLI, "acquire-lock", "J", "--request-uuid", str(uuid.uuid4()), "--lease-seconds", "30"]
    owner = procs.start(argv, env=env)
    wait_for(lambda: list(work.glob("spawn.go.*")), 15, "the owner to stop before the agent's spawn")
    frozen_until = time.monotonic() + 4.0  # the freeze itself: past a place's 3 s
    st = lock_status(procs, "J")
    assert st["waiters"] or st["holder"], st  # its ticket, at the head of the line

    def gone() -> bool:
        st = lock_status(procs, "J")
        return not st["waiters"] and st["holder"] is None

    if caps.shared_by_hosts:
        wait_for(gone, 6, "the unrenewed place to lapse")
    wait_for(lambda: time.monotonic() > frozen_until, 10, "the freeze to last past a place's 3 s")
    paused.touch()
    r = procs.finish(owner, timeout=30)
    if caps.shared_by_hosts:
        assert r.returncode == ExitCode.REFUSED, r
        assert json.loads(r.stdout)["state"] == "expired", r
        assert procs.pr_run("--job", "J", "--", "true").returncode == 0
    else:
        assert r.returncode == 0 and json.loads(r.stdout)["state"] == "held", r
        assert procs.pr_run("--job", "J", "--", "true").returncode == ExitCode.BUSY
