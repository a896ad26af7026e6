"""The OpenAI routes end to end: uvicorn -> the router app -> engine -> fake shard.

/v1/completions and /v1/models, and what every route shares: validation errors, shard
errors, limits, cancellation when the client leaves, and metrics. The chat answers
themselves are in test_chat_routes.py.
"""

from __future__ import annotations

import asyncio
from typing import Any

import httpx
import pytest

from textgate.tests.router.fake_shard import FakeShard, FakeTokenizer
from textgate.tests.router.openai.routes_helpers import StartRouter, chat, sse


async def test_a_shard_error_ends_the_stream_with_an_error_then_done(
    client: httpx.AsyncClient, fake: FakeShard
) -> None:
    fake.fail["Step"] = 1
    events = await sse(client, "/v1/chat/completions", chat(max_tokens=5, stream=True))
    assert events[-1] == "[DONE]"
    assert set(events[-2]) == {"error", "error_type"}
    assert events[-2]["error_type"] == "generation"


async def test_a_shard_error_without_stream_is_424(
    client: httpx.AsyncClient, fake: FakeShard
) -> None:
    fake.fail["Step"] = 1
    response = await client.post("/v1/chat/completions", json=chat(max_tokens=5, n=2))
    assert response.status_code == 424
    assert response.json()["error_type"] == "generation"


async def test_completion_with_prompts_n_and_usage(client: httpx.AsyncClient) -> None:
    body = {
        "model": "fake-model",
        "prompt": ["w5", "w20 w21"],
        "max_tokens": 2,
        "n": 2,
        "temperature": 0,
    }
    answer = (await client.post("/v1/completions", json=body)).json()
    assert answer["id"].startswith("cmpl-")
    assert answer["object"] == "text_completion"
    assert [(c["index"], c["text"]) for c in answer["choices"]] == [
        (0, " t6 t7"),
        (1, " t6 t7"),
        (2, " t22 t23"),
        (3, " t22 t23"),
    ]
    assert answer["usage"] == {"prompt_tokens": 3, "completion_tokens": 8, "total_tokens": 11}


async def test_completion_of_token_id_prompts(client: httpx.AsyncClient, fake: FakeShard) -> None:
    # vLLM's (and OpenAI's) token-array prompts, as lm-evaluation-harness sends them.
    body = {"prompt": [[5, 20], [7]], "max_tokens": 1, "echo": True, "temperature": 0}
    answer = (await client.post("/v1/completions", json=body)).json()
    assert [list(r.input_ids) for r in fake.received_requests()] == [[5, 20], [7]]
    texts = [c["text"] for c in answer["choices"]]
    assert texts[0].startswith("w5 w20") and texts[1].startswith("w7")  # echoed, decoded
    assert answer["usage"]["prompt_tokens"] == 3
    single = {"prompt": [5, 20], "max_tokens": 1}
    assert (await client.post("/v1/completions", json=single)).status_code == 200


async def test_completion_defaults_to_16_tokens(client: httpx.AsyncClient) -> None:
    answer = (await client.post("/v1/completions", json={"prompt": "w5"})).json()
    assert answer["usage"]["completion_tokens"] == 16
    assert answer["model"] == "fake-model"


async def test_completion_echo_and_logprobs(client: httpx.AsyncClient) -> None:
    body = {"prompt": "w5 w6", "max_tokens": 2, "echo": True, "logprobs": 1, "temperature": 0}
    choice = (await client.post("/v1/completions", json=body)).json()["choices"][0]
    assert choice["text"] == "w5 w6 t7 t8"
    assert choice["logprobs"] == {
        "tokens": [" t5", " t6", " t7", " t8"],
        "token_logprobs": [None, -1.0, -0.5, -0.5],
        "top_logprobs": [None, {" t6": -1.0}, {" t7": -0.5}, {" t8": -0.5}],
        "text_offset": [0, 3, 6, 9],
    }


async def test_completion_max_tokens_0_with_echo_scores_the_prompt_only(
    client: httpx.AsyncClient,
) -> None:
    body = {"prompt": "w5 w6", "max_tokens": 0, "echo": True, "logprobs": 0, "temperature": 0}
    answer = (await client.post("/v1/completions", json=body)).json()
    (choice,) = answer["choices"]
    assert (choice["text"], choice["finish_reason"]) == ("w5 w6", "length")
    assert choice["logprobs"]["tokens"] == [" t5", " t6"]  # the one generated token is dropped
    assert choice["logprobs"]["token_logprobs"] == [None, -1.0]
    assert answer["usage"] == {"prompt_tokens": 2, "completion_tokens": 0, "total_tokens": 2}


