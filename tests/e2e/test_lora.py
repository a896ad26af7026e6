"""LoRA adapters served over HTTP: 12 concurrent requests over three adapters and the base
each get exactly what they get alone, and each adapter answers differently from the base."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import httpx
import pytest

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
}


async def _answer(client: httpx.AsyncClient, prompt: str, adapter: str | None) -> list[int]:
    parameters: dict[str, Any] = {"max_new_tokens": 8, "ignore_eos": True, "details": True}
    if adapter is not None:
        parameters["adapter_id"] = adapter
    response = await client.post("/generate", json={"inputs": prompt, "parameters": parameters})
    assert response.status_code == 200, response.text
    return [token["id"] for token in response.json()["details"]["tokens"]]


def test_twelve_concurrent_requests_over_three_adapters_and_the_base(
    launch_server: Any, tmp_path: Path
) -> None:
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
    )  # fmt: skip
    try:
        server.wait_ready()
        prompts = [f"The quick brown fox {'jumps ' * n}" for n in range(3)]
        jobs = [(p, a) for p in prompts for a in (None, *TARGETS)]  # 12

        async def run() -> None:
            async with httpx.AsyncClient(base_url=server.url, timeout=120) as client:
                alone = [await _answer(client, p, a) for p, a in jobs]
                together = await asyncio.gather(*(_answer(client, p, a) for p, a in jobs))
                assert list(together) == alone
                for i in range(0, len(jobs), 4):  # every adapter changes the answer
                    assert len({tuple(t) for t in alone[i : i + 4]}) == 4, alone[i : i + 4]
                models = (await client.get("/v1/models")).json()["data"]
                assert sorted(m["id"] for m in models[1:]) == sorted(TARGETS)

        asyncio.run(run())
    finally:
        assert server.stop() == 0
