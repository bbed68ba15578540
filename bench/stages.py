"""Stage-by-stage stamps of one uncontended ``pearing-run`` and one lock-dir hand-over, from the
kernel's side: ``strace --seccomp-bpf`` stops only at the few system calls that mark a stage
(exec, flock, fork, fsync, spawn, exit), so the processes run at nearly full speed between them.

``python -m bench.stages [--runs N] [--only lockdir|etcd] [--json]``: medians over N runs, in ms
from the stage before; with etcd and etcdctl installed, also an etcd hand-over of pearing-run and
of ``etcdctl lock`` side by side (``stages_etcd``). Needs strace 5.3 or later; the main benchmark
(``python -m bench``) includes it when strace is there.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from bench import stages_etcd, trace
from bench.trace import first

BIN = Path(sys.executable).parent
RUN = str(BIN / "pearing-run")
CALLS = "execve,clone,clone3,flock,fsync,fdatasync,sendmsg,exit_group"


def _strace(argv: list[str], log: Path, env: dict[str, str]) -> subprocess.Popen[bytes]:
    return trace.strace(argv, log, env, CALLS)


def uncontended(tmp: Path, env: dict[str, str]) -> dict[str, float]:
    log = tmp / "run.trace"
    marker = tmp / "cmd-marker"
    p = _strace([RUN, "--job", "u", "--", "/bin/touch", str(marker)], log, env)
    if p.wait(60) != 0:
        raise SystemExit("bench.stages: the uncontended run failed")
    ev = trace.events(log)
    start = ev[0][1]
    locked = first(ev, lambda s: s.startswith("flock(") and "LOCK_NB" in s and s.endswith("= 0"))
    forked = first(ev, lambda s: s.startswith("clone("), locked)
    synced = max(t for _, t, s in ev if s.startswith(("fsync(", "fdatasync(")) and t < _spawn(ev))
    spawned = _spawn(ev)
    execd = first(ev, lambda s: s.startswith('execve("/bin/touch"') or ("touch" in s and "= 0" in s), spawned)
    done = ev[-1][1]
    return {
        "exec to flock taken (interpreter, imports, parse)": locked - start,
        "flock to holder forked": forked - locked,
        "holder forked to fence durable (fsyncs)": synced - forked,
        "fence durable to COMMAND spawned (records, token, ready)": spawned - synced,
        "spawned to COMMAND exec": execd - spawned,
        "COMMAND exec to pearing-run gone (reap, end record)": done - execd,
        "total": done - start,
    }


def _spawn(ev: list[tuple[int, float, str]]) -> float:
    return first(ev, lambda s: s.startswith("clone3(") or ("CLONE_VFORK" in s))


def handover(tmp: Path, env: dict[str, str]) -> dict[str, float]:
    gate, ready = tmp / "go", tmp / "ready"
    held = subprocess.Popen(
        [RUN, "--job", "h", "--", "sh", "-c", f"touch {ready}; while [ ! -e {gate} ]; do sleep 0.001; done"], env=env
    )
    _wait(ready.exists, "the first run's COMMAND")
    log = tmp / "next.trace"
    nxt = _strace([RUN, "--job", "h", "--wait-seconds", "30", "--", "/bin/true"], log, env)
    qdir = Path(env["PEARING_LOCK_DIR"]) / "locks" / "default" / "@h" / "queue"
    _wait(lambda: any(not n.startswith(".") and n[:1].isdigit() for n in os.listdir(qdir)), "the next run in line")
    time.sleep(0.2)  # let it settle into its blocking flock: what is timed starts at the release
    released = time.time() * 1000
    gate.touch()
    if held.wait(60) != 0 or nxt.wait(60) != 0:
        raise SystemExit("bench.stages: a hand-over run failed")
    ev = trace.events(log)
    woken = first(ev, lambda s: s.startswith("flock(") and "LOCK_EX)" in s and s.endswith("= 0"), released)
    # The holder forked as the run joined the line is handed the flocked fd (sendmsg); a run
    # whose standby holder died forks one with it (clone).
    handed = first(ev, lambda s: s.startswith(("clone(", "sendmsg(")), woken)
    spawned = _spawn([e for e in ev if e[1] >= handed])
    synced = max(t for _, t, s in ev if s.startswith(("fsync(", "fdatasync(")) and handed <= t < spawned)
    execd = first(ev, lambda s: s.startswith('execve("/bin/true"'), spawned)
    return {
        "gate opened to next run's flock returns (old COMMAND ends, old holder lets go)": woken - released,
        "flock to the holder handed the fd": handed - woken,
        "holder handed the fd to fence durable (fsyncs)": synced - handed,
        "fence durable to COMMAND spawned": spawned - synced,
        "spawned to COMMAND exec": execd - spawned,
        "total: gate opened to next COMMAND exec": execd - released,
    }


def _wait(pred: Any, what: str) -> None:
    deadline = time.monotonic() + 20
    while not pred():
        if time.monotonic() > deadline:
            raise SystemExit(f"bench.stages: timed out waiting for {what}")
        time.sleep(0.005)


def stages(runs: int, parts: tuple[str, ...] = ("lockdir", "etcd")) -> dict[str, Any] | None:
    """None where strace is missing or may not trace here (ptrace forbidden, too old for
    --seccomp-bpf). The etcd part (``stages_etcd``) is None without etcd and etcdctl."""
    if not trace.usable():
        return None
    out: dict[str, Any] = {"runs": runs}
    if "lockdir" in parts:
        samples: dict[str, dict[str, list[float]]] = {"uncontended": {}, "handover": {}}
        for i in range(runs):
            with tempfile.TemporaryDirectory(prefix="pearing-stages-") as t:
                tmp = Path(t)
                env = {k: v for k, v in os.environ.items() if not k.startswith("PEARING_")}
                env["PEARING_LOCK_DIR"] = str(tmp / f"lockdir{i}")
                for name, fn in (("uncontended", uncontended), ("handover", handover)):
                    for stage, ms in fn(tmp, env).items():
                        samples[name].setdefault(stage, []).append(ms)
        out |= {name: {k: statistics.median(v) for k, v in s.items()} for name, s in samples.items()}
    if "etcd" in parts:
        out["etcd"] = stages_etcd.etcd_stages(runs)
    return out


def table(result: dict[str, Any]) -> str:
    lines = [f"stages (strace --seccomp-bpf, medians of {result['runs']} runs, ms):"]
    for name in ("uncontended", "handover"):
        if name in result:
            lines.append(f"  {name}:")
            lines += [f"    {ms:7.1f}  {stage}" for stage, ms in result[name].items()]
    if result.get("etcd"):
        lines += stages_etcd.table(result["etcd"])
    elif "etcd" in result:
        lines.append("etcd hand-over: skipped (needs etcd and etcdctl)")
    return "\n".join(lines) + "\n"


def main() -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.stages", description=__doc__)
    ap.add_argument("--runs", type=int, default=10)
    ap.add_argument("--only", choices=("lockdir", "etcd"), help="one part: the lock dir's runs, or the etcd hand-overs")
    ap.add_argument("--json", action="store_true", help="the result as JSON, not a table")
    a = ap.parse_args()
    if a.runs < 1:
        sys.stderr.write("bench.stages: --runs must be at least 1\n")
        return 64
    result = stages(a.runs, (a.only,) if a.only else ("lockdir", "etcd"))
    if result is None:
        sys.stderr.write("bench.stages: needs strace 5.3 or later, allowed to trace here\n")
        return 69
    sys.stdout.write(json.dumps(result, indent=2) + "\n" if a.json else table(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
