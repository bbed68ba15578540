"""pearing-guard: refuse side effects without a live token; reject stale fences.

pearing-guard verify [--token-file F] [--json]
pearing-guard exec [--max-seconds S] [--token-file F] -- CMD [ARG...]
pearing-guard fence --resource NAME --fence N [--ledger PATH]
"""

from __future__ import annotations

import contextlib
import json
import os
import select
import signal
import sys

from singleflight import __version__, guard
from singleflight.backend import backend_url
from singleflight.cli._argv import Option, parse, usage
from singleflight.core import fault, names
from singleflight.core.const import DEFAULT_GUARD_MAX_SECONDS, ENV_BACKEND, ExitCode
from singleflight.core.errors import BadValue, PearingError, UsageError
from singleflight.core.log import Log

PROG = "pearing-guard"
SYNOPSIS = "verify|exec|fence [options] [-- CMD...]"
TOKEN_FILE = Option("--token-file", dest="token_file", metavar="F", help="token file (default PEARING_TOKEN_FILE)")
HELP = Option("-h", "--help", dest="help", flag=True, help="show this help and exit")
VERIFY = [TOKEN_FILE, Option("--json", dest="json", flag=True, help="print the verdict as JSON"), HELP]
EXEC = [
    TOKEN_FILE,
    Option("--max-seconds", dest="max_seconds", metavar="S", help="kill CMD after S s (default 60)"),
    HELP,
]
FENCE = [
    Option("--resource", dest="resource", metavar="NAME", help="what the fence protects (required)"),
    Option("--fence", dest="fence", metavar="N", help="the writer's fence (required)"),
    Option("--ledger", dest="ledger", metavar="PATH", help="ledger file (default LOCK_DIR/ledger.json, or etcd)"),
    Option("--json", dest="json", flag=True, help="print the result as JSON"),
    HELP,
]
_FORWARDED = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP, signal.SIGQUIT, signal.SIGUSR1, signal.SIGUSR2)


def _help(opts: list[Option], synopsis: str) -> int:
    sys.stdout.write(usage(PROG, synopsis, opts))
    return 0


def cmd_verify(argv: list[str], log: Log) -> int:
    values, _ = parse(argv, VERIFY, positional=False)
    if values.get("help"):
        return _help(VERIFY, "verify [--token-file F] [--json]")
    token_file = values.get("token_file")
    verdict = guard.verify(str(token_file) if token_file else None)
    if values.get("json"):
        sys.stdout.write(json.dumps(verdict.as_dict()) + "\n")
    if verdict.ok:
        return 0
    log.refused(verdict.reason)
    return int(ExitCode.REFUSED)


def cmd_exec(argv: list[str], log: Log) -> int:
    values, command = parse(argv, EXEC, positional=True)
    if values.get("help"):
        return _help(EXEC, "exec [--max-seconds S] [--token-file F] -- CMD [ARG...]")
    if not command:
        raise UsageError("no CMD given (put it after --)")
    if not command[0]:
        raise BadValue("CMD", command[0], "must name a program, not be empty")
    given = values.get("max_seconds")  # "--max-seconds=" is a bad number, not the default
    max_seconds = names.seconds(
        DEFAULT_GUARD_MAX_SECONDS if given is None else str(given), "--max-seconds", allow_zero=False
    )
    token_file = values.get("token_file")
    try:
        with guard.guarded(str(token_file) if token_file else None, hold_seconds=max_seconds):
            return _run_bounded(command, max_seconds, log)
    except PearingError as exc:
        if exc.exit_code == ExitCode.REFUSED:
            log.refused(str(getattr(exc, "reason", exc)))
            return int(ExitCode.REFUSED)
        raise


def _run_bounded(command: list[str], max_seconds: float, log: Log) -> int:
    # A signal between the spawn and our handlers would kill us and orphan CMD (its guard
    # held by nobody): block them across, and let CMD start with none blocked.
    old = signal.pthread_sigmask(signal.SIG_BLOCK, _FORWARDED)
    try:
        pid = os.posix_spawnp(
            command[0],
            command,
            dict(os.environ),
            setpgroup=0,
            setsigdef=(*_FORWARDED, signal.SIGPIPE),
            setsigmask=old,
        )
    except OSError as exc:
        signal.pthread_sigmask(signal.SIG_SETMASK, old)
        found = not isinstance(exc, FileNotFoundError)
        log.error(f"command {'not executable' if found else 'not found'}: {command[0]}: {exc.strerror}")
        return int(ExitCode.NOEXEC if found else ExitCode.NOTFOUND)
    fault.pause("pause-guard-spawned")
    for sig in _FORWARDED:
        signal.signal(sig, lambda signum, frame: _killpg(pid, signum))
    signal.pthread_sigmask(signal.SIG_SETMASK, old)
    pidfd = os.pidfd_open(pid)
    ready, _, _ = select.select([pidfd], [], [], max_seconds)
    if not ready:
        log.error(f"CMD ran past --max-seconds {max_seconds:g}: killed")
        _killpg(pid, signal.SIGTERM)
        if not select.select([pidfd], [], [], 1.0)[0]:
            _killpg(pid, signal.SIGKILL)
        os.waitpid(pid, 0)
        _killpg(pid, signal.SIGKILL)
        return int(ExitCode.LEASE_LOST)
    _, status = os.waitpid(pid, 0)
    code = os.waitstatus_to_exitcode(status)
    return 128 - code if code < 0 else code


def _killpg(pgid: int, sig: int) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pgid, sig)


def cmd_fence(argv: list[str], log: Log) -> int:
    values, _ = parse(argv, FENCE, positional=False)
    if values.get("help"):
        return _help(FENCE, "fence --resource NAME --fence N [--ledger PATH]")
    resource, fence = values.get("resource"), values.get("fence")
    if resource is None or fence is None:
        raise UsageError("fence needs --resource NAME and --fence N")
    ledger = values.get("ledger")
    backend = backend_url(None, os.environ.get(ENV_BACKEND))
    ledger_path = str(ledger) if ledger else None
    accepted = guard.accept_fence(str(resource), names.fence(str(fence)), ledger_path, backend=backend)
    if values.get("json"):
        sys.stdout.write(json.dumps({"ok": True, "resource": resource, "fence": accepted}) + "\n")
    return 0


COMMANDS = {"verify": cmd_verify, "exec": cmd_exec, "fence": cmd_fence}


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    log = Log(PROG)
    try:
        if not args or args[0] in ("-h", "--help"):
            sys.stdout.write(f"usage: {PROG} {SYNOPSIS}\n")
            return 0 if args else int(ExitCode.USAGE)
        if args[0] == "--version":
            sys.stdout.write(f"{PROG} {__version__}\n")
            return 0
        handler = COMMANDS.get(args[0])
        if handler is None:
            raise UsageError(f"unknown command {args[0]!r}: use verify, exec or fence")
        return handler(args[1:], log)
    except PearingError as exc:
        if exc.exit_code == ExitCode.REFUSED:
            log.refused(str(exc))
        else:
            log.error(str(exc))
        return int(exc.exit_code)
    except Exception as exc:  # noqa: BLE001 - a bug still gets one line and exit 70
        log.error(f"internal error (a bug, please report it): {exc!r}")
        return int(ExitCode.SOFTWARE)


if __name__ == "__main__":
    sys.exit(main())
