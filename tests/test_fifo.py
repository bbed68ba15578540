"""FIFO is one rule for every way in: pearing-run, and the agent behind pearing-cli / pearing-mcp / Lock."""

from __future__ import annotations

import json
import os
import signal
import uuid
from pathlib import Path

from helpers import PEARING_CLI, Gate, Procs, q, wait_for

from singleflight.core.const import ExitCode


def _waiters(procs: Procs, job: str) -> int:
    out = procs.run_text([PEARING_CLI, "status", job, "--json"])
    locks = json.loads(out.stdout or "[]")
    return len(locks[0]["waiters"]) if locks else 0


def test_a_frozen_head_waiter_keeps_its_turn_against_a_cli_acquisition(backend: str, procs: Procs, work: Path) -> None:
    """The head waiter is between its wake-up and its flock (frozen here with SIGSTOP) when the
    lock is released; a pearing-cli acquire-lock arriving then queues behind it, and the head
    waiter runs first."""
    gate = Gate(work)
    holder = procs.pr("--job", "J", "--", "sh", "-c", gate.script())
    gate.wait_ready()
    log = work / "head.log"
    with open(log, "wb") as err:
        head = procs.pr(
            "-v", "--job", "J", "--wait-seconds", "60", "--",
            "sh", "-c", f"echo $PEARING_FENCE > {q(work / 'head.fence')}",
            stderr=err,
        )  # fmt: skip
    # Its "waiting" line, not the line in status: status lists it as soon as it has joined, while
    # it is still inside the lock dir's record mutex, and stopped there it would hold every other
    # process of the lock out (docs/faults.md) until it is continued (CI once: 30 s, the holder's end).
    wait_for(lambda: b"waiting lock=J" in log.read_bytes(), 15, "the head waiter to queue")
    assert _waiters(procs, "J") == 1
    os.kill(head.pid, signal.SIGSTOP)
    try:
        gate.open()
        assert procs.finish(holder).returncode == 0
        # The lock is free now, and the head of the line cannot take it while frozen.
        cli = procs.run_text([
            PEARING_CLI, "acquire-lock", "J", "--request-uuid", str(uuid.uuid4()),
            "--lease-seconds", "30", "--wait-seconds", "0",
        ])  # fmt: skip
    finally:
        os.kill(head.pid, signal.SIGCONT)
    assert cli.returncode == ExitCode.BUSY, cli
    ticket = cli.json
    assert ticket["state"] == "waiting" and ticket["queue_position"] >= 1
    r = procs.finish(head, timeout=60)
    assert r.returncode == 0, r
    head_fence = int((work / "head.fence").read_text())
    # The CLI ticket is promoted after the head waiter: a larger fence.
    got = wait_for(
        lambda: (
            t
            if (t := procs.run_text([PEARING_CLI, "get-lock-ticket", "J", ticket["ticket_id"]]).json)["state"] == "held"
            else None
        ),
        15,
        "the CLI ticket to be promoted",
    )
    assert got["fence"] > head_fence
    rel = procs.run_text([PEARING_CLI, "release-lock-ticket", "J", ticket["ticket_id"]])
    assert rel.returncode == 0 and rel.json["state"] == "released", rel
