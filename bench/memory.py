"""Memory per held lock: the proportional set size (PSS) of the pearing processes that keep one
lock (pearing-run's wrapper and its holder; COMMAND excluded), read from
``/proc/PID/smaps_rollup`` while ``count`` locks are held at once, beside flock(1) holding as
many. PSS shares each page among the processes that map it, so the sum over processes is what
the locks cost the host together."""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

_RUN = str(Path(sys.executable).parent / "pearing-run")
_FLOCK = shutil.which("flock")


def pss_kib(pid: int) -> int:
    """The process's PSS in KiB (0 once it is gone)."""
    try:
        text = Path(f"/proc/{pid}/smaps_rollup").read_text()
    except OSError:
        return 0
    for line in text.splitlines():
        if line.startswith("Pss:"):
            return int(line.split()[1])
    return 0


def _children(pid: int) -> list[int]:
    """Direct children of ``pid`` (from /proc/PID/task/*/children)."""
    out: list[int] = []
    for task in Path(f"/proc/{pid}/task").glob("*"):
        try:
            out += [int(c) for c in (task / "children").read_text().split()]
        except OSError:
            continue
    return out


def _comm(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/comm").read_text().strip()
    except OSError:
        return ""


def _holders(tmp: Path, tool: str, count: int, env: dict[str, str]) -> list[subprocess.Popen[bytes]]:
    procs = []
    for i in range(count):
        ready = tmp / f"{tool}-ready-{i}"
        script = f"touch {ready}; exec sleep 600"
        if tool == "pearing-run":
            argv = [_RUN, "--job", f"mem-{i}", "--", "sh", "-c", script]
        else:
            assert _FLOCK is not None
            argv = [_FLOCK, str(tmp / f"flock-{i}.lock"), "sh", "-c", script]
        procs.append(subprocess.Popen(argv, env=env, stdin=subprocess.DEVNULL, start_new_session=True))
    deadline = time.monotonic() + 60
    while not all((tmp / f"{tool}-ready-{i}").exists() for i in range(count)):
        if time.monotonic() > deadline:
            raise SystemExit(f"bench: {tool} holders did not start")
        time.sleep(0.01)
    return procs


def _lock_pss(top: int) -> int:
    """The wrapper (or flock) and its children that are not COMMAND (``sleep``)."""
    total = pss_kib(top)
    for child in _children(top):
        if _comm(child) != "sleep":
            total += pss_kib(child)
    return total


def _stop(procs: list[subprocess.Popen[bytes]]) -> None:
    for p in procs:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(p.pid, signal.SIGTERM)
    for p in procs:
        try:
            p.wait(30)
        except subprocess.TimeoutExpired:
            os.killpg(p.pid, signal.SIGKILL)
            p.wait()


def memory(tmp: Path, count: int, env: dict[str, str]) -> dict[str, Any]:
    tools = ["pearing-run"] + (["flock"] if _FLOCK else [])
    out: dict[str, Any] = {"locks": count}
    for tool in tools:
        procs = _holders(tmp, tool, count, env)
        try:
            time.sleep(0.5)  # past the holder's settling writes: a steady state, not the start
            per_lock = [_lock_pss(p.pid) for p in procs]
        finally:
            _stop(procs)
        out[tool] = {"pss_mib_per_lock": statistics.median(per_lock) / 1024, "pss_mib_total": sum(per_lock) / 1024}
    return out


def table(m: dict[str, Any]) -> list[str]:
    lines = ["", f"== memory: PSS of the processes keeping each of {m['locks']} held locks (COMMAND excluded) =="]
    for tool in ("pearing-run", "flock"):
        if tool in m:
            each, total = m[tool]["pss_mib_per_lock"], m[tool]["pss_mib_total"]
            lines.append(f"{tool:<30} {each:>8.2f} MiB a lock, {total:>8.1f} MiB in all")
    return lines
