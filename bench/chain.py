"""What the benchmark's sections share: a clean environment, a bounded wait, the hand-over chain
(``chain``), a one-member etcd on loopback (``etcd_member``) and a throwaway PostgreSQL server on
loopback (``pg_member``). ``python -m bench`` and
``python -m bench.growth`` both measure hand-overs with ``chain``, so their numbers compare."""

from __future__ import annotations

import contextlib
import glob
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from collections.abc import Callable, Iterator
from pathlib import Path

BIN = Path(sys.executable).parent
RUN = str(BIN / "pearing-run")
FLOCK = shutil.which("flock")
ETCD = shutil.which("etcd")
ETCDCTL = shutil.which("etcdctl")
# Debian's server binaries are off PATH, one directory a major version.
PG_BIN = next(
    (b for b in sorted(glob.glob("/usr/lib/postgresql/*/bin"), reverse=True) if os.path.exists(f"{b}/initdb")), None
)


def env(lock_dir: Path) -> dict[str, str]:
    out = {k: v for k, v in os.environ.items() if not k.startswith("PEARING_")}
    out["PEARING_LOCK_DIR"] = str(lock_dir)
    return out


def wait_for(pred: Callable[[], bool], timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not pred():
        if time.monotonic() > deadline:
            raise SystemExit(f"bench: timed out waiting for {what}")
        time.sleep(0.002)


def chain(
    tool: str,
    waiters: int,
    tmp: Path,
    backend: str | None = None,
    *,
    job: str = "c",
    lock_dir: Path | None = None,
    behind: Callable[[], None] | None = None,
) -> list[float]:
    """Start a holder, queue ``waiters`` runs behind it, release; hand-over gaps in ms.

    ``tool``: pearing (pearing-run, on the lock dir or ``backend``), flock (flock -w) or
    etcdctl (etcdctl lock on ``backend``'s queue of the same lock: pearing's mutex prefix).
    ``lock_dir``: the runs' lock dir (default: a new one). ``behind`` is called once every
    waiter is in line, before the holder lets go: what it adds to the line waits behind the
    chain (``bench.growth``'s long lines).
    """
    d = Path(tempfile.mkdtemp(dir=tmp, prefix=f"chain-{tool}-"))
    lock_dir = lock_dir or d / "lockdir"
    e = env(lock_dir)
    if backend:
        e["PEARING_BACKEND"] = backend
        e["ETCDCTL_API"] = "3"
    gate, ready = d / "go", d / "ready"
    hold = f"touch {ready}; while [ ! -e {gate} ]; do sleep 0.002; done; date +%s%N > {d}/h"
    lock = str(d / "flock.lock")
    etcdctl = (
        [str(ETCDCTL), "--endpoints", endpoints(backend), "lock", mutex_prefix(backend, job), "--"]
        if tool == "etcdctl"
        else []
    )
    if tool == "pearing":
        head = [RUN, "--job", job, "--", "sh", "-c", hold]
    elif tool == "etcdctl":
        head = [*etcdctl, "sh", "-c", hold]
    else:
        head = [str(FLOCK), "-w", "300", lock, "sh", "-c", hold]
    procs = [subprocess.Popen(head, env=e)]
    wait_for(ready.exists, 10, "chain holder")
    outs = []
    for i in range(waiters):
        out = open(d / f"w{i:03d}", "wb")  # noqa: SIM115 - closed below
        outs.append(out)
        if tool == "pearing":
            argv = [RUN, "--job", job, "--wait-seconds", "300", "--", "date", "+%s%N"]
        elif tool == "etcdctl":
            argv = [*etcdctl, "date", "+%s%N"]
        else:
            argv = [str(FLOCK), "-w", "300", lock, "date", "+%s%N"]
        procs.append(subprocess.Popen(argv, env=e, stdout=out))
        if tool == "pearing" and not backend:  # arrival order is part of what is measured
            qdir = lock_dir / f"locks/default/@{job}/queue"
            wait_for(lambda n=i + 1, q=qdir: queued(q) >= n, 20, "enqueue")
        elif backend:
            wait_for(lambda n=i + 2: in_line(backend, job) >= n, 20, "enqueue")
    # flock(1) has no queue to watch: give its waiters time to block in the kernel.
    if tool == "flock":
        time.sleep(0.2 + waiters * 0.005)
    if behind is not None:
        behind()
    gate.touch()
    for p in procs:
        if p.wait(300) != 0:
            raise SystemExit(f"bench: chain member exited {p.returncode}")
    for out in outs:
        out.close()
    stamps = [int((d / "h").read_text())]
    order = []
    for i in range(waiters):
        t = int((d / f"w{i:03d}").read_text())
        stamps.append(t)
        order.append((t, i))
    gaps = [(b - a) / 1e6 for a, b in zip(sorted(stamps), sorted(stamps)[1:], strict=False)]
    fifo = [i for _, i in sorted(order)] == list(range(waiters))
    shutil.rmtree(d, ignore_errors=True)
    return gaps if tool == "flock" or fifo else [-1.0]


def queued(qdir: Path) -> int:
    return len([q for q in os.listdir(qdir) if q[0].isdigit()]) if qdir.exists() else 0


def in_line(url: str, job: str) -> int:
    """The tickets in (default, ``job``)'s line on a network store, its holder's included."""
    return pg_in_line(url, job) if url.startswith(("postgresql://", "postgres://")) else etcd_queued(url, job)


def pg_in_line(url: str, job: str) -> int:
    from singleflight.postgres.db import Db

    db = Db(url)
    try:
        sql = "SELECT count(*) FROM {s}.tickets WHERE line AND scope = 'default' AND name = %s"
        return int(db.q(sql, (job,))[0][0])
    finally:
        db.close()


def etcd_queued(url: str, job: str) -> int:
    from singleflight.etcd.client import Cluster
    from singleflight.etcd.lock import Mutex

    kvs, _ = Mutex(Cluster(url), "default", job).queue(keys_only=True)
    return len(kvs)


def endpoints(url: str | None) -> str:
    from singleflight.etcd.url import parse_url

    return ",".join(f"{h}:{p}" for h, p in parse_url(str(url))[0])


def mutex_prefix(url: str | None, job: str) -> str:
    """The etcd concurrency-mutex prefix of (default, job): what etcdctl lock takes."""
    from singleflight.etcd.url import parse_url

    return f"/{parse_url(str(url))[1]}/default/@{job}/q"


@contextlib.contextmanager
def etcd_member(data_dir: Path) -> Iterator[str | None]:
    """A one-member etcd on loopback, healthy, as ``etcd://127.0.0.1:PORT``; None without
    etcd or etcdctl (the sections that need it are skipped)."""
    if ETCD is None or ETCDCTL is None:
        yield None
        return
    ports = []
    for _ in range(2):
        with socket.socket() as sk:
            sk.bind(("127.0.0.1", 0))
            ports.append(sk.getsockname()[1])
    client, peer = ports
    proc = subprocess.Popen(
        [
            ETCD, "--name", "bench", "--data-dir", str(data_dir),
            "--listen-client-urls", f"http://127.0.0.1:{client}", "--advertise-client-urls", f"http://127.0.0.1:{client}",
            "--listen-peer-urls", f"http://127.0.0.1:{peer}", "--initial-advertise-peer-urls", f"http://127.0.0.1:{peer}",
            "--initial-cluster", f"bench=http://127.0.0.1:{peer}",
        ],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )  # fmt: skip

    def healthy() -> bool:
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{client}/health", timeout=0.5) as r:
                return b"true" in r.read()
        except OSError:
            return False

    try:
        wait_for(healthy, 20, "etcd")
        yield f"etcd://127.0.0.1:{client}"
    finally:
        proc.terminate()
        proc.wait(10)


@contextlib.contextmanager
def pg_member() -> Iterator[str | None]:
    """A throwaway PostgreSQL server on loopback (``initdb`` in a temp dir of its own, trust auth,
    as the ``postgres`` user when we are root: the server refuses to run as root, and so cannot
    enter the benchmark's own private temp dir), as a ``postgresql://`` URL; None without the
    server's binaries or the postgres extra's driver."""
    try:
        import psycopg  # noqa: F401 - only whether the extra is installed
    except ImportError:
        yield None
        return
    if PG_BIN is None:
        yield None
        return
    owner = ["runuser", "-u", "postgres", "--"] if os.geteuid() == 0 else []
    root = Path(tempfile.mkdtemp(prefix="pearing-bench-pg-"))
    if owner:
        shutil.chown(root, "postgres", "postgres")
    with socket.socket() as sk:
        sk.bind(("127.0.0.1", 0))
        port = sk.getsockname()[1]
    data = root / "data"

    def run(*argv: str) -> None:
        subprocess.run([*owner, *argv], check=True, capture_output=True, timeout=120)

    try:
        run(f"{PG_BIN}/initdb", "-D", str(data), "-U", "postgres", "--auth=trust", "-E", "UTF8")
        opts = f"-c listen_addresses=127.0.0.1 -p {port} -k {root} -c max_connections=400"
        run(f"{PG_BIN}/pg_ctl", "-D", str(data), "-o", opts, "-l", str(root / "log"), "-w", "start")
        try:
            yield f"postgresql://postgres@127.0.0.1:{port}/postgres?schema=bench"
        finally:
            with contextlib.suppress(subprocess.SubprocessError):
                run(f"{PG_BIN}/pg_ctl", "-D", str(data), "-m", "fast", "-w", "stop")
    finally:
        shutil.rmtree(root, ignore_errors=True)
