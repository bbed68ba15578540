"""Fixtures: a private lock dir, the environment for pearing-run, and a process reaper."""

from __future__ import annotations

import compileall
import os
import shutil
import signal
import tempfile
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest
from caps import Caps, caps_of
from etcd_cluster import ETCD, Cluster
from helpers import MARKER_VAR, Procs, signal_sets
from hostile_peer import HostilePeer
from pg_cluster import BIN as PG_BIN
from pg_cluster import PgCluster

from singleflight.core.const import ENV_BACKEND, ENV_FAULT, ENV_LOCK_DIR


@pytest.fixture
def lock_dir(tmp_path: Path) -> Path:
    """This test's lock dir; it does not exist until pearing-run creates it."""
    return tmp_path / "lockdir"


@pytest.fixture
def work(tmp_path: Path) -> Path:
    """Where COMMANDs write their marker and gate files."""
    d = tmp_path / "work"
    d.mkdir()
    return d


@pytest.fixture
def env(lock_dir: Path) -> dict[str, str]:
    """os.environ with PEARING_LOCK_DIR set to this test's lock dir and no fault injection.

    Any other PEARING_* variable (a test run from inside a pearing-run COMMAND) is
    dropped too, so nothing leaks in from the caller.
    """
    e = {k: v for k, v in os.environ.items() if not k.startswith("PEARING_")}
    e.pop(ENV_FAULT, None)
    e[ENV_LOCK_DIR] = str(lock_dir)
    e[MARKER_VAR] = uuid.uuid4().hex
    return e


@pytest.fixture
def procs(env: dict[str, str], tmp_path: Path, lock_dir: Path) -> Iterator[Procs]:
    """Start processes through this; at teardown every one still alive is killed and reaped,
    with COMMAND's process group, its children and the detached holder."""
    p = Procs(env, tmp_path, lock_dir)
    try:
        yield p
    finally:
        p.cleanup()


@pytest.fixture
def work_procs(procs: Procs, work: Path) -> Procs:
    """``procs``, starting every process in ``work``: a COMMAND's relative files land there."""
    procs.cwd = work
    return procs


# The processes a test starts find the terminal signals at their defaults, however the suite was
# started: from a shell's background job (no job control) SIGINT and SIGQUIT come ignored, under
# nohup SIGHUP, and a process keeps an ignored signal ignored (pearing-run too, by design).
signal.signal(signal.SIGINT, signal.default_int_handler)
for _sig in (signal.SIGQUIT, signal.SIGHUP):
    if signal.getsignal(_sig) == signal.SIG_IGN:
        signal.signal(_sig, signal.SIG_DFL)

# What every process a test starts inherits from the worker: an ignored signal, a blocked one.
_INHERITED = (
    signal.SIGINT,
    signal.SIGQUIT,
    signal.SIGTERM,
    signal.SIGHUP,
    signal.SIGTSTP,
    signal.SIGTTIN,
    signal.SIGTTOU,
    signal.SIGPIPE,
    signal.SIGCHLD,
    signal.SIGUSR1,
    signal.SIGUSR2,
    signal.SIGALRM,
)


def _ignored_here() -> int:
    """This process's ignored signals, as the kernel has them (C code may set them behind Python's back)."""
    return signal_sets(Path("/proc/self/status").read_text())["SigIgn"]


@pytest.fixture(autouse=True)
def signals_left_as_found() -> Iterator[None]:
    """A test must leave the worker's signal dispositions and mask as it found them: every later
    test's processes inherit them (an ignored SIGINT, inherited, makes a Python child deaf to
    ^C). Restored, and the test fails naming them."""
    before = {sig: signal.getsignal(sig) for sig in _INHERITED}
    mask = signal.pthread_sigmask(signal.SIG_BLOCK, [])
    ignored = _ignored_here()  # as the kernel has it: C code may change it behind Python's back
    yield
    changed = [sig.name for sig in _INHERITED if signal.getsignal(sig) != before[sig]]
    if _ignored_here() != ignored:
        changed.append(f"the ignored set (SigIgn {ignored:#x} -> {_ignored_here():#x})")
    for sig in _INHERITED:
        if signal.getsignal(sig) != before[sig] and before[sig] is not None:
            signal.signal(sig, before[sig])
    if signal.pthread_sigmask(signal.SIG_SETMASK, mask) != mask:
        changed.append("the signal mask")
    if changed:
        pytest.fail(f"the test left the worker's signals changed: {', '.join(changed)}")


