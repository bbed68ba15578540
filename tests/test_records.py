"""Records that lie: a lost or rolled-back fence file, a ledger someone else can write, garbage
in a record or a pointer.

SPEC "Bad input and faults": a missing fence file continues above the highest fence any record
shows; a corrupt record is reported with its path (74) and never resets a fence; a ledger is
checked like ssh's StrictModes (77); an empty or unparsable ledger is corrupt (74). Real
processes, except where a test says it drives the store in-process.
"""

from __future__ import annotations

import json
import os
import stat
import time
import uuid
from pathlib import Path

import pytest
from helpers import PEARING_CLI, PEARING_GUARD, Procs, Result, cli_json, q, read_json, store_dir

from singleflight.core import fs as _fs
from singleflight.core.const import MAX_FENCE, REQUEST_RETENTION, ExitCode
from singleflight.core.errors import CorruptRecord, NotPermitted
from singleflight.core.record import new_uuid4
from singleflight.core.request import RequestRecord
from singleflight.core.ticket import Ticket
from singleflight.local import lease
from singleflight.local.store import LockDir, LockStore

IOERR = int(ExitCode.IOERR)
NOPERM = int(ExitCode.NOPERM)
CANTCREAT = int(ExitCode.CANTCREAT)
REFUSED = int(ExitCode.REFUSED)


def run_fence(procs: Procs, out: Path, *flags: str) -> Result:
    """``pearing-run --job J FLAGS -- COMMAND`` where COMMAND appends its fence to ``out``."""
    return procs.pr_run("--job", "J", *flags, "--", "sh", "-c", f"echo $PEARING_FENCE >> {q(out)}")


def fences(out: Path) -> list[int]:
    return [int(x) for x in out.read_text().split()] if out.exists() else []


def one_error_naming(r: Result, path: Path) -> None:
    assert len(r.err_lines) == 1, r
    assert str(path) in r.err_lines[0], r
    assert "Traceback" not in r.stderr.decode(errors="replace"), r


# -- item 7: fences never restart or go backwards -----------------------------------------------


@pytest.fixture
def three_runs(procs: Procs, lock_dir: Path, work: Path) -> Path:
    """Fences 1..3: a request-uuid run, a plain run, a run with --min-interval (its success
    record) and a request uuid. Returns the fences file."""
    out = work / "fences"
    assert run_fence(procs, out, "--request-uuid", str(uuid.uuid4())).returncode == 0
    assert run_fence(procs, out).returncode == 0
    assert run_fence(procs, out, "--request-uuid", str(uuid.uuid4()), "--min-interval", "1s").returncode == 0
    assert fences(out) == [1, 2, 3]
    return out


# Which records survive besides the lost fence file; each one alone is enough.
KEEP = {
    "every record": (),
    "ended tickets only": ("requests", "success"),
    "request records only": ("ended", "success"),
    "success record only": ("ended", "requests"),
}


@pytest.mark.parametrize("keep", list(KEEP), ids=[k.replace(" ", "-") for k in KEEP])
def test_lost_fence_file_continues_above_every_record(
    procs: Procs, lock_dir: Path, three_runs: Path, keep: str
) -> None:
    d = store_dir(lock_dir, "J")
    (d / "fence").unlink()
    for gone in KEEP[keep]:
        if gone == "success":
            (d / "success").unlink()
        else:
            for f in (d / gone).iterdir():
                f.unlink()
    s = procs.run([PEARING_CLI, "status", "J"])
    assert s.returncode == 0, s
    assert json.loads(s.stdout)[0]["fence"] == 3
    r = run_fence(procs, three_runs)
    assert r.returncode == 0, r
    assert fences(three_runs) == [1, 2, 3, 4]
    assert (d / "fence").read_text().strip() == "4"


def test_lost_fence_file_with_a_corrupt_record_is_74_naming_it(procs: Procs, lock_dir: Path, three_runs: Path) -> None:
    d = store_dir(lock_dir, "J")
    (d / "fence").unlink()
    victim = sorted((d / "ended").iterdir())[0]
    victim.write_bytes(b'{"ticket_id": ')
    for _ in range(2):
        r = run_fence(procs, three_runs)
        assert r.returncode == IOERR, r
        one_error_naming(r, victim)
    assert fences(three_runs) == [1, 2, 3], "a run started without knowing the last fence"
    assert not (d / "fence").exists()


