"""The import graph of ``vecstore/``, ``attention/`` and ``integrations/`` points one way.

Every ``.py`` file is parsed (never imported) and every import statement counts: at module
level, inside functions, and under ``if TYPE_CHECKING:``. The graph must have no cycle, and
no module may import one of a higher layer than its own (:data:`LAYERS`).
"""

from __future__ import annotations

import ast
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = ("vecstore", "attention", "integrations")

LAYERS: dict[str, float] = {
    # foundations: errors, shared records, checks, configuration, the plug-in registry
    "vecstore.errors": 0,
    "vecstore.version": 0,
    "vecstore.types": 0,
    "vecstore.checks": 0,
    "vecstore.slicing": 0,
    "vecstore.registry": 0,
    "vecstore.config": 0,
    "vecstore.config_parse": 0,
    "vecstore.config_sections": 0,
    # tensors and ops
    "vecstore.kernels": 1,
    # components: indexes, clusterers, KV tiers, cache policies, the catalog
    "vecstore.index": 2,
    "vecstore.cluster": 2,
    "vecstore.kvstore": 2,
    "vecstore.policies": 2,
    "vecstore.catalog": 2,
    # what builds on components: wave buffers, on-disk storage
    "vecstore.buffer": 3,
    "vecstore.storage": 3,
    # executors, and the check of a config's plug-ins against every registry
    "vecstore.executor": 4,
    "vecstore.plugins": 4,
    # the engine, bottom up: a layer's parts; its state; sequences and shared tails;
    # batches, decoders, transactions and sequence assembly; queries; writes; the store
    "vecstore.engine.tail": 5.0,
    "vecstore.engine.layer_image": 5.0,
    "vecstore.engine.layer_mark": 5.0,
    "vecstore.engine.layer_lineage": 5.0,
    "vecstore.engine.layer_indexes": 5.0,
    "vecstore.engine.layer_staging": 5.0,
    "vecstore.engine.view_turnover": 5.0,
    "vecstore.engine.layer_state": 5.1,
    "vecstore.engine.lazy_layer": 5.2,
    "vecstore.engine.shared_tail": 5.2,
    "vecstore.engine.batch_share": 5.2,
    "vecstore.engine.batch_build": 5.2,
    "vecstore.engine.sequence": 5.2,
    "vecstore.engine.batch": 5.3,
    "vecstore.engine.batch_steady": 5.3,
    "vecstore.engine.decoder": 5.3,
    "vecstore.engine.sequence_builder": 5.3,
    "vecstore.engine.transaction": 5.3,
    "vecstore.engine.query_engine": 5.4,
    "vecstore.engine.writer": 5.5,
    "vecstore.engine.store_core": 5.6,
    "vecstore.engine.store_data": 5.7,
    "vecstore.engine.store": 5.8,
    # the public API
    "vecstore": 6,
    # the model-side attention layer
    "attention": 7,
    # framework bindings
    "integrations": 8,
    # the command line
    "vecstore.cli": 9,
}
"""Layer of each package or module (the longest dotted prefix of a module's name that is a
key names its layer). A module may import modules of its own layer or lower ones."""


@dataclass(frozen=True, slots=True)
class Edge:
    """``source`` imports ``target`` at ``line`` of ``path``."""

    source: str
    target: str
    path: str
    line: int

    def __str__(self) -> str:
        return f"{self.source} -> {self.target} ({self.path}:{self.line})"


def modules() -> dict[str, tuple[Path, bool]]:
    """Every module of :data:`PACKAGES`: dotted name -> (file, is a package)."""
    found = {}
    for package in PACKAGES:
        for path in sorted((ROOT / package).rglob("*.py")):
            parts = list(path.relative_to(ROOT).with_suffix("").parts)
            is_package = parts[-1] == "__init__"
            if is_package:
                parts = parts[:-1]
            found[".".join(parts)] = (path, is_package)
    return found


def _known(name: str, known: dict[str, tuple[Path, bool]]) -> str | None:
    """``name``, or its longest dotted prefix, that is a module of the tree."""
    while name and name not in known:
        name = name.rpartition(".")[0]
    return name or None


def imports(name: str, path: Path, is_package: bool,
            known: dict[str, tuple[Path, bool]]) -> Iterator[Edge]:
    """Every import of a module of the tree by ``name``, anywhere in its file; relative
    imports resolved, ``from a import b`` taken as the module ``a.b`` when there is one."""
    package = name if is_package else name.rpartition(".")[0]
    rel = str(path.relative_to(ROOT))
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        targets: list[str] = []
        if isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")[:len(package.split(".")) - node.level + 1]
                module = ".".join([*base, *([node.module] if node.module else [])])
            else:
                module = node.module or ""
            targets = [f"{module}.{alias.name}" if f"{module}.{alias.name}" in known
                       else module for alias in node.names]
        resolved = {_known(target, known) for target in targets}
        for found in sorted(t for t in resolved if t is not None and t != name):
            yield Edge(name, found, rel, node.lineno)


def graph() -> dict[str, list[Edge]]:
    """Module -> its imports of other modules of the tree."""
    known = modules()
    return {name: list(imports(name, path, is_package, known))
            for name, (path, is_package) in known.items()}


def layer(module: str) -> float:
    """The layer of ``module`` (:data:`LAYERS`)."""
    name = module
    while name not in LAYERS:
        if "." not in name:
            raise KeyError(f"{module} is in no layer: add it (or its package) to LAYERS")
        name = name.rpartition(".")[0]
    return LAYERS[name]


def cycles(edges: dict[str, list[Edge]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan), each sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for e in edges[v]:
            w = e.target
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for v in sorted(edges):
        if v not in index:
            visit(v)
    return found


def test_the_tree_is_parsed():
    edges = graph()
    assert {"vecstore", "vecstore.engine.store", "attention", "integrations.hf"} <= set(edges)
    assert any(e.target == "vecstore.engine.sequence" for e in edges["vecstore.engine.store_core"])


def test_every_module_has_a_layer():
    assert [m for m in graph() if _undeclared(m)] == []


def _undeclared(module: str) -> bool:
    try:
        layer(module)
    except KeyError:
        return True
    return False


def test_no_import_cycle():
    edges = graph()
    problems = []
    for component in cycles(edges):
        inside = set(component)
        lines = [str(e) for m in component for e in edges[m] if e.target in inside]
        problems.append(f"cycle of {len(component)} modules: {', '.join(component)}\n    "
                        + "\n    ".join(lines))
    assert not problems, "import cycles (cut one edge of each):\n" + "\n".join(problems)


def test_imports_point_down():
    upward = [f"{e} imports layer {layer(e.target)} from layer {layer(e.source)}"
              for es in graph().values() for e in es if layer(e.target) > layer(e.source)]
    assert not upward, "upward imports:\n" + "\n".join(upward)


def test_the_checks_catch_a_cycle_and_an_upward_edge():
    a, b = "vecstore.engine.store", "vecstore.errors"
    edges = {a: [Edge(a, b, "x.py", 1)], b: [Edge(b, a, "y.py", 2)]}
    assert cycles(edges) == [sorted([a, b])]  # each component sorted
    assert layer(b) < layer(a)
    assert str(edges[b][0]) == "vecstore.errors -> vecstore.engine.store (y.py:2)"
