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
from typing import Final

from singleflight.core.const import ENV_LOCK_DIR, ROOT_LOCK_DIR
from singleflight.core.errors import BadValue, CorruptRecord, LockDirError, NotPermitted

_DIR_FLAGS: Final = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC
_FILE_FLAGS: Final = os.O_NOFOLLOW | os.O_CLOEXEC
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


class Dir:
    """An open directory inside the lock dir; owns its fd."""

    __slots__ = ("fd", "path")

    def __init__(self, fd: int, path: str) -> None:
        self.fd, self.path = fd, path

    @classmethod
    def open_root(cls, path: str, *, create: bool) -> Dir:
        """Open (and create 0700) the lock dir itself, refusing a hostile one."""
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
            if st.st_uid not in (0, os.geteuid()) or (st.st_mode & 0o022 and not st.st_mode & stat.S_ISVTX):
                raise NotPermitted(path, f"{what} is writable by others (mode {stat.S_IMODE(st.st_mode):o})")
            check_ancestors(path)
        except BaseException:
            os.close(fd)
            raise
        return cls(fd, path)

    def child_path(self, name: str) -> str:
        return f"{self.path}/{name}"

    def sub(self, name: str, *, create: bool = True) -> Dir:
        path = self.child_path(name)
        try:
            fd = os.open(name, _DIR_FLAGS, dir_fd=self.fd)
        except FileNotFoundError:
            if not create:
                raise
            try:
                os.mkdir(name, 0o700, dir_fd=self.fd)
            except FileExistsError:
                pass
            except OSError as exc:
                raise _os_error(path, exc) from None
            try:
                fd = os.open(name, _DIR_FLAGS, dir_fd=self.fd)
            except OSError as exc:
                raise _os_error(path, exc) from None
        except OSError as exc:
            raise _os_error(path, exc) from None
        return Dir(fd, path)

    def walk(self, parts: list[str], *, create: bool = True) -> Dir:
        current = self
        for part in parts:
            nxt = current.sub(part, create=create)
            if current is not self:
                current.close()
            current = nxt
        return current

    def open(self, name: str, flags: int, mode: int = 0o600) -> int:
        """Open a file in this dir without following a symlink."""
        try:
            return os.open(name, flags | _FILE_FLAGS, mode, dir_fd=self.fd)
        except FileNotFoundError:
            raise
        except OSError as exc:
            raise _os_error(self.child_path(name), exc) from None

    def read(self, name: str) -> bytes | None:
        """The whole file, or None when it does not exist."""
        try:
            fd = self.open(name, os.O_RDONLY)
        except FileNotFoundError:
            return None
        try:
            chunks = []
            while chunk := os.read(fd, 65536):
                chunks.append(chunk)
            return b"".join(chunks)
        finally:
            os.close(fd)

    def write_atomic(self, name: str, data: bytes, *, mode: int = 0o600, durable: bool = True) -> None:
        """Replace ``name`` whole: readers see the old or the new bytes, never a mix.

        ``durable`` fsyncs file and directory so the record survives power loss
        (fences and dedupe records need that; a ticket of a dead machine does not).
        """
        tmp = f".tmp.{name}.{os.getpid()}"
        try:
            fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | _FILE_FLAGS, mode, dir_fd=self.fd)
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
        try:
            os.unlink(name, dir_fd=self.fd)
        except FileNotFoundError:
            return False
        except OSError as exc:
            raise _os_error(self.child_path(name), exc) from None
        return True

    def rename(self, src: str, dst: str) -> None:
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

    def lstat(self, name: str) -> os.stat_result | None:
        try:
            return os.stat(name, dir_fd=self.fd, follow_symlinks=False)
        except FileNotFoundError:
            return None

    def close(self) -> None:
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1

    def __enter__(self) -> Dir:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def parse_int_record(path: str, data: bytes) -> int:
    """A decimal counter file (fences, ledger entries); corrupt is an error, never 0."""
    text = data.decode("ascii", "replace").strip()
    if not text.isdigit():
        raise CorruptRecord(path, f"expected a decimal integer, found {text[:40]!r}")
    return int(text)
