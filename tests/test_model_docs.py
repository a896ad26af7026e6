"""docs/models.md lists exactly the model types that have a native class."""

from __future__ import annotations

import re
from pathlib import Path

import textgate
from textgate.shard_server.models import supported_model_types
from textgate.tests.test_docs import references, resolve

DOC = Path(textgate.__file__).parent / "docs" / "models.md"


def documented_types() -> list[str]:
    """The backticked model_type of each row of the native-architectures table."""
    return re.findall(r"^\| `(\w+)` \|", DOC.read_text(), flags=re.MULTILINE)


def test_the_table_lists_every_native_model_type_once() -> None:
    documented = documented_types()
    assert len(documented) == len(set(documented)), documented
    assert sorted(documented) == supported_model_types()


def test_the_code_it_cites_exists() -> None:
    dotted, files = references(DOC.read_text())
    assert "shard_server.layers.moe.SparseMoE" in dotted
    for name in dotted:
        resolve(name)
    assert [path for path in files if not (DOC.parent.parent / path).exists()] == []