async def test_completion_prompt_logprobs_are_vllms(client: httpx.AsyncClient) -> None:
    body = {"prompt": "w5 w6", "max_tokens": 1, "prompt_logprobs": 0, "temperature": 0}
    choice = (await client.post("/v1/completions", json=body)).json()["choices"][0]
    assert choice["text"] == " t7" and choice["logprobs"] is None
    # The fake shard sends no alternatives: each token has only itself, of unknown rank.
    assert choice["prompt_logprobs"] == [
        None,
        {"6": {"logprob": -1.0, "rank": None, "decoded_token": " t6"}},
    ]
    plain = (await client.post("/v1/completions", json={"prompt": "w5"})).json()
    assert "prompt_logprobs" not in plain["choices"][0]  # only when asked, as vLLM


async def test_completion_best_of_keeps_the_likeliest(
    client: httpx.AsyncClient, fake: FakeShard
) -> None:
    body = {"prompt": "w5", "max_tokens": 1, "best_of": 2, "logprobs": 0}
    choices = (await client.post("/v1/completions", json=body)).json()["choices"]
    assert len(choices) == 1
    candidates = [r.parameters.seed for r in fake.received_requests()]
    assert len(candidates) == 2
    best = max(-((seed % 97) + 1) / 100 for seed in candidates)
    assert choices[0]["logprobs"]["token_logprobs"] == [pytest.approx(best)]


async def test_completion_stream(client: httpx.AsyncClient) -> None:
    body = {
        "prompt": "w5",
        "max_tokens": 3,
        "stream": True,
        "echo": True,
        "stream_options": {"include_usage": True},
    }
    events = await sse(client, "/v1/completions", body)
    assert events[-1] == "[DONE]"
    chunks = events[:-2]
    assert {c["object"] for c in chunks} == {"text_completion"}
    assert "".join(c["choices"][0]["text"] for c in chunks) == "w5 t6 t7 t8"
    assert chunks[-1]["choices"][0]["finish_reason"] == "length"
    assert events[-2]["choices"] == []
    assert events[-2]["usage"]["completion_tokens"] == 3


async def test_models_lists_the_served_model(client: httpx.AsyncClient) -> None:
    body = (await client.get("/v1/models")).json()
    assert body["object"] == "list"
    (card,) = body["data"]
    assert card["id"] == "fake-model"
    assert card["object"] == "model"
    assert card["owned_by"] == "textgate"
    assert isinstance(card["created"], int)


