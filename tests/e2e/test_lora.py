"""LoRA adapters served over HTTP: 15 concurrent requests over four adapters (taking turns
in two --max-loras slots) and the base each get exactly what they get alone, and each
adapter answers differently from the base;
adapters loaded, unloaded and reloaded at runtime while other streams run, none failing;
two shards (tensor parallel) answering as one, adapters loaded at startup and at runtime."""

from __future__ import annotations

import asyncio
import json
import re
from pathlib import Path
from typing import Any

import httpx
import pytest

from textgate.launcher import free_port
from textgate.tests.conftest import build_tiny_model
from textgate.tests.shard_server.layers.test_lora import make_adapter

pytestmark = [
    pytest.mark.e2e,
    pytest.mark.filterwarnings("ignore:`is_gradient_checkpointing` is deprecated:FutureWarning"),
]
pytest.importorskip("peft")

TARGETS = {
    "attn": ["q_proj", "v_proj"],
    "mlp": ["gate_proj", "down_proj"],
    "all": ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"],
    "out": ["o_proj", "up_proj"],
}


def _body(prompt: str, adapter: str | None) -> dict[str, Any]:
    parameters: dict[str, Any] = {"max_new_tokens": 8, "ignore_eos": True, "details": True}
    if adapter is not None:
        parameters["adapter_id"] = adapter
    return {"inputs": prompt, "parameters": parameters}


async def _answer(client: httpx.AsyncClient, prompt: str, adapter: str | None) -> list[int]:
    response = await client.post("/generate", json=_body(prompt, adapter))
    assert response.status_code == 200, response.text
    return [token["id"] for token in response.json()["details"]["tokens"]]


def test_concurrent_requests_over_four_adapters_in_two_slots_and_the_base(
    launch_server: Any, tmp_path: Path
) -> None:
    """--max-loras 2 with four adapters in use at once: they take turns in the two slots
    (evicted and made resident again from their host copies) and every request gets exactly
    the tokens it gets alone (greedy, float32)."""
    base = build_tiny_model(tmp_path / "base")
    adapters = []
    for seed, (name, targets) in enumerate(TARGETS.items()):
        make_adapter(base, tmp_path / name, seed, r=8, lora_alpha=32, target_modules=targets)
        adapters.append(f"{name}={tmp_path / name}")
    server = launch_server(
        tmp_path,
        "--model-id", str(base),
        "--dtype", "float32",
        "--lora-adapters", ",".join(adapters),
        "--max-loras", "2",
    )  # fmt: skip
    try:
        server.wait_ready()
        prompts = [f"The quick brown fox {'jumps ' * n}" for n in range(3)]
        jobs = [(p, a) for p in prompts for a in (None, *TARGETS)]  # 15

        async def run() -> None:
            async with httpx.AsyncClient(base_url=server.url, timeout=120) as client:
                alone = [await _answer(client, p, a) for p, a in jobs]
                together = await asyncio.gather(*(_answer(client, p, a) for p, a in jobs))
                assert list(together) == alone
                for i in range(0, len(jobs), 5):  # every adapter changes the answer
                    assert len({tuple(t) for t in alone[i : i + 5]}) == 5, alone[i : i + 5]
                models = (await client.get("/v1/models")).json()["data"]
                assert sorted(m["id"] for m in models[1:]) == sorted(TARGETS)
                metrics = (await client.get("/metrics")).text
                evictions = re.search(r"^textgate_lora_evictions (\S+)$", metrics, re.M)
                assert evictions is not None and float(evictions[1]) >= 10, metrics
                assert "textgate_lora_resident_adapters 2.0" in metrics

        asyncio.run(run())
    finally:
        assert server.stop() == 0


async def _stream(client: httpx.AsyncClient, prompt: str, adapter: str | None) -> list[int]:
    """The token ids of a /generate_stream of 48 tokens; fails on any error event."""
    parameters: dict[str, Any] = {"max_new_tokens": 48, "ignore_eos": True}
    if adapter is not None:
        parameters["adapter_id"] = adapter
    body = {"inputs": prompt, "parameters": parameters}
    ids = []
    async with client.stream("POST", "/generate_stream", json=body) as response:
        assert response.status_code == 200, await response.aread()
        async for line in response.aiter_lines():
            if line.startswith("data:"):
                event = json.loads(line.removeprefix("data:"))
                assert "error" not in event, event
                ids.append(event["token"]["id"])
    return ids


