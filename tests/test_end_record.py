"""The end-of-run record (the request's outcome, a success's start, the metrics' end) is written
once, by one function, whoever finishes the run: a holder killed right after COMMAND's success
leaves it to its wrapper, and nothing of it is lost."""

from __future__ import annotations

import re
import uuid
from pathlib import Path

from helpers import Procs

from singleflight.core.const import ENV_FAULT


def _series(prom: str, name: str) -> float:
    m = re.search(rf"^{name}\{{[^}}]*\}} (\S+)$", prom, re.M)
    assert m is not None, f"{name} not in:\n{prom}"
    return float(m.group(1))


def test_a_holder_killed_right_after_command_succeeded_leaves_the_whole_end_record(
    backend: str, work_procs: Procs, work: Path
) -> None:
    job, key, metrics = f"end-{uuid.uuid4().hex[:8]}", "event-1", work / "metrics"
    metrics.mkdir()
    common = ["--job", job, "--min-interval", "1h", "--metrics-dir", str(metrics)]
    armed = dict(work_procs.env, **{ENV_FAULT: "before-finish"})
    first = work_procs.pr_run(*common, "--request-key", key, "--", "sh", "-c", "echo ran >> ran", env=armed)
    assert first.returncode == 0, first
    assert (work / "ran").read_text() == "ran\n"

    # The replay of the same event is deduplicated by the request's record ...
    replay = work_procs.pr_run(*common, "--request-key", key, "--", "sh", "-c", "echo ran >> ran")
    assert replay.returncode == 0, replay
    # ... and another event inside the interval by the success's start.
    other = work_procs.pr_run(*common, "--request-key", "event-2", "--", "sh", "-c", "echo ran >> ran")
    assert other.returncode == 0, other
    assert (work / "ran").read_text() == "ran\n", "a run was replayed after its holder died"

    prom = next(metrics.glob("*.prom")).read_text()
    assert _series(prom, "pearing_run_runs_total") == 1, prom
    assert _series(prom, "pearing_run_last_exit_code") == 0, prom
    assert _series(prom, "pearing_run_deduplicated_total") == 2, prom
    assert _series(prom, "pearing_run_running") == 0, prom
