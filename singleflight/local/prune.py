"""``pearing-cli prune`` on the lock dir: an idle lock's files go, its fence into the floor.

Every owner of a lock takes a flock only on the file its name still means (``LockStore.flocked``,
``LocalLock.enter``, ``LocalPlace.wait``): a flock on a file unlinked meanwhile is dropped and the
path opened again. Prune keeps the other half. It takes the lock's flock and its guard lock
without waiting (a lock in use is skipped, not waited for) and its mutex (held for microseconds
by anyone), each checked the same way; finds no live ticket, nobody in line and no token file of
another backend's run; raises the lock dir's fence floor above the lock's fence (durably, before
the fence file goes); removes the records; and unlinks the three flock files last, while it still
holds them. Whoever opened one before finds, once it has the flock, that the name means another
file or none, and starts again on the path; whoever comes later makes the directory afresh. No
symlink is followed (every name is unlinked, never opened through), nothing outside the lock's
directory and its empty scope directories is touched.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import stat
import time
from collections.abc import Callable

from singleflight.core import proc
from singleflight.core.const import HELD
from singleflight.core.errors import PearingError, UnknownLock, Vanished
from singleflight.core.fs import Dir, parse_int_record, same_file
from singleflight.core.idle import Idle
from singleflight.local import queue, slots
from singleflight.local.records import LockRecords
from singleflight.local.store import FENCE_FLOOR, LockDir, LockStore

# The lock's own subdirectories (store.py); another directory found there is not ours: left,
# and the lock's directory with it.
_SUBDIRS = ("tickets", "ended", "tokens", "queue", "requests")
# The flock files, and why a lock whose file is flocked by someone else is kept. The mutex is
# waited for a moment (its holders keep it for microseconds); the other two are not waited for.
_FLOCKS = {"lock": ("held", 0.0), "guard.lock": ("a guarded command in flight", 0.0), "state.lock": ("busy", 1.0)}


def prune(lock_dir: LockDir, repo: str, lock: str, keep: Callable[[Idle], str | None], *, dry_run: bool) -> str | None:
    """Remove the lock's files unless ``keep`` says why not (returned). UnknownLock: none left."""
    try:
        store = lock_dir.lock_store(repo, lock, create=False)
    except FileNotFoundError:
        raise UnknownLock(repo, lock) from None
    fds: list[int] = []
    try:
        with store:
            for name, (busy, wait) in _FLOCKS.items():
                fd = _flock(store, name, wait)
                if fd is None:
                    return busy
                fds.append(fd)
            why = keep(_facts(store))
            if why is not None or dry_run:
                return why
            _raise_floor(lock_dir, store.read_fence())
            _remove(store)
            _rmdir_lock(lock_dir, store, repo, lock)
    finally:
        for fd in fds:
            os.close(fd)  # the flocks on the unlinked files: whoever waited on them starts again
    _rmdir_scopes(lock_dir, repo)
    return None


def _flock(store: LockStore, name: str, wait: float) -> int | None:
    """The flock file ``name`` flocked, and still the file of that name; None if someone has it."""
    try:
        fd = store.dir.open(name, os.O_RDWR | os.O_CREAT, 0o600)
    except Vanished:
        return None  # another prune took the lock a moment ago
    if queue.flock_until(fd, time.monotonic() + wait) and same_file(store.dir, name, fd):
        return fd
    os.close(fd)
    return None


def _facts(store: LockStore) -> Idle:
    """The lock as it is, under its flock, guard lock and mutex."""
    in_use = None
    for t in store.tickets():
        # A live record whose process is gone is a leftover (a holder killed with -9): its lock's
        # flock was free, and the next holder would end it.
        if t.live and (t.holder_pid is None or proc.alive(t.holder_pid, t.holder_start)):
            in_use = "held" if t.state == HELD else "waiting"
    if in_use is None and _waiting(store):
        in_use = "waiting"
    if in_use is None and slots.ever_slotted(store):
        # Its slot files are taken without prune's check that a flocked file is still the one
        # its name means (only the one-slot lock file has it): never removed, whatever its age.
        in_use = "a lock with --slots (not pruned)"
    if in_use is None and _foreign_tokens(store):
        in_use = "a token file of a run on another backend"
    requests = []
    if store.dir.lstat("requests") is not None:
        d, records = store.sub("requests"), LockRecords(store)
        # As a run reads them: a claim whose run is gone is none (``LockRecords.read_record``).
        for name in d.listdir():
            body = d.read(name) if name.endswith(".json") and not name.startswith(".") else None
            if body is not None and not records.dead_claim(body):
                requests.append(body)
    return Idle(in_use=in_use, last_used=_newest(store), success=store.dir.read("success"), requests=requests)


