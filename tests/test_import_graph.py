"""The import graph between textgate's top-level packages: no cycles, no forbidden edges.

Every .py file of the installed package is parsed with `ast` (nothing is imported), and
each import statement anywhere in it (module level, inside functions, under
`TYPE_CHECKING`) becomes an edge from the file's top-level package (`router`,
`shard_server`, `kernels`, ..., or `launcher`/`paths` for a root module) to the package it
names. Everything under `router/` is `router`, whatever its sub-packages are called.
Imports through `importlib` or `__import__` are not seen.
"""

from __future__ import annotations

import ast
from collections import defaultdict
from collections.abc import Set
from dataclasses import dataclass
from pathlib import Path

import textgate

PACKAGE = "textgate"
ROOT = Path(textgate.__file__).resolve().parent
# Folders under the root that are not part of the installed package.
EXCLUDED_DIRS = frozenset({"tests", "build", "dist", "docs", "__pycache__"})

# Internal edges that must not exist, whatever the module: source -> forbidden targets.
FORBIDDEN = {
    "router": {"shard_server", "kernels", "quantization"},
    "shard_server": {"router"},
    "client": {"router", "shard_server"},
    "kernels": {"shard_server"},
    "quantization": {"router"},
}
# Third-party packages a top-level package must not import (the router is pure Python).
FORBIDDEN_THIRD_PARTY = {"router": {"torch"}}


@dataclass(frozen=True)
class Import:
    """One import statement's edge: `source` package imports `target` at `path:lineno`."""

    path: str  # relative to the package root
    lineno: int
    statement: str
    source: str
    target: str
    internal: bool  # a textgate package, not a third-party one

    def where(self) -> str:
        return f"{self.path}:{self.lineno}: `{self.statement}`"


def python_files(root: Path) -> list[Path]:
    """The package's .py files: no tests, build outputs, hidden folders or egg-info."""
    files = []
    for path in sorted(root.rglob("*.py")):
        folders = path.relative_to(root).parts[:-1]
        if any(
            part in EXCLUDED_DIRS or part.startswith(".") or part.endswith(".egg-info")
            for part in folders
        ):
            continue
        files.append(path)
    return files


def top_level_names(files: list[Path], root: Path) -> set[str]:
    """`router` for router/**, `launcher` for launcher.py; the root __init__ is `textgate`."""
    return {_top_of(path.relative_to(root).parts) for path in files}


def _top_of(parts: tuple[str, ...]) -> str:
    if len(parts) > 1:
        return parts[0]
    stem = parts[0].removesuffix(".py")
    return PACKAGE if stem == "__init__" else stem


def _internal_targets(module: list[str], names: list[str], tops: set[str]) -> list[str]:
    """Top-level packages named by `from textgate.<module> import <names>`; with an empty
    module each name that is a top-level package is one, anything else is the root."""
    if module:
        return [module[0]]
    return [name if name in tops else PACKAGE for name in names]


def _targets(node: ast.stmt, package: list[str], tops: set[str]) -> list[tuple[bool, str]]:
    """(internal, top-level name) for each package one import statement names."""
    if isinstance(node, ast.Import):
        modules = [alias.name.split(".") for alias in node.names]
        return [
            (True, _internal_targets(module[1:], [PACKAGE], tops)[0])
            if module[0] == PACKAGE
            else (False, module[0])
            for module in modules
        ]
    assert isinstance(node, ast.ImportFrom)
    names = [alias.name for alias in node.names]
    module = node.module.split(".") if node.module else []
    if node.level == 0:
        if module[0] != PACKAGE:
            return [(False, module[0])]
        return [(True, top) for top in _internal_targets(module[1:], names, tops)]
    climb = node.level - 1  # `from . import x` stays in the file's own package
    if climb > len(package):
        raise ValueError(f"line {node.lineno}: relative import climbs out of {PACKAGE}")
    base = package[: len(package) - climb]
    return [(True, top) for top in _internal_targets(base + module, names, tops)]


def imports_of(path: Path, root: Path, tops: set[str]) -> list[Import]:
    """Every import in one file, as edges from its top-level package."""
    parts = path.relative_to(root).parts
    source, package = _top_of(parts), list(parts[:-1])
    text = path.read_text(encoding="utf-8")
    edges = []
    for node in ast.walk(ast.parse(text, filename=str(path))):
        if not isinstance(node, ast.Import | ast.ImportFrom):
            continue
        statement = " ".join((ast.get_source_segment(text, node) or "").split())
        edges += [
            Import("/".join(parts), node.lineno, statement, source, target, internal)
            for internal, target in _targets(node, package, tops)
        ]
    return edges


