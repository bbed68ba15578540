"""pearing-run's options, as its front end checked them (``cli/run.py``)."""

from __future__ import annotations

from singleflight.core.const import QUEUE_FIFO, ExitCode


class RunOptions:
    __slots__ = (
        "backend",
        "busy_exit_code",
        "cancel_in_progress",
        "command",
        "dedupe_window",
        "heartbeat_auto",
        "identity",
        "job",
        "kill_grace",
        "lease_seconds",
        "lock_dir",
        "log_format",
        "max_runtime",
        "max_waiting",
        "metrics_dir",
        "min_interval",
        "queue",
        "repo",
        "request_uuid",
        "skip_if",
        "slots",
        "verbose",
        "wait_seconds",
    )

    def __init__(
        self,
        *,
        job: str,
        repo: str,
        command: list[str],
        lock_dir: str,
        identity: str,
        backend: str = "local",
        lease_seconds: float = 60.0,
        wait_seconds: float = 0.0,
        heartbeat_auto: bool = True,
        max_runtime: float | None = None,
        kill_grace: float = 10.0,
        request_uuid: str | None = None,
        dedupe_window: float = 86400.0,
        skip_if: str | None = None,
        busy_exit_code: int = int(ExitCode.BUSY),
        verbose: bool = False,
        log_format: str = "text",
        min_interval: float | None = None,
        metrics_dir: str | None = None,
        queue: str = QUEUE_FIFO,
        cancel_in_progress: bool = False,
        max_waiting: int | None = None,
        slots: int = 1,
    ) -> None:
        self.job, self.repo, self.command, self.lock_dir, self.identity = job, repo, command, lock_dir, identity
        self.backend, self.lease_seconds, self.wait_seconds = backend, lease_seconds, wait_seconds
        self.heartbeat_auto, self.max_runtime, self.kill_grace = heartbeat_auto, max_runtime, kill_grace
        self.request_uuid, self.dedupe_window, self.skip_if = request_uuid, dedupe_window, skip_if
        self.busy_exit_code, self.verbose, self.log_format = busy_exit_code, verbose, log_format
        self.min_interval, self.metrics_dir = min_interval, metrics_dir
        self.queue, self.cancel_in_progress = queue, cancel_in_progress
        self.max_waiting, self.slots = max_waiting, slots

    job: str
    repo: str
    command: list[str]
    lock_dir: str
    identity: str
    backend: str
    lease_seconds: float
    wait_seconds: float
    heartbeat_auto: bool
    max_runtime: float | None
    kill_grace: float
    request_uuid: str | None
    dedupe_window: float
    skip_if: str | None
    busy_exit_code: int
    verbose: bool
    log_format: str
    min_interval: float | None
    metrics_dir: str | None
    queue: str
    cancel_in_progress: bool
    max_waiting: int | None
    slots: int