def _waiting(store: LockStore) -> bool:
    """Is an entry in line flocked by its waiter (alive, even if frozen past its deadline)?"""
    if store.dir.lstat("queue") is None:
        return False
    d = store.sub("queue")
    for name in d.listdir():
        if name == ".seq":
            continue
        try:
            fd = d.open(name, os.O_RDONLY | os.O_NONBLOCK)
        except (FileNotFoundError, PearingError):
            continue  # gone, or not a file a waiter made (a planted link): no waiter of ours
        try:
            if not queue.try_flock(fd):
                return True
        finally:
            os.close(fd)
    return False


def _foreign_tokens(store: LockStore) -> bool:
    """A token file naming another backend (etcd's runs keep theirs here too). Ours exist only
    while held, and a leftover of a holder killed with -9 is this backend's: it goes."""
    if store.dir.lstat("tokens") is None:
        return False
    d = store.sub("tokens")
    for name in d.listdir():
        try:
            body = json.loads(d.read(name) or b"{}")
        except (ValueError, PearingError):
            return True  # not ours to judge: kept for a person
        if not isinstance(body, dict) or body.get("backend"):
            return True
    return False


def _newest(store: LockStore) -> float:
    """The newest file's mtime: every acquisition writes the fence, every end a ticket record."""
    newest = 0.0
    for d, names in _files(store):
        for name in names:
            st = d.lstat(name)
            if st is not None and not stat.S_ISDIR(st.st_mode):
                newest = max(newest, st.st_mtime)
    return newest


def _files(store: LockStore) -> list[tuple[Dir, list[str]]]:
    out = [(store.dir, store.dir.listdir())]
    for sub in _SUBDIRS:
        st = store.dir.lstat(sub)
        if st is not None and stat.S_ISDIR(st.st_mode):
            d = store.sub(sub)
            out.append((d, d.listdir()))
    return out


def _raise_floor(lock_dir: LockDir, fence: int) -> None:
    """The lock dir's fence floor to at least ``fence``, on disk before the lock's fence file goes.
    Under a flock of the floor's own lock file: two prunes at once must not lower it."""
    if fence <= 0:
        return
    root = lock_dir.root
    fd = root.open(FENCE_FLOOR + ".lock", os.O_RDWR | os.O_CREAT, 0o600)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        data = root.read(FENCE_FLOOR)
        floor = 0 if data is None else parse_int_record(root.child_path(FENCE_FLOOR), data, low=0)
        if fence > floor:
            root.write_atomic(FENCE_FLOOR, f"{fence}\n".encode(), durable=True)
    finally:
        os.close(fd)


def _remove(store: LockStore) -> None:
    """The records, then the flock files (still flocked by us). Only names are unlinked: a symlink
    planted here goes as a link, its target untouched."""
    for sub in _SUBDIRS:
        st = store.dir.lstat(sub)
        if st is None or not stat.S_ISDIR(st.st_mode):
            continue
        d = store.sub(sub)
        for name in d.listdir():
            st = d.lstat(name)
            if st is not None and not stat.S_ISDIR(st.st_mode):
                d.unlink(name)
    store.close_subs()
    for sub in _SUBDIRS:
        store.dir.rmdir(sub)
    for name in store.dir.listdir():
        st = store.dir.lstat(name)
        if name not in _FLOCKS and st is not None and not stat.S_ISDIR(st.st_mode):
            store.dir.unlink(name)
    for name in _FLOCKS:
        store.dir.unlink(name)


def _rmdir_lock(lock_dir: LockDir, store: LockStore, repo: str, lock: str) -> None:
    """The lock's directory, if it is still the one we emptied and nobody has come since."""
    try:
        parent = lock_dir.root.walk(["locks", *repo.split("/")], create=False)
    except FileNotFoundError:
        return
    with parent:
        st, mine = parent.lstat("@" + lock), os.fstat(store.dir.fd)
        if st is not None and (st.st_dev, st.st_ino) == (mine.st_dev, mine.st_ino):
            parent.rmdir("@" + lock)


def _rmdir_scopes(lock_dir: LockDir, repo: str) -> None:
    """The scope's directories left empty, innermost first. Whoever walks down one as it goes
    finds it gone when making the next and walks again from the top (``LockDir.walk``)."""
    segs = repo.split("/")
    for depth in range(len(segs), 0, -1):
        try:
            parent = lock_dir.root.walk(["locks", *segs[: depth - 1]], create=False)
        except FileNotFoundError:
            return
        with parent, contextlib.suppress(FileNotFoundError):
            if not parent.rmdir(segs[depth - 1]):
                return
