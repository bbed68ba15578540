"""The project's benchmark: ``python -m bench [--quick] [--out PATH]``.

Everything compared is measured side by side in one run, alternating the
commands run by run, and reported as medians and ratios: the machine is shared
and noisy, so only ratios taken together mean anything.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from bench import growth, memory, stages
from bench.chain import FLOCK, etcd_member, pg_member, wait_for
from bench.chain import chain as _chain
from bench.chain import env as _env

BIN = Path(sys.executable).parent
PY = sys.executable
RUN = str(BIN / "pearing-run")
GUARD = str(BIN / "pearing-guard")
CLI = str(BIN / "pearing-cli")


def _time(argv: list[str], env: dict[str, str], expect: int | None = 0) -> float:
    t0 = time.perf_counter()
    rc = subprocess.run(argv, env=env, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, check=False).returncode
    dt = time.perf_counter() - t0
    if expect is not None and rc != expect:
        raise SystemExit(f"bench: {argv} exited {rc}, expected {expect}")
    return dt * 1000


def _alternate(cases: dict[str, Callable[[], float]], rounds: int) -> dict[str, list[float]]:
    out: dict[str, list[float]] = {k: [] for k in cases}
    for _ in range(2):  # warm-up
        for fn in cases.values():
            fn()
    for _ in range(rounds):
        for name, fn in cases.items():
            out[name].append(fn())
    return out


def _pct(xs: list[float], p: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, max(0, round(p / 100 * (len(xs) - 1))))]


# -- 1, 2, 5: start-up costs ---------------------------------------------------


def startup(tmp: Path, rounds: int) -> dict[str, Any]:
    env = _env(tmp / "startup")
    flock_file = str(tmp / "flock.lock")
    cases: dict[str, Callable[[], float]] = {
        "python3 -c pass": lambda: _time([PY, "-c", "pass"], env),
        "pearing-run (uncontended)": lambda: _time([RUN, "--job", "x", "--", "true"], env),
    }
    if FLOCK:
        cases["flock -n f true"] = lambda: _time([FLOCK, "-n", flock_file, "true"], env)
    # Busy skip: a holder keeps job "busy" for the whole measurement.
    gate = tmp / "busy-go"
    holder = subprocess.Popen(
        [RUN, "--job", "busy", "--", "sh", "-c", f"touch {tmp}/busy-ready; while [ ! -e {gate} ]; do sleep 0.05; done"],
        env=env,
    )
    wait_for((tmp / "busy-ready").exists, 10, "busy holder")
    cases["pearing-run (busy skip)"] = lambda: _time([RUN, "--job", "busy", "--", "true"], env, expect=75)
    # verify inside a live lease: copy the holder's token file path.
    token_file = next((tmp / "startup").glob("locks/default/@busy/tokens/*.token"))
    cases["pearing-guard verify"] = lambda: _time([GUARD, "verify", "--token-file", str(token_file)], env)
    # What an agent pays for each beat: pearing-cli's start and one heartbeat of a held CLI ticket.
    got = subprocess.run(
        [CLI, "acquire-lock", "beat", "--request-key", "bench", "--lease-seconds", "600"],
        env=env,
        capture_output=True,
        check=True,
    )
    beat_ticket = json.loads(got.stdout)["ticket_id"]
    beat = [CLI, "heartbeat-lock-ticket", "beat", beat_ticket, "--lease-seconds", "600"]
    cases["pearing-cli heartbeat"] = lambda: _time(beat, env)
    try:
        samples = _alternate(cases, rounds)
    finally:
        gate.touch()
        holder.wait(30)
        subprocess.run([CLI, "release-lock-ticket", "beat", beat_ticket], env=env, capture_output=True, check=False)
    med = {k: statistics.median(v) for k, v in samples.items()}
    base = med["python3 -c pass"]
    return {
        "median_ms": med,
        "ratio_to_python": {k: v / base for k, v in med.items()},
        "busy_over_uncontended": med["pearing-run (busy skip)"] / med["pearing-run (uncontended)"],
        "rounds": rounds,
    }


# -- 3, 6: hand-over -------------------------------------------------------------


def handover(tmp: Path, chains: int, length: int) -> dict[str, Any]:
    res: dict[str, list[float]] = {"pearing-run --wait-seconds": [], "flock -w": []}
    fifo_ok = True
    for _ in range(chains):
        g = _chain("pearing", length, tmp)
        fifo_ok &= g != [-1.0]
        res["pearing-run --wait-seconds"] += g
        if FLOCK:
            res["flock -w"] += _chain("flock", length, tmp)
    out: dict[str, Any] = {"chain_length": length, "chains": chains, "fifo_kept": fifo_ok}
    for k, v in res.items():
        if v:
            out[k] = {"p50_ms": statistics.median(v), "p99_ms": _pct(v, 99), "max_ms": max(v), "n": len(v)}
    if FLOCK and res["flock -w"]:
        out["p50_difference_ms"] = out["pearing-run --wait-seconds"]["p50_ms"] - out["flock -w"]["p50_ms"]
    return out


def etcd_handover(tmp: Path, length: int, chains: int) -> dict[str, Any] | None:
    """pearing-run and etcdctl lock, chains alternating on one single-member etcd on loopback,
    and the lock dir in the same run. Skipped without etcd or etcdctl."""
    res: dict[str, list[float]] = {"pearing-run --backend etcd": [], "etcdctl lock": [], "pearing-run (lock dir)": []}
    fifo = True
    with etcd_member(tmp / "etcd-data") as url:
        if url is None:
            return None
        _chain("pearing", 2, tmp, backend=url)  # warm-up
        _chain("etcdctl", 2, tmp, backend=url)
        for _ in range(chains):
            for name, tool, backend in (
                ("pearing-run --backend etcd", "pearing", url),
                ("etcdctl lock", "etcdctl", url),
                ("pearing-run (lock dir)", "pearing", None),
            ):
                gaps = _chain(tool, length, tmp, backend=backend)
                fifo &= gaps != [-1.0]
                res[name] += gaps
    out: dict[str, Any] = {"chain_length": length, "chains": chains, "fifo_kept": fifo}
    for k, v in res.items():
        out[k] = {"p50_ms": statistics.median(v), "p99_ms": _pct(v, 99), "max_ms": max(v), "n": len(v)}
    out["p50_difference_ms"] = out["pearing-run --backend etcd"]["p50_ms"] - out["etcdctl lock"]["p50_ms"]
    return out


def stores_handover(tmp: Path, length: int, chains: int) -> dict[str, Any] | None:
    """pearing-run's hand-over on each store, chains alternating in one run: PostgreSQL (a
    throwaway server on loopback), etcd (one member on loopback) and the lock dir. Skipped without
    PostgreSQL's server or the postgres extra; etcd's column is left out without etcd."""
    with pg_member() as pg, etcd_member(tmp / "etcd-stores") as etcd:
        if pg is None:
            return None
        stores = {"postgres": pg, "etcd": etcd, "lock dir": None}
        if etcd is None:
            del stores["etcd"]
        for url in stores.values():
            _chain("pearing", 2, tmp, backend=url)  # warm-up (and the postgres schema made)
        res: dict[str, list[float]] = {k: [] for k in stores}
        fifo = True
        for _ in range(chains):
            for name, url in stores.items():
                gaps = _chain("pearing", length, tmp, backend=url)
                fifo &= gaps != [-1.0]
                res[name] += gaps
    out: dict[str, Any] = {"chain_length": length, "chains": chains, "fifo_kept": fifo}
    for k, v in res.items():
        out[k] = {"p50_ms": statistics.median(v), "p99_ms": _pct(v, 99), "max_ms": max(v), "n": len(v)}
    return out


def scale_waiters(tmp: Path, many: int) -> dict[str, Any]:
    two = [g for _ in range(10) for g in _chain("pearing", 2, tmp)]
    big = _chain("pearing", many, tmp)
    fifo = big != [-1.0]
    return {
        "p50_ms_2_waiters": statistics.median(two),
        f"p99_ms_{many}_waiters": _pct(big, 99) if fifo else None,
        f"p50_ms_{many}_waiters": statistics.median(big) if fifo else None,
        "fifo_kept": fifo,
        "p99_over_2_waiter_p50": (_pct(big, 99) / statistics.median(two)) if fifo else None,
    }


# -- 4: lease-expiry detection -------------------------------------------------

_TRAP = """
import os, signal, sys, time
def term(sig, frame):
    t = time.time()
    v = os.system("{guard} verify >/dev/null 2>&1")
    open(sys.argv[1], "w").write(f"{{t}} {{v}}")
    sys.exit(0)
