"""``singleflight.core.metrics``: the textfile collector files of ``--metrics-dir``.

Every file is read back with prometheus_client's parser (what a scrape would see). Concurrent
writers are real processes released together; the unwritable-dir case runs the writer as
``nobody`` when the tests run as root, since root ignores directory permissions.
"""

from __future__ import annotations

import ast
import fcntl
import json
import os
import shutil
import stat
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from prometheus_client.parser import text_string_to_metric_families

from singleflight.core import metrics, promtext
from singleflight.core.errors import PearingError
from singleflight.core.metrics import MetricsError, file_name, record

REPO, JOB = "teams/platform/web", "checkin"
NOBODY = 65534

segment = st.text(st.sampled_from("abZ09._-"), min_size=1, max_size=12).filter(lambda s: s not in (".", ".."))
repos = st.lists(segment, min_size=1, max_size=5).map("/".join).filter(lambda r: len(r) <= 200)
jobs = st.builds(
    lambda first, rest: first + rest,
    st.sampled_from("aZ9"),
    st.text(st.sampled_from("abZ09._-"), max_size=20),
)
long_repos = st.integers(150, 200).map(lambda n: "r/" * (n // 2) + "x")


@pytest.fixture
def mdir(tmp_path: Path) -> Path:
    """A metrics dir that does not exist yet; its parent does."""
    return tmp_path / "metrics"


def read(mdir: Path, repo: str = REPO, job: str = JOB) -> dict[str, float]:
    """Sample name to value, as a scrape sees the file; asserts every family is well formed."""
    text = (mdir / file_name(repo, job)).read_text()
    out: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        assert family.documentation
        assert family.type in ("gauge", "counter")
        for sample in family.samples:
            assert sample.labels == {"pearing_job": job, "pearing_repo": repo}
            assert sample.timestamp is None  # node_exporter refuses sample timestamps
            out[sample.name] = sample.value
    return out


def entries(mdir: Path) -> list[str]:
    return sorted(os.listdir(mdir))


def test_last_run_is_carried(mdir: Path) -> None:
    record(str(mdir), REPO, JOB, "start", now=1000.25)
    assert read(mdir) == {
        "pearing_run_running": 1,
        "pearing_run_last_start_timestamp_seconds": 1000.25,
        "pearing_run_runs_total": 1,
        "pearing_run_busy_total": 0,
        "pearing_run_deduplicated_total": 0,
        "pearing_run_lease_lost_total": 0,
    }
    record(str(mdir), REPO, JOB, "end", now=1002.75, exit_code=0, duration=2.5)
    got = read(mdir)
    assert got["pearing_run_running"] == 0
    assert got["pearing_run_last_exit_code"] == 0
    assert got["pearing_run_last_start_timestamp_seconds"] == 1000.25
    assert got["pearing_run_last_end_timestamp_seconds"] == 1002.75
    assert got["pearing_run_last_success_timestamp_seconds"] == 1002.75
    assert got["pearing_run_last_duration_seconds"] == 2.5
    assert entries(mdir) == sorted([".pearing_metrics.lock", file_name(REPO, JOB)])


def test_types_and_help_are_the_same_in_every_file(mdir: Path) -> None:
    # node_exporter refuses one metric name carrying two help texts across files.
    record(str(mdir), REPO, JOB, "busy", now=1.0)
    record(str(mdir), "other", "job2", "start", now=2.0)
    record(str(mdir), "other", "job2", "end", now=3.0, exit_code=3, duration=1.0)

    def comments(name: str) -> set[str]:
        return {line for line in (mdir / name).read_text().splitlines() if line.startswith("#")}

    first, second = comments(file_name(REPO, JOB)), comments(file_name("other", "job2"))
    assert first <= second
    families = {f.name: f.type for f in text_string_to_metric_families((mdir / file_name("other", "job2")).read_text())}
    assert families["pearing_run_runs"] == "counter"
    assert families["pearing_run_running"] == "gauge"
    assert families["pearing_run_last_exit_code"] == "gauge"


def test_counters_accumulate_across_calls(mdir: Path) -> None:
    now = 5000.0
    for _ in range(3):
        record(str(mdir), REPO, JOB, "start", now=now)
        record(str(mdir), REPO, JOB, "end", now=now + 1, exit_code=0, duration=1.0)
        now += 10
    for _ in range(2):
        record(str(mdir), REPO, JOB, "busy", now=now)
    for _ in range(4):
        record(str(mdir), REPO, JOB, "deduplicated", now=now)
    record(str(mdir), REPO, JOB, "start", now=now)
    record(str(mdir), REPO, JOB, "lease_lost", now=now + 60)
    record(str(mdir), REPO, JOB, "end", now=now + 61, exit_code=124, duration=61.0)
    got = read(mdir)
    assert got["pearing_run_runs_total"] == 4
    assert got["pearing_run_busy_total"] == 2
    assert got["pearing_run_deduplicated_total"] == 4
    assert got["pearing_run_lease_lost_total"] == 1
    assert got["pearing_run_last_exit_code"] == 124
    assert got["pearing_run_last_success_timestamp_seconds"] == 5021.0
    assert got["pearing_run_running"] == 0


def test_failure_does_not_move_last_success(mdir: Path) -> None:
    record(str(mdir), REPO, JOB, "start", now=100.0)
    record(str(mdir), REPO, JOB, "end", now=101.0, exit_code=0, duration=1.0)
    record(str(mdir), REPO, JOB, "start", now=200.0)
    record(str(mdir), REPO, JOB, "end", now=230.5, exit_code=1, duration=30.5)
    got = read(mdir)
    assert got["pearing_run_last_success_timestamp_seconds"] == 101.0
    assert got["pearing_run_last_end_timestamp_seconds"] == 230.5
    assert got["pearing_run_last_exit_code"] == 1
    assert got["pearing_run_last_duration_seconds"] == 30.5


def test_never_succeeded_has_no_success_series(mdir: Path) -> None:
    record(str(mdir), REPO, JOB, "start", now=100.0)
    record(str(mdir), REPO, JOB, "end", now=101.0, exit_code=127, duration=0.0)
    got = read(mdir)
    assert "pearing_run_last_success_timestamp_seconds" not in got
    assert got["pearing_run_last_exit_code"] == 127


def test_busy_keeps_the_holders_running_state(mdir: Path) -> None:
    record(str(mdir), REPO, JOB, "start", now=100.0)
    record(str(mdir), REPO, JOB, "busy", now=101.0)
    assert read(mdir)["pearing_run_running"] == 1


WRITER = """
import sys, time
from singleflight.core.metrics import record
mdir, repo, job, event, n = sys.argv[1:6]
sys.stdin.read(1)  # released together with the others
for _ in range(int(n)):
    if event == "run":
        record(mdir, repo, job, "start", now=time.time())
        record(mdir, repo, job, "end", now=time.time(), exit_code=0, duration=0.0)
    else:
        record(mdir, repo, job, event, now=time.time())
"""


def run_together(argvs: list[list[str]], logs: Path) -> None:
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", WRITER, *argv],
            stdin=subprocess.PIPE,
            stderr=(logs / f"writer{i}.err").open("wb"),
        )
        for i, argv in enumerate(argvs)
    ]
    try:
        for p in procs:
            assert p.stdin is not None
            p.stdin.write(b"g")
            p.stdin.close()
        for i, p in enumerate(procs):
            assert p.wait(timeout=120) == 0, (logs / f"writer{i}.err").read_text()
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()


