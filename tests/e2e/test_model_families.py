"""A model with no native class served over HTTP on the paged engine: transformers'
olmo2 modules with textgate's attention, concurrent requests, a grammar, /info naming
how it runs; and a model the paged engine cannot run, refused at startup saying why."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import httpx
import pytest
import torch
from transformers import AutoConfig, AutoModelForCausalLM

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


def test_a_model_the_paged_engine_cannot_run_stops_the_launcher_naming_why(
    launch_server: Any, tmp_path: Path
) -> None:
    torch.manual_seed(0)
    config = AutoConfig.for_model("mamba", vocab_size=101, hidden_size=32, num_hidden_layers=2)
    AutoModelForCausalLM.from_config(config).save_pretrained(tmp_path / "mamba")
    server = launch_server(tmp_path, "--model-id", str(tmp_path / "mamba"))
    with pytest.raises(RuntimeError, match="launcher exited early"):
        server.wait_ready(timeout=120)
    assert server.stop() != 0
    assert (
        "model type 'mamba' cannot be served: MambaForCausalLM does not run its attention "
        "through transformers' AttentionInterface"
    ) in server.log_path.read_text()
