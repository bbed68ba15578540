"""The only place that touches files in the lock dir.

Every path is walked one component at a time with ``dir_fd`` and
``O_NOFOLLOW``, so a symlink planted anywhere inside the lock dir is refused
(ELOOP/ENOTDIR) instead of followed. Every record is written by one function:
temp file, fsync, rename, fsync of the directory.
"""

from __future__ import annotations

import errno
import os
import stat

from singleflight.core.const import ENV_LOCK_DIR, MAX_FENCE, ROOT_LOCK_DIR, TYPE_CHECKING
from singleflight.core.errors import BadValue, CorruptRecord, LockDirError, NotPermitted, Vanished

if TYPE_CHECKING:
    from collections.abc import Callable
    from typing import Final

_DIR_FLAGS: Final = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC
_FILE_FLAGS: Final = os.O_NOFOLLOW | os.O_CLOEXEC
# O_NONBLOCK: a FIFO planted where a record belongs must not hang open(); O_NOCTTY: nor
# may a terminal device become ours.
_READ_FLAGS: Final = os.O_RDONLY | os.O_NONBLOCK | os.O_NOCTTY
# Every record is a few hundred bytes; a larger file is not one of ours.
MAX_RECORD: Final = 1 << 20
# A symlink met with O_NOFOLLOW gives ELOOP; a symlink standing for a
# directory in a dir_fd walk gives ENOTDIR.
_SYMLINK_ERRNOS: Final = frozenset({errno.ELOOP, errno.ENOTDIR, errno.EMLINK})


def resolve_lock_dir(flag: str | None = None) -> str:
    """``--lock-dir``, else PEARING_LOCK_DIR, else the per-user state dir (root: /var/lib/pearing)."""
    value = flag if flag is not None else os.environ.get(ENV_LOCK_DIR) or None
    if value is not None:
        if not value or "\0" in value:
            raise BadValue("lock dir", value, "must be a non-empty path")
        return os.path.abspath(value)
    if os.geteuid() == 0:
        return ROOT_LOCK_DIR
    # platformdirs' rule for Linux, without its import on the hot path.
    state_home = os.environ.get("XDG_STATE_HOME", "").strip()
    if os.path.isabs(state_home):
        return os.path.join(state_home, "pearing")
    if not os.path.exists("/proc"):
        import platformdirs

        return platformdirs.user_state_dir("pearing")
    return os.path.join(os.path.expanduser("~"), ".local", "state", "pearing")


def lock_parts(repo: str, lock: str) -> list[str]:
    """The path of one (repo, lock) inside the lock dir; '@' cannot occur in a scope segment."""
    return ["locks", *repo.split("/"), "@" + lock]


def _check_owner(st: os.stat_result, path: str) -> None:
    if st.st_uid != os.geteuid():
        raise NotPermitted(path, f"owned by uid {st.st_uid}, not by this user (uid {os.geteuid()})")
    if st.st_mode & 0o022:
        raise NotPermitted(path, f"is group- or world-writable (mode {stat.S_IMODE(st.st_mode):o})")


def check_ancestors(path: str) -> None:
    """Every directory above ``path``, like ssh's StrictModes: owned by root or by us, and
    not group- or world-writable unless sticky. Otherwise another user could rename the
    lock dir (or a ledger) away and plant their own, and a fence would start again at 1.
    """
    euid = os.geteuid()
    current = os.path.dirname(os.path.realpath(path))
    while True:
        try:
            st = os.stat(current)
        except OSError as exc:
            raise _os_error(current, exc) from None
        if st.st_uid not in (0, euid):
            raise NotPermitted(current, f"an ancestor is owned by uid {st.st_uid}, not by root or this user")
        if st.st_mode & 0o022 and not st.st_mode & stat.S_ISVTX:
            mode = stat.S_IMODE(st.st_mode)
            raise NotPermitted(current, f"an ancestor is group- or world-writable without the sticky bit ({mode:o})")
        parent = os.path.dirname(current)
        if parent == current:
            return
        current = parent


def _os_error(path: str, exc: OSError) -> Exception:
    if exc.errno in _SYMLINK_ERRNOS:
        return NotPermitted(path, "is a symlink or not a directory; refusing to follow it")
    if exc.errno in (errno.EACCES, errno.EPERM):
        return NotPermitted(path, exc.strerror or "permission denied")
    return LockDirError(path, exc.strerror or str(exc))


def _plain(d: Dir, name: str) -> None:
    """One name inside ``d``: never a path that could leave it, never one the OS refuses.

    Names come from validated values (a UUID, a lock name) or from listing the dir, so this
    is a backstop: a name read from a record that slipped past validation stops here (77).
    """
    if not name or name in (".", "..") or "/" in name or "\0" in name or len(name) > 255:
        raise NotPermitted(d.child_path(name.replace("\0", "\\0")), "not a plain file name; refusing to leave the dir")