def test_concurrent_writers_lose_no_increment(mdir: Path, tmp_path: Path) -> None:
    mdir.mkdir()
    run_together([[str(mdir), REPO, JOB, "busy", "50"] for _ in range(8)], tmp_path)
    assert read(mdir)["pearing_run_busy_total"] == 400
    assert entries(mdir) == sorted([".pearing_metrics.lock", file_name(REPO, JOB)])


def test_concurrent_holder_and_skips_of_one_job(mdir: Path, tmp_path: Path) -> None:
    mdir.mkdir()
    argvs = [[str(mdir), REPO, JOB, "run", "40"], [str(mdir), "other/repo", JOB, "busy", "40"]]
    argvs += [[str(mdir), REPO, JOB, event, "40"] for event in ("busy", "busy", "deduplicated", "lease_lost")]
    run_together(argvs, tmp_path)
    got = read(mdir)
    assert got["pearing_run_runs_total"] == 40
    assert got["pearing_run_busy_total"] == 80
    assert got["pearing_run_deduplicated_total"] == 40
    assert got["pearing_run_lease_lost_total"] == 40
    assert got["pearing_run_running"] == 0
    assert read(mdir, "other/repo", JOB)["pearing_run_busy_total"] == 40


@pytest.fixture
def shared_base() -> Iterator[Path]:
    """A dir ``nobody`` can traverse (pytest's tmp_path is 0700)."""
    base = Path(tempfile.mkdtemp(prefix="pearing-metrics-test-"))
    base.chmod(0o755)
    try:
        yield base
    finally:
        for root, dirs, _ in os.walk(base):
            for d in dirs:
                Path(root, d).chmod(0o755)
        shutil.rmtree(base)


