"""The import rules of the source tree (README's architecture): each package depends only on the ones
below it. kernels/ never imports the engine or the server; the engine never imports the server;
models never import the runner, drafters or the step; and no two modules, nor two packages, import
each other, even through others. Imports inside functions count: they are cycles all the same, only
postponed."""

from __future__ import annotations

import ast
from collections import defaultdict
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = ("engine", "kernels", "server", "loadtest")

# (importer prefix, imported prefix) that must never meet
FORBIDDEN = [
    ("kernels", "engine"), ("kernels", "server"), ("kernels", "loadtest"),
    ("engine", "server"), ("engine", "loadtest"),
    ("engine.models", "engine.runner"), ("engine.models", "engine.proposers"),
    ("engine.models", "engine.step"), ("engine.models", "engine.sample"),
    ("engine.models", "engine.core"), ("engine.models", "engine.scheduler"),
    ("engine.sample", "engine.step"), ("engine.sample", "engine.proposers"),
    ("engine.sample", "engine.runner"),
    ("engine.runner", "engine.proposers"), ("engine.runner", "engine.core"),
]


def module_name(path: Path) -> str:
    name = ".".join(path.relative_to(ROOT).with_suffix("").parts)
    return name.removesuffix(".__init__")


def source_modules() -> dict[str, Path]:
    return {module_name(path): path for package in PACKAGES
            for path in sorted((ROOT / package).rglob("*.py"))}


def import_graph() -> dict[str, set[str]]:
    """module -> the modules of the tree it imports (anywhere in its body)."""
    modules = source_modules()
    graph: dict[str, set[str]] = defaultdict(set)
    for name, path in modules.items():
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                targets = [node.module] + [f"{node.module}.{alias.name}" for alias in node.names]
            elif isinstance(node, ast.Import):
                targets = [alias.name for alias in node.names]
            else:
                continue
            graph[name] |= {target for target in targets if target in modules and target != name}
    return graph


def package_of(module: str) -> str:
    """engine.x.y -> engine.x (engine's subpackages and top modules are its parts); else the top."""
    parts = module.split(".")
    return ".".join(parts[:2]) if parts[0] == "engine" and len(parts) > 1 else parts[0]


def within(module: str, prefix: str) -> bool:
    return module == prefix or module.startswith(prefix + ".")


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one node (Tarjan, iteratively)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []
    for root in sorted(graph):
        if root in index:
            continue
        work = [(root, iter(sorted(graph.get(root, ()))))]
        index[root] = low[root] = len(index)
        stack.append(root)
        on_stack.add(root)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = len(index)
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(graph.get(child, ())))))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                component = []
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.append(member)
                    if member == node:
                        break
                if len(component) > 1:
                    found.append(sorted(component))
    return found


@pytest.fixture(scope="module")
def graph() -> dict[str, set[str]]:
    return import_graph()


def test_no_package_imports_one_above_it(graph):
    broken = sorted(f"{importer} imports {imported}"
                    for importer, targets in graph.items() for imported in targets
                    for low, high in FORBIDDEN if within(importer, low) and within(imported, high))
    assert not broken, "\n".join(broken)


def test_no_two_modules_import_each_other(graph):
    assert not cycles(graph), cycles(graph)


def test_no_two_packages_import_each_other(graph):
    packages: dict[str, set[str]] = defaultdict(set)
    for importer, targets in graph.items():
        packages[package_of(importer)] |= {package_of(t) for t in targets} - {package_of(importer)}
    assert not cycles(packages), cycles(packages)


def test_the_rules_catch_a_cycle_and_an_upward_import():
    """The checks themselves: a made-up graph with both faults fails them."""
    made_up = {"kernels.a": {"engine.models.b"}, "engine.models.b": {"engine.runner.c"},
               "engine.runner.c": {"engine.models.b"}}
    assert cycles(made_up) == [["engine.models.b", "engine.runner.c"]]
    assert any(within(importer, low) and within(imported, high)
               for importer, targets in made_up.items() for imported in targets
               for low, high in FORBIDDEN)
