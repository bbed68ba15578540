"""Prometheus textfile metrics of ``pearing-run --metrics-dir DIR``, for node_exporter.

Files
-----
One file per (repo, job) in DIR, in the Prometheus text format 0.0.4 that node_exporter's
textfile collector reads (``*.prom``, no sample timestamps)::

    pearing_<job>@<repo with every "/" written "+">.prom
    e.g. job checkin, repo teams/platform/web  ->  pearing_checkin@teams+platform+web.prom

``@`` and ``+`` are outside the job and repo alphabets, so the name decodes back to one
(repo, job) pair: two pairs never share a file. A name longer than 255 bytes (job and repo
together over 241 characters) is cut and ends in ``~`` and 32 hex digits of
SHA-256(``<job>@<repo>``); ``~`` never appears in a short name, so a long name could only
collide with another long one through a SHA-256 collision.

The file is replaced whole (rename of a temp file), so the collector sees the previous or
the next version, never a mix. Beside it, in DIR: ``.pearing_metrics.lock`` (flock: one
read-modify-write at a time in DIR, so concurrent runs of the same job lose no count) and,
for an instant, ``.pearing_metrics.<pid>.tmp``. Both are hidden and do not end in ``.prom``.
Neither the target, nor the temp file, nor the lock file is followed through a symlink; a
symlink or non-regular file at the target is refused. DIR itself may be a symlink (it is the
operator's path). DIR is created (mode 0755) if its parent exists; parents are not. Files are
mode 0644 whatever the umask, and DIR when created 0755: node_exporter runs as another user.
No fsync: the write sits on the hand-over path, and the worst a power loss can do is restart
the counters, which Prometheus handles as a counter reset.

The series, their labels and their help texts are ``promtext``'s. Counters carry on across
runs by reading the previous file back. A previous file that does not parse or carries other
labels is not ours: counters restart from 0 (metrics are best effort); series this version
does not know are dropped.

What the runner calls
---------------------
Every pearing-run invocation that gets as far as deciding records exactly one of:

- ``busy``: it exits with the busy code without running COMMAND (lock busy, wait timed out,
  the same request already holds or waits, a ``--queue latest`` waiter cancelled).
- ``deduplicated``: it exits 0 without running COMMAND because the work is done: the request
  completed within the dedupe window, ``--min-interval`` has not passed, or ``--skip-if``
  said done.
- a run: ``start`` once the lock is held and ``--skip-if`` passed, just before COMMAND is
  spawned (so 126 / 127 are runs too); ``lease_lost`` as soon as ownership is lost (lease
  expired, ``--max-runtime``, holder killed), and in every case ``end`` with the status
  pearing-run exits with (124 after a lost lease) and ``duration`` = its monotonic time since
  ``start``, once COMMAND's group is gone and the lock released (a write may wait for the
  metrics lock: the lease must not lapse meanwhile, SPEC 14), with ``started``, the ``now``
  of its ``start``. The next holder's ``start`` may then land first: an ``end`` leaves
  ``running`` alone when a later ``start`` is on file, so it is never left 0 under a live
  run. ``lease_lost`` is separate from ``end`` 124 because a COMMAND may itself exit 124
  (``timeout(1)`` does). A ``--cancel-in-progress`` victim is an ``end`` with its busy
  code, not a lost lease. A ``start`` that found the metrics lock taken is written after the
  run's end (``late``): it counts the run, and never sets ``running``.

Usage errors and lock dir errors record nothing. After a kill -9 of pearing-run,
``running`` stays 1 until the job's next ``start`` or ``end``. ``now`` is wall-clock time
(``time.time()``): the timestamps are for ``time() - x`` in alert rules.

Failures
--------
Every failure, bad arguments included, is raised as ``MetricsError`` and nothing else. The
runner prints its one line to stderr and carries on with its exit status unchanged: a
metrics write never changes what pearing-run exits with.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import math
import os
import stat
import time
from typing import Final, Literal, TypeGuard

from singleflight.core import names
from singleflight.core.errors import BadValue, PearingError
from singleflight.core.promtext import (
    BUSY_TOTAL,
    DEDUPLICATED_TOTAL,
    LAST_DURATION,
    LAST_END,
    LAST_EXIT_CODE,
    LAST_START,
    LAST_SUCCESS,
    LEASE_LOST_TOTAL,
    RUNNING,
    RUNS,
    State,
    parse,
    render,
)

Event = Literal["start", "end", "busy", "deduplicated", "lease_lost"]
START: Final = "start"
END: Final = "end"
BUSY: Final = "busy"
DEDUPLICATED: Final = "deduplicated"
LEASE_LOST: Final = "lease_lost"
EVENTS: Final = frozenset({START, END, BUSY, DEDUPLICATED, LEASE_LOST})
_COUNTER_OF: Final = {START: RUNS, BUSY: BUSY_TOTAL, DEDUPLICATED: DEDUPLICATED_TOTAL, LEASE_LOST: LEASE_LOST_TOTAL}

_PREFIX: Final = "pearing_"
_SUFFIX: Final = ".prom"
_NAME_MAX: Final = 255
_HASH_HEX: Final = 32
LOCK_NAME: Final = ".pearing_metrics.lock"
_DIR_MODE: Final = 0o755
_FILE_MODE: Final = 0o644
_DIR_FLAGS: Final = os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC
# O_NONBLOCK: opening a FIFO planted at one of our names must fail or return, never hang.
_FILE_FLAGS: Final = os.O_NOFOLLOW | os.O_CLOEXEC | os.O_NONBLOCK
# Our own file is about 2 KiB; anything much larger is not ours and is not worth reading.
_MAX_FILE: Final = 64 * 1024
# Writes take well under a millisecond; a lock held this long belongs to a stopped or
# hostile process, and metrics must never hold up the run. flock(2) has no timeout, and an
# alarm would meddle with the runner's signal handling, so the wait polls with backoff.
_LOCK_WAIT: Final = 5.0
_LOCK_POLL_MAX: Final = 0.01


class MetricsError(PearingError):
    """A metrics file was not written. Never changes pearing-run's exit status."""

    def __init__(self, path: str, detail: str) -> None:
        self.path, self.detail = path, detail
        super().__init__(f"metrics not written to {path}: {detail}")


