"""--num-shard 2 over gloo answers exactly what one shard answers, for a tiny Qwen3-MoE:
the launcher, gloo and the router are the same for every family, and this one carries
the most that tensor parallelism splits (q/k/v heads with per-head norms, experts, the
one all-reduce per MoE layer). Each family's TP is checked against one rank in
tests/shard_server/models/test_llama_tp.py."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import httpx
import pytest

from textgate.launcher import free_port

pytestmark = pytest.mark.e2e

PROMPTS = ["Paris is the capital", "The quick brown fox", "Continuous batching keeps"]


def _answers(launch_server: Any, tmp_path: Path, model: Path, num_shard: int) -> list[str]:
    server = launch_server(
        tmp_path / f"tp{num_shard}",
        "--model-id", str(model),
        "--num-shard", str(num_shard),
        "--dtype", "float32",
        "--master-port", str(free_port()),
    )  # fmt: skip
    try:
        server.wait_ready()
        body = {"parameters": {"max_new_tokens": 8, "ignore_eos": True, "details": True}}
        answers = []
        for prompt in PROMPTS:
            response = httpx.post(
                f"{server.url}/generate", json={"inputs": prompt, **body}, timeout=60
            )
            assert response.status_code == 200, response.text
            tokens = response.json()["details"]["tokens"]
            answers.append(" ".join(str(t["id"]) for t in tokens))
        info = httpx.get(f"{server.url}/info").json()
        assert info["model_id"]
        return answers
    finally:
        assert server.stop() == 0


def test_two_shards_give_the_same_greedy_tokens(
    launch_server: Any, tmp_path: Path, tiny_moe_model_dir: Path
) -> None:
    (tmp_path / "tp1").mkdir()
    (tmp_path / "tp2").mkdir()
    two = _answers(launch_server, tmp_path, tiny_moe_model_dir, 2)
    assert two == _answers(launch_server, tmp_path, tiny_moe_model_dir, 1)
