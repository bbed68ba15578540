"""The public Python API, ``from singleflight import Busy, LeaseLost, Lock``, on both backends.

Each scenario runs in a real Python process (started through ``procs``, so it carries the
test's backend and lock dir and is reaped at the end) and prints one JSON line per fact.
"""

from __future__ import annotations

import json
import sys
import textwrap
from pathlib import Path
from typing import Any

import pytest
from helpers import PEARING_CLI, PEARING_GUARD, Gate, Procs, get_ticket, lock_status, q, wait_for, wait_queued

from singleflight.core.const import ExitCode

PRELUDE = """
import json, os, subprocess, sys, time
from singleflight import Busy, LeaseLost, Lock

def say(**kw):
    print(json.dumps(kw), flush=True)

def verify(path):
    return subprocess.run([{guard!r}, "verify", "--token-file", path], capture_output=True).returncode
"""


def script(body: str) -> list[str]:
    code = PRELUDE.format(guard=PEARING_GUARD) + textwrap.dedent(body)
    return [sys.executable, "-c", code]


def facts(out: bytes) -> list[dict[str, Any]]:
    return [json.loads(line) for line in out.decode().splitlines() if line.startswith("{")]


def test_import_is_cheap_and_public() -> None:
    import singleflight

    assert {"Busy", "LeaseLost", "Lock"} <= set(singleflight.__all__)
    from singleflight import Busy, LeaseLost, Lock

    assert issubclass(Busy, Exception) and issubclass(LeaseLost, Exception) and callable(Lock)
    # The errors a caller catches are exported, and a bad value is the builtin that fits.
    from singleflight import BadValue, NotHeld, PearingError, StaleFence, Thread, UsageError

    assert issubclass(BadValue, ValueError) and issubclass(UsageError, ValueError)
    assert all(issubclass(e, PearingError) for e in (BadValue, NotHeld, StaleFence, UsageError, Busy, LeaseLost))
    with pytest.raises(ValueError, match="lock name"):
        Lock("bad name")
    assert callable(Thread)


def test_the_package_says_it_is_typed() -> None:
    """PEP 561: ``mypy --strict`` on a user's code reads our annotations."""
    import importlib.resources

    assert importlib.resources.files("singleflight").joinpath("py.typed").is_file()


def test_fence_rises_across_two_blocks_and_the_token_is_live_only_inside(backend: str, procs: Procs) -> None:
    r = procs.run(
        script("""
            for _ in range(2):
                with Lock("J", lease_seconds=5) as held:
                    say(fence=held.fence, ticket=held.ticket_id, promoted=held.promoted, inside=verify(held.token_file))
                say(after=verify(held.token_file), token_file_left=os.path.exists(held.token_file))
        """),
        timeout=60,
    )
    assert r.returncode == 0, r
    first, after1, second, after2 = facts(r.stdout)
    assert first["inside"] == 0 and second["inside"] == 0
    assert after1 == after2 == {"after": 1, "token_file_left": False}
    assert second["fence"] > first["fence"] >= 1
    assert first["ticket"] != second["ticket"]
    assert first["promoted"] is False


def test_busy_when_the_wait_runs_out_and_nothing_is_left_behind(backend: str, procs: Procs, work: Path) -> None:
    gate = Gate(work)
    holder = procs.pr("--job", "J", "--", "sh", "-c", gate.script())
    gate.wait_ready()
    r = procs.run(
        script("""
            t0 = time.monotonic()
            try:
                with Lock("J", wait_seconds=1):
                    say(ran=True)
            except Busy as exc:
                say(busy=True, state=exc.ticket["state"], kept=exc.kept, code=int(exc.exit_code),
                    waited=time.monotonic() - t0)
        """),
        timeout=60,
    )
    assert r.returncode == 0, r
    (fact,) = facts(r.stdout)
    # Not kept (no request uuid of the caller's): cancelled, and Busy says so, not "waiting".
    assert fact["busy"] and fact["state"] == "cancelled" and fact["kept"] is False
    assert fact["code"] == ExitCode.BUSY
    assert 0.9 <= fact["waited"] < 10
    # Without a request uuid of the caller's the place is cancelled: no waiter remains.
    status = procs.run_text([PEARING_CLI, "status", "J", "--json"]).json
    assert status[0]["waiters"] == []
    gate.open()
    assert procs.finish(holder).returncode == 0
    assert procs.pr_run("--job", "J", "--", "true").returncode == 0