def test_rolled_back_fence_file_continues_above_the_last_holder(procs: Procs, lock_dir: Path, three_runs: Path) -> None:
    """A fence file restored from an old backup (valid, but lower) never reissues a fence."""
    (store_dir(lock_dir, "J") / "fence").write_text("1\n")
    r = run_fence(procs, three_runs)
    assert r.returncode == 0, r
    assert fences(three_runs) == [1, 2, 3, 4]


BAD_FENCES = {
    "empty": b"",
    "garbage": b"garbage\n",
    "nul": b"3\x00\n",
    "negative": b"-3\n",
    "zero": b"0\n",
    "beyond-int64": str(2**63).encode(),
    "more-digits-than-int-parses": b"9" * 5000,
    "full-width-digits": "\uff13".encode(),
    "at-the-ceiling": str(MAX_FENCE).encode(),
}


@pytest.mark.parametrize("content", list(BAD_FENCES.values()), ids=list(BAD_FENCES))
def test_bad_fence_content_is_74_and_never_reset(
    procs: Procs, lock_dir: Path, three_runs: Path, content: bytes
) -> None:
    fence = store_dir(lock_dir, "J") / "fence"
    fence.write_bytes(content)
    for args in (["--job", "J", "--", "true"], ["--job", "J", "--wait-seconds", "1", "--", "true"]):
        r = procs.pr_run(*args)
        assert r.returncode == IOERR, r
        one_error_naming(r, fence)
    s = procs.run([PEARING_CLI, "status", "J"])
    if content == str(MAX_FENCE).encode():
        # The last fence there can be is a valid fence to show; only a next one cannot exist.
        assert s.returncode == 0 and json.loads(s.stdout)[0]["fence"] == MAX_FENCE, s
    else:
        assert s.returncode == IOERR, s
        one_error_naming(s, fence)
    assert fence.read_bytes() == content
    assert fences(three_runs) == [1, 2, 3]


@pytest.mark.parametrize("kind", ["directory", "symlink", "fifo"])
def test_fence_that_is_not_a_file_is_77_naming_it(
    procs: Procs, lock_dir: Path, three_runs: Path, tmp_path: Path, kind: str
) -> None:
    fence = store_dir(lock_dir, "J") / "fence"
    fence.unlink()
    target = tmp_path / "elsewhere"
    target.write_text("1\n")
    if kind == "directory":
        fence.mkdir()
    elif kind == "symlink":
        fence.symlink_to(target)
    else:
        os.mkfifo(fence)
    r = run_fence(procs, three_runs)  # a FIFO must not hang the reader: 30 s timeout fails it
    assert r.returncode == NOPERM, r
    one_error_naming(r, fence)
    s = procs.run([PEARING_CLI, "status", "J"])
    assert s.returncode == NOPERM, s
    one_error_naming(s, fence)
    assert fences(three_runs) == [1, 2, 3]
    assert target.read_text() == "1\n"


def test_truncated_ledger_after_9_refuses_3(procs: Procs, lock_dir: Path) -> None:
    fence = [PEARING_GUARD, "fence", "--resource", "branch:x", "--fence"]
    assert procs.run([*fence, "9"]).returncode == 0
    ledger = lock_dir / "ledger.json"
    for content in (b"", b"\n", b"{", b"[]", b'{"branch:x": "9"}', b'{"branch:x": 0}', b"[" * 100000):
        ledger.write_bytes(content)
        r = procs.run([*fence, "3"])
        assert r.returncode == IOERR, (content[:20], r)
        one_error_naming(r, ledger)
        assert ledger.read_bytes() == content


# -- item 8: --ledger is checked like ssh's StrictModes --------------------------------------------


@pytest.fixture
def shared(tmp_path: Path) -> Path:
    """A world-writable sticky dir, like /tmp, holding a ledger that has seen fence 9."""
    d = tmp_path / "shared"
    d.mkdir()
    d.chmod(0o1777)
    return d


def fence_in(procs: Procs, ledger: Path, n: int) -> Result:
    return procs.run([PEARING_GUARD, "fence", "--resource", "r", "--fence", str(n), "--ledger", str(ledger)])


def assert_refused_77(r: Result, path: Path) -> None:
    assert r.returncode == NOPERM, r
    one_error_naming(r, path)


def test_ledger_in_a_sticky_shared_dir_works(procs: Procs, shared: Path) -> None:
    ledger = shared / "ledger.json"
    assert fence_in(procs, ledger, 9).returncode == 0
    stale = fence_in(procs, ledger, 3)
    assert stale.returncode == REFUSED and "stale fence 3 < 9" in stale.err_lines[0], stale
    assert stat.S_IMODE(ledger.stat().st_mode) == 0o600


