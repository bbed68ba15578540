"""Stage-by-stage stamps of one uncontended ``pearing-run`` and one lock-dir hand-over, from the
kernel's side: ``strace --seccomp-bpf`` stops only at the few system calls that mark a stage
(exec, flock, fork, fsync, spawn, exit), so the processes run at nearly full speed between them.

``python -m bench.stages [--runs N]``: medians over N runs, in ms from the stage before. Needs
strace 5.3 or later; the main benchmark (``python -m bench``) includes it when strace is there.
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

BIN = Path(sys.executable).parent
RUN = str(BIN / "pearing-run")
STRACE = shutil.which("strace")
CALLS = "execve,clone,clone3,flock,fsync,fdatasync,sendmsg,exit_group"
_LINE = re.compile(r"^(\d+) +(\d+\.\d+) (.*?)(?: <(\d+\.\d+)>)?$")


def _events(path: Path) -> list[tuple[int, float, str]]:
    """(pid, ms, call) of each traced call, stamped when it returned (``-T``: the time spent in
    it, added to its start), so a blocking flock is stamped when it was granted."""
    out = []
    for line in path.read_text().splitlines():
        m = _LINE.match(line)
        if m:
            spent = float(m.group(4)) if m.group(4) else 0.0
            out.append((int(m.group(1)), (float(m.group(2)) + spent) * 1000, m.group(3)))
    return sorted(out, key=lambda e: e[1])


def _first(events: list[tuple[int, float, str]], pred: Any, after: float = 0.0) -> float:
    return next(t for _, t, text in events if t >= after and pred(text))


def _strace(argv: list[str], log: Path, env: dict[str, str]) -> subprocess.Popen[bytes]:
    assert STRACE is not None
    return subprocess.Popen(
        [STRACE, "--seccomp-bpf", "-f", "-ttt", "-T", "-e", f"trace={CALLS}", "-o", str(log), *argv], env=env
    )


def uncontended(tmp: Path, env: dict[str, str]) -> dict[str, float]:
    log = tmp / "run.trace"
    marker = tmp / "cmd-marker"
    p = _strace([RUN, "--job", "u", "--", "/bin/touch", str(marker)], log, env)
    if p.wait(60) != 0:
        raise SystemExit("bench.stages: the uncontended run failed")
    ev = _events(log)
    start = ev[0][1]
    locked = _first(ev, lambda s: s.startswith("flock(") and "LOCK_NB" in s and s.endswith("= 0"))
    forked = _first(ev, lambda s: s.startswith("clone("), locked)
    synced = max(t for _, t, s in ev if s.startswith(("fsync(", "fdatasync(")) and t < _spawn(ev))
    spawned = _spawn(ev)
    execd = _first(ev, lambda s: s.startswith('execve("/bin/touch"') or ("touch" in s and "= 0" in s), spawned)
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
    return _first(ev, lambda s: s.startswith("clone3(") or ("CLONE_VFORK" in s))


def handover(tmp: Path, env: dict[str, str]) -> dict[str, float]:
    gate, ready = tmp / "go", tmp / "ready"
    first = subprocess.Popen(
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
    if first.wait(60) != 0 or nxt.wait(60) != 0:
        raise SystemExit("bench.stages: a hand-over run failed")
    ev = _events(log)
    woken = _first(ev, lambda s: s.startswith("flock(") and "LOCK_EX)" in s and s.endswith("= 0"), released)
    # The holder forked as the run joined the line is handed the flocked fd (sendmsg); a run
    # whose standby holder died forks one with it (clone).
    handed = _first(ev, lambda s: s.startswith(("clone(", "sendmsg(")), woken)
    spawned = _spawn([e for e in ev if e[1] >= handed])
    synced = max(t for _, t, s in ev if s.startswith(("fsync(", "fdatasync(")) and handed <= t < spawned)
    execd = _first(ev, lambda s: s.startswith('execve("/bin/true"'), spawned)
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


def stages(runs: int) -> dict[str, Any] | None:
    """None where strace is missing or may not trace here (ptrace forbidden, too old for
    --seccomp-bpf)."""
    if STRACE is None:
        return None
    probe = [STRACE, "--seccomp-bpf", "-f", "-o", os.devnull, "true"]
    if subprocess.run(probe, capture_output=True, check=False).returncode != 0:
        return None
    samples: dict[str, dict[str, list[float]]] = {"uncontended": {}, "handover": {}}
    for i in range(runs):
        with tempfile.TemporaryDirectory(prefix="pearing-stages-") as t:
            tmp = Path(t)
            env = {k: v for k, v in os.environ.items() if not k.startswith("PEARING_")}
            env["PEARING_LOCK_DIR"] = str(tmp / f"lockdir{i}")
            for name, fn in (("uncontended", uncontended), ("handover", handover)):
                for stage, ms in fn(tmp, env).items():
                    samples[name].setdefault(stage, []).append(ms)
    return {name: {k: statistics.median(v) for k, v in s.items()} for name, s in samples.items()} | {"runs": runs}


def table(result: dict[str, Any]) -> str:
    lines = [f"stages (strace --seccomp-bpf, medians of {result['runs']} runs, ms):"]
    for name in ("uncontended", "handover"):
        lines.append(f"  {name}:")
        lines += [f"    {ms:7.1f}  {stage}" for stage, ms in result[name].items()]
    return "\n".join(lines) + "\n"


def main() -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.stages", description=__doc__)
    ap.add_argument("--runs", type=int, default=10)
    result = stages(ap.parse_args().runs)
    if result is None:
        sys.stderr.write("bench.stages: needs strace 5.3 or later, allowed to trace here\n")
        return 69
    sys.stdout.write(table(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
