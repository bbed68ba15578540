"""A hostile or broken lock dir: planted symlinks, loose permissions, a foreign owner, a reused
pid, wall-clock jumps, a full disk and corrupt records.

SPEC "Bad input and faults": files in the lock dir are never followed through symlinks, the
lock dir is 0700 and refused when group/world-writable or foreign (77), a token never lies on
disk in the clear outside its 0600 token file, PID reuse cannot make a dead holder look alive,
lease deadlines are monotonic, and a corrupt record is reported with its path (74), never reset.
"""

from __future__ import annotations

import errno
import hashlib
import json
import os
import resource
import shutil
import stat
import subprocess
import time
import uuid
from pathlib import Path
from typing import Any

import pytest
from helpers import (
    PEARING_CLI,
    PEARING_GUARD,
    PEARING_RUN,
    Gate,
    Procs,
    all_files,
    held_records,
    lock_dir_blobs,
    q,
    read_json,
    store_dir,
    tree,
    wait_for,
)

from singleflight.core import fs as _fs
from singleflight.core import proc as _proc
from singleflight.core.const import ENV_TICKET, ENV_TOKEN_FILE, HELD, ExitCode
from singleflight.core.errors import LockDirError, NotHeld
from singleflight.core.record import new_uuid4
from singleflight.core.ticket import Ticket
from singleflight.core.tokens import Claim, token_hash
from singleflight.local import guard, lease
from singleflight.local.store import LockDir
from singleflight.rules import verdict as verdict_rules

pytestmark = pytest.mark.local_only("a hostile or broken lock dir: its files, modes, records and clocks")

NOPERM = int(ExitCode.NOPERM)
IOERR = int(ExitCode.IOERR)
CANTCREAT = int(ExitCode.CANTCREAT)
REFUSED = int(ExitCode.REFUSED)


def sh(script: str) -> list[str]:
    return ["sh", "-c", script]


def snapshot(path: Path) -> Any:
    """Content, mode and mtime of a file, or of every entry under a directory."""
    if path.is_dir():
        return {
            rel: (p.stat().st_mode, p.stat().st_mtime_ns, p.read_bytes() if p.is_file() else None)
            for rel, p in ((r, path / r) for r in sorted(tree(path)))
        } | {".": (path.stat().st_mode, path.stat().st_mtime_ns, None)}
    st = path.stat()
    return (st.st_mode, st.st_mtime_ns, path.read_bytes())


@pytest.fixture
def outside(tmp_path: Path) -> Path:
    """Targets for planted symlinks, outside the lock dir."""
    d = tmp_path / "outside"
    (d / "dir").mkdir(parents=True)
    (d / "dir" / "keep").write_text("keep\n")
    (d / "file").write_text('{"branch:x": 1}\n')
    return d


def plant(victim: Path, outside: Path) -> Path:
    """Replace ``victim`` (a file or a dir in the lock dir) by a symlink to a twin outside."""
    if victim.is_dir():
        shutil.rmtree(victim)
        target = outside / "dir"
    else:
        victim.unlink(missing_ok=True)
        target = outside / "file"
    victim.symlink_to(target)
    return target


# -- planted symlinks ------------------------------------------------------------------------

# The brief's six plus every other entry of the per-lock layout (store.py).
SYMLINK_VICTIMS = [
    "locks",
    "locks/default",
    "locks/default/@J",
    "locks/default/@J/lock",
    "locks/default/@J/fence",
    "locks/default/@J/tickets",
    "locks/default/@J/tokens",
    "locks/default/@J/ended",
    "locks/default/@J/queue",
    "locks/default/@J/requests",
    "locks/default/@J/holder",
    "locks/default/@J/state.lock",
    "locks/default/@J/guard.lock",
]


