"""A throwaway PostgreSQL cluster on loopback for the tests (Debian's postgresql).

``initdb`` in a temp dir (as the ``postgres`` user when the tests run as root), trust auth,
listening on 127.0.0.1 on a free port with its unix socket in the temp dir; stopped at the end.
The server can be stopped, started, paused (SIGSTOP) and resumed to inject faults.
"""

from __future__ import annotations

import contextlib
import glob
import os
import shutil
import signal
import socket
import subprocess
from pathlib import Path

_BINS = sorted(glob.glob("/usr/lib/postgresql/*/bin"), reverse=True)
BIN = next((b for b in _BINS if os.path.exists(f"{b}/initdb")), None)
PGBOUNCER = shutil.which("pgbouncer") or ("/usr/sbin/pgbouncer" if os.path.exists("/usr/sbin/pgbouncer") else None)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _as_owner() -> list[str]:
    """Postgres refuses to run as root: as the ``postgres`` user then."""
    return ["runuser", "-u", "postgres", "--"] if os.geteuid() == 0 else []


class PgCluster:
    def __init__(self, root: Path) -> None:
        assert BIN is not None
        self.root = root
        self.data = root / "data"
        self.port = free_port()
        if os.geteuid() == 0:
            shutil.chown(root, "postgres", "postgres")
            os.chmod(root, 0o700)

    @property
    def url(self) -> str:
        return f"postgresql://postgres@127.0.0.1:{self.port}/postgres"

    def _run(self, *argv: str) -> None:
        subprocess.run([*_as_owner(), *argv], check=True, capture_output=True, timeout=60)

    def init(self) -> None:
        self._run(f"{BIN}/initdb", "-D", str(self.data), "-U", "postgres", "--auth=trust", "-E", "UTF8")

    def start(self, *settings: str, tries: int = 3) -> None:
        """``settings``: more ``name=value`` for the server (as ``-c``). Its port was free when
        chosen, but another test worker may take it before the server binds it: then it is
        started again on a fresh one."""
        log = self.root / "log"
        for attempt in range(tries):
            opts = f"-c listen_addresses=127.0.0.1 -p {self.port} -k {self.root} -c max_connections=300"
            opts += "".join(f" -c {setting}" for setting in settings)
            seen = log.stat().st_size if log.exists() else 0
            try:
                self._run(f"{BIN}/pg_ctl", "-D", str(self.data), "-o", opts, "-l", str(log), "-w", "start")
                return
            except subprocess.CalledProcessError:
                with open(log, "rb") as f:
                    f.seek(seen)
                    taken = b"Address already in use" in f.read()
                if not taken or attempt == tries - 1:
                    raise
                self.port = free_port()

    def standby_of(self, primary: PgCluster) -> None:
        """This cluster's data: a streaming copy of ``primary`` that follows it (pg_basebackup -R)."""
        self._run(
            f"{BIN}/pg_basebackup", "-D", str(self.data), "-h", "127.0.0.1", "-p", str(primary.port),
            "-U", "postgres", "-R", "-X", "stream",
        )  # fmt: skip

    def promote(self) -> None:
        self._run(f"{BIN}/pg_ctl", "-D", str(self.data), "-w", "promote")

    def stop(self, mode: str = "fast") -> None:
        with contextlib.suppress(subprocess.CalledProcessError, subprocess.TimeoutExpired):
            self._run(f"{BIN}/pg_ctl", "-D", str(self.data), "-m", mode, "-w", "stop")

    def pid(self) -> int:
        return int((self.data / "postmaster.pid").read_text().split()[0])

    def pause(self) -> None:
        """SIGSTOP the postmaster and every backend: the server stops answering (connections stay)."""
        for pid in self._pids():
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGSTOP)

    def resume(self) -> None:
        for pid in self._pids():
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGCONT)

    def _pids(self) -> list[int]:
        main = self.pid()
        out = subprocess.run(["ps", "-o", "pid=", "--ppid", str(main)], capture_output=True, text=True, check=False)
        return [main, *(int(p) for p in out.stdout.split())]

    def sql(self, statement: str) -> str:
        assert BIN is not None
        r = subprocess.run(
            [f"{BIN}/psql", self.url, "-At", "-v", "ON_ERROR_STOP=1", "-c", statement],
            capture_output=True,
            text=True,
            timeout=30,
            check=True,
        )
        return r.stdout
