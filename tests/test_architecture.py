"""The layers are checked, not hoped for: no import cycles (imports inside functions count),
the import-linter contracts of pyproject.toml hold, and tests ask for capabilities, not backend names."""

from __future__ import annotations

import ast
import os
import re
import subprocess
import sys
from pathlib import Path

import grimp

ROOT = Path(__file__).resolve().parent.parent


def _cycles(graph: grimp.ImportGraph) -> list[list[str]]:
    """Every strongly connected group of more than one module (Tarjan), as sorted lists."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    out: list[list[str]] = []
    counter = 0

    def visit(v: str) -> None:
        nonlocal counter
        index[v] = low[v] = counter
        counter += 1
        stack.append(v)
        on_stack.add(v)
        for w in graph.find_modules_directly_imported_by(v):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            group = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                group.append(w)
                if w == v:
                    break
            if len(group) > 1:
                out.append(sorted(group))

    for module in sorted(graph.modules):
        if module not in index:
            visit(module)
    return out


def test_no_import_cycles_counting_imports_inside_functions() -> None:
    graph = grimp.build_graph("singleflight")
    assert _cycles(graph) == []
    # The checker sees function-level imports at all (runner imports bootstrap, which forks the
    # holder, only inside a function): otherwise this test could never fail.
    assert graph.direct_import_exists(importer="singleflight.runner", imported="singleflight.bootstrap")


def test_cycle_finder_finds_a_cycle() -> None:
    graph = grimp.ImportGraph()
    for m in ("p", "p.a", "p.b", "p.c"):
        graph.add_module(m)
    graph.add_import(importer="p.a", imported="p.b")
    graph.add_import(importer="p.b", imported="p.a")
    graph.add_import(importer="p.c", imported="p.a")
    assert _cycles(graph) == [["p.a", "p.b"]]


def test_import_linter_contracts_hold() -> None:
    lint = Path(sys.executable).with_name("lint-imports")
    r = subprocess.run([str(lint)], cwd=ROOT, capture_output=True, text=True, env=dict(os.environ), check=False)
    assert r.returncode == 0, r.stdout + r.stderr
    assert "2 kept, 0 broken" in r.stdout


def test_backends_import_neither_each_other_nor_anything_above() -> None:
    graph = grimp.build_graph("singleflight")
    for low, forbidden in (
        ("singleflight.local", ("singleflight.etcd", "singleflight.backend", "singleflight.runner")),
        ("singleflight.etcd", ("singleflight.local", "singleflight.backend", "singleflight.runner")),
        ("singleflight.core", ("singleflight.local", "singleflight.etcd", "singleflight.backend")),
    ):
        for f in forbidden:
            assert not graph.chain_exists(importer=low, imported=f, as_packages=True), f"{low} reaches {f}"


# -- tests ask for capabilities (tests/caps.py), not for the backend's name ------------------------

TESTS = ROOT / "tests"
# The one table that maps a name to its capabilities.
CAPS_TABLE = TESTS / "caps.py"
_BACKEND_NAMES = frozenset({"local", "etcd", "postgres", "postgresql"})
_BACKEND_URL = re.compile(r"(local|etcd|postgres(ql)?)(:.*)?", re.DOTALL)


def _is_backend(node: ast.expr) -> bool:
    return (isinstance(node, ast.Name) and node.id == "backend") or (
        isinstance(node, ast.Attribute) and node.attr == "backend"
    )


def _builds_the_backend(node: ast.AST) -> bool:
    """A ``backend`` fixture: it turns the parameter's name into a URL, so it may compare it."""
    return (
        isinstance(node, ast.FunctionDef)
        and node.name == "backend"
        and any("fixture" in ast.unparse(d) for d in node.decorator_list)
    )


def backend_name_checks(source: str) -> list[int]:
    """Lines of ``source`` that compare a backend's name (``backend == "local"``, ``name != "etcd"``,
    ``"local" in backend``, ``url.startswith("etcd")``) outside a ``backend`` fixture."""
    tree = ast.parse(source)
    exempt = {
        line
        for node in ast.walk(tree)
        if _builds_the_backend(node)
        for line in range(node.lineno, (node.end_lineno or node.lineno) + 1)
    }
    found = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Compare):
            operands = [node.left, *node.comparators]
            strings = [o.value for o in operands if isinstance(o, ast.Constant) and isinstance(o.value, str)]
            if (strings and any(_is_backend(o) for o in operands)) or _BACKEND_NAMES.intersection(strings):
                found.add(node.lineno)
        elif (
            isinstance(node, ast.Call)
            and isinstance(node.func, ast.Attribute)
            and node.func.attr in ("startswith", "endswith")
            and any(
                isinstance(a, ast.Constant) and isinstance(a.value, str) and _BACKEND_URL.fullmatch(a.value)
                for a in node.args
            )
        ):
            found.add(node.lineno)
    return sorted(found - exempt)