@pytest.mark.parametrize("victim", SYMLINK_VICTIMS, ids=[v.split("/")[-1] for v in SYMLINK_VICTIMS])
def test_planted_symlink_is_refused_not_followed(
    procs: Procs, lock_dir: Path, work: Path, outside: Path, victim: str
) -> None:
    u = str(uuid.uuid4())
    assert procs.pr_run("--job", "J", "--request-uuid", u, "--", "true").returncode == 0
    # The holder tidies up after pearing-run returned (housekeeping): planting while it writes
    # in the lock's dir failed the rmtree ("Directory not empty") once in a full run.
    procs.wait_idle()
    path = lock_dir / victim
    target = plant(path, outside)
    before = snapshot(outside)

    r = procs.pr_run("--job", "J", "--request-uuid", str(uuid.uuid4()), "--", "touch", str(work / "ran"))
    assert r.returncode == NOPERM, r
    assert len(r.err_lines) == 1, r
    assert str(path) in r.err_lines[0] and "symlink" in r.err_lines[0], r
    assert not (work / "ran").exists(), "COMMAND ran in a lock dir with a planted symlink"
    assert snapshot(outside) == before, f"wrote through the symlink into {target}"
    assert path.is_symlink(), "the planted symlink was replaced, not refused"
    # The CLI refuses too, without touching the target.
    c = procs.run([PEARING_CLI, "acquire-lock", "J", "--request-uuid", str(uuid.uuid4()), "--lease-seconds", "5"])
    assert c.returncode == NOPERM, c
    assert snapshot(outside) == before


def test_lock_dir_itself_a_symlink_is_refused(procs: Procs, tmp_path: Path, work: Path, outside: Path) -> None:
    link = tmp_path / "linked-lockdir"
    real = outside / "dir"
    real.chmod(0o700)
    link.symlink_to(real)
    before = snapshot(outside)
    r = procs.pr_run("--lock-dir", str(link), "--job", "J", "--", "touch", str(work / "ran"))
    assert r.returncode == NOPERM, r
    assert len(r.err_lines) == 1 and str(link) in r.err_lines[0], r
    assert not (work / "ran").exists()
    assert snapshot(outside) == before


@pytest.mark.parametrize("victim", ["ledger.json", "ledger.json.lock"])
def test_planted_symlink_at_the_ledger_is_refused(
    procs: Procs, lock_dir: Path, outside: Path, tmp_path: Path, victim: str
) -> None:
    fence = [PEARING_GUARD, "fence", "--resource", "branch:x", "--fence"]
    assert procs.run([*fence, "2"]).returncode == 0
    plant(lock_dir / victim, outside)
    before = snapshot(outside)
    r = procs.run([*fence, "3"])
    assert r.returncode == NOPERM, r
    assert len(r.err_lines) == 1 and str(lock_dir / victim) in r.err_lines[0], r
    assert snapshot(outside) == before

    # An explicit --ledger that is a symlink is refused the same way.
    link = tmp_path / "ledger-link.json"
    link.symlink_to(outside / "file")
    r = procs.run([*fence, "5", "--ledger", str(link)])
    assert r.returncode == NOPERM, r
    assert len(r.err_lines) == 1, r
    assert snapshot(outside) == before


# -- permissions and ownership ------------------------------------------------------------------


@pytest.mark.parametrize("mode", [0o777, 0o770, 0o720, 0o702, 0o1777])
def test_loose_lock_dir_is_refused(procs: Procs, lock_dir: Path, work: Path, mode: int) -> None:
    assert procs.pr_run("--job", "J", "--", "true").returncode == 0
    procs.wait_idle()
    lock_dir.chmod(mode)
    before = tree(lock_dir)
    r = procs.pr_run("--job", "J", "--", "touch", str(work / "ran"))
    assert r.returncode == NOPERM, r
    assert len(r.err_lines) == 1 and str(lock_dir) in r.err_lines[0] and "writable" in r.err_lines[0], r
    assert not (work / "ran").exists()
    assert tree(lock_dir) == before
    g = procs.run([PEARING_GUARD, "fence", "--resource", "r", "--fence", "1"])
    assert g.returncode == NOPERM, g
    assert not (lock_dir / "ledger.json").exists()