def collect(root: Path) -> list[Import]:
    """All import edges of the package rooted at `root`."""
    files = python_files(root)
    tops = top_level_names(files, root)
    return [edge for path in files for edge in imports_of(path, root, tops)]


def forbidden_edges(edges: list[Import]) -> list[str]:
    """One line per import that crosses a forbidden edge."""
    problems = []
    for edge in edges:
        rules = FORBIDDEN if edge.internal else FORBIDDEN_THIRD_PARTY
        if edge.target in rules.get(edge.source, set()):
            kind = "" if edge.internal else " (third-party)"
            problems.append(f"{edge.source} -> {edge.target}{kind} is forbidden: {edge.where()}")
    return problems


def cycles(edges: list[Import]) -> list[str]:
    """One message per cycle between top-level packages (a strongly connected component of
    two or more), listing every import that closes it."""
    graph: dict[str, set[str]] = defaultdict(set)
    for edge in edges:
        if edge.internal and edge.source != edge.target:
            graph[edge.source].add(edge.target)
    problems = []
    for component in _strongly_connected(graph):
        if len(component) < 2:
            continue
        lines = [
            f"  {edge.source} -> {edge.target}: {edge.where()}"
            for edge in edges
            if edge.internal
            and edge.source != edge.target
            and {edge.source, edge.target} <= component
        ]
        problems.append(f"import cycle between {sorted(component)}:\n" + "\n".join(lines))
    return problems


def _strongly_connected(graph: dict[str, set[str]]) -> list[set[str]]:
    """Tarjan's algorithm (recursive: the graph has a dozen nodes)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    components: list[set[str]] = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        for succ in sorted(graph.get(node, ())):
            if succ not in index:
                visit(succ)
                low[node] = min(low[node], low[succ])
            elif succ in stack:
                low[node] = min(low[node], index[succ])
        if low[node] == index[node]:
            component = set()
            while True:
                member = stack.pop()
                component.add(member)
                if member == node:
                    break
            components.append(component)

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return components


def test_the_package_has_no_cycles_and_no_forbidden_imports():
    edges = collect(ROOT)
    # Not vacuous: the walk reached the real package and read imports from it.
    sources = {edge.path for edge in edges}
    assert {"kernels/linear.py", "quantization/unquantized.py", "launcher.py"} <= sources
    assert any(e.source == "quantization" and e.target == "kernels" for e in edges)
    problems = cycles(edges) + forbidden_edges(edges)
    assert not problems, "\n".join(problems)


def _write(root: Path, files: dict[str, str]) -> Path:
    for name, text in files.items():
        path = root / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    return root


def test_the_checker_catches_planted_cycles_and_edges(tmp_path):
    root = _write(
        tmp_path,
        {
            "__init__.py": "",
            "router/__init__.py": "",
            "router/engine/step.py": (
                "def run():\n    import torch.nn\n    from ...shard_server import model\n"
            ),
            "shard_server/model.py": "from textgate.paths import cache_dir\n",
            "kernels/a.py": "import textgate.quantization.w\n",
            "quantization/w.py": "from ..kernels import a\n",
            "client/c.py": "from textgate import router\n",
            "paths.py": "import os\n",
            "tests/test_x.py": "from textgate.router import engine\n",
            ".venv/lib.py": "from textgate.shard_server import model\n",
        },
    )
    edges = collect(root)
    assert {e.path for e in edges} == {
        "router/engine/step.py",
        "shard_server/model.py",
        "kernels/a.py",
        "quantization/w.py",
        "client/c.py",
        "paths.py",
    }
    assert forbidden_edges(edges) == [
        "client -> router is forbidden: client/c.py:1: `from textgate import router`",
        "router -> torch (third-party) is forbidden: router/engine/step.py:2: `import torch.nn`",
        "router -> shard_server is forbidden: "
        "router/engine/step.py:3: `from ...shard_server import model`",
    ]
    (cycle,) = cycles(edges)
    assert "['kernels', 'quantization']" in cycle
    assert "kernels/a.py:1: `import textgate.quantization.w`" in cycle
    assert "quantization/w.py:1: `from ..kernels import a`" in cycle


def test_a_layered_tree_passes(tmp_path):
    root = _write(
        tmp_path,
        {
            "router/app.py": "import asyncio\nfrom textgate.proto import generate_pb2\n",
            "shard_server/server.py": "from textgate import kernels, quantization\n",
            "quantization/w.py": "from textgate.kernels.linear import FastLinear\n",
            "kernels/linear.py": "import torch\nfrom textgate.paths import cache_dir\n",
            "proto/generate_pb2.py": "",
            "paths.py": "",
        },
    )
    edges = collect(root)
    assert len(edges) == 7
    assert cycles(edges) == [] and forbidden_edges(edges) == []


# The router one level down: each unit (a sub-package, or a module at router/'s root)
# imports only units of lower layers. Layer 0 is what every layer uses (config, logs,
# metrics, tracing, the shard client); the last is the composition root. Units of one
# layer may import each other only in the first and last layers (no cycle either way).
ROUTER_LAYERS: tuple[frozenset[str], ...] = (
    frozenset(
        {"request_record", "config", "tracing", "metrics", "metrics_collectors", "shard_client"}
    ),
    frozenset({"engine"}),
    frozenset({"generation"}),
    frozenset({"http"}),
    frozenset({"tgi", "openai", "anthropic"}),
    frozenset({"app", "openapi", "autoconfig", "server", "__main__", "__init__"}),
)
#: Imports that break the layering today, each (file, unit it imports). Empty since issue
#: 24 moved the canonical request into `generation/`; it stays, for a violation that must
#: be allowed for a while, and may only shrink.
KNOWN_ROUTER_VIOLATIONS: frozenset[tuple[str, str]] = frozenset()


def router_edges(root: Path) -> list[tuple[str, str, str]]:
    """(file, source unit, target unit) for every import between the router's units."""
    router = root / "router"
    edges = []
    for path in python_files(root):
        if router not in path.parents:
            continue
        parts = path.relative_to(router).parts
        source = parts[0].removesuffix(".py")
        text = path.read_text(encoding="utf-8")
        for node in ast.walk(ast.parse(text, filename=str(path))):
            if isinstance(node, ast.ImportFrom) and node.module:
                modules = [node.module.split(".")]
                if modules[0] == [PACKAGE, "router"]:
                    modules = [[PACKAGE, "router", alias.name] for alias in node.names]
            elif isinstance(node, ast.Import):
                modules = [alias.name.split(".") for alias in node.names]
            else:
                continue
            for module in modules:
                if module[:2] == [PACKAGE, "router"] and len(module) > 2 and module[2] != source:
                    edges.append((path.relative_to(root).as_posix(), source, module[2]))
    return edges


