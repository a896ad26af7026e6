"""client.py is generated from async_client.py; the committed copy must be what codegen makes."""

from __future__ import annotations

import ast
import inspect
import re

import pytest

from textgate.client import AsyncClient, Client, codegen


def test_committed_client_is_fresh() -> None:
    assert codegen.generate() == codegen.SYNC_TARGET.read_text(), (
        "client/client.py is stale: run `python -m textgate.client.codegen` and commit the result"
    )


def test_committed_client_says_it_is_generated() -> None:
    assert codegen.SYNC_TARGET.read_text().startswith(codegen.HEADER)


def test_generated_client_has_no_async_code_left() -> None:
    source = codegen.SYNC_TARGET.read_text()
    async_nodes = (ast.AsyncFunctionDef, ast.AsyncWith, ast.AsyncFor, ast.Await)
    assert not [node for node in ast.walk(ast.parse(source)) if isinstance(node, async_nodes)]
    assert not re.findall(r"\b(?:async|await|asyncio)\b|Async|aclos|codegen:", source)


def test_tokens_are_swapped_as_whole_words() -> None:
    source = "async def f(c: httpx.AsyncClient) -> None:\n    await c.aclose()\n"
    assert codegen.swap_tokens(source) == "def f(c: httpx.Client) -> None:\n    c.close()\n"
    untouched = "contextlib.aclosing(x); MyAsyncClient; AsyncClientPool; acloser; asyncio"
    assert codegen.swap_tokens(untouched) == untouched


def test_a_passage_must_occur_exactly_once() -> None:
    with pytest.raises(ValueError, match="occurs 0 times"):
        codegen.swap_passages("")
    passage = next(iter(codegen.SYNC_PASSAGES))
    with pytest.raises(ValueError, match="occurs 2 times"):
        codegen.swap_passages(codegen.ASYNC_SOURCE.read_text() + passage)


def test_codegen_notes_are_dropped() -> None:
    source = "x = 1\n    # codegen: why the async source looks so\ny = 2  # kept\n"
    assert codegen.drop_codegen_notes(source) == "x = 1\ny = 2  # kept\n"


@pytest.mark.parametrize(
    "name", sorted(n for n in vars(AsyncClient) if not n.startswith("_") or n == "__init__")
)
def test_client_methods_mirror_the_async_ones(name: str) -> None:
    sync_name = codegen.swap_tokens(name)
    async_method, sync_method = getattr(AsyncClient, name), getattr(Client, sync_name)
    assert str(inspect.signature(sync_method)) == codegen.swap_tokens(
        str(inspect.signature(async_method))
    )
    assert not inspect.iscoroutinefunction(sync_method)