@pytest.mark.skipif(os.geteuid() != 0, reason="chown to another user needs root")
def test_foreign_lock_dir_is_refused(procs: Procs, lock_dir: Path, work: Path) -> None:
    assert procs.pr_run("--job", "J", "--", "true").returncode == 0
    procs.wait_idle()
    os.chown(lock_dir, 65534, 65534)
    before = tree(lock_dir)
    r = procs.pr_run("--job", "J", "--", "touch", str(work / "ran"))
    assert r.returncode == NOPERM, r
    assert len(r.err_lines) == 1 and "65534" in r.err_lines[0] and str(lock_dir) in r.err_lines[0], r
    assert not (work / "ran").exists()
    assert tree(lock_dir) == before
    c = procs.run([PEARING_CLI, "status"])
    assert c.returncode == NOPERM, c


def test_modes_even_with_umask_zero(procs: Procs, lock_dir: Path, work: Path) -> None:
    """The lock dir and every dir in it are 0700, every file 0600 (the token file included),
    whatever the caller's umask."""
    gate = Gate(work)
    tf = work / "token-file-path"
    script = f"echo ${ENV_TOKEN_FILE} > {q(tf)}; {gate.script()}"
    p = procs.start(["sh", "-c", 'umask 000; exec "$0" "$@"', PEARING_RUN, "--job", "J", "--", *sh(script)])
    gate.wait_ready()
    token_file = Path(tf.read_text().strip())
    assert stat.S_IMODE(token_file.stat().st_mode) == 0o600
    g = procs.run(["sh", "-c", f"umask 000; exec {q(PEARING_GUARD)} fence --resource r --fence 3"])
    assert g.returncode == 0, g
    assert stat.S_IMODE(lock_dir.stat().st_mode) == 0o700
    loose = []
    for dirpath, dirs, files in os.walk(lock_dir):
        for name in dirs:
            if stat.S_IMODE(os.lstat(os.path.join(dirpath, name)).st_mode) != 0o700:
                loose.append(os.path.join(dirpath, name))
        for name in files:
            if stat.S_IMODE(os.lstat(os.path.join(dirpath, name)).st_mode) & 0o077:
                loose.append(os.path.join(dirpath, name))
    assert loose == [], f"group/world bits on {loose}"
    gate.open()
    assert procs.finish(p).returncode == 0


# -- the raw token --------------------------------------------------------------------------------


def test_raw_token_only_in_its_token_file(procs: Procs, lock_dir: Path, work: Path) -> None:
    gate = Gate(work)
    seen = work / "seen.json"
    # COMMAND copies what it was given out of the lock dir, heartbeats, sets an activity, and a
    # guarded fence lands in the default ledger: every kind of record exists while the token lives.
    script = (
        f'printf \'{{"token_file": "%s", "ticket": "%s"}}\' "${ENV_TOKEN_FILE}" "${ENV_TICKET}" > {q(seen)}; '
        f"{q(PEARING_CLI)} heartbeat-lock-ticket --lease-seconds 60 >/dev/null; "
        f"{q(PEARING_CLI)} update-user-activity --activity busy >/dev/null; "
        f"{q(PEARING_GUARD)} exec -- {q(PEARING_GUARD)} fence --resource r --fence $PEARING_FENCE; "
        f"{gate.script()}"
    )
    p = procs.pr("--job", "J", "--request-uuid", str(uuid.uuid4()), "--", *sh(script))
    gate.wait_ready()
    info = read_json(seen)
    assert info is not None
    token_file = Path(info["token_file"])
    token = json.loads(token_file.read_text())["token"]
    assert len(token) >= 32
    needle = token.encode()

    leaks = [name for name, data in lock_dir_blobs(lock_dir).items() if name != str(token_file) and needle in data]
    assert leaks == [], f"raw token stored in {leaks}"
    # Neither the wrapper nor the holder carries it in argv or environment (only COMMAND's env does).
    [rec] = held_records(lock_dir, "J")
    for pid in (p.pid, rec["holder_pid"]):
        for what in ("cmdline", "environ"):
            assert needle not in Path(f"/proc/{pid}/{what}").read_bytes(), (pid, what)
    assert rec["token_hash"] == hashlib.sha256(needle).hexdigest()

    gate.open()
    assert procs.finish(p).returncode == 0
    procs.wait_idle()  # its holder tidies up (housekeeping) after pearing-run returned
    leaks = [name for name, data in lock_dir_blobs(lock_dir).items() if needle in data]
    assert leaks == [], f"raw token left in {leaks} after the run"


