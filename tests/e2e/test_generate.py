"""End to end: the launcher serving the embedded default model, driven over real HTTP."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import httpx
import pytest
from transformers import AutoTokenizer

pytestmark = pytest.mark.e2e


@pytest.fixture(scope="module")
def chat_prompt(default_model_dir: Path) -> str:
    tokenizer = AutoTokenizer.from_pretrained(default_model_dir)
    messages = [{"role": "user", "content": "Name the capital of France."}]
    return str(tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True))


def test_health_and_info(live_server: str) -> None:
    assert httpx.get(f"{live_server}/health").status_code == 200
    info = httpx.get(f"{live_server}/info").json()
    assert info["max_total_tokens"] > info["max_input_tokens"] > 0
    assert info["model_id"] == "HuggingFaceTB/SmolLM2-135M-Instruct"


def test_generate_answers_paris(live_server: str, chat_prompt: str) -> None:
    body = {"inputs": chat_prompt, "parameters": {"max_new_tokens": 20, "details": True}}
    response = httpx.post(f"{live_server}/generate", json=body, timeout=120)
    assert response.status_code == 200, response.text
    answer = response.json()
    assert "Paris" in answer["generated_text"]
    assert answer["details"]["finish_reason"] == "eos_token"
    assert int(response.headers["x-generated-tokens"]) == answer["details"]["generated_tokens"]


def _events(text: str) -> list[dict]:
    return [json.loads(line[5:]) for line in text.splitlines() if line.startswith("data:")]


def test_generate_stream_answers_paris(live_server: str, chat_prompt: str) -> None:
    body = {"inputs": chat_prompt, "parameters": {"max_new_tokens": 20}}
    response = httpx.post(f"{live_server}/generate_stream", json=body, timeout=120)
    assert response.status_code == 200
    assert response.headers["content-type"].startswith("text/event-stream")
    events = _events(response.text)
    final = events[-1]
    assert "Paris" in final["generated_text"]
    assert all(e["generated_text"] is None for e in events[:-1])
    assert "".join(e["token"]["text"] for e in events if not e["token"]["special"]).strip() == (
        final["generated_text"].strip()
    )


async def _stream(client: httpx.AsyncClient, url: str, max_new_tokens: int) -> tuple[int, dict]:
    body = {
        "inputs": f"Count to {max_new_tokens}:",
        "parameters": {"max_new_tokens": max_new_tokens, "ignore_eos": True, "details": True},
    }
    tokens = 0
    last: dict = {}
    async with client.stream("POST", f"{url}/generate_stream", json=body) as response:
        assert response.status_code == 200
        async for line in response.aiter_lines():
            if line.startswith("data:"):
                last = json.loads(line[5:])
                tokens += 1
    return tokens, last


def test_concurrent_streams_join_and_leave_the_batch(live_server: str) -> None:
    lengths = [3, 17, 5, 30, 9, 1, 24, 12]

    async def run() -> list[tuple[int, dict]]:
        async with httpx.AsyncClient(timeout=300) as client:
            return await asyncio.gather(*(_stream(client, live_server, n) for n in lengths))

    for n, (tokens, last) in zip(lengths, asyncio.run(run()), strict=True):
        assert tokens == n
        assert last["details"]["generated_tokens"] == n
        assert last["details"]["finish_reason"] == "length"


def test_bad_input_is_422_and_the_server_still_serves(live_server: str) -> None:
    bad = httpx.post(
        f"{live_server}/generate", json={"inputs": "x", "parameters": {"temperature": -1}}
    )
    assert bad.status_code == 422
    assert bad.json()["error_type"] == "validation"
    good = httpx.post(
        f"{live_server}/generate",
        json={"inputs": "Hello", "parameters": {"max_new_tokens": 2}},
        timeout=60,
    )
    assert good.status_code == 200
