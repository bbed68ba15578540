"""Cost as work grows: the hand-over with many other locks held, ``pearing-cli status`` over many
locks, and an etcd line of many waiters. Each curve is its sizes' values, their ratios to the
smallest size's, the cost each step adds per unit of size, and its shape (``_curve``).

Many held locks and long lines are made in this one process, through the package's own acquire
path (``LockOps.enter``, then ``take`` as a holder does, or ``Place.queue`` as a waiter does),
not by thousands of pearing-run processes (two interpreters each): the store's state is what a
scan or a hand-over pays for, and that state is the same. What is timed is always real
processes: pearing-run chains (``bench.chain``) and pearing-cli.

``python -m bench.growth [--quick]``; ``python -m bench`` includes it.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from bench.chain import chain, env, etcd_member

CLI = str(Path(sys.executable).parent / "pearing-cli")
# Long enough that nothing held or waiting here needs renewing while it is measured.
_LEASE = 3600.0
_progress = False  # ``python -m bench.growth``: a line on stderr as each size is done


def _say(text: str) -> None:
    if _progress:
        sys.stderr.write(f"bench.growth: {text}\n")


def _ticket(repo: str, lock: str) -> Any:
    """A new waiting ticket, as pearing-run's wrapper makes one (``runner.Runner.run``)."""
    from singleflight.core import proc
    from singleflight.core.record import new_uuid4
    from singleflight.core.ticket import Ticket

    return Ticket(
        ticket_id=new_uuid4(),
        request_uuid=new_uuid4(),
        lock_name=lock,
        repo=repo,
        identity="bench",
        lease_seconds=_LEASE,
        holder_pid=os.getpid(),
        holder_start=proc.start_time(os.getpid()),
        kill_grace=5.0,
    )


class Holdings:
    """Locks held by this process, each as a holder holds one: the grip from ``enter`` (the lock
    was free), then ``take`` (fence, token, token file), then the lease's first due ``check``
    (on etcd the holder settles its key then: its pid and deadline). Kept until the process
    ends: a lock dir grip is an open fd, an etcd one a lease of an hour."""

    def __init__(self, url: str | None, lock_dir: Path) -> None:
        from singleflight.backend import open_backend

        self.backend = open_backend(url, str(lock_dir))
        self.held: list[tuple[Any, Any, Any]] = []  # (lock, grip, lease)

    def hold(self, repo: str, lock: str) -> None:
        lk = self.backend.lock(repo, lock)
        ticket = _ticket(repo, lock)
        grip, _ = lk.enter(ticket)
        if grip is None:
            raise SystemExit(f"bench.growth: {repo}/{lock} was not free")
        lease, _ = lk.take(grip, ticket, promoted=False, kill_grace=5.0)
        self.held.append((lk, grip, lease))

    def top_up(self, count: int, repo: str = "default", prefix: str = "other") -> float:
        """Hold ``count`` locks in all (``prefix-00000``...); seconds it took."""
        t0 = time.perf_counter()
        start = len(self.held)
        for i in range(start, count):
            self.hold(repo, f"{prefix}-{i:05d}")
        self.settle(start)
        return time.perf_counter() - t0

    def settle(self, start: int = 0) -> None:
        """Each new lease's first look, when it falls due (within a second on etcd, as in a
        holder's loop; an hour away on the lock dir)."""
        for _, _, lease in self.held[start:]:
            due = lease.ticket.lease_deadline_mono or 0.0
            if due - time.monotonic() < 1.0:
                time.sleep(max(0.0, due - time.monotonic()))
                if lease.check() is not None:
                    raise SystemExit(f"bench.growth: lost {lease.ticket.lock_name} as it settled")