class MetricsBusy(MetricsError):
    """The metrics lock stayed taken: the same write may succeed later."""


def file_name(repo: str, job: str) -> str:
    """The metrics file of a validated (repo, job); see the module docstring."""
    name = f"{_PREFIX}{job}@{repo.replace('/', '+')}{_SUFFIX}"
    if len(name) <= _NAME_MAX:
        return name
    import hashlib  # only for names past NAME_MAX, which few setups have

    digest = hashlib.sha256(f"{job}@{repo}".encode()).hexdigest()[:_HASH_HEX]
    keep = _NAME_MAX - len(_SUFFIX) - 1 - _HASH_HEX
    return f"{name[:keep]}~{digest}{_SUFFIX}"


def _is_seconds(value: object) -> TypeGuard[float]:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return False
    try:
        number = float(value)  # an int past 1e308 overflows here, not later in the write
    except OverflowError:
        return False
    return math.isfinite(number) and number >= 0


def _check(
    metrics_dir: str,
    repo: str,
    job: str,
    event: str,
    *,
    now: float,
    exit_code: int | None,
    duration: float | None,
    started: float | None = None,
    late: bool = False,
) -> None:
    if not metrics_dir:
        raise MetricsError(repr(metrics_dir), "empty metrics dir")
    if "\0" in metrics_dir:
        raise MetricsError(repr(metrics_dir), "NUL in the metrics dir path")
    try:
        names.scope(repo, "repo")
        names.lock_name(job, "job")
    except BadValue as exc:
        raise MetricsError(metrics_dir, str(exc)) from None
    if event not in EVENTS:
        raise MetricsError(metrics_dir, f"unknown event {event!r}")
    if not _is_seconds(now):
        raise MetricsError(metrics_dir, f"bad time {now!r}")
    if late and event != START:
        raise MetricsError(metrics_dir, f"late belongs to {START!r}, not {event!r}")
    if started is not None and not _is_seconds(started):
        raise MetricsError(metrics_dir, f"bad start time {started!r}")
    if event != END:
        if exit_code is not None or duration is not None or started is not None:
            raise MetricsError(metrics_dir, f"exit_code, duration and started belong to {END!r}, not {event!r}")
        return
    if not (isinstance(exit_code, int) and not isinstance(exit_code, bool) and 0 <= exit_code <= 255):
        raise MetricsError(metrics_dir, f"bad exit code {exit_code!r}: {END!r} needs an integer 0-255")
    if not _is_seconds(duration):
        raise MetricsError(metrics_dir, f"bad duration {duration!r}: {END!r} needs seconds >= 0")


def _apply(
    state: State,
    event: str,
    *,
    now: float,
    exit_code: int | None = None,
    duration: float | None = None,
    started: float | None = None,
    late: bool = False,
) -> State:
    new = dict(state)
    counter = _COUNTER_OF.get(event)
    if counter is not None:
        new[counter] = int(new.get(counter, 0)) + 1
    if event == START and late:
        new[LAST_START] = max(float(now), new.get(LAST_START, 0.0))
    elif event == START:
        new[RUNNING] = 1
        new[LAST_START] = float(now)
    elif event == END:
        assert exit_code is not None and duration is not None  # _check saw to it
        if started is None or new.get(LAST_START, 0.0) <= started:
            new[RUNNING] = 0  # else a later run has started: running is its
        new[LAST_END] = float(now)
        new[LAST_EXIT_CODE] = exit_code
        new[LAST_DURATION] = float(duration)
        if exit_code == 0:
            new[LAST_SUCCESS] = float(now)
    return new


def _os_detail(exc: OSError) -> str:
    return exc.strerror or str(exc)