@pytest.mark.skipif(os.geteuid() != 0, reason="chown to another user needs root")
@pytest.mark.parametrize("victim", ["ledger.json", "ledger.json.lock"])
def test_ledger_owned_by_another_user_is_77(procs: Procs, shared: Path, victim: str) -> None:
    ledger = shared / "ledger.json"
    assert fence_in(procs, ledger, 9).returncode == 0
    # Another user's file of that name (they planted it before us, or swapped it in).
    (shared / victim).unlink()
    (shared / victim).write_text("{}" if victim == "ledger.json" else "")
    os.chown(shared / victim, 65534, 65534)
    assert_refused_77(fence_in(procs, ledger, 3), shared / victim)
    assert "65534" in fence_in(procs, ledger, 3).err_lines[0]


@pytest.mark.parametrize("mode", [0o620, 0o602, 0o666])
def test_ledger_writable_by_others_is_77(procs: Procs, shared: Path, mode: int) -> None:
    ledger = shared / "ledger.json"
    assert fence_in(procs, ledger, 9).returncode == 0
    ledger.chmod(mode)
    r = fence_in(procs, ledger, 3)
    assert_refused_77(r, ledger)
    assert f"{mode:o}" in r.err_lines[0], r
    assert read_json(ledger) == {"r": 9}


@pytest.mark.parametrize("mode", [0o777, 0o775, 0o757])
def test_ledger_dir_writable_by_others_without_sticky_is_77(procs: Procs, tmp_path: Path, mode: int) -> None:
    d = tmp_path / "loose"
    d.mkdir()
    ledger = d / "ledger.json"
    assert fence_in(procs, ledger, 9).returncode == 0
    d.chmod(mode)
    ledger.write_text("{}")  # what another user could now do: a stale fence must not pass
    assert_refused_77(fence_in(procs, ledger, 3), d)


@pytest.mark.skipif(os.geteuid() != 0, reason="chown to another user needs root")
def test_ledger_dir_owned_by_another_user_is_77(procs: Procs, tmp_path: Path) -> None:
    d = tmp_path / "theirs"
    d.mkdir()
    ledger = d / "ledger.json"
    assert fence_in(procs, ledger, 9).returncode == 0
    os.chown(d, 65534, 65534)  # they may now replace the ledger: it proves nothing any more
    r = fence_in(procs, ledger, 3)
    assert_refused_77(r, d)
    assert "65534" in r.err_lines[0], r


def test_ledger_below_a_loose_ancestor_is_77(procs: Procs, tmp_path: Path) -> None:
    top = tmp_path / "top"
    (top / "inner").mkdir(parents=True)
    ledger = top / "inner" / "ledger.json"
    assert fence_in(procs, ledger, 9).returncode == 0
    top.chmod(0o777)  # another user could rename inner/ away and plant their own
    assert_refused_77(fence_in(procs, ledger, 3), top)


@pytest.mark.parametrize("victim", ["ledger.json", "ledger.json.lock"])
def test_symlinked_ledger_is_77(procs: Procs, shared: Path, tmp_path: Path, victim: str) -> None:
    ledger = shared / "ledger.json"
    assert fence_in(procs, ledger, 9).returncode == 0
    elsewhere = tmp_path / "elsewhere.json"
    elsewhere.write_text("{}")
    (shared / victim).unlink()
    (shared / victim).symlink_to(elsewhere)
    assert_refused_77(fence_in(procs, ledger, 3), shared / victim)
    assert elsewhere.read_text() == "{}"
    # A ledger path that is itself a link to a good ledger is refused too.
    link = shared / "link.json"
    link.symlink_to(ledger)
    assert_refused_77(fence_in(procs, link, 3), link)


@pytest.mark.parametrize("kind", ["directory", "fifo"])
def test_ledger_that_is_not_a_file_is_77(procs: Procs, shared: Path, kind: str) -> None:
    ledger = shared / "ledger.json"
    if kind == "directory":
        ledger.mkdir()
    else:
        os.mkfifo(ledger, 0o600)
    assert_refused_77(fence_in(procs, ledger, 3), ledger)


# -- item 10: pointers and records with garbage -----------------------------------------------------