def require_etcd() -> None:
    """Skip where etcd is not installed, except under CI (CI=true), where .ci/run installs
    Debian's etcd-server and a skip would hide the suite."""
    if ETCD is None:
        if os.environ.get("CI") == "true":
            pytest.fail("etcd is not installed but CI=true: .ci/run must install etcd-server")
        pytest.skip("etcd not installed (apt-get install etcd-server)")


@pytest.fixture(scope="session")
def etcd(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:
    """A real 3-member etcd cluster on loopback, for the whole session (``require_etcd``)."""
    require_etcd()
    cluster = Cluster(tmp_path_factory.mktemp("etcd"))
    cluster.start_all()
    try:
        yield cluster
    finally:
        cluster.stop()


# The postgres half of ``backend`` runs where PostgreSQL's server is installed (skipped elsewhere,
# failed under CI), as etcd's does; PEARING_TEST_POSTGRES=0 leaves it out (a quicker local run).
WITH_POSTGRES = os.environ.get("PEARING_TEST_POSTGRES", "1") != "0"


def require_postgres() -> None:
    """Skip where the server is not installed, except under CI (CI=true), where .ci/run installs
    Debian's postgresql and a skip would hide the postgres half."""
    if PG_BIN is None:
        if os.environ.get("CI") == "true":
            pytest.fail("postgresql is not installed but CI=true: .ci/run must install postgresql")
        pytest.skip("postgresql not installed (apt-get install postgresql)")


@pytest.fixture(scope="session")
def postgres() -> Iterator[PgCluster]:
    """A throwaway PostgreSQL cluster on loopback, for the whole session (``pg_cluster``)."""
    require_postgres()
    # Not under pytest's temp dir: that one is private to us, and the server runs as ``postgres``.
    cluster = PgCluster(Path(tempfile.mkdtemp(prefix="pearing-pg-")))
    try:
        cluster.init()
        cluster.start()
        yield cluster
    finally:
        cluster.stop("immediate")
        shutil.rmtree(cluster.root, ignore_errors=True)


@pytest.fixture
def job() -> str:
    """A lock name of its own under the default tenant: the session's cluster is shared (and
    etcdctl names a queue by its path)."""
    return f"job-{uuid.uuid4().hex[:12]}"


@pytest.fixture
def on_etcd(etcd: Cluster, procs: Procs) -> str:
    """Every process of the test talks to the session's cluster."""
    procs.env[ENV_BACKEND] = etcd.url
    return etcd.url


def pytest_configure(config: pytest.Config) -> None:
    # The suite starts thousands of interpreters on the package. Where PYTHONDONTWRITEBYTECODE is
    # set (as on the CI machine) no import writes a .pyc, so each of them compiled every module
    # from source until some test happened to write them: a CI run spent half its CPU that way
    # (pytest 579 s against 383 s). Compiled here once, as a regular install compiles at install.
    # (The helper scripts tests start, which import this directory's modules, likewise.) A strict
    # editable install imports the package through a tree of links (build/), whose __pycache__
    # is its own: compiled there too, as imported.
    import singleflight

    root = Path(__file__).resolve().parent.parent
    for tree in {root / "singleflight", Path(singleflight.__file__).parent, root / "tests"}:
        compileall.compile_dir(str(tree), quiet=1)
    config.addinivalue_line("markers", "etcd: runs against the real etcd cluster (the etcd half of `backend`)")
    config.addinivalue_line(
        "markers", "postgres: runs against a real PostgreSQL server (the postgres half of `backend`)"
    )
    config.addinivalue_line(
        "markers",
        "local_only(reason): runs on the lock dir only, for the reason given (what it asserts that only "
        "the lock dir has); every other behaviour test takes `backend` and runs on both",
    )
    config.addinivalue_line(
        "markers",
        "etcd_xfail(reason): a known product difference from the lock dir: the test's etcd half of "
        "`backend` is a strict xfail, so it fails loudly once the product is fixed",
    )


# The suite's longest tests (9 s to 40 s each on 2 cores, pytest --durations), run first and
# longest first: xdist deals the first quarter of the items round robin, so they start at once
# on every worker instead of one of them starting last and running alone at the end.
_LONG = (
    "test_install.py::",
    "test_bench.py::",
    "test_nemesis.py::test_nemesis[",
    "test_cli_fast.py::test_the_fast_path_reads",
    "test_metrics_busy.py::test_a_metrics_lock_held_past",
    "test_mcp_progress.py::test_a_wait_that_runs_out",
    "test_nemesis.py::test_group_kill_mid_guarded_write",
    "test_etcd_faults.py::test_a_heartbeat_within",
    "test_storm.py::",
    "test_slots_storm.py::",
    "test_hardening.py::test_same_uuid_retries",
    "test_hardening.py::test_a_holder_frozen_before_it_is_ready",
    "test_cancel_work.py::test_a_newcomer_whose_wait_runs_out_during",
    "test_cancel_work.py::test_a_cancel_whose_newcomer_was_killed",
    "test_cli.py::test_heartbeat_keeps_a_waiting_ticket",
)


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """local_only and etcd_xfail say why; local_only never asks for both backends, etcd_xfail always
    does. The longest tests go first (``_LONG``)."""
    items.sort(
        key=lambda item: next((i for i, long in enumerate(_LONG) if f"/{long}" in f"/{item.nodeid}"), len(_LONG))
    )
    for item in items:
        both = "backend" in getattr(item, "fixturenames", ())
        for name, wants_both in (("local_only", False), ("etcd_xfail", True)):
            marker = item.get_closest_marker(name)
            if marker is None:
                continue
            reason = marker.args[0] if marker.args else None
            if not isinstance(reason, str) or not reason.strip():
                raise pytest.UsageError(f"{item.nodeid}: @pytest.mark.{name} needs a reason")
            if both != wants_both:
                raise pytest.UsageError(f"{item.nodeid}: @pytest.mark.{name} and the `backend` fixture disagree")


_BACKENDS = ["local", pytest.param("etcd", marks=pytest.mark.etcd)]
if WITH_POSTGRES:
    _BACKENDS.append(pytest.param("postgres", marks=pytest.mark.postgres))


@pytest.fixture(params=_BACKENDS)
def backend(request: pytest.FixtureRequest, env: dict[str, str]) -> str:
    """Run a test on both backends: the same contract on either.

    On etcd every test gets a tenant prefix of its own (``etcd://.../t-HEX``), so
    lock names never meet another test's on the session's shared cluster. The
    commands a test starts with ``env`` use it through PEARING_BACKEND.
    """
    if request.param == "local":
        env.pop(ENV_BACKEND, None)
        return "local"
    if request.param == "postgres":
        pg: PgCluster = request.getfixturevalue("postgres")
        env[ENV_BACKEND] = f"{pg.url}?schema=t_{uuid.uuid4().hex[:12]}"  # a tenant of its own
        return env[ENV_BACKEND]
    known = request.node.get_closest_marker("etcd_xfail")
    if known is not None:
        request.applymarker(pytest.mark.xfail(strict=True, reason=f"etcd: {known.args[0]}"))
    cluster: Cluster = request.getfixturevalue("etcd")
    url = f"{cluster.url}/t-{uuid.uuid4().hex[:12]}"
    env[ENV_BACKEND] = url
    return url


@pytest.fixture
def caps(backend: str) -> Caps:
    """What the current ``backend`` can do: a test that expects something different on one
    backend asks for the property (tests/caps.py), never for the backend's name."""
    return caps_of(backend)


@pytest.fixture
def peer() -> Iterator[HostilePeer]:
    """A hostile HTTP peer on loopback (``hostile_peer``), stopped at teardown."""
    p = HostilePeer()
    try:
        yield p
    finally:
        p.stop()