def _open_dir(path: str) -> int:
    try:
        return os.open(path, _DIR_FLAGS)
    except FileNotFoundError:
        pass
    except OSError as exc:
        raise MetricsError(path, _os_detail(exc)) from None
    try:
        os.mkdir(path, _DIR_MODE)
        created = True
    except FileExistsError:
        created = False
    except FileNotFoundError:
        raise MetricsError(path, "no such directory, nor its parent (parents are not created)") from None
    except OSError as exc:
        raise MetricsError(path, f"cannot create the directory: {_os_detail(exc)}") from None
    try:
        fd = os.open(path, _DIR_FLAGS)
        if created:
            os.fchmod(fd, _DIR_MODE)
    except OSError as exc:
        raise MetricsError(path, _os_detail(exc)) from None
    return fd


def _lock(dir_fd: int, metrics_dir: str) -> int:
    path = f"{metrics_dir}/{LOCK_NAME}"
    try:
        # Read-only is enough for flock, and lets users who share DIR share the lock file.
        fd = os.open(LOCK_NAME, os.O_RDONLY | os.O_CREAT | _FILE_FLAGS, _FILE_MODE, dir_fd=dir_fd)
    except OSError as exc:
        raise MetricsError(path, _refusal(exc)) from None
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            raise MetricsError(path, "is not a regular file; refusing it")
        deadline = time.monotonic() + _LOCK_WAIT
        delay = 0.0005
        while True:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                return fd
            except BlockingIOError:
                if time.monotonic() >= deadline:
                    raise MetricsBusy(path, f"still locked by another process after {_LOCK_WAIT:g} s") from None
                time.sleep(delay)
                delay = min(delay * 2, _LOCK_POLL_MAX)
    except BaseException:
        os.close(fd)
        raise


def _refusal(exc: OSError) -> str:
    if exc.errno == errno.ELOOP:
        return "is a symlink; refusing to follow or replace it"
    return _os_detail(exc)


def _read_previous(dir_fd: int, name: str, path: str) -> bytes | None:
    try:
        fd = os.open(name, os.O_RDONLY | _FILE_FLAGS, dir_fd=dir_fd)
    except FileNotFoundError:
        return None
    except OSError as exc:
        raise MetricsError(path, _refusal(exc)) from None
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            raise MetricsError(path, "is not a regular file; refusing to replace it")
        chunks: list[bytes] = []
        size = 0
        while size <= _MAX_FILE and (chunk := os.read(fd, _MAX_FILE + 1 - size)):
            chunks.append(chunk)
            size += len(chunk)
        # Too big to be ours: read as empty, so its counters restart like any foreign file's.
        return b"".join(chunks) if size <= _MAX_FILE else b""
    except OSError as exc:
        raise MetricsError(path, _os_detail(exc)) from None
    finally:
        os.close(fd)


def _replace(dir_fd: int, name: str, path: str, data: bytes) -> None:
    # One writer at a time per DIR (the flock), so a per-process name cannot clash; a temp
    # left by a kill -9 is reused by the next writer with that pid and is never read.
    tmp = f".pearing_metrics.{os.getpid()}.tmp"
    try:
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | _FILE_FLAGS, _FILE_MODE, dir_fd=dir_fd)
    except OSError as exc:
        raise MetricsError(path, f"temp file {tmp}: {_refusal(exc)}") from None
    try:
        try:
            if not stat.S_ISREG(os.fstat(fd).st_mode):
                raise MetricsError(path, f"temp file {tmp} is not a regular file")
            view = memoryview(data)
            while view:
                view = view[os.write(fd, view) :]
            os.fchmod(fd, _FILE_MODE)
        finally:
            os.close(fd)
        os.rename(tmp, name, src_dir_fd=dir_fd, dst_dir_fd=dir_fd)
    except BaseException as exc:
        with contextlib.suppress(OSError):
            os.unlink(tmp, dir_fd=dir_fd)
        if isinstance(exc, OSError):
            raise MetricsError(path, _os_detail(exc)) from None
        raise


def record(
    metrics_dir: str,
    repo: str,
    job: str,
    event: Event,
    *,
    now: float,
    exit_code: int | None = None,
    duration: float | None = None,
    started: float | None = None,
    late: bool = False,
) -> None:
    """Record one event of (repo, job) in its file in ``metrics_dir``; MetricsError on any failure
    (MetricsBusy: the metrics lock stayed taken).

    ``exit_code`` (0-255), ``duration`` (seconds) and ``started`` (its run's ``start`` time) go
    with ``end`` and only with it; ``late`` with a ``start`` written after its run ended.
    """
    _check(metrics_dir, repo, job, event, now=now, exit_code=exit_code, duration=duration, started=started, late=late)
    name = file_name(repo, job)
    path = f"{metrics_dir}/{name}"
    dir_fd = _open_dir(metrics_dir)
    try:
        lock_fd = _lock(dir_fd, metrics_dir)
        try:
            previous = _read_previous(dir_fd, name, path)
            state = (parse(previous, repo, job) if previous is not None else None) or {}
            state = _apply(state, event, now=now, exit_code=exit_code, duration=duration, started=started, late=late)
            _replace(dir_fd, name, path, render(state, repo, job))
        finally:
            os.close(lock_fd)
    finally:
        os.close(dir_fd)
