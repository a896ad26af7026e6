"""LoRA adapters through the router: each API picks one (TGI `adapter_id`, OpenAI and
Anthropic `model`), the shard request carries it, /v1/models and /info list them, an
unknown one fails in each API's shape, and the prefix cache never mixes adapters; vLLM's
/v1/load_lora_adapter and /v1/unload_lora_adapter change all of that at runtime, refuse
what they cannot do (an adapter in use is not unloaded), and adapters are counted."""

from __future__ import annotations

import asyncio
import logging
import re
from pathlib import Path
from typing import Any

import httpx
import pytest

from textgate.router.engine.block_allocator import BlockAllocator
from textgate.router.engine.lora_registry import LoraRegistry
from textgate.tests.router.fake_shard import FakeShard
from textgate.tests.router.openai.routes_helpers import ChatFakeTokenizer, StartRouter, chat


@pytest.fixture
async def client(start_router: StartRouter, fake: FakeShard) -> httpx.AsyncClient:
    fake.lora_adapters = ["sql", "poet"]
    async with httpx.AsyncClient(
        base_url=await start_router(ChatFakeTokenizer(), allow_runtime_lora_updating=True)
    ) as http:
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


# ---- adapters loaded and unloaded at runtime (vLLM's routes) ----


async def _load(client: httpx.AsyncClient, name: str, path: Path | str) -> httpx.Response:
    return await client.post(
        "/v1/load_lora_adapter", json={"lora_name": name, "lora_path": str(path)}
    )


async def _unload(client: httpx.AsyncClient, name: str) -> httpx.Response:
    return await client.post("/v1/unload_lora_adapter", json={"lora_name": name})


def _generate(adapter: str, prompt: str = "w5", max_new_tokens: int = 2) -> dict[str, Any]:
    parameters = {"max_new_tokens": max_new_tokens, "adapter_id": adapter}
    return {"inputs": prompt, "parameters": parameters}


async def test_a_loaded_adapter_serves_and_lists_until_it_is_unloaded(
    client, fake, tmp_path
) -> None:
    loaded = await _load(client, "haiku", tmp_path)
    assert loaded.status_code == 200, loaded.text
    assert loaded.text == "Success: LoRA adapter 'haiku' added successfully."
    assert fake.calls_to("LoadAdapter")[0].path == str(tmp_path)
    models = (await client.get("/v1/models")).json()["data"]
    assert [m["id"] for m in models[1:]] == ["sql", "poet", "haiku"]
    assert models[-1]["parent"] == models[0]["id"]
    assert (await client.get("/info")).json()["lora_adapters"] == ["sql", "poet", "haiku"]
    assert (await client.post("/generate", json=_generate("haiku"))).status_code == 200
    answer = await client.post("/v1/chat/completions", json=chat(model="haiku", max_tokens=2))
    assert answer.status_code == 200 and answer.json()["model"] == "haiku"
    assert [r.adapter_id for r in fake.received_requests()] == ["haiku", "haiku"]

    unloaded = await _unload(client, "haiku")
    assert unloaded.status_code == 200, unloaded.text
    assert unloaded.text == "Success: LoRA adapter 'haiku' removed successfully."
    assert [m["id"] for m in (await client.get("/v1/models")).json()["data"][1:]] == ["sql", "poet"]
    assert (await client.get("/info")).json()["lora_adapters"] == ["sql", "poet"]
    refused = await client.post("/generate", json=_generate("haiku"))
    assert refused.status_code == 422
    assert (
        refused.json()["error"] == "`adapter_id` 'haiku' is not a loaded adapter; loaded: sql, poet"
    )
    missing = await client.post("/v1/chat/completions", json=chat(model="haiku"))
    assert missing.status_code == 404
    assert len(fake.received_requests()) == 2


async def test_loads_and_unloads_the_server_refuses_say_why(client, fake, tmp_path) -> None:
    cases = [
        (
            await _load(client, "sql", tmp_path),
            400,
            "The lora adapter 'sql' has already been loaded.",
        ),
        (await _load(client, "fake-model", tmp_path), 400, "'fake-model' is the base model's name"),
        (
            await _load(client, "haiku", tmp_path / "nowhere"),
            400,
            f"LoRA adapter 'haiku': {tmp_path / 'nowhere'} has no adapter_config.json",
        ),
        (
            await _load(client, "", tmp_path),
            400,
            "Both 'lora_name' and 'lora_path' must be provided.",
        ),
        (await _unload(client, "haiku"), 404, "The lora adapter 'haiku' cannot be found."),
        (await client.post("/v1/load_lora_adapter", json={"lora_name": "x"}), 400, "lora_path"),
    ]
    for response, status, message in cases:
        assert response.status_code == status, response.text
        assert message in response.json()["error"]["message"], response.text
    assert [c.adapter_id for c in fake.calls_to("LoadAdapter")] == ["haiku"]
    assert (await client.get("/info")).json()["lora_adapters"] == ["sql", "poet"]
    assert not fake.calls_to("UnloadAdapter")


async def test_an_adapter_in_use_is_not_unloaded_and_its_request_finishes(client, fake) -> None:
    fake.step_delay_s = 0.02
    running = asyncio.ensure_future(
        client.post("/generate", json=_generate("sql", max_new_tokens=20))
    )
    while not fake.received_requests():
        await asyncio.sleep(0.01)
    refused = await _unload(client, "sql")
    assert refused.status_code == 400
    assert refused.json()["error"]["message"] == (
        "adapter 'sql' has 1 requests in flight; unload it once they have finished"
    )
    answer = await running
    assert answer.status_code == 200 and len(answer.json()["generated_text"].split()) == 20
    assert (await _unload(client, "sql")).status_code == 200
    assert not fake.calls_to("UnloadAdapter")[1:]


