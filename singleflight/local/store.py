"""The lock dir backend's records: the lock dir and, per (repo, lock), its files.

LOCK_DIR/                      0700, owned by the user, never group/world-writable
  activity/IDENTITY            the identity's current activity text
  ledger.json                  highest fence per resource a target accepted (pearing-guard fence)
  fence-floor                  the highest fence of every lock pruned as idle (pearing-cli prune)
  locks/SEG/SEG/@LOCK/         one dir per (repo, lock); '@' cannot occur in a scope
    lock                       the kernel flock the holder keeps; never unlinked
    slot.N                     --slots: slot N's flock (slot 0 is ``lock``); never unlinked
    state.lock                 short mutex around read-modify-write of records
    guard.lock                 shared by pearing-guard exec, exclusive on expiry/release
    holder                     the ticket id of the last holder (a hint for sweeping it)
    holder.N                   --slots: the same, of slot N
    fence                      last fence issued, decimal, fsynced before any token;
                               if missing, the next continues above every record's fence
                               and above LOCK_DIR/fence-floor (the highest fence prune retired)
    success                    the last successful start (--min-interval), with its fence
    tickets/ID.json            ticket records (token only as a sha256)
    tokens/ID.token            0600 JSON token file, only while held
    queue/SEQ.ID               FIFO entries, each flocked by its live waiter
    requests/UUID.json         request-uuid records for idempotency and dedupe
"""

from __future__ import annotations

import fcntl
import os
import signal
from contextlib import contextmanager

from singleflight.core import fault, names
from singleflight.core.const import MAX_FENCE, TYPE_CHECKING
from singleflight.core.errors import BadValue, CorruptRecord, Vanished
from singleflight.core.fs import Dir, lock_parts, parse_int_record, same_file
from singleflight.core.record import epoch, loads
from singleflight.core.request import RequestRecord
from singleflight.core.ticket import Ticket
from singleflight.core.tokens import TokenFiles

if TYPE_CHECKING:
    from collections.abc import Iterator

# The highest fence of the locks pruned as idle (local/prune.py): a lock without a fence file
# continues above it, so a pruned lock that comes back never reissues a fence.
FENCE_FLOOR = "fence-floor"
# How often an owner opens a lock's path again after prune removed it underneath: each retry
# follows a whole prune of the idle lock, so only a prune run in a tight loop costs more than one.
_REOPEN_TRIES = 100


# The stop signals a terminal or a user sends, held back while the record mutex is held.
_STOPS = frozenset({signal.SIGTSTP, signal.SIGTTIN, signal.SIGTTOU})


class LockDir:
    """The open lock dir; cheap to construct, holds one fd."""

    def __init__(self, path: str, *, create: bool = True) -> None:
        self.path = path
        self.root = Dir.open_root(path, create=create)

    def close(self) -> None:
        self.root.close()

    def __enter__(self) -> LockDir:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def lock_store(self, repo: str, lock: str, *, create: bool = True) -> LockStore:
        return LockStore(self, repo, lock, self.walk(repo, lock, create=create))

    def walk(self, repo: str, lock: str, *, create: bool = True) -> Dir:
        """The lock's directory, opened down from the lock dir; made if ``create``."""
        for _ in range(_REOPEN_TRIES):
            try:
                return self.root.walk(lock_parts(repo, lock), create=create)
            except Vanished:
                continue  # a scope dir pruned as we passed through it: from the top again
        raise Vanished(self.root.child_path("/".join(lock_parts(repo, lock))))

    def fence_floor(self) -> int:
        """The highest fence prune retired (0: none)."""
        data = self.root.read(FENCE_FLOOR)
        return 0 if data is None else parse_int_record(self.root.child_path(FENCE_FLOOR), data, low=0)

    def iter_locks(self, repo: str | None = None) -> Iterator[LockStore]:
        """Every (repo, lock) in the lock dir, or in one scope."""
        try:
            top = self.root.sub("locks", create=False)
        except FileNotFoundError:
            return
        stack: list[tuple[Dir, list[str]]] = [(top, [])]
        want = repo.split("/") if repo else None
        while stack:
            d, segs = stack.pop()
            try:
                for name in sorted(d.listdir(), reverse=True):
                    if not _made_by_us(name, segs):
                        continue  # not a name this tool creates: someone else's file, never a lock
                    if name.startswith("@"):
                        if want is not None and segs != want:
                            continue
                        try:
                            sub = d.sub(name, create=False)
                        except FileNotFoundError:
                            continue
                        yield LockStore(self, "/".join(segs), name[1:], sub)
                    elif want is None or (len(segs) < len(want) and want[len(segs)] == name):
                        try:
                            stack.append((d.sub(name, create=False), [*segs, name]))
                        except FileNotFoundError:
                            continue
            finally:
                d.close()


def _made_by_us(name: str, segs: list[str]) -> bool:
    """Is ``name`` in locks/SEGS/ a scope segment or an @LOCK dir this tool could have made?"""
    try:
        if name.startswith("@"):
            names.lock_name(name[1:])
            return bool(segs)
        names.scope("/".join([*segs, name]))
    except BadValue:
        return False
    return True