# -- PID reuse --------------------------------------------------------------------------------------


def fake_held_ticket(lock_dir: Path, pid: int, start: int, token: str) -> tuple[str, Path]:
    """A held ticket record naming ``pid`` as holder (started at ``start``), and its token file."""
    tid = new_uuid4()
    now = time.time()
    fence = int((store_dir(lock_dir, "J") / "fence").read_text())
    t = Ticket(
        ticket_id=tid,
        request_uuid=new_uuid4(),
        lock_name="J",
        repo="default",
        identity="fake@host",
        state=HELD,
        fence=fence,
        lease_seconds=3600.0,
        lease_expires_at=now + 3600,
        lease_deadline_mono=time.monotonic() + 3600,
        boot_id=_proc.boot_id(),
        holder_pid=pid,
        holder_start=start,
        created_at=now,
        acquired_at=now,
        token_hash=token_hash(token),
    )
    d = store_dir(lock_dir, "J")
    (d / "tickets" / f"{tid}.json").write_bytes(t.to_json())
    (d / "holder").write_text(tid)
    tf = d / "tokens" / f"{tid}.token"
    body = {"lock": "J", "repo": "default", "ticket": tid, "fence": fence, "token": token, "lock_dir": str(lock_dir)}
    tf.write_text(json.dumps(body))
    tf.chmod(0o600)
    return tid, tf


def test_reused_pid_does_not_look_like_a_live_holder(procs: Procs, lock_dir: Path, work: Path) -> None:
    assert procs.pr_run("--job", "J", "--", "true").returncode == 0
    sleeper = procs.start(["sleep", "60"])
    real_start = wait_for(lambda: _proc.start_time(sleeper.pid), 5, "the sleeper's start time")
    token = os.urandom(32).hex()

    def status_holder() -> Any:
        r = procs.run([PEARING_CLI, "status", "J"])
        assert r.returncode == 0, r
        [lock] = json.loads(r.stdout)
        return lock["holder"]

    # Control: with the sleeper's true start time the record does look alive...
    tid, tf = fake_held_ticket(lock_dir, sleeper.pid, real_start, token)
    ok = procs.run([PEARING_GUARD, "verify", "--token-file", str(tf)])
    assert ok.returncode == 0, ok
    assert status_holder()["ticket_id"] == tid
    (store_dir(lock_dir, "J") / "tickets" / f"{tid}.json").unlink()
    tf.unlink()

    # ...the same pid with another start time is someone else: the holder is gone.
    tid, tf = fake_held_ticket(lock_dir, sleeper.pid, real_start + 12345, token)
    v = procs.run([PEARING_GUARD, "verify", "--token-file", str(tf)])
    assert v.returncode == REFUSED, v
    assert len(v.err_lines) == 1 and "holder gone" in v.err_lines[0], v
    assert status_holder() is None, "a record naming a reused pid was shown as the holder"
    # And it does not block the lock: the next run takes it and sweeps the dead record.
    out = work / "fence"
    r = procs.pr_run("--job", "J", "--", *sh(f"echo $PEARING_FENCE > {q(out)}"))
    assert r.returncode == 0, r
    assert held_records(lock_dir, "J") == []
    assert not tf.exists(), "the dead holder's token file was left behind"
    assert sleeper.poll() is None, "the unrelated process was touched"


# -- wall-clock jumps: leases run on the monotonic clock -------------------------------------------


@pytest.fixture
def store(tmp_path: Path) -> Any:
    with LockDir(str(tmp_path / "lockdir")) as ld, ld.lock_store("default", "J") as s:
        yield s


