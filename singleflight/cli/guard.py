"""pearing-guard: refuse side effects without a live token; reject stale fences.

pearing-guard verify [--token-file PATH] [--backend URL] [--json]
pearing-guard exec [--max-seconds SECONDS] [--token-file PATH] [--backend URL] -- CMD [ARG...]
pearing-guard fence --resource NAME --fence N [--ledger PATH] [--backend URL]
pearing-guard git-push [--fence N] [--lock NAME --repo SCOPE] REMOTE REFSPEC...

``git-push`` talks only to git: the fence, lock and scope come from the flags or from
the environment pearing-run gives its COMMAND (singleflight.gitpush).

``--backend`` (default PEARING_BACKEND, else the lock dir), as pearing-run and pearing-cli
take it: where a token from PEARING_TOKEN lives, and whose ledger ``fence`` uses. A token
file names its own backend: the one that issued it.
"""

from __future__ import annotations

import contextlib
import os
import select
import signal
import sys

from singleflight import __version__, guard
from singleflight.backend import backend_url
from singleflight.cli._argv import Command, Option, parse, render, rows, usage
from singleflight.cli._script import script
from singleflight.core import fault, jsontext, names, proc, schemes
from singleflight.core.const import (
    DEFAULT_GUARD_MAX_SECONDS,
    ENV_BACKEND,
    ENV_FENCE,
    ENV_LOCK,
    ENV_REPO,
    TYPE_CHECKING,
    ExitCode,
)
from singleflight.core.errors import BadValue, PearingError, ToolFailed, UsageError
from singleflight.core.log import Log

if TYPE_CHECKING:
    from typing import NoReturn

PROG = "pearing-guard"
SYNOPSIS = "verify|exec|fence|git-push [options] [-- CMD...] [REMOTE REFSPEC...]"
SUMMARY = "Refuse a side effect without the live token of its lock's holder; reject stale fences."
TOKEN_FILE = Option("--token-file", dest="token_file", metavar="PATH", help="token file (default PEARING_TOKEN_FILE)")
HELP = Option("-h", "--help", dest="help", flag=True, help="show this help and exit")
JSON = Option("--json", dest="json", flag=True, help="print the verdict (fence: the result) as JSON")
BACKEND = Option("--backend", dest="backend", metavar="URL", help=schemes.help_text())
VERIFY = Command(
    "verify",
    "verify [--token-file PATH] [--backend URL] [--json]",
    "exit 0 only while the run's token is live (else 1, with the reason)",
    [TOKEN_FILE, BACKEND, JSON, HELP],
)
EXEC = Command(
    "exec",
    "exec [--max-seconds SECONDS] [--token-file PATH] [--backend URL] -- CMD [ARG...]",
    "run CMD only under a live token; the lock waits for CMD to end",
    [
        TOKEN_FILE,
        BACKEND,
        Option("--max-seconds", dest="max_seconds", metavar="SECONDS", help="kill CMD after SECONDS (default 60)"),
        HELP,
    ],
    label="exec -- CMD",
)
FENCE = Command(
    "fence",
    "fence --resource NAME --fence N [--ledger PATH] [--backend URL]",
    "accept a write's fence only if no higher one was accepted",
    [
        Option("--resource", dest="resource", metavar="NAME", help="what the fence protects (required)"),
        Option("--fence", dest="fence", metavar="N", help="the writer's fence (required)"),
        Option("--ledger", dest="ledger", metavar="PATH", help="ledger file (default the backend's own ledger)"),
        BACKEND,
        JSON,
        HELP,
    ],
)
GIT_PUSH = Command(
    "git-push",
    "git-push [--fence N] [--lock NAME --repo SCOPE] REMOTE REFSPEC...",
    "git push the refspecs and the lock's fence ref atomically, refused if the remote holds a higher fence",
    [
        Option("--fence", dest="fence", metavar="N", help=f"the holder's fence (default {ENV_FENCE})"),
        Option("--lock", dest="lock", metavar="NAME", help=f"the lock's name (default {ENV_LOCK})"),
        Option("--repo", dest="repo", metavar="SCOPE", help=f"the lock's scope (default {ENV_REPO})"),
        HELP,
    ],
    label="git-push REMOTE REFSPEC...",
)
SUBCOMMANDS = [VERIFY, EXEC, FENCE, GIT_PUSH]
_TERMINAL = (signal.SIGINT, signal.SIGQUIT)
_FORWARDED = (signal.SIGTERM, signal.SIGHUP, signal.SIGUSR1, signal.SIGUSR2)
_CAUGHT = (*_TERMINAL, *_FORWARDED)


def _help(command: Command) -> int:
    sys.stdout.write(usage(PROG, command.synopsis, command.options, command.summary))
    return 0