class LockStore:
    """The files of one (repo, lock)."""

    def __init__(self, lock_dir: LockDir, repo: str, lock: str, d: Dir) -> None:
        self.lock_dir, self.repo, self.lock, self.dir = lock_dir, repo, lock, d
        self._subs: dict[str, Dir] = {}
        self._tokens: TokenFiles | None = None

    def close(self) -> None:
        self.close_subs()
        self.dir.close()

    def close_subs(self) -> None:
        if self._tokens is not None:
            self._tokens.close()
            self._tokens = None
        for sub in self._subs.values():
            sub.close()
        self._subs.clear()

    def reopen(self) -> None:
        """Prune removed this lock's directory (it was idle) after we opened it: open its path
        again, made afresh. Every reader goes through ``dir`` and ``sub``, so all see the new one."""
        self.close_subs()
        fresh = self.lock_dir.walk(self.repo, self.lock)
        self.dir.close()
        self.dir = fresh

    def __enter__(self) -> LockStore:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def sub(self, name: str) -> Dir:
        d = self._subs.get(name)
        if d is None:
            try:
                d = self.dir.sub(name)
            except Vanished:
                if os.fstat(self.dir.fd).st_nlink:
                    raise  # only this subdirectory went (as prune emptied the lock): not a stand-in
                # Pruned as idle since we opened it: a removed directory is empty and takes no new
                # file, which is what its subdirectory is now (read: nothing; write: Vanished). An
                # owner that must write takes the mutex, which opens the path afresh (``flocked``).
                d = Dir(os.dup(self.dir.fd), self.dir.child_path(name))
            self._subs[name] = d
        return d

    def open_lock_file(self, name: str = "lock") -> int:
        """An fd on one of the flock files. Unlinked only by prune, holding its flock, with the
        lock idle; whoever takes a flock on one checks it is still the file (``flocked``)."""
        return self.dir.open(name, os.O_RDWR | os.O_CREAT, 0o600)

    @contextmanager
    def mutex(self) -> Iterator[None]:
        """Serialise read-modify-write of this lock's records (held for microseconds).

        A stop signal (^Z, ``kill -TSTP``) waits until the mutex is let go: stopped inside it,
        this process would hold every acquirer of the lock until it was continued. Blocked for
        this thread (our processes have one; SIGSTOP cannot be blocked: docs/faults.md)."""
        old = signal.pthread_sigmask(signal.SIG_BLOCK, _STOPS)
        try:
            fd = flocked(self, "state.lock")
            try:
                yield
            finally:
                os.close(fd)
        finally:
            signal.pthread_sigmask(signal.SIG_SETMASK, old)

    def read_pointer(self, name: str) -> str | None:
        """The ticket id a pointer file names, or None when there is none.

        A pointer is only a hint (``holder``: whom to sweep on the next take-over), so one
        that holds anything but a ticket id (garbage, a path, a NUL) is ignored, never used
        as a file name; the caller falls back to scanning the live tickets.
        """
        data = self.dir.read(name)
        if not data:
            return None
        try:
            return names.ticket_id(data.decode("ascii").strip())
        except (UnicodeDecodeError, BadValue):
            return None

    def write_pointer(self, name: str, value: str) -> None:
        self.dir.write_atomic(name, value.encode(), durable=False)

    # -- fence -------------------------------------------------------------

    def read_fence(self) -> int:
        """The last fence issued. Without a fence file (deleted, or never written) it is the
        highest fence any record of this lock shows, so the next one is never lower than one
        already handed out; a corrupt record that would tell is reported (74), not skipped."""
        data = self.dir.read("fence")
        if data is None:
            return highest_recorded_fence(self)
        return parse_int_record(self.dir.child_path("fence"), data)

    def bump_fence(self, floor: int = 0) -> int:
        """Issue the next fence, above the fence file and above ``floor`` (a fence a record
        shows). Caller holds the mutex (and a slot's flock), so no one else bumps.

        The new value is on disk (fsynced, renamed, dir fsynced) before it is
        returned, so no token can ever carry a fence that a crash could reissue.
        """
        data = self.dir.read("fence")
        if data is None:
            # A new lock, or one pruned as idle: above what prune retired, too.
            current = max(highest_recorded_fence(self), self.lock_dir.fence_floor(), floor)
        else:
            current = max(parse_int_record(self.dir.child_path("fence"), data), floor)
        if current >= MAX_FENCE:
            raise CorruptRecord(self.dir.child_path("fence"), f"holds the largest fence ({MAX_FENCE}); none can follow")
        fence = current + 1
        self.dir.write_atomic("fence", f"{fence}\n".encode(), durable=True)
        fault.point("after-fence-bump")
        return fence

    # -- tickets -----------------------------------------------------------

    # Live tickets (waiting, held) live in tickets/, ended ones in ended/, so
    # the acquire path only ever reads the few live records.

    def read_ticket(self, ticket_id: str) -> Ticket | None:
        name = f"{ticket_id}.json"
        # Live first: a ticket is written to ended/ before its live record is
        # unlinked, so one of the two reads always finds it.
        for sub in ("tickets", "ended"):
            data = self.sub(sub).read(name)
            if data is not None:
                return self._parse_ticket(sub, name, data)
        return None

    def _parse_ticket(self, sub: str, name: str, data: bytes) -> Ticket:
        try:
            t = Ticket.from_json(data)
            # A record under another ticket's name, or another lock's, would make every
            # later write land beside it: it is not this lock's record.
            if name != f"{t.ticket_id}.json":
                raise ValueError(f"names ticket {t.ticket_id}, not {name[:-5]!r}")
            if (t.repo, t.lock_name) != (self.repo, self.lock):
                raise ValueError(f"belongs to lock {t.lock_name!r} in scope {t.repo!r}")
        except (ValueError, TypeError) as exc:
            raise CorruptRecord(self.sub(sub).child_path(name), str(exc)) from None
        return t

    def write_ticket(self, ticket: Ticket, *, durable: bool = False) -> None:
        name = f"{ticket.ticket_id}.json"
        if ticket.live:
            self.sub("tickets").write_atomic(name, ticket.to_json(), durable=durable)
        else:
            self.sub("ended").write_atomic(name, ticket.to_json(), durable=durable)
            self.sub("tickets").unlink(name)

    def _records(self, sub: str) -> list[Ticket]:
        d = self.sub(sub)
        out = []
        for name in d.listdir():
            if name.endswith(".json") and not name.startswith("."):
                data = d.read(name)
                if data is not None:
                    out.append(self._parse_ticket(sub, name, data))
        return out

    def tickets(self) -> list[Ticket]:
        """The live (waiting or held) tickets, oldest first."""
        out = self._records("tickets")
        out.sort(key=lambda t: t.created_at or 0.0)
        return out

    # -- the last successful start (--min-interval) --------------------------

    def _read_success(self) -> tuple[float, int | None] | None:
        """(started_at, fence) of the last successful run, or None."""
        data = self.dir.read("success")
        if data is None:
            return None
        try:
            obj = loads(data)
            value, fence = epoch(obj["started_at"], "started_at"), obj.get("fence")
            if fence is not None and (
                isinstance(fence, bool) or not isinstance(fence, int) or not 1 <= fence <= MAX_FENCE
            ):
                raise TypeError("fence is not a fence")
        except (ValueError, KeyError, TypeError, AttributeError) as exc:
            raise CorruptRecord(self.dir.child_path("success"), f"not a success record: {exc}") from None
        return value, fence

    # -- token files and request records -----------------------------------

    @property
    def tokens(self) -> TokenFiles:
        if self._tokens is None:
            self._tokens = TokenFiles(self.lock_dir.path, self.dir)
        return self._tokens

    def read_request(self, request_uuid: str) -> RequestRecord | None:
        d = self.sub("requests")
        name = f"{request_uuid}.json"
        data = d.read(name)
        if data is None:
            return None
        try:
            return RequestRecord.from_json(data)
        except (ValueError, TypeError) as exc:
            raise CorruptRecord(d.child_path(name), f"not a request record: {exc}") from None

    def write_request(self, request_uuid: str, record: RequestRecord) -> None:
        # Durable: a finished run's record must survive a crash, or a replay reruns it.
        self.sub("requests").write_atomic(f"{request_uuid}.json", record.to_json(), durable=True)


