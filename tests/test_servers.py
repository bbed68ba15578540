"""The servers the suite starts (etcd, PostgreSQL) come up even when another process took the port
chosen for them: four test workers choose free ports at the same time, and a session cluster
that did not start failed every test of its worker for that store."""

from __future__ import annotations

import shutil
import socket
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest
from conftest import require_etcd, require_postgres
from etcd_cluster import Cluster
from pg_cluster import PgCluster


def _occupy(port: int) -> socket.socket:
    return socket.create_server(("127.0.0.1", port))


@pytest.fixture
def taken() -> Iterator[list[socket.socket]]:
    socks: list[socket.socket] = []
    yield socks
    for s in socks:
        s.close()


def test_an_etcd_cluster_whose_port_was_taken_starts_on_fresh_ones(tmp_path: Path, taken: list[socket.socket]) -> None:
    require_etcd()
    cluster = Cluster(tmp_path)
    first = cluster.members[0].client
    taken.append(_occupy(first))
    try:
        cluster.start_all()
        assert cluster.members[0].client != first
        assert all(m.healthy() for m in cluster.members)
    finally:
        cluster.stop()
    assert b"address already in use" in (tmp_path / "m0.log").read_bytes()  # what it recovered from


def test_a_postgres_server_whose_port_was_taken_starts_on_a_fresh_one(taken: list[socket.socket]) -> None:
    require_postgres()
    cluster = PgCluster(Path(tempfile.mkdtemp(prefix="pearing-pgt-")))
    try:
        cluster.init()
        first = cluster.port
        taken.append(_occupy(first))
        cluster.start()
        assert cluster.port != first and cluster.sql("SELECT 1").strip() == "1"
    finally:
        cluster.stop("immediate")
        shutil.rmtree(cluster.root, ignore_errors=True)