async def test_a_reloaded_name_never_gets_the_old_adapters_cached_blocks(client, tmp_path) -> None:
    prompt = " ".join(f"w{n}" for n in range(1, 41))  # two full blocks of 16 and a rest

    async def hit_tokens_after_one_request() -> float:
        assert (await client.post("/generate", json=_generate("sql", prompt, 1))).status_code == 200
        metrics = (await client.get("/metrics")).text
        return float(re.search(r"^textgate_prefix_cache_hit_tokens (\S+)$", metrics, re.M)[1])

    assert await hit_tokens_after_one_request() == 0
    assert await hit_tokens_after_one_request() == 32  # the same load: its blocks are reused
    assert (await _unload(client, "sql")).status_code == 200
    assert (await _load(client, "sql", tmp_path)).status_code == 200
    assert await hit_tokens_after_one_request() == 32  # a new load: nothing reused
    assert await hit_tokens_after_one_request() == 64


async def test_requests_and_tokens_are_counted_per_adapter(client, caplog) -> None:
    caplog.set_level(logging.INFO, "textgate.router.access")
    for adapter in ("sql", "sql", "poet"):
        body = _generate(adapter, max_new_tokens=3)
        assert (await client.post("/generate", json=body)).status_code == 200
    assert (await client.post("/generate", json={"inputs": "w5"})).status_code == 200
    metrics = (await client.get("/metrics")).text
    assert 'textgate_request_adapter_count{adapter="sql"} 2.0' in metrics
    assert 'textgate_request_adapter_count{adapter="poet"} 1.0' in metrics
    assert 'textgate_request_adapter_generated_tokens{adapter="sql"} 6.0' in metrics
    assert 'textgate_request_adapter_generated_tokens{adapter="poet"} 3.0' in metrics
    lines = [r.getMessage() for r in caplog.records if "/generate" in r.getMessage()]
    assert [" adapter=sql" in line for line in lines] == [True, True, False, False]
    assert " adapter=poet" in lines[2]


async def test_the_api_key_guards_loading_and_unloading(start_router, fake, tmp_path) -> None:
    fake.lora_adapters = ["sql"]
    base_url = await start_router(
        ChatFakeTokenizer(), api_key="secret", allow_runtime_lora_updating=True
    )
    async with httpx.AsyncClient(base_url=base_url) as http:
        assert (await _load(http, "haiku", tmp_path)).status_code == 401
        assert (await _unload(http, "sql")).status_code == 401
        assert not fake.calls_to("LoadAdapter") and not fake.calls_to("UnloadAdapter")
        http.headers["authorization"] = "Bearer secret"
        assert (await _load(http, "haiku", tmp_path)).status_code == 200
        assert (await _unload(http, "sql")).status_code == 200


def test_each_load_of_a_name_has_its_own_cache_salt() -> None:
    adapters = LoraRegistry(["sql"])
    first = adapters.cache_salt("sql")
    assert adapters.cache_salt(None) == adapters.cache_salt("") == ""
    adapters.remove("sql")
    with pytest.raises(ValueError, match="'sql' is not a loaded adapter; loaded: none"):
        adapters.cache_salt("sql")
    adapters.add("sql")
    assert adapters.cache_salt("sql") not in (first, "")


async def test_runtime_loading_is_off_unless_asked_for(start_router, fake, tmp_path) -> None:
    fake.lora_adapters = ["sql"]
    async with httpx.AsyncClient(base_url=await start_router(ChatFakeTokenizer())) as http:
        assert (await _load(http, "haiku", tmp_path)).status_code == 404
        assert (await _unload(http, "sql")).status_code == 404
    assert not fake.calls_to("LoadAdapter") and not fake.calls_to("UnloadAdapter")


async def test_more_adapters_than_slots_take_turns_and_none_fails(
    start_router, fake, tmp_path
) -> None:
    """--max-loras 1 over three adapters: concurrent requests on each (and the base) all
    finish, the shard never runs one on an adapter that is not resident (the fake fails such
    a step), loads and evictions are counted, and an unloaded then reloaded one is resident
    again when used."""
    fake.lora_adapters, fake.max_loras, fake.resident = ["sql", "poet", "haiku"], 1, ["sql"]
    fake.step_delay_s = 0.005
    base_url = await start_router(ChatFakeTokenizer(), allow_runtime_lora_updating=True)
    async with httpx.AsyncClient(base_url=base_url, timeout=30) as http:
        bodies = [_generate(a, max_new_tokens=4) for a in ("sql", "poet", "haiku") * 3]
        bodies.append({"inputs": "w5", "parameters": {"max_new_tokens": 4}})
        answers = await asyncio.gather(*(http.post("/generate", json=b) for b in bodies))
        assert [a.status_code for a in answers] == [200] * len(bodies), [a.text for a in answers]
        metrics = (await http.get("/metrics")).text
        loads = float(re.search(r"^textgate_lora_loads (\S+)$", metrics, re.M)[1])
        evictions = float(re.search(r"^textgate_lora_evictions (\S+)$", metrics, re.M)[1])
        assert evictions >= 2 and loads == evictions  # `sql` was resident at startup
        assert "textgate_lora_resident_adapters 1.0" in metrics
        assert 'vllm:lora_requests_info{max_lora="1"' in metrics
        assert (await _unload(http, "haiku")).status_code == 200
        assert (await _load(http, "haiku", tmp_path)).status_code == 200
        assert (await http.post("/generate", json=_generate("haiku"))).status_code == 200
        assert fake.resident == ["haiku"]