def flocked(store: LockStore, name: str, op: int = fcntl.LOCK_EX) -> int:
    """An fd on the flock file ``name``, flocked (``op``), and still the file that name
    means: one that prune unlinked between our open and our flock is left for the new one
    (locking the old inode would let a newcomer lock the new one too). The caller closes it."""
    for _ in range(_REOPEN_TRIES):
        try:
            fd = store.open_lock_file(name)
        except Vanished:
            store.reopen()
            continue
        try:
            fcntl.flock(fd, op)
            if same_file(store.dir, name, fd):
                return fd
        except BaseException:
            os.close(fd)
            raise
        os.close(fd)
        store.reopen()
    raise Vanished(store.dir.path)


def highest_recorded_fence(store: LockStore) -> int:
    """The highest fence in tickets/, ended/ (the last holder's record is never pruned),
    requests/ (and each one's previous run) and the success record; 0 if none shows one."""
    highest = 0
    # Only directories that exist: a new lock must not grow empty ones (disk per idle lock).
    for sub in ("tickets", "ended"):
        if store.dir.lstat(sub) is not None:
            for t in store._records(sub):
                highest = max(highest, t.fence or 0)
    names = store.sub("requests").listdir() if store.dir.lstat("requests") is not None else []
    for name in names:
        if name.endswith(".json") and not name.startswith("."):
            rec = store.read_request(name[:-5])
            while rec is not None:
                highest = max(highest, rec.fence or 0)
                rec = rec.previous
    success = store._read_success()
    if success is not None and success[1] is not None:
        highest = max(highest, success[1])
    return highest
