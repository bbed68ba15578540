"""--slots N: at most N COMMANDs of a lock at once, each with a fence of its own (unique, rising
across slots) and a slot (PEARING_SLOT, 0..N-1) no other run holds at the same time."""

from __future__ import annotations

import json
import os
import signal
import sys
import uuid
from pathlib import Path

import pytest
from helpers import PEARING_CLI, PEARING_GUARD, PEARING_RUN, Gate, Procs, q, wait_for
from test_hardening import INTERVAL_CMD
from test_mcp import serve, server_args  # noqa: F401 - server_args is a fixture

from singleflight.cli._table import render
from singleflight.core.const import ExitCode
from singleflight.core.errors import SlotsMismatch
from singleflight.core.ticket import Ticket, check_slots

# Each COMMAND logs "RUN:SLOT:FENCE start T" and "... end T" (interval_cmd.py, CLOCK_MONOTONIC).
_NAMED = 'exec "$0" "$1" "$2" "$3:$PEARING_SLOT:$PEARING_FENCE" "$4"'


def _contender(log: Path, name: str, seconds: float) -> list[str]:
    return ["sh", "-c", _NAMED, sys.executable, INTERVAL_CMD, str(log), name, str(seconds)]


def _runs(log: Path) -> list[tuple[str, int, int, float, float]]:
    """(run, slot, fence, start, end) of every COMMAND that ran to its end."""
    stamps: dict[str, dict[str, float]] = {}
    for line in log.read_text().splitlines():
        name, what, stamp = line.split()
        stamps.setdefault(name, {})[what] = float(stamp)
    out = []
    for name, s in stamps.items():
        run, slot, fence = name.split(":")
        assert "end" in s, f"{name} never ended"
        out.append((run, int(slot), int(fence), s["start"], s["end"]))
    return out


def _most_at_once(runs: list[tuple[str, int, int, float, float]]) -> int:
    events = sorted([(r[3], 1) for r in runs] + [(r[4], -1) for r in runs])
    now = most = 0
    for _, step in events:  # an end before a start at the same instant
        now += step
        most = max(most, now)
    return most


def _status(procs: Procs, job: str) -> dict[str, object]:
    out = procs.run_text([PEARING_CLI, "status", job, "--json"])
    locks = json.loads(out.stdout or "[]")
    return dict(locks[0]) if locks else {}


def test_ten_contenders_on_three_slots(backend: str, procs: Procs, work: Path) -> None:
    log = work / "log"
    ps = [
        procs.pr("--job", "S", "--slots", "3", "--wait-seconds", "120", "--", *_contender(log, f"r{i}", 0.8))
        for i in range(10)
    ]
    results = [procs.finish(p, timeout=180) for p in ps]
    assert [r.returncode for r in results] == [0] * 10, [r for r in results if r.returncode]
    runs = _runs(log)
    assert sorted(r[0] for r in runs) == sorted(f"r{i}" for i in range(10))
    assert _most_at_once(runs) == 3, runs  # never more than 3, and 3 at some moment
    fences = [r[2] for r in runs]
    assert len(set(fences)) == 10, fences
    assert {r[1] for r in runs} <= {0, 1, 2}, runs
    for a in runs:
        for b in runs:
            if a is not b and a[1] == b[1]:
                assert a[4] <= b[3] or b[4] <= a[3], f"slot {a[1]} shared: {a} {b}"
                # One slot's runs follow each other: a later one has a larger fence.
                assert (a[2] < b[2]) == (a[3] < b[3]), (a, b)


def test_a_holder_killed_frees_its_slot(backend: str, procs: Procs, work: Path) -> None:
    """Both slots held; the wrapper, holder and COMMAND of one are killed with -9 at once; the
    waiter takes the freed slot (the same one) within the bounds of a one-slot lock."""
    log = work / "log"
    gates = [Gate(work, f"g{i}") for i in range(2)]
    flags = ("--job", "S", "--slots", "2", "--lease-seconds", "3")
    holders = []
    for i, g in enumerate(gates):
        note = f"echo $$ $PEARING_TICKET > {q(work / f'run{i}')}"
        holders.append(procs.pr(*flags, "--", "sh", "-c", f"{note}; {g.script()}"))
        g.wait_ready()
    waiter = procs.pr("-v", *flags, "--wait-seconds", "60", "--", *_contender(log, "w", 0))
    wait_for(lambda: len(_status(procs, "S").get("waiters") or []) == 1, 15, "the waiter to queue")
    held = _status(procs, "S")["holders"]
    assert isinstance(held, list) and len(held) == 2
    command, ticket = (work / "run0").read_text().split()
    victim = next(h for h in held if h["ticket_id"] == ticket)
    for pid in (holders[0].pid, int(victim["holder_pid"]), int(command)):
        os.kill(pid, signal.SIGKILL)
    r = procs.finish(waiter, timeout=30)
    assert r.returncode == 0, r
    assert any(" waiting " in x and " position=1 " in x for x in r.err_lines), r  # first behind 2 holders
    [(_, slot, fence, _, _)] = _runs(log)
    assert slot == victim["slot"] and fence > max(int(h["fence"]) for h in held), (slot, fence, held)
    gates[1].open()
    assert procs.finish(holders[1]).returncode == 0


