"""The docs name real code: every module, file and `module.function` they cite exists.

A reference is a backticked dotted path under the package (`router.engine.paged_engine.PagedEngine`,
`launcher.main`) or a backticked file path (`router/app.py`). Dotted paths are imported
(the longest importable module prefix) and the rest looked up as attributes; file paths must
exist in the repository. Renaming a function without updating the doc fails here.
"""

from __future__ import annotations

import importlib
import re
from pathlib import Path

import pytest

import textgate

ROOT = Path(textgate.__file__).parent
DOCS = ("docs/architecture.md",)
PACKAGES = (
    "router",
    "shard_server",
    "kernels",
    "quantization",
    "client",
    "proto",
    "bench",
    "launcher",
    "paths",
)
_BACKTICKED = re.compile(r"`([^`\s]+)`")
_NAMES = "|".join(PACKAGES)
_DOTTED = re.compile(rf"^(?:{_NAMES})(?:\.\w+)*$")
_FILE = re.compile(rf"^(?:{_NAMES})(?:/\w+)*(?:\.(?:py|c|proto)|/)$")


def references(text: str) -> tuple[list[str], list[str]]:
    """The dotted references and the file references a doc's text cites."""
    dotted, files = [], []
    for token in _BACKTICKED.findall(text):
        token = token.removesuffix("()")
        if _FILE.match(token):
            files.append(token)
        elif _DOTTED.match(token):
            dotted.append(token)
    return dotted, files


def resolve(dotted: str) -> object:
    """Import the longest module prefix of `dotted`, then walk the remaining attributes."""
    parts = dotted.split(".")
    for cut in range(len(parts), 0, -1):
        try:
            target: object = importlib.import_module("textgate." + ".".join(parts[:cut]))
        except ModuleNotFoundError:
            continue
        for name in parts[cut:]:
            target = getattr(target, name)
        return target
    raise ModuleNotFoundError(dotted)


@pytest.mark.parametrize("doc", DOCS)
def test_every_cited_name_exists(doc: str) -> None:
    dotted, files = references((ROOT / doc).read_text())
    assert len(dotted) >= 20, f"{doc} cites too few code names to be a walk-through"
    missing = []
    for name in dotted:
        try:
            resolve(name)
        except (ImportError, AttributeError) as exc:
            missing.append(f"{name}: {exc}")
    missing += [f"{path}: no such file" for path in files if not (ROOT / path).exists()]
    assert not missing, f"{doc} cites code that does not exist:\n" + "\n".join(missing)


def test_the_checker_catches_a_stale_reference() -> None:
    dotted, files = references(
        "see `router.engine.paged_engine.PagedEngine.submit`, `router.nowhere.fn()` and "
        "`router/app.py`, `router/gone.py`; `not.a.package` is prose"
    )
    assert dotted == ["router.engine.paged_engine.PagedEngine.submit", "router.nowhere.fn"]
    assert files == ["router/app.py", "router/gone.py"]
    resolve(dotted[0])
    with pytest.raises(AttributeError):
        resolve(dotted[1])
    assert not (ROOT / files[1]).exists()
