"""LoRA adapters through the router: each API picks one (TGI `adapter_id`, OpenAI and
Anthropic `model`), the shard request carries it, /v1/models and /info list them, an
unknown one fails in each API's shape, and the prefix cache never mixes adapters."""

from __future__ import annotations

import httpx
import pytest

from textgate.router.engine.block_allocator import BlockAllocator
from textgate.tests.router.fake_shard import FakeShard
from textgate.tests.router.openai.routes_helpers import ChatFakeTokenizer, StartRouter, chat


@pytest.fixture
async def client(start_router: StartRouter, fake: FakeShard) -> httpx.AsyncClient:
    fake.lora_adapters = ["sql", "poet"]
    async with httpx.AsyncClient(base_url=await start_router(ChatFakeTokenizer())) as http:
        yield http


async def test_each_api_picks_an_adapter_and_the_shard_gets_it(client, fake) -> None:
    tgi = {"inputs": "w5", "parameters": {"max_new_tokens": 2, "adapter_id": "sql"}}
    assert (await client.post("/generate", json=tgi)).status_code == 200
    answer = await client.post("/v1/chat/completions", json=chat(model="poet", max_tokens=2))
    assert answer.status_code == 200 and answer.json()["model"] == "poet"
    base = await client.post("/v1/completions", json={"prompt": "w5", "max_tokens": 2})
    assert base.status_code == 200
    messages = {"model": "sql", "max_tokens": 2, "messages": [{"role": "user", "content": "w5"}]}
    assert (await client.post("/v1/messages", json=messages)).status_code == 200
    assert [r.adapter_id for r in fake.received_requests()] == ["sql", "poet", "", "sql"]


async def test_models_and_info_list_the_adapters(client) -> None:
    models = (await client.get("/v1/models")).json()["data"]
    assert [(m["id"], m.get("parent")) for m in models[1:]] == [
        ("sql", models[0]["id"]),
        ("poet", models[0]["id"]),
    ]
    assert "parent" not in models[0]
    assert (await client.get("/info")).json()["lora_adapters"] == ["sql", "poet"]


async def test_an_unknown_adapter_fails_in_each_apis_shape(client) -> None:
    tgi = {"inputs": "w5", "parameters": {"adapter_id": "haiku"}}
    refused = await client.post("/generate", json=tgi)
    assert refused.status_code == 422
    assert refused.json()["error"] == (
        "`adapter_id` 'haiku' is not a loaded adapter; loaded: sql, poet"
    )
    missing = await client.post("/v1/chat/completions", json=chat(model="haiku"))
    assert missing.status_code == 404 and "the adapters sql, poet" in missing.text


def test_the_prefix_cache_never_shares_blocks_across_adapters() -> None:
    allocator = BlockAllocator(num_blocks=16, block_size=4)
    prompt = list(range(13))
    for request_id, salt in enumerate(["", "sql", "sql", ""]):
        cached = allocator.allocate(request_id, prompt, 16, salt=salt)
        assert cached == (0 if request_id < 2 else 12), (request_id, salt, cached)
        allocator.cache_blocks(request_id, prompt, len(prompt))
