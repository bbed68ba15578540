"""Schedules and events as they really arrive: --request-key, --min-interval, --metrics-dir."""

from __future__ import annotations

import time
from pathlib import Path

import pytest
from caps import Caps
from helpers import PEARING_CLI, Gate, Procs, q, wait_for
from prometheus_client.parser import text_string_to_metric_families

from singleflight.core.const import ENV_LOCK_DIR, ExitCode
from singleflight.core.keys import request_key_uuid


def count_runs(work: Path, name: str = "ran") -> int:
    p = work / name
    return len(p.read_text().splitlines()) if p.exists() else 0


def run_marking(procs: Procs, work: Path, *flags: str, status: int = 0, env: dict[str, str] | None = None) -> int:
    r = procs.pr_run(*flags, "--", "sh", "-c", f"echo x >> {q(work / 'ran')}; exit {status}", env=env)
    return r.returncode


def test_the_same_request_key_runs_once_and_another_key_runs(backend: str, procs: Procs, work: Path) -> None:
    for _ in range(3):
        assert run_marking(procs, work, "--job", "J", "--request-key", "evt_1NvXyZ") == 0
    assert count_runs(work) == 1
    assert run_marking(procs, work, "--job", "J", "--request-key", "Ev0123456789") == 0
    assert count_runs(work) == 2
    # The key is the documented UUIDv5: the same request as its uuid.
    uuid_of_key = request_key_uuid("evt_1NvXyZ")
    assert run_marking(procs, work, "--job", "J", "--request-uuid", uuid_of_key) == 0
    assert count_runs(work) == 2


def test_request_key_on_the_cli_is_the_same_request(backend: str, procs: Procs) -> None:
    a = procs.run_text([PEARING_CLI, "acquire-lock", "K", "--request-key", "delivery-42", "--lease-seconds", "5"])
    assert a.returncode == 0, a
    b = procs.run_text([PEARING_CLI, "acquire-lock", "K", "--request-key", "delivery-42", "--lease-seconds", "5"])
    assert b.returncode == 0 and b.json["ticket_id"] == a.json["ticket_id"], b
    assert a.json["request_uuid"] == request_key_uuid("delivery-42")
    assert procs.run_text([PEARING_CLI, "release-lock-ticket", "K", a.json["ticket_id"]]).returncode == 0


@pytest.mark.parametrize(
    "args",
    [
        ["--request-key", ""],
        ["--request-key", "a\nb"],
        ["--request-key", "x" * 257],
        ["--request-key", "k", "--request-uuid", "a2b6da75-a87d-44e0-b413-484354289702"],
        ["--min-interval", "0"],
        ["--min-interval", "-5m"],
        ["--min-interval", ""],
        ["--min-interval", "5 m"],
        ["--min-interval", "1y"],
        ["--metrics-dir", ""],
    ],
)
def test_bad_keys_and_durations_are_usage_errors(procs: Procs, lock_dir: Path, args: list[str]) -> None:
    r = procs.pr_run("--job", "J", *args, "--", "true")
    assert r.returncode == ExitCode.USAGE, r
    assert len(r.err_lines) == 1, r
    assert not lock_dir.exists()


def test_min_interval_dedupes_after_a_success_retries_after_a_failure_and_is_per_job(
    backend: str, procs: Procs, work: Path
) -> None:
    assert run_marking(procs, work, "--job", "J", "--min-interval", "1h", status=3) == 3
    assert run_marking(procs, work, "--job", "J", "--min-interval", "1h") == 0  # the failure did not count
    assert count_runs(work) == 2
    r = procs.pr_run("-v", "--job", "J", "--min-interval", "1h", "--", "sh", "-c", f"echo x >> {q(work / 'ran')}")
    assert r.returncode == 0 and count_runs(work) == 2, r
    assert any("deduplicated lock=J last_success_start=" in line for line in r.err_lines), r
    assert run_marking(procs, work, "--job", "other", "--min-interval", "1h") == 0  # another job runs
    assert count_runs(work) == 3


def test_a_short_interval_lets_the_next_run_through(backend: str, procs: Procs, work: Path) -> None:
    assert run_marking(procs, work, "--job", "J", "--min-interval", "2s") == 0
    started = time.time()
    assert run_marking(procs, work, "--job", "J", "--min-interval", "2s") == 0
    assert count_runs(work) == 1
    wait_for(lambda: time.time() >= started + 2.2, 10, "2.2 s to pass")
    assert run_marking(procs, work, "--job", "J", "--min-interval", "2s") == 0
    assert count_runs(work) == 2