FAILING_WRITER = """
import json, os, sys, time
from singleflight.core.metrics import MetricsError, record  # before dropping: /root may be 0700
if os.geteuid() == 0:
    os.setgroups([])
    os.setgid(int(sys.argv[2]))
    os.setuid(int(sys.argv[2]))
try:
    record(sys.argv[1], "teams/platform/web", "checkin", "busy", now=time.time())
except MetricsError as exc:
    print(json.dumps({"error": str(exc), "path": exc.path}))
else:
    print(json.dumps({"error": None}))
"""


def test_unwritable_dir_raises_metrics_error_and_leaves_no_temp(shared_base: Path) -> None:
    mdir = shared_base / "metrics"
    record(str(mdir), REPO, JOB, "busy", now=1.0)
    before = (mdir / file_name(REPO, JOB)).read_bytes()
    mdir.chmod(0o555)
    out = subprocess.run(
        [sys.executable, "-c", FAILING_WRITER, str(mdir), str(NOBODY)],
        capture_output=True,
        text=True,
        check=True,
        timeout=60,
    )
    result = json.loads(out.stdout)
    assert result["error"] is not None
    assert result["error"].startswith(f"metrics not written to {mdir}/{file_name(REPO, JOB)}: ")
    assert "temp file .pearing_metrics." in result["error"]
    assert "Permission denied" in result["error"]
    assert "\n" not in result["error"]
    assert entries(mdir) == sorted([".pearing_metrics.lock", file_name(REPO, JOB)])
    assert (mdir / file_name(REPO, JOB)).read_bytes() == before


def test_symlink_at_target_refused(mdir: Path, tmp_path: Path) -> None:
    victim = tmp_path / "victim"
    victim.write_text("precious\n")
    mdir.mkdir()
    target = mdir / file_name(REPO, JOB)
    target.symlink_to(victim)
    with pytest.raises(MetricsError, match="is a symlink") as info:
        record(str(mdir), REPO, JOB, "busy", now=1.0)
    assert info.value.path == str(target)
    assert victim.read_text() == "precious\n"
    assert target.is_symlink()
    assert entries(mdir) == sorted([".pearing_metrics.lock", file_name(REPO, JOB)])


def test_symlink_at_lock_or_temp_refused(mdir: Path, tmp_path: Path) -> None:
    victim = tmp_path / "victim"
    victim.write_text("precious\n")
    mdir.mkdir()
    (mdir / ".pearing_metrics.lock").symlink_to(victim)
    with pytest.raises(MetricsError, match="symlink"):
        record(str(mdir), REPO, JOB, "busy", now=1.0)
    (mdir / ".pearing_metrics.lock").unlink()
    tmp = mdir / f".pearing_metrics.{os.getpid()}.tmp"
    tmp.symlink_to(victim)
    with pytest.raises(MetricsError, match="symlink"):
        record(str(mdir), REPO, JOB, "busy", now=1.0)
    assert victim.read_text() == "precious\n"
    assert not (mdir / file_name(REPO, JOB)).exists()


def test_fifo_or_dir_at_target_refused_without_hanging(mdir: Path) -> None:
    mdir.mkdir()
    target = mdir / file_name(REPO, JOB)
    os.mkfifo(target)
    with pytest.raises(MetricsError, match="not a regular file"):
        record(str(mdir), REPO, JOB, "busy", now=1.0)
    target.unlink()
    target.mkdir()
    with pytest.raises(MetricsError, match="not a regular file"):
        record(str(mdir), REPO, JOB, "busy", now=1.0)
    assert entries(mdir) == sorted([".pearing_metrics.lock", file_name(REPO, JOB)])


