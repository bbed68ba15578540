"""A pearing-run cut off from its PostgreSQL server while it holds (a network partition between
that one client and the server; the server and every other client are fine).

The holder cannot renew: it must stop COMMAND before the server can expire its lease and promote
the next waiter, whatever its kill grace. With a lease under 3 x (grace + 1.5 s) the grace is cut
to what is left of the lease (as on etcd: test_etcd.py's partitioned holder).
"""

from __future__ import annotations

from pathlib import Path

import pytest
from helpers import PEARING_GUARD, Procs, q, stubborn_command, wait_for
from pg_cluster import PgCluster
from tcp_partition import Partition
from test_postgres import _tenant, waiting

from singleflight.core.const import ENV_BACKEND, ExitCode


@pytest.mark.parametrize(("lease", "grace"), [("6", "1"), ("3", "2")])
def test_a_holder_cut_off_from_the_server_stops_command_before_its_lease_can_pass(
    postgres: PgCluster, procs: Procs, work: Path, lease: str, grace: str
) -> None:
    url = _tenant(postgres)
    partition = Partition(postgres.port)
    try:
        holder_url = url.replace(f"127.0.0.1:{postgres.port}/", f"127.0.0.1:{partition.port}/")
        assert holder_url != url
        alive, term = work / "alive", work / "term"
        script = stubborn_command(work, work / "ready")
        holder = procs.pr(
            "--job", "J", "--lease-seconds", lease, "--kill-grace", grace, "--", "sh", "-c", script,
            env={**procs.env, ENV_BACKEND: holder_url},
        )  # fmt: skip
        wait_for((work / "ready").exists, 30, "the holder's COMMAND to start")
        waiter = procs.pr(
            "--job", "J", "--wait-seconds", "30", "--", "sh", "-c",
            f"date +%s%N > {q(work / 'w_start')}; echo $PEARING_FENCE > {q(work / 'f2')}",
            env={**procs.env, ENV_BACKEND: url},
        )  # fmt: skip
        wait_for(lambda: waiting(url, 1), 30, "the waiter to join the line")
        partition.cut()
        h = procs.finish(holder, timeout=30)
        w = procs.finish(waiter, timeout=30)
    finally:
        partition.close()
    assert h.returncode == ExitCode.LEASE_LOST, h
    assert w.returncode == 0, w
    assert term.exists(), "stopped as everywhere: SIGTERM first"
    assert int((work / "w_start").read_text()) > int(alive.read_text()), "two COMMANDs at once"
    assert int((work / "f2").read_text()) > int((work / "f1").read_text())
    r = procs.run(
        [PEARING_GUARD, "verify", "--token-file", str(work / "old.token")], env={**procs.env, ENV_BACKEND: url}
    )
    assert r.returncode == ExitCode.REFUSED, r