class Dir:
    """An open directory inside the lock dir; owns its fd."""

    __slots__ = ("fd", "path")

    def __init__(self, fd: int, path: str) -> None:
        self.fd, self.path = fd, path

    @classmethod
    def open_root(cls, path: str, *, create: bool) -> Dir:
        """Open (and create 0700) the lock dir itself, refusing a hostile one."""
        if not path or "\0" in path:
            raise LockDirError(repr(path), "not a usable lock dir path")
        path = os.path.abspath(path)
        try:
            fd = os.open(path, _DIR_FLAGS)
        except FileNotFoundError:
            if not create:
                raise LockDirError(path, "lock dir does not exist") from None
            try:
                os.makedirs(path, mode=0o700, exist_ok=True)
                fd = os.open(path, _DIR_FLAGS)
            except OSError as exc:
                raise _os_error(path, exc) from None
        except OSError as exc:
            raise _os_error(path, exc) from None
        try:
            _check_owner(os.fstat(fd), path)
            check_ancestors(path)
        except BaseException:
            os.close(fd)
            raise
        return cls(fd, path)

    @classmethod
    def open_checked(cls, path: str, *, what: str) -> Dir:
        """An existing directory outside the lock dir (a ledger's), checked like the lock dir's
        ancestors: owned by root or us, not writable by others unless sticky."""
        path = os.path.abspath(path)
        try:
            fd = os.open(path, _DIR_FLAGS)
        except FileNotFoundError:
            raise LockDirError(path, f"{what} does not exist") from None
        except OSError as exc:
            raise _os_error(path, exc) from None
        try:
            st = os.fstat(fd)
            if st.st_uid not in (0, os.geteuid()):
                raise NotPermitted(path, f"{what} is owned by uid {st.st_uid}, not by root or this user")
            if st.st_mode & 0o022 and not st.st_mode & stat.S_ISVTX:
                mode = stat.S_IMODE(st.st_mode)
                raise NotPermitted(path, f"{what} is writable by others without the sticky bit (mode {mode:o})")
            check_ancestors(path)
        except BaseException:
            os.close(fd)
            raise
        return cls(fd, path)

    def child_path(self, name: str) -> str:
        return f"{self.path}/{name}"

    def sub(self, name: str, *, create: bool = True) -> Dir:
        path = self.child_path(name)
        _plain(self, name)
        try:
            fd = os.open(name, _DIR_FLAGS, dir_fd=self.fd)
        except FileNotFoundError:
            if not create:
                raise
            try:
                os.mkdir(name, 0o700, dir_fd=self.fd)
            except FileExistsError:
                pass
            except FileNotFoundError:
                raise Vanished(self.path) from None  # this directory itself is gone (pruned)
            except OSError as exc:
                raise _os_error(path, exc) from None
            try:
                fd = os.open(name, _DIR_FLAGS, dir_fd=self.fd)
            except FileNotFoundError:
                raise Vanished(path) from None  # made, and pruned at once
            except OSError as exc:
                raise _os_error(path, exc) from None
        except OSError as exc:
            raise _os_error(path, exc) from None
        return Dir(fd, path)

    def walk(self, parts: list[str], *, create: bool = True) -> Dir:
        current = self
        try:
            for part in parts:
                nxt = current.sub(part, create=create)
                if current is not self:
                    current.close()
                current = nxt
        except BaseException:
            if current is not self:
                current.close()
            raise
        return current

    def open(self, name: str, flags: int, mode: int = 0o600) -> int:
        """Open a file in this dir without following a symlink."""
        _plain(self, name)
        try:
            return os.open(name, flags | _FILE_FLAGS, mode, dir_fd=self.fd)
        except FileNotFoundError:
            if flags & os.O_CREAT:
                raise Vanished(self.path) from None  # O_CREAT fails only once the directory is gone
            raise
        except OSError as exc:
            raise _os_error(self.child_path(name), exc) from None

    def read(self, name: str, check: Callable[[int], None] | None = None) -> bytes | None:
        """The whole record, or None when it does not exist.

        Anything but a regular file (a directory, a FIFO, a device) is refused (77), and a
        file larger than any record is corrupt (74): every failure names the path.
        ``check`` sees the open fd first (a ledger's owner and mode).
        """
        try:
            fd = self.open(name, _READ_FLAGS)
        except FileNotFoundError:
            return None
        path = self.child_path(name)
        try:
            if check is not None:
                check(fd)
            st = os.fstat(fd)
            if not stat.S_ISREG(st.st_mode):
                raise NotPermitted(path, "is not a regular file; refusing to read it as a record")
            if st.st_size > MAX_RECORD:
                raise CorruptRecord(path, f"{st.st_size} bytes, larger than any record")
            chunks = []
            size = 0
            while chunk := os.read(fd, 65536):
                chunks.append(chunk)
                size += len(chunk)
                if size > MAX_RECORD:
                    raise CorruptRecord(path, "larger than any record")
            return b"".join(chunks)
        except OSError as exc:
            raise _os_error(path, exc) from None
        finally:
            os.close(fd)

    def write_atomic(self, name: str, data: bytes, *, mode: int = 0o600, durable: bool = True) -> None:
        """Replace ``name`` whole: readers see the old or the new bytes, never a mix.

        ``durable`` fsyncs file and directory so the record survives power loss
        (fences and dedupe records need that; a ticket of a dead machine does not).
        """
        _plain(self, name)
        tmp = f".tmp.{name}.{os.getpid()}"
        # O_EXCL on a fresh name: in a shared (sticky) ledger dir another user may have
        # planted a file of the temp's name, and writing into their inode would hand them
        # the record after the rename.
        self.unlink(tmp)
        try:
            fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | _FILE_FLAGS, mode, dir_fd=self.fd)
        except FileNotFoundError:
            raise Vanished(self.path) from None
        except OSError as exc:
            raise _os_error(self.child_path(name), exc) from None
        try:
            try:
                view = memoryview(data)
                while view:
                    view = view[os.write(fd, view) :]
                if durable:
                    os.fsync(fd)
            finally:
                os.close(fd)
            os.rename(tmp, name, src_dir_fd=self.fd, dst_dir_fd=self.fd)
        except OSError as exc:
            self.unlink(tmp)
            raise _os_error(self.child_path(name), exc) from None
        if durable:
            try:
                os.fsync(self.fd)
            except OSError as exc:
                raise _os_error(self.path, exc) from None

    def unlink(self, name: str) -> bool:
        _plain(self, name)
        try:
            os.unlink(name, dir_fd=self.fd)
        except FileNotFoundError:
            return False
        except OSError as exc:
            raise _os_error(self.child_path(name), exc) from None
        return True

    def rename(self, src: str, dst: str) -> None:
        _plain(self, src)
        _plain(self, dst)
        try:
            os.rename(src, dst, src_dir_fd=self.fd, dst_dir_fd=self.fd)
        except OSError as exc:
            raise _os_error(self.child_path(dst), exc) from None

    def fsync(self) -> None:
        """Make a rename in this directory durable."""
        try:
            os.fsync(self.fd)
        except OSError as exc:
            raise _os_error(self.path, exc) from None

    def listdir(self) -> list[str]:
        try:
            return os.listdir(self.fd)
        except OSError as exc:
            raise _os_error(self.path, exc) from None

    def rmdir(self, name: str) -> bool:
        """Remove the empty directory ``name`` (never a symlink: rmdir refuses one); False when
        it is not empty or not there, as when someone has just come to use it."""
        _plain(self, name)
        try:
            os.rmdir(name, dir_fd=self.fd)
        except OSError as exc:
            if exc.errno in (errno.ENOENT, errno.ENOTEMPTY, errno.EEXIST):
                return False
            raise _os_error(self.child_path(name), exc) from None
        return True

    def lstat(self, name: str) -> os.stat_result | None:
        _plain(self, name)
        try:
            return os.stat(name, dir_fd=self.fd, follow_symlinks=False)
        except FileNotFoundError:
            return None
        except OSError as exc:
            raise _os_error(self.child_path(name), exc) from None

    def close(self) -> None:
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1

    def __enter__(self) -> Dir:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def same_file(d: Dir, name: str, fd: int) -> bool:
    """Does ``name`` in ``d`` still name the file open as ``fd``? After a flock, the
    answer tells a lock on the current file from one on a file prune unlinked meanwhile
    (its inode lives on while open, and a newcomer would lock a fresh one: two holders)."""
    try:
        here = os.stat(name, dir_fd=d.fd, follow_symlinks=False)
    except FileNotFoundError:
        return False
    except OSError as exc:
        raise _os_error(d.child_path(name), exc) from None
    mine = os.fstat(fd)
    return (here.st_dev, here.st_ino) == (mine.st_dev, mine.st_ino)


