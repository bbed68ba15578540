"""Shared helpers for the pearing-run tests: real processes, file/pipe synchronisation.

Nothing here waits with a bare sleep: every wait is ``wait_for`` (10 ms polls,
hard timeout, fails the test with a message) or a blocking read/wait on a
process the test started.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import shlex
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterable, Iterator, Sequence
from pathlib import Path
from typing import Any

import pytest
from caps import caps_of

BIN_DIR = os.path.dirname(sys.executable)
PEARING_RUN = os.path.join(BIN_DIR, "pearing-run")
PEARING_CLI = os.path.join(BIN_DIR, "pearing-cli")
PEARING_GUARD = os.path.join(BIN_DIR, "pearing-guard")

# Every process a test starts inherits this variable (pearing-run passes its
# environment on to the holder, COMMAND and COMMAND's children), so teardown
# can find and kill exactly the processes of that one test.
MARKER_VAR = "SINGLEFLIGHT_TEST_MARKER"

POLL = 0.01


def q(value: object) -> str:
    """Shell-quote a path or word for a ``sh -c`` script."""
    return shlex.quote(str(value))


def wait_for(predicate: Callable[[], Any], timeout: float = 10.0, what: str = "condition") -> Any:
    """Poll ``predicate`` every 10 ms; return its first truthy value, or fail the test.

    A predicate that starts a process (a pearing-cli, 0.1 s of CPU) is asked at most half the
    time: polled back to back it would keep a core busy, slowing the very runs it waits for."""
    deadline = time.monotonic() + timeout
    while True:
        asked = time.monotonic()
        value = predicate()
        if value:
            return value
        now = time.monotonic()
        if now >= deadline:
            pytest.fail(f"timed out after {timeout:g} s waiting for {what}")
        time.sleep(max(POLL, now - asked))  # the poll interval of wait_for itself, never a wait on its own


def read_line_file(path: Path) -> str | None:
    """The content of a file written with ``echo ... > path``, once it is complete."""
    try:
        text = path.read_text()
    except FileNotFoundError:
        return None
    return text if text.endswith("\n") else None


def line_file(path: Path) -> str | None:
    """The stripped line of a file written with ``echo ... > path`` (None until it is complete)."""
    text = read_line_file(path)
    return None if text is None else text.strip()


def wait_line(path: Path, timeout: float = 10.0) -> str:
    """Wait until a COMMAND has written a complete line file; return it stripped."""
    return str(wait_for(lambda: read_line_file(path), timeout, f"{path.name} to be written")).strip()


def proc_state(pid: int) -> str | None:
    """The /proc state letter of ``pid`` (None if there is no such process)."""
    try:
        data = Path(f"/proc/{pid}/stat").read_bytes()
    except (FileNotFoundError, ProcessLookupError):
        return None
    return data[data.rindex(b")") + 2 :].split()[0].decode()


def signal_sets(status: str) -> dict[str, int]:
    """The signal sets (SigBlk, SigIgn, SigCgt, ...) of a /proc/PID/status text, or of the lines
    of it that a COMMAND grepped, as bit sets."""
    sets = ("SigPnd", "ShdPnd", "SigBlk", "SigIgn", "SigCgt")
    return {k: int(v, 16) for k, _, v in (line.partition(":") for line in status.splitlines()) if k in sets}


def signals_in(bits: int) -> set[signal.Signals]:
    """The signals of a bit set from ``signal_sets``."""
    return {sig for sig in signal.Signals if bits & (1 << (sig - 1))}


def signal_disposition(pid: int, sig: int) -> str:
    """How ``pid`` takes ``sig`` (/proc/PID/status): "blocked", "ignored", "caught" or "default"."""
    sets = signal_sets(Path(f"/proc/{pid}/status").read_text())
    for name, field in (("blocked", "SigBlk"), ("ignored", "SigIgn"), ("caught", "SigCgt")):
        if sig in signals_in(sets[field]):
            return name
    return "default"


def pid_alive(pid: int) -> bool:
    """Running (a zombie waiting for its reaper counts as dead)."""
    return proc_state(pid) not in (None, "Z", "X")


def proc_fd_targets(pid: int) -> list[str]:
    """What the open fds of ``pid`` point at (readlink of /proc/PID/fd/*)."""
    out = []
    with contextlib.suppress(FileNotFoundError, ProcessLookupError):
        for name in os.listdir(f"/proc/{pid}/fd"):
            with contextlib.suppress(FileNotFoundError, ProcessLookupError):
                out.append(os.readlink(f"/proc/{pid}/fd/{name}"))
    return out


def pipe_id(fileobj: Any) -> str:
    """How /proc shows the pipe behind ``fileobj`` in another process's fd table."""
    return f"pipe:[{os.fstat(fileobj.fileno()).st_ino}]"


# -- the lock dir layout (see singleflight/store.py) ---------------------------------------


def store_dir(lock_dir: Path, job: str, repo: str = "default") -> Path:
    return lock_dir.joinpath("locks", *repo.split("/"), "@" + job)


def read_json(path: Path) -> dict[str, Any] | None:
    try:
        return json.loads(path.read_text())
    except FileNotFoundError:
        return None


def ticket_records(lock_dir: Path, job: str, sub: str = "tickets", repo: str = "default") -> list[dict[str, Any]]:
    d = store_dir(lock_dir, job, repo) / sub
    out = []
    if d.is_dir():
        for p in sorted(d.glob("*.json")):
            rec = read_json(p)
            if rec is not None:
                out.append(rec)
    return out


def ticket_record(lock_dir: Path, job: str, ticket_id: str, repo: str = "default") -> tuple[str, dict[str, Any]] | None:
    """(``tickets`` or ``ended``, record) for one ticket, live record first."""
    for sub in ("tickets", "ended"):
        rec = read_json(store_dir(lock_dir, job, repo) / sub / f"{ticket_id}.json")
        if rec is not None:
            return sub, rec
    return None


def all_files(root: Path) -> list[Path]:
    return [Path(dirpath, name) for dirpath, _dirs, files in os.walk(root) for name in files]


def lock_dir_blobs(lock_dir: Path) -> dict[str, bytes]:
    """Every file under the lock dir and its bytes, as one consistent look: a live holder writes
    by temp file and rename, so a file listed can be gone by the time it is read. Such a look is
    taken again (a few times), never skipped: a file that vanished is not a file checked."""
    for _ in range(20):
        try:
            return {str(f): f.read_bytes() for f in all_files(lock_dir)} if lock_dir.is_dir() else {}
        except FileNotFoundError:
            continue
    raise AssertionError(f"files under {lock_dir} kept changing while read")


def tree(root: Path) -> set[str]:
    """Every path (dirs and files) below ``root``, relative."""
    out = set()
    for dirpath, dirs, files in os.walk(root):
        for name in [*dirs, *files]:
            out.add(os.path.relpath(os.path.join(dirpath, name), root))
    return out


# -- a gate a blocking COMMAND waits at ------------------------------------------------------


class Gate:
    """``ready`` is touched by COMMAND when it is running; COMMAND blocks until ``go`` exists."""

    def __init__(self, directory: Path, name: str = "gate") -> None:
        self.ready = directory / f"{name}.ready"
        self.go = directory / f"{name}.go"

    def script(self) -> str:
        """The sh fragment: announce, then block on a file the test controls."""
        return f"touch {q(self.ready)}; while [ ! -e {q(self.go)} ]; do sleep 0.01; done"

    def wait_ready(self, timeout: float = 10.0) -> None:
        wait_for(self.ready.exists, timeout, f"COMMAND to reach {self.ready.name}")

    def open(self) -> None:
        self.go.touch()


# -- processes ---------------------------------------------------------------------------


class Result:
    def __init__(self, returncode: int, stdout: bytes, stderr: bytes, elapsed: float) -> None:
        self.returncode, self.stdout, self.stderr, self.elapsed = returncode, stdout, stderr, elapsed

    @property
    def err_lines(self) -> list[str]:
        return self.stderr.decode(errors="replace").splitlines()

    def __repr__(self) -> str:
        return (
            f"Result(rc={self.returncode}, elapsed={self.elapsed:.3f}s, "
            f"stdout={self.stdout[-2000:]!r}, stderr={self.stderr[-2000:]!r})"
        )


class TextResult:
    """A finished process whose stdout and stderr were read as text (``Procs.run_text``)."""

    def __init__(self, returncode: int, stdout: str, stderr: str, elapsed: float) -> None:
        self.returncode, self.stdout, self.stderr, self.elapsed = returncode, stdout, stderr, elapsed

    @property
    def json(self) -> Any:
        return json.loads(self.stdout)

    def one_line(self) -> str:
        """The one line on stderr; fails the test if there is not exactly one."""
        lines = self.stderr.strip().splitlines()
        assert len(lines) == 1, f"expected one line on stderr, got {self.stderr!r}"
        return lines[0]

    def __repr__(self) -> str:
        return (
            f"TextResult(rc={self.returncode}, elapsed={self.elapsed:.3f}s, "
            f"stdout={self.stdout[-2000:]!r}, stderr={self.stderr[-2000:]!r})"
        )


class Procs:
    """Starts processes for one test and leaves none of them running afterwards."""

    def __init__(self, env: dict[str, str], cwd: Path, lock_dir: Path) -> None:
        self.env, self.cwd, self.lock_dir = env, cwd, lock_dir
        self.marker = f"{MARKER_VAR}={env[MARKER_VAR]}".encode()
        self.popens: list[subprocess.Popen[bytes]] = []
        self.started: dict[int, float] = {}

    def start(
        self,
        args: Sequence[str],
        *,
        env: dict[str, str] | None = None,
        stdin: Any = subprocess.DEVNULL,
        stdout: Any = subprocess.PIPE,
        stderr: Any = subprocess.PIPE,
        text: bool = False,
        own_group: bool = False,
    ) -> subprocess.Popen[Any]:
        """Start ``args``; with ``text`` its pipes carry str instead of bytes. Each starts in a
        session of its own; with ``own_group``, in a process group of its own in the test's
        session instead: the kernel discards ^Z (SIGTSTP) sent to a group with no parent outside
        it in its session, as a new session's is."""
        started = time.monotonic()
        p = subprocess.Popen(
            list(args),
            env=self.env if env is None else env,
            cwd=self.cwd,
            stdin=stdin,
            stdout=stdout,
            stderr=stderr,
            text=text,
            start_new_session=not own_group,
            process_group=0 if own_group else None,
        )
        self.popens.append(p)
        self.started[p.pid] = started
        return p

    def pr(self, *args: str, **kw: Any) -> subprocess.Popen[bytes]:
        """Start ``pearing-run ARGS``."""
        return self.start([PEARING_RUN, *args], **kw)

    def _communicate(self, p: subprocess.Popen[Any], timeout: float) -> tuple[Any, Any, float]:
        """Wait for exit and EOF on its pipes: (stdout, stderr, seconds since start)."""
        try:
            out, err = p.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            pytest.fail(f"{p.args!r} did not finish within {timeout:g} s")
        return out, err, time.monotonic() - self.started[p.pid]

    def finish(self, p: subprocess.Popen[bytes], timeout: float = 30.0) -> Result:
        """Wait for exit and EOF on its pipes; elapsed is since start."""
        out, err, elapsed = self._communicate(p, timeout)
        return Result(p.returncode, out or b"", err or b"", elapsed)

    def run(self, args: Sequence[str], timeout: float = 30.0, **kw: Any) -> Result:
        return self.finish(self.start(args, **kw), timeout)

    def run_text(self, args: Sequence[str], *, env: dict[str, str] | None = None, timeout: float = 30.0) -> TextResult:
        """Run ``args`` to the end with stdin from /dev/null, reading stdout and stderr as text."""
        p = self.start(args, env=env, text=True)
        out, err, elapsed = self._communicate(p, timeout)
        return TextResult(p.returncode, out or "", err or "", elapsed)

    def pr_run(self, *args: str, timeout: float = 30.0, **kw: Any) -> Result:
        """Run ``pearing-run ARGS`` to the end."""
        return self.run([PEARING_RUN, *args], timeout=timeout, **kw)

    # -- teardown ----------------------------------------------------------------------

    def _marked_pids(self) -> list[int]:
        me = os.getpid()
        out = []
        for name in os.listdir("/proc"):
            if not name.isdigit() or int(name) == me:
                continue
            try:
                environ = Path(f"/proc/{name}/environ").read_bytes()
            except OSError:
                continue
            if self.marker in environ.split(b"\0") and pid_alive(int(name)):
                out.append(int(name))
        return out

    def wait_idle(self, timeout: float = 15.0) -> None:
        """Until every process started here, and all they forked, has exited: a holder tidies up
        (``housekeeping``) after its pearing-run has returned."""
        wait_for(lambda: not self._marked_pids(), timeout, "the runs and their holders to exit")

    def _holder_pids(self, ours: set[int]) -> Iterable[int]:
        """Holders named by ticket records, if they are still alive and ours (not a reused pid)."""
        locks = self.lock_dir / "locks"
        if not locks.is_dir():
            return []
        pids = set()
        for path in locks.rglob("*.json"):
            if path.parent.name not in ("tickets", "ended"):
                continue
            with contextlib.suppress(OSError, ValueError, AttributeError):
                pid = json.loads(path.read_text()).get("holder_pid")
                if isinstance(pid, int) and pid > 1:
                    pids.add(pid)
        return [pid for pid in pids if pid in ours]

    def cleanup(self) -> None:
        for p in self.popens:
            if p.poll() is None:
                with contextlib.suppress(ProcessLookupError):
                    p.kill()
        deadline = time.monotonic() + 10.0
        while time.monotonic() < deadline:
            marked = set(self._marked_pids())
            victims = marked | set(self._holder_pids(marked))
            if not victims:
                break
            for pid in victims:
                with contextlib.suppress(ProcessLookupError, PermissionError):
                    os.kill(pid, signal.SIGKILL)
            time.sleep(POLL)  # give the kernel a moment to tear them down, then look again
        for p in self.popens:
            with contextlib.suppress(subprocess.TimeoutExpired, ValueError, OSError):
                p.communicate(timeout=5)
            if p.poll() is None:
                p.kill()
                p.wait(timeout=5)


# -- what a user sees, on either backend: pearing-cli's JSON -------------------------------------


def cli_json(procs: Procs, *args: str) -> Any:
    """``pearing-cli ARGS`` (in the test's environment, so on its backend), which must exit 0: its JSON."""
    r = procs.run([PEARING_CLI, *args])
    assert r.returncode == 0, r
    return json.loads(r.stdout)


def lock_status(procs: Procs, job: str, repo: str = "default") -> dict[str, Any]:
    """``pearing-cli status JOB``'s entry for the lock; a lock the backend does not list is free.

    Read in this process, through the function ``pearing-cli status`` prints (``ops.status``),
    on the backend and lock dir of the test's environment: tests poll it every 10 ms while a
    run gets in line, and a pearing-cli per poll was a busy loop of interpreter starts that
    slowed the very runs being waited for. test_cli.py checks the command prints the same."""
    from singleflight import ops
    from singleflight.backend import Opened
    from singleflight.core.const import ENV_BACKEND, ENV_LOCK_DIR

    backend = Opened(procs.env.get(ENV_BACKEND) or None, procs.env[ENV_LOCK_DIR])
    try:
        locks = json.loads(json.dumps(ops.status(backend, repo, job)))
    finally:
        backend.close()
    if not locks:
        return {"lock_name": job, "repo": repo, "state": "free", "holder": None, "waiters": []}
    [entry] = locks
    assert isinstance(entry, dict)
    return entry


def holder_pid(procs: Procs, job: str, wrapper: int, repo: str = "default") -> int:
    """The detached holder's pid, once it has recorded itself: until then the line names who
    waited, the wrapper (etcd's holder settles its record after COMMAND starts, off the hand-over)."""

    def settled() -> int | None:
        holder = lock_status(procs, job, repo)["holder"]
        found = holder and holder.get("holder_pid")
        return int(found) if found and found != wrapper else None

    return int(wait_for(settled, 15, "the holder to record its pid"))


def get_ticket(procs: Procs, job: str, ticket_id: str, repo: str = "default") -> dict[str, Any]:
    """``pearing-cli get-lock-ticket JOB TICKET``."""
    ticket = cli_json(procs, "get-lock-ticket", job, ticket_id, "--repo", repo)
    assert isinstance(ticket, dict)
    return ticket


def wait_queued(procs: Procs, job: str, count: int, repo: str = "default", timeout: float = 15.0) -> None:
    """Wait until ``count`` runs wait in line on the lock, each in its place (as ``status`` shows it)."""

    def queued() -> bool:
        waiters = lock_status(procs, job, repo)["waiters"]
        return [w["queue_position"] for w in waiters] == list(range(1, count + 1))

    wait_for(queued, timeout, f"{count} waiter(s) in line on {job}")


def backend_url(env: dict[str, str]) -> str | None:
    """The etcd URL the test's commands use, or None on the lock dir."""
    from singleflight.core.const import ENV_BACKEND

    return env.get(ENV_BACKEND)


def stored_blobs(env: dict[str, str], lock_dir: Path) -> dict[str, bytes]:
    """Everything the backend keeps: the lock dir's files and, on etcd, the values under the
    test's tenant prefix. Named by path or key."""
    out = lock_dir_blobs(lock_dir)
    url = backend_url(env)
    if url is not None and caps_of(url).records_in_tables:
        out.update(pg_rows(url))
    elif url is not None:
        from singleflight.etcd.client import Cluster

        cluster = Cluster(url)
        kvs, _ = cluster.range_prefix(cluster.root)
        out.update({kv["key"]: kv["value"] for kv in kvs})
    return out


def pg_query(url: str, sql: str, params: tuple[Any, ...] = ()) -> list[tuple[Any, ...]]:
    """One statement on the test's PostgreSQL tenant (``{s}``: its schema)."""
    from singleflight.postgres.db import Db

    db = Db(url)
    try:
        return db.q(sql, params)
    finally:
        db.close()


def pg_rows(url: str) -> dict[str, bytes]:
    """Every row of the tenant's tables, as text, named by table and row number."""
    out = {}
    for table in ("locks", "tickets", "records", "guards", "threads", "replies"):
        for i, row in enumerate(pg_query(url, f"SELECT x::text FROM {{s}}.{table} x")):
            out[f"{table}/{i}"] = str(row[0]).encode()
    return out


def ticket_ids(env: dict[str, str], lock_dir: Path, job: str, repo: str = "default") -> set[str]:
    """Every ticket the backend has recorded for the lock, live or ended."""
    url = backend_url(env)
    if url is None:
        return {rec["ticket_id"] for sub in ("tickets", "ended") for rec in ticket_records(lock_dir, job, sub, repo)}
    if caps_of(url).records_in_tables:
        return {r[0] for r in pg_query(url, "SELECT id FROM {s}.tickets WHERE scope = %s AND name = %s", (repo, job))}
    from singleflight.etcd.client import Cluster

    cluster = Cluster(url)
    prefix = f"{cluster.root}{repo}/@{job}/t/"  # every ticket as created, kept an hour
    kvs, _ = cluster.range_prefix(prefix)
    return {kv["key"][len(prefix) :] for kv in kvs}


def forget_ticket(env: dict[str, str], lock_dir: Path, job: str, ticket_id: str, repo: str = "default") -> None:
    """What the backend keeps of an ended ticket, removed, as its retention does an hour after it
    ended: the lock dir's record, etcd's end record and copy, PostgreSQL's row."""
    url = backend_url(env)
    if url is None:
        for sub in ("tickets", "ended"):
            with contextlib.suppress(FileNotFoundError):
                (store_dir(lock_dir, job, repo) / sub / f"{ticket_id}.json").unlink()
        return
    if caps_of(url).records_in_tables:
        assert pg_query(url, "DELETE FROM {s}.tickets WHERE id = %s RETURNING id", (ticket_id,))
        return
    from singleflight.etcd.client import Cluster
    from singleflight.etcd.lock import Mutex

    cluster = Cluster(url)
    mutex = Mutex(cluster, repo, job)
    for key in (mutex.e + ticket_id, mutex.t + ticket_id):
        cluster.delete(key)


# -- reliability suite: consistent snapshots of a lock's records ----------------------------------


@contextlib.contextmanager
def lock_mutex(lock_dir: Path, job: str, repo: str = "default") -> Iterator[None]:
    """Hold the lock's record mutex (``state.lock``, as the product does around every
    read-modify-write), so a scan of tickets/ sees one consistent moment."""
    try:
        fd = os.open(store_dir(lock_dir, job, repo) / "state.lock", os.O_RDWR | os.O_NOFOLLOW | os.O_CLOEXEC)
    except FileNotFoundError:
        yield  # nothing has been recorded yet: nothing to race with
        return
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)


def held_records(lock_dir: Path, job: str, repo: str = "default") -> list[dict[str, Any]]:
    """The ticket records in tickets/ with state held, read under the record mutex."""
    with lock_mutex(lock_dir, job, repo):
        return [rec for rec in ticket_records(lock_dir, job, repo=repo) if rec.get("state") == "held"]


def record_alive(rec: dict[str, Any]) -> bool:
    """Is the process a ticket names as its holder the very process that was recorded?"""
    from singleflight.core import proc as _proc

    pid, start = rec.get("holder_pid"), rec.get("holder_start")
    return isinstance(pid, int) and isinstance(start, int) and _proc.alive(pid, start)


def assert_one_live_holder_at_most(lock_dir: Path, job: str, repo: str = "default") -> list[dict[str, Any]]:
    """At most one ticket is held, and a held one has a live holder. Returns the held records."""
    held = held_records(lock_dir, job, repo)
    assert len(held) <= 1, f"{len(held)} tickets held at once: {held}"
    for rec in held:
        assert record_alive(rec), f"ticket recorded held but its holder is gone: {rec}"
    return held


def fence_on_disk(lock_dir: Path, job: str, repo: str = "default") -> int:
    """The lock's fence file (0 when none was issued yet)."""
    try:
        text = (store_dir(lock_dir, job, repo) / "fence").read_text()
    except FileNotFoundError:
        return 0
    return int(text)


def kill_exact(pid: int, start: int | None, sig: int = signal.SIGKILL) -> bool:
    """Signal ``pid`` only if it is still the process that started at ``start`` (no pid-reuse
    accident): the check and the signal go through one pidfd. True if the signal was sent."""
    from singleflight.core import proc as _proc

    try:
        fd = os.pidfd_open(pid)
    except (ProcessLookupError, OSError):
        return False
    try:
        if start is None or _proc.start_time(pid) != start:
            return False
        signal.pidfd_send_signal(fd, sig)
        return True
    except ProcessLookupError:
        return False
    finally:
        os.close(fd)


def live_agent_pids(lock_dir: Path) -> list[int]:
    """Holder pids named by live (tickets/) records anywhere in the lock dir, if still alive."""
    locks = lock_dir / "locks"
    out = []
    if locks.is_dir():
        for path in locks.rglob("tickets/*.json"):
            with contextlib.suppress(OSError, ValueError):
                rec = json.loads(path.read_text())
                if record_alive(rec):
                    out.append(int(rec["holder_pid"]))
    return out


def freeze_waiting(pid: int, stime: int, mutex: Path) -> None:
    """SIGSTOP a waiter that is waiting, not inside the lock dir's mutex (its ticket is visible
    a moment before it publishes its place and lets go of ``state.lock``). Frozen in there, it
    holds every acquirer of the lock until it resumes, its wait deadline or not: no process can
    take a kernel lock from a stopped holder. (^Z is SIGTSTP: see docs/faults.md.) Retried until
    the mutex is seen free with the waiter stopped; etcd has no such mutex."""
    for _ in range(200):
        assert kill_exact(pid, stime, signal.SIGSTOP)
        wait_for(lambda: proc_state(pid) == "T", 5, "the waiter to stop")
        try:
            fd = os.open(mutex, os.O_RDONLY)
        except FileNotFoundError:
            return  # no lock dir mutex: etcd
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            return  # free (ours for a moment; closed below), so the waiter is outside it
        except BlockingIOError:
            pass
        finally:
            os.close(fd)
        kill_exact(pid, stime, signal.SIGCONT)
        time.sleep(0.002)  # let it finish the critical section: a pause, not a sync
    pytest.fail("the waiter never left the mutex")


def stubborn_command(work: Path, ready: Path) -> str:
    """A COMMAND for a holder cut off from its store: it saves its token file (``old.token``) and
    fence (``f1``), touches ``ready``, notes SIGTERM (``term``) and ignores it, and stamps itself
    alive every 10 ms (``alive``): only the KILL at the end of its grace stops it."""
    alive = q(work / "alive")
    return (
        f"cp $PEARING_TOKEN_FILE {q(work / 'old.token')}; echo $PEARING_FENCE > {q(work / 'f1')}; "
        f"trap 'date +%s%N > {q(work / 'term')}' TERM; touch {q(ready)}; "
        f"while :; do date +%s%N > {alive}.tmp && mv {alive}.tmp {alive}; sleep 0.01; done"
    )