@pytest.mark.parametrize("value", ["0", "-1", "1.5", "x", "100000", ""])
def test_bad_slots_are_usage_errors(backend: str, procs: Procs, lock_dir: Path, value: str) -> None:
    r = procs.run_text([PEARING_RUN, "--job", "S", "--slots", value, "--", "true"])
    assert r.returncode == ExitCode.USAGE, r
    assert r.one_line().startswith("pearing-run: error: bad --slots"), r
    assert not lock_dir.exists()


def test_the_largest_slots_value_runs(backend: str, procs: Procs) -> None:
    """--slots 1000, the most validation accepts: a run takes a slot and is done."""
    r = procs.run_text([PEARING_RUN, "--job", "S", "--slots", "1000", "--", "sh", "-c", 'echo "$PEARING_SLOT"'])
    assert r.returncode == 0 and r.stdout.strip() == "0", r


@pytest.mark.local_only("the lock dir keeps an fd on each slot file; etcd's slots are keys")
def test_slots_past_the_fd_limit_are_one_error_line_and_leave_nothing_held(procs: Procs) -> None:
    """A soft limit of 256 open files with --slots 1000: the store's one line naming the slot
    file it could not open, 73 (EMFILE), and nothing held: the next run under the usual limit
    takes the lock. (Documented in docs/choices.md: N slots need N fds at the head of the line.)"""
    argv = [PEARING_RUN, "--job", "S", "--slots", "1000", "--", "true"]
    low = procs.run_text(["sh", "-c", 'ulimit -n 256 && exec "$@"', "sh", *argv])
    assert low.returncode == ExitCode.CANTCREAT and "Too many open files" in low.one_line(), low
    assert "/slot." in low.one_line(), low
    assert procs.run_text(argv).returncode == 0


def test_a_run_with_other_slots_than_the_live_tickets_is_refused(backend: str, procs: Procs, work: Path) -> None:
    gate = Gate(work)
    holder = procs.pr("--job", "S", "--slots", "3", "--", "sh", "-c", gate.script())
    gate.wait_ready()
    for flags in (["--slots", "2"], [], ["--slots", "2", "--wait-seconds", "30"]):
        r = procs.run_text([PEARING_RUN, "--job", "S", *flags, "--", "true"])
        assert r.returncode == ExitCode.USAGE, (flags, r)
        n = flags[1] if flags else "1"
        assert r.one_line() == f"pearing-run: error: slots {n} differs from the 3 slot(s) the lock's live tickets use"
    ok = procs.run_text([PEARING_RUN, "--job", "S", "--slots", "3", "--", "true"])
    assert ok.returncode == 0, ok
    gate.open()
    assert procs.finish(holder).returncode == 0
    # Once no live ticket is left, the lock takes another number of slots.
    assert procs.run_text([PEARING_RUN, "--job", "S", "--", "true"]).returncode == 0


def test_every_holder_passes_the_guard_with_its_own_token(backend: str, procs: Procs, work: Path) -> None:
    """Three runs hold at once, each with a larger fence than the one before: each one's token is
    live (not "superseded" by the others'), and the idiom of a ledger per slot accepts each."""
    gates = [Gate(work, f"g{i}") for i in range(3)]
    ps = []
    for i, g in enumerate(gates):
        checks = (
            f"{q(PEARING_GUARD)} verify > {q(work / f'verify{i}')} 2>&1; echo $? >> {q(work / f'verify{i}')}; "
            f'{q(PEARING_GUARD)} fence --resource "res-$PEARING_SLOT" --fence "$PEARING_FENCE"'
            f" > /dev/null 2>&1; echo $? > {q(work / f'fence{i}')}"
        )
        # Checked once all three hold: the first run's fence is the lowest by then.
        ps.append(procs.pr("--job", "S", "--slots", "3", "--", "sh", "-c", f"{g.script()}; {checks}"))
        g.wait_ready()
    for g in gates:
        g.open()
    assert [procs.finish(p).returncode for p in ps] == [0, 0, 0]
    for i in range(3):
        assert (work / f"verify{i}").read_text().split()[-1] == "0", (work / f"verify{i}").read_text()
        assert (work / f"fence{i}").read_text().strip() == "0"