def test_a_waiter_is_promoted_with_a_larger_fence(backend: str, procs: Procs, work: Path) -> None:
    gate = Gate(work)
    holder = procs.pr("--job", "J", "--", "sh", "-c", f"echo $PEARING_FENCE > {q(work / 'f1')}; {gate.script()}")
    gate.wait_ready()
    waiter = procs.start(
        script("""
            with Lock("J", wait_seconds=30) as held:
                say(fence=held.fence, promoted=held.promoted, inside=verify(held.token_file))
        """)
    )
    # In its place in line, not only recorded: status numbers a waiting ticket whose agent is
    # still starting too, and that agent would find the lock free and take it unpromoted.
    wait_queued(procs, "J", 1)
    (waiter_ticket,) = lock_status(procs, "J")["waiters"]
    wait_for(lambda: get_ticket(procs, "J", waiter_ticket["ticket_id"])["queue_position"] == 1, 15, "its place")
    gate.open()
    assert procs.finish(holder).returncode == 0
    r = procs.finish(waiter, timeout=60)
    assert r.returncode == 0, r
    (fact,) = facts(r.stdout)
    assert fact["promoted"] is True and fact["inside"] == 0
    assert fact["fence"] > int((work / "f1").read_text())


def test_auto_heartbeat_keeps_the_lease_past_its_length(backend: str, procs: Procs) -> None:
    r = procs.run(
        script("""
            with Lock("J", lease_seconds=2) as held:
                deadline = time.monotonic() + 5
                while time.monotonic() < deadline:
                    assert verify(held.token_file) == 0, "lease lost under auto heartbeat"
                    time.sleep(0.2)
                held.heartbeat()
                say(alive=verify(held.token_file))
        """),
        timeout=60,
    )
    assert r.returncode == 0, r
    assert facts(r.stdout) == [{"alive": 0}]


def test_manual_heartbeat_after_the_lease_ran_out_raises_lease_lost(backend: str, procs: Procs) -> None:
    r = procs.run(
        script("""
            with Lock("J", lease_seconds=2, heartbeat="manual") as held:
                held.heartbeat()
                deadline = time.monotonic() + 20
                while verify(held.token_file) == 0 and time.monotonic() < deadline:
                    time.sleep(0.05)
                try:
                    held.heartbeat()
                    say(lost=False)
                except LeaseLost as exc:
                    say(lost=True, code=int(exc.exit_code))
                try:
                    with held.guarded():
                        say(guarded_ran=True)
                except LeaseLost:
                    say(guarded_refused=True)
        """),
        timeout=60,
    )
    assert r.returncode == 0, r
    assert facts(r.stdout) == [{"lost": True, "code": ExitCode.LEASE_LOST}, {"guarded_refused": True}]
    # The lock is free again for others.
    assert procs.pr_run("--job", "J", "--", "true").returncode == 0


def test_guarded_runs_the_block_while_held(backend: str, procs: Procs, work: Path) -> None:
    r = procs.run(
        script(f"""
            with Lock("J", lease_seconds=5) as held:
                with held.guarded() as verdict:
                    open({str(work / "side-effect")!r}, "w").write(str(verdict.fence))
                say(fence=held.fence)
        """),
        timeout=60,
    )
    assert r.returncode == 0, r
    (fact,) = facts(r.stdout)
    assert (work / "side-effect").read_text() == str(fact["fence"])


def test_a_process_that_dies_inside_the_block_frees_the_lock(backend: str, procs: Procs, work: Path) -> None:
    p = procs.start(
        script(f"""
            with Lock("J", lease_seconds=30) as held:
                open({str(work / "in")!r}, "w").write("1")
                os.kill(os.getpid(), 9)
        """)
    )
    assert procs.finish(p, timeout=60).returncode == -9
    assert (work / "in").exists()
    # The agent saw its owner die and released: long before the 30 s lease would run out.
    r = procs.pr_run("--job", "J", "--wait-seconds", "15", "--", "true")
    assert r.returncode == 0 and r.elapsed < 15, r


