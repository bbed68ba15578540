"""pearing-run: the cron / systemd wrapper. Parse, run, map errors to exit codes."""

from __future__ import annotations

import itertools
import os
import sys

from singleflight import __version__
from singleflight.backend import backend_url
from singleflight.cli._argv import Option, parse, usage
from singleflight.cli._script import script
from singleflight.core import identity, names, schemes
from singleflight.core.const import (
    DEFAULT_DEDUPE_WINDOW,
    DEFAULT_KILL_GRACE,
    DEFAULT_LEASE_SECONDS,
    DEFAULT_SCOPE,
    ENV_BACKEND,
    ENV_METRICS_DIR,
    HEARTBEAT_AUTO,
    HEARTBEAT_MODES,
    QUEUE_FIFO,
    QUEUE_MODES,
    TYPE_CHECKING,
    ExitCode,
)
from singleflight.core.errors import BadValue, PearingError, UsageError
from singleflight.core.fs import resolve_lock_dir
from singleflight.core.log import FORMATS, Log
from singleflight.core.proc import ensure_std_fds
from singleflight.runner import run
from singleflight.runopts import RunOptions

if TYPE_CHECKING:
    from typing import NoReturn

PROG = "pearing-run"
SYNOPSIS = "--job NAME [options] -- COMMAND [ARG...]"
SUMMARY = (
    "Run COMMAND as the one holder of the lock NAME, with a lease, a fence and a token in its environment. "
    "A busy lock exits 75 at once, or after waiting its turn in FIFO order (--wait-seconds)."
)
OPTIONS = [
    Option("--job", dest="job", metavar="NAME", help="lock name, e.g. checkin or thread-work.42 (required)"),
    Option("--repo", dest="repo", metavar="SCOPE", help=f"scope of the lock name (default {DEFAULT_SCOPE})"),
    Option("--lease-seconds", dest="lease", metavar="SECONDS", help="lease length (default 60)"),
    Option(
        "--wait-seconds", dest="wait", metavar="SECONDS", help="when busy, wait in FIFO order up to SECONDS (default 0)"
    ),
    Option("--heartbeat", dest="heartbeat", metavar="auto|manual", help="who renews the lease (default auto)"),
    Option(
        "--max-runtime", dest="max_runtime", metavar="SECONDS", help="stop COMMAND after SECONDS whatever the lease"
    ),
    Option("--kill-grace", dest="kill_grace", metavar="SECONDS", help="SIGTERM to SIGKILL delay (default 10)"),
    Option("--request-uuid", dest="request_uuid", metavar="UUID", help="idempotency key: replays run once"),
    Option("--request-key", dest="request_key", metavar="KEY", help="any event id: the request uuid is its UUIDv5"),
    Option("--min-interval", dest="min_interval", metavar="DURATION", help="skip if a success started < DURATION ago"),
    Option("--metrics-dir", dest="metrics_dir", metavar="DIR", help="Prometheus textfile dir (PEARING_METRICS_DIR)"),
    Option("--dedupe-window", dest="dedupe_window", metavar="DURATION", help="how long a success is remembered (1d)"),
    Option("--skip-if", dest="skip_if", metavar="CMD", help="after acquiring: exit 0 of CMD means already done"),
    Option("--busy-exit-code", dest="busy_code", metavar="N", help="exit code when busy (default 75)"),
    Option("--identity", dest="identity", metavar="ID", help="who holds (default PEARING_IDENTITY or user@host)"),
    Option("--backend", dest="backend", metavar="URL", help=schemes.help_text()),
    Option("--lock-dir", dest="lock_dir", metavar="DIR", help="state dir (default PEARING_LOCK_DIR or per user)"),
    Option("-v", "--verbose", dest="verbose", flag=True, help="lifecycle lines on stderr"),
    Option("--queue", dest="queue", metavar="fifo|latest", help="latest: a newer waiter replaces older ones"),
    Option("--cancel-in-progress", dest="cancel", flag=True, help="stop an opted-in holder, then take the lock"),
    Option("--max-waiting", dest="max_waiting", metavar="N", help="busy at once if N already wait (0-10000)"),
    Option("--slots", dest="slots", metavar="N", help="at most N COMMANDs at once, each its own fence (1-1000)"),
    Option("--log-format", dest="log_format", metavar="text|json", help="stderr line format (default text)"),
    Option("--version", dest="version", flag=True, help="print the version and exit"),
    Option("-h", "--help", dest="help", flag=True, help="show this help and exit"),
]


def _opt_str(values: dict[str, object], key: str) -> str | None:
    v = values.get(key)
    return None if v is None else str(v)


def _opt(values: dict[str, object], key: str, default: object) -> str:
    """The flag's value, or ``default`` only when the flag is absent (``--repo=`` is a bad scope)."""
    v = values.get(key)
    return str(default) if v is None else str(v)


