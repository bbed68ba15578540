"""The Prometheus text format 0.0.4 of the ``--metrics-dir`` files (``metrics`` writes
them): the series, a file rendered from them and a file parsed back.

Series (labels ``job``, ``repo``; HELP and TYPE in every file, identical in all of them,
because node_exporter refuses one metric name with two help texts)::

    pearing_run_running                       gauge   1 from start to end, else 0
    pearing_run_last_start_timestamp_seconds  gauge   absent until a run starts
    pearing_run_last_end_timestamp_seconds    gauge   absent until a run ends
    pearing_run_last_success_timestamp_seconds gauge  end time of the last run that exited 0
    pearing_run_last_exit_code                gauge   pearing-run's exit status of the last run
    pearing_run_last_duration_seconds         gauge   start to end of the last run
    pearing_run_runs_total                    counter starts
    pearing_run_busy_total                    counter busy skips
    pearing_run_deduplicated_total            counter exits 0 without running COMMAND
    pearing_run_lease_lost_total              counter runs stopped for a lost lease

``parse`` reads back only what ``render`` wrote for the same (repo, job): a file that does not
parse or carries other labels is not ours (None); series this version does not know are dropped.
"""

from __future__ import annotations

import math
from typing import Final, TypeAlias

RUNNING: Final = "pearing_run_running"
LAST_START: Final = "pearing_run_last_start_timestamp_seconds"
LAST_END: Final = "pearing_run_last_end_timestamp_seconds"
LAST_SUCCESS: Final = "pearing_run_last_success_timestamp_seconds"
LAST_EXIT_CODE: Final = "pearing_run_last_exit_code"
LAST_DURATION: Final = "pearing_run_last_duration_seconds"
RUNS: Final = "pearing_run_runs_total"
BUSY_TOTAL: Final = "pearing_run_busy_total"
DEDUPLICATED_TOTAL: Final = "pearing_run_deduplicated_total"
LEASE_LOST_TOTAL: Final = "pearing_run_lease_lost_total"

# Name, type, help. The help text is an interface: node_exporter refuses a metric whose help
# differs between two files, so changing it breaks collection until every file is rewritten.
_METRICS: Final = (
    (RUNNING, "gauge", "1 while a run of this job is running its command, else 0."),
    (LAST_START, "gauge", "Unix time the last run of this job started its command."),
    (LAST_END, "gauge", "Unix time the last run of this job ended."),
    (LAST_SUCCESS, "gauge", "Unix time the last run of this job that exited 0 ended."),
    (LAST_EXIT_CODE, "gauge", "Exit status of the last run of this job (124: lease lost; 128+N: signal N)."),
    (LAST_DURATION, "gauge", "Seconds the last run of this job took from start to end."),
    (RUNS, "counter", "Runs of this job that started its command."),
    (BUSY_TOTAL, "counter", "Invocations of this job that exited busy without running its command."),
    (DEDUPLICATED_TOTAL, "counter", "Invocations of this job that exited 0 without running its command."),
    (LEASE_LOST_TOTAL, "counter", "Runs of this job stopped because their lease was lost."),
)
_KINDS: Final = {name: kind for name, kind, _ in _METRICS}
# Written even before the first event that sets them: rate() needs a 0 to start from.
_ALWAYS: Final = frozenset({RUNNING, RUNS, BUSY_TOTAL, DEDUPLICATED_TOTAL, LEASE_LOST_TOTAL})
_MAX_COUNTER_DIGITS: Final = 20
_DIGITS: Final = frozenset("0123456789")

# Metric name to value; counters, running and the exit code stay ints.
State: TypeAlias = dict[str, float]


def _escape(value: str) -> str:
    return value.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")


def _labels(repo: str, job: str) -> str:
    # Not ``job`` / ``repo``: Prometheus renames a scraped ``job`` label to ``exported_job``,
    # so an alert on {job="checkin"} matched nothing.
    return f'pearing_job="{_escape(job)}",pearing_repo="{_escape(repo)}"'


def _old_labels(repo: str, job: str) -> str:
    """The labels of files written before 0.3 (``job``, ``repo``): read once, then rewritten."""
    return f'job="{_escape(job)}",repo="{_escape(repo)}"'


def _parse_value(name: str, text: str) -> int | float | None:
    if _KINDS[name] == "counter" or name in (RUNNING, LAST_EXIT_CODE):
        if not text or len(text) > _MAX_COUNTER_DIGITS or not _DIGITS.issuperset(text):
            return None
        return int(text)
    try:
        number = float(text)
    except ValueError:
        return None
    return number if math.isfinite(number) and number >= 0 else None


def parse(data: bytes, repo: str, job: str) -> State | None:
    """The series of a file we wrote for (repo, job); None if it is corrupt or not ours."""
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError:
        return None
    wants = {_labels(repo, job) + "}", _old_labels(repo, job) + "}"}
    state: State = {}
    for line in text.split("\n"):
        if not line or line[0] == "#":
            continue
        series, _, value = line.rpartition(" ")
        name, _, labels = series.partition("{")
        if name not in _KINDS:
            continue
        if labels not in wants:
            return None
        number = _parse_value(name, value)
        if number is None:
            return None
        state[name] = number
    return state


def render(state: State, repo: str, job: str) -> bytes:
    """The file for ``state``: HELP, TYPE and the sample of every series that has a value."""
    labels = _labels(repo, job)
    lines = []
    for name, kind, help_text in _METRICS:
        value = state.get(name, 0 if name in _ALWAYS else None)
        if value is None:
            continue
        shown = repr(value) if isinstance(value, float) else str(value)
        lines += [f"# HELP {name} {help_text}", f"# TYPE {name} {kind}", f"{name}{{{labels}}} {shown}"]
    return ("\n".join(lines) + "\n").encode()