def test_tests_ask_for_capabilities_not_backend_names() -> None:
    """A third backend must run the suite unchanged: a test that expects something different on
    one backend branches on a property from tests/caps.py (``caps.contiguous_fences``)."""
    offenders = [
        f"{path.relative_to(ROOT)}:{line}: {path.read_text().splitlines()[line - 1].strip()}"
        for path in sorted(TESTS.glob("*.py"))
        if path != CAPS_TABLE
        for line in backend_name_checks(path.read_text())
    ]
    assert offenders == [], "compare a capability (tests/caps.py), not the backend's name:\n" + "\n".join(offenders)


def test_backend_name_checks_are_found() -> None:
    source = """
import pytest

@pytest.fixture
def backend(request):
    if request.param == "local":
        return "local"

def a(backend):
    assert backend != "local" or fence == 1

class N:
    def b(self, name):
        x = 1 if self.backend == "local" else 2
        if name == "etcd":
            pass
        if "local" in backend or url.startswith("etcd://"):
            pass
        ok = identity.startswith("etcd-lease:") and caps.contiguous_fences
"""
    assert backend_name_checks(source) == [10, 14, 15, 17]


def _interface_members() -> dict[str, list[str]]:
    """Every member (method, property, annotated attribute) of the Protocols backends implement."""
    tree = ast.parse((Path(__file__).parents[1] / "singleflight" / "backend.py").read_text())
    out = {}
    for node in tree.body:
        if isinstance(node, ast.ClassDef) and any(getattr(b, "id", None) == "Protocol" for b in node.bases):
            out[node.name] = [
                item.name if isinstance(item, ast.FunctionDef) else item.target.id  # type: ignore[union-attr]
                for item in node.body
                if isinstance(item, ast.FunctionDef) or (isinstance(item, ast.AnnAssign) and hasattr(item.target, "id"))
            ]
    return out


# The backend interface only shrinks from here (the goal is 25: rules above, store primitives
# below). Print it with: pytest -q -s tests/test_architecture.py -k interface
# 54: a lock's records are three store primitives (read, compare-and-set, prepare); what they
# hold and when a claim stands are rules/requests.py's; a waiting ticket's deadline is read from
# the ticket (rules/tickets.py); whether a grip can be handed over by message is in the scheme table;
# a heartbeat and a cancel request are rules over a ticket's compare-and-set (update) and a poke.
# 53: token files are the host's (core.tokens.TokenFiles.at), not the store's.
# 52: housekeeping is the end of release, after its owner heard the lock is free.
# 51: a waiter's position is read off the line (Line.position), as status reads it.
# 48: records are the backend's, by key (core.request.Key): a lock's, an identity's activity, a
# resource's fence; the activity record and the fence ledger's rule are rules/records.py's.
# 47: a holder forked before its grip existed hands ``take`` what the grip's ``handover`` said.
# 46: an agent adopts its ticket by compare-and-set of its pid (rules.tickets.adopt).
# 47: pearing-cli prune removes an idle lock's state (Backend.prune): only the store can shut out
# the lock's acquirers while it judges and removes (the lock dir: its flocks, each owner checking
# it locked the file its name still means; etcd: one transaction on the revision it judged).
# Which locks go is rules/prune.py's.
# 46: a grip's fds are part of what ``handover`` says (a holder forked with the grip keeps them;
# one forked before gets both over its socketpair): one member, not two.
# 45: pearing-guard asks the store one thing (``Backend.guard``): what it knows of a claimed
# ticket, read with or without a hold on its expiry and hand-over.
# 44: whether nobody on this host is left to keep a ticket's lock is read off the ticket
# (``Ticket.orphaned``): its holder's and, where a store records one, its owner's pid.
# 43: an arrival is given the lock itself or a place to queue from (``enter``), not a place
# that may hold the lock.
# 41: a lock's scope and name are its caller's (it opened it by them): the rules read them off
# the ticket at hand (records, token files) or are given them (a lock's status).
# 40: telling a holder to look now is a signal to its exact pid on this host (``Ticket.poke``),
# not a store's: three copies of the same four lines.
# 39: making a ticket's process let go (``rules.tickets.stop``) is a rule over ``end``: a waiter
# leaves the line (the store wakes it), a settled holder here is poked, one elsewhere or still
# settling is waited out of the line; three copies that had drifted (who is poked, and when).
# 38: the holders a newcomer may ask to stop are read off the line (rules.events.holders).
# 37: a grip's keep says when it is next due (and sends nothing before): no ``keep_every``.
# 35: a backend's URL and lock dir are its opener's (``Opened``: what the seed's commands and the
# holder are given), not something a store publishes.
# 34: a retried request waits for its ticket's turn by a rule over ``read`` and ``line``
# (rules.tickets.await_turn): three copies of "until promoted, then while its agent settles".
# 33: a cancel-in-progress request is judged by the rule (rules.events.act) and acted on by a
# judged ``Lease.end``: the store drains guarded commands and ends the ticket in one step if the
# judgement gives a reason; no ``LockOps.end_superseded`` (a use-case, in three stores).
_INTERFACE_CEILING = 33