def test_acquire_and_release_without_a_with_block(backend: str, procs: Procs, work: Path) -> None:
    """``acquire(timeout=)`` / ``release()`` as threading.Lock and filelock have them: the
    same lock as ``with``, Busy when the timeout runs out, a release only of a held lock."""
    step, go = work / "step", work / "go"
    p = procs.start(
        script(f"""
            from singleflight import UsageError
            lock = Lock("J", lease_seconds=30)
            try:
                lock.release()
            except UsageError as exc:
                say(unheld="not held" in str(exc))
            held = lock.acquire()
            say(fence=held.fence, held=lock.held, inside=verify(held.token_file))
            lock.release()
            say(held=lock.held, after=verify(held.token_file))
            again = lock.acquire(timeout=0)
            say(fence=again.fence)
            lock.release()
            open({str(step)!r}, "w").close()
            while not os.path.exists({str(go)!r}):
                time.sleep(0.01)
            t0 = time.monotonic()
            try:
                lock.acquire(timeout=1)
            except Busy as busy:
                say(busy=busy.ticket["state"], waited=round(time.monotonic() - t0, 1) >= 0.9, held=lock.held)
        """)
    )
    wait_for(step.exists, 60, "the script's first three steps")
    gate = Gate(work)
    holder = procs.pr("--job", "J", "--", "sh", "-c", gate.script())
    gate.wait_ready()
    go.touch()
    r = procs.finish(p, timeout=60)
    gate.open()
    assert procs.finish(holder).returncode == 0
    assert r.returncode == 0, r
    unheld, first, after, second, busy = facts(r.stdout)
    assert unheld == {"unheld": True}
    assert first["held"] is True and first["inside"] == 0 and after == {"held": False, "after": 1}
    assert second["fence"] > first["fence"]
    assert busy == {"busy": "cancelled", "waited": True, "held": False}


def test_async_lock_waits_without_blocking_the_loop_and_a_cancelled_wait_leaves_the_line(
    backend: str, procs: Procs, work: Path
) -> None:
    gate = Gate(work)
    holder = procs.pr("--job", "J", "--", "sh", "-c", gate.script())
    gate.wait_ready()
    queued = work / "queued"
    p = procs.start(
        script(f"""
            import asyncio
            from singleflight import AsyncLock

            async def main():
                for own in (None, "11111111-2222-4333-8444-555555555555"):
                    waiter = asyncio.create_task(AsyncLock("J", wait_seconds=60, request_uuid=own).__aenter__())
                    go, polls = {str(queued)!r} + str(own is not None), 0
                    # This loop runs while the waiter waits: a wait that blocked the event loop
                    # would stop it (and the test would time out).
                    while not os.path.exists(go):  # the test sees it in line, then says go
                        await asyncio.sleep(0.01)
                        polls += 1
                    waiter.cancel()
                    try:
                        await waiter
                    except asyncio.CancelledError:
                        say(cancelled=True, loop_ran=polls > 0)
                    while not os.path.exists(go + ".next"):  # the test saw the line empty
                        await asyncio.sleep(0.01)

            asyncio.run(main())
        """)
    )
    for kept in ("False", "True"):
        wait_queued(procs, "J", 1, timeout=30)  # the async waiter is in line
        (work / f"queued{kept}").touch()  # now it is cancelled
        wait_for(lambda: not lock_status(procs, "J")["waiters"], 5, "the cancelled waiter to leave the line")
        (work / f"queued{kept}.next").touch()
    r = procs.finish(p, timeout=60)
    assert r.returncode == 0, r
    assert facts(r.stdout) == [{"cancelled": True, "loop_ran": True}] * 2, r
    gate.open()
    assert procs.finish(holder).returncode == 0
    ok = procs.run(
        script("""
            import asyncio
            from singleflight import AsyncLock

            async def main():
                async with AsyncLock("J", lease_seconds=30) as held:
                    say(fence=held.fence, inside=verify(held.token_file))
                say(after=verify(held.token_file))

            asyncio.run(main())
        """),
        timeout=60,
    )
    assert ok.returncode == 0, ok
    inside, after = facts(ok.stdout)
    assert inside["inside"] == 0 and inside["fence"] > 0 and after == {"after": 1}