_FENCE_ANY = Option(
    "--fence", dest="fence", metavar="N", help=f"the writer's fence (fence: required; git-push: default {ENV_FENCE})"
)
VERSION = Option("--version", dest="version", flag=True, help="print the version and exit")
HELP_ALL = Option("-h", "--help", dest="help", flag=True, help="show this help (COMMAND -h: that command's)")


def overview_options() -> list[Option]:
    """The options of ``pearing-guard --help``: every command's, each once, then its own."""
    # An option two commands spell alike but mean apart (--fence) is shown once, in general words.
    every = [o for c in SUBCOMMANDS for o in c.options if o is not HELP]
    shared = list({o.names: o for o in every}.values())
    return [_FENCE_ANY if o.names == ("--fence",) else o for o in shared] + [VERSION, HELP_ALL]


def _overview() -> str:
    """``pearing-guard --help``: what each command is for, then the options they share."""
    commands = [(c.label, c.summary) for c in SUBCOMMANDS]
    return render(PROG, SYNOPSIS, SUMMARY, [("commands", commands), ("options", rows(overview_options()))])


def _backend(values: dict[str, object]) -> str:
    """``--backend``, else PEARING_BACKEND, else local: checked before anything is opened."""
    flag = values.get("backend")
    return backend_url(None if flag is None else str(flag), os.environ.get(ENV_BACKEND))


def _env(values: dict[str, object]) -> dict[str, str]:
    """The environment a token is read from, with the backend chosen here."""
    return {**os.environ, ENV_BACKEND: _backend(values)}


def cmd_verify(argv: list[str], log: Log) -> int:
    values, _ = parse(argv, VERIFY.options, positional=False)
    if values.get("help"):
        return _help(VERIFY)
    token_file = values.get("token_file")
    verdict = guard.verify(str(token_file) if token_file else None, env=_env(values))
    if values.get("json"):
        sys.stdout.write(jsontext.dumps(verdict.as_dict()) + "\n")
    if verdict.ok:
        return 0
    log.refused(verdict.reason)
    return int(ExitCode.REFUSED)


def cmd_exec(argv: list[str], log: Log) -> int:
    values, command = parse(argv, EXEC.options, positional=True)
    if values.get("help"):
        return _help(EXEC)
    env = _env(values)
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
        with guard.guarded(str(token_file) if token_file else None, env=env, hold_seconds=max_seconds):
            return _run_bounded(command, max_seconds, log)
    except PearingError as exc:
        if exc.exit_code == ExitCode.REFUSED:
            log.refused(str(getattr(exc, "reason", exc)))
            return int(ExitCode.REFUSED)
        raise


def _run_bounded(command: list[str], max_seconds: float, log: Log) -> int:
    """Run CMD in our own process group (COMMAND's, under pearing-run): whatever stops
    COMMAND's group stops CMD too, and the lock is released only once that group is gone,
    so a guarded write can never outlive a kill -9 of COMMAND's group and land under the
    next holder's fence. SIGINT and SIGQUIT come from the terminal to the whole group, CMD
    included, so we ignore them (as system(3) does); other signals sent to us alone are
    passed on to CMD."""
    # A signal between the spawn and our handlers would kill us and leave CMD running
    # outside the hold-off: block them across, and let CMD start with none blocked.
    old = signal.pthread_sigmask(signal.SIG_BLOCK, _CAUGHT)
    kept = proc.ignored_at_start(_CAUGHT)  # stays ignored here and in CMD (nohup's SIGHUP)
    sigdef = (*(sig for sig in _CAUGHT if sig not in kept), signal.SIGPIPE)
    try:
        pid = os.posix_spawnp(command[0], command, dict(os.environ), setsigdef=sigdef, setsigmask=old)
    except OSError as exc:
        signal.pthread_sigmask(signal.SIG_SETMASK, old)
        found = not isinstance(exc, FileNotFoundError)
        log.error(f"command {'not executable' if found else 'not found'}: {command[0]}: {exc.strerror}")
        return int(ExitCode.NOEXEC if found else ExitCode.NOTFOUND)
    fault.pause("pause-guard-spawned")
    pidfd = os.pidfd_open(pid)
    for sig in _TERMINAL:
        signal.signal(sig, signal.SIG_IGN)
    for sig in _FORWARDED:
        if sig not in kept:
            signal.signal(sig, lambda signum, frame: _send(pidfd, signum))
    signal.pthread_sigmask(signal.SIG_SETMASK, old)
    ready, _, _ = select.select([pidfd], [], [], max_seconds)
    if not ready:
        log.error(f"CMD ran past --max-seconds {max_seconds:g}: killed")
        _kill_tree(pid, pidfd)
        return int(ExitCode.LEASE_LOST)
    _, status = os.waitpid(pid, 0)
    code = os.waitstatus_to_exitcode(status)
    return 128 - code if code < 0 else code


