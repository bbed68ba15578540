"""What is about the PostgreSQL backend alone: the masked password, the role that may not
create (77), a corrupt row (74). Run only with PEARING_TEST_POSTGRES=1 (conftest.py)."""

from __future__ import annotations

import uuid

import pytest
from conftest import WITH_POSTGRES
from helpers import PEARING_CLI, Procs, pg_query
from pg_cluster import PgCluster, free_port

from singleflight.core.const import ENV_BACKEND

pytestmark = [
    pytest.mark.postgres,
    pytest.mark.skipif(not WITH_POSTGRES, reason="PEARING_TEST_POSTGRES=1 runs the postgres tests"),
]

BUSY, NOPERM, IOERR = 75, 77, 74


def _tenant(pg: PgCluster) -> str:
    return f"{pg.url}?schema=t_{uuid.uuid4().hex[:12]}"


def test_the_password_is_never_printed(procs: Procs) -> None:
    """A server that cannot be reached: the error names the URL with its password masked."""
    secret = f"s3cret{uuid.uuid4().hex[:8]}"
    procs.env[ENV_BACKEND] = f"postgresql://me:{secret}@127.0.0.1:{free_port()}/db"
    r = procs.pr_run("--job", "J", "--wait-seconds", "0", "--", "true")
    assert r.returncode == BUSY, r
    assert secret not in r.stderr.decode() + r.stdout.decode(), r
    assert "me:***@127.0.0.1" in r.stderr.decode(), r
    bad = procs.pr_run("--backend", f"postgresql://me:{secret}@127.0.0.1:x/db", "--job", "J", "--", "true")
    assert bad.returncode == 64 and secret not in bad.stderr.decode(), bad


def test_a_role_that_may_not_create_gets_77(postgres: PgCluster, procs: Procs) -> None:
    role = f"r{uuid.uuid4().hex[:10]}"
    postgres.sql(f"CREATE ROLE {role} LOGIN")
    procs.env[ENV_BACKEND] = f"postgresql://{role}@127.0.0.1:{postgres.port}/postgres?schema=t_{role}"
    r = procs.pr_run("--job", "J", "--", "true")
    assert r.returncode == NOPERM, r
    assert len(r.err_lines) == 1 and "init-db --print-sql" in r.err_lines[0], r


def test_a_corrupt_row_is_74_naming_table_and_key(postgres: PgCluster, procs: Procs) -> None:
    url = procs.env[ENV_BACKEND] = _tenant(postgres)
    assert procs.pr_run("--job", "J", "--", "true").returncode == 0
    pg_query(url, "UPDATE {s}.locks SET fence = -5 WHERE name = 'J'")
    r = procs.pr_run("--job", "J", "--", "true")
    assert r.returncode == IOERR, r
    assert "table locks key default/J" in r.stderr.decode(), r


def test_init_db_prints_the_ddl_and_a_dba_can_run_it(postgres: PgCluster, procs: Procs) -> None:
    """The DDL a DBA runs for a role that may not create; that role then works without CREATE."""
    role = f"r{uuid.uuid4().hex[:10]}"
    url = f"postgresql://{role}@127.0.0.1:{postgres.port}/postgres?schema=t_{role}"
    printed = procs.run([PEARING_CLI, "--backend", url, "init-db", "--print-sql"])
    assert printed.returncode == 0, printed
    ddl = printed.stdout.decode()
    assert f'CREATE SCHEMA IF NOT EXISTS "t_{role}"' in ddl and "pearing_schema" in ddl, ddl
    postgres.sql(f"CREATE ROLE {role} LOGIN")
    postgres.sql(
        ddl + f'GRANT USAGE ON SCHEMA "t_{role}" TO {role};'
        f'GRANT ALL ON ALL TABLES IN SCHEMA "t_{role}" TO {role};'
        f'GRANT ALL ON ALL SEQUENCES IN SCHEMA "t_{role}" TO {role};'
    )
    procs.env[ENV_BACKEND] = url
    r = procs.pr_run("--job", "J", "--", "true")
    assert r.returncode == 0, r
    local = procs.run([PEARING_CLI, "--backend", "local", "init-db", "--print-sql"])
    assert local.returncode == 64, local