def build_options(argv: list[str]) -> RunOptions:
    values, command = parse(argv, OPTIONS, positional=False)
    if values.get("help"):
        sys.stdout.write(usage(PROG, SYNOPSIS, OPTIONS, SUMMARY))
        raise SystemExit(0)
    if values.get("version"):
        sys.stdout.write(f"{PROG} {__version__}\n")
        raise SystemExit(0)
    job = _opt_str(values, "job")
    if job is None:
        raise UsageError("--job NAME is required")
    if not command:
        raise UsageError("no COMMAND given (put it after --)")
    if not command[0]:
        raise BadValue("COMMAND", command[0], "must name a program, not be empty")
    heartbeat = names.choice(_opt(values, "heartbeat", HEARTBEAT_AUTO), "--heartbeat", HEARTBEAT_MODES)
    queue = names.choice(_opt(values, "queue", QUEUE_FIFO), "--queue", QUEUE_MODES)
    log_format = names.choice(_opt(values, "log_format", "text"), "--log-format", FORMATS)
    max_runtime = _opt_str(values, "max_runtime")
    request_uuid = names.request(_opt_str(values, "request_uuid"), _opt_str(values, "request_key"))
    min_interval = _opt_str(values, "min_interval")
    metrics_dir = _opt_str(values, "metrics_dir")
    max_waiting = _opt_str(values, "max_waiting")
    if metrics_dir is None:
        metrics_dir = os.environ.get(ENV_METRICS_DIR) or None
    return RunOptions(
        job=names.lock_name(job, "--job"),
        repo=names.scope(_opt(values, "repo", DEFAULT_SCOPE), "--repo scope"),
        lease_seconds=names.lease_seconds(_opt(values, "lease", DEFAULT_LEASE_SECONDS)),
        wait_seconds=names.seconds(_opt(values, "wait", 0), "--wait-seconds"),
        heartbeat_auto=heartbeat == HEARTBEAT_AUTO,
        max_runtime=None if max_runtime is None else names.seconds(max_runtime, "--max-runtime", allow_zero=False),
        kill_grace=names.seconds(_opt(values, "kill_grace", DEFAULT_KILL_GRACE), "--kill-grace"),
        request_uuid=request_uuid,
        min_interval=None if min_interval is None else names.duration(min_interval, "--min-interval"),
        metrics_dir=_metrics_dir(metrics_dir),
        dedupe_window=names.duration(
            _opt(values, "dedupe_window", DEFAULT_DEDUPE_WINDOW), "--dedupe-window", allow_zero=True
        ),
        skip_if=_skip_if(_opt_str(values, "skip_if")),
        busy_exit_code=names.exit_status(_opt(values, "busy_code", int(ExitCode.BUSY))),
        identity=identity.resolve(_opt_str(values, "identity")),
        lock_dir=resolve_lock_dir(_opt_str(values, "lock_dir")),
        verbose=bool(values.get("verbose")),
        log_format=log_format,
        command=command,
        backend=backend_url(_opt_str(values, "backend"), os.environ.get(ENV_BACKEND)),
        queue=queue,
        cancel_in_progress=bool(values.get("cancel")),
        max_waiting=None if max_waiting is None else names.max_waiting(max_waiting),
        slots=names.slots(_opt(values, "slots", 1)),
    )


def _metrics_dir(value: str | None) -> str | None:
    if value is not None and (not value or "\0" in value):
        raise BadValue("--metrics-dir", value, "must be a directory path")
    return None if value is None else os.path.abspath(value)


def _pair(args: list[str], flag: str, value: str) -> bool:
    head = args[: args.index("--")] if "--" in args else args
    return any(a == flag and b == value for a, b in itertools.pairwise(head))


def _skip_if(value: str | None) -> str | None:
    if value is not None and not value.strip():
        raise BadValue("--skip-if", value, "must be a shell command")
    return value


def main(argv: list[str] | None = None) -> int:
    ensure_std_fds()  # first: no fd of ours may land on 0-2
    args = sys.argv[1:] if argv is None else argv
    # Errors before parsing finishes still honour --log-format json.
    log = Log(PROG, fmt="json" if "--log-format=json" in args or _pair(args, "--log-format", "json") else "text")
    try:
        return run(build_options(args))
    except PearingError as exc:
        log.error(str(exc))
        return int(exc.exit_code)
    except KeyboardInterrupt:
        return int(ExitCode.INTERRUPTED)
    except Exception as exc:  # noqa: BLE001 - a bug still gets one line and exit 70
        log.error(f"internal error (a bug, please report it): {exc!r}")
        return int(ExitCode.SOFTWARE)


def entry() -> NoReturn:
    """The ``pearing-run`` command."""
    script(main)


if __name__ == "__main__":
    entry()