def parse_int_record(path: str, data: bytes, *, low: int = 1, high: int = MAX_FENCE) -> int:
    """A decimal counter file (a fence): ASCII digits from ``low`` to ``high``, surrounding
    whitespace allowed. Anything else is corrupt (74), never read as 0."""
    text = data.decode("ascii", "replace").strip()
    digits = text.lstrip("0") or "0"
    # int() refuses more than 4300 digits (ValueError): a longer value is over any ceiling anyway.
    if not text or not text.isascii() or not text.isdigit() or len(digits) > len(str(high)):
        raise CorruptRecord(path, f"expected a decimal integer from {low} to {high}, found {text[:40]!r}")
    value = int(digits)
    if not low <= value <= high:
        raise CorruptRecord(path, f"expected a decimal integer from {low} to {high}, found {text[:40]!r}")
    return value


def check_trusted(path: str, st: os.stat_result, what: str) -> None:
    """A file of ours alone (a ledger, the thread database): a regular file of this user's that
    nobody else can write. In a sticky shared dir another user may own a file of this name, or
    make one writable to all, and rewrite what it guards. ``st``: from the open fd."""
    if not stat.S_ISREG(st.st_mode):
        raise NotPermitted(path, f"is not a regular file; refusing it as {what}")
    if st.st_uid != os.geteuid():
        raise NotPermitted(path, f"owned by uid {st.st_uid}, not by this user (uid {os.geteuid()})")
    if st.st_mode & 0o022:
        raise NotPermitted(path, f"is group- or world-writable (mode {stat.S_IMODE(st.st_mode):o})")
