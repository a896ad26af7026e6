"""Anthropic route fixtures: the router app served with a tokenizer that has a chat template."""

from __future__ import annotations

from collections.abc import AsyncIterator

import httpx
import pytest

from textgate.tests.router.openai.routes_helpers import ChatFakeTokenizer, StartRouter


@pytest.fixture
async def client(start_router: StartRouter) -> AsyncIterator[httpx.AsyncClient]:
    """An HTTP client for a router whose tokenizer has the toy chat template (its
    generation prompt is " w9", so the fake model answers " t10 t11 ...")."""
    base_url = await start_router(ChatFakeTokenizer())
    async with httpx.AsyncClient(base_url=base_url, timeout=10) as http:
        yield http