signal.signal(signal.SIGTERM, term)
open(sys.argv[2], "w").close()
while True:
    signal.pause()
"""


def expiry(tmp: Path, runs: int) -> dict[str, Any]:
    lags, refused = [], 0
    script = tmp / "trap.py"
    script.write_text(_TRAP.format(guard=GUARD))
    for i in range(runs):
        d = tmp / f"exp{i}"
        d.mkdir()
        env = _env(d / "lockdir")
        # Long enough for the trap's interpreter to start and set its handler on a loaded
        # machine (the lease counts from COMMAND's start): what is measured is the lag after it.
        argv = [RUN, "--job", "e", "--heartbeat", "manual", "--lease-seconds", "1.5", "--kill-grace", "5"]
        cmd = [*argv, "--", PY, str(script), str(d / "term"), str(d / "ready")]
        rc = subprocess.run(cmd, env=env, check=False).returncode
        if rc != 124:
            raise SystemExit(f"bench: expiry run exited {rc}, expected 124")
        term_at, verify_rc = (d / "term").read_text().split()
        ended = next((d / "lockdir").glob("locks/default/@e/ended/*.json"))
        deadline = json.loads(ended.read_text())["lease_expires_at"]
        lags.append((float(term_at) - deadline) * 1000)
        refused += int(verify_rc) != 0
    return {
        "runs": runs,
        "deadline_to_sigterm_p50_ms": statistics.median(lags),
        "deadline_to_sigterm_max_ms": max(lags),
        "token_refused_in_term_trap": f"{refused}/{runs}",
    }


# -- 7: many locks ---------------------------------------------------------------


def many_locks(tmp: Path, count: int) -> dict[str, Any]:
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
    from singleflight.core.record import new_uuid4
    from singleflight.core.request import RequestRecord
    from singleflight.core.ticket import Ticket
    from singleflight.local.lease import prune_requests
    from singleflight.local.store import LockDir

    lock_dir = tmp / "many"
    ld = LockDir(str(lock_dir))
    t0 = time.perf_counter()
    for i in range(count):
        with ld.lock_store("default", f"job-{i:05d}") as st:
            os.close(st.open_lock_file())
            with st.mutex():
                st.bump_fence()
    made = time.perf_counter() - t0
    env = _env(lock_dir)
    # Every lock is idle: plain ``status`` lists none of them (it scans for holders and waiters),
    # ``--idle`` shows them all.
    times = [_time([CLI, "status", "--idle"], env) for _ in range(3)]
    live_times = [_time([CLI, "status"], env) for _ in range(3)]
    out = subprocess.run([CLI, "status", "--idle"], env=env, capture_output=True, check=True).stdout
    listed = len(json.loads(out))
    du = int(
        subprocess.run(
            ["du", "-sk", str(lock_dir / "locks")], capture_output=True, text=True, check=True
        ).stdout.split()[0]
    )
    # Completed request-uuid records on one lock.
    with ld.lock_store("default", "dedupe") as st:
        st.sub("requests")
        before = _du_bytes(lock_dir / "locks/default/@dedupe/requests")
        for _ in range(200):
            t = Ticket(
                ticket_id=new_uuid4(), request_uuid=new_uuid4(), lock_name="dedupe", repo="default", identity="b"
            )
            t.fence = 1
            st.write_request(t.request_uuid, RequestRecord.finished(t, 0, 86400))
        after = _du_bytes(lock_dir / "locks/default/@dedupe/requests")
        pruned_now = prune_requests(st, time.time() + 86401)
    return {
        "locks": count,
        "created_in_s": made,
        "status_idle_median_s": statistics.median(times) / 1000,
        "status_median_s": statistics.median(live_times) / 1000,  # none of them in use: none listed
        "status_listed": listed,
        "disk_kib_per_idle_lock": du / count,
        "disk_bytes_per_request_record": (after - before) / 200,
        "request_records_pruned_after_window": pruned_now,
    }


def _du_bytes(p: Path) -> int:
    return int(subprocess.run(["du", "-sb", str(p)], capture_output=True, text=True, check=True).stdout.split()[0])


# -- report ------------------------------------------------------------------------


def _table(r: dict[str, Any]) -> str:
    s = r["startup"]
    lines = ["", "== start-up (median of alternating runs) ==", f"{'command':<30} {'median ms':>10} {'x python':>9}"]
    for k, v in s["median_ms"].items():
        lines.append(f"{k:<30} {v:>10.1f} {s['ratio_to_python'][k]:>9.2f}")
    lines.append(f"busy skip / uncontended: {s['busy_over_uncontended']:.2f}")
    h = r["handover"]
    lines += [
        "",
        f"== hand-over, chains of {h['chain_length']} waiters ==",
        f"{'tool':<30} {'p50':>8} {'p99':>8} {'max':>8}",
    ]
    for k in ("pearing-run --wait-seconds", "flock -w"):
        if k in h:
            lines.append(f"{k:<30} {h[k]['p50_ms']:>8.1f} {h[k]['p99_ms']:>8.1f} {h[k]['max_ms']:>8.1f}")
    if "p50_difference_ms" in h:
        lines.append(f"p50 difference: {h['p50_difference_ms']:+.1f} ms; FIFO kept: {h['fifo_kept']}")
    w = r["waiters"]
    lines += ["", "== queue length =="] + [
        f"{k}: {v if not isinstance(v, float) else round(v, 2)}" for k, v in w.items()
    ]
    e = r["expiry"]
    lines += ["", "== lease-expiry detection =="] + [
        f"{k}: {v if not isinstance(v, float) else round(v, 1)}" for k, v in e.items()
    ]
    m = r["many_locks"]
    lines += ["", "== many locks =="] + [f"{k}: {v if not isinstance(v, float) else round(v, 3)}" for k, v in m.items()]
    e = r.get("etcd")
    if e:
        title = f"hand-over on etcd (one member, loopback), chains of {e['chain_length']}, alternating"
        tools = ("pearing-run --backend etcd", "etcdctl lock", "pearing-run (lock dir)")
        lines += _percentiles(title, "tool", e, tools)
        lines.append(f"p50 difference to etcdctl lock: {e['p50_difference_ms']:+.1f} ms; FIFO kept: {e['fifo_kept']}")
    else:
        lines += ["", "== hand-over on etcd: skipped (needs etcd and etcdctl) =="]
    sh = r.get("stores")
    if sh:
        title = f"hand-over on each store (pearing-run; servers on loopback), chains of {sh['chain_length']}"
        lines += _percentiles(title, "store", sh, ("postgres", "etcd", "lock dir"))
        lines.append(f"FIFO kept: {sh['fifo_kept']}")
    else:
        lines += ["", "== hand-over on each store: skipped (needs PostgreSQL's server and the postgres extra) =="]
    lines += growth.table(r["growth"])
    lines += memory.table(r["memory"])
    st = r.get("stages")
    lines += ["", stages.table(st).rstrip()] if st else ["", "== stages: skipped (needs strace) =="]
    return "\n".join(lines) + "\n"


def _percentiles(title: str, what: str, section: dict[str, Any], rows: tuple[str, ...]) -> list[str]:
    """A section's p50 / p99 / max table, one line per row it has."""
    out = ["", f"== {title} ==", f"{what:<30} {'p50':>8} {'p99':>8} {'max':>8}"]
    for k in (k for k in rows if k in section):
        out.append(f"{k:<30} {section[k]['p50_ms']:>8.1f} {section[k]['p99_ms']:>8.1f} {section[k]['max_ms']:>8.1f}")
    return out