def _fd_room(count: int) -> None:
    """A lock dir grip is an open fd, and each lock's store a few more: raise the soft limit
    toward the hard one when ``count`` needs it (the sections' children inherit it, harmlessly)."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    want = 8 * count + 256
    if soft != resource.RLIM_INFINITY and soft < want:
        resource.setrlimit(resource.RLIMIT_NOFILE, (want if hard == resource.RLIM_INFINITY else min(want, hard), hard))


def _curve(sizes: list[int], values: list[float]) -> dict[str, Any]:
    """Each size's value, its ratio to the smallest size's, and the shape. A fixed cost (a
    process's start) hides growth in the ratios, so the shape is judged on the cost each step
    adds per unit of size: flat when the largest size costs under 1.5x the smallest; linear
    while the last step's cost a unit stays within 3x the first step's; else worse."""
    base = values[0] or 1e-9
    ratios = [v / base for v in values]
    per_unit = [(b - a) / (m - n) for n, m, a, b in zip(sizes, sizes[1:], values, values[1:], strict=False)]
    if ratios[-1] < 1.5:
        shape = "flat"
    elif per_unit[0] <= 0 or per_unit[-1] <= 3 * per_unit[0]:
        shape = "linear"
    else:
        shape = "worse"
    return {"sizes": sizes, "values": values, "ratios": ratios, "added_per_unit": per_unit, "shape": shape}


# -- 1: hand-over with many other locks held -------------------------------------------------


def handover(tmp: Path, url: str | None, sizes: list[int], chains: int, length: int, *, warm: bool) -> dict[str, Any]:
    """Hand-over p50 on lock ``c`` (``bench.chain``) while ``size`` other locks are held."""
    where = tmp / f"handover-{'etcd' if url else 'lockdir'}"
    holdings = Holdings(url, where)  # the chains run in the same lock dir (etcd: its token files)
    _fd_room(sizes[-1])
    p50s, made, fifo = [], [], True
    if warm:
        chain("pearing", 2, tmp, backend=url, lock_dir=where)
    for size in sizes:
        made.append(holdings.top_up(size))
        gaps: list[float] = []
        for _ in range(chains):
            g = chain("pearing", length, tmp, backend=url, lock_dir=where)
            fifo &= g != [-1.0]
            gaps += g
        p50s.append(statistics.median(gaps))
        _say(f"hand-over ({'etcd' if url else 'lock dir'}), {size} held: p50 {p50s[-1]:.1f} ms")
    out = _curve(sizes, p50s)
    return out | {"metric": "hand-over p50 ms", "fifo_kept": fifo, "made_s": made, "gaps_per_size": chains * length}


# -- 2: pearing-cli status over many locks -----------------------------------------------------


def status(tmp: Path, sizes: list[int], held: int, rounds: int) -> dict[str, Any]:
    """``pearing-cli status`` and ``status --idle`` on a lock dir of ``size`` locks, ``held`` of
    them held (the rest idle: a fence and nobody in line). Medians of ``rounds``."""
    from singleflight.local.store import LockDir

    lock_dir = tmp / "status"
    holdings = Holdings(None, lock_dir)
    _fd_room(held)
    holdings.top_up(held, prefix="held")
    ld = LockDir(str(lock_dir))
    e = env(lock_dir)
    plain, idle, listed, listed_idle = [], [], [], []
    made = held
    for size in sizes:
        for i in range(made, size):  # idle, as ``python -m bench``'s many_locks makes them
            with ld.lock_store("default", f"idle-{i:05d}") as st:
                os.close(st.open_lock_file())
                with st.mutex():
                    st.bump_fence()
        made = max(made, size)
        runs = [_time_cli(["status"], e) for _ in range(rounds)]
        runs_idle = [_time_cli(["status", "--idle"], e) for _ in range(rounds)]
        plain.append(statistics.median(ms for ms, _ in runs))
        idle.append(statistics.median(ms for ms, _ in runs_idle))
        listed.append(sum(1 for s in json.loads(runs[-1][1]) if s["state"] == "held"))
        listed_idle.append(len(json.loads(runs_idle[-1][1])))
        _say(f"status, {size} locks: {plain[-1]:.0f} ms, --idle {idle[-1]:.0f} ms")
    return {
        "held": held,
        "status": _curve(sizes, plain) | {"metric": "pearing-cli status ms", "listed_held": listed},
        "status --idle": _curve(sizes, idle) | {"metric": "pearing-cli status --idle ms", "listed": listed_idle},
    }


def _time_cli(args: list[str], e: dict[str, str]) -> tuple[float, bytes]:
    """ms, and what it printed."""
    t0 = time.perf_counter()
    out = subprocess.run([CLI, *args], env=e, capture_output=True, check=True).stdout
    return (time.perf_counter() - t0) * 1000, out


# -- 3: an etcd line of many waiters -------------------------------------------------------------


class Line:
    """``count`` waiters joined at the end of ``lock``'s line in this process, each as a waiting
    run joins (``enter``, then ``Place.queue``: what is timed). Each key then moves onto its
    ticket's hour-long holder lease (``Mutex.rehome``, as a pearing-cli ticket's key rides on
    it until its agent takes over) and its 3 s waiting lease goes: a thousand waiters keep
    their leases from a thousand processes, but one process here could not keep them all
    within 3 s on a loaded 2-core host (most lapsed, and the line thinned as it was measured)."""

    def __init__(self, url: str, lock_dir: Path, lock: str) -> None:
        from singleflight.backend import open_backend

        self.backend = open_backend(url, str(lock_dir))
        self.lk = self.backend.lock("default", lock)
        self.places: list[Any] = []
        self.join_ms: list[float] = []
        self.lost = 0  # waiters whose place was gone when the drain reached them

    def join(self, count: int) -> None:
        far = time.monotonic() + _LEASE
        mutex, cluster = self.lk.mutex, self.lk.cluster
        for _ in range(count):
            t0 = time.perf_counter()
            _, place = self.lk.enter(_ticket("default", self.lk.lock))
            place.queue(lambda: far)
            self.join_ms.append((time.perf_counter() - t0) * 1000)
            place.kv, _ = mutex.rehome(place.kv, place.lease)
            cluster.revoke(place.waiting_lease)
            self.places.append(place)

    def drain(self) -> list[float]:
        """Each waiter in turn, first now: its ``wait`` returns the grip, which it releases at
        once (as a wrapper whose holder is gone does). ms each."""
        out = []
        far = time.monotonic() + _LEASE
        for place in self.places:
            t0 = time.perf_counter()
            grip = place.wait(lambda: far)
            if grip is None:  # its place was gone: counted, and the line goes on
                self.lost += 1
                continue
            grip.release()
            out.append((time.perf_counter() - t0) * 1000)
        return out


def line(tmp: Path, url: str, sizes: list[int], length: int) -> dict[str, Any]:
    """A pearing-run chain of ``length`` at the head of an etcd line that ``size`` more wait in:
    the N-th waiter's join, the hand-over p50 at the head, and the line drained (ms a waiter)."""
    joins, last_joins, heads, drains, fifo, lost = [], [], [], [], True, 0
    for size in sizes:
        job = f"line-{size}"
        waiting = Line(url, tmp / f"line-{size}", job)

        def behind(w: Line = waiting, n: int = size) -> None:
            w.join(n)

        gaps = chain("pearing", length, tmp, backend=url, job=job, behind=behind)
        fifo &= gaps != [-1.0]
        drained = waiting.drain()
        lost += waiting.lost
        tail = waiting.join_ms[-max(1, size // 10) :]
        joins.append(statistics.mean(waiting.join_ms))
        last_joins.append(statistics.median(tail))
        heads.append(statistics.median(gaps))
        drains.append(statistics.mean(drained))
        _say(f"etcd line of {size}: join {joins[-1]:.1f} ms, head p50 {heads[-1]:.1f} ms, drain {drains[-1]:.1f} ms")
    return {
        "chain_length": length,
        "fifo_kept": fifo,
        "waiters_lost": lost,
        "join ms (mean)": _curve(sizes, joins),
        "join ms (last tenth, median)": _curve(sizes, last_joins),
        "head hand-over p50 ms": _curve(sizes, heads),
        "drain ms a waiter": _curve(sizes, drains),
    }


# -- the section -----------------------------------------------------------------------------


def growth(tmp: Path, quick: bool) -> dict[str, Any]:
    held = [1, 4] if quick else [1, 100, 1000]
    chains, length = (1, 3) if quick else (2, 10)
    out: dict[str, Any] = {
        "handover lock dir": handover(tmp, None, held, chains, length, warm=not quick),
        "status": status(tmp, [20, 60] if quick else [100, 1000, 10000], 3 if quick else 10, 1 if quick else 3),
    }
    with etcd_member(tmp / "growth-etcd") as url:
        if url is not None:
            out["handover etcd"] = handover(tmp, url, held, chains, length, warm=not quick)
            out["etcd line"] = line(tmp, url, [2, 8] if quick else [10, 100, 1000], 2 if quick else 10)
    return out


def _row(name: str, c: dict[str, Any]) -> list[str]:
    cells = "  ".join(
        f"{n:>6}: {v:9.2f} ({r:6.2f}x)" for n, v, r in zip(c["sizes"], c["values"], c["ratios"], strict=True)
    )
    steps = ", ".join(f"{x:.4g}" for x in c["added_per_unit"])
    return [f"{name}: {c['shape']} (added a unit of N, step by step: {steps})", f"  {cells}"]


def table(g: dict[str, Any]) -> list[str]:
    lines = ["", "== growth: N, the value at N (its ratio to the smallest N's), and the curve's shape =="]
    for key, where in (("handover lock dir", "lock dir"), ("handover etcd", "etcd")):
        if key in g:
            lines += _row(f"hand-over p50 ms, N other locks held ({where})", g[key])
    s = g["status"]
    lines += _row(f"pearing-cli status ms, N locks in the lock dir ({s['held']} held)", s["status"])
    lines += _row(f"pearing-cli status --idle ms, N locks in the lock dir ({s['held']} held)", s["status --idle"])
    e = g.get("etcd line")
    if e:
        for k in ("join ms (mean)", "join ms (last tenth, median)", "head hand-over p50 ms", "drain ms a waiter"):
            lines += _row(f"etcd line of N waiters, {k}", e[k])
        lines.append(
            f"etcd line: FIFO kept {e['fifo_kept']}; waiters lost before the drain reached them {e['waiters_lost']}"
        )
    else:
        lines.append("hand-over and line on etcd: skipped (needs etcd and etcdctl)")
    return lines


def main() -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.growth", description=__doc__)
    ap.add_argument("--quick", action="store_true", help="tiny sizes: checks that the section works")
    ap.add_argument("--out", help="also write the JSON here")
    a = ap.parse_args()
    global _progress
    _progress = True
    with tempfile.TemporaryDirectory(prefix="pearing-growth-") as t:
        result = growth(Path(t), a.quick)
    if a.out:
        Path(a.out).write_text(json.dumps(result, indent=2) + "\n")
    sys.stdout.write("\n".join(table(result)) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
