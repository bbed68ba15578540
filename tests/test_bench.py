"""The benchmark itself keeps working: its quick mode runs every section and writes its JSON."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


def test_bench_quick_runs_every_section(tmp_path: Path) -> None:
    out = tmp_path / "bench.json"
    r = subprocess.run(
        [sys.executable, "-m", "bench", "--quick", "--out", str(out)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    assert r.returncode == 0, r.stderr
    result = json.loads(out.read_text())
    assert {"startup", "handover", "waiters", "expiry", "many_locks", "memory", "growth"} <= set(result)
    assert "pearing-cli heartbeat" in result["startup"]["median_ms"], result["startup"]
    mem = result["memory"]
    # A held lock's pearing processes map at least an interpreter's worth of pages of their own.
    assert mem["locks"] == 3 and 1.0 < mem["pearing-run"]["pss_mib_per_lock"] < 100, mem
    assert result["handover"]["fifo_kept"] and result["waiters"]["fifo_kept"]
    assert result["expiry"]["token_refused_in_term_trap"] == "3/3"
    assert result["many_locks"]["status_listed"] == 200
    assert "hand-over, chains of 5 waiters" in r.stdout
    _check_growth(result["growth"], r.stdout)
    stores = result["stores"]
    if stores is not None:  # PostgreSQL's server and the postgres extra are here
        assert stores["fifo_kept"] and stores["postgres"]["n"] == 5 and stores["postgres"]["p50_ms"] > 0, stores
        assert stores["lock dir"]["n"] == 5, stores
        assert "== hand-over on each store" in r.stdout
    else:
        assert "hand-over on each store: skipped" in r.stdout
    if shutil.which("strace"):  # stage stamps: each stage found in the trace, none negative
        for run in ("uncontended", "handover"):
            assert all(ms >= 0 for ms in result["stages"][run].values()), result["stages"]
        assert "holder handed the fd to fence durable (fsyncs)" in result["stages"]["handover"], result["stages"]


def _check_growth(g: dict[str, object], stdout: str) -> None:
    """Every curve has a value and a ratio for each size, and a shape; the locks held in the
    bench's own process show as held to pearing-cli status, and every lock to --idle."""
    st = g["status"]
    assert isinstance(st, dict)
    curves = [g["handover lock dir"], st["status"], st["status --idle"]]
    if shutil.which("etcd") and shutil.which("etcdctl"):
        line = g["etcd line"]
        assert isinstance(line, dict)
        curves += [g["handover etcd"], line["head hand-over p50 ms"], line["drain ms a waiter"]]
        assert line["fifo_kept"] and line["waiters_lost"] == 0, line
    for c in curves:
        assert isinstance(c, dict)
        assert len(c["sizes"]) == len(c["values"]) == len(c["ratios"]) >= 2, c
        assert c["ratios"][0] == 1.0 and all(v > 0 for v in c["values"]), c
        assert c["shape"] in {"flat", "linear", "worse"} and len(c["added_per_unit"]) == len(c["sizes"]) - 1, c
    assert st["status"]["listed_held"] == [st["held"]] * len(st["status"]["sizes"]), st
    assert st["status --idle"]["listed"] == st["status --idle"]["sizes"], st
    assert "== growth:" in stdout


# Every stage of both traces, in order: each ends at the call that marks it in the trace.
PEARING_STAGES = [
    "gate opened to the old COMMAND's exit",
    "old wrapper reaps it (pidfd, wait4)",
    "old wrapper writes `exited` to its holder",
    "old holder reads `exited` (a wake-up)",
    "old holder sends its release txn (end record, key deleted)",
    "next wrapper's watch returns (etcd: fsync, apply, notify; a wake-up)",
    "it sends its read (first in line? ticket live? guards?)",
    "the read's round trip",
    "it writes `go` (the grip) to its standby holder",
    "the holder's recvmsg returns (a wake-up)",
    "the holder takes the lease (ticket, token hash, token file), writes `ready`",
    "the wrapper reads it (a wake-up), makes COMMAND's environment, writes `spawning`",
    "it spawns COMMAND (clone3)",
    "COMMAND's exec",
]
ETCDCTL_STAGES = [
    "gate opened to the old COMMAND's exit",
    "old etcdctl reaps it (wait4)",
    "old etcdctl sends its unlock (Delete)",
    "next etcdctl's watch returns (etcd: fsync, apply, notify; a wake-up)",
    "it sends its Get (anyone left ahead?)",
    "the Get's round trip",
    "it spawns COMMAND (clone, CLONE_VFORK)",
    "COMMAND's exec",
]
TOTAL = "total: gate opened to next COMMAND's exec"


@pytest.mark.skipif(
    any(shutil.which(t) is None for t in ("strace", "etcd", "etcdctl")) and os.environ.get("CI") != "true",
    reason="needs strace, etcd and etcdctl",
)
def test_stages_etcd_hand_over_side_by_side_with_etcdctl() -> None:
    """One traced etcd hand-over of each (one run, no warm-up: a few seconds): every stage found,
    none negative, and within one run the stages add up to the total, as the phases both share."""
    r = subprocess.run(
        [sys.executable, "-m", "bench.stages", "--runs", "1", "--only", "etcd", "--json"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert r.returncode == 0, r.stderr
    result = json.loads(r.stdout)["etcd"]
    assert result["runs"] == 1
    for tool, names in (("pearing-run", PEARING_STAGES), ("etcdctl lock", ETCDCTL_STAGES)):
        stages = result[tool]
        assert [k for k in stages if k != TOTAL and not k.startswith("(aside)")] == names, stages
        assert all(ms >= 0 for ms in stages.values()), stages
        assert 0 < stages[TOTAL] < 10_000, stages
        assert abs(sum(stages[k] for k in names) - stages[TOTAL]) < 0.01, stages
        phases = [v[tool] for v in result["side by side"].values()]
        assert all(ms >= 0 for ms in phases) and abs(sum(phases) - stages[TOTAL]) < 0.01, result["side by side"]
    assert len(result["side by side"]) == 7
    for v in result["side by side"].values():
        assert abs(v["extra"] - (v["pearing-run"] - v["etcdctl lock"])) < 1e-9, v
    assert result["pearing-run"]["(aside) the old holder's release txn, round trip"] > 0
    # One write (the release) and one read (the waiter's look) between the two COMMANDs, each.
    for tool in ("pearing-run", "etcdctl lock"):
        assert result[tool]["(aside) requests to etcd, gate opened to COMMAND's exec (a count)"] >= 2, result[tool]