INVALID: list[tuple[str, dict[str, Any], str]] = [
    ("/v1/chat/completions", chat(temperature=-1), "`temperature` must be >= 0"),
    ("/v1/chat/completions", chat(top_p=1.5), "`top_p` must be > 0 and <= 1"),
    ("/v1/chat/completions", chat(max_tokens=0), "`max_tokens` must be >= 1"),
    ("/v1/chat/completions", chat(max_completion_tokens=0), "`max_completion_tokens`"),
    ("/v1/chat/completions", chat(n=3), "`n` must be >= 1 and <= 2"),
    ("/v1/chat/completions", chat(presence_penalty=2.5), "`presence_penalty` must be >= -2.0"),
    ("/v1/chat/completions", chat(logit_bias={"x": 1}), "`logit_bias` keys must be token ids"),
    ("/v1/chat/completions", chat(logit_bias={"5": -101}), "`logit_bias` values must be"),
    ("/v1/chat/completions", chat(top_logprobs=2), "needs `logprobs`"),
    ("/v1/chat/completions", chat(logprobs=True, top_logprobs=9), "`top_logprobs` must"),
    ("/v1/chat/completions", chat(response_format={"type": "json_schema"}), "needs `json_schema`"),
    ("/v1/chat/completions", chat(tools=[{"type": "function"}]), "needs a `name`"),
    ("/v1/chat/completions", chat(tool_choice="required"), "`tool_choice` needs `tools`"),
    ("/v1/chat/completions", chat(stop=["a", "b", "c", "d", "e"]), "up to 4 stop"),
    ("/v1/chat/completions", chat(seed=-1), "`seed` must be"),
    ("/v1/chat/completions", chat(frequency_penalty=3), "`frequency_penalty` must"),
    (
        "/v1/chat/completions",
        chat(" ".join(["w5"] * 70)),
        "`messages` must have less than 64 tokens. Given: 7",
    ),
    ("/v1/chat/completions", chat(" ".join(["w5"] * 70)), "`truncate_prompt_tokens`"),
    ("/v1/chat/completions", chat(" ".join(["w5"] * 70)), "after the chat template"),
    ("/v1/completions", {"prompt": "w5 " * 70}, "`prompt` must have less than 64 tokens"),
    ("/v1/chat/completions", chat(max_tokens=127), "`max_tokens` must be <= 128"),
    (
        "/v1/chat/completions",
        chat(max_completion_tokens=127),
        "`messages` tokens + `max_completion_tokens` must be <= 128",
    ),
    ("/v1/chat/completions", {"messages": []}, "`messages` cannot be empty"),
    ("/v1/chat/completions", {"model": "m"}, "messages: Field required"),
    ("/v1/chat/completions", {"messages": [{"role": "bad"}]}, "template"),
    (
        "/v1/chat/completions",
        {"messages": [{"role": "user", "content": [{"type": "image_url"}]}]},
        "only text",
    ),
    (
        "/v1/chat/completions",
        {"messages": [{"role": "user", "content": "w5"}], "continue_final_message": True},
        "assistant",
    ),
    ("/v1/completions", {"prompt": ""}, "`prompt` cannot be empty"),
    ("/v1/completions", {"prompt": [5, 1000]}, "`prompt` token id 1000 is not in the vocabulary"),
    ("/v1/completions", {"prompt": [[5], []]}, "`prompt` cannot be empty"),
    ("/v1/completions", {"prompt": [5, "w6"]}, "prompt"),
    ("/v1/completions", {"prompt": ["w5"] * 5}, "at most 4 prompts"),
    ("/v1/completions", {"prompt": "w5", "n": 2, "best_of": 1}, "`best_of` must be >= `n`"),
    ("/v1/completions", {"prompt": "w5", "best_of": 3}, "`best_of` must be <= 2"),
    ("/v1/completions", {"prompt": "w5", "best_of": 2, "stream": True}, "streaming"),
    ("/v1/completions", {"prompt": "w5", "logprobs": 6}, "`logprobs` must be"),
    ("/v1/completions", {"prompt": "w5", "suffix": "x"}, "`suffix` is not"),
    (
        "/v1/completions",
        {"prompt": "w5", "echo": True, "logprobs": 1, "stream": True},
        "`echo` with `logprobs`",
    ),
    ("/v1/completions", {"prompt": "w5", "max_tokens": 0}, "0 only with `echo`"),
    (
        "/v1/completions",
        {"prompt": "w5", "max_tokens": 0, "echo": True, "stream": True},
        "`max_tokens` 0 is not supported when streaming",
    ),
    ("/v1/completions", {"prompt": "w5", "prompt_logprobs": 6}, "`prompt_logprobs` must be"),
    (
        "/v1/completions",
        {"prompt": "w5", "prompt_logprobs": 1, "stream": True},
        "`prompt_logprobs` is not supported when streaming",
    ),
    ("/chat_tokenize", {"messages": []}, "`messages` cannot be empty"),
]


async def test_invalid_requests_are_422(client: httpx.AsyncClient) -> None:
    # One server for all cases: each answers before reaching the shard.
    failures = []
    for path, body, message in INVALID:
        response = await client.post(path, json=body)
        error = response.json()
        if (
            response.status_code != 422
            or error.get("error_type") != "validation"
            or message not in error_message(path, error)
        ):
            failures.append((path, body, response.status_code, response.text[:200]))
    assert not failures


def error_message(path: str, body: dict[str, Any]) -> str:
    """The message of an error body: OpenAI's shape on /v1/..., TGI's elsewhere."""
    error = body.get("error")
    if path.startswith("/v1/"):
        assert isinstance(error, dict), body
        assert set(error) == {"message", "type", "param", "code"}, body
        return str(error["message"])
    assert isinstance(error, str), body
    return error


async def test_malformed_json_is_422(client: httpx.AsyncClient) -> None:
    response = await client.post("/v1/chat/completions", content=b"{not json")
    assert response.status_code == 422
    assert response.json()["error_type"] == "validation"


async def test_a_model_without_chat_template_is_422(start_openai: StartRouter) -> None:
    async with httpx.AsyncClient(base_url=await start_openai(FakeTokenizer())) as http:
        response = await http.post("/v1/chat/completions", json=chat())
        assert response.status_code == 422
        assert "no chat template" in response.json()["error"]["message"]
        completion = await http.post("/v1/completions", json={"prompt": "w5", "max_tokens": 1})
        assert completion.status_code == 200