def _send(pidfd: int, sig: int) -> None:
    # Through the pidfd: CMD's pid, once reaped, is never some other process.
    with contextlib.suppress(ProcessLookupError, PermissionError):
        signal.pidfd_send_signal(pidfd, sig)


def _kill_tree(pid: int, pidfd: int) -> None:
    """CMD ran past --max-seconds: TERM to it and what it started, KILL a second later."""
    import psutil

    def tree() -> list[psutil.Process]:
        with contextlib.suppress(psutil.Error):
            return psutil.Process(pid).children(recursive=True)
        return []

    children = tree()
    _send(pidfd, signal.SIGTERM)
    for c in children:
        with contextlib.suppress(psutil.Error):
            c.terminate()
    if not select.select([pidfd], [], [], 1.0)[0]:
        children += tree()
        _send(pidfd, signal.SIGKILL)
    for c in children:  # psutil checks each one's start time: a reused pid is not hit
        with contextlib.suppress(psutil.Error):
            c.kill()
    os.waitpid(pid, 0)


def cmd_fence(argv: list[str], log: Log) -> int:
    values, _ = parse(argv, FENCE.options, positional=False)
    if values.get("help"):
        return _help(FENCE)
    resource, fence = values.get("resource"), values.get("fence")
    if resource is None or fence is None:
        raise UsageError("fence needs --resource NAME and --fence N")
    ledger = values.get("ledger")
    backend = _backend(values)
    ledger_path = str(ledger) if ledger else None
    accepted = guard.accept_fence(str(resource), names.fence(str(fence)), ledger_path, backend=backend)
    if values.get("json"):
        sys.stdout.write(jsontext.dumps({"ok": True, "resource": resource, "fence": accepted}) + "\n")
    return 0


# git-push's flags as its usage line spells them, and the variable each defaults from: the
# environment pearing-run gives its COMMAND.
_GIT_PUSH_DEFAULTS = (
    ("fence", "--fence N", ENV_FENCE),
    ("lock", "--lock NAME", ENV_LOCK),
    ("repo", "--repo SCOPE", ENV_REPO),
)


def _git_push_target(values: dict[str, object]) -> dict[str, str]:
    """fence, lock and repo: each flag, else its variable (``--fence=`` is a bad fence, not absent)."""
    given = {dest: values.get(dest, os.environ.get(var)) for dest, _, var in _GIT_PUSH_DEFAULTS}
    missing = [(spelt, var) for dest, spelt, var in _GIT_PUSH_DEFAULTS if given[dest] is None]
    if missing:
        flags, variables = " and ".join(m[0] for m in missing), ", ".join(m[1] for m in missing)
        raise UsageError(f"git-push needs {flags} (or {variables}, as pearing-run sets for its COMMAND)")
    return {dest: str(value) for dest, value in given.items()}


def cmd_git_push(argv: list[str], log: Log) -> int:
    values, rest = parse(argv, GIT_PUSH.options, positional=True)
    if values.get("help"):
        return _help(GIT_PUSH)
    target = _git_push_target(values)
    if not rest:
        raise UsageError("git-push needs REMOTE and at least one REFSPEC")
    fence = names.fence(target["fence"])
    try:
        from singleflight import gitpush  # subprocess and the rest: git-push's, not verify's hot path

        out = gitpush.push(rest[0], rest[1:], fence=fence, scope=target["repo"], lock=target["lock"])
    except ToolFailed as exc:  # git's own failure: its words and its status, untouched
        _write(exc.stdout, exc.stderr)
        return exc.status
    _write(out.stdout, out.stderr)
    return 0


def _write(stdout: bytes, stderr: bytes) -> None:
    """git's output, byte for byte. The push is done by now: a closed or broken stream must
    not turn its status into ours (an internal error)."""
    for stream, data in ((sys.stdout, stdout), (sys.stderr, stderr)):
        if data and stream is not None:  # None when started with that fd closed
            with contextlib.suppress(OSError, ValueError):
                stream.flush()
                stream.buffer.write(data)
                stream.flush()


COMMANDS = {"verify": cmd_verify, "exec": cmd_exec, "fence": cmd_fence, "git-push": cmd_git_push}


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    log = Log(PROG)
    try:
        if not args or args[0] in ("-h", "--help"):
            sys.stdout.write(_overview() if args else f"usage: {PROG} {SYNOPSIS}\n")
            return 0 if args else int(ExitCode.USAGE)
        if args[0] == "--version":
            sys.stdout.write(f"{PROG} {__version__}\n")
            return 0
        handler = COMMANDS.get(args[0])
        if handler is None:
            raise UsageError(f"unknown command {args[0]!r}: use verify, exec, fence or git-push")
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


def entry() -> NoReturn:
    """The ``pearing-guard`` command."""
    script(main)


if __name__ == "__main__":
    entry()
