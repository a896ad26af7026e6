"""End to end: TGI's routes beyond /generate on the embedded model — `/`, /invocations,
/tokenize, /ping, /metrics, /docs — over real HTTP."""

from __future__ import annotations

import json
from pathlib import Path

import httpx
import pytest
from transformers import AutoTokenizer

pytestmark = pytest.mark.e2e

PROMPT = "The capital of France is"
TIMEOUT_S = 120


def _events(text: str) -> list[dict]:
    return [json.loads(line[5:]) for line in text.splitlines() if line.startswith("data:")]


def test_root_answers_a_list_or_a_stream_with_the_same_greedy_text(live_server: str) -> None:
    parameters = {"max_new_tokens": 8, "details": True, "return_full_text": False}
    response = httpx.post(
        f"{live_server}/", json={"inputs": PROMPT, "parameters": parameters}, timeout=TIMEOUT_S
    )
    assert response.status_code == 200, response.text
    (answer,) = response.json()
    assert answer["details"]["seed"] is None, "greedy requests report no seed"
    assert len(answer["details"]["tokens"]) == answer["details"]["generated_tokens"]
    streamed = httpx.post(
        f"{live_server}/invocations",
        json={"inputs": PROMPT, "parameters": parameters, "stream": True},
        timeout=TIMEOUT_S,
    )
    assert streamed.headers["content-type"].startswith("text/event-stream")
    events = _events(streamed.text)
    assert events[-1]["generated_text"] == answer["generated_text"]
    assert events[-1]["details"]["seed"] is None
    assert [e["token"]["id"] for e in events] == [t["id"] for t in answer["details"]["tokens"]]


def test_root_returns_the_full_text_unless_told_otherwise(live_server: str) -> None:
    body = {"inputs": PROMPT, "parameters": {"max_new_tokens": 2}}
    (answer,) = httpx.post(f"{live_server}/", json=body, timeout=TIMEOUT_S).json()
    assert answer["generated_text"].startswith(PROMPT)


def test_tokenize_matches_the_models_tokenizer(live_server: str, default_model_dir: Path) -> None:
    tokens = httpx.post(f"{live_server}/tokenize", json={"inputs": PROMPT}, timeout=30).json()
    expected = AutoTokenizer.from_pretrained(default_model_dir)(PROMPT)["input_ids"]
    assert [t["id"] for t in tokens] == expected
    assert all(t["text"] == PROMPT[t["start"] : t["stop"]] for t in tokens)
    assert tokens[-1]["stop"] == len(PROMPT)


def test_probes_docs_and_metrics(live_server: str) -> None:
    assert httpx.get(f"{live_server}/ping").status_code == 200
    assert httpx.get(f"{live_server}/").status_code == 200
    spec = httpx.get(f"{live_server}/api-doc/openapi.json").json()
    assert "/generate_stream" in spec["paths"]
    assert "/api-doc/openapi.json" in httpx.get(f"{live_server}/docs").text
    body = {"inputs": PROMPT, "parameters": {"max_new_tokens": 2}}
    assert httpx.post(f"{live_server}/generate", json=body, timeout=TIMEOUT_S).status_code == 200
    metrics = httpx.get(f"{live_server}/metrics").text
    values = {
        line.rsplit(" ", 1)[0]: float(line.rsplit(" ", 1)[1])
        for line in metrics.splitlines()
        if line and not line.startswith("#")
    }
    assert values["tgi_request_success"] >= 1
    assert values['tgi_batch_inference_success{method="prefill"}'] >= 1
    assert values["tgi_request_generated_tokens_count"] >= 1
    # The default model runs paged: its KV cache shows up too.
    assert values["textgate_kv_cache_blocks_free"] > 0
    assert "textgate_prefix_cache_hit_tokens" in values
