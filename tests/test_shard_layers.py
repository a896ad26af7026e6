"""The shard one level down: its units import only units of lower layers, never in a cycle.

A unit is a sub-package of `shard_server/` (`step`, `startup`, `models`, ...) or a module at
its root (`server`, `__main__`, ...). Every import statement of every file under
`shard_server/` counts: module level, inside functions, under `TYPE_CHECKING`, absolute
or relative. The file walk, the cycle search and the tree writer are those of
tests/test_import_graph.py.
"""

from __future__ import annotations

import ast
from collections import defaultdict
from pathlib import Path

from textgate.tests.test_import_graph import (
    PACKAGE,
    ROOT,
    _strongly_connected,
    _write,
    python_files,
)

SHARD = "shard_server"
# Lowest first. Units of one layer may import each other only in the last one (the
# servicer and the entry point, which sit on everything else).
SHARD_LAYERS: tuple[frozenset[str], ...] = (
    frozenset({"step", "layers"}),  # what one step does; the native models' building blocks
    frozenset({"models", "startup"}),  # native models; sizing and measurement at warmup
    frozenset({"protocols"}),  # PagedModel: the step protocol over the paged KV cache
    frozenset({"loading"}),  # from a model id to the PagedModel a shard serves
    frozenset({"server", "tracing", "flag_types", "__main__", "__init__"}),
)


def _module_of(path: Path, root: Path) -> list[str]:
    """`textgate.shard_server.step.sampler` as parts, for shard_server/step/sampler.py."""
    parts = list(path.relative_to(root).with_suffix("").parts)
    return [PACKAGE, *parts[:-1]] if parts[-1] == "__init__" else [PACKAGE, *parts]


def _imported(
    node: ast.Import | ast.ImportFrom, module: list[str], is_package: bool
) -> list[list[str]]:
    """The dotted modules (as parts) one import statement names, relative ones resolved;
    `from package import name` names `package.name`, which may be a module."""
    if isinstance(node, ast.Import):
        return [alias.name.split(".") for alias in node.names]
    base = node.module.split(".") if node.module else []
    if node.level:
        package = module if is_package else module[:-1]
        base = package[: len(package) - (node.level - 1)] + base
    return [[*base, alias.name] for alias in node.names]


def shard_edges(root: Path) -> list[tuple[str, str, str]]:
    """(file, source unit, target unit) for every import between two of the shard's units."""
    shard = root / SHARD
    edges = []
    for path in python_files(root):
        if shard not in path.parents:
            continue
        source = path.relative_to(shard).parts[0].removesuffix(".py")
        module = _module_of(path, root)
        tree = ast.parse(path.read_text(encoding="utf-8"), filename=str(path))
        for node in ast.walk(tree):
            if not isinstance(node, ast.Import | ast.ImportFrom):
                continue
            targets = {
                parts[2]
                for parts in _imported(node, module, path.name == "__init__.py")
                if parts[:2] == [PACKAGE, SHARD] and len(parts) > 2
            }
            file = path.relative_to(root).as_posix()
            edges += [(file, source, target) for target in sorted(targets - {source})]
    return edges


def _layer(unit: str) -> int:
    for number, units in enumerate(SHARD_LAYERS):
        if unit in units:
            return number
    raise AssertionError(f"shard unit {unit!r} is in no layer of SHARD_LAYERS")


def layering_problems(edges: list[tuple[str, str, str]]) -> list[str]:
    """One line per import from a unit to one of its own layer or a higher one (bar the
    last layer's own)."""
    last = len(SHARD_LAYERS) - 1
    problems = []
    for path, source, target in edges:
        low, high = _layer(target), _layer(source)
        if not (low < high or low == high == last):
            problems.append(
                f"{path}: shard_server.{source} (layer {high}) imports "
                f"shard_server.{target} (layer {low})"
            )
    return problems


def shard_cycles(edges: list[tuple[str, str, str]]) -> list[list[str]]:
    """The cycles between units (strongly connected components of two or more), sorted."""
    graph: dict[str, set[str]] = defaultdict(set)
    for _, source, target in edges:
        graph[source].add(target)
    return sorted(sorted(c) for c in _strongly_connected(graph) if len(c) > 1)


def test_the_shard_is_layered() -> None:
    edges = shard_edges(ROOT)
    # Not vacuous: module-level, relative-free and function-local edges were all read.
    seen = {(source, target) for _, source, target in edges}
    assert {("protocols", "step"), ("models", "layers"), ("server", "protocols")} <= seen
    assert ("shard_server/loading/shard_loader.py", "loading", "models") in edges  # in a def
    assert shard_cycles(edges) == []
    problems = layering_problems(edges)
    assert not problems, "\n".join(problems)


def test_the_checker_catches_a_planted_cycle(tmp_path: Path) -> None:
    root = _write(
        tmp_path,
        {
            "shard_server/__init__.py": "",
            "shard_server/step/__init__.py": "",
            "shard_server/step/sampler.py": (
                "def sample():\n    from textgate.shard_server.protocols import paged_model\n"
            ),
            "shard_server/protocols/paged_model.py": (
                "from typing import TYPE_CHECKING\n"
                "if TYPE_CHECKING:\n    from ..step.sampler import sample\n"
            ),
            "shard_server/startup/memory.py": "from textgate.shard_server import loading\n",
            "shard_server/loading/__init__.py": "from .model_source import resolve\n",
            "shard_server/loading/model_source.py": "import textgate.shard_server.startup.memory\n",
            "tests/test_x.py": "from textgate.shard_server.server import serve\n",
        },
    )
    edges = shard_edges(root)
    assert sorted(edges) == [
        ("shard_server/loading/model_source.py", "loading", "startup"),
        ("shard_server/protocols/paged_model.py", "protocols", "step"),
        ("shard_server/startup/memory.py", "startup", "loading"),
        ("shard_server/step/sampler.py", "step", "protocols"),
    ]
    assert shard_cycles(edges) == [["loading", "startup"], ["protocols", "step"]]
    assert layering_problems(edges) == [
        "shard_server/startup/memory.py: shard_server.startup (layer 1) imports "
        "shard_server.loading (layer 3)",
        "shard_server/step/sampler.py: shard_server.step (layer 0) imports "
        "shard_server.protocols (layer 2)",
    ]


def test_a_layered_tree_passes(tmp_path: Path) -> None:
    root = _write(
        tmp_path,
        {
            "shard_server/server.py": "from textgate.shard_server import tracing\n",
            "shard_server/tracing.py": "from textgate.telemetry import Telemetry\n",
            "shard_server/protocols/paged_model.py": "from ..step import sampler\n",
            "shard_server/step/sampler.py": "import torch\nfrom textgate.kernels import x\n",
            "shard_server/models/llama.py": "from textgate.shard_server.layers.norm import N\n",
        },
    )
    edges = shard_edges(root)
    assert sorted(edges) == [
        ("shard_server/models/llama.py", "models", "layers"),
        ("shard_server/protocols/paged_model.py", "protocols", "step"),
        ("shard_server/server.py", "server", "tracing"),
    ]
    assert shard_cycles(edges) == [] and layering_problems(edges) == []