def test_cli_tickets_share_the_slots_and_status_shows_each_holder(backend: str, procs: Procs) -> None:
    def acquire() -> dict[str, object]:
        r = procs.run_text([PEARING_CLI, "acquire-lock", "S", "--slots", "2", "--request-uuid", str(uuid.uuid4())])
        assert r.returncode in (0, ExitCode.BUSY), r
        return dict(r.json)

    a, b, c = acquire(), acquire(), acquire()
    assert (a["state"], b["state"], c["state"]) == ("held", "held", "waiting"), (a, b, c)
    assert {a["slot"], b["slot"]} == {0, 1} and b["fence"] > a["fence"]  # type: ignore[operator]
    st = _status(procs, "S")
    assert st["slots"] == {"used": 2, "total": 2}, st
    assert [h["ticket_id"] for h in st["holders"]] == [a["ticket_id"], b["ticket_id"]]  # type: ignore[attr-defined]
    # The table a terminal gets: one row per holder, the state as slots used of total.
    rows = render([st]).splitlines()[1:]
    assert [r.split()[2:4] for r in rows] == [["held", "2/2"], ["held", "2/2"]], rows
    procs.run_text([PEARING_CLI, "release-lock-ticket", "S", str(a["ticket_id"])])
    got = wait_for(
        lambda: (
            t
            if (t := procs.run_text([PEARING_CLI, "get-lock-ticket", "S", str(c["ticket_id"])]).json)["state"] == "held"
            else None
        ),
        15,
        "the third ticket to be promoted",
    )
    assert got["slot"] == a["slot"] and got["fence"] > b["fence"], got
    for t in (b, c):
        procs.run_text([PEARING_CLI, "release-lock-ticket", "S", str(t["ticket_id"])])


def test_cancel_in_progress_stops_the_holder_with_the_lowest_fence(backend: str, procs: Procs, work: Path) -> None:
    log = work / "log"
    gates = [Gate(work, f"g{i}") for i in range(2)]
    flags = ("--job", "S", "--slots", "2", "--cancel-in-progress", "--kill-grace", "1")
    olds = []
    for g in gates:
        olds.append(procs.pr("-v", *flags, "--", "sh", "-c", g.script()))
        g.wait_ready()
    new = procs.pr(*flags, "--wait-seconds", "30", "--", *_contender(log, "new", 0))
    r = procs.finish(olds[0], timeout=30)
    assert r.returncode == ExitCode.BUSY, r
    assert any(" superseded " in line for line in r.err_lines), r
    assert procs.finish(new, timeout=30).returncode == 0
    assert olds[1].poll() is None, "the holder with the larger fence was stopped"
    gates[1].open()
    assert procs.finish(olds[1]).returncode == 0


def test_slots_compose_with_request_dedupe_min_interval_and_latest(backend: str, procs: Procs, work: Path) -> None:
    log = work / "log"
    gate = Gate(work)
    flags = ("--job", "S", "--slots", "2")
    holder = procs.pr(*flags, "--request-key", "evt-1", "--", "sh", "-c", gate.script())
    gate.wait_ready()
    # A replay of a request in flight is busy, though a slot is free: a request runs once.
    again = procs.run_text([PEARING_RUN, *flags, "--request-key", "evt-1", "--", "true"])
    assert again.returncode == ExitCode.BUSY, again
    # The second slot is free: another request runs at once; --min-interval then skips.
    assert procs.run_text([PEARING_RUN, *flags, "--min-interval", "1h", "--", "true"]).returncode == 0
    skipped = procs.run_text([PEARING_RUN, *flags, "--min-interval", "1h", "--", "sh", "-c", "exit 9"])
    assert skipped.returncode == 0, skipped
    # Both slots held: of two `latest` waiters the newer replaces the older.
    gate2 = Gate(work, "g2")
    second = procs.pr(*flags, "--", "sh", "-c", gate2.script())
    gate2.wait_ready()
    latest = (*flags, "--queue", "latest", "--wait-seconds", "60", "--")
    old = procs.pr(*latest, *_contender(log, "old", 0))
    wait_for(lambda: len(_status(procs, "S").get("waiters") or []) == 1, 15, "the older latest run to queue")
    new = procs.pr(*latest, *_contender(log, "new", 0))
    assert procs.finish(old, timeout=30).returncode == ExitCode.BUSY
    gate.open()
    assert procs.finish(new, timeout=30).returncode == 0
    assert [r[0] for r in _runs(log)] == ["new"]
    gate2.open()
    assert procs.finish(holder).returncode == 0 and procs.finish(second).returncode == 0