def test_the_backend_interface_does_not_grow() -> None:
    members = _interface_members()
    total = sum(len(v) for v in members.values())
    print(f"backend interface: {total} members", {k: len(v) for k, v in members.items()})
    assert {"Grip", "Place", "Lease", "LockOps", "Backend"} <= members.keys(), members
    assert total <= _INTERFACE_CEILING, members


def test_pearing_runs_path_does_not_load_dataclasses() -> None:
    """``dataclasses`` pulls in ``inspect`` (about 10 ms): every pearing-run would pay it. A
    module of the acquire path once used it for one small record."""
    code = "import sys, singleflight.cli.run, singleflight.runner; print('dataclasses' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False", out


# Past these sizes a module or a class is doing more than one thing (the sizes issue 21 set).
MAX_MODULE_LINES, MAX_CLASS_LINES = 400, 250


def _oversized(root: Path) -> list[str]:
    out = []
    for path in sorted(root.rglob("*.py")):
        text = path.read_text()
        if (n := len(text.splitlines())) > MAX_MODULE_LINES:
            out.append(f"{path.relative_to(root.parent)}: module of {n} lines")
        for node in ast.walk(ast.parse(text)):
            if isinstance(node, ast.ClassDef) and (n := (node.end_lineno or 0) - node.lineno + 1) > MAX_CLASS_LINES:
                out.append(f"{path.relative_to(root.parent)}: class {node.name} of {n} lines")
    return out


def test_no_module_over_400_lines_and_no_class_over_250() -> None:
    assert _oversized(ROOT / "singleflight") == []


def test_oversized_modules_and_classes_are_found(tmp_path: Path) -> None:
    pkg = tmp_path / "pkg"
    pkg.mkdir()
    (pkg / "big.py").write_text("x = 1\n" * 401)
    (pkg / "cls.py").write_text("class C:\n" + "    x = 1\n" * 250 + "class D:\n    pass\n")
    assert _oversized(pkg) == ["pkg/big.py: module of 401 lines", "pkg/cls.py: class C of 251 lines"]


def test_pearing_guards_path_loads_neither_subprocess_nor_sqlite() -> None:
    """``pearing-guard verify`` is on every guarded write: git-push's ``subprocess`` and the thread
    service's ``sqlite3`` load only when those commands run (git-push was imported at the top
    once, about 15 ms on every verify)."""
    code = "import sys, singleflight.cli.guard; print(sorted({'subprocess', 'sqlite3', 'random'} & set(sys.modules)))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]", out


# What implements each Protocol: the scheme table names only the backends' classes, so mypy
# (``backend_class()`` is Any) cannot see a member that a backend lacks.
_IMPLEMENTATIONS = {
    "Backend": (
        "singleflight.local.backend:LocalBackend",
        "singleflight.etcd.backend:EtcdBackend",
        "singleflight.postgres.backend:PgBackend",
    ),
    "LockOps": (
        "singleflight.local.backend:LocalLock",
        "singleflight.etcd.backend:EtcdLock",
        "singleflight.postgres.backend:PgLock",
    ),
    "Lease": (
        "singleflight.local.backend:LocalLease",
        "singleflight.etcd.lease:EtcdLease",
        "singleflight.postgres.lease:PgLease",
    ),
    "Place": (
        "singleflight.local.place:LocalPlace",
        "singleflight.etcd.place:EtcdPlace",
        "singleflight.postgres.place:PgPlace",
    ),
    "Grip": (
        "singleflight.local.place:FlockGrip",
        "singleflight.etcd.grip:EtcdGrip",
        "singleflight.postgres.place:PgGrip",
    ),
}


def _has(cls: type, member: str) -> bool:
    """A method or property of the class (or its bases), or an attribute its code sets."""
    import inspect

    if hasattr(cls, member):
        return True
    return any(f"self.{member}" in inspect.getsource(c) for c in cls.__mro__ if c.__module__ != "builtins")


def test_every_backend_implements_every_member_of_the_interface() -> None:
    import importlib

    members = _interface_members()
    assert members.keys() == _IMPLEMENTATIONS.keys(), "a Protocol without its implementations listed here"
    missing = []
    for protocol, names in members.items():
        for where in _IMPLEMENTATIONS[protocol]:
            module, _, name = where.partition(":")
            cls = getattr(importlib.import_module(module), name)
            missing += [f"{name}.{m} ({protocol})" for m in names if not _has(cls, m)]
    assert not missing, missing


class _Partial:
    def __init__(self) -> None:
        self.lock = "J"

    def read(self) -> None: ...


def test_a_missing_member_is_found() -> None:
    assert _has(_Partial, "read") and _has(_Partial, "lock")
    assert not _has(_Partial, "update")
