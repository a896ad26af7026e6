"""End to end: scoring a prompt on the default model, as evaluation harnesses do.

vLLM's `prompt_logprobs` and `max_tokens: 0` prompt scoring on /v1/completions give the
TGI route's `decoder_input_details` numbers; vLLM's /tokenize and /detokenize agree with
TGI's /tokenize on the same path.
"""

from __future__ import annotations

import httpx
import pytest

pytestmark = pytest.mark.e2e

PROMPT = "The capital of France is Paris, and the capital of Italy is Rome."


def test_prompt_logprobs_are_decoder_input_details(live_server: str) -> None:
    tgi_body = {"inputs": PROMPT, "parameters": {"max_new_tokens": 1, "details": True}}
    tgi_body["parameters"]["decoder_input_details"] = True
    prefill = httpx.post(f"{live_server}/generate", json=tgi_body, timeout=120).json()
    prefill = prefill["details"]["prefill"]
    body = {"prompt": PROMPT, "max_tokens": 0, "echo": True, "logprobs": 2, "prompt_logprobs": 3}
    answer = httpx.post(f"{live_server}/v1/completions", json=body, timeout=120).json()
    (choice,) = answer["choices"]
    assert (choice["text"], choice["finish_reason"]) == (PROMPT, "length")
    assert answer["usage"]["completion_tokens"] == 0
    scores = choice["prompt_logprobs"]
    assert len(scores) == len(prefill) and scores[0] is None
    for token, position in zip(prefill[1:], scores[1:], strict=True):
        assert next(iter(position)) == str(token["id"])  # the prompt token first
        mine = position[str(token["id"])]
        assert mine["logprob"] == pytest.approx(token["logprob"], abs=1e-5)
        ranked = sorted((e for e in position.values() if e["rank"]), key=lambda e: e["rank"])
        assert [e["rank"] for e in ranked] == [1, 2, 3]  # the 3 likeliest
        assert [e["logprob"] for e in ranked] == sorted(
            (e["logprob"] for e in ranked), reverse=True
        )
        assert mine["logprob"] <= ranked[0]["logprob"] + 1e-6
    # The legacy logprobs of the echoed prompt are the same numbers.
    assert choice["logprobs"]["token_logprobs"][1:] == pytest.approx(
        [t["logprob"] for t in prefill[1:]], abs=1e-5
    )


def test_vllm_and_tgi_tokenize_agree(live_server: str) -> None:
    tgi = httpx.post(f"{live_server}/tokenize", json={"inputs": PROMPT}).json()
    vllm = httpx.post(f"{live_server}/tokenize", json={"prompt": PROMPT}).json()
    assert vllm["tokens"] == [t["id"] for t in tgi]
    assert vllm["count"] == len(tgi) and vllm["max_model_len"] > vllm["count"]
    back = httpx.post(f"{live_server}/detokenize", json={"tokens": vllm["tokens"]}).json()
    assert back == {"prompt": PROMPT}
    chat = {"messages": [{"role": "user", "content": "Hi"}], "return_token_strs": True}
    templated = httpx.post(f"{live_server}/tokenize", json=chat).json()
    assert "<|im_start|>" in templated["token_strs"] and templated["count"] > 3