def test_lock_held_too_long_gives_up(mdir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    mdir.mkdir()
    monkeypatch.setattr(metrics, "_LOCK_WAIT", 0.3)
    fd = os.open(mdir / ".pearing_metrics.lock", os.O_RDONLY | os.O_CREAT, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)  # another open file description: conflicts even in-process
        started = time.monotonic()
        with pytest.raises(MetricsError, match="still locked"):
            record(str(mdir), REPO, JOB, "busy", now=1.0)
        assert 0.3 <= time.monotonic() - started < 5
    finally:
        os.close(fd)
    record(str(mdir), REPO, JOB, "busy", now=1.0)
    assert read(mdir)["pearing_run_busy_total"] == 1


@pytest.mark.parametrize(
    "content",
    [
        b"garbage\x00\xff\n",
        b"pearing_run_busy_total 7\n",
        b'pearing_run_busy_total{job="someone",repo="else"} 7\n',
        b'pearing_run_busy_total{job="checkin",repo="teams/platform/web"} -3\n',
        b'pearing_run_busy_total{job="checkin",repo="teams/platform/web"} 1e3\n',
        b'pearing_run_busy_total{job="checkin",repo="teams/platform/web"} ' + b"9" * 40 + b"\n",
        b'pearing_run_last_end_timestamp_seconds{job="checkin",repo="teams/platform/web"} NaN\n',
        b"\xc3\x28 not utf-8\n",
        b"#" * 100_000,
        b"",
    ],
    ids=[
        "binary",
        "no-labels",
        "other-labels",
        "negative",
        "exponent",
        "huge",
        "nan",
        "bad-utf8",
        "huge-file",
        "empty",
    ],
)
def test_corrupt_or_foreign_previous_file_restarts_counters(mdir: Path, content: bytes) -> None:
    mdir.mkdir()
    (mdir / file_name(REPO, JOB)).write_bytes(content)
    record(str(mdir), REPO, JOB, "busy", now=1.0)
    got = read(mdir)
    assert got["pearing_run_busy_total"] == 1
    assert "pearing_run_last_end_timestamp_seconds" not in got


def test_a_file_with_the_old_job_and_repo_labels_keeps_its_counters(mdir: Path) -> None:
    """Before 0.3 the labels were ``job`` / ``repo`` (which Prometheus renames to
    ``exported_job`` on scrape): such a file is read, then rewritten with the new ones."""
    mdir.mkdir()
    old = f'pearing_run_busy_total{{job="{JOB}",repo="{REPO}"}} 41\n'
    (mdir / file_name(REPO, JOB)).write_text(old)
    record(str(mdir), REPO, JOB, "busy", now=1.0)
    assert read(mdir)["pearing_run_busy_total"] == 42
    assert 'job="' not in (mdir / file_name(REPO, JOB)).read_text().replace("pearing_job=", "")


def test_the_documented_alert_selects_the_series_a_scrape_gets(mdir: Path) -> None:
    """The alert in docs/schedules-and-metrics.md (moved there from the README),
    ``...{pearing_job="checkin"}``, against the textfile as a scrape parses it
    (prometheus_client): the label it names is there, with the job's name."""
    page = (Path(__file__).parents[1] / "docs/schedules-and-metrics.md").read_text()
    alert = next(line for line in page.splitlines() if "expr:" in line and "last_success" in line)
    selector = alert.split("{", 1)[1].split("}", 1)[0]
    key, _, value = selector.partition("=")
    record(str(mdir), "default", "checkin", "start", now=1.0)
    record(str(mdir), "default", "checkin", "end", now=2.0, exit_code=0, duration=1.0, started=1.0)
    text = (mdir / file_name("default", "checkin")).read_text()
    found = [
        s
        for f in text_string_to_metric_families(text)
        for s in f.samples
        if s.name == "pearing_run_last_success_timestamp_seconds"
    ]
    assert found and all(s.labels.get(key) == value.strip('"') for s in found), (selector, found)
    assert key != "job"  # a scrape would rename it to exported_job


def test_unknown_series_dropped_counters_kept(mdir: Path) -> None:
    record(str(mdir), REPO, JOB, "busy", now=1.0)
    target = mdir / file_name(REPO, JOB)
    target.write_bytes(target.read_bytes() + b'pearing_run_future_total{job="x"} 5\n# a comment\n\n')
    record(str(mdir), REPO, JOB, "busy", now=2.0)
    assert read(mdir)["pearing_run_busy_total"] == 2
    assert b"future" not in target.read_bytes()


def test_missing_dir_created_0755_whatever_the_umask(mdir: Path) -> None:
    old = os.umask(0o077)
    try:
        record(str(mdir), REPO, JOB, "busy", now=1.0)
    finally:
        os.umask(old)
    assert stat.S_IMODE(mdir.stat().st_mode) == 0o755
    assert stat.S_IMODE((mdir / file_name(REPO, JOB)).stat().st_mode) == 0o644


def test_existing_dir_mode_left_alone(mdir: Path) -> None:
    mdir.mkdir(mode=0o700)
    mdir.chmod(0o700)
    record(str(mdir), REPO, JOB, "busy", now=1.0)
    assert stat.S_IMODE(mdir.stat().st_mode) == 0o700


def test_missing_parent_not_created(tmp_path: Path) -> None:
    deep = tmp_path / "no" / "metrics"
    with pytest.raises(MetricsError, match="parents are not created"):
        record(str(deep), REPO, JOB, "busy", now=1.0)
    assert not (tmp_path / "no").exists()


def test_dir_path_that_is_a_file(tmp_path: Path) -> None:
    (tmp_path / "file").write_text("")
    with pytest.raises(MetricsError, match="Not a directory"):
        record(str(tmp_path / "file"), REPO, JOB, "busy", now=1.0)


@pytest.mark.parametrize(
    ("repo", "job", "event", "kwargs"),
    [
        ("../x", JOB, "busy", {}),
        ("/abs", JOB, "busy", {}),
        ("a" * 201, JOB, "busy", {}),
        (REPO, "-job", "busy", {}),
        (REPO, "a/b", "busy", {}),
        (REPO, "j" * 129, "busy", {}),
        (REPO, JOB, "stop", {}),
        (REPO, JOB, "end", {}),
        (REPO, JOB, "end", {"exit_code": 0}),
        (REPO, JOB, "end", {"duration": 1.0}),
        (REPO, JOB, "end", {"exit_code": 256, "duration": 1.0}),
        (REPO, JOB, "end", {"exit_code": -1, "duration": 1.0}),
        (REPO, JOB, "end", {"exit_code": True, "duration": 1.0}),
        (REPO, JOB, "end", {"exit_code": 0, "duration": -1.0}),
        (REPO, JOB, "end", {"exit_code": 0, "duration": float("nan")}),
        (REPO, JOB, "busy", {"exit_code": 0}),
        (REPO, JOB, "start", {"duration": 1.0}),
        (REPO, JOB, "busy", {"now": float("inf")}),
        (REPO, JOB, "busy", {"now": -1.0}),
        (REPO, JOB, "busy", {"now": True}),
        (REPO, JOB, "busy", {"now": 10**400}),
        (REPO, JOB, "busy", {"now": "1.0"}),
        (REPO, JOB, "end", {"exit_code": 0, "duration": 10**400}),
    ],
)
def test_bad_arguments_are_metrics_errors(
    mdir: Path, repo: str, job: str, event: str, kwargs: dict[str, object]
) -> None:
    args: dict[str, object] = {"now": 1.0, **kwargs}
    with pytest.raises(MetricsError) as info:
        record(str(mdir), repo, job, event, **args)  # type: ignore[arg-type]
    assert "\n" not in str(info.value)
    assert not mdir.exists()


def test_empty_or_nul_dir_argument() -> None:
    with pytest.raises(MetricsError, match="empty metrics dir"):
        record("", REPO, JOB, "busy", now=1.0)
    with pytest.raises(MetricsError, match="NUL"):
        record("a\0b", REPO, JOB, "busy", now=1.0)


def test_metrics_error_is_the_one_pearing_error() -> None:
    exc = MetricsError("/m/x.prom", "No space left on device")
    assert isinstance(exc, PearingError)
    assert str(exc) == "metrics not written to /m/x.prom: No space left on device"
    assert (exc.path, exc.detail) == ("/m/x.prom", "No space left on device")


def test_brief_collision_pairs_get_different_files(mdir: Path) -> None:
    # Pairs that collide under naive joins such as "<job>__<repo with / as _>".
    pairs = [("a/b", "c"), ("a", "b_c"), ("a_b", "c"), ("c", "a__b"), ("b__c", "a"), ("a/b/c", "d"), ("a", "b.c")]
    for i, (repo, job) in enumerate(pairs):
        record(str(mdir), repo, job, "start", now=float(i))
    assert len({file_name(r, j) for r, j in pairs}) == len(pairs)
    for i, (repo, job) in enumerate(pairs):
        assert read(mdir, repo, job)["pearing_run_last_start_timestamp_seconds"] == float(i)


def decode(name: str) -> tuple[str, str]:
    assert name.startswith("pearing_") and name.endswith(".prom")
    job, at, repo = name[len("pearing_") : -len(".prom")].partition("@")
    assert at and "@" not in repo
    return repo.replace("+", "/"), job


@settings(max_examples=400, deadline=None)
@given(repos, jobs)
def test_short_names_decode_back(repo: str, job: str) -> None:
    name = file_name(repo, job)
    assert "/" not in name and len(name.encode()) <= 255
    if "~" not in name:
        assert decode(name) == (repo, job)


@settings(max_examples=200, deadline=None)
@given(st.lists(st.tuples(st.one_of(repos, long_repos), jobs), min_size=2, max_size=20, unique=True))
def test_distinct_pairs_distinct_files(pairs: list[tuple[str, str]]) -> None:
    names_ = [file_name(r, j) for r, j in pairs]
    assert len(set(names_)) == len(pairs)
    for name in names_:
        assert name.endswith(".prom") and not name.startswith(".")
        assert len(name.encode()) <= 255


def test_longest_pairs_fit_and_differ(mdir: Path) -> None:
    job = "j" * 128
    repo_a, repo_b = "r" * 199 + "a", "r" * 199 + "b"
    name_a, name_b = file_name(repo_a, job), file_name(repo_b, job)
    assert name_a != name_b
    assert len(name_a) == 255 and "~" in name_a
    record(str(mdir), repo_a, job, "busy", now=1.0)
    record(str(mdir), repo_b, job, "busy", now=1.0)
    record(str(mdir), repo_b, job, "busy", now=1.0)
    assert read(mdir, repo_a, job)["pearing_run_busy_total"] == 1
    assert read(mdir, repo_b, job)["pearing_run_busy_total"] == 2


@pytest.mark.parametrize(
    ("repo", "job"),
    [("a.b-c_d/E.F", "x-y_z.9"), ('quote"d', "back\\slash"), ("new\nline", 'both\\"')],
)
def test_labels_escaped_validly(repo: str, job: str) -> None:
    # Validated names never carry these characters; the format must hold up anyway.
    data = promtext.render({"pearing_run_busy_total": 3, "pearing_run_last_duration_seconds": 0.5}, repo, job)
    samples = [s for f in text_string_to_metric_families(data.decode()) for s in f.samples]
    assert {s.name: s.value for s in samples}["pearing_run_busy_total"] == 3
    assert all(s.labels == {"pearing_job": job, "pearing_repo": repo} for s in samples)
    assert promtext.parse(data, repo, job) == {
        "pearing_run_running": 0,
        "pearing_run_runs_total": 0,
        "pearing_run_busy_total": 3,
        "pearing_run_deduplicated_total": 0,
        "pearing_run_lease_lost_total": 0,
        "pearing_run_last_duration_seconds": 0.5,
    }


@pytest.mark.parametrize("module", ["metrics", "keys"])
def test_new_modules_import_only_core(module: str) -> None:
    tree = ast.parse(Path(metrics.__file__).with_name(f"{module}.py").read_text())
    imported = [a.name for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names]
    imported += [n.module or "" for n in ast.walk(tree) if isinstance(n, ast.ImportFrom)]
    ours = [m for m in imported if m.split(".")[0] == "singleflight"]
    assert ours and all(m.startswith("singleflight.core") for m in ours)
