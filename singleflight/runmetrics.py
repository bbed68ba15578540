"""When pearing-run writes each event of a run to ``--metrics-dir`` (``core.metrics`` writes it).

Best effort: a failed write is one line on stderr and never the exit status (SPEC 14), and no
write may let the lease lapse. So the end of a run is written after the release, once the
outcome is settled (its request recorded, the lock handed on), never before it; and while the
run holds the lock, a write that found the metrics lock taken (``core.metrics`` waits 5 s for
it) waits no more: it and the events after it, in order, are written after the release with
the end, retried while that lock stays taken. The next run's start may then land before this
run's end: the end carries its ``started``, so it leaves ``running`` to the later run, and a
``start`` written late never sets it (``core.metrics``).
"""

from __future__ import annotations

import time

from singleflight.core.const import TYPE_CHECKING

if TYPE_CHECKING:
    from typing import Any

    from singleflight.core.log import Log
    from singleflight.core.metrics import Event

# After the release, how long a metrics lock that stays taken is waited for: it holds up
# pearing-run's exit (never the lock, nor the next run) in the rare case it is held that long.
AFTER_RELEASE = 30.0


class RunMetrics:
    def __init__(self, metrics_dir: str | None, repo: str, job: str, log: Log) -> None:
        self.dir, self.repo, self.job, self.log = metrics_dir, repo, job, log
        self.started = 0.0  # the ``now`` of this run's start
        self.later: list[tuple[Event, float]] | None = None  # what waits for the release

    def record(self, event: Event, *, holding: bool) -> None:
        """An event other than the end; ``holding``: the run holds the lock (a write that finds
        the metrics lock taken then waits for the release)."""
        if self.dir is None:
            return
        now = time.time()
        self.started = now if event == "start" else self.started
        if self.later is not None:
            self.later.append((event, now))
        elif not self._write(event, now, holding=holding) and holding:
            self.later = [(event, now)]

    def after_release(self, end: tuple[float, float, int] | None) -> None:
        """What waited for the metrics lock, and the run's ``end`` (its time, duration, exit code)."""
        if self.dir is None:
            return
        queued: list[tuple[Event, float, dict[str, Any]]] = [
            (e, t, {"late": e == "start"}) for e, t in self.later or ()
        ]
        self.later = None
        if end is not None:
            ended, duration, code = end
            queued.append(("end", ended, {"exit_code": code, "duration": duration, "started": self.started}))
        give_up = time.monotonic() + AFTER_RELEASE
        for event, now, extra in queued:
            while not self._write(event, now, quiet=True, **extra):
                if time.monotonic() >= give_up:
                    self.log.error(f"metrics not written to {self.dir}: still locked {AFTER_RELEASE:g} s after the run")
                    return

    def _write(self, event: Event, now: float, *, holding: bool = False, quiet: bool = False, **extra: Any) -> bool:
        """One write; False when the metrics lock stayed taken (said on stderr unless ``quiet``)."""
        from singleflight.core import metrics

        assert self.dir is not None
        try:
            metrics.record(self.dir, self.repo, self.job, event, now=now, **extra)
        except metrics.MetricsBusy as exc:
            if not quiet:
                self.log.error(f"{exc}; tried again once the run has ended" if holding else str(exc))
            return False
        except metrics.MetricsError as exc:
            self.log.error(str(exc))
        return True
