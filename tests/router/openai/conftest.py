"""OpenAI route fixtures: the router app served with a tokenizer that has a chat template."""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any

import httpx
import pytest

from textgate.tests.router.fake_shard import FakeTokenizer
from textgate.tests.router.openai.routes_helpers import ChatFakeTokenizer, StartRouter


@pytest.fixture
def start_openai(start_router: StartRouter) -> StartRouter:
    """`await start_openai(tokenizer=None, **config_overrides)`: `start_router` with a
    tokenizer that has a chat template (ChatFakeTokenizer) by default."""

    async def start(tokenizer: FakeTokenizer | None = None, **overrides: Any) -> str:
        return await start_router(tokenizer or ChatFakeTokenizer(), **overrides)

    return start


@pytest.fixture
async def client(start_openai: StartRouter) -> AsyncIterator[httpx.AsyncClient]:
    async with httpx.AsyncClient(base_url=await start_openai(), timeout=10) as http:
        yield http