def held_by_me(store: Any, token: str, lease_seconds: float) -> Ticket:
    t = Ticket(
        ticket_id=new_uuid4(),
        request_uuid=new_uuid4(),
        lock_name="J",
        repo="default",
        identity="me@host",
        state=HELD,
        fence=store.bump_fence(),
        boot_id=_proc.boot_id(),
        holder_pid=os.getpid(),
        holder_start=_proc.start_time(os.getpid()),
        created_at=time.time(),
        token_hash=token_hash(token),
    )
    t.set_lease(lease_seconds)
    store.write_ticket(t)
    return t


def judged(store: Any, t: Ticket, token: str) -> Any:
    """The guard's verdict on ``token``, from what the lock dir knows of its ticket."""
    c = Claim("J", "default", t.ticket_id, token, lock_dir=store.lock_dir.path, backend=None)
    return verdict_rules.judge(c, guard.facts(c, token_hash(token)))


@pytest.mark.parametrize("jump", [3600.0, -3600.0])
def test_healthy_lease_survives_a_wall_clock_jump(store: Any, monkeypatch: pytest.MonkeyPatch, jump: float) -> None:
    token = os.urandom(32).hex()
    t = held_by_me(store, token, 60.0)
    real = time.time
    monkeypatch.setattr(time, "time", lambda: real() + jump)
    assert t.refusal(gone=False) is None  # the rule every heartbeat applies (rules.tickets.heartbeat)
    verdict = judged(store, t, token)
    assert verdict.ok, verdict.reason
    assert lease.renew(store, t.ticket_id, 60.0, t.lease_expires_at).state == HELD


@pytest.mark.parametrize("jump", [-3600.0, 3600.0])
def test_expired_lease_is_not_revived_by_a_wall_clock_jump(
    store: Any, monkeypatch: pytest.MonkeyPatch, jump: float
) -> None:
    token = os.urandom(32).hex()
    t = held_by_me(store, token, 60.0)
    # Expired on the monotonic clock, while the wall-clock expiry still lies an hour ahead.
    t.lease_deadline_mono = time.monotonic() - 1.0
    t.lease_expires_at = time.time() + 3600.0
    store.write_ticket(t)
    real = time.time
    monkeypatch.setattr(time, "time", lambda: real() + jump)
    assert (t.refusal(gone=False) or "").startswith("lease expired"), t.refusal(gone=False)
    verdict = judged(store, t, token)
    assert not verdict.ok and verdict.reason.startswith("lease expired"), verdict.reason
    with pytest.raises(NotHeld, match="lease expired"):
        lease.renew(store, t.ticket_id, 60.0, t.lease_expires_at)


# -- a full disk ------------------------------------------------------------------------------------


class _FailingOs:
    """``os`` as seen by singleflight.core.fs, with one call failing."""

    def __init__(self, name: str, err: int) -> None:
        self._name, self._err = name, err

    def __getattr__(self, attr: str) -> Any:
        if attr == self._name:

            def fail(*args: Any, **kwargs: Any) -> Any:
                raise OSError(self._err, os.strerror(self._err))

            return fail
        return getattr(os, attr)


@pytest.mark.parametrize(("call", "err"), [("write", errno.ENOSPC), ("fsync", errno.EIO), ("rename", errno.ENOSPC)])
def test_disk_full_leaves_the_old_record_and_no_temp_file(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, call: str, err: int
) -> None:
    with _fs.Dir.open_root(str(tmp_path / "lockdir"), create=True) as d:
        d.write_atomic("fence", b"41\n")
        monkeypatch.setattr(_fs, "os", _FailingOs(call, err))
        with pytest.raises(LockDirError) as info:
            d.write_atomic("fence", b"42\n")
        monkeypatch.undo()
        assert info.value.exit_code == CANTCREAT
        assert d.child_path("fence") in str(info.value) and os.strerror(err) in str(info.value)
        assert d.read("fence") == b"41\n"
        assert d.listdir() == ["fence"], "a temp file was left behind"