async def test_over_max_concurrent_requests_is_429(start_openai: StartRouter) -> None:
    async with httpx.AsyncClient(base_url=await start_openai(max_concurrent_requests=1)) as http:
        response = await http.post("/v1/chat/completions", json=chat(n=2, max_tokens=1))
        assert response.status_code == 429
        assert response.json() == {
            "error": {
                "message": "Model is overloaded",
                "type": "rate_limit_error",
                "param": None,
                "code": None,
            },
            "error_type": "overloaded",
        }
        stream = await http.post("/v1/completions", json={"prompt": ["w5", "w6"], "stream": True})
        assert stream.status_code == 429


async def test_bodies_over_the_payload_limit_are_413(start_openai: StartRouter) -> None:
    async with httpx.AsyncClient(base_url=await start_openai(payload_limit=100)) as http:
        response = await http.post("/v1/chat/completions", json=chat("w5 " * 100))
        assert response.status_code == 413
        assert response.json()["error_type"] == "payload_too_large"


def dropped_from_shard(fake: FakeShard) -> bool:
    """The shard received requests and holds none of them any more."""
    return bool(fake.received_requests()) and not fake.held_request_ids()


async def test_a_client_leaving_a_stream_cancels_every_choice(
    client: httpx.AsyncClient, fake: FakeShard
) -> None:
    fake.step_delay_s = 0.01
    body = chat(max_tokens=100, stream=True, n=2)
    async with client.stream("POST", "/v1/chat/completions", json=body) as response:
        async for line in response.aiter_lines():
            if '"content":" t' in line:
                break
    for _ in range(200):
        if dropped_from_shard(fake):
            break
        await asyncio.sleep(0.01)
    assert dropped_from_shard(fake)
    assert len(fake.calls_to("Step")) < 50


async def test_a_client_leaving_a_completion_cancels_it(
    client: httpx.AsyncClient, fake: FakeShard
) -> None:
    fake.step_delay_s = 0.01
    with pytest.raises(httpx.ReadTimeout):
        await client.post("/v1/completions", json={"prompt": "w5", "max_tokens": 100}, timeout=0.2)
    for _ in range(200):
        if dropped_from_shard(fake):
            break
        await asyncio.sleep(0.01)
    assert dropped_from_shard(fake)
    assert len(fake.calls_to("Step")) < 50


async def test_requests_are_counted_in_tgi_metrics(
    start_openai: StartRouter, fake: FakeShard
) -> None:
    async with httpx.AsyncClient(base_url=await start_openai()) as http:
        await http.post("/v1/chat/completions", json=chat(max_tokens=2))
        await sse(http, "/v1/completions", {"prompt": "w5", "max_tokens": 2, "stream": True})
        await http.post("/v1/chat/completions", json=chat(temperature=-1))
        fake.fail["Step"] = 1
        await sse(http, "/v1/chat/completions", chat(max_tokens=3, stream=True))
        metrics = (await http.get("/metrics")).text
    assert "tgi_request_count 4.0" in metrics
    assert "tgi_request_success 2.0" in metrics
    assert 'tgi_request_failure{err="validation"} 1.0' in metrics
    assert 'tgi_request_failure{err="generation"} 1.0' in metrics


async def test_truncate_prompt_tokens_keeps_the_last_tokens(client: httpx.AsyncClient) -> None:
    long = chat(" ".join(["w5"] * 70), max_tokens=2, temperature=0)
    assert (await client.post("/v1/chat/completions", json=long)).status_code == 422
    response = await client.post(
        "/v1/chat/completions", json={**long, "truncate_prompt_tokens": 10}
    )
    assert response.status_code == 200, response.text
    assert response.json()["usage"]["prompt_tokens"] == 10


async def test_an_unknown_model_is_openais_404(client: httpx.AsyncClient) -> None:
    response = await client.post("/v1/chat/completions", json={**chat(), "model": "gpt-4o"})
    assert response.status_code == 404
    error = response.json()["error"]
    assert error["code"] == "model_not_found" and error["type"] == "invalid_request_error"
    assert "`gpt-4o` does not exist" in error["message"] and "fake-model" in error["message"]
    for name in ("fake-model", "tgi", ""):
        answer = await client.post(
            "/v1/completions", json={"model": name, "prompt": "w5", "max_tokens": 1}
        )
        assert answer.status_code == 200, answer.text
        assert answer.json()["model"] == "fake-model"