def test_adapters_load_unload_and_reload_while_other_streams_run(
    launch_server: Any, tmp_path: Path
) -> None:
    base = build_tiny_model(tmp_path / "base")
    for seed, name in enumerate(("attn", "mlp")):
        make_adapter(base, tmp_path / name, seed, r=8, lora_alpha=32, target_modules=TARGETS[name])
    server = launch_server(
        tmp_path,
        "--model-id", str(base),
        "--dtype", "float32",
        "--lora-adapters", f"attn={tmp_path / 'attn'}",
        "--max-loras", "2",
        "--allow-runtime-lora-updating",
    )  # fmt: skip
    try:
        server.wait_ready()

        async def run() -> None:
            async with httpx.AsyncClient(base_url=server.url, timeout=120) as client:
                prompt = "The quick brown fox "
                alone = {a: await _stream(client, prompt, a) for a in (None, "attn")}
                streams = [
                    asyncio.ensure_future(_stream(client, prompt, a)) for a in (None, "attn") * 2
                ]
                mlp = {"lora_name": "mlp", "lora_path": str(tmp_path / "mlp")}
                assert (await client.post("/v1/load_lora_adapter", json=mlp)).status_code == 200
                assert not all(s.done() for s in streams)  # loaded while they run
                first = await _answer(client, prompt, "mlp")
                unload = await client.post("/v1/unload_lora_adapter", json={"lora_name": "mlp"})
                assert unload.status_code == 200
                gone = await client.post("/generate", json=_body(prompt, "mlp"))
                assert gone.status_code == 422, gone.text
                assert (await client.post("/v1/load_lora_adapter", json=mlp)).status_code == 200
                assert await _answer(client, prompt, "mlp") == first
                in_use = await client.post("/v1/unload_lora_adapter", json={"lora_name": "attn"})
                assert in_use.status_code == 400 and "in flight" in in_use.text
                results = await asyncio.gather(*streams)
                assert results == [alone[None], alone["attn"]] * 2
                assert first[:8] != alone[None][:8]
                models = (await client.get("/v1/models")).json()["data"]
                assert [m["id"] for m in models[1:]] == ["attn", "mlp"]

        asyncio.run(run())
    finally:
        assert server.stop() == 0


def _shard_answers(launch_server: Any, folder: Path, base: Path, num_shard: int) -> list[list[int]]:
    """Through a launcher of `num_shard` shards started with adapter `attn`: `mlp` loaded at
    runtime, then one prompt's tokens on the base and on each adapter."""
    server = launch_server(
        folder / f"tp{num_shard}",
        "--model-id", str(base),
        "--dtype", "float32",
        "--num-shard", str(num_shard),
        "--master-port", str(free_port()),
        "--lora-adapters", f"attn={folder / 'attn'}",
        "--allow-runtime-lora-updating",
    )  # fmt: skip
    try:
        server.wait_ready()

        async def run() -> list[list[int]]:
            async with httpx.AsyncClient(base_url=server.url, timeout=120) as client:
                mlp = {"lora_name": "mlp", "lora_path": str(folder / "mlp")}
                assert (await client.post("/v1/load_lora_adapter", json=mlp)).status_code == 200
                prompt = "The quick brown fox "
                return [await _answer(client, prompt, a) for a in (None, "attn", "mlp")]

        return asyncio.run(run())
    finally:
        assert server.stop() == 0


def test_two_shards_serve_adapters_as_one_does(launch_server: Any, tmp_path: Path) -> None:
    """--num-shard 2: each shard holds its half of every update (at startup and loaded at
    runtime), and the tokens are one shard's."""
    base = build_tiny_model(tmp_path / "base")
    for seed, name in enumerate(("attn", "mlp")):
        make_adapter(base, tmp_path / name, seed, r=8, lora_alpha=32, target_modules=TARGETS["all"])
    for num_shard in (1, 2):
        (tmp_path / f"tp{num_shard}").mkdir()
    two = _shard_answers(launch_server, tmp_path, base, 2)
    assert two == _shard_answers(launch_server, tmp_path, base, 1)
    assert len({tuple(tokens) for tokens in two}) == 3  # each adapter changes the answer
