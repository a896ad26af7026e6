"""A model with no native class served over HTTP on the paged engine: transformers'
olmo2 modules with textgate's attention, concurrent requests, a grammar (which the
padded fallback refuses), /info naming how it runs."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import httpx
import pytest

from textgate.shard_server.models import supported_model_types
from textgate.tests.conftest import build_tiny_model

pytestmark = pytest.mark.e2e


async def _generate(client: httpx.AsyncClient, prompt: str, **parameters: Any) -> Any:
    body = {"inputs": prompt, "parameters": {"max_new_tokens": 6, **parameters}}
    response = await client.post("/generate", json=body)
    assert response.status_code == 200, response.text
    return response.json()


def test_olmo2_serves_paged_with_concurrency_and_a_grammar(
    launch_server: Any, tmp_path: Path
) -> None:
    assert "olmo2" not in supported_model_types()
    model = build_tiny_model(tmp_path / "olmo2", "olmo2")
    server = launch_server(tmp_path, "--model-id", str(model), "--dtype", "float32")
    try:
        server.wait_ready()

        async def run() -> None:
            async with httpx.AsyncClient(base_url=server.url, timeout=60) as client:
                prompts = [f"The quick brown fox {'jumps ' * n}" for n in range(6)]
                alone = [(await _generate(client, p))["generated_text"] for p in prompts]
                together = await asyncio.gather(*(_generate(client, p) for p in prompts))
                assert [answer["generated_text"] for answer in together] == alone
                grammar = {"type": "regex", "value": "(ab|ba){3}"}
                constrained = await _generate(client, prompts[0], grammar=grammar)
                assert constrained["generated_text"] in {
                    a + b + c for a in ("ab", "ba") for b in ("ab", "ba") for c in ("ab", "ba")
                }
                info = (await client.get("/info")).json()
                assert info["model_implementation"] == (
                    "transformers Olmo2ForCausalLM on the paged engine (no native class)"
                )

        asyncio.run(run())
    finally:
        assert server.stop() == 0
    assert "transformers' modules on the paged engine" in server.log_path.read_text()