def test_disk_full_never_issues_a_fence(store: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    assert store.bump_fence() == 1
    monkeypatch.setattr(_fs, "os", _FailingOs("write", errno.ENOSPC))
    with pytest.raises(LockDirError):
        store.bump_fence()
    monkeypatch.undo()
    assert store.read_fence() == 1
    assert store.bump_fence() == 2


def test_file_size_limit_makes_pearing_run_exit_73(procs: Procs, lock_dir: Path, work: Path) -> None:
    """A real process that cannot write (RLIMIT_FSIZE 0, the closest thing to a full disk a test can
    set up without a mount): exit 73 with one line, no fence issued, no temp file, COMMAND not run."""
    assert procs.pr_run("--job", "J", "--", "true").returncode == 0
    procs.wait_idle()  # its holder's housekeeping writes a temp file after pearing-run returned
    before = (store_dir(lock_dir, "J") / "fence").read_bytes()
    p = procs_start_limited(procs, ["--job", "J", "--", "touch", str(work / "ran")])
    r = procs.finish(p)
    assert r.returncode == CANTCREAT, r
    assert len(r.err_lines) == 1 and str(lock_dir) in r.err_lines[0], r
    assert not (work / "ran").exists()
    assert (store_dir(lock_dir, "J") / "fence").read_bytes() == before
    assert [f for f in all_files(lock_dir) if f.name.startswith(".tmp")] == []
    assert held_records(lock_dir, "J") == []
    after = procs.pr_run("--job", "J", "--", "true")
    assert after.returncode == 0, after


def procs_start_limited(procs: Procs, args: list[str]) -> Any:
    """``pearing-run ARGS`` that may not grow any file; reaped by the ``procs`` fixture."""

    def no_file_growth() -> None:
        resource.setrlimit(resource.RLIMIT_FSIZE, (0, resource.RLIM_INFINITY))

    p = subprocess.Popen(
        [PEARING_RUN, *args],
        env=procs.env,
        cwd=procs.cwd,
        stdin=subprocess.DEVNULL,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        start_new_session=True,
        preexec_fn=no_file_growth,  # noqa: PLW1509 - the test process starts no threads
    )
    procs.popens.append(p)
    procs.started[p.pid] = time.monotonic()
    return p


# -- corrupt records ----------------------------------------------------------------------------------


@pytest.mark.parametrize("content", [b"garbage", b"", b"-3\n", b"12abc\n", b"7 8\n", b"\xff\xfe"])
def test_corrupt_fence_stops_the_lock_and_is_never_reset(
    procs: Procs, lock_dir: Path, work: Path, content: bytes
) -> None:
    assert procs.pr_run("--job", "J", "--", "true").returncode == 0
    fence = store_dir(lock_dir, "J") / "fence"
    fence.write_bytes(content)
    for _ in range(2):  # and again: nothing reset it in between
        r = procs.pr_run("--job", "J", "--", "touch", str(work / "ran"))
        assert r.returncode == IOERR, r
        assert len(r.err_lines) == 1 and str(fence) in r.err_lines[0], r
        assert not (work / "ran").exists()
        assert fence.read_bytes() == content, "the corrupt fence was rewritten"
    assert held_records(lock_dir, "J") == []
    c = procs.run([PEARING_CLI, "acquire-lock", "J", "--request-uuid", str(uuid.uuid4()), "--lease-seconds", "5"])
    assert c.returncode == IOERR, c
    assert any(str(fence) in line for line in c.err_lines), c
    assert fence.read_bytes() == content


def test_corrupt_ticket_record_is_reported_with_its_path(procs: Procs, lock_dir: Path, work: Path) -> None:
    gate = Gate(work)
    p = procs.pr("--job", "J", "--", *sh(gate.script()))
    gate.wait_ready()
    [rec] = held_records(lock_dir, "J")
    gate.open()
    assert procs.finish(p).returncode == 0
    torn = store_dir(lock_dir, "J") / "tickets" / f"{rec['ticket_id']}.json"
    torn.write_bytes(b'{"ticket_id": "x", "state": "he')
    s = procs.run([PEARING_CLI, "status", "J"])
    assert s.returncode == IOERR, s
    assert any(str(torn) in line for line in s.err_lines), s
    assert torn.read_bytes() == b'{"ticket_id": "x", "state": "he'
