"""What is about the PostgreSQL backend alone: the masked password, the role that may not
create (77), a corrupt row (74), init-db, and the server's faults (restart, a terminated
connection, SIGSTOP past the lease, a waiter killed with -9) with 0 overlaps and fences only
rising. Left out with PEARING_TEST_POSTGRES=0, skipped without the server (conftest.py).

COMMANDs log "NAME start T" / "NAME end T" (tests/interval_cmd.py, CLOCK_MONOTONIC) and their
fence; "never two COMMANDs" and "fences only rise" are asserted on those."""

from __future__ import annotations

import contextlib
import itertools
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest
from conftest import WITH_POSTGRES, require_postgres
from helpers import PEARING_CLI, Procs, pg_query, proc_state, q, wait_for
from pg_cluster import PGBOUNCER, PgCluster, free_port

from singleflight.core.const import ENV_BACKEND, ENV_FAULT, ENV_METRICS_DIR, ExitCode

pytestmark = [
    pytest.mark.postgres,
    pytest.mark.skipif(not WITH_POSTGRES, reason="PEARING_TEST_POSTGRES=0 leaves the postgres tests out"),
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


def test_the_password_is_in_no_output_of_a_working_run(postgres: PgCluster, procs: Procs, work: Path) -> None:
    """A server that takes the URL (trust auth ignores the password): a verbose run, its metrics
    and status, while held and after, never show the password."""
    secret = f"s3cret{uuid.uuid4().hex[:8]}"
    procs.env[ENV_BACKEND] = f"postgresql://postgres:{secret}@127.0.0.1:{postgres.port}/postgres?schema=t_{secret}"
    procs.env[ENV_METRICS_DIR] = str(work / "metrics")
    gate = work / "go"
    held = procs.pr(
        "-v", "--job", "J", "--", "sh", "-c", f"touch {q(work / 'in')}; while [ ! -e {q(gate)} ]; do sleep 0.05; done"
    )
    wait_for((work / "in").exists, 15, "the run to hold")
    outputs = [procs.run([PEARING_CLI, "status"]), procs.run([PEARING_CLI, "status", "J"])]
    # A CLI ticket's agent (it holds K now, detached) and the run's wrapper and holder: no argv
    # on the host shows the password (any user may read /proc/PID/cmdline).
    agent = procs.run([PEARING_CLI, "acquire-lock", "K", "--request-uuid", str(uuid.uuid4()), "--lease-seconds", "30"])
    outputs.append(agent)
    argvs = []
    for cmdline in Path("/proc").glob("[0-9]*/cmdline"):
        with contextlib.suppress(OSError):
            argvs.append(cmdline.read_bytes())
    assert any(b"singleflight.agent" in a for a in argvs), "the agent is not running"
    assert not [a for a in argvs if secret.encode() in a], "a process's argv shows the password"
    gate.touch()
    outputs.append(procs.finish(held))
    outputs.append(procs.run([PEARING_CLI, "status", "--idle"]))
    assert [r.returncode for r in outputs] == [0, 0, 0, 0, 0], outputs
    shown = b"".join(r.stdout + r.stderr for r in outputs)
    metrics = [f for f in (work / "metrics").rglob("*") if f.is_file()]
    assert metrics, "no metrics written"
    shown += b"".join(f.read_bytes() for f in metrics)
    assert secret.encode() not in shown


def test_without_the_driver_one_line_and_69(procs: Procs, tmp_path: Path) -> None:
    """The postgres extra not installed: one line naming the extra, 69 (a missing part), not 75."""
    fake = tmp_path / "nodriver" / "psycopg"
    fake.mkdir(parents=True)
    (fake / "__init__.py").write_text("raise ImportError('no psycopg here')\n")
    procs.env["PYTHONPATH"] = str(fake.parent)
    procs.env[ENV_BACKEND] = f"postgresql://me@127.0.0.1:{free_port()}/db"
    r = procs.pr_run("--job", "J", "--", "true")
    assert r.returncode == ExitCode.UNAVAILABLE, r
    assert len(r.err_lines) == 1 and "pearing-singleflight[postgres]" in r.err_lines[0], r


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
    # libpq's other spelling names the same backend: the same statements.
    other = procs.run([PEARING_CLI, "--backend", "postgres" + url[len("postgresql") :], "init-db", "--print-sql"])
    assert other.returncode == 0 and other.stdout == printed.stdout, other


# -- faults of the server ---------------------------------------------------------------------

INTERVAL_CMD = str(Path(__file__).with_name("interval_cmd.py"))


@pytest.fixture(scope="module")
def server() -> Iterator[PgCluster]:
    """A cluster of this module's own: its faults (restart, SIGSTOP) reach no other test."""
    require_postgres()
    cluster = PgCluster(Path(tempfile.mkdtemp(prefix="pearing-pgf-")))
    try:
        cluster.init()
        cluster.start()
        yield cluster
    finally:
        cluster.resume()
        cluster.stop("immediate")
        shutil.rmtree(cluster.root, ignore_errors=True)


def contender(
    procs: Procs,
    work: Path,
    name: str,
    *,
    lease: str,
    seconds: float,
    grace: str = "2",
    env: dict[str, str] | None = None,
    until: Path | None = None,
) -> subprocess.Popen[bytes]:
    """A run whose COMMAND logs its fence, then its interval (0.2 s to exit on SIGTERM): ``seconds``
    long, or until the file ``until`` exists (at most ``seconds``)."""
    log, fences = work / "log", work / "fences"
    gate = f" {q(until)}" if until is not None else ""
    script = (
        f"echo {name} $PEARING_FENCE >> {q(fences)}; "
        f"exec {sys.executable} {INTERVAL_CMD} {q(log)} {name} {seconds} 0.2{gate}"
    )
    return procs.pr(
        "--job", "J", "--lease-seconds", lease, "--kill-grace", grace, "--wait-seconds", "60", "--", "sh", "-c", script,
        env=env,
    )  # fmt: skip


def intervals(work: Path) -> dict[str, tuple[float, float | None]]:
    out: dict[str, list[float | None]] = {}
    for line in (work / "log").read_text().splitlines():
        name, what, stamp = line.split()
        out.setdefault(name, [None, None])[0 if what == "start" else 1] = float(stamp)
    return {k: (v[0] or 0.0, v[1]) for k, v in out.items()}


def assert_safe(work: Path) -> list[str]:
    """No two COMMANDs at once, and each later one under a higher fence; the names, in order."""
    spans = intervals(work)
    order = sorted(spans, key=lambda n: spans[n][0])
    for a, b in itertools.pairwise(order):
        end = spans[a][1]
        assert end is not None and end <= spans[b][0], f"{a} {spans[a]} overlaps {b} {spans[b]}"
    fences = dict(line.split() for line in (work / "fences").read_text().splitlines())
    ran = [int(fences[n]) for n in order]
    assert ran == sorted(set(ran)), f"fences not strictly rising in run order: {list(zip(order, ran, strict=True))}"
    return order


def started(work: Path, name: str) -> bool:
    log = work / "log"
    return log.exists() and f"{name} start" in log.read_text()


def waiting(url: str, n: int) -> bool:
    rows = pg_query(url, "SELECT count(*) FROM {s}.tickets WHERE line AND NOT hold")
    return bool(rows and rows[0][0] >= n)


def test_a_server_restart_mid_run(server: PgCluster, procs: Procs, work: Path) -> None:
    url = procs.env[ENV_BACKEND] = _tenant(server)
    # A holds until B and C are in line and the server has restarted (timed, it once ran out
    # before a loaded machine had queued them both).
    a = contender(procs, work, "A", lease="8", seconds=60, until=work / "a.go")
    wait_for(lambda: started(work, "A"), 15, "A to start")
    others = [contender(procs, work, n, lease="8", seconds=0.3) for n in ("B", "C")]
    wait_for(lambda: waiting(url, 2), 15, "B and C to queue")
    server.stop("fast")
    server.start()
    (work / "a.go").touch()
    assert procs.finish(a, timeout=60).returncode == 0
    codes = [procs.finish(p, timeout=60).returncode for p in others]
    assert set(codes) <= {0, BUSY}, codes  # a waiter whose place lapsed while the server was down leaves busy
    assert assert_safe(work)[0] == "A"


def test_a_failover_to_a_synchronous_standby_never_reissues_a_fence(procs: Procs, work: Path) -> None:
    """The primary crashes (an immediate stop: no checkpoint) after runs that committed their
    fences, and its synchronous standby is promoted: the next run there gets a higher fence, never
    one the primary gave. (A commit returns only once the standby has it: the promotion's fence.)"""
    require_postgres()
    primary = PgCluster(Path(tempfile.mkdtemp(prefix="pearing-pgp-")))
    standby = PgCluster(Path(tempfile.mkdtemp(prefix="pearing-pgs-")))
    try:
        primary.init()
        primary.start("synchronous_standby_names='*'")
        standby.standby_of(primary)
        standby.start()
        wait_for(lambda: "sync" in primary.sql("SELECT sync_state FROM pg_stat_replication"), 30, "a sync standby")
        schema = f"t_{uuid.uuid4().hex[:12]}"
        fences = work / "fences"
        for _ in range(3):
            procs.env[ENV_BACKEND] = f"{primary.url}?schema={schema}"
            r = procs.pr_run("--job", "J", "--", "sh", "-c", f"echo $PEARING_FENCE >> {q(fences)}")
            assert r.returncode == 0, r
        primary.stop("immediate")
        standby.promote()
        procs.env[ENV_BACKEND] = f"{standby.url}?schema={schema}"
        r = procs.pr_run("--job", "J", "--", "sh", "-c", f"echo $PEARING_FENCE >> {q(fences)}")
        assert r.returncode == 0, r
        assert [int(f) for f in fences.read_text().split()] == [1, 2, 3, 4]
    finally:
        for cluster in (standby, primary):
            cluster.stop("immediate")
            shutil.rmtree(cluster.root, ignore_errors=True)


def test_the_holders_connection_terminated(server: PgCluster, procs: Procs, work: Path) -> None:
    """Every pearing connection, the holder's among them, terminated by the server mid-run."""
    url = procs.env[ENV_BACKEND] = _tenant(server)
    a = contender(procs, work, "A", lease="6", seconds=3)
    wait_for(lambda: started(work, "A"), 15, "A to start")
    b = contender(procs, work, "B", lease="6", seconds=0.3)
    wait_for(lambda: waiting(url, 1), 15, "B to queue")
    server.sql("SELECT pg_terminate_backend(pid) FROM pg_stat_activity WHERE application_name = 'pearing'")
    assert procs.finish(a, timeout=60).returncode == 0
    assert procs.finish(b, timeout=60).returncode == 0
    assert assert_safe(work) == ["A", "B"]


def test_a_waiters_connection_terminated_as_it_joins(server: PgCluster, procs: Procs, work: Path) -> None:
    """Every pearing connection terminated right after the waiter joined the line, before its
    wait's first request (``pause-queued``): that request meets the dropped connection, which is
    opened again, and the wait goes on (it once exited 75, "unreachable: terminating connection
    due to administrator command", under load, where that window is wide)."""
    procs.env[ENV_BACKEND] = _tenant(server)
    a = contender(procs, work, "A", lease="6", seconds=3)
    wait_for(lambda: started(work, "A"), 15, "A to start")
    b = contender(procs, work, "B", lease="6", seconds=0.3, env={**procs.env, ENV_FAULT: "pause-queued"})
    wait_for(lambda: proc_state(b.pid) == "T", 15, "B to stop just in line")
    server.sql("SELECT pg_terminate_backend(pid) FROM pg_stat_activity WHERE application_name = 'pearing'")
    os.kill(b.pid, signal.SIGCONT)
    assert procs.finish(a, timeout=60).returncode == 0
    rb = procs.finish(b, timeout=60)
    assert rb.returncode == 0, rb
    assert assert_safe(work) == ["A", "B"]


def test_a_waiter_frozen_inside_its_transaction_holds_up_the_line_seconds_at_most(
    server: PgCluster, procs: Procs, work: Path
) -> None:
    """SIGSTOP of a waiter inside the transaction that joins it to the line, where it holds the
    lock's row (``pause-in-mutex``): every other arrival at that lock waits for that row. The
    server ends a session idle in a transaction that long, so the next arrival joins and runs
    after the holder; the frozen one, resumed, finds its transaction gone and never runs beside.
    (It once held the line for as long as it stayed frozen: a nemesis round caught it.)"""
    url = procs.env[ENV_BACKEND] = _tenant(server)
    a = contender(procs, work, "A", lease="6", seconds=60, until=work / "a.go")
    wait_for(lambda: started(work, "A"), 15, "A to start")
    b = contender(procs, work, "B", lease="6", seconds=0.3, env={**procs.env, ENV_FAULT: "pause-in-mutex"})
    wait_for(lambda: proc_state(b.pid) == "T", 15, "B to stop inside its join")
    c = contender(procs, work, "C", lease="6", seconds=0.3)
    wait_for(lambda: waiting(url, 1), 15, "C to join the line past the frozen B")
    (work / "a.go").touch()
    assert procs.finish(a, timeout=60).returncode == 0
    assert procs.finish(c, timeout=60).returncode == 0
    os.kill(b.pid, signal.SIGCONT)
    assert procs.finish(b, timeout=60).returncode in (0, BUSY)
    assert assert_safe(work)[:2] == ["A", "C"]


def test_the_server_stopped_past_the_lease(server: PgCluster, procs: Procs, work: Path) -> None:
    """SIGSTOP longer than the lease: the holder gives up on its own clock and stops COMMAND
    before the server, resumed, can promote the next; that one runs after it."""
    url = procs.env[ENV_BACKEND] = _tenant(server)
    a = contender(procs, work, "A", lease="3", grace="0.5", seconds=30)
    wait_for(lambda: started(work, "A"), 15, "A to start")
    b = contender(procs, work, "B", lease="3", seconds=0.3)
    wait_for(lambda: waiting(url, 1), 15, "B to queue")
    server.pause()
    try:
        assert procs.finish(a, timeout=30).returncode == ExitCode.LEASE_LOST
    finally:
        server.resume()
    assert procs.finish(b, timeout=60).returncode in (0, BUSY)
    order = assert_safe(work)
    assert order[0] == "A", order


def test_a_waiter_killed_with_minus_9(server: PgCluster, procs: Procs, work: Path) -> None:
    """A killed waiter stops blocking within 5 s: the one behind it runs soon after the holder."""
    url = procs.env[ENV_BACKEND] = _tenant(server)
    # A holds until B and C are in line and B is dead (timed, its 1.5 s once ran out on a loaded
    # machine before C had queued: B held, and C never had two ahead of it).
    a = contender(procs, work, "A", lease="6", seconds=60, until=work / "a.go")
    wait_for(lambda: started(work, "A"), 15, "A to start")
    b = contender(procs, work, "B", lease="6", seconds=0.3)
    wait_for(lambda: waiting(url, 1), 15, "B to queue")
    c = contender(procs, work, "C", lease="6", seconds=0.3)
    wait_for(lambda: waiting(url, 2), 15, "C to queue")
    with contextlib.suppress(ProcessLookupError):
        b.send_signal(signal.SIGKILL)
    procs.finish(b, timeout=10)
    (work / "a.go").touch()
    assert procs.finish(a, timeout=60).returncode == 0
    assert procs.finish(c, timeout=60).returncode == 0
    spans = intervals(work)
    assert "B" not in spans
    end_a = spans["A"][1]
    assert end_a is not None and spans["C"][0] - end_a < 5.0, spans
    assert assert_safe(work) == ["A", "C"]


# -- a pooler in transaction mode -------------------------------------------------------------


@pytest.fixture(scope="module")
def bouncer(server: PgCluster) -> Iterator[int]:
    """PgBouncer in transaction mode in front of the module's server; its port."""
    if PGBOUNCER is None:
        pytest.skip("pgbouncer not installed")
    port = free_port()
    root = Path(tempfile.mkdtemp(prefix="pearing-pgb-"))
    ini = root / "pgbouncer.ini"
    ini.write_text(
        f"[databases]\npostgres = host=127.0.0.1 port={server.port} dbname=postgres\n"
        f"[pgbouncer]\nlisten_addr = 127.0.0.1\nlisten_port = {port}\nunix_socket_dir =\n"
        "auth_type = trust\npool_mode = transaction\nmax_client_conn = 200\ndefault_pool_size = 20\n"
        f"auth_file = {root / 'users.txt'}\nlogfile = {root / 'log'}\npidfile = {root / 'pid'}\n"
    )
    (root / "users.txt").write_text('"postgres" ""\n')
    owner = []
    if os.geteuid() == 0:  # pgbouncer refuses to run as root
        for f in (root, *root.iterdir()):
            shutil.chown(f, "postgres", "postgres")
        owner = ["runuser", "-u", "postgres", "--"]
    proc = subprocess.Popen([*owner, PGBOUNCER, str(ini)], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        wait_for(
            lambda: "listening on" in ((root / "log").read_text() if (root / "log").exists() else ""), 15, "pgbouncer"
        )
        yield port
    finally:
        proc.terminate()
        proc.wait(timeout=10)
        shutil.rmtree(root, ignore_errors=True)


@pytest.mark.parametrize("listen", ["0", "1"])
def test_through_pgbouncer_in_transaction_mode(bouncer: int, procs: Procs, work: Path, listen: str) -> None:
    """listen=0: waiters poll instead of LISTEN (the pooler keeps no session); no advisory lock
    and nothing else of a session is relied on, so hand-overs work through it. Left at LISTEN
    by mistake, a waiter still looks every second: slower hand-overs, never a stuck line."""
    procs.env[ENV_BACKEND] = (
        f"postgresql://postgres@127.0.0.1:{bouncer}/postgres?schema=t_{uuid.uuid4().hex[:12]}&listen={listen}"
    )
    runs = [contender(procs, work, n, lease="6", seconds=0.3) for n in ("A", "B", "C", "D")]
    assert [procs.finish(p, timeout=60).returncode for p in runs] == [0, 0, 0, 0]
    assert sorted(assert_safe(work)) == ["A", "B", "C", "D"]