def _layer(unit: str) -> int:
    for number, units in enumerate(ROUTER_LAYERS):
        if unit in units:
            return number
    raise AssertionError(f"router unit {unit!r} is in no layer of ROUTER_LAYERS")


def layering_problems(
    edges: list[tuple[str, str, str]], known: Set[tuple[str, str]] = KNOWN_ROUTER_VIOLATIONS
) -> list[str]:
    """One line per import from a unit to one of its own or a higher layer (bar layer 0's
    and the root's own), not in KNOWN_ROUTER_VIOLATIONS."""
    problems = []
    last = len(ROUTER_LAYERS) - 1
    for path, source, target in edges:
        low, high = _layer(target), _layer(source)
        allowed = low < high or (low == high and high in (0, last))
        if not allowed and (path, target) not in known:
            problems.append(
                f"{path}: router.{source} (layer {high}) imports router.{target} (layer {low})"
            )
    return problems


def test_the_router_is_layered():
    edges = router_edges(ROOT)
    assert any(source == "engine" and target == "shard_client" for _, source, target in edges)
    problems = layering_problems(edges)
    assert not problems, "\n".join(problems)
    graph: dict[str, set[str]] = defaultdict(set)
    for path, source, target in edges:
        if (path, target) not in KNOWN_ROUTER_VIOLATIONS:
            graph[source].add(target)
    cyclic = [sorted(c) for c in _strongly_connected(graph) if len(c) > 1]
    assert not cyclic, f"import cycles between the router's units: {cyclic}"
    # The exceptions may only go: one that no longer happens must leave the list.
    seen = {(path, target) for path, _, target in edges}
    assert seen >= KNOWN_ROUTER_VIOLATIONS, sorted(KNOWN_ROUTER_VIOLATIONS - seen)


def test_the_layering_check_catches_an_upward_import():
    edges = [
        ("router/engine/channel.py", "engine", "tgi"),  # down into an API: refused
        ("router/tgi/routes.py", "tgi", "engine"),  # up: fine
        ("router/tracing.py", "tracing", "request_record"),  # within layer 0: fine
        ("router/generation/validation.py", "generation", "engine"),  # up: fine
        ("router/openai/output.py", "openai", "tgi"),  # one API into another: refused
        ("router/http/errors.py", "http", "tgi"),  # a known exception
    ]
    assert layering_problems(edges, known={("router/http/errors.py", "tgi")}) == [
        "router/engine/channel.py: router.engine (layer 1) imports router.tgi (layer 4)",
        "router/openai/output.py: router.openai (layer 4) imports router.tgi (layer 4)",
    ]
