"""The layers are checked, not hoped for: no import cycles (imports inside functions count),
and the import-linter contracts of pyproject.toml hold."""

from __future__ import annotations

import os
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