def main() -> int:
    ap = argparse.ArgumentParser(prog="python -m bench", description=__doc__)
    ap.add_argument("--quick", action="store_true", help="few rounds: checks that the benchmark works")
    ap.add_argument("--out", default="bench/results/latest.json", help="where to write the JSON")
    a = ap.parse_args()
    q = a.quick
    with tempfile.TemporaryDirectory(prefix="pearing-bench-") as t:
        tmp = Path(t)
        result = {
            "machine": {"platform": platform.platform(), "cpus": os.cpu_count(), "python": platform.python_version()},
            "startup": startup(tmp, 5 if q else 40),
            "handover": handover(tmp, 1 if q else 3, 5 if q else 20),
            "waiters": scale_waiters(tmp, 10 if q else 100),
            "expiry": expiry(tmp, 3 if q else 20),
            "many_locks": many_locks(tmp, 200 if q else 10000),
            "etcd": etcd_handover(tmp, 5 if q else 10, 1 if q else 3),
            "stores": stores_handover(tmp, 5 if q else 10, 1 if q else 3),
            "growth": growth.growth(tmp, q),
            "memory": memory.memory(tmp, 3 if q else 10, _env(tmp / "memory")),
            "stages": stages.stages(1 if q else 10),
        }
    out = Path(a.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2) + "\n")
    sys.stdout.write(_table(result))
    sys.stdout.write(f"\nJSON: {out}\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
