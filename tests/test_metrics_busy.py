"""A metrics write never changes pearing-run's exit status (SPEC 14), not even one that waits
for the metrics dir's lock past the lease: the run's outcome is settled (its request recorded,
the lock released) before the end of the run is written, and what could not be written while
the lock was taken is written once it frees."""

from __future__ import annotations

from pathlib import Path

import pytest
from helpers import Procs, q, wait_for
from prometheus_client.parser import text_string_to_metric_families

from singleflight.core.metrics import LOCK_NAME, MetricsError, file_name, record


def samples(mdir: Path, job: str) -> dict[str, float]:
    path = mdir / file_name("default", job)
    if not path.exists():
        return {}
    return {s.name: s.value for f in text_string_to_metric_families(path.read_text()) for s in f.samples}


def test_a_metrics_lock_held_past_the_lease_never_turns_a_success_into_124(
    backend: str, procs: Procs, work: Path
) -> None:
    mdir = work / "metrics"
    mdir.mkdir()
    locked = work / "locked"
    # Another process holds the metrics dir's lock for 14 s: longer than the metrics write
    # waits (5 s), much longer than the 2 s lease.
    locker = procs.start(["flock", str(mdir / LOCK_NAME), "sh", "-c", f"touch {q(locked)}; exec sleep 14"])
    wait_for(locked.exists, 10, "the metrics lock to be held")
    runs = work / "runs"
    args = (
        "--job", "m6", "--lease-seconds", "2", "--metrics-dir", str(mdir), "--request-key", "ev1",
        "--", "sh", "-c", f"echo run >> {q(runs)}",
    )  # fmt: skip
    first = procs.pr_run(*args, timeout=90)
    assert first.returncode == 0, first
    replay = procs.pr_run(*args, timeout=90)
    assert replay.returncode == 0, replay
    assert runs.read_text().splitlines() == ["run"], "the replay ran COMMAND again"
    procs.finish(locker, timeout=30)
    want = {
        "pearing_run_runs_total": 1,
        "pearing_run_running": 0,
        "pearing_run_last_exit_code": 0,
        "pearing_run_deduplicated_total": 1,
        "pearing_run_busy_total": 0,
        "pearing_run_lease_lost_total": 0,
    }

    def right() -> bool:
        got = samples(mdir, "m6")
        return all(got.get(k) == v for k, v in want.items()) and "pearing_run_last_success_timestamp_seconds" in got

    wait_for(right, 60, "the metrics file to show the run and the replay")


def test_an_end_written_after_the_next_start_leaves_running_to_that_run(tmp_path: Path) -> None:
    """The end of a run lands after the release, so possibly after the next run's start."""
    mdir, job = str(tmp_path), "order"
    record(mdir, "default", job, "start", now=100.0)
    record(mdir, "default", job, "start", now=105.0)  # the next run, promoted at our release
    record(mdir, "default", job, "end", now=104.0, exit_code=0, duration=4.0, started=100.0)
    got = samples(tmp_path, job)
    assert got["pearing_run_running"] == 1 and got["pearing_run_last_exit_code"] == 0, got
    record(mdir, "default", job, "end", now=106.0, exit_code=3, duration=1.0, started=105.0)
    got = samples(tmp_path, job)
    assert got["pearing_run_running"] == 0 and got["pearing_run_last_exit_code"] == 3, got


def test_a_start_written_late_counts_the_run_and_never_sets_running(tmp_path: Path) -> None:
    """A start that found the metrics lock taken is written after its run ended, in whatever
    order with the next run's writes: it counts, and running stays the truth."""
    mdir, job = str(tmp_path), "late"
    record(mdir, "default", job, "start", now=105.0)  # the next run's start came first
    record(mdir, "default", job, "start", now=100.0, late=True)
    record(mdir, "default", job, "end", now=104.0, exit_code=0, duration=4.0, started=100.0)
    got = samples(tmp_path, job)
    assert got["pearing_run_runs_total"] == 2 and got["pearing_run_running"] == 1, got
    assert got["pearing_run_last_start_timestamp_seconds"] == 105.0, got
    record(mdir, "default", job, "start", now=110.0, late=True)
    assert samples(tmp_path, job)["pearing_run_running"] == 1


def test_started_and_late_belong_to_end_and_start(tmp_path: Path) -> None:
    with pytest.raises(MetricsError, match="started belong"):
        record(str(tmp_path), "default", "j", "busy", now=1.0, started=0.5)
    with pytest.raises(MetricsError, match="late belongs"):
        record(str(tmp_path), "default", "j", "end", now=1.0, exit_code=0, duration=1.0, late=True)
    with pytest.raises(MetricsError, match="bad start time"):
        record(str(tmp_path), "default", "j", "end", now=1.0, exit_code=0, duration=1.0, started=-1.0)