def test_acquire_lock_with_other_slots_than_the_live_tickets_is_refused(backend: str, procs: Procs, work: Path) -> None:
    gate = Gate(work)
    holder = procs.pr("--job", "S", "--slots", "2", "--", "sh", "-c", gate.script())
    gate.wait_ready()
    r = procs.run_text([PEARING_CLI, "acquire-lock", "S", "--slots", "3", "--request-uuid", str(uuid.uuid4())])
    assert r.returncode == ExitCode.USAGE, r
    assert r.one_line() == "pearing-cli: error: slots 3 differs from the 2 slot(s) the lock's live tickets use", r
    ok = procs.run_text([PEARING_CLI, "acquire-lock", "S", "--slots", "2", "--request-uuid", str(uuid.uuid4())])
    assert ok.returncode == 0 and ok.json["slot"] == 1, ok
    procs.run_text([PEARING_CLI, "release-lock-ticket", "S", ok.json["ticket_id"]])
    gate.open()
    assert procs.finish(holder).returncode == 0


@pytest.mark.anyio
@pytest.mark.parametrize("anyio_backend", ["asyncio"])
async def test_mcp_acquire_lock_takes_slots(
    backend: str,
    server_args: list[str],  # noqa: F811
    tmp_path: Path,
) -> None:
    agents: set[int] = set()
    async with serve(tmp_path, agents, *server_args) as c:
        args = {"repo": "default", "lock_name": "S", "slots": 2}
        a = await c.call("acquire_lock", request_uuid=str(uuid.uuid4()), **args)
        b = await c.call("acquire_lock", request_uuid=str(uuid.uuid4()), **args)
        third = await c.call("acquire_lock", request_uuid=str(uuid.uuid4()), **args)
        assert (a["state"], b["state"], third["state"]) == ("held", "held", "waiting")
        assert {a["slot"], b["slot"]} == {0, 1} and b["fence"] > a["fence"]
        await c.release_all()


def test_a_lost_lease_stops_only_its_own_run(backend: str, procs: Procs, work: Path) -> None:
    """Leases are per run: a slot's run that stops heartbeating loses its lease and is stopped
    (124); the other slot's run goes on, and the freed slot goes to the waiter."""
    log = work / "log"
    gate = Gate(work)
    flags = ("--job", "S", "--slots", "2")
    steady = procs.pr(*flags, "--", "sh", "-c", gate.script())
    gate.wait_ready()
    hung = procs.pr(*flags, "--heartbeat", "manual", "--lease-seconds", "2", "--kill-grace", "1", "--", "sleep", "60")
    wait_for(lambda: (_status(procs, "S").get("slots") or {}).get("used") == 2, 15, "both slots held")
    waiter = procs.pr(*flags, "--wait-seconds", "60", "--", *_contender(log, "w", 0))
    r = procs.finish(hung, timeout=30)
    assert r.returncode == ExitCode.LEASE_LOST, r
    assert procs.finish(waiter, timeout=30).returncode == 0
    assert steady.poll() is None, "the other slot's run was stopped"
    gate.open()
    assert procs.finish(steady).returncode == 0


def _t(slots: int, state: str = "waiting") -> Ticket:
    t = Ticket(ticket_id=str(uuid.uuid4()), request_uuid=str(uuid.uuid4()), lock_name="J", repo="default", identity="t")
    t.slots, t.state = slots, state
    return t


def test_the_first_live_ticket_in_line_speaks_for_the_locks_slots() -> None:
    """The rule both stores call (``core.ticket.check_slots``): the first live ticket in line
    order, not any later one (of two that disagree the later leaves); ended ones and the
    newcomer itself say nothing."""
    me = _t(3)
    check_slots(me, [_t(1, "expired"), me, _t(3, "held"), _t(1)])  # a later disagreeing one: not ours to judge
    check_slots(me, [])
    with pytest.raises(SlotsMismatch) as err:
        check_slots(me, [_t(2, "released"), _t(1, "held"), _t(3)])
    assert (err.value.asked, err.value.live) == (3, 1)
