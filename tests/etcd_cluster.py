"""A real 3-member etcd cluster on loopback for the tests (Debian's etcd-server).

Each member has its own data dir under a temp dir and its own ports; the
cluster is started once per session and stopped at the end. Members can be
killed, restarted, paused (SIGSTOP) and resumed to inject faults.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import socket
import subprocess
import time
import urllib.request
from pathlib import Path

ETCD = shutil.which("etcd")


def _free_ports(n: int) -> list[int]:
    """``n`` loopback ports free now, all different: each stays bound until all are chosen. (Bound
    and closed one at a time, the kernel handed one port out twice: two members on one peer URL,
    and a session cluster that never started.)"""
    socks = [socket.socket() for _ in range(n)]
    try:
        for s in socks:
            s.bind(("127.0.0.1", 0))
        return [int(s.getsockname()[1]) for s in socks]
    finally:
        for s in socks:
            s.close()


class Member:
    def __init__(self, name: str, data: Path, client: int, peer: int) -> None:
        self.name, self.data, self.client, self.peer = name, data, client, peer
        self.proc: subprocess.Popen[bytes] | None = None

    @property
    def endpoint(self) -> str:
        return f"127.0.0.1:{self.client}"

    def healthy(self) -> bool:
        try:
            with urllib.request.urlopen(f"http://{self.endpoint}/health", timeout=0.5) as r:
                return bool(json.loads(r.read()).get("health") == "true")
        except (OSError, ValueError):
            return False

    def is_leader(self) -> bool:
        req = urllib.request.Request(
            f"http://{self.endpoint}/v3/maintenance/status", data=b"{}", headers={"Content-Type": "application/json"}
        )
        try:
            with urllib.request.urlopen(req, timeout=0.5) as r:
                st = json.loads(r.read())
        except (OSError, ValueError):
            return False
        return bool(st.get("leader") == st.get("header", {}).get("member_id"))


class Cluster:
    def __init__(self, root: Path, size: int = 3) -> None:
        self.root = root
        ports = _free_ports(2 * size)
        self.members = [Member(f"m{i}", root / f"m{i}", ports[2 * i], ports[2 * i + 1]) for i in range(size)]
        self.initial = ",".join(f"{m.name}=http://127.0.0.1:{m.peer}" for m in self.members)

    @property
    def url(self) -> str:
        return "etcd://" + ",".join(m.endpoint for m in self.members)

    def url_of(self, *members: Member) -> str:
        return "etcd://" + ",".join(m.endpoint for m in members)

    def start(self, m: Member, state: str = "new") -> None:
        assert ETCD is not None
        log = open(self.root / f"{m.name}.log", "ab")  # noqa: SIM115 - owned by the process
        m.proc = subprocess.Popen(
            [
                ETCD, "--name", m.name, "--data-dir", str(m.data),
                "--listen-client-urls", f"http://127.0.0.1:{m.client}",
                "--advertise-client-urls", f"http://127.0.0.1:{m.client}",
                "--listen-peer-urls", f"http://127.0.0.1:{m.peer}",
                "--initial-advertise-peer-urls", f"http://127.0.0.1:{m.peer}",
                "--initial-cluster", self.initial, "--initial-cluster-state", state,
                "--initial-cluster-token", "pearing-test",
                "--heartbeat-interval", "50", "--election-timeout", "500",
            ],
            stdout=log,
            stderr=log,
            start_new_session=True,
        )  # fmt: skip
        log.close()

    def start_all(self, tries: int = 3) -> None:
        """Every member, until the cluster is healthy. Its ports were free when chosen, but another
        test worker may take one before the member binds it: a member that exited for that is
        started again with the whole cluster on fresh ports (its data is thrown away)."""
        for attempt in range(tries):
            for m in self.members:
                self.start(m)
            self.wait_healthy()
            # wait_healthy asks only the members still running: one that exited at start says so
            # here, not as every etcd test of the worker failing to reach the cluster.
            gone = [m for m in self.members if m.proc is None or m.proc.poll() is not None]
            if not gone:
                return
            taken = any(b"address already in use" in (self.root / f"{m.name}.log").read_bytes() for m in gone)
            if not taken or attempt == tries - 1:
                raise RuntimeError(
                    f"etcd members {[m.name for m in gone]} exited as the cluster started; logs in {self.root}"
                )
            self.stop()
            self._renumber()

    def _renumber(self) -> None:
        ports = _free_ports(2 * len(self.members))
        for i, m in enumerate(self.members):
            m.client, m.peer, m.proc = ports[2 * i], ports[2 * i + 1], None
            shutil.rmtree(m.data, ignore_errors=True)
        self.initial = ",".join(f"{m.name}=http://127.0.0.1:{m.peer}" for m in self.members)

    def wait_healthy(self, timeout: float = 30.0) -> None:
        deadline = time.monotonic() + timeout
        while not all(m.healthy() for m in self.members if m.proc and m.proc.poll() is None):
            if time.monotonic() > deadline:
                raise RuntimeError(f"etcd cluster not healthy; logs in {self.root}")
            time.sleep(0.05)

    def leader(self) -> Member:
        deadline = time.monotonic() + 15
        while True:
            for m in self.members:
                if m.is_leader():
                    return m
            if time.monotonic() > deadline:
                raise RuntimeError("no etcd leader")
            time.sleep(0.05)

    def kill(self, m: Member) -> None:
        assert m.proc is not None
        m.proc.kill()
        m.proc.wait()

    def restart(self, m: Member) -> None:
        self.start(m, state="existing")
        self.wait_healthy()

    def pause(self, m: Member) -> None:
        assert m.proc is not None
        os.kill(m.proc.pid, signal.SIGSTOP)

    def resume(self, m: Member) -> None:
        assert m.proc is not None
        os.kill(m.proc.pid, signal.SIGCONT)

    def heal(self) -> None:
        """Every member running and healthy again (after a fault test)."""
        for m in self.members:
            if m.proc is not None and m.proc.poll() is None:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(m.proc.pid, signal.SIGCONT)
            else:
                self.start(m, state="existing")
        self.wait_healthy()

    def stop(self) -> None:
        """Every member killed: its data dir is thrown away, so nothing is lost, and a graceful
        stop (SIGTERM) of the last members took about 6 s at the end of every test worker."""
        for m in self.members:
            if m.proc is not None and m.proc.poll() is None:
                with contextlib.suppress(ProcessLookupError):
                    m.proc.kill()
        for m in self.members:
            if m.proc is not None:
                m.proc.wait()