@pytest.mark.parametrize(
    "pointer",
    [b"\x00", b"abc\x00def", b"../../../../outside", b"/etc/passwd", b"..", b"", b"\xff\xfe", b"x" * 5000],
    ids=["nul", "nul-inside", "traversal", "absolute", "dotdot", "empty", "not-ascii", "long"],
)
def test_garbage_holder_pointer_is_ignored_and_the_dead_holder_still_swept(
    procs: Procs, lock_dir: Path, three_runs: Path, tmp_path: Path, pointer: bytes
) -> None:
    """The pointer is a hint: garbage in it is ignored, never used as a file name; the sweep
    falls back to the live tickets, so a holder that died holding is still marked expired."""
    d = store_dir(lock_dir, "J")
    # A ticket recorded held by a holder that is gone (kill -9 before it could end it).
    dead = json.loads(sorted((d / "ended").iterdir())[-1].read_text())
    dead.update(ticket_id=new_uuid4(), state="held", ended_at=None, end_reason=None, holder_pid=2**22 + 7)
    (d / "tickets" / f"{dead['ticket_id']}.json").write_text(json.dumps(dead))
    (d / "tokens" / f"{dead['ticket_id']}.token").write_text("{}")
    (d / "holder").write_bytes(pointer)
    before = sorted(p.name for p in tmp_path.iterdir())
    r = run_fence(procs, three_runs)
    assert r.returncode == 0, r
    assert r.stderr == b"", r
    assert fences(three_runs) == [1, 2, 3, 4]
    swept = read_json(d / "ended" / f"{dead['ticket_id']}.json")
    assert swept is not None and swept["state"] == "expired" and swept["end_reason"] == "holder gone", swept
    assert not (d / "tokens" / f"{dead['ticket_id']}.token").exists()
    assert sorted(p.name for p in tmp_path.iterdir()) == before, "a file appeared outside the lock dir"


WRONG_TICKETS = {
    "fence-as-text": {"fence": "3"},
    "fence-zero": {"fence": 0},
    "fence-beyond-int64": {"fence": 2**63},
    "state-unknown": {"state": "stolen"},
    "identity-traversal": {"identity": "../../etc"},
    "ticket-id-traversal": {"ticket_id": "../../x"},
    "ticket-id-of-another": {"ticket_id": "00000000-0000-4000-8000-000000000000"},
    "other-lock": {"lock_name": "K"},
    "holder-pid-huge": {"holder_pid": 2**70},
    "time-nan": {"created_at": float("nan")},
    "host-with-nul": {"holder_host": "a\x00b"},
    "token-hash-short": {"token_hash": "abc"},
    "promoted-number": {"promoted": 1},
    "not-an-object": [],
}


@pytest.mark.parametrize("change", list(WRONG_TICKETS.values()), ids=list(WRONG_TICKETS))
def test_ended_ticket_with_a_wrong_field_is_74_naming_it(
    procs: Procs, lock_dir: Path, three_runs: Path, change: object
) -> None:
    d = store_dir(lock_dir, "J")
    path = sorted((d / "ended").iterdir())[0]
    rec = json.loads(path.read_text())
    tid = rec["ticket_id"]
    bad = {**rec, **change} if isinstance(change, dict) else change
    path.write_text(json.dumps(bad))
    r = procs.run([PEARING_CLI, "get-lock-ticket", "J", tid])
    assert r.returncode == IOERR, r
    one_error_naming(r, path)
    path.write_text(json.dumps(rec))  # the reaper of ``procs`` reads ticket records too


# -- the store, in-process -----------------------------------------------------------------------


@pytest.fixture
def store(tmp_path: Path) -> LockStore:
    with LockDir(str(tmp_path / "lockdir")) as ld, ld.lock_store("default", "J") as s:
        yield s


def ended_ticket(fence: int) -> Ticket:
    now = time.time()
    return Ticket(
        ticket_id=new_uuid4(),
        request_uuid=new_uuid4(),
        lock_name="J",
        repo="default",
        identity="me@host",
        state="released",
        fence=fence,
        created_at=now,
        acquired_at=now,
        ended_at=now,
    )


def test_store_highest_recorded_fence_reads_every_kind_of_record(store: LockStore) -> None:
    """In-process: tickets/, ended/, requests/ (and each one's previous run) and success."""
    assert store.read_fence() == 0
    store.write_ticket(ended_ticket(4))
    assert store.read_fence() == 4
    prev = RequestRecord(state="failed", ticket_id=new_uuid4(), fence=7)
    store.write_request(new_uuid4(), RequestRecord(state="active", ticket_id=new_uuid4(), previous=prev))
    assert store.read_fence() == 7
    store.dir.write_atomic("success", json.dumps({"started_at": 1.0, "fence": 11}).encode())
    assert store.read_fence() == 11
    assert store.bump_fence() == 12
    assert store.bump_fence(floor=40) == 41
    assert store.read_fence() == 41