def test_a_waiter_behind_the_successful_run_is_deduplicated(backend: str, procs: Procs, work: Path) -> None:
    gate = Gate(work)
    first = procs.pr(
        "--job", "J", "--min-interval", "1h", "--", "sh", "-c", f"echo x >> {q(work / 'ran')}; {gate.script()}"
    )
    gate.wait_ready()
    waiter = procs.pr(
        "-v", "--job", "J", "--min-interval", "1h", "--wait-seconds", "30", "--",
        "sh", "-c", f"echo y >> {q(work / 'ran')}",
    )  # fmt: skip
    wait_for(
        lambda: procs.run_text([PEARING_CLI, "status", "J", "--json"]).json[0]["waiters"], 15, "the waiter to queue"
    )
    gate.open()
    assert procs.finish(first).returncode == 0
    r = procs.finish(waiter)
    assert r.returncode == 0, r
    assert count_runs(work) == 1
    assert any("deduplicated" in line for line in r.err_lines), r


def test_two_hosts_sharing_the_store_firing_a_second_apart_run_once(
    caps: Caps, procs: Procs, work: Path, tmp_path: Path
) -> None:
    """Two lock dirs (two hosts) and one store: host B's cron fires 1 s after host A's job."""
    if not caps.shared_by_hosts:
        pytest.skip("the lock dir is one host's: two hosts share no lock through it")
    hosts = [{**procs.env, ENV_LOCK_DIR: str(tmp_path / f"host-{name}")} for name in ("a", "b")]
    assert run_marking(procs, work, "--job", "hourly", "--min-interval", "50m", env=hosts[0]) == 0
    fired = time.monotonic()
    wait_for(lambda: time.monotonic() >= fired + 1.0, 5, "host B's firing a second later")
    assert run_marking(procs, work, "--job", "hourly", "--min-interval", "50m", env=hosts[1]) == 0
    assert count_runs(work) == 1


def _metrics(metrics_dir: Path) -> dict[str, float]:
    (path,) = metrics_dir.glob("*.prom")
    out = {}
    for family in text_string_to_metric_families(path.read_text()):
        for sample in family.samples:
            assert sample.labels == {"pearing_job": "J", "pearing_repo": "default"}
            out[sample.name] = sample.value
    return out


def test_metrics_file_after_runs_busy_skips_and_dedupes(backend: str, procs: Procs, work: Path) -> None:
    mdir = work / "metrics"
    flags = ("--job", "J", "--metrics-dir", str(mdir))
    before = time.time()
    assert run_marking(procs, work, *flags, "--request-key", "e1", status=0) == 0
    m = _metrics(mdir)
    assert m["pearing_run_last_exit_code"] == 0
    assert before <= m["pearing_run_last_success_timestamp_seconds"] <= time.time()
    assert m["pearing_run_runs_total"] == 1 and m["pearing_run_running"] == 0
    assert run_marking(procs, work, *flags, "--request-key", "e1") == 0  # deduplicated
    assert run_marking(procs, work, *flags, status=5) == 5
    gate = Gate(work)
    holder = procs.pr(*flags, "--", "sh", "-c", gate.script())
    gate.wait_ready()
    assert _metrics(mdir)["pearing_run_running"] == 1
    assert procs.pr_run(*flags, "--", "true").returncode == ExitCode.BUSY
    gate.open()
    assert procs.finish(holder).returncode == 0
    m = _metrics(mdir)
    assert m["pearing_run_runs_total"] == 3
    assert m["pearing_run_deduplicated_total"] == 1
    assert m["pearing_run_busy_total"] == 1
    assert m["pearing_run_last_exit_code"] == 0
    assert m["pearing_run_running"] == 0


def test_a_lost_lease_is_counted(backend: str, procs: Procs, work: Path) -> None:
    mdir = work / "metrics"
    r = procs.pr_run(
        "--job", "J", "--metrics-dir", str(mdir), "--heartbeat", "manual", "--lease-seconds", "2",
        "--kill-grace", "1", "--", "sleep", "30",
    )  # fmt: skip
    assert r.returncode == ExitCode.LEASE_LOST, r
    m = _metrics(mdir)
    assert m["pearing_run_lease_lost_total"] == 1
    assert m["pearing_run_last_exit_code"] == ExitCode.LEASE_LOST


def test_a_metrics_write_that_fails_never_changes_the_exit_status(procs: Procs, work: Path) -> None:
    blocker = work / "not-a-dir"
    blocker.write_text("")
    r = procs.pr_run("--job", "J", "--metrics-dir", str(blocker / "m"), "--", "sh", "-c", "exit 3")
    assert r.returncode == 3, r
    assert r.err_lines and all("metrics" in line for line in r.err_lines), r