def test_store_prune_keeps_the_last_holders_ended_record(store: LockStore) -> None:
    """In-process: an hour later every ended ticket is pruned but the last holder's, whose
    fence a lost fence file continues from."""
    old, last = ended_ticket(1), ended_ticket(2)
    for t in (old, last):
        store.write_ticket(t)
    store.write_pointer("holder", last.ticket_id)
    assert lease.prune_ended(store, time.time() + 7200) == 1
    assert [p for p in store.sub("ended").listdir()] == [f"{last.ticket_id}.json"]
    store.dir.unlink("fence")
    assert store.bump_fence() == 3


def test_store_success_record_carries_the_fence(tmp_path: Path) -> None:
    """The success record holds its run's fence: one more record a lost fence file continues above."""
    from singleflight.local.backend import LocalBackend
    from singleflight.rules import requests

    with LocalBackend("local", str(tmp_path / "lockdir")) as b:
        lk = b.lock("default", "J")
        t = ended_ticket(7)
        t.acquired_at = 123.0
        requests.record_end(b, t, 0, window=None, success=True)
        assert json.loads(lk.store.dir.read("success") or b"")["fence"] == 7
        assert requests.last_success(b, t.repo, t.lock_name) == 123.0
        lk.store.dir.unlink("fence")
        assert lk.store.bump_fence() == 8
        lk.close()


def test_dir_read_refuses_what_is_not_a_record(tmp_path: Path) -> None:
    """In-process: Dir.read of a directory, a FIFO (without hanging) or an oversized file
    raises an error naming the path, never a bare OSError."""
    with _fs.Dir.open_root(str(tmp_path / "lockdir"), create=True) as d:
        os.mkdir("sub", dir_fd=d.fd)
        os.mkfifo("fifo", dir_fd=d.fd)
        with pytest.raises(NotPermitted, match="sub: is not a regular file"):
            d.read("sub")
        with pytest.raises(NotPermitted, match="fifo: is not a regular file"):
            d.read("fifo")
        d.write_atomic("big", b"x" * (_fs.MAX_RECORD + 1))
        with pytest.raises(CorruptRecord, match="big"):
            d.read("big")
        for name in ("../x", "a/b", "..", "", "a\x00b"):
            with pytest.raises(NotPermitted, match="not a plain file name"):
                d.read(name)


def test_a_request_record_whose_run_is_gone_is_pruned_a_day_later(procs: Procs, lock_dir: Path) -> None:
    """pearing-cli acquire-lock records which ticket its request uuid has, and that record is never
    ended: once its run is gone it reads as none, and housekeeping removes it REQUEST_RETENTION
    later, as etcd's lease and PostgreSQL's expiry drop theirs; not one file per request for good.
    One whose run still holds stays. Real processes make them; the store is pruned in-process
    with its clock moved on."""
    gone, held = str(uuid.uuid4()), str(uuid.uuid4())
    flags = ("--lease-seconds", "60", "--wait-seconds", "5")
    first = cli_json(procs, "acquire-lock", "J", "--request-uuid", gone, *flags)
    cli_json(procs, "release-lock-ticket", "J", first["ticket_id"])
    second = cli_json(procs, "acquire-lock", "J", "--request-uuid", held, *flags)
    requests = store_dir(lock_dir, "J") / "requests"
    assert sorted(p.name for p in requests.iterdir()) == sorted([f"{gone}.json", f"{held}.json"])
    # A record full of garbage, first in the listing: left for its own request's run to name, and
    # the rest tidied all the same (it used to stop the lock's whole housekeeping).
    garbage = requests / "00000000-0000-4000-8000-000000000000.json"
    garbage.write_bytes(b"\0garbage{")
    with LockDir(str(lock_dir)) as ld, ld.lock_store("default", "J") as s:
        assert lease.prune_requests(s, time.time() + REQUEST_RETENTION - 60) == 0  # not yet a day
        assert lease.prune_requests(s, time.time() + REQUEST_RETENTION + 60) == 1
    assert sorted(p.name for p in requests.iterdir()) == sorted([garbage.name, f"{held}.json"])
    cli_json(procs, "release-lock-ticket", "J", second["ticket_id"])
